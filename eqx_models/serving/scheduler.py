"""Which tokens of which requests the engine computes in a step.

The scheduler knows requests only by their tokens and pages (`ScheduledSequence`):
it runs no model, so it is tested alone. Each `schedule()` call reads the waiting
and running sequences and the free pages and returns a `StepPlan`: the sequences
that decode one token, the prompt chunks to compute, and the sequences it
preempted to make room. After the model has run, `computed` records the new
tokens (and names newly filled pages in the prefix cache); `finish` hands a
sequence's pages back.

Policy, first come first served:

- every running sequence whose prompt is cached decodes a token; when a page is
  missing for one, the latest admitted running sequence is preempted (its pages
  freed, its tokens recomputed when it is admitted again, from the front of the
  line) until the page is found;
- the rest of the token budget goes to prompt chunks: first the running
  sequences whose prompt is not all cached, then waiting ones, admitted while
  fewer than `max_num_seqs` run; a newcomer leaves a page per running sequence
  free, so that admitting it does not at once preempt the others;
- with prefix caching, an admitted sequence starts from the cached pages its
  tokens begin with (never its last token, whose logits are needed): only the
  rest is computed. A waiting sequence whose next page a running one is computing
  (the `n` choices of one prompt) waits for it instead of computing it again.
"""

import collections
import dataclasses
import logging
import math

from .pages import PageAllocator, PageKey, page_keys

logger = logging.getLogger("eqx_models.serving")


@dataclasses.dataclass(eq=False)  # compared and hashed by identity
class ScheduledSequence:
    """What the scheduler knows of a request: its tokens and where they are cached.

    `cached` tokens have their keys and values in `pages` (page `i` holds tokens
    `i * page_size` to `(i + 1) * page_size - 1`). `reuse_prefix` False makes the
    sequence compute every token (a request for the prompt's log-probabilities).
    """

    id: str
    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0
    state_slot: int | None = None  # its slot in the recurrent-state pool, while running
    reuse_prefix: bool = True
    page_keys: list[PageKey] = dataclasses.field(default_factory=list)  # of its full pages, as far as known
    registered: int = 0  # of its pages, how many are named in the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uncached(self) -> int:
        return self.num_tokens - self.cached

    def token_range(self, start: int, stop: int) -> list[int]:
        """`tokens[start:stop]` without copying the whole sequence (a decode step needs one)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(start - prompt, 0) : max(stop - prompt, 0)]


@dataclasses.dataclass
class StepPlan:
    """One step's work: `decode` rows compute their one uncached token, each
    `(sequence, length)` of `prefill` the `length` tokens after its cached ones;
    `preempted` lost their pages and wait again."""

    decode: list[ScheduledSequence] = dataclasses.field(default_factory=list)
    prefill: list[tuple[ScheduledSequence, int]] = dataclasses.field(default_factory=list)
    preempted: list[ScheduledSequence] = dataclasses.field(default_factory=list)

    @property
    def scheduled_tokens(self) -> int:
        return len(self.decode) + sum(length for _, length in self.prefill)


class Scheduler:
    """Continuous batching over a pool of KV pages (the policy is in the module's
    docstring).

    Args:
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens one step computes.
        page_size: tokens per page.
        num_pages: pages in the pool.
        state_slots: slots in a recurrent-state pool (one per running sequence),
            or None for a model without one.
        prefix_caching: share full pages between sequences whose tokens begin the
            same way. Off for a model with a recurrent state, whose state after a
            prefix is not kept.
        chunk_granularity: a prompt chunk of more than one token costs its length
            rounded up to a multiple of this (the engine's ragged step lays chunks
            out in whole blocks).
    """

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int, num_pages: int,
                 state_slots: int | None = None, prefix_caching: bool = True, chunk_granularity: int = 1):
        self.max_num_seqs = max_num_seqs
        self.chunk_granularity = chunk_granularity
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, prefix_caching and state_slots is None)
        self._state_slots = None if state_slots is None else list(range(state_slots))
        self.waiting: collections.deque[ScheduledSequence] = collections.deque()
        self.running: list[ScheduledSequence] = []
        self.prefix_queries = 0  # tokens of admitted sequences that could have come from the cache
        self.prefix_hits = 0  # of those, the tokens that did

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    def add(self, sequence: ScheduledSequence) -> None:
        self.waiting.append(sequence)

    def schedule(self) -> StepPlan:
        """The next step's plan (admitting, growing and preempting sequences as it goes)."""
        plan = StepPlan()
        plan.decode = self._reserve_decode_pages(plan.preempted)
        plan.prefill = self._schedule_prefill(self.max_num_batched_tokens - len(plan.decode))
        if not plan.decode and not plan.prefill and self.running:
            # Nothing fits: every running sequence waits for pages another holds.
            self._preempt(self.running[-1], plan.preempted)
        return plan

    def computed(self, sequence: ScheduledSequence, tokens: int) -> None:
        """Records that the model cached `tokens` more of the sequence's tokens."""
        sequence.cached += tokens
        full = sequence.cached // self.page_size
        if self.prefix_caching and full > sequence.registered:
            keys = self._keys(sequence, full)
            for page in range(sequence.registered, full):
                self.allocator.register(sequence.pages[page], keys[page])
            sequence.registered = full

    def preempt_all(self) -> list[ScheduledSequence]:
        """Sends every running sequence back to wait, first in line and in the order
        they ran, to be recomputed from its tokens (after the KV pages were lost)."""
        preempted: list[ScheduledSequence] = []
        for sequence in reversed(list(self.running)):
            self._preempt(sequence, preempted)
        return preempted[::-1]

    def finish(self, sequence: ScheduledSequence) -> None:
        """Takes a sequence out (done or aborted) and gives its pages back."""
        self._give_back_pages(sequence)
        self._release_state_slot(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence in self.waiting:
            self.waiting.remove(sequence)

    # ------------------------------------------------------------------ policy

    def _pages_for(self, sequence: ScheduledSequence, tokens: int) -> bool:
        """Gives `sequence` pages for its first `tokens` tokens; False if the pool is short."""
        missing = math.ceil(tokens / self.page_size) - len(sequence.pages)
        if missing <= 0:
            return True
        pages = self.allocator.allocate(missing)
        if pages is None:
            return False
        sequence.pages += pages
        return True

    def _reserve_decode_pages(self, preempted: list[ScheduledSequence]) -> list[ScheduledSequence]:
        rows = []
        for sequence in list(self.running):
            if sequence not in self.running or sequence.uncached != 1:
                continue
            while not self._pages_for(sequence, sequence.cached + 1):
                victim = self.running[-1]  # the latest admitted gives way
                self._preempt(victim, preempted)
                if victim is sequence:
                    break
            if sequence in self.running:
                rows.append(sequence)
        return [s for s in rows if s in self.running]

    def _schedule_prefill(self, budget: int) -> list[tuple[ScheduledSequence, int]]:
        chunks = []
        candidates = [s for s in self.running if s.uncached > 1]
        while budget > 0:
            if candidates:
                sequence = candidates.pop(0)
            elif self.waiting and len(self.running) < self.max_num_seqs:
                sequence = self.waiting[0]
                self._match_prefix(sequence)
                if self._next_page_in_flight(sequence):  # waits a step and takes it from the cache
                    self._give_back_pages(sequence)
                    break
            else:
                break
            length = min(sequence.uncached, budget)
            spare = 0 if sequence in self.running else len(self.running)
            available = (len(sequence.pages) + self.allocator.free - spare) * self.page_size - sequence.cached
            length = min(length, available)
            if length <= 0:
                if sequence not in self.running:  # stays waiting: its cached pages go back
                    self._give_back_pages(sequence)
                break
            if length < sequence.uncached and length > self.chunk_granularity:
                length -= length % self.chunk_granularity  # cut short: whole blocks, no padding
            self._pages_for(sequence, sequence.cached + length)
            if sequence not in self.running:
                self.waiting.popleft()
                self.running.append(sequence)
                if self._state_slots is not None:
                    sequence.state_slot = self._state_slots.pop()
                if self.prefix_caching and sequence.reuse_prefix:
                    self.prefix_queries += sequence.num_tokens
                    self.prefix_hits += sequence.cached
            chunks.append((sequence, length))
            budget -= self._cost(length) if length > 1 else 1
        return chunks

    def _cost(self, tokens: int) -> int:
        """`tokens` rounded up to the chunk granularity."""
        return -(-tokens // self.chunk_granularity) * self.chunk_granularity

    def _match_prefix(self, sequence: ScheduledSequence) -> None:
        """Starts a sequence with no pages from the cached pages its tokens begin
        with (all but its last token's: that one is computed for its logits)."""
        if not (self.prefix_caching and sequence.reuse_prefix) or sequence.pages:
            return
        reusable = (sequence.num_tokens - 1) // self.page_size
        pages = self.allocator.match(self._keys(sequence, reusable))
        sequence.pages, sequence.cached, sequence.registered = pages, len(pages) * self.page_size, len(pages)

    def _next_page_in_flight(self, sequence: ScheduledSequence) -> bool:
        """Whether a running sequence is computing the page of the same tokens that
        `sequence` would compute first (as the `n` choices of one prompt do)."""
        if not (self.prefix_caching and sequence.reuse_prefix):
            return False
        page = sequence.cached // self.page_size
        if page >= (sequence.num_tokens - 1) // self.page_size:
            return False
        key = self._keys(sequence, page + 1)[page]
        for other in self.running:
            if other.registered <= page < other.num_tokens // self.page_size:
                if self._keys(other, page + 1)[page] == key:
                    return True
        return False

    def _keys(self, sequence: ScheduledSequence, count: int) -> list[PageKey]:
        """The keys of the sequence's first `count` full pages (computed once)."""
        known = len(sequence.page_keys)
        if count > known:
            tokens = sequence.token_range(known * self.page_size, count * self.page_size)
            parent = sequence.page_keys[-1] if known else b""
            sequence.page_keys += page_keys(tokens, self.page_size, parent)
        return sequence.page_keys[:count]

    def _give_back_pages(self, sequence: ScheduledSequence) -> None:
        """Gives a sequence's pages back and forgets what it had cached."""
        self.allocator.release(sequence.pages)
        sequence.pages, sequence.cached, sequence.registered = [], 0, 0

    def _preempt(self, sequence: ScheduledSequence, preempted: list[ScheduledSequence]) -> None:
        """Frees a running sequence's pages; it waits (first in line) to be recomputed."""
        logger.info("preempting %s (%d tokens) to free %d pages", sequence.id, sequence.num_tokens, len(sequence.pages))
        self._give_back_pages(sequence)
        self._release_state_slot(sequence)
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)
        preempted.append(sequence)

    def _release_state_slot(self, sequence: ScheduledSequence) -> None:
        if sequence.state_slot is not None:
            self._state_slots.append(sequence.state_slot)
            sequence.state_slot = None
