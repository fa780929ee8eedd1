"""The serving engine without HTTP: batching, paging, preemption, sampling, stops."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES, require_fixture

import eqx_models
from eqx_models.serving import Engine, SamplingParams

PROMPTS = ["Once upon a time", "The cat", "Lily wanted to play with her friend because", "Tom", "A big dog", "The sun was"]


@pytest.fixture(autouse=True, params=["by_length", "ragged"])
def step_kind(request, monkeypatch):
    """Every test runs with both kinds of step: one call per chunk length and one
    for the decodes (the CPU backend's choice), and one ragged call (an
    accelerator's)."""
    from eqx_models.backends import active_backend

    monkeypatch.setattr(type(active_backend()), "prefers_ragged_steps", lambda self: request.param == "ragged")
    return request.param


@pytest.fixture(scope="module")
def stories():
    path = require_fixture(STORIES)
    return eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)


def alone(model, prompt_ids, max_tokens, eos=None):
    return eqx_models.generate(model, prompt_ids, max_new_tokens=max_tokens, eos_token_id=eos)[0].tolist()


def test_batched_greedy_outputs_equal_generate_and_pages_come_back(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64)
    prompts = [tokenizer.encode(p) for p in PROMPTS]  # more prompts than max_num_seqs
    lengths = [5, 30, 12, 1, 20, 9]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == alone(model, prompt, n)
        # The continuation keeps its leading space: the prompt's text plus it is the whole text.
        assert tokenizer.decode(prompt) + out.text == tokenizer.decode(prompt + out.token_ids)
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert {k: stats[k] for k in ("kv_pages_free", "kv_pages_total", "num_requests_running", "num_requests_waiting")} \
        == dict(kv_pages_free=64, kv_pages_total=64, num_requests_running=0, num_requests_waiting=0)


def test_an_int8_page_pool_serves_what_generate_gives_with_an_int8_cache(stories):
    model, tokenizer = stories
    # Each prompt in one chunk, as generate prefills it (a later chunk would read the
    # earlier one back from the integers).
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=256, page_size=4, num_pages=64,
                    kv_cache_dtype="int8")
    assert engine.pools[0].dtype == jnp.int8 and engine.pools[2].shape == engine.pools[0].shape[:-1]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for prompt, out in zip(prompts, outs):
        want = eqx_models.generate(model, prompt, max_new_tokens=24, cache_dtype="int8")[0].tolist()
        assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) > 0
    # The same memory holds more pages: a row is head_dim bytes and a float32 scale in
    # int8, 2 * head_dim bytes in bfloat16 (about twice as many pages at head_dim 128).
    budget = 1 << 20
    pages = {dtype: Engine(model, tokenizer, kv_cache_memory=budget, kv_cache_dtype=dtype).allocator.num_pages
             for dtype in ("bfloat16", "int8")}
    head_dim = model.config.head_dim
    assert pages["int8"] / pages["bfloat16"] == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.02)


def test_a_small_pool_preempts_and_recomputes_without_losing_anything(stories, caplog):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=32, page_size=4, num_pages=14)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    with caplog.at_level("INFO", logger="eqx_models.serving"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    assert any("preempting" in record.message for record in caplog.records)  # the pool really ran out
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(model, prompt, 40)
    assert engine.stats()["kv_pages_free"] == 14


def shared_tokens(prompt, earlier, page_size) -> int:
    """Tokens of `prompt` in the full pages it shares with one of `earlier`, short of its last token."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    longest = max((common(prompt, other) for other in earlier), default=0)
    return min(longest, len(prompt) - 1) // page_size * page_size


def test_a_shared_prefix_is_computed_once_and_changes_no_output(stories):
    model, tokenizer = stories
    prefix = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    prompts = [prefix + tokenizer.encode(p)[1:] for p in PROMPTS]  # one story opening, six ways on (no second BOS)
    params = SamplingParams(max_tokens=16, temperature=0)
    cached = Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=128)
    uncached = Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=128,
                      prefix_caching=False)
    outs = cached.generate(prompts, params)
    for prompt, out, plain in zip(prompts, outs, uncached.generate(prompts, params)):
        assert out.token_ids == plain.token_ids == alone(model, prompt, 16)
    stats = cached.stats()
    # The first prompt computes the shared pages; the others wait for them and take
    # them (and whatever full pages they share with an earlier one beyond that).
    assert stats["prefix_cache_hits_total"] == sum(shared_tokens(p, prompts[:i], 4) for i, p in enumerate(prompts))
    assert stats["prefix_cache_hits_total"] >= 5 * 4 * (len(prefix) // 4)
    assert stats["prefix_cache_queries_total"] == sum(len(p) for p in prompts)
    assert uncached.stats()["prefix_cache_hits_total"] == 0 and uncached.stats()["prefix_cache_pages"] == 0
    # Everything is cached now: asked again, each prompt computes only its last page's tokens.
    again = cached.generate(prompts, params)
    assert [out.token_ids for out in again] == [out.token_ids for out in outs]
    hits = cached.stats()["prefix_cache_hits_total"] - stats["prefix_cache_hits_total"]
    assert hits == sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert cached.stats()["kv_pages_free"] == 128


def test_prefix_caching_survives_preemption_and_eviction(stories, caplog):
    model, tokenizer = stories
    prefix = tokenizer.encode("One day, a little boy named Tom went to the park with his mom.")
    prompts = [prefix + tokenizer.encode(p)[1:] for p in PROMPTS]
    engine = Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=32, page_size=4, num_pages=24)
    with caplog.at_level("INFO", logger="eqx_models.serving"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    assert any("preempting" in record.message for record in caplog.records)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(model, prompt, 30)
    assert engine.stats()["prefix_cache_hits_total"] > 0 and engine.stats()["kv_pages_free"] == 24


def test_sampled_tokens_depend_on_the_seed_not_on_the_batch(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=8, page_size=4, num_pages=128)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    together = engine.generate(prompts, params)
    by_itself = engine.generate(prompts[2:3], params)
    assert together[2].token_ids == by_itself[0].token_ids
    other_seed = engine.generate(prompts[2:3], SamplingParams(max_tokens=24, temperature=0.9, seed=8))
    assert other_seed[0].token_ids != by_itself[0].token_ids


def test_compilations_stop_after_warm_up(stories):
    import jax

    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=8, page_size=4, num_pages=128)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=20, temperature=0)
    engine.generate(prompts, params)
    engine.generate(prompts, params)  # again: now the prompts' full pages come from the prefix cache
    warm = dict(engine.trace_counts)
    # XLA compilations, not only traces: jit also recompiles a traced function when an
    # argument's placement changes.
    compiles = []
    listener = lambda event, duration, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.generate(prompts, params)
        engine.generate(prompts[::-1], params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert dict(engine.trace_counts) == warm
    assert compiles == []


def test_stops_eos_stop_token_and_stop_string(stories):
    model, tokenizer = stories
    prompt = tokenizer.encode("Once upon a time")
    greedy = alone(model, prompt, 40)
    text = tokenizer.decode(greedy)
    engine = Engine(model, tokenizer, page_size=4, num_pages=64)
    # A stop string: the text ends before it; the tokens up to the one completing it count.
    out = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=("named",)))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", "named", text[: text.index("named")])
    # A stop token: generation ends on it.
    out = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(greedy[6],)))[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", greedy[6], greedy[: greedy.index(greedy[6]) + 1])
    # EOS (here the "." token): finish_reason "stop" with no stop_reason; ignore_eos runs on.
    eos_tokenizer = copy.copy(tokenizer)
    eos_tokenizer.eos_token_ids = (tokenizer.backend.token_to_id("."),)
    eos_engine = Engine(model, eos_tokenizer, page_size=4, num_pages=64)
    out = eos_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids == greedy[: greedy.index(eos_tokenizer.eos_token_ids[0]) + 1]
    out = eos_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == greedy and out.finish_reason == "length"


def test_logprobs_are_the_models_log_softmax(stories):
    model, tokenizer = stories
    prompt = tokenizer.encode("The cat")
    engine = Engine(model, tokenizer, page_size=4, num_pages=64)
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    ids = prompt + out.token_ids
    logits, _ = model(np.asarray(ids, np.int32)[None])
    expected = np.asarray(logits[0], np.float64)
    expected = expected - np.log(np.exp(expected - expected.max(-1, keepdims=True)).sum(-1, keepdims=True)) - expected.max(-1, keepdims=True)
    for step, entry in enumerate(out.logprobs):
        row = expected[len(prompt) - 1 + step]
        assert entry.token_id == out.token_ids[step]
        assert entry.logprob == pytest.approx(row[entry.token_id], abs=1e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(-row)[:5])
        assert entry.top[0][1] == pytest.approx(row.max(), abs=1e-4)


def test_requests_that_can_never_run_are_refused_with_the_reason(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_model_len=64, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="needs 10 KV pages but the pool has only 8"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"in \[0, 512\)"):
        engine.add_request([1, 512], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        Engine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=32)


def test_abort_frees_the_pages_at_the_next_step(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, page_size=4, num_pages=64)
    request = engine.add_request(tokenizer.encode("Once upon a time"), SamplingParams(max_tokens=100, temperature=0))
    engine.step()
    engine.step()
    assert engine.stats()["kv_pages_free"] < 64
    engine.abort(request)
    (update,) = engine.step()
    assert update.finish_reason == "abort"
    stats = engine.stats()
    assert {k: stats[k] for k in ("kv_pages_free", "kv_pages_total", "num_requests_running", "num_requests_waiting")} \
        == dict(kv_pages_free=64, kv_pages_total=64, num_requests_running=0, num_requests_waiting=0)


def test_sampler_draws_from_the_softmax_and_respects_top_k_and_top_p():
    import jax.numpy as jnp

    from eqx_models.serving.sampling import sample_rows

    logits = jnp.log(jnp.asarray([0.1, 0.4, 0.05, 0.3, 0.15]))
    draws = 6000
    rows = jnp.tile(logits, (draws, 1))

    def frequencies(top_k=0, top_p=1.0, temperature=1.0):
        tokens = sample_rows(
            rows, jnp.full(draws, 11, jnp.int32), jnp.arange(draws, dtype=jnp.int32),
            jnp.full(draws, temperature), jnp.full(draws, top_k, jnp.int32), jnp.full(draws, top_p),
            sampled=True, filters=top_k > 0 or top_p < 1,
        )
        return np.bincount(np.asarray(tokens), minlength=5) / draws

    np.testing.assert_allclose(frequencies(), [0.1, 0.4, 0.05, 0.3, 0.15], atol=0.02)
    np.testing.assert_allclose(frequencies(top_k=2), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], atol=0.02)
    # top_p 0.75: 0.4 + 0.3 reach 0.7 < 0.75, so 0.15 joins; the rest is cut.
    np.testing.assert_allclose(frequencies(top_p=0.75), [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85], atol=0.02)
    sharpened = frequencies(temperature=0.25)  # p ** 4, renormalised
    expected = np.array([0.1, 0.4, 0.05, 0.3, 0.15]) ** 4
    np.testing.assert_allclose(sharpened, expected / expected.sum(), atol=0.02)
    assert (frequencies(temperature=0.0) == [0, 1, 0, 0, 0]).all()


@pytest.mark.parametrize("architecture", ["qwen3_moe_mixed", "mistral_window", "gemma3_local_global"])
def test_every_cache_architecture_serves_what_generate_gives(stories, architecture):
    from test_cache import ARCHITECTURES, small_model

    _, tokenizer = stories  # any tokenizer covering the tiny vocabulary will do for the text
    model = small_model(**ARCHITECTURES[architecture])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 101, n).tolist() for n in (3, 11, 7)]
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == eqx_models.generate(model, prompt, max_new_tokens=14, eos_token_id=[])[0].tolist()


def test_a_step_of_prompt_chunks_and_decodes_is_one_ragged_call(stories):
    """Prompt chunks and decodes of one step go in one call, flattened; decodes
    alone go one token per row; outputs are those of `generate`."""
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=12, page_size=4, num_pages=64,
                    ragged_steps=True)
    calls = []
    forward = engine._forward

    def counted(params, pools, batch, **options):
        calls.append({name: np.shape(array) for name, array in batch.items()})
        return forward(params, pools, batch, **options)

    engine._forward = counted
    first, second = tokenizer.encode(PROMPTS[0]), tokenizer.encode(PROMPTS[2])  # 5 and 10 tokens
    params = SamplingParams(max_tokens=6, temperature=0)
    outputs = {}
    collect = lambda update: outputs.setdefault(update.request_id, []).extend(update.token_ids)
    engine.add_request(first, params, request_id="first", on_update=collect)
    engine.step()
    engine.add_request(second, params, request_id="second", on_update=collect)
    calls.clear()
    engine.step()  # the first decodes while the second's prompt is computed, in whole blocks of its own
    assert len(calls) == 1 and calls[0]["ids"] == (1, 32) and calls[0]["query_starts"] == (3,)
    engine.step()  # the rest of the second's prompt and the first's decode: still one call
    assert len(calls) == 2 and calls[1]["ids"] == (1, 32)
    while engine.has_work:
        engine.step()
    assert all(call["ids"][1] == 1 and "query_starts" not in call for call in calls[2:])  # decodes alone
    assert outputs == {"first": alone(model, first, 6), "second": alone(model, second, 6)}


def test_prompt_logprobs_are_the_models_log_softmax_over_the_prompt(stories):
    import jax

    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]  # one of 11 tokens, over two steps
    updates = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0), request_id=str(i),
                           prompt_logprobs=True, on_update=lambda u: updates.setdefault(u.request_id, []).append(u))
    while engine.has_work:
        engine.step()
    for i, prompt in enumerate(prompts):
        entries = next(u.prompt_logprobs for u in updates[str(i)] if u.prompt_logprobs is not None)
        logits, _ = model(np.asarray([prompt]))
        want = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
        assert entries[0] is None and len(entries) == len(prompt)
        for position, entry in enumerate(entries[1:]):
            assert entry.token_id == prompt[position + 1]
            assert entry.logprob == pytest.approx(float(want[position, prompt[position + 1]]), abs=1e-4)
