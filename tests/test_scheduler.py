"""The scheduler and the page allocator alone, without a model: admission, token
budget, preemption, and the prefix cache (sharing, reference counts, eviction)."""

import pytest

from eqx_models.serving.pages import PageAllocator, page_keys
from eqx_models.serving.scheduler import ScheduledSequence, Scheduler

PAGE = 4


def sequence(name: str, tokens, **fields) -> ScheduledSequence:
    return ScheduledSequence(id=name, prompt_ids=list(tokens), **fields)


def scheduler(**settings) -> Scheduler:
    defaults = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=PAGE, num_pages=32)
    return Scheduler(**{**defaults, **settings})


def run(s: Scheduler, plan, next_token: int = 7) -> None:
    """What the engine does with a plan: the model caches the planned tokens, a
    sequence whose tokens are all cached samples its next one."""
    for seq, length in plan.prefill:
        s.computed(seq, length)
        if seq.uncached == 0:
            seq.output_ids.append(next_token)
    for seq in plan.decode:
        s.computed(seq, 1)
        seq.output_ids.append(next_token)


def test_prompts_are_admitted_in_order_within_the_token_budget_and_then_decode():
    s = scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    a, b, c = sequence("a", range(10)), sequence("b", range(100, 110)), sequence("c", range(200, 203))
    for seq in (a, b, c):
        s.add(seq)
    plan = s.schedule()
    assert [(seq.id, n) for seq, n in plan.prefill] == [("a", 10), ("b", 6)] and plan.decode == []
    assert s.running == [a, b] and list(s.waiting) == [c]
    assert len(a.pages) == 3 and len(b.pages) == 2  # pages for the tokens computed so far
    run(s, plan)
    plan = s.schedule()  # a decodes; b's rest; c waits for a free row (max_num_seqs 2)
    assert plan.decode == [a] and [(seq.id, n) for seq, n in plan.prefill] == [("b", 4)]
    assert list(s.waiting) == [c]
    run(s, plan)
    s.finish(a)
    plan = s.schedule()
    assert plan.decode == [b] and [(seq.id, n) for seq, n in plan.prefill] == [("c", 3)]
    assert plan.scheduled_tokens == 4


def test_a_short_pool_preempts_the_latest_admitted_which_waits_first_in_line():
    s = scheduler(num_pages=6, prefix_caching=False)
    a, b = sequence("a", range(8)), sequence("b", range(100, 107))
    s.add(a), s.add(b)
    plan = s.schedule()
    # b leaves a page for a's growth: 2 pages of 6 - 2 for a, 1 spare -> 3 pages, 7 tokens fit in 2.
    assert [(seq.id, n) for seq, n in plan.prefill] == [("a", 8), ("b", 7)]
    run(s, plan)
    assert s.allocator.free == 6 - 2 - 2
    while not s.waiting:  # both decode until the pool runs dry
        plan = s.schedule()
        run(s, plan)
    assert plan.preempted == [b] and list(s.waiting) == [b] and s.running == [a]
    assert b.pages == [] and b.cached == 0 and len(b.output_ids) > 0  # recomputed with its outputs later
    assert s.allocator.free == 6 - len(a.pages)


def test_when_every_running_prompt_waits_for_pages_the_latest_admitted_gives_way():
    s = scheduler(num_pages=4, prefix_caching=False)
    a, b = sequence("a", range(12)), sequence("b", range(100, 112))
    for seq in (a, b):  # both admitted part-way through their prompts, the pool now empty
        seq.pages = s.allocator.allocate(2)
        s.computed(seq, 8)
        s.running.append(seq)
    plan = s.schedule()
    assert plan.prefill == [] and plan.decode == [] and plan.preempted == [b]
    assert list(s.waiting) == [b] and s.allocator.free == 2
    plan = s.schedule()
    assert plan.prefill == [(a, 4)]


def test_a_shared_prefix_is_computed_once_and_its_pages_shared():
    s = scheduler()
    shared = list(range(12))  # three full pages
    a = sequence("a", shared + [50, 51])
    s.add(a)
    run(s, s.schedule())
    b = sequence("b", shared + [60, 61, 62, 63, 64])
    s.add(b)
    plan = s.schedule()
    assert (b, 17 - 12) in plan.prefill  # only what follows the shared pages
    assert b.pages[:3] == a.pages[:3] and b.cached == 12 and b.pages[3] != a.pages[3]
    assert [s.allocator.references(p) for p in a.pages[:3]] == [2, 2, 2]
    assert (s.prefix_queries, s.prefix_hits) == (14 + 17, 12)


def test_the_last_prompt_token_is_always_computed():
    s = scheduler()
    a = sequence("a", range(8))  # two full pages
    s.add(a)
    run(s, s.schedule())
    b = sequence("b", range(8))
    s.add(b)
    plan = s.schedule()
    assert (b, 4) in plan.prefill and b.cached == 4  # the first page only: the second holds the last token


def test_finished_pages_stay_cached_until_evicted_oldest_first():
    s = scheduler(num_pages=6, max_num_seqs=1)
    a = sequence("a", range(9))  # 2 full pages + 1 token
    s.add(a)
    run(s, s.schedule())
    s.finish(a)
    assert s.allocator.free == 6 and s.allocator.cached == 2  # registered, no longer held
    b = sequence("b", range(100, 117))  # needs 5 pages: the 4 free, then the tail of a's cached ones
    s.add(b)
    run(s, s.schedule())
    assert s.allocator.cached == 1
    s.finish(b)
    c = sequence("c", list(range(9)))
    s.add(c)
    s.schedule()
    assert c.cached == 4  # a's first page survived (a's tail went first), its second did not


def test_the_n_choices_of_one_prompt_wait_for_the_first_to_compute_it():
    s = scheduler(max_num_batched_tokens=64)
    prompt = list(range(21))
    first, second = sequence("0", prompt), sequence("1", prompt)
    s.add(first), s.add(second)
    plan = s.schedule()
    assert [(seq.id, n) for seq, n in plan.prefill] == [("0", 21)] and list(s.waiting) == [second]
    assert second.pages == []
    run(s, plan)
    plan = s.schedule()
    assert (second, 1) in plan.prefill and second.pages[:5] == first.pages[:5]


@pytest.mark.parametrize("settings, fields", [
    (dict(prefix_caching=False), {}),
    (dict(state_slots=4), {}),  # a recurrent state is not kept per prefix
    ({}, dict(reuse_prefix=False)),  # e.g. a request for the prompt's log-probabilities
])
def test_no_sharing_when_off_with_a_recurrent_state_or_asked_not_to(settings, fields):
    s = scheduler(**settings)
    a = sequence("a", range(13))
    s.add(a)
    run(s, s.schedule())
    b = sequence("b", range(13), **fields)
    s.add(b)
    plan = s.schedule()
    assert (b, 13) in plan.prefill and not set(b.pages) & set(a.pages)
    assert s.prefix_hits == 0


def test_a_preempted_sequence_takes_its_own_pages_back_from_the_cache():
    s = scheduler(num_pages=8)
    a = sequence("a", range(12))
    s.add(a)
    run(s, s.schedule())
    pages = list(a.pages)
    s._preempt(a, [])
    plan = s.schedule()
    assert a.pages[:3] == pages[:3] and (a, 1) in plan.prefill  # 12 prompt tokens + 1 output; the last recomputed


def test_page_keys_chain_the_whole_prefix():
    one, two = page_keys([1, 2, 3, 4, 5, 6, 7, 8], PAGE), page_keys([9, 2, 3, 4, 5, 6, 7, 8], PAGE)
    assert len(one) == 2 and one[0] != two[0] and one[1] != two[1]  # same page tokens, different prefix
    assert page_keys([5, 6, 7, 8], PAGE, parent=one[0]) == one[1:]
    assert page_keys([1, 2, 3], PAGE) == []


def test_the_allocator_counts_references():
    pool = PageAllocator(3, prefix_caching=True)
    pages = pool.allocate(2)
    pool.register(pages[0], b"k")
    assert pool.match([b"k", b"other"]) == [pages[0]] and pool.references(pages[0]) == 2
    pool.release(pages)
    assert pool.free == 2 and pool.cached == 0  # still held once
    pool.release(pages[:1])
    assert pool.free == 3 and pool.cached == 1
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(pages[:1])
    assert pool.allocate(4) is None and pool.free == 3
    assert len(pool.allocate(3)) == 3 and pool.match([b"k"]) == []  # evicted to make room


def test_chunks_are_charged_in_whole_blocks_and_one_cut_short_ends_on_one():
    """With a chunk granularity (the engine's ragged steps: 16), a 10-token prompt
    costs 16 of the budget, and a prompt the rest of the budget cannot hold is cut
    to whole blocks; decodes and one-token chunks cost one each."""
    s = scheduler(max_num_batched_tokens=64, num_pages=64, chunk_granularity=16, prefix_caching=False)
    a, b = sequence("a", range(10)), sequence("b", range(100, 160))
    s.add(a), s.add(b)
    plan = s.schedule()
    # a: 10 tokens for 16; b: the 48 left would hold 48, a whole number of blocks.
    assert [(seq.id, n) for seq, n in plan.prefill] == [("a", 10), ("b", 48)]
    run(s, plan)
    plan = s.schedule()  # a decodes (1): b's last 12 tokens in the 63 left
    assert plan.decode == [a] and [(seq.id, n) for seq, n in plan.prefill] == [("b", 12)]
    c = sequence("c", range(200, 280))
    s.add(c)
    run(s, plan)
    plan = s.schedule()  # a and b decode (2): of c's 80, the 62 left, cut to whole blocks: 48
    assert [(seq.id, n) for seq, n in plan.prefill] == [("c", 48)]
