"""The TPU backend's Pallas kernels against the reference ops, run by Pallas'
interpreter (on the CPU, in CI); on the chip itself `benchmarks/tpu_check.py`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_models.backends import xla
from eqx_models.backends.tpu import attention, experts, paged, quantized, splash
from eqx_models.quantized import quantize_weight


def _case(rng, layers, batch, kv_heads, groups, kv_seq, head_dim, dtype, starts, ends):
    """Random query and caches; row `b` may see slots `[starts[b], ends[b])`."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    slots = np.arange(kv_seq)
    valid = jnp.asarray([(slots >= s) & (slots < e) for s, e in zip(starts, ends)])
    return dict(
        query=normal(batch, kv_heads, groups, head_dim),
        key_stack=normal(layers, batch, kv_heads, kv_seq, head_dim).astype(dtype),
        value_stack=normal(layers, batch, kv_heads, kv_seq, head_dim).astype(dtype),
        valid=valid,
        new_key=normal(batch, kv_heads, head_dim).astype(dtype),
        new_value=normal(batch, kv_heads, head_dim).astype(dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    "kv_seq, starts, ends",
    [
        (256, [0, 5, 130], [129, 256, 131]),  # a prefix, left padding, one slot
        (1024, [0, 300, 513], [1024, 700, 1000]),  # blocks of 512 skipped before and after
        (384, [0, 10, 383], [384, 128, 384]),  # blocks of 128
    ],
)
def test_decode_attention_reads_live_blocks_and_equals_the_reference(dtype, with_sinks, kv_seq, starts, ends):
    rng = np.random.default_rng(kv_seq + len(starts))
    case = _case(rng, 3, len(starts), 2, 4, kv_seq, 128, dtype, starts, ends)
    self_valid = jnp.asarray([True, False, True])
    sinks = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32) if with_sinks else jnp.full((2, 4), -jnp.inf)
    args = (case["query"], case["key_stack"], case["value_stack"], jnp.int32(1), case["valid"], self_valid,
            case["new_key"], case["new_value"], sinks)
    got = attention.decode_attention(*args, 0.125, interpret=True)
    none = jnp.zeros((0,), jnp.float32)
    want = xla.decode_attention(*args, none, none, 0.125)
    assert got.shape == want.shape == (3, 2, 4, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_a_row_with_nothing_to_attend_to_gets_zeros_not_nan():
    rng = np.random.default_rng(0)
    case = _case(rng, 1, 2, 1, 2, 256, 128, jnp.float32, [0, 0], [40, 0])
    args = (case["query"], case["key_stack"], case["value_stack"], jnp.int32(0), case["valid"],
            jnp.asarray([True, False]), case["new_key"], case["new_value"], jnp.full((1, 2), -jnp.inf))
    got = np.asarray(attention.decode_attention(*args, 0.1, interpret=True))
    assert np.isfinite(got).all() and not got[1].any()


def test_live_blocks_are_each_rows_first_and_last_valid_block():
    valid = np.zeros((3, 1024), bool)
    valid[0, 10:20] = True
    valid[1, 600:1024] = True
    first, last = attention.live_blocks(jnp.asarray(valid), 256)
    assert first.tolist() == [0, 2, 0] and last.tolist() == [0, 3, 0]


@pytest.mark.parametrize("kv_seq, block", [(1024, 512), (768, 256), (384, 128), (200, None), (64, None)])
def test_block_size_divides_the_cache(kv_seq, block):
    assert attention.block_for(kv_seq) == block


def test_caches_the_kernel_does_not_take_go_to_the_reference():
    query = jnp.zeros((1, 2, 2, 128))
    keys = jnp.zeros((1, 1, 2, 2048, 128), jnp.bfloat16)
    none = jnp.zeros((0,), jnp.float32)
    assert attention.fits(query, keys, keys + 1, jnp.zeros((1, 2, 128)), none, none)
    assert not attention.fits(query, keys, keys, jnp.zeros((1, 2, 128)), none, none)  # values are the keys (MLA)
    assert not attention.fits(query, keys.astype(jnp.int8), keys.astype(jnp.int8), jnp.zeros((1, 2, 128)),
                              jnp.ones((1, 1, 2, 2048)), jnp.ones((1, 1, 2, 2048)))  # int8 with scales
    assert not attention.fits(query, keys[..., :200, :], keys[..., :200, :] + 1, jnp.zeros((1, 2, 128)), none, none)
    short = keys[..., :1024, :]  # two blocks: XLA's attention over the whole cache is as fast
    assert not attention.fits(query, short, short + 1, jnp.zeros((1, 2, 128)), none, none)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows, sizes", [
    (40, [10, 0, 25, 3]),  # an empty group, two rows past the groups
    (5, [0, 0, 5, 0]),  # decode: a few rows, one expert
    (300, [128, 1, 100, 71]),  # more than one tile of rows
])
def test_grouped_matmul_reads_the_layers_experts_and_equals_the_reference(dtype, rows, sizes):
    rng = np.random.default_rng(rows)
    stack = jnp.asarray(rng.standard_normal((3, 4, 256, 384)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, 384)), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = experts.grouped_matmul(x, stack, jnp.int32(1), group_sizes, interpret=True)
    want = xla.grouped_matmul(x, stack, jnp.int32(1), group_sizes)
    assert got.shape == want.shape == (rows, 256) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=1e-3)
    assert not np.asarray(got)[sum(sizes):].any()  # rows past the groups are zeros, not leftovers


def test_grouped_matmul_gradients_equal_the_references():
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.standard_normal((2, 3, 128, 256)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.float32)
    group_sizes = jnp.asarray([9, 0, 13], jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)

    def loss(product):
        return lambda x, stack: jnp.sum(product(x, stack, jnp.int32(1), group_sizes) * cotangent)

    kernel = lambda *args: experts.grouped_matmul(*args, interpret=True)
    got = jax.grad(loss(kernel), argnums=(0, 1))(x, stack)
    want = jax.grad(loss(xla.grouped_matmul), argnums=(0, 1))(x, stack)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)
    assert not np.asarray(got[1])[0].any()  # the other layer's experts get no gradient


def _paged_case(rng, dtype, page_size, width, spans, self_valid):
    """Random pools and a query per row; row `b` owns `width` distinct pages and sees
    slots `[spans[b][0], spans[b][1])` of them."""
    layers, pages, kv_heads, groups, head_dim = 2, 3 * width + 4, 2, 3, 128
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    batch = len(spans)
    tables = jnp.asarray(np.stack([rng.permutation(pages)[:width] for _ in range(batch)]), jnp.int32)
    slots = np.arange(width * page_size)
    return (normal(batch, kv_heads, groups, head_dim),
            normal(layers, pages, kv_heads, page_size, head_dim).astype(dtype),
            normal(layers, pages, kv_heads, page_size, head_dim).astype(dtype), jnp.int32(1), tables,
            jnp.asarray([(slots >= a) & (slots < b) for a, b in spans]), jnp.asarray(self_valid),
            normal(batch, kv_heads, head_dim).astype(dtype), normal(batch, kv_heads, head_dim).astype(dtype),
            normal(kv_heads, groups))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size, width, spans", [
    (16, 12, [(0, 189), (5, 40), (0, 0), (17, 18)]),  # 8 pages a step: a second, partial step of pages
    (16, 20, [(200, 310), (130, 131), (0, 320)]),  # rows whose first live step is not the first (a window)
    (16, 3, [(0, 48), (20, 21)]),  # a table narrower than one step
    (32, 5, [(0, 160), (100, 150), (31, 33)]),  # a span across a page boundary
])
def test_paged_decode_attention_reads_each_rows_pages_and_equals_the_reference(dtype, page_size, width, spans):
    rng = np.random.default_rng(page_size + width)
    args = _paged_case(rng, dtype, page_size, width, spans, [b % 2 == 0 for b in range(len(spans))])
    none = jnp.zeros((0,), jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = paged.paged_decode_attention(*args, 0.088, interpret=True)
        want = xla.paged_decode_attention(*args, none, none, 0.088)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    assert not np.isnan(np.asarray(got)).any()


def test_paged_pools_the_kernel_does_not_take_go_to_the_reference():
    args = _paged_case(np.random.default_rng(0), jnp.float32, 16, 2, [(0, 4)], [True])
    query, keys, values, tables, new_value = args[0], args[1], args[2], args[4], args[8]
    none = jnp.zeros((0,), jnp.float32)
    assert paged.fits(query, keys, values, tables, new_value, none, none)
    assert not paged.fits(query, keys, keys, tables, new_value, none, none)  # values read from the keys
    assert not paged.fits(query, keys[..., :8, :], values[..., :8, :], tables, new_value, none, none)  # pages of 8
    wide = jnp.concatenate([keys] * 3, axis=3)  # pages of 48: a step of 2 pages is 96 slots, not whole lanes
    assert not paged.fits(query, wide, wide + 1, tables, new_value, none, none)
    huge = jnp.zeros((64, paged.MAX_TABLE_ENTRIES // 64 + 1), jnp.int32)  # block tables beyond scalar memory
    assert not paged.fits(query, keys, values, huge, new_value, none, none)
    int8 = keys.astype(jnp.int8)
    assert not paged.fits(query, int8, int8 + 0, tables, new_value, jnp.ones(int8.shape[:-1]),
                          jnp.ones(int8.shape[:-1]))


def test_the_engine_on_the_tpu_backend_with_its_paged_kernel_serves_what_generate_gives(monkeypatch):
    """The TPU backend's choices with the paged decode kernel run by the interpreter:
    the engine's ragged steps (prompt chunks and decodes in one call) and its
    decode-only steps give the greedy tokens `generate` gives on the CPU."""
    from conftest import STORIES, release_compiled_code, require_fixture

    import eqx_models
    from eqx_models.backends.tpu import Tpu
    from eqx_models.serving import Engine, SamplingParams

    path = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)
    prompts = [tokenizer.encode(text) for text in ("Once upon a time", "The little dog", "A", "She said that the")]
    lengths = [12, 30, 5, 20]
    want = [eqx_models.generate(model, p, max_new_tokens=n, eos_token_id=[])[0].tolist()  # the new tokens
            for p, n in zip(prompts, lengths)]
    calls = []

    def through_kernel(query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks,
                       key_scales, value_scales, scale):
        assert paged.fits(query, key_pool, value_pool, block_tables, new_value, key_scales, value_scales)
        calls.append(block_tables.shape)
        return paged.paged_decode_attention(query, key_pool, value_pool, layer, block_tables, valid, self_valid,
                                            new_key, new_value, sinks, scale, interpret=True)

    release_compiled_code()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(Tpu, "paged_decode_attention", staticmethod(through_kernel))
    monkeypatch.setattr(Tpu, "ragged_paged_attention",
                        staticmethod(functools.partial(xla.ragged_paged_attention, decode=through_kernel)))
    try:
        engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=32, page_size=16, num_pages=32)
        outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    finally:
        release_compiled_code()
    assert engine.trace_counts["ragged"] and engine.trace_counts["decode"] and calls
    assert [out.token_ids for out in outs] == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_new_kernels_lower_for_the_tpu(dtype):
    """The paged decode and int8 product kernels lower to Mosaic for the TPU on this
    machine (`jax.export`): block shapes, scalar prefetch and the kernels' ops pass
    Pallas' TPU lowering (Mosaic's own compile needs the chip: `tpu_check.py`)."""
    from jax import export

    shape = jax.ShapeDtypeStruct
    batch, kv_heads, groups, head_dim, page_size, width, pages = 8, 8, 2, 128, 16, 72, 128
    pool = shape((2, pages, kv_heads, page_size, head_dim), dtype)
    paged_args = (shape((batch, kv_heads, groups, head_dim), jnp.float32), pool, pool, shape((), jnp.int32),
                  shape((batch, width), jnp.int32), shape((batch, width * page_size), jnp.bool_),
                  shape((batch,), jnp.bool_), shape((batch, kv_heads, head_dim), dtype),
                  shape((batch, kv_heads, head_dim), dtype), shape((kv_heads, groups), jnp.float32))
    lowered = export.export(jax.jit(lambda *a: paged.paged_decode_attention(*a, 0.088)), platforms=["tpu"])(*paged_args)
    assert "tpu_custom_call" in lowered.mlir_module()
    product = jax.jit(lambda x, q, s, layer: quantized.layer_product(x, q, s, layer, group_size=128))
    lowered = export.export(product, platforms=["tpu"])(
        shape((64, 2560), dtype), shape((2, 1024, 2560), jnp.int8), shape((20, 1024), jnp.float32), shape((), jnp.int32))
    assert "tpu_custom_call" in lowered.mlir_module()


def test_on_a_mesh_the_new_kernels_give_way_to_the_references(monkeypatch):
    """A Mosaic call is not split by the partitioner: a model laid out over several
    devices takes the reference ops (XLA splits those), never the int8 or paged kernel."""
    from eqx_models import sharding
    from eqx_models.backends.tpu import Tpu

    stack = _int8_stacks(np.random.default_rng(0), jnp.float32, "float")[0]
    x = jnp.zeros((4, 512), jnp.float32)
    mesh = sharding.Placement(jax.sharding.AbstractMesh((2,), ("tensor",)), sharding.resolve_rules(None))
    assert Tpu().reads_layers_in_place(x, stack)

    def refused(*args, **kwargs):
        raise AssertionError("a kernel was dispatched on a mesh")

    monkeypatch.setattr(jax.lax, "platform_dependent", refused)  # how the backend offers a kernel
    args = _paged_case(np.random.default_rng(1), jnp.float32, 16, 2, [(0, 20)], [True])
    none = jnp.zeros((0,), jnp.float32)
    with sharding.active(mesh):
        assert not Tpu().reads_layers_in_place(x, stack)
        got = Tpu.paged_decode_attention(*args, none, none, 0.088)
        Tpu.quantized_matvecs(x, (stack,), jnp.int32(0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla.paged_decode_attention(*args, none, none, 0.088)))


def _int8_stacks(rng, dtype, activations, layers=3, outs=(384, 256), inner=512):
    return tuple(
        quantize_weight(jnp.asarray(rng.standard_normal((layers, out, inner)) * 0.05, dtype), 8, 128,
                        scale_dtype=jnp.bfloat16, activations=activations)
        for out in outs
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("rows", [(1,), (2, 5), (300,)])  # a decode row, a small batch, more than one row tile
def test_int8_product_reads_the_layer_and_equals_the_reference(dtype, activations, rows):
    rng = np.random.default_rng(len(rows) + rows[0])
    stacks = _int8_stacks(rng, dtype, activations)
    # A bfloat16 model's activations are bfloat16 values (the kernel multiplies them as such).
    x = jnp.asarray(rng.standard_normal((*rows, 512)), dtype).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = quantized.quantized_matvecs(x, stacks, jnp.int32(1), interpret=True)
        want = xla.quantized_matvecs(x, stacks, jnp.int32(1))
    for g, w, stack in zip(got, want, stacks):
        assert g.shape == w.shape == (*rows, stack.shape[-2]) and g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_int8_product_over_several_blocks_of_weights_and_rows(monkeypatch):
    """Blocks of 128 output rows (a smaller block budget) and of 16 rows: every
    block's index maps, and the rows fetched again for each block of weights."""
    monkeypatch.setattr(quantized, "WEIGHT_BLOCK_BYTES", 128 * 512)
    monkeypatch.setattr(quantized, "ROW_BLOCK_BYTES", 16 * 512 * 2)
    rng = np.random.default_rng(9)
    stacks = _int8_stacks(rng, jnp.bfloat16, "float")
    assert quantized.out_tile(384, 512) == 128 and quantized.row_tile(40, 512, 2) == 16
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.bfloat16).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = quantized.quantized_matvecs(x, stacks, jnp.int32(2), interpret=True)
        want = xla.quantized_matvecs(x, stacks, jnp.int32(2))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_int8_product_gradients_equal_the_references():
    rng = np.random.default_rng(3)
    stacks = _int8_stacks(rng, jnp.float32, "float")
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
    cotangents = [jnp.asarray(rng.standard_normal((4, s.shape[-2])), jnp.float32) for s in stacks]

    def loss(product):
        def run(x, scales):
            swapped = tuple(eqx.tree_at(lambda s: s.scales, stack, new) for stack, new in zip(stacks, scales))
            return sum(jnp.sum(y * c) for y, c in zip(product(x, swapped, jnp.int32(2)), cotangents))
        return run

    kernel = lambda *args: quantized.quantized_matvecs(*args, interpret=True)
    scales = tuple(s.scales for s in stacks)
    got = jax.grad(loss(kernel), argnums=(0, 1))(x, scales)
    want = jax.grad(loss(xla.quantized_matvecs), argnums=(0, 1))(x, scales)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-5, rtol=1e-5)


def test_int8_formats_the_kernel_does_not_take_keep_the_reference():
    weight = jnp.asarray(np.random.default_rng(0).standard_normal((2, 256, 512)), jnp.float32)
    assert quantized.fits(quantize_weight(weight, 8, 128))
    assert not quantized.fits(quantize_weight(weight, 8, 32))  # groups narrower than the lanes
    assert not quantized.fits(quantize_weight(weight, 4, 128))  # int4
    assert not quantized.fits(quantize_weight(weight[:, :200], 8, 128))  # outputs not whole lanes
    assert not quantized.fits(weight)


@pytest.mark.parametrize("out, inner, tile", [(1024, 2560, 1024), (9728, 2560, 512), (2560, 9728, 256),
                                             (151936, 2560, 128)])
def test_int8_output_tiles_divide_the_outputs_within_the_block_budget(out, inner, tile):
    assert quantized.out_tile(out, inner) == tile
    assert out % tile == 0 and tile % 128 == 0


def test_an_int8_model_on_the_tpu_backend_decodes_as_on_the_cpu(checkpoint_factory, monkeypatch):
    """The TPU backend's choices with its int8 kernel run by the interpreter: a
    Qwen3 quantized in groups of 128 gives the CPU's logits and greedy tokens, and
    its decode products really went through the kernel."""
    from conftest import release_compiled_code

    import eqx_models
    from eqx_models.backends.tpu import Tpu

    folder, _ = checkpoint_factory("qwen3", hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=64)
    model = eqx_models.quantize(eqx_models.from_pretrained(folder), 8, group_size=128, activations="float")
    ids = np.random.default_rng(6).integers(0, model.config.vocab_size, (2, 12))
    want_logits, _ = model(ids)
    want_tokens = eqx_models.generate(model, ids, max_new_tokens=6, eos_token_id=[])
    calls = []

    def through_kernel(x, stacks, layer):
        assert all(quantized.fits(stack) for stack in stacks)
        calls.append(x.shape)
        return quantized.quantized_matvecs(x, stacks, layer, interpret=True)

    release_compiled_code()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(Tpu, "quantized_matvecs", staticmethod(through_kernel))
    try:
        logits, _ = model(ids)
        tokens = eqx_models.generate(model, ids, max_new_tokens=6, eos_token_id=[])
    finally:
        release_compiled_code()
    assert calls  # the products really went through the kernel
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))


def _prompt(rng, batch, kv_heads, groups, seq, head_dim, dtype):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    return normal(batch, kv_heads, groups, seq, head_dim), normal(batch, kv_heads, seq, head_dim), normal(
        batch, kv_heads, seq, head_dim)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window, softcap, packed", [
    (1 << 30, None, False),  # causal
    (100, None, False),  # a sliding window that is not a whole block
    (1 << 30, 30.0, True),  # soft cap, packed documents
])
def test_splash_attention_equals_the_reference_on_real_tokens(dtype, window, softcap, packed):
    rng = np.random.default_rng(window % 97)
    batch, kv_heads, groups, seq, head_dim = 2, 2, 2, 256, 128
    query, keys, values = _prompt(rng, batch, kv_heads, groups, seq, head_dim, dtype)
    mask = np.ones((batch, seq), np.int32)
    mask[1, :37] = 0  # left padding
    segments = jnp.asarray(np.repeat(np.arange(4), seq // 4)[None].repeat(batch, 0), jnp.int32) if packed else None
    args = (query, keys, values, jnp.asarray(mask), segments, window, 0.09, softcap)
    got = np.asarray(splash.causal_attention(*args, interpret=True), np.float32)
    want = np.asarray(xla.causal_attention(*args, None), np.float32)
    real = mask.astype(bool)[:, None, None, :, None]  # a padding query's output is padding
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_splash_attention_gradients_equal_the_references(dtype):
    # bfloat16 goes through the kernel traced at the default precision (`precision.py`).
    rng = np.random.default_rng(3)
    query, keys, values = _prompt(rng, 1, 1, 2, 256, 128, dtype)
    mask = jnp.ones((1, 256), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal(query.shape), jnp.float32)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)

    kernel = lambda q, k, v: splash.causal_attention(q, k, v, mask, None, 1 << 30, 0.09, None, interpret=True)
    reference = lambda q, k, v: xla.causal_attention(q, k, v, mask, None, 1 << 30, 0.09, None, None)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(query, keys, values)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(query, keys, values)
    tolerance = 1e-4 if dtype == jnp.float32 else 5e-2
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=tolerance, rtol=tolerance)


def test_a_model_whose_prompts_go_through_splash_matches_transformers(checkpoint_factory, monkeypatch):
    """The TPU backend's choices with its splash kernel run by the interpreter: a
    Qwen3 with 128-wide heads, left-padded prompts of 128 tokens, against
    `transformers` on the real tokens, and its greedy tokens."""
    import torch
    from conftest import release_compiled_code

    import eqx_models
    from eqx_models.backends.tpu import Tpu

    folder, reference = checkpoint_factory("qwen3", head_dim=128, num_key_value_heads=2)
    model = eqx_models.from_pretrained(folder)
    ids = np.random.default_rng(5).integers(0, reference.config.vocab_size, (2, 128))
    mask = np.ones((2, 128), np.int64)
    mask[1, :40] = 0
    with torch.no_grad():
        expected = reference(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()
        reference_tokens = reference.generate(torch.tensor(ids[:1]), attention_mask=torch.tensor(mask[:1]),
                                              max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 128:].numpy()
    calls = []

    def through_splash(query, keys, values, attention_mask, segment_ids, window, scale, softcap, sinks):
        assert splash.fits(query, keys, values, window, sinks)
        calls.append(query.shape)
        return splash.causal_attention(query, keys, values, attention_mask, segment_ids, window, scale, softcap,
                                       interpret=True)

    release_compiled_code()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(Tpu, "causal_attention", staticmethod(through_splash))
    try:
        logits, _ = model(ids, attention_mask=mask)
        tokens = eqx_models.generate(model, ids[:1], max_new_tokens=8, eos_token_id=[])
    finally:
        release_compiled_code()
    assert calls  # the prompts really went through the kernel
    real = mask.astype(bool)[..., None]
    np.testing.assert_allclose(np.where(real, np.asarray(logits), 0), np.where(real, expected, 0), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(tokens[0], reference_tokens)


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot in `jaxpr` and the jaxprs inside it (kernels' bodies too)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(inner, jax.extend.core.ClosedJaxpr):
                    found += _dot_precisions(inner.jaxpr)
                elif isinstance(inner, jax.extend.core.Jaxpr):
                    found += _dot_precisions(inner)
    return found


def _highest(precision) -> bool:
    return precision is not None and jax.lax.Precision.HIGHEST in (
        precision if isinstance(precision, tuple) else (precision,))


def test_16_bit_kernels_trace_at_default_precision_under_highest():
    # Mosaic refuses a 16-bit product at HIGHEST ("Bad lhs type" on the chip):
    # forward and backward, the kernels' dots must not ask for it.
    rng = np.random.default_rng(4)
    stack = jnp.asarray(rng.standard_normal((2, 3, 128, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    group_sizes = jnp.asarray([9, 0, 13], jnp.int32)
    grouped = lambda x, stack: jnp.sum(experts.grouped_matmul(x, stack, jnp.int32(1), group_sizes, interpret=True))
    query, keys, values = _prompt(rng, 1, 1, 2, 256, 128, jnp.bfloat16)
    mask = jnp.ones((1, 256), jnp.int32)
    prompt = lambda q, k, v: jnp.sum(
        splash.causal_attention(q, k, v, mask, None, 1 << 30, 0.09, None, interpret=True).astype(jnp.float32))
    with jax.default_matmul_precision("highest"):
        grouped_dots = _dot_precisions(jax.make_jaxpr(jax.grad(grouped, argnums=(0, 1)))(x, stack).jaxpr)
        splash_dots = _dot_precisions(jax.make_jaxpr(jax.grad(prompt, argnums=(0, 1, 2)))(query, keys, values).jaxpr)
        float32_dots = _dot_precisions(jax.make_jaxpr(grouped)(x.astype(jnp.float32), stack.astype(jnp.float32)).jaxpr)
        float32_dots += _dot_precisions(jax.make_jaxpr(prompt)(
            query.astype(jnp.float32), keys.astype(jnp.float32), values.astype(jnp.float32)).jaxpr)
    assert len(grouped_dots) >= 3 and len(splash_dots) >= 3  # the kernels' bodies were looked into
    assert not any(map(_highest, grouped_dots + splash_dots))
    assert all(map(_highest, float32_dots))  # float32 inputs keep the caller's precision
