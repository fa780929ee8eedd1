"""The cache contract: decode equals the full pass, chunking, scanning, ragged batches."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_models
from eqx_models.models.gemma3 import Gemma3Config
from eqx_models.generation import DecodeState, Sampling, _decode_step, trace_counts
from eqx_models.nn.linear import Embedding, Linear


def small_model(seed: int = 0, config_class=eqx_models.DecoderConfig, **overrides) -> eqx_models.CausalLM:
    fields = dict(
        model_type="qwen3",
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        use_qk_norm=True,
    )
    fields.update(overrides)
    model = eqx_models.CausalLM(config_class(**fields), key=jax.random.key(seed))
    # Rescale the std-0.02 init of the projections and embeddings to unit variance
    # (std 1/sqrt(fan_in)), so logits are of order 1-10 and the tolerances bite.
    # Norm weights stay at one (their stacked leaves are 2-D too, hence the filter).
    weights = lambda m: [
        leaf.weight
        for leaf in jax.tree.leaves(m, is_leaf=lambda x: isinstance(x, (Linear, Embedding)))
        if isinstance(leaf, (Linear, Embedding))
    ]
    return eqx.tree_at(weights, model, [w / (0.02 * np.sqrt(w.shape[-1])) for w in weights(model)])


# The cache contract holds for every kind of layer stack: dense, biased, sparse
# (mixture of experts), and dense and sparse layers mixed in one scan.
ARCHITECTURES = {
    "qwen3": {},
    "qwen2": dict(model_type="qwen2", use_qk_norm=False, attention_bias=True),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen3_moe_mixed": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,)
    ),
    "mistral_window": dict(model_type="mistral", use_qk_norm=False, sliding_window=6),
    "gemma3_local_global": dict(
        model_type="gemma3_text", sliding_window=5, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        local_rope_theta=100.0, query_pre_attn_scalar=12.0, hidden_act="gelu_pytorch_tanh",
        config_class=Gemma3Config,
    ),
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return small_model(**ARCHITECTURES[request.param])


def random_ids(shape, seed=0, vocab=101):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def test_logits_are_of_realistic_size(model):
    logits, _ = model(random_ids((1, 8)))
    assert 1.0 < float(jnp.abs(logits).max()) < 100.0


def test_prefill_then_single_token_decode_equals_full_forward(model):
    ids = random_ids((2, 20))
    full, _ = model(ids)
    cache = model.init_cache(2, 32)
    step_logits = []
    logits, cache = model(ids[:, :12], cache=cache)
    step_logits.append(logits)
    for t in range(12, 20):
        logits, cache = model(ids[:, t : t + 1], cache=cache)
        step_logits.append(logits)
    np.testing.assert_allclose(np.concatenate(step_logits, axis=1), full, atol=1e-4, rtol=0)
    assert int(cache.length) == 20
    np.testing.assert_array_equal(cache.positions, [20, 20])


def test_chunked_prefill_equals_one_shot_prefill(model):
    ids = random_ids((2, 24), seed=1)
    one_shot, cache_a = model(ids, cache=model.init_cache(2, 40))
    chunks = []
    cache_b = model.init_cache(2, 40)
    for start in range(0, 24, 7):
        logits, cache_b = model(ids[:, start : start + 7], cache=cache_b)
        chunks.append(logits)
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), one_shot, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache_b.keys, cache_a.keys, atol=1e-5, rtol=0)
    next_a, _ = model(ids[:, :1], cache=cache_a)
    next_b, _ = model(ids[:, :1], cache=cache_b)
    np.testing.assert_allclose(next_a, next_b, atol=1e-4, rtol=0)


def test_unrolled_layers_equal_scanned_layers(model):
    ids = random_ids((2, 16), seed=2)
    unrolled = model.with_scan_layers(False)
    assert model.scan_layers and not unrolled.scan_layers

    @eqx.filter_jit
    def prefill_and_step(m):
        logits, cache = m(ids, cache=m.init_cache(2, 20))
        step_logits, cache = m(ids[:, :1], cache=cache)
        return logits, step_logits, cache

    # Same stacked weights, same math, both compiled: bit-for-bit the same numbers,
    # except where a scale is not a power of two (Gemma's sqrt(hidden) embedding
    # scale and query_pre_attn_scalar): XLA orders those multiplications differently
    # in a loop body than in straight-line code, a float32 rounding difference.
    exact = not isinstance(model.config, Gemma3Config)
    for scanned, looped in zip(jax.tree.leaves(prefill_and_step(model)), jax.tree.leaves(prefill_and_step(unrolled))):
        if exact:
            np.testing.assert_array_equal(looped, scanned)
        else:
            np.testing.assert_allclose(looped, scanned, atol=1e-5, rtol=0)


def test_left_padded_batch_equals_each_prompt_alone(model):
    prompts = [random_ids((n,), seed=n).tolist() for n in (5, 11, 8)]
    width = max(len(p) for p in prompts)
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1

    logits, _ = model(ids, attention_mask=mask)
    batched = eqx_models.generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    for i, p in enumerate(prompts):
        alone_logits, _ = model(np.asarray([p]))
        np.testing.assert_allclose(logits[i, width - len(p) :], alone_logits[0], atol=1e-4, rtol=0)
        alone = eqx_models.generate(model, [p], max_new_tokens=12, eos_token_id=[])
        np.testing.assert_array_equal(batched[i], alone[0])
    # A list of different-length prompts is left-padded for the caller.
    np.testing.assert_array_equal(
        eqx_models.generate(model, prompts, max_new_tokens=12, eos_token_id=[]), batched
    )


def test_compilations_do_not_grow_with_max_new_tokens():
    model = small_model(seed=3, intermediate_size=40)  # a shape no other test compiles
    prompt = random_ids((1, 9), seed=3)
    before = trace_counts()
    eqx_models.generate(model, prompt, max_new_tokens=8, eos_token_id=[])
    after_short = trace_counts()
    eqx_models.generate(model, prompt, max_new_tokens=256, eos_token_id=[])
    after_long = trace_counts()

    def traced(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in ("prefill", "decode")}

    # One prefill and one decode step compiled per cache size, however many tokens.
    assert traced(before, after_short) == {"prefill": 1, "decode": 1}
    assert traced(after_short, after_long) == traced(before, after_short)
    eqx_models.generate(model, prompt, max_new_tokens=14, eos_token_id=[])
    assert trace_counts() == after_long  # same cache bucket as 8 tokens: nothing new compiled


def test_decode_step_updates_cache_in_place_without_copying_it():
    model = small_model(seed=4, num_hidden_layers=8, hidden_size=64, num_attention_heads=4, head_dim=32)
    cache = model.init_cache(4, 1024)
    state = DecodeState(cache, jnp.zeros(4, jnp.int32), jnp.zeros(4, bool), jax.random.key(0))
    compiled = _decode_step.lower(model, state, Sampling(), (), 0).compile().compiled
    memory = compiled.memory_analysis()
    cache_bytes = cache.keys.nbytes + cache.values.nbytes
    # Donated: the output cache aliases the input cache.
    assert memory.alias_size_in_bytes >= cache_bytes
    # No copy of the cache per step: not of the whole cache, and not even of one
    # layer's keys and values (the key slice is read in place; the value slice is
    # still copied for its `dot`, half a layer).
    layer_slice = cache_bytes / 8
    assert memory.temp_size_in_bytes < 0.75 * layer_slice, (memory.temp_size_in_bytes, layer_slice)


def test_writing_past_the_cache_raises():
    model = small_model()  # full attention: a fixed-size cache, not a ring
    cache = model.init_cache(1, 8)
    _, cache = model(random_ids((1, 6)), cache=cache)
    with pytest.raises(Exception, match="KVCache overflow"):
        model(random_ids((1, 3)), cache=cache)


@pytest.mark.parametrize("first_chunk", [3, 12])
def test_sliding_window_cache_is_a_ring_that_decodes_far_past_the_window(first_chunk):
    model = small_model(model_type="mistral", use_qk_norm=False, sliding_window=5)
    ids = random_ids((2, 30), seed=9)
    full, _ = model(ids)
    cache = model.init_cache(2, 1000)
    assert cache.max_length == 5  # memory bounded by the window, not by max_length
    logits, cache = model(ids[:, :first_chunk], cache=cache)
    steps = [logits]
    for t in range(first_chunk, 30):
        logits, cache = model(ids[:, t : t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)
    assert cache.keys.shape[3] == 5 and int(cache.length) == 30
    np.testing.assert_array_equal(np.sort(np.asarray(cache.slot_positions), axis=1), [list(range(25, 30))] * 2)


def test_runtime_shape_checking_is_on(model):
    with pytest.raises(Exception, match="batch seq"):
        model(np.zeros((4,), np.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_reads_weights_and_cache_in_place(dtype):
    from eqx_models.backends.cpu import kernels_status

    assert kernels_status() == "ready", f"the CPU decode kernels did not build: {kernels_status()}"
    model = small_model(seed=5, num_hidden_layers=6, hidden_size=256, intermediate_size=1024, num_attention_heads=4, head_dim=64)
    model = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)

    def compile_step(max_length):
        state = DecodeState(model.init_cache(1, max_length), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool), jax.random.key(0))
        return state, _decode_step.lower(model, state, Sampling(), (), 0).compile().compiled

    state, compiled = compile_step(2048)
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.model.layers)) // 6
    cache_layer_bytes = (state.cache.keys.nbytes + state.cache.values.nbytes) // 6
    # A `dot` on a scanned layer's weights or cache slice copies the slice first
    # (temp >= one layer); the kernels read them where they are. What temp is left
    # holds one token's activations and per-slot flags, nothing the size of the cache.
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < layer_bytes / 8 and temp < cache_layer_bytes / 8, (temp, layer_bytes, cache_layer_bytes)
    shorter_temp = compile_step(512)[1].memory_analysis().temp_size_in_bytes
    assert temp - shorter_temp < cache_layer_bytes * (1 - 512 / 2048) / 100, (temp, shorter_temp)
    hlo = compiled.as_text()
    assert "eqx_models_stacked_matvec" in hlo and "eqx_models_decode_attention" in hlo
    weight_lines = [line for line in hlo.splitlines() if "1024,256" in line or "256,1024" in line]
    assert not any(" dot(" in line or "dynamic-slice(" in line for line in weight_lines)


def test_gated_deltanet_decode_updates_its_state_in_place():
    # Qwen3-Next: the DeltaNet layers' float32 state (here 8 heads of 128 x 128 per
    # layer) is carried through the scan and advanced where it lies by the kernel;
    # XLA's own update would gather and scatter a copy of it per layer and step.
    from eqx_models.models import architecture_for
    from eqx_models.nn.causal_lm import CausalLM

    hf = dict(
        model_type="qwen3_next", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=0, full_attention_interval=4,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        partial_rotary_factor=0.25, max_position_embeddings=4096,
    )
    model = CausalLM(architecture_for(hf).config_from_hf(hf), key=jax.random.key(0))
    state = DecodeState(model.init_cache(1, 1024), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool), jax.random.key(0))
    compiled = _decode_step.lower(model, state, Sampling(), (), 0).compile().compiled
    deltanet_layers = model.config.num_blocks * 3
    state_layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.cache.state)) // deltanet_layers
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.model.layers)) // 8
    # What temp is left is one token's activations, the convolution's window the
    # largest (7.5x below a layer's state, measured): a copy of any layer's state
    # or of the whole state would be at least 4x more.
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < state_layer_bytes / 4 and temp < layer_bytes / 8, (temp, state_layer_bytes, layer_bytes)
    hlo = compiled.as_text()
    assert "eqx_models_delta_rule_step" in hlo
    assert not any("8,128,128" in line and ("copy(" in line or "gather(" in line) for line in hlo.splitlines())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_latent_attention_decode_reads_its_expansions_and_cache_in_place(dtype):
    # DeepSeek-V2/V3: the absorbed key and value expansions come from the stacked
    # kv_b_proj read in place (a slice of it for XLA's einsum is 8 MB here, per layer
    # and step), and the compressed cache from the decode kernel.
    from eqx_models.models import architecture_for
    from eqx_models.nn.causal_lm import CausalLM

    hf = dict(
        model_type="deepseek_v2", vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1, n_routed_experts=8,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096, topk_method="greedy",
    )
    model = CausalLM(architecture_for(hf).config_from_hf(hf), key=jax.random.key(0))
    model = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)
    state = DecodeState(model.init_cache(1, 2048), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool), jax.random.key(0))
    compiled = _decode_step.lower(model, state, Sampling(), (), 0).compile().compiled
    cache_layer_bytes = (state.cache.keys.nbytes + state.cache.values.nbytes) // 4
    expansion_bytes = model.model.layers.self_attn.kv_b_proj.weight.nbytes // 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache_layer_bytes / 8 and temp < expansion_bytes / 8, (temp, cache_layer_bytes, expansion_bytes)
    hlo = compiled.as_text()
    assert "eqx_models_headwise_matvec" in hlo and "eqx_models_decode_attention" in hlo


def test_prefill_into_a_new_cache_equals_prefill_into_an_empty_one(model):
    ids = random_ids((2, 10), seed=6)
    mask = np.ones((2, 10), np.int32)
    mask[1, :3] = 0
    expected_logits, expected_cache = model(ids, cache=model.init_cache(2, 16), attention_mask=mask)
    logits, cache = model.prefill(ids, 16, attention_mask=mask)
    np.testing.assert_allclose(logits[1, 3:], expected_logits[1, 3:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[0], expected_logits[0], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.valid, expected_cache.valid)
    np.testing.assert_array_equal(cache.positions, expected_cache.positions)
    assert int(cache.length) == int(expected_cache.length) == 10
    real = np.asarray(cache.valid)[None, :, None, :, None]  # padding slots hold don't-care values
    for got, want in ((cache.keys, expected_cache.keys), (cache.values, expected_cache.values)):
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=0)
    step, _ = model(ids[:, :1], cache=cache)
    expected_step, _ = model(ids[:, :1], cache=expected_cache)
    np.testing.assert_allclose(step, expected_step, atol=1e-5, rtol=0)


def test_long_prompts_attend_in_query_blocks_with_the_same_result(model, monkeypatch):
    from eqx_models.backends import xla

    ids = random_ids((2, 23), seed=7)
    mask = np.ones((2, 23), np.int32)
    mask[0, :5] = 0
    whole, whole_cache = model.prefill(ids, 32, attention_mask=mask)
    monkeypatch.setattr(xla, "QUERY_CHUNK", 4)  # 23 > 2 * 4: six query blocks
    jax.clear_caches()  # the programs compiled above would not see the new chunk
    blocked, blocked_cache = model.prefill(ids, 32, attention_mask=mask)
    np.testing.assert_allclose(blocked[0, 5:], whole[0, 5:], atol=1e-4, rtol=0)
    np.testing.assert_allclose(blocked[1], whole[1], atol=1e-4, rtol=0)
    # Also with cached keys in front (chunked prefill of a long second chunk).
    first, _ = model(ids[:, 10:], cache=model.prefill(ids[:, :10], 32, attention_mask=mask[:, :10])[1])
    monkeypatch.setattr(xla, "QUERY_CHUNK", 512)
    jax.clear_caches()
    expected, _ = model(ids[:, 10:], cache=model.prefill(ids[:, :10], 32, attention_mask=mask[:, :10])[1])
    np.testing.assert_allclose(first, expected, atol=1e-4, rtol=0)


# Dense stacks only: in a random mixture of experts a small change in a hidden
# state can flip a token's experts, which moves its logits by whole units.
@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "mistral_window", "gemma3_local_global"])
def test_int8_cache_prefill_chunks_and_decode_stay_close_to_the_float_cache(architecture):
    model = small_model(**ARCHITECTURES[architecture])
    ids = random_ids((2, 30), seed=3)
    runs = {}
    for dtype in ("float32", "int8"):
        cache = model.init_cache(2, 40, dtype=dtype)
        steps = []
        # A prompt, a second chunk that reads the first from the cache, then one token a step.
        for start, stop in [(0, 12), (12, 17), *((t, t + 1) for t in range(17, 30))]:
            logits, cache = model(ids[:, start:stop], cache=cache)
            steps.append(logits)
        runs[dtype] = np.concatenate(steps, axis=1)
    assert cache.keys.dtype == jnp.int8 and cache.key_scales.shape == cache.keys.shape[:-1]
    np.testing.assert_array_equal(runs["int8"][:, :12], runs["float32"][:, :12])  # nothing cached yet
    # Each key and value within half a step of 1/127 of its row's largest entry.
    largest = float(np.abs(runs["float32"]).max())
    np.testing.assert_allclose(runs["int8"], runs["float32"], atol=0.05 * largest, rtol=0)
    assert np.abs(runs["int8"] - runs["float32"]).max() > 0  # the integers were read


def test_int8_cache_holds_each_row_within_half_a_step_in_about_half_of_bfloat16s_bytes():
    model = small_model(seed=2, head_dim=128)
    ids = random_ids((2, 9), seed=4)
    _, exact = model(ids, cache=model.init_cache(2, 16, dtype="float32"))
    _, cache = model(ids, cache=model.init_cache(2, 16, dtype="int8"))
    for ints, scales, floats in ((cache.keys, cache.key_scales, exact.keys), (cache.values, cache.value_scales,
                                                                               exact.values)):
        written = np.asarray(ints[:, :, :, :9], np.float64) * np.asarray(scales[:, :, :, :9, None], np.float64)
        want = np.asarray(floats[:, :, :, :9], np.float64)
        step = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert (np.abs(written - want) <= step / 2 + 1e-6 * np.abs(want)).all()
    bfloat16 = model.init_cache(2, 16, dtype="bfloat16")
    int8_bytes = sum(a.nbytes for a in (cache.keys, cache.values, cache.key_scales, cache.value_scales))
    assert int8_bytes / (bfloat16.keys.nbytes + bfloat16.values.nbytes) == pytest.approx((128 + 4) / 256)


def test_int8_cache_decode_step_reads_it_in_place():
    model = small_model(seed=4, num_hidden_layers=8, hidden_size=64, num_attention_heads=4, head_dim=32)
    cache = model.init_cache(4, 1024, dtype="int8")
    state = DecodeState(cache, jnp.zeros(4, jnp.int32), jnp.zeros(4, bool), jax.random.key(0))
    compiled = _decode_step.lower(model, state, Sampling(), (), 0).compile().compiled
    memory = compiled.memory_analysis()
    cache_bytes = sum(a.nbytes for a in (cache.keys, cache.values, cache.key_scales, cache.value_scales))
    assert memory.alias_size_in_bytes >= cache_bytes
    # No dequantized copy: a float32 layer of this cache would be 4x its int8 bytes.
    assert memory.temp_size_in_bytes < cache_bytes / 8 / 8, (memory.temp_size_in_bytes, cache_bytes)
    assert "eqx_models_decode_attention" in compiled.as_text()


def test_generate_with_an_int8_cache_keeps_the_stories_greedy_text():
    from conftest import STORIES, require_fixture

    folder = require_fixture(STORIES)
    model = eqx_models.from_pretrained(folder)
    prompt = eqx_models.load_tokenizer(folder).encode("Once upon a time")
    float_tokens = eqx_models.generate(model, prompt, max_new_tokens=60)
    int8_tokens = eqx_models.generate(model, prompt, max_new_tokens=60, cache_dtype="int8")
    np.testing.assert_array_equal(int8_tokens, float_tokens)


def test_an_unknown_cache_dtype_names_the_ones_there_are():
    model = small_model()
    for dtype in ("int4", "int16", "fp8"):
        with pytest.raises(ValueError, match="float32, bfloat16, float16, float64, int8"):
            model.init_cache(1, 8, dtype=dtype)
    with pytest.raises(ValueError, match="int8"):
        eqx_models.generate(model, [1, 2], max_new_tokens=2, cache_dtype="q8_0")
    with pytest.raises(ValueError, match="64-bit mode"):
        model.init_cache(1, 8, dtype="float64")
    # int8 rows without their scales would be written as truncated floats: refused.
    unscaled = eqx.tree_at(lambda c: (c.key_scales, c.value_scales), model.init_cache(1, 8, dtype="int8"),
                           (None, None), is_leaf=lambda x: x is None)
    with pytest.raises(ValueError, match="keys are int8 without key_scales"):
        model(random_ids((1, 2)), cache=unscaled)
