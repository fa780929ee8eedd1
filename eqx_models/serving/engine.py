"""The serving engine: continuous batching over a paged KV cache.

Each `step()` asks the `Scheduler` for a plan (which prompt chunks to compute,
which sequences decode a token; it admits and preempts), runs the model on it,
and turns the sampled tokens into text, stops and log-probabilities. Where the
backend prefers it (accelerators), a step with prompt chunks is one ragged call
(`RaggedPagedKVCache`: every row's new tokens flattened into one row, each
attending to its own pages, nothing padded to the longest chunk); elsewhere, and
for a family with a recurrent state, one call per chunk-length bucket and one
for the decodes. A step of decodes alone is one call of one token per row
(`PagedKVCache`, the decode kernel's shape). Shapes are bucketed (powers of two
for the token count, up to the step's budget, the batch and the block-table
width), so the number of compilations is bounded whatever the traffic.
"""

import collections
import dataclasses
import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..cache import resolve_cache_dtype
from ..device_memory import OutOfDeviceMemory, free_bytes, gib, refuse_unless_fits
from ..nn.causal_lm import CausalLM
from ..backends import active_backend
from ..backends.xla import QUERY_BLOCK
from ..paged_cache import PagedKVCache, RaggedPagedKVCache
from ..tokenizer import StreamDecoder, Tokenizer
from .scheduler import ScheduledSequence, Scheduler
from .structured import GrammarCompiler, Matcher, StructuredOutput
from .sampling import SamplingParams, sample_rows, token_logprobs

logger = logging.getLogger("eqx_models.serving")

MIN_CHUNK_BUCKET = 16
# Prompt tokens the detokeniser keeps as context before the output (enough for a
# SentencePiece leading space or a character split across tokens).
DETOKENIZE_CONTEXT = 8
DEFAULT_KV_CACHE_BYTES = 1 << 30
# The share of an accelerator's memory the engine fills (weights, a step's
# temporaries and the page pool), as vLLM's `--gpu-memory-utilization`.
DEFAULT_MEMORY_UTILIZATION = 0.9


def _bucket(n: int, smallest: int = 1) -> int:
    return max(smallest, 1 << max(n - 1, 0).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_arrays(batch: int, width: int) -> dict[str, np.ndarray]:
    """The per-row host arrays every call takes, for padding rows: block tables,
    cached counts and the sampling settings."""
    return dict(
        tables=np.zeros((batch, width), np.int32), positions=np.zeros(batch, np.int32),
        seeds=np.zeros(batch, np.int32), counters=np.zeros(batch, np.int32),
        temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32), top_p=np.ones(batch, np.float32),
    )


@dataclasses.dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class SequenceUpdate:
    """What a step produced for one request: new tokens and the text they completed.

    `text` is new text only (it never ends inside a multi-byte character or
    inside a possible stop string); `finish_reason` is None while running, then
    "stop", "length" or "abort". A request the engine failed (rather than one
    aborted by its client) finishes with "abort" and says why in `error`.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None


@dataclasses.dataclass(eq=False, kw_only=True)  # compared and hashed by identity
class _Sequence(ScheduledSequence):
    params: SamplingParams
    seed: int
    on_update: Callable[[SequenceUpdate], None] | None
    prompt_logprobs: bool
    decoder: StreamDecoder
    matcher: Matcher | None = None  # a structured output's place in its grammar
    text: str = ""  # all output text so far (stop strings cut off)
    sent: int = 0  # characters of `text` already handed out
    pending_ids: list[int] = dataclasses.field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_entries: list[TokenLogprobs | None] | None = None
    prompt_entries_sent: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine failed it
    suspect: int | None = None  # the failed model call it was in with others, until its culprit is found


@dataclasses.dataclass
class CompletionOutput:
    """The whole result of one request from `Engine.generate`."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs | None] | None
    error: str | None = None  # with finish_reason "abort": why the engine failed it


class _PoolsLost(Exception):
    """A failed model call had taken the KV pools: the step ends there."""


class Engine:
    """Runs many requests at once through one model with a shared paged KV cache.

    Args:
        model: a `CausalLM`.
        tokenizer: its `Tokenizer` (for stop strings, EOS and the text of outputs).
        max_model_len: most tokens (prompt + output) of one sequence; defaults to
            the model's `max_position_embeddings`.
        max_num_seqs: most sequences running at once (the decode batch).
        max_num_batched_tokens: most tokens one step computes (prompt chunks plus
            one per decoding sequence); longer prompts are prefilled in chunks.
        page_size: tokens per KV page.
        num_pages: pages in the pool; or give `kv_cache_memory` (bytes) instead,
            which also holds a hybrid model's recurrent-state pool (one state per
            running sequence, plus one); or `memory_utilization`. Default: on an
            accelerator (a device that reports its memory), `memory_utilization`
            0.9; elsewhere a pool of `DEFAULT_KV_CACHE_BYTES`, or less if that is
            more than `max_num_seqs` full-length sequences need.
        memory_utilization: the fraction of the accelerator's memory the engine
            may fill: the pool gets what is left of it after what the device
            already holds (the weights) and the largest step's temporaries (its
            compiled program's, measured). Refused where that cannot hold one
            sequence of `max_model_len` tokens, or where the device reports no
            memory (the CPU: give `kv_cache_memory`).
        kv_cache_dtype: the pages' dtype (default: the model's); `"int8"` keeps a
            float32 scale per token and head and fits about twice the tokens of
            bfloat16 in the same memory.
        prefix_caching: keep full pages for reuse, so that a request whose tokens
            begin like an earlier one's skips computing that part (see
            `Scheduler`); off for a model with a recurrent state.
        ragged_steps: run a step's prompt chunks and decodes as one ragged batch
            (True) or one call per chunk length and one for the decodes (False);
            default: the backend's choice (ragged on accelerators, not yet on
            the CPU), and by chunk length for a model with a recurrent state
            (which refuses True).
        seed: seeds the requests that do not bring their own.

    A failure while serving one request ends that request alone (finish_reason
    "abort", with an `error`): its inputs, its text, stops, grammar and
    log-probabilities, and a model call it ran in alone. When a model call of
    several requests fails, each of them runs alone from then on until the one at
    fault is found; if the call had taken the KV pools, every running request is
    recomputed from its tokens, as after preemption. So the other requests finish
    with the outputs they would have had without it.
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory: int | None = None,
        memory_utilization: float | None = None,
        kv_cache_dtype=None,
        prefix_caching: bool = True,
        ragged_steps: bool | None = None,
        seed: int = 0,
    ):
        config = model.config
        kv_cache_dtype = resolve_cache_dtype(kv_cache_dtype or model.dtype)
        limit = config.max_position_embeddings
        self.max_model_len = max_model_len or limit
        if not 0 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be between 1 and the model's max_position_embeddings ({limit}), "
                f"got {max_model_len}."
            )
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("page_size", page_size)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                f"({max_num_seqs}): every running sequence decodes one token per step."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.pages_per_seq = math.ceil(self.max_model_len / page_size)
        layout = config.cache_layout()
        row_bytes = (layout.key_dim + layout.value_dim) * kv_cache_dtype.itemsize
        if kv_cache_dtype == jnp.int8:  # a float32 scale per key row and per value row
            row_bytes += 4 * (bool(layout.key_dim) + bool(layout.value_dim))
        page_bytes = config.num_blocks * layout.kv_heads * page_size * row_bytes
        # What one device holds of a page: on a mesh the pools split by key/value heads.
        device_page_bytes = page_bytes
        if model.placement is not None:
            shape = (config.num_blocks, 1, layout.kv_heads, page_size, max(layout.key_dim, 1))
            held = model.placement.sharding(PagedKVCache.pool_axes(), shape).shard_shape(shape)
            device_page_bytes = page_bytes * math.prod(held) // math.prod(shape)
        # A model with a recurrent state gets one slot per running sequence, and a
        # scratch slot (number max_num_seqs) for the rows that pad a call. Its shape
        # only: the state itself is made once, with the pools.
        state_shape = jax.eval_shape(lambda: config.recurrent_state(max_num_seqs + 1, model.dtype))
        self._has_state = state_shape is not None
        # A step's prompt chunks and decodes run as one ragged call where the
        # backend prefers it; a recurrent state (updated token by token per row)
        # keeps the calls by chunk length.
        if ragged_steps and self._has_state:
            raise ValueError("ragged_steps=True: a model with a recurrent state (Qwen3-Next) steps by chunk length; "
                             "leave ragged_steps unset or False.")
        if ragged_steps is None:
            ragged_steps = active_backend().prefers_ragged_steps() and not self._has_state
        self._ragged = ragged_steps
        state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state_shape))
        if sum(size is not None for size in (num_pages, kv_cache_memory, memory_utilization)) > 1:
            raise ValueError("Give one of num_pages, kv_cache_memory and memory_utilization, not several.")
        if memory_utilization is not None and not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization is a fraction of the device's memory, in (0, 1]; got "
                             f"{memory_utilization}.")
        self.trace_counts: collections.Counter = collections.Counter()
        params, static = eqx.partition(model, eqx.is_array)
        self._params = params
        self._forward = self._jitted_forward(static, self.trace_counts)
        self.kv_cache_dtype = kv_cache_dtype
        self._layout = layout
        if num_pages is None and kv_cache_memory is None:
            reported = free_bytes(model.devices())
            if reported is not None:
                num_pages = self._pages_in_memory(reported, memory_utilization or DEFAULT_MEMORY_UTILIZATION, static,
                                                  device_page_bytes, state_bytes)
            elif memory_utilization is not None:
                raise ValueError(
                    f"memory_utilization sizes the pool from an accelerator's memory, and {model.devices()} report "
                    "none: give kv_cache_memory (bytes) or num_pages."
                )
            else:
                kv_cache_memory = min(DEFAULT_KV_CACHE_BYTES, max_num_seqs * self.pages_per_seq * page_bytes)
                kv_cache_memory += state_bytes
        if num_pages is None:
            # The budget holds the pages and the recurrent-state pool together.
            num_pages = int((kv_cache_memory - state_bytes) // page_bytes)
            if num_pages < 1:
                state = f" after the recurrent state of {max_num_seqs} + 1 sequences ({state_bytes} bytes)"
                raise ValueError(
                    f"kv_cache_memory={kv_cache_memory} bytes holds no page ({page_bytes} bytes each)"
                    f"{state if state_bytes else ''}; give more{' or lower max_num_seqs' if state_bytes else ''}."
                )
        self.scheduler = Scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
            num_pages=num_pages, state_slots=max_num_seqs if self._has_state else None, prefix_caching=prefix_caching,
            chunk_granularity=QUERY_BLOCK if self._ragged else 1,
        )
        self._num_pages = num_pages
        pool_bytes = num_pages * device_page_bytes + state_bytes  # on each device
        fitting = free_bytes(model.devices())
        fitting = None if fitting is None else int((fitting[0] - state_bytes) // device_page_bytes)
        refuse_unless_fits(
            f"The serving engine's KV cache ({num_pages} pages of {page_size} tokens, {kv_cache_dtype.name})",
            pool_bytes, model.devices(),
            [f"num_pages={fitting} ({fitting * page_size} tokens)" if fitting and fitting > 0 else
             "no page at all: free device memory first"] + ([] if kv_cache_dtype == jnp.int8 else ["kv_cache_dtype='int8'"]),
        )
        self.pools = self._empty_pools()
        eos = tokenizer.eos_token_ids or config.eos_token_id
        self.eos_token_ids = frozenset(int(i) for i in eos)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog: list = []  # taken from the inbox while idle, handled first
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._incidents = itertools.count()  # model calls of several requests that failed
        self._failed: list[_Sequence] = []  # in this step
        self._grammars: GrammarCompiler | None = None  # made on the first structured request
        self._grammars_refused: str | None = None  # why this vocabulary cannot take grammars, once known
        self._grammars_lock = threading.Lock()  # requests come from the server's threads and the engine's
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MB), %d tokens in all; recurrent state %.1f MB; "
            "max_model_len %d, max_num_seqs %d",
            num_pages, page_size, num_pages * page_bytes / 1e6, num_pages * page_size, state_bytes / 1e6,
            self.max_model_len, max_num_seqs,
        )

    def _empty_pools(self, num_pages: int | None = None) -> tuple:
        """The key and value pools (of `num_pages`, default the engine's), their
        scales (int8) or None, and the recurrent-state pool (or None)."""
        # Committed to a device like the step's outputs that replace them: jit keys
        # its compiled code on that too, and would otherwise compile every shape twice.
        layout, config = self._layout, self.model.config
        pools = PagedKVCache.empty_pool(
            config.num_blocks, num_pages or self._num_pages, layout.kv_heads, self.page_size, layout.key_dim,
            dtype=self.kv_cache_dtype, value_dim=layout.value_dim,
        )
        state = None
        if self._has_state:
            state = config.recurrent_state(self.max_num_seqs + 1, self.model.dtype)
        return jax.device_put((*pools, state), self._pool_placements((*pools, state)))

    def _pool_placements(self, pools: tuple):
        """Where the pools go: the model's device, or on the model's mesh split as the
        sharding rules split a paged cache (by key/value heads, never by pages), the
        recurrent state whole on every device."""
        placement = self.model.placement
        if placement is None:
            return jax.devices()[0]
        *pages, state = pools
        whole = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
        split = lambda pool: placement.sharding(PagedKVCache.pool_axes()[: pool.ndim], pool.shape)
        return (*(None if pool is None else split(pool) for pool in pages),
                None if state is None else jax.tree.map(lambda _: whole, state))

    def _pages_in_memory(self, reported, utilization: float, static, page_bytes: int, state_bytes: int) -> int:
        """The pages that fit in `utilization` of the device's memory, after what it
        holds now and the temporaries of the largest step (measured on its
        compiled program, with a pool of just over one sequence's pages); refuses a
        pool that cannot hold one sequence of `max_model_len` tokens. `page_bytes`:
        what one device holds of a page."""
        available, limit, device = reported
        in_use = limit - available
        pools = jax.eval_shape(lambda: self._empty_pools(self.pages_per_seq + 1))
        width = min(self.pages_per_seq, _bucket(self.pages_per_seq))
        if self._ragged:
            inputs = self._ragged_inputs([], _bucket(self.max_num_seqs), width, [],
                                         tokens=_round_up(self.max_num_batched_tokens, QUERY_BLOCK) + 2 * QUERY_BLOCK)
        else:
            rows, length = self._largest_chunk_call()
            inputs = self._inputs([], rows, width, [length])
        probe = self._jitted_forward(static, collections.Counter())
        compiled = probe.lower(self._params, pools, inputs, sampled=True, filters=True, masked=False, logprobs=True,
                               all_logits=True).compile()
        step = compiled.memory_analysis().temp_size_in_bytes
        budget = int(utilization * limit) - in_use - step - state_bytes
        num_pages = max(budget // page_bytes, 0)
        if num_pages < self.pages_per_seq:
            needed = self.pages_per_seq * page_bytes + state_bytes + step + in_use
            raise OutOfDeviceMemory(
                f"The serving engine's page pool, at memory_utilization={utilization} of {device}'s {gib(limit)}, "
                f"holds {num_pages} pages of {self.page_size} tokens: less than one sequence of max_model_len="
                f"{self.max_model_len} tokens ({self.pages_per_seq} pages, {gib(self.pages_per_seq * page_bytes)}), "
                f"after {gib(in_use)} the device holds (weights, other arrays) and {gib(step)} for the largest "
                f"step's temporaries. It needs memory_utilization >= {needed / limit:.2f}, or a lower "
                "max_model_len, max_num_batched_tokens or max_num_seqs, "
                + ("int8 pages (kv_cache_dtype='int8') or " if self.kv_cache_dtype != jnp.int8 else "")
                + "int8 weights (quantize='int8')."
            )
        logger.info("page pool: %d pages (%s) in %s of %s: %s held, %s for a step's temporaries", num_pages,
                    gib(num_pages * page_bytes), f"{utilization:.2f}", gib(limit), gib(in_use), gib(step))
        return int(num_pages)

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_update: Callable[[SequenceUpdate], None] | None = None,
        prompt_logprobs: bool = False,
    ) -> str:
        """Queues a request; returns its id. Thread-safe.

        `on_update` is called (from the thread running `step`) with each
        `SequenceUpdate`. Raises ValueError for a request that can never run: an
        empty prompt, a token outside the vocabulary, or more tokens than
        `max_model_len` or the whole page pool holds.
        """
        sequence = self._new_sequence(prompt_ids, params, request_id, on_update, prompt_logprobs)
        self._inbox.put(("add", sequence))
        return sequence.id

    def _new_sequence(self, prompt_ids, params, request_id, on_update, prompt_logprobs) -> _Sequence:
        """Checks a request and makes its sequence (raises ValueError if it can never run)."""
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"Prompt token ids must be in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}.")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Reduce the prompt or max_tokens."
            )
        if math.ceil(total / self.page_size) > self.allocator.num_pages:
            raise ValueError(
                f"The request needs {math.ceil(total / self.page_size)} KV pages but the pool has only "
                f"{self.allocator.num_pages}; start the engine with more pages (--num-pages / --kv-cache-memory)."
            )
        matcher = None if params.structured is None else self._matcher(params.structured)
        seed = int(self._rng.integers(0, 2**31)) if params.seed is None else params.seed & 0x7FFFFFFF
        decoder = StreamDecoder(self.tokenizer, prompt_ids[-DETOKENIZE_CONTEXT:])
        request_id = request_id or f"req-{next(self._ids)}"
        return _Sequence(id=request_id, prompt_ids=prompt_ids, params=params, seed=seed, on_update=on_update,
                         prompt_logprobs=prompt_logprobs, decoder=decoder, matcher=matcher,
                         reuse_prefix=not prompt_logprobs)

    def _matcher(self, structured: StructuredOutput) -> Matcher:
        # The compiler is made once (seconds for a large vocabulary), and so is a
        # refusal of the vocabulary: later requests are refused without the work.
        with self._grammars_lock:
            if self._grammars is None and self._grammars_refused is None:
                try:
                    self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
                except ValueError as error:
                    self._grammars_refused = str(error)
        if self._grammars_refused is not None:
            raise ValueError(self._grammars_refused)
        return self._grammars.matcher(structured)

    def check_structured(self, structured: StructuredOutput) -> None:
        """Raises ValueError naming the problem if `structured` cannot be compiled
        for this tokenizer (a request carrying it would be refused)."""
        self._matcher(structured)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its pages at the next step. Thread-safe."""
        self._inbox.put(("abort", request_id))

    @property
    def waiting(self) -> collections.deque:
        return self.scheduler.waiting

    @property
    def running(self) -> list:
        return self.scheduler.running

    @property
    def allocator(self):
        return self.scheduler.allocator

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or not self._inbox.empty())

    def stats(self) -> dict[str, int | float]:
        """Free (cached ones included) and total KV pages, running and waiting
        sequences, and the prefix cache: pages kept, tokens of admitted requests
        looked up and found, and the hit rate (found / looked up, 0 before any)."""
        scheduler = self.scheduler
        return {
            "kv_pages_free": self.allocator.free,
            "kv_pages_total": self.allocator.num_pages,
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "prefix_cache_pages": self.allocator.cached,
            "prefix_cache_queries_total": scheduler.prefix_queries,
            "prefix_cache_hits_total": scheduler.prefix_hits,
            "prefix_cache_hit_rate": scheduler.prefix_hits / scheduler.prefix_queries if scheduler.prefix_queries else 0.0,
        }

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[CompletionOutput]:
        """Runs `prompts` (token id lists) to completion, all batched together.

        `params` is one `SamplingParams` for all or one per prompt. Not to be used
        while the background loop (`start`) runs.
        """
        if self._thread is not None:
            raise RuntimeError("Engine.generate cannot run while the background loop runs; use add_request.")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results: dict[str, CompletionOutput] = {}

        def collect(update: SequenceUpdate, prompt: list[int]):
            out = results.setdefault(
                update.request_id, CompletionOutput(update.request_id, prompt, [], "", "", None, [], None)
            )
            out.token_ids += update.token_ids
            out.text += update.text
            out.logprobs += update.logprobs
            if update.prompt_logprobs is not None:
                out.prompt_logprobs = update.prompt_logprobs
            if update.finish_reason is not None:
                out.finish_reason, out.stop_reason, out.error = update.finish_reason, update.stop_reason, update.error

        sequences = [
            self._new_sequence(prompt, p, None, lambda u, prompt=list(prompt): collect(u, prompt), False)
            for prompt, p in zip(prompts, params)
        ]
        for sequence in sequences:  # all checked before any is queued
            self._inbox.put(("add", sequence))
        ids = [sequence.id for sequence in sequences]
        while any(results.get(i) is None or not results[i].finish_reason for i in ids):
            self.step()
        return [results[i] for i in ids]

    # --------------------------------------------------------- background loop

    def start(self) -> None:
        """Runs `step` in a background thread whenever there is work."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="eqx-models-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the background loop (running requests stay where they are)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join()
        self._thread = None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not (self.waiting or self.running):
                self._backlog.append(self._inbox.get())  # sleep until something arrives
            try:
                self.step()
            except Exception as error:  # outside any one request (scheduling): fail the requests, not the server
                logger.exception("engine step failed; aborting the running and waiting requests")
                for sequence in list(self.running) + list(self.waiting):
                    sequence.error = f"The engine failed a step: {type(error).__name__}: {error}"
                    self._finish(sequence, "abort")
                    self._emit_into([], sequence)
                if self._pools_lost():
                    self._reset_pools()

    # ------------------------------------------------------------------- steps

    def step(self) -> list[SequenceUpdate]:
        """One scheduling round: admit, prefill chunks, decode. Returns the updates."""
        updates: list[SequenceUpdate] = []
        self._drain_inbox(updates)
        plan = self.scheduler.schedule()
        self._failed = []
        try:
            if self._ragged and plan.prefill:  # prompt chunks and decodes in one call
                self._run_prefill(plan.prefill + [(sequence, 1) for sequence in plan.decode])
            else:
                self._run_prefill(plan.prefill)  # admits and preempts nothing: the decode rows still run
                if plan.decode:
                    self._run_decode(plan.decode)
        except _PoolsLost:
            pass  # every running sequence waits to be recomputed
        for sequence in dict.fromkeys([sequence for sequence, _ in plan.prefill] + plan.decode + self._failed):
            self._emit_into(updates, sequence)
        return updates

    def _drain_inbox(self, updates: list[SequenceUpdate]) -> None:
        while True:
            if self._backlog:
                kind, item = self._backlog.pop(0)
            else:
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    return
            if kind == "add":
                self.scheduler.add(item)
            elif kind == "abort":
                for sequence in [s for s in itertools.chain(self.running, self.waiting) if s.id == item]:
                    self._finish(sequence, "abort")
                    self._emit_into(updates, sequence)

    def _finish(self, sequence: _Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        sequence.finish_reason, sequence.stop_reason = reason, stop_reason
        self.scheduler.finish(sequence)

    def _fail(self, sequence: _Sequence, error: Exception) -> None:
        """Ends one request that could not be served; the others run on."""
        logger.error("request %s failed; ending it alone", sequence.id, exc_info=error)
        sequence.error = f"The engine failed while running this request: {type(error).__name__}: {error}"
        self._finish(sequence, "abort")
        self._failed.append(sequence)

    def _emit_into(self, updates: list[SequenceUpdate], sequence: _Sequence) -> None:
        """`_emit`, its update added to `updates`; a listener that raises ends its own request."""
        try:
            update = self._emit(sequence)
        except Exception:
            logger.exception("handing out the output of %s failed; ending it", sequence.id)
            if sequence.finish_reason is None:
                self._finish(sequence, "abort")
            return
        if update is not None:
            updates.append(update)

    # -------------------------------------------------------------- model calls

    def _largest_chunk_call(self) -> tuple[int, int]:
        """The rows and chunk length (buckets) of the largest call by chunk length the
        scheduler can make: chunks of one bucket are longer than half of it, and a
        step's chunks hold at most `max_num_batched_tokens` tokens."""
        calls = []
        length = MIN_CHUNK_BUCKET
        while length <= _bucket(self.max_num_batched_tokens, MIN_CHUNK_BUCKET):
            shortest = 2 if length == MIN_CHUNK_BUCKET else length // 2 + 1
            rows = _bucket(max(1, min(self.max_num_seqs, self.max_num_batched_tokens // shortest)))
            calls.append((rows * length, rows, length))
            length *= 2
        _, rows, length = max(calls)
        return rows, length

    def _jitted_forward(self, static, counts: collections.Counter):
        """The step, jitted with the pools donated (`counts` counts its traces)."""
        return jax.jit(self._make_forward(static, counts), donate_argnums=1,
                       static_argnames=("sampled", "filters", "masked", "logprobs", "all_logits"))

    def _make_forward(self, static, counts: collections.Counter):
        def forward(params, pools, batch, *, sampled: bool, filters: bool, masked: bool, logprobs: bool,
                    all_logits: bool):
            ragged = "query_starts" in batch
            counts["ragged" if ragged else "prefill" if batch["ids"].shape[1] > 1 else "decode"] += 1
            model = eqx.combine(params, static)
            keys, values, key_scales, value_scales, state = pools
            if ragged:
                cache = RaggedPagedKVCache(keys, values, batch["tables"], batch["positions"], batch["query_starts"],
                                           key_scales, value_scales)
                logits, cache = model(batch["ids"], cache, batch["mask"],
                                      logits_at=None if all_logits else batch["logits_at"])
                last = jnp.take_along_axis(logits, batch["logits_at"][..., None], axis=1)[0] if all_logits else logits[0]
            else:
                cache = PagedKVCache(keys, values, batch["tables"], batch["positions"], state, batch["state_slots"],
                                     key_scales, value_scales)
                logits, cache = model(batch["ids"], cache, batch["mask"], logits_to_keep=None if all_logits else 1)
                last = logits[:, -1]
            allowed = last
            if masked:  # structured outputs: bit t % 32 of word t // 32 allows token t
                bits = jax.lax.bitcast_convert_type(batch["allowed"], jnp.uint8).reshape(last.shape[0], -1)
                bits = jnp.unpackbits(bits, axis=-1, bitorder="little")[:, : last.shape[-1]]
                allowed = jnp.where(bits.astype(bool), last, -jnp.inf)
            tokens = sample_rows(
                allowed, batch["seeds"], batch["counters"], batch["temperature"], batch["top_k"], batch["top_p"],
                sampled=sampled, filters=filters,
            )
            out = {"tokens": tokens}
            if logprobs:
                out["logprob"], out["top_ids"], out["top_logprobs"] = token_logprobs(last, tokens)
            if all_logits:
                out["prompt"] = token_logprobs(logits, batch["targets"])
            return (cache.keys, cache.values, cache.key_scales, cache.value_scales, cache.state), out

        return forward

    def _inputs(self, rows: list[_Sequence], batch: int, width: int, lengths: list[int]) -> dict[str, np.ndarray]:
        """Host arrays of one call: row i computes the `lengths[i]` tokens after its
        cache. A row that cannot be filled in fails its request and stays padding."""
        seq = max(MIN_CHUNK_BUCKET, _bucket(max(lengths))) if max(lengths) > 1 else 1
        inputs = dict(
            _row_arrays(batch, width), ids=np.zeros((batch, seq), np.int32), mask=np.zeros((batch, seq), np.int32),
            targets=np.zeros((batch, seq), np.int32),
            state_slots=np.full(batch, self.max_num_seqs, np.int32),  # the scratch slot
        )
        return self._filled(inputs, rows, lengths, width, [None] * len(rows))

    def _ragged_inputs(
        self, rows: list[_Sequence], batch: int, width: int, lengths: list[int], tokens: int = 0,
    ) -> dict[str, np.ndarray]:
        """Host arrays of one ragged call: the rows' new tokens end to end in one
        row of a bucketed length (of at least `tokens`), with where each row's start
        (`query_starts`) and each row's last (`logits_at`, the token it samples
        after). A row that cannot be filled in fails its request and becomes padding."""
        starts = np.zeros(batch + 1, np.int32)
        end = 0
        for i, length in enumerate(lengths):  # a chunk spans whole blocks of its own
            starts[i] = end = _round_up(end, QUERY_BLOCK) if length > 1 else end
            end += length
        starts[len(rows) :] = _round_up(end, QUERY_BLOCK)
        # Powers of two, but never past the budget and the two part-blocks it may
        # be overrun by (the decodes' padding, a last chunk's).
        end = int(starts[-1])
        tokens = max(end, min(_bucket(max(end, tokens), MIN_CHUNK_BUCKET),
                              _round_up(self.max_num_batched_tokens, QUERY_BLOCK) + 2 * QUERY_BLOCK))
        inputs = dict(
            _row_arrays(batch, width), ids=np.zeros((1, tokens), np.int32), mask=np.zeros((1, tokens), np.int32),
            targets=np.zeros((1, tokens), np.int32), logits_at=np.zeros((1, batch), np.int32), query_starts=starts,
        )
        return self._filled(inputs, rows, lengths, width, [int(start) for start in starts[: len(rows)]])

    def _filled(self, inputs: dict[str, np.ndarray], rows: list[_Sequence], lengths: list[int], width: int,
                starts: list[int | None]) -> dict[str, np.ndarray]:
        """`inputs` with each row's tokens filled in (`_fill_row`); a row that cannot
        be fails its request and becomes padding."""
        for i, (sequence, length, start) in enumerate(zip(rows, lengths, starts)):
            try:
                self._fill_row(inputs, i, sequence, length, width, start=start)
            except Exception as error:
                self._fail(sequence, error)
                self._blank_row(inputs, i)
        return inputs

    def _fill_row(
        self, inputs: dict[str, np.ndarray], i: int, sequence: _Sequence, length: int, width: int,
        start: int | None = None,
    ) -> None:
        """Row i's tokens: at columns `start` on of the one flattened row (a ragged
        call), else at the end of row i (left-padded)."""
        if start is None:  # left-padded: the last column is the newest token
            row, start = i, inputs["ids"].shape[1] - length
        else:
            row = 0
            inputs["logits_at"][0, i] = start + length - 1
        new = sequence.token_range(sequence.cached, sequence.cached + length)
        inputs["ids"][row, start : start + length] = new
        inputs["mask"][row, start : start + length] = 1
        following = sequence.token_range(sequence.cached + 1, sequence.cached + length + 1)
        inputs["targets"][row, start : start + len(following)] = following
        inputs["tables"][i, : len(sequence.pages)] = sequence.pages[:width]
        inputs["positions"][i] = sequence.cached
        if sequence.state_slot is not None:
            inputs["state_slots"][i] = sequence.state_slot
        inputs["seeds"][i], inputs["counters"][i] = sequence.seed, len(sequence.output_ids)
        p = sequence.params
        inputs["temperature"][i], inputs["top_k"][i], inputs["top_p"][i] = p.temperature, max(p.top_k, 0), p.top_p

    def _blank_row(self, inputs: dict[str, np.ndarray], i: int) -> None:
        """Makes row i padding: it writes no page and its token is not kept."""
        blank = {"state_slots": self.max_num_seqs, "top_p": 1, "allowed": -1}
        starts = inputs.get("query_starts")
        for name, array in inputs.items():
            if name == "query_starts":
                continue
            if starts is not None and name in ("ids", "mask", "targets"):  # its span of the flattened row
                array[0, starts[i] : starts[i + 1]] = 0
            elif starts is not None and name == "logits_at":
                array[0, i] = 0
            else:
                array[i] = blank.get(name, 0)

    def _call(self, rows, batch, lengths, *, samples: list[bool], all_logits=False, ragged=False):
        """Runs the model on `rows` (`ragged`: in one flattened row); `samples[i]`:
        whether row i's token is kept (its structured output's mask applies). Rows
        whose request failed on the way in have their `finish_reason` set; None if
        the call itself failed (`_call_failed`)."""
        width = min(self.pages_per_seq, _bucket(max(len(s.pages) for s in rows)))
        inputs = (self._ragged_inputs if ragged else self._inputs)(rows, batch, width, lengths)
        if all(s.finish_reason is not None for s in rows):  # every row failed on the way in
            return None
        masked = [i for i, s in enumerate(rows) if s.matcher is not None and samples[i] and s.finish_reason is None]
        if masked:
            inputs["allowed"] = np.full((batch, self._grammars.mask_words), -1, np.int32)
            self._fill_masks(rows, masked, inputs)
        try:
            pools, out = self._forward(
                self._params, self.pools, inputs,
                sampled=any(s.params.sampled for s in rows),
                filters=any(s.params.filters for s in rows),
                masked=bool(masked),
                logprobs=any(s.params.logprobs is not None for s in rows),
                all_logits=all_logits,
            )
            out = jax.device_get(out)
            if ragged:  # where each row's tokens are, for its prompt log-probabilities
                out["query_starts"] = inputs["query_starts"]
        except Exception as error:
            self._call_failed(rows, error)
            return None
        self.pools = pools
        if len(rows) == 1 and rows[0].suspect is not None:
            # A suspect that ran alone without failing is not the one at fault: it
            # batches again (else a fault that needs company kept every suspect alone).
            rows[0].suspect = None
        return out

    def _fill_masks(self, rows: list[_Sequence], masked: list[int], inputs: dict[str, np.ndarray]) -> None:
        try:
            self._grammars.fill_masks([(rows[i].matcher, i) for i in masked], inputs["allowed"])
        except Exception:  # find the grammar(s) at fault, one by one
            for i in masked:
                try:
                    self._grammars.fill_masks([(rows[i].matcher, i)], inputs["allowed"])
                except Exception as error:
                    self._fail(rows[i], error)
                    self._blank_row(inputs, i)

    def _call_failed(self, rows: list[_Sequence], error: Exception) -> None:
        """A model call raised. A request alone in it is at fault and fails (and the
        others of the call it was suspected with are cleared). With others, none can
        be blamed yet: each runs alone from now on (`_alone_if_suspect`) until the
        culprit is found. If the call had taken the KV pools, every running sequence
        waits to be recomputed, as after preemption, and the step ends (`_PoolsLost`)."""
        live = [sequence for sequence in rows if sequence.finish_reason is None]
        if len(live) == 1:
            culprit = live[0]
            self._fail(culprit, error)
            if culprit.suspect is not None:
                for sequence in itertools.chain(self.running, self.waiting):
                    if sequence.suspect == culprit.suspect:
                        sequence.suspect = None
        elif live:
            incident = next(self._incidents)
            logger.error("a model call of %d requests failed; running each alone to find the one at fault",
                         len(live), exc_info=error)
            for sequence in live:
                sequence.suspect = incident
        if self._pools_lost():
            self._reset_pools()
            raise _PoolsLost

    def _pools_lost(self) -> bool:
        """Whether a failed call had taken (donated) the pools."""
        return any(pool.is_deleted() for pool in jax.tree.leaves(self.pools))

    def _reset_pools(self) -> None:
        """New, empty pools; every running sequence waits to be recomputed from its tokens."""
        logger.warning("the KV pages were lost with a failed model call; recomputing the running requests")
        self.pools = self._empty_pools()
        self.allocator.forget_cached()  # the new pages hold zeros
        self.scheduler.preempt_all()

    @staticmethod
    def _alone_if_suspect(items: list, sequence_of=lambda item: item) -> list[list]:
        """`items` as model calls: the unsuspected ones together, each suspect alone."""
        together = [item for item in items if sequence_of(item).suspect is None]
        return ([together] if together else []) + [[item] for item in items if sequence_of(item).suspect is not None]

    def _run_prefill(self, chunks: list[tuple[_Sequence, int]]) -> None:
        """Runs the chunks: in one ragged call where the model takes one, else one
        call per chunk-length bucket (rows of a call share the weight reads;
        grouping by length keeps the padding small)."""
        if self._ragged:
            for call in self._alone_if_suspect(chunks, lambda chunk: chunk[0]):
                # Rows of one token first: then the chunks' blocks start right after them.
                self._prefill_call(sorted(call, key=lambda chunk: chunk[1] > 1))
            return
        groups: dict[int, list[tuple[_Sequence, int]]] = collections.defaultdict(list)
        for sequence, length in chunks:
            groups[_bucket(length, MIN_CHUNK_BUCKET) if length > 1 else 1].append((sequence, length))
        for group in groups.values():
            for call in self._alone_if_suspect(group, lambda chunk: chunk[0]):
                self._prefill_call(call)

    def _prefill_call(self, group: list[tuple[_Sequence, int]]) -> None:
        rows = [sequence for sequence, _ in group]
        lengths = [length for _, length in group]
        wants = [s.prompt_logprobs and s.cached < len(s.prompt_ids) - 1 for s in rows]
        samples = [s.cached + length == s.num_tokens for s, length in group]
        out = self._call(rows, _bucket(len(rows)), lengths, samples=samples, all_logits=any(wants),
                         ragged=self._ragged)
        if out is None:
            return
        starts = out.get("query_starts")
        for row, (sequence, length) in enumerate(group):
            if sequence.finish_reason is not None:  # failed on the way in
                continue
            try:
                if wants[row]:
                    # A ragged call's row i is columns starts[i] on of its one row;
                    # else row i, right-aligned.
                    where = (0, int(starts[row])) if self._ragged else (row, out["prompt"][0].shape[1] - length)
                    self._record_prompt_logprobs(sequence, out["prompt"], length, *where)
                completes = sequence.cached + length == sequence.num_tokens
                self.scheduler.computed(sequence, length)
                if completes:
                    self._accept(sequence, out, row)
            except Exception as error:
                self._fail(sequence, error)

    def _run_decode(self, rows: list[_Sequence]) -> None:
        for call in self._alone_if_suspect(rows):
            batch = min(_bucket(len(call)), _bucket(self.max_num_seqs))
            out = self._call(call, batch, [1] * len(call), samples=[True] * len(call))
            if out is None:
                continue
            for i, sequence in enumerate(call):
                if sequence.finish_reason is not None:  # failed on the way in
                    continue
                try:
                    self.scheduler.computed(sequence, 1)
                    self._accept(sequence, out, i)
                except Exception as error:
                    self._fail(sequence, error)

    def _record_prompt_logprobs(self, sequence: _Sequence, prompt, length: int, row: int, first: int) -> None:
        """The log-probabilities of the prompt tokens after the `length` computed
        ones, which are columns `first` on of `row`."""
        picked, top_ids, top_values = prompt
        if sequence.prompt_entries is None:
            sequence.prompt_entries = [None]  # the first token has nothing before it
        for column in range(first, first + length):
            position = sequence.cached + column - first  # predicts the token after it
            if position + 1 >= len(sequence.prompt_ids) or position + 1 < len(sequence.prompt_entries):
                continue
            sequence.prompt_entries.append(
                TokenLogprobs(
                    sequence.prompt_ids[position + 1], float(picked[row, column]),
                    list(zip(top_ids[row, column].tolist(), top_values[row, column].tolist())),
                )
            )

    # ---------------------------------------------------------------- outputs

    def _accept(self, sequence: _Sequence, out, row: int) -> None:
        """Appends a sampled token; decides whether the sequence is done."""
        token = int(out["tokens"][row])
        sequence.output_ids.append(token)
        sequence.pending_ids.append(token)
        p = sequence.params
        if p.logprobs is not None:
            top = list(zip(out["top_ids"][row].tolist(), out["top_logprobs"][row].tolist()))[: p.logprobs]
            sequence.pending_logprobs.append(TokenLogprobs(token, float(out["logprob"][row]), top))
        if sequence.matcher is not None:
            try:
                sequence.matcher.consume(token)
            except RuntimeError as error:  # the mask allowed it: a bug, confined to this request
                return self._fail(sequence, error)
        before = len(sequence.text)
        sequence.text += sequence.decoder.push([token])
        for stop in p.stop:
            # Only a stop string that ends in the new text can be new.
            found = sequence.text.find(stop, max(0, before - len(stop) + 1))
            if found >= 0:
                sequence.text = sequence.text[:found]
                return self._finish(sequence, "stop", stop)
        if token in self.eos_token_ids and not p.ignore_eos:
            reason, stop_reason = "stop", None
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif sequence.matcher is not None and sequence.matcher.done:  # the structured output is complete
            reason, stop_reason = "stop", None
        elif len(sequence.output_ids) >= p.max_tokens or sequence.num_tokens >= self.max_model_len:
            reason, stop_reason = "length", None
        else:
            return
        sequence.text += sequence.decoder.flush()  # a character cut short at the end, if any
        self._finish(sequence, reason, stop_reason)

    def _emit(self, sequence: _Sequence) -> SequenceUpdate | None:
        """Hands out what is new for a sequence (nothing when nothing is)."""
        finished = sequence.finish_reason is not None
        hold = 0 if finished else max((len(s) for s in sequence.params.stop), default=1) - 1
        released = len(sequence.text) - hold
        text = sequence.text[sequence.sent : released] if released > sequence.sent else ""
        if not (text or sequence.pending_ids or finished):
            return None
        prompt_entries = None
        if sequence.prompt_logprobs and sequence.output_ids and not sequence.prompt_entries_sent:
            prompt_entries, sequence.prompt_entries_sent = sequence.prompt_entries or [None], True
        update = SequenceUpdate(
            sequence.id, sequence.pending_ids, text, sequence.pending_logprobs, sequence.finish_reason,
            sequence.stop_reason, len(sequence.prompt_ids), len(sequence.output_ids),
            prompt_entries, sequence.error,
        )
        sequence.sent = max(sequence.sent, released)
        sequence.pending_ids, sequence.pending_logprobs = [], []
        if sequence.on_update is not None:
            sequence.on_update(update)
        return update
