"""Sharded runs on 8 CPU devices; `tests/test_sharding.py` runs this file in its own
pytest session with `XLA_FLAGS=--xla_force_host_platform_device_count=8`."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_checkpoint, tiny_config
from test_published_configs import LLAMA_3_1_70B, QWEN3_30B_A3B
from zoo import tiny_overrides
from eqx_models import from_pretrained, generate, supported_model_types
from eqx_models.checkpoint import leaf_name
from eqx_models.generation import trace_counts
from eqx_models.models import architecture_for
from eqx_models.memory import memory_plan
from eqx_models.sharding import logical_axes

DENSE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
    head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
)
MOE = dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
MODELS = {
    "qwen3": ("qwen3", DENSE),
    "qwen3_moe": ("qwen3_moe", MOE),
    "qwen3_two_kv_heads": ("qwen3", dict(DENSE, num_key_value_heads=2)),
    "qwen3_moe_mixed": ("qwen3_moe", dict(MOE, mlp_only_layers=[0])),  # a dense and a sparse layer
}
# name -> mesh shape, the specs some weights must get, the KV cache's spec.
PRESETS = {
    "dp8": (
        {"data": 8},
        {"self_attn.q_proj.weight": P(), "embed_tokens.weight": P()},
        P(None, "data"),
    ),
    "fsdp8": (
        {"fsdp": 8},
        {"self_attn.q_proj.weight": P(None, None, "fsdp"), "self_attn.o_proj.weight": P(None, "fsdp"),
         "embed_tokens.weight": P(None, "fsdp")},
        P(None, "fsdp"),
    ),
    "tp2_dp4": (
        {"data": 4, "tensor": 2},
        {"self_attn.q_proj.weight": P(None, "tensor"), "self_attn.k_proj.weight": P(None, "tensor"),
         "self_attn.o_proj.weight": P(None, None, "tensor"), "mlp.down_proj.weight": P(None, None, "tensor"),
         "mlp.experts.gate_proj.weight": P(None, None, "tensor"), "embed_tokens.weight": P("tensor")},
        P(None, "data", "tensor"),
    ),
    "tp4_fsdp2": (
        {"fsdp": 2, "tensor": 4},
        {"self_attn.q_proj.weight": P(None, "tensor", "fsdp"), "self_attn.o_proj.weight": P(None, "fsdp", "tensor"),
         "mlp.up_proj.weight": P(None, "tensor", "fsdp"), "lm_head.weight": P("tensor", "fsdp")},
        P(None, "fsdp", "tensor"),
    ),
    "ep4_dp2": (
        {"data": 2, "expert": 4},
        {"mlp.experts.down_proj.weight": P(None, "expert"), "self_attn.q_proj.weight": P()},
        P(None, ("data", "expert")),
    ),
}
CASES = [
    ("qwen3", "dp8"), ("qwen3", "fsdp8"), ("qwen3", "tp2_dp4"), ("qwen3", "tp4_fsdp2"),
    ("qwen3_moe", "dp8"), ("qwen3_moe", "fsdp8"), ("qwen3_moe", "tp2_dp4"), ("qwen3_moe", "tp4_fsdp2"),
    ("qwen3_moe", "ep4_dp2"),
    ("qwen3_two_kv_heads", "tp4_fsdp2"),
]
NEW_TOKENS = 24
DECODE_STEPS = 4


def test_eight_devices():
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def prompts(rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts of different lengths."""
    rng = np.random.default_rng(0)
    lengths = [12, 5, 9, 12, 1, 7, 12, 3][:rows]
    ids = np.zeros((rows, 12), np.int32)
    mask = np.zeros((rows, 12), np.int32)
    for row, length in enumerate(lengths):
        ids[row, 12 - length:] = rng.integers(0, 128, length)
        mask[row, 12 - length:] = 1
    return ids, mask


@eqx.filter_jit
def prefill(model, ids, cache, mask):
    return model(ids, cache, mask)


@eqx.filter_jit
def decode(model, ids, cache):
    return model(ids, cache)


def run(model, ids, mask) -> dict[str, np.ndarray]:
    """Full-pass logits, greedy tokens, and logits of a prefill into `init_cache`'s
    cache followed by single-token steps."""
    logits, _ = model(ids, attention_mask=mask)
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    cache = model.init_cache(ids.shape[0], 32)
    step, cache = prefill(model, ids, cache, mask)
    stepwise = [step[:, -1]]
    for i in range(DECODE_STEPS):
        step, cache = decode(model, tokens[:, i : i + 1], cache)
        stepwise.append(step[:, -1])
    return {"logits": np.asarray(logits), "tokens": tokens, "stepwise": np.asarray(jnp.stack(stepwise, 1)),
            "cache": cache}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per model: its checkpoint folder and the single-device results."""
    ids, mask = prompts()
    out = {}
    for name, (model_type, overrides) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        make_checkpoint(folder, tiny_config(model_type, **overrides))
        single = from_pretrained(folder, dtype=jnp.float32)
        out[name] = (folder, run(single, ids, mask))
    return out


def mesh_of(shape: dict[str, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(tuple(shape.values()), tuple(shape))


@pytest.mark.parametrize("model_name,preset", CASES)
def test_sharded_run_equals_single_device(references, model_name, preset):
    folder, expected = references[model_name]
    shape, weight_specs, cache_spec = PRESETS[preset]
    mesh = mesh_of(shape)
    model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh)  # the pinned entry point: default rules
    ids, mask = prompts()

    # Every parameter carries the sharding its logical axes ask for; the table above
    # pins the intended layout for the weights that show each preset.
    params = eqx.filter(model, eqx.is_array)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    axes = jax.tree.leaves(logical_axes(params), is_leaf=lambda x: isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))
    checked = set()
    for (path, leaf), names in zip(leaves, axes):
        name = leaf_name(path)
        spec = leaf.sharding.spec
        for suffix, wanted in weight_specs.items():
            if name.endswith(suffix) and not (model_name == "qwen3_two_kv_heads" and "k_proj" in suffix):
                assert spec == wanted, f"{name}: {spec} != {wanted}"
                checked.add(suffix)
        assert spec == model.placement.spec(names, leaf.shape), name
        # Each device holds exactly its block: no full copy of a split tensor.
        block = NamedSharding(mesh, spec).shard_shape(leaf.shape)
        for shard in leaf.addressable_shards:
            assert shard.data.shape == block, name
        assert len(leaf.addressable_shards) == 8
    assert checked == {s for s in weight_specs if any(leaf_name(p).endswith(s) for p, _ in leaves)} - (
        {"self_attn.k_proj.weight"} if model_name == "qwen3_two_kv_heads" else set()
    )
    if model_name == "qwen3_two_kv_heads":
        # Two KV heads over four tensor devices: replicated along tensor (not padded).
        assert model.model.layers.self_attn.k_proj.weight.sharding.spec == P(None, None, "fsdp")
        cache_spec = P(None, "fsdp")

    before = dict(trace_counts())
    got = run(model, ids, mask)
    assert np.max(np.abs(got["logits"] - expected["logits"])) < 1e-4
    assert np.max(np.abs(got["stepwise"] - expected["stepwise"])) < 1e-4
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])
    for part in ("keys", "values"):
        leaf = getattr(got["cache"], part)
        assert leaf.sharding.spec == cache_spec, f"cache {part}: {leaf.sharding.spec}"
        block = NamedSharding(mesh, cache_spec).shard_shape(leaf.shape)
        assert all(shard.data.shape == block for shard in leaf.addressable_shards)

    # One prefill and one decode compilation for this layout; more tokens reuse them.
    after = dict(trace_counts())
    assert after["decode"] - before.get("decode", 0) == 1
    generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS - 4, eos_token_id=[])
    assert dict(trace_counts()) == after


@pytest.mark.parametrize("preset,shape", [("tp", {"data": 4, "tensor": 2}), ("ep", {"data": 2, "expert": 4}),
                                          ("fsdp", {"fsdp": 8}), ("dp", {"data": 2, "tensor": 4})])
def test_named_presets_lay_out_only_their_axes(references, preset, shape):
    folder, expected = references["qwen3_moe"]
    model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(shape), sharding=preset)
    layers = model.model.layers
    q, experts = layers.self_attn.q_proj.weight.sharding.spec, layers.mlp.experts.up_proj.weight.sharding.spec
    assert (q, experts) == {
        "tp": (P(None, "tensor"), P(None, None, "tensor")),
        "ep": (P(), P(None, "expert")),
        "fsdp": (P(None, None, "fsdp"), P(None, None, None, "fsdp")),
        "dp": (P(), P()),
    }[preset]
    ids, mask = prompts()
    logits, _ = model(ids, attention_mask=mask)
    assert np.max(np.abs(np.asarray(logits) - expected["logits"])) < 1e-4


@pytest.mark.parametrize("model_name,shape,rules,rows", [
    ("qwen3_moe", {"data": 4, "tensor": 2}, {"batch": "data", "experts": "tensor"}, 8),  # experts over tensor
    ("qwen3_moe", {"data": 4, "tensor": 2}, {"batch": ("data", "tensor"), "mlp": "tensor"}, 8),  # shared axis
    ("qwen3_moe", {"data": 2, "expert": 4}, None, 6),  # 6 rows: split over data only
    ("qwen3_moe_mixed", {"data": 2, "expert": 4}, None, 8),
    ("qwen3_moe_mixed", {"fsdp": 2, "tensor": 2, "expert": 2}, None, 8),
    ("qwen3", {"data": 8}, None, 5),  # 5 rows over 8: replicated
])
def test_other_layouts_equal_single_device(references, model_name, shape, rules, rows):
    folder, _ = references[model_name]
    ids, mask = prompts(rows)
    single = from_pretrained(folder, dtype=jnp.float32)
    model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(shape), sharding=rules)
    expected, got = run(single, ids, mask), run(model, ids, mask)
    assert np.max(np.abs(got["logits"] - expected["logits"])) < 1e-4
    assert np.max(np.abs(got["stepwise"] - expected["stepwise"])) < 1e-4
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])


@pytest.mark.parametrize("model_name,shape", [
    ("qwen3_moe", {"data": 2, "expert": 4}), ("qwen3_moe", {"data": 4, "tensor": 2}), ("qwen3", {"fsdp": 2, "tensor": 4}),
])
def test_loss_and_gradients_on_a_mesh_equal_single_device(references, model_name, shape):
    from eqx_models import causal_lm_loss

    folder, _ = references[model_name]
    ids, mask = prompts()
    labels = np.where(mask == 1, ids, -100)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(causal_lm_loss))
    loss, grads = grad(from_pretrained(folder, dtype=jnp.float32), ids, labels, mask)
    mesh_loss, mesh_grads = grad(from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(shape)), ids, labels, mask)
    assert abs(float(mesh_loss) - float(loss)) < 1e-5
    for a, b in zip(jax.tree.leaves(eqx.filter(mesh_grads, eqx.is_array)), jax.tree.leaves(eqx.filter(grads, eqx.is_array))):
        assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1e-4 * max(np.max(np.abs(np.asarray(b))), 1e-6)


@pytest.mark.parametrize("model_name,shape,rules", [
    ("qwen3_moe", {"data": 2, "expert": 4}, None),  # each device its experts; ids of others' sorted last
    ("qwen3_moe", {"data": 4, "tensor": 2}, None),  # each device a slice of every expert's width
    ("qwen3_moe_mixed", {"fsdp": 2, "tensor": 2, "expert": 2}, None),
])
def test_grouped_experts_on_a_mesh_equal_the_cpus_blocks(references, model_name, shape, rules, monkeypatch):
    """The experts as a GPU's backend runs them (grouped products over every
    assignment, XLA's ragged dot; the TPU's differ only in the kernel), per device
    inside `shard_map`, against the CPU's block loop on one device; and their
    gradients."""
    from eqx_models import causal_lm_loss
    from eqx_models.ops import groups_experts

    folder, expected = references[model_name]
    ids, mask = prompts()
    labels = np.where(mask == 1, ids, -100)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(causal_lm_loss))
    loss, grads = grad(from_pretrained(folder, dtype=jnp.float32), ids, labels, mask)
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    try:
        assert groups_experts(jnp.zeros((8, 4, 4)))  # [experts, out, in]
        model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(shape), sharding=rules)
        got = run(model, ids, mask)
        assert np.max(np.abs(got["logits"] - expected["logits"])) < 1e-4
        assert np.max(np.abs(got["stepwise"] - expected["stepwise"])) < 1e-4
        np.testing.assert_array_equal(got["tokens"], expected["tokens"])
        mesh_loss, mesh_grads = grad(model, ids, labels, mask)
    finally:
        jax.clear_caches()  # programs traced for another backend must not serve the CPU's calls
    assert abs(float(mesh_loss) - float(loss)) < 1e-5
    for a, b in zip(jax.tree.leaves(eqx.filter(mesh_grads, eqx.is_array)), jax.tree.leaves(eqx.filter(grads, eqx.is_array))):
        assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1e-4 * max(np.max(np.abs(np.asarray(b))), 1e-6)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_architecture_on_a_tensor_and_data_parallel_mesh_equals_one_device(model_type, tmp_path):
    """Each registered family (its tiny config, tests/zoo.py) split over tensor x data:
    heads, MLP and the layer's own projections over `tensor`, the batch over `data`."""
    make_checkpoint(tmp_path, tiny_config(model_type, **tiny_overrides(model_type)))
    single = from_pretrained(tmp_path, dtype=jnp.float32)
    model = from_pretrained(tmp_path, dtype=jnp.float32, mesh=mesh_of({"data": 4, "tensor": 2}))
    ids, mask = prompts()
    ids = ids % single.config.vocab_size
    expected, got = run(single, ids, mask), run(model, ids, mask)
    assert np.max(np.abs(got["logits"] - expected["logits"])) < 1e-4
    assert np.max(np.abs(got["stepwise"] - expected["stepwise"])) < 1e-4
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])
    split = [leaf for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)) if "tensor" in str(leaf.sharding.spec)]
    assert split  # something really is split over tensor


@pytest.mark.parametrize("model_name,shape,quantize", [
    ("qwen3", {"data": 4, "tensor": 2}, "int8"),
    ("qwen3", {"fsdp": 2, "tensor": 4}, dict(bits=4, group_size=32, mode="affine")),
    ("qwen3_moe", {"data": 4, "tensor": 2}, "int4"),
    ("qwen3_moe", {"data": 2, "expert": 4}, "int8"),  # quantized experts in the expert-parallel path
])
def test_a_model_quantized_while_loading_onto_a_mesh_equals_one_device(references, model_name, shape, quantize):
    from eqx_models.quantization import QuantizedWeight, with_activations

    folder, _ = references[model_name]
    mesh = mesh_of(shape)
    single = from_pretrained(folder, dtype=jnp.float32, quantize=quantize)
    model = from_pretrained(folder, dtype=jnp.float32, quantize=quantize, mesh=mesh)
    is_q = lambda n: isinstance(n, QuantizedWeight)
    weights = [w for w in jax.tree.leaves(model, is_leaf=is_q) if is_q(w)]
    assert len(weights) == len([w for w in jax.tree.leaves(single, is_leaf=is_q) if is_q(w)]) > 0
    split = 0
    for w in weights:
        # Integers, scales (and biases) split alike, each device holding whole groups.
        specs = {a.sharding.spec for a in jax.tree.leaves(w)}
        assert len(specs) == 1, specs
        packed, scales = w.packed.addressable_shards[0].data, w.scales.addressable_shards[0].data
        assert packed.shape[:-1] == scales.shape[:-1]
        assert packed.shape[-1] * 8 // w.bits == scales.shape[-1] * w.group_size
        split += "tensor" in str(specs) or "expert" in str(specs)
    assert split  # some really are split
    ids, mask = prompts()
    # With float activations both compute the dequantized weights' products.
    got = np.asarray(with_activations(model, "float")(ids, attention_mask=mask)[0])
    want = np.asarray(with_activations(single, "float")(ids, attention_mask=mask)[0])
    assert np.max(np.abs(got - want)) < 1e-4
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(tokens, generate(single, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[]))


def int8_rows_that_differ(got, want, unrounded=None) -> np.ndarray:
    """The batch rows where int8 caches `got` and `want` store different codes.

    A mesh computes keys and values about 1e-6 away from one device (its matmuls and
    expert sums run over other shapes), and that flips the rounding of a value lying
    within that of a half step: one code step, about 1% of its head's largest
    value. So codes may differ by one step, and (given `unrounded`, the float
    cache of the same tokens) only where the value lies at a half step; scales
    agree to float32 rounding.
    """
    rows = np.zeros(got.keys.shape[1], bool)  # [layers, batch, kv_heads, slots, head_dim]
    for name in ("keys", "values"):
        codes = np.asarray(getattr(got, name)).astype(np.int32)
        expected = np.asarray(getattr(want, name)).astype(np.int32)
        scales = np.asarray(getattr(want, name[:-1] + "_scales"))
        np.testing.assert_allclose(np.asarray(getattr(got, name[:-1] + "_scales")), scales, rtol=1e-5, atol=1e-9)
        flipped = codes != expected
        assert np.all(np.abs(codes - expected) <= 1), f"{name}: codes more than one step apart"
        if unrounded is not None and flipped.any():
            steps = np.asarray(getattr(unrounded, name)) / np.where(scales > 0, scales, 1)[..., None]
            off_half = np.abs(np.abs(steps - np.floor(steps)) - 0.5)
            assert np.all(off_half[flipped] < 1e-3), f"{name}: a code differs away from a half step"
        rows |= flipped.any(axis=(0, 2, 3, 4))
    return rows


@pytest.mark.parametrize("model_name,preset", [("qwen3", "tp2_dp4"), ("qwen3", "tp4_fsdp2"), ("qwen3_moe", "ep4_dp2")])
def test_an_int8_kv_cache_on_a_mesh_equals_one_device(references, model_name, preset):
    """The int8 cache and its per-row scales split like a float cache (the scales
    without the head_dim axis), prefill stores the codes one device stores, and a
    decode step from the same cache gives one device's logits."""
    folder, _ = references[model_name]
    shape, _, cache_spec = PRESETS[preset]
    mesh = mesh_of(shape)
    single = from_pretrained(folder, dtype=jnp.float32)
    model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh)
    ids, mask = prompts()
    empty = lambda model, dtype="int8": model.init_cache(ids.shape[0], 32, dtype=dtype)

    # Prefill attends to its float keys and values; the cache holds them rounded.
    got, cache = prefill(model, ids, empty(model), mask)
    want, expected = prefill(single, ids, empty(single), mask)
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) < 1e-4
    _, unrounded = prefill(single, ids, empty(single, jnp.float32), mask)
    int8_rows_that_differ(cache, expected, unrounded)
    assert cache.keys.dtype == jnp.int8 and cache.key_scales.dtype == jnp.float32
    for name in ("keys", "values", "key_scales", "value_scales"):
        leaf = getattr(cache, name)
        assert leaf.sharding.spec == cache_spec, f"cache {name}: {leaf.sharding.spec}"
        block = NamedSharding(mesh, cache_spec).shard_shape(leaf.shape)
        assert all(shard.data.shape == block for shard in leaf.addressable_shards)

    # Each step starts both from the mesh's cache. A row whose new codes differ (at
    # a half step, see above) has its logits one code step apart; the others agree.
    compared = 0
    for i in range(DECODE_STEPS):
        token = jnp.full((ids.shape[0], 1), i + 3, jnp.int32)
        got, next_cache = decode(model, token, cache)
        want, expected = decode(single, token, jax.device_put(cache, jax.devices()[0]))
        same = ~int8_rows_that_differ(next_cache, expected)
        assert np.max(np.abs(np.asarray(got) - np.asarray(want))[same]) < 1e-4
        assert next_cache.keys.sharding.spec == cache_spec
        compared += same.sum()
        cache = next_cache
    assert compared >= DECODE_STEPS * ids.shape[0] // 2, "int8 codes differ in most rows"
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[], cache_dtype="int8")
    np.testing.assert_array_equal(
        tokens, generate(single, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[], cache_dtype="int8"))


PUBLISHED = {"qwen3_30b_a3b": QWEN3_30B_A3B, "llama_3_1_70b": LLAMA_3_1_70B}


@pytest.mark.parametrize("name,shape", [
    ("qwen3_30b_a3b", {"expert": 4}),
    ("qwen3_30b_a3b", {"tensor": 4, "expert": 2}),
    ("llama_3_1_70b", {"tensor": 8}),
    ("llama_3_1_70b", {"fsdp": 8}),
])
def test_memory_plan_equals_the_sum_of_shard_sizes(name, shape):
    from eqx_models.nn.causal_lm import CausalLM
    from eqx_models.sharding import placement_for, shardings

    hf = PUBLISHED[name]
    config = architecture_for(hf).config_from_hf(hf)
    plan = memory_plan(config, shape, dtype=jnp.bfloat16, batch_size=8, max_length=4096)
    devices = math.prod(shape.values())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(tuple(shape.values())), tuple(shape))
    placement = placement_for(config, mesh)
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    # JAX's own block shapes for the shardings of every leaf, summed.
    blocks = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * 2, skeleton, shardings(skeleton, placement),
                          is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    assert plan["parameter_bytes_per_device"] == sum(jax.tree.leaves(blocks))
    assert plan["parameter_bytes"] == sum(math.prod(s.shape) * 2 for s in jax.tree.leaves(skeleton))
    print(name, shape, f"{plan['parameter_bytes_per_device'] / 1e9:.2f} GB per device of {plan['parameter_bytes'] / 1e9:.2f}")


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("preset, pool_spec", [("tp2_dp4", P(None, None, "tensor")), ("dp8", P())])
def test_the_serving_engine_on_a_mesh_serves_what_one_device_generates(references, preset, pool_spec, ragged):
    """The engine over a model placed on a mesh: its page pools split by key/value
    heads as the rules split a paged cache (never by pages), and both kinds of step
    give the greedy tokens `generate` gives on one device."""
    from conftest import STORIES, require_fixture

    from eqx_models import load_tokenizer
    from eqx_models.serving import Engine, SamplingParams

    folder, _ = references["qwen3"]
    single = from_pretrained(folder, dtype=jnp.float32)
    model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(PRESETS[preset][0]))
    tokenizer = load_tokenizer(require_fixture(STORIES))  # any tokenizer: the outputs are compared as ids
    rng = np.random.default_rng(3)
    prompts_ids = [rng.integers(0, 128, length).tolist() for length in (9, 3, 14, 6, 1)]
    lengths = [7, 12, 4, 9, 5]
    want = [generate(single, p, max_new_tokens=n, eos_token_id=[])[0].tolist() for p, n in zip(prompts_ids, lengths)]
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=48,
                    ragged_steps=ragged)
    for pool in engine.pools[:2]:
        assert pool.sharding.spec == pool_spec and len(pool.addressable_shards) == 8
    outs = engine.generate(prompts_ids, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    assert [out.token_ids for out in outs] == want
    assert engine.pools[0].sharding.spec == pool_spec  # the steps keep the pools where they are


def test_the_engine_sizes_its_pool_by_what_each_device_holds_of_a_page(references, monkeypatch):
    """With the device's memory reported (made up here: the CPU reports none), a pool
    split over 2 devices by key/value heads gets about twice the pages of a pool
    every device holds whole, in the same share of memory."""
    from conftest import STORIES, require_fixture

    import eqx_models.serving.engine as engine_module
    from eqx_models import load_tokenizer
    from eqx_models.serving import Engine

    limit = 64 << 20
    monkeypatch.setattr(engine_module, "free_bytes", lambda devices: (limit, limit, list(devices)[0]))
    folder, _ = references["qwen3"]
    tokenizer = load_tokenizer(require_fixture(STORIES))
    pages = {}
    for preset in ("dp8", "tp2_dp4"):
        model = from_pretrained(folder, dtype=jnp.float32, mesh=mesh_of(PRESETS[preset][0]))
        engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=32, page_size=4,
                        memory_utilization=0.5)
        pages[preset] = engine.allocator.num_pages
        held = engine.pools[0].addressable_shards[0].data.nbytes + engine.pools[1].addressable_shards[0].data.nbytes
        assert held <= limit // 2  # what one device holds of the pools fits its share
    assert pages["tp2_dp4"] > 1.8 * pages["dp8"], pages  # less the largest step's temporaries, smaller split


def test_the_server_on_a_mesh_answers_what_one_device_generates(tmp_path):
    """`eqx-models serve --mesh data=4,tensor=2` over the 8 devices: a greedy
    completion equals `generate` on one device; a mesh of the wrong size is refused
    with the sizes before anything loads."""
    import subprocess
    import sys

    from conftest import STORIES, require_fixture
    from test_serve import Served

    from eqx_models import load_tokenizer

    path = require_fixture(STORIES)
    single, tokenizer = from_pretrained(path), load_tokenizer(path)
    prompt = tokenizer.encode("Once upon a time")
    want = generate(single, prompt, max_new_tokens=16, eos_token_id=[])[0].tolist()
    with open(tmp_path / "server.log", "w+") as log:
        served = Served(str(path), "--served-model-name", "stories", "--page-size", "4", "--max-num-seqs", "4",
                        "--mesh", "data=4,tensor=2", log=log)
        try:
            response = served.client.completions.create(model="stories", prompt=prompt, max_tokens=16, temperature=0,
                                                        extra_body={"ignore_eos": True})
        finally:
            assert served.close()
    assert response.choices[0].text == tokenizer.decode(prompt + want)[len(tokenizer.decode(prompt)):]
    refused = subprocess.run([sys.executable, "-m", "eqx_models.cli", "serve", str(path), "--mesh", "tensor=3"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "tensor=3 has 3 devices but 8 are here" in refused.stderr
