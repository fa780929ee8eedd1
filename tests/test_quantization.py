"""Group-quantized weights: the formats' error bounds, the decode kernel against a
float64 product, and quantized models against the same models dequantized."""

import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import random_ids, small_model

import eqx_models
from eqx_models.generation import DecodeState, Sampling, _decode_step
from eqx_models.backends.cpu import kernels_status
from eqx_models.ops import quantized_matvecs
from eqx_models.nn.linear import Linear
from eqx_models.quantization import (
    QuantizedWeight,
    dequantize,
    is_expert_stack,
    quantize,
    quantize_activations,
    quantize_weight,
    unpack_int4,
)

is_quantized = lambda node: isinstance(node, QuantizedWeight)


def dequantized(model):
    """`model` with every quantized weight replaced by its float value."""
    return jax.tree.map(lambda n: n.dequantize() if is_quantized(n) else n, model, is_leaf=is_quantized)


def heavy_tailed(shape, seed=0):
    # Outliers in some groups: scales that differ by orders of magnitude.
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_t(3, shape).astype(np.float32) * 0.05)


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int8_error_is_at_most_half_a_step(group_size, scale_dtype):
    w = heavy_tailed((3, 16, 256))  # a stack of 3 layers
    q = quantize_weight(w, 8, group_size, scale_dtype=scale_dtype)
    assert q.packed.dtype == jnp.int8 and q.packed.shape == (3, 16, 256)
    assert q.scales.dtype == scale_dtype and q.scales.shape == (3, 16, 256 // group_size)
    step = np.repeat(np.asarray(q.scales, np.float32), group_size, axis=-1)
    amax = np.repeat(np.abs(np.asarray(w)).reshape(3, 16, -1, group_size).max(-1), group_size, axis=-1)
    # Half a step, plus what rounding the scale down cuts off the largest value.
    bound = 0.5 * step + np.maximum(amax - 127 * step, 0) + 1e-7
    error = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    assert (error <= bound).all(), float((error - bound).max())
    assert np.asarray(q.packed).min() >= -127


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step_but_at_the_clipped_end(group_size, scale_dtype):
    w = heavy_tailed((16, 512), seed=1)
    q = quantize_weight(w, 4, group_size, scale_dtype=scale_dtype)
    assert q.packed.dtype == jnp.uint8 and q.packed.shape == (16, 256) and q.shape == (16, 512)
    step = np.abs(np.repeat(np.asarray(q.scales, np.float32), group_size, axis=-1))
    ratio = np.asarray(w) / np.repeat(np.asarray(q.scales, np.float32), group_size, axis=-1)
    # The value of largest magnitude maps to -8; its opposite would be +8 and clips to 7.
    bound = np.where(ratio > 7.5, step, 0.5 * step) * (1 + 1e-3) + 1e-7
    error = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    assert (error <= bound).all(), float((error - bound).max())
    q_ints = np.asarray(unpack_int4(q.packed, group_size))
    assert q_ints.min() == 0 and q_ints.max() <= 15


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_int4_error_is_at_most_half_a_step_plus_the_rounding_of_the_bias(group_size, scale_dtype):
    w = heavy_tailed((2, 16, 512), seed=2) + 0.03  # lopsided groups, where a bias helps
    q = quantize_weight(w, 4, group_size, scale_dtype=scale_dtype, mode="affine")
    assert q.mode == "affine" and q.biases.shape == q.scales.shape == (2, 16, 512 // group_size)
    assert q.biases.dtype == scale_dtype and q.packed.shape == (2, 16, 256)
    groups = np.asarray(w).reshape(2, 16, -1, group_size)
    low, high = groups.min(-1), groups.max(-1)
    bias, scale = np.asarray(q.biases, np.float32), np.asarray(q.scales, np.float32)
    # Inside the stored range, half a step; values beyond it (the rounding of the
    # bias and scale cut off an end) clip to the nearest end.
    top = bias + 15 * scale
    outside = np.maximum(np.maximum(bias - low, high - top), 0)
    bound = np.repeat(0.5 * scale + outside, group_size, axis=-1) * (1 + 1e-3) + 1e-7
    error = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    assert (error <= bound).all(), float((error - bound).max())
    symmetric = np.abs(np.asarray(quantize_weight(w, 4, group_size, scale_dtype=scale_dtype).dequantize()) - w)
    assert error.mean() < symmetric.mean()  # what the bias is for


def test_int4_packs_q4_0_order_two_weights_per_byte():
    # Group of 32: byte j holds weight j (low nibble) and weight j + 16 (high).
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = -8.0  # the extreme: q 0, scale 1
    w[0, 16] = 7.0  # q 15
    w[0, 1] = 3.0  # q 11
    q = quantize_weight(jnp.asarray(w), 4, 32)
    assert float(q.scales[0, 0]) == 1.0
    packed = np.asarray(q.packed)[0]
    assert packed[0] == 0 | (15 << 4) and packed[1] == 11 | (8 << 4) and (packed[2:] == 8 | (8 << 4)).all()
    np.testing.assert_array_equal(np.asarray(q.dequantize()), w)


def test_bad_formats_are_refused_with_the_fix():
    w = jnp.ones((4, 96))
    with pytest.raises(ValueError, match="group_size=64 does not divide the input width 96.*one of \\[32\\]"):
        quantize_weight(w, 8, 64)
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 3"):
        quantize_weight(w, 3, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_weight(w, 8, 48)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_weight(w, 8, 32, scale_dtype=jnp.float32)
    with pytest.raises(ValueError, match="mode='affine' is int4 only"):
        quantize_weight(w, 8, 32, mode="affine")
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize_weight(w, 4, 32, mode="asymmetric")


def activations_as_int8(x) -> np.ndarray:
    """The int8-activation rounding, written out in float32 numpy: per block of 32,
    q = round-half-even(x * (127 / max|x|)), times max|x| / 127."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.round(blocks * inverse) * (amax / np.float32(127))).reshape(x.shape)


def test_activation_rounding_is_the_documented_int8_blocks():
    x = heavy_tailed((3, 5, 128), seed=4)
    x = x.at[0, 0, :32].set(0.0)  # an all-zero block stays zero
    got = np.asarray(quantize_activations(x))
    # The same integers; the scale max|x| / 127 may differ in its last bit (XLA
    # divides by a constant as a multiplication).
    np.testing.assert_allclose(got, activations_as_int8(x), rtol=3e-7, atol=0)
    step = np.repeat(np.abs(np.asarray(x)).reshape(3, 5, 4, 32).max(-1) / 127, 32, axis=-1)
    assert (np.abs(got - np.asarray(x)) <= 0.5 * step * (1 + 1e-5) + 1e-12).all()
    assert (got[0, 0, :32] == 0).all()


# bits and mode of the three formats.
FORMATS = {"int8": (8, "symmetric"), "int4": (4, "symmetric"), "int4-affine": (4, "affine")}


def layer_weight(stack: QuantizedWeight, layer: int) -> np.ndarray:
    """Layer `layer` of a stack, dequantized, in float64."""
    return np.asarray(jax.tree.map(lambda a: a[layer], stack).dequantize(jnp.float32), np.float64)


def product_float64(x, stack: QuantizedWeight, layer: int) -> np.ndarray:
    weight = layer_weight(stack, layer)
    inputs = activations_as_int8(x) if stack.activations == "int8" else np.asarray(x)
    return np.asarray(inputs, np.float64) @ np.asarray(weight, np.float64).T


def close_to_float64(got, want, x, weight_abs):
    # float32 sums: a few units of rounding of the sum of |x| |w|.
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ weight_abs.T) + 1e-6
    assert (np.abs(np.asarray(got, np.float64) - want) <= bound).all(), float(np.abs(got - want).max())


@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_quantized_matvec_equals_the_float64_product_of_the_dequantized_slice(kind, group_size, rows, activations):
    assert kernels_status() == "ready"
    bits, mode = FORMATS[kind]
    weights = heavy_tailed((3, 37, 256), seed=rows) + (0.02 if mode == "affine" else 0)
    stack = quantize_weight(weights, bits, group_size, activations=activations, mode=mode)
    x = jax.random.normal(jax.random.key(rows), (rows, 256))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(2))
    close_to_float64(got, product_float64(x, stack, 2), x, np.abs(layer_weight(stack, 2)))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("in_features", [96, 160])  # an odd number of blocks: int4 cannot pair them all
def test_quantized_matvec_with_an_odd_number_of_blocks(kind, in_features):
    bits, mode = FORMATS[kind]
    stack = quantize_weight(heavy_tailed((2, 21, in_features), seed=in_features), bits, 32, mode=mode)
    x = jax.random.normal(jax.random.key(2), (3, in_features))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(1))
    close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("in_features, group_size", [(1152, 32), (1184, 32), (1152, 64), (1152, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_quantized_matvec_over_wide_rows(kind, in_features, group_size, rows):
    """Rows long enough for the kernel's unrolled steps, the steps left over and a
    last odd block (1184 = 37 blocks of 32)."""
    bits, mode = FORMATS[kind]
    stack = quantize_weight(heavy_tailed((2, 13, in_features), seed=rows), bits, group_size, mode=mode)
    x = jax.random.normal(jax.random.key(rows), (rows, in_features))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(1))
    close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("in_features, group_size", [(1184, 32), (1152, 64), (1152, 128), (64, 64)])
@pytest.mark.parametrize("rows", [6, 7, 15, 100])
def test_quantized_matvec_over_many_rows(kind, in_features, group_size, rows):
    """Batches and prompts: with AVX-512 VNNI whole tiles of 16 weight rows meet
    up to 8 activation rows at a time (37 rows: two tiles and 5 rows left over;
    1184 inputs: a last lone int4 group of 32; 64 in groups of 64: one group)."""
    bits, mode = FORMATS[kind]
    stack = quantize_weight(heavy_tailed((2, 37, in_features), seed=rows) + (0.02 if mode == "affine" else 0), bits,
                            group_size, mode=mode)
    x = jax.random.normal(jax.random.key(rows), (rows, in_features))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(1))
    close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [8, 100])
def test_quantized_matvec_over_several_chunks_of_tiles(kind, rows):
    """300 weight rows of 1024 inputs: more than one chunk of whole tiles, and rows
    left over in the last."""
    bits, mode = FORMATS[kind]
    stack = quantize_weight(heavy_tailed((1, 300, 1024), seed=rows), bits, 64 if mode == "affine" else 32, mode=mode)
    x = jax.random.normal(jax.random.key(rows), (rows, 1024))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(0))
    close_to_float64(got, product_float64(x, stack, 0), x, np.abs(layer_weight(stack, 0)))


def test_a_prompt_takes_the_kernel_where_its_tiles_run():
    from eqx_models.backends.cpu import quantized_tiles_available
    from eqx_models.ops import reads_in_place

    prompt = jnp.zeros((1, 512, 256))
    for activations in ("int8", "float"):
        weight = quantize_weight(heavy_tailed((64, 256)), 8, 32, activations=activations)
        assert reads_in_place(prompt, weight) == (activations == "int8" and quantized_tiles_available())
    assert not reads_in_place(prompt, heavy_tailed((64, 256)))  # float weights: XLA's matmul


@pytest.mark.parametrize("which", ["x", "scales"])
def test_only_the_differentiated_terms_of_a_quantized_product_are_formed(which):
    """A frozen base (QLoRA: scales not differentiated) or inputs that are not:
    the other term's tangent is a symbolic zero and left out, the gradient as XLA's."""
    stack = quantize_weight(heavy_tailed((2, 48, 128)), 8, 32)
    x = jax.random.normal(jax.random.key(3), (40, 128))
    with_scales = lambda scales: eqx.tree_at(lambda s: s.scales, stack, scales)
    straight_through = lambda x: x + jax.lax.stop_gradient(quantize_activations(x) - x)
    loss = lambda x, scales: jnp.sum(jnp.tanh(quantized_matvecs(x, (with_scales(scales),), jnp.int32(1))[0]))
    reference = lambda x, scales: jnp.sum(jnp.tanh(straight_through(x) @ dequantize(stack.packed[1], scales[1], 8, 32).T))
    argnum = 0 if which == "x" else 1
    got = np.asarray(jax.grad(loss, argnum)(x, stack.scales), np.float32)
    want = np.asarray(jax.grad(reference, argnum)(x, stack.scales), np.float32)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("kind", FORMATS)
def test_quantized_matvecs_run_several_stacks_with_bfloat16_scales(kind):
    bits, mode = FORMATS[kind]
    stacks = [quantize_weight(heavy_tailed((2, n, 128), seed=n), bits, 32, scale_dtype=jnp.bfloat16, mode=mode)
              for n in (24, 8, 40)]
    x = jax.random.normal(jax.random.key(0), (2, 3, 128))  # leading axes kept
    outs = jax.jit(quantized_matvecs)(x, stacks, jnp.int32(1))
    for out, stack in zip(outs, stacks):
        assert out.shape == (2, 3, stack.shape[1])
        weight_abs = np.abs(layer_weight(stack, 1))
        flat = np.asarray(x).reshape(6, 128)
        close_to_float64(np.asarray(out).reshape(6, -1), product_float64(flat, stack, 1), flat, weight_abs)


def test_quantized_matvecs_refuse_mixed_formats():
    a = quantize_weight(jnp.ones((1, 8, 64)), 8, 32)
    b = quantize_weight(jnp.ones((1, 8, 64)), 4, 32)
    c = quantize_weight(jnp.ones((1, 8, 64)), 4, 32, mode="affine")
    for pair in ((a, b), (b, c)):
        with pytest.raises(ValueError, match="share bits, group_size, activations and mode"):
            quantized_matvecs(jnp.ones((1, 64)), pair, jnp.int32(0))


def test_quantized_matvec_differentiates_in_the_activations_and_scales():
    stack = quantize_weight(heavy_tailed((2, 16, 64)), 4, 32)
    x = jax.random.normal(jax.random.key(1), (1, 64))
    loss = lambda x, scales: jnp.sum(
        quantized_matvecs(x, (eqx.tree_at(lambda s: s.scales, stack, scales),), jnp.int32(1))[0] ** 2
    )
    # The inputs' rounding differentiates as the identity (straight through).
    straight_through = lambda x: x + jax.lax.stop_gradient(quantize_activations(x) - x)
    reference = lambda x, scales: jnp.sum(
        (straight_through(x) @ dequantize(stack.packed[1], scales[1], 4, 32).T) ** 2
    )
    scales = stack.scales  # float16: the kernel's path
    for got, want in zip(jax.grad(loss, (0, 1))(x, scales), jax.grad(reference, (0, 1))(x, scales)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-5 * np.abs(want).max())


def test_affine_quantized_matvec_differentiates_in_the_scales_and_biases():
    stack = quantize_weight(heavy_tailed((2, 16, 128)) + 0.01, 4, 64, mode="affine")
    x = jax.random.normal(jax.random.key(1), (1, 128))
    with_arrays = lambda scales, biases: eqx.tree_at(lambda s: (s.scales, s.biases), stack, (scales, biases))
    loss = lambda scales, biases: jnp.sum(quantized_matvecs(x, (with_arrays(scales, biases),), jnp.int32(1))[0] ** 2)
    x_seen = quantize_activations(x)
    reference = lambda scales, biases: jnp.sum(
        (x_seen @ dequantize(stack.packed[1], scales[1], 4, 64, biases=biases[1]).T) ** 2
    )
    grads = jax.grad(loss, (0, 1))(stack.scales, stack.biases)
    for got, want in zip(grads, jax.grad(reference, (0, 1))(stack.scales, stack.biases)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("path", ["EQX_MODELS_KERNELS_PORTABLE", "EQX_MODELS_KERNELS_AVX2",
                                  "EQX_MODELS_QUANTIZED_TILES_FROM"])
def test_portable_avx2_and_tile_paths_equal_the_float64_product(path):
    """The paths a CPU without AVX-512 takes, forced on this one, and (with AVX-512
    VNNI) the tiles from a single activation row on (in a fresh process: the kernel
    library picks its path once)."""
    script = """
import jax, jax.numpy as jnp, numpy as np
from eqx_models.backends.cpu import kernels_status
from eqx_models.ops import quantized_matvecs
from eqx_models.quantization import dequantize, quantize_activations, quantize_weight
assert kernels_status() == "ready"
cases = [(8, 1, "int8", 64), (4, 3, "int8", 64), (4, 5, "int8", 32), (8, 6, "int8", 128), (4, 2, "int8", 128),
         (8, 3, "float", 64), (4, 1, "float", 64)]
cases += [(bits, rows, activations, group, "affine") for bits, rows, activations, group in cases if bits == 4]
for bits, rows, activations, group, *mode in cases:
    stack = quantize_weight(jax.random.normal(jax.random.key(bits), (2, 19, 256)) * 0.1 + 0.02, bits, group,
                            activations=activations, mode=(mode or ["symmetric"])[0])
    x = jax.random.normal(jax.random.key(rows), (rows, 256))
    (got,) = quantized_matvecs(x, (stack,), jnp.int32(1))
    w = np.asarray(jax.tree.map(lambda a: a[1], stack).dequantize(jnp.float32), np.float64)
    inputs = quantize_activations(x) if activations == "int8" else x
    want = np.asarray(inputs, np.float64) @ w.T
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(w).T) + 1e-6
    assert (np.abs(np.asarray(got, np.float64) - want) <= bound).all(), (bits, rows, activations, group, mode)
"""
    env = dict(os.environ, **{path: "1"})
    subprocess.run([sys.executable, "-c", script], env=env, check=True)


@pytest.fixture(scope="module")
def model():
    return small_model(seed=3, num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       head_dim=32)


@pytest.mark.parametrize("bits, tied, mode", [(8, False, "symmetric"), (4, False, "symmetric"), (8, True, "symmetric"),
                                             (4, False, "affine")])
def test_with_float_activations_a_quantized_model_decodes_as_its_dequantized_weights(model, bits, tied, mode):
    if tied:
        model = small_model(seed=4, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, head_dim=32, tie_word_embeddings=True)
    group_size = 64 if mode == "affine" else 32
    quantized = quantize(model, bits=bits, group_size=group_size, activations="float", mode=mode)
    leaves = jax.tree.leaves(quantized, is_leaf=is_quantized)
    # q/k/v/o, gate/up/down, the embedding table, and the head unless tied to it.
    assert sum(is_quantized(leaf) for leaf in leaves) == 7 + 1 + (not tied)
    assert quantized.dtype == jnp.float32
    float_model = dequantized(quantized)
    ids = random_ids((2, 12), seed=bits)
    tokens = eqx_models.generate(quantized, ids, max_new_tokens=24)
    np.testing.assert_array_equal(tokens, eqx_models.generate(float_model, ids, max_new_tokens=24))
    # Step by step through the cache, the kernel against XLA's dot of the dequantized weights.
    cache_q, cache_f = quantized.init_cache(2, 40), float_model.init_cache(2, 40)
    _, cache_q = quantized(ids, cache=cache_q)
    _, cache_f = float_model(ids, cache=cache_f)
    for t in range(8):
        step = tokens[:, t : t + 1]
        got, cache_q = quantized(step, cache=cache_q)
        want, cache_f = float_model(step, cache=cache_f)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", FORMATS)
def test_with_int8_activations_decode_and_prefill_compute_one_function(model, kind):
    # The kernels (decode) and XLA (prefill) round each product's input the same
    # way (the kernel tests above check that to float32 rounding). But a value that
    # float32 noise between two paths (or two sequence lengths of one path) puts on
    # the other side of a rounding boundary moves by a whole step of its block,
    # 1/127 of the block's largest value, and the layers after carry that on: here
    # logits moved by up to 2.5% of their largest value (int4, three layers), as
    # llama.cpp's do between its batched and single-token paths. Greedy tokens agree.
    bits, mode = FORMATS[kind]
    quantized = quantize(model, bits=bits, group_size=64 if mode == "affine" else 32, mode=mode)
    ids = random_ids((2, 12), seed=bits)
    new = np.asarray(eqx_models.generate(quantized, ids, max_new_tokens=12, eos_token_id=[]))
    tokens = np.concatenate([np.asarray(ids), new], axis=1)
    full, _ = quantized(jnp.asarray(tokens[:, :-1]))
    np.testing.assert_array_equal(new, np.argmax(np.asarray(full[:, 11:]), axis=-1))
    cache = quantized.init_cache(2, 40)
    logits, cache = quantized(jnp.asarray(tokens[:, :12]), cache=cache)
    steps = [logits]
    for t in range(12, 23):
        logits, cache = quantized(jnp.asarray(tokens[:, t : t + 1]), cache=cache)
        steps.append(logits)
    stepped = np.concatenate(steps, axis=1)
    scale = np.abs(np.asarray(full)).max()
    np.testing.assert_allclose(stepped, full, atol=0.05 * scale, rtol=0)


def test_quantize_can_leave_the_head_and_embeddings_float(model):
    quantized = quantize(model, bits=8, lm_head=False, embeddings=False)
    assert not is_quantized(quantized.lm_head.weight) and not is_quantized(quantized.model.embed_tokens.weight)
    assert is_quantized(quantized.model.layers.mlp.up_proj.weight)


def test_int8_decode_step_reads_the_packed_weights_in_place():
    assert kernels_status() == "ready"
    model = small_model(seed=5, num_hidden_layers=6, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                        head_dim=64)
    for kind, (bits, mode) in FORMATS.items():
        quantized = quantize(model, bits=bits, group_size=64 if mode == "affine" else 32, mode=mode)
        state = DecodeState(quantized.init_cache(1, 256), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool),
                            jax.random.key(0))
        compiled = _decode_step.lower(quantized, state, Sampling(), (), 0).compile().compiled
        layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(quantized.model.layers)) // 6
        temp = compiled.memory_analysis().temp_size_in_bytes
        # A dequantized float copy of one layer's MLP weight alone would be 1 MB.
        assert temp < layer_bytes / 8, (kind, temp, layer_bytes)
        hlo = compiled.as_text()
        assert "eqx_models_quantized_matvec" in hlo
        assert not any("f32[1024,256]" in line or "f32[256,1024]" in line for line in hlo.splitlines())


@pytest.mark.parametrize("kind", FORMATS)
def test_a_quantized_moe_decode_step_reads_the_packed_experts_in_place(kind):
    model = small_model(seed=6, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, head_dim=32)
    bits, mode = FORMATS[kind]
    quantized = quantize(model, bits=bits, group_size=64 if mode == "affine" else 32, mode=mode)
    assert is_quantized(quantized.model.layers.mlp.experts.up_proj.weight)
    state = DecodeState(quantized.init_cache(1, 64), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool), jax.random.key(0))
    compiled = _decode_step.lower(quantized, state, Sampling(), (), 0).compile().compiled
    # One expert's weight dequantized to float32 would be 128 KB (256 x 128 x 4 bytes).
    assert compiled.memory_analysis().temp_size_in_bytes < 32 * 1024
    assert "eqx_models_quantized_matvec" in compiled.as_text()


# Widths that groups of 32 divide, for the layers each family quantizes.
GROUPABLE = dict(intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, v_head_dim=8,
                 shared_expert_intermediate_size=32, linear_value_head_dim=8)


def _groupable_config(model_type: str):
    """The family's tiny `transformers` config (tests/zoo.py) with group-divisible widths."""
    from conftest import tiny_config
    from zoo import tiny_overrides

    overrides = dict(tiny_overrides(model_type))
    overrides.update({k: v for k, v in GROUPABLE.items() if k in overrides or k == "intermediate_size"})
    return tiny_config(model_type, **overrides)


def _groupable_model(model_type: str):
    from eqx_models.models import architecture_for

    hf = _groupable_config(model_type).to_dict()
    model = eqx_models.CausalLM(architecture_for(hf).config_from_hf(hf), key=jax.random.key(0))
    # Matrices drawn 8x wider than the 0.02 default: logits of order 1, not near-ties.
    widen = lambda a: a * 8 if eqx.is_inexact_array(a) and a.ndim >= 2 else a
    return jax.tree.map(widen, model)


@pytest.mark.parametrize("model_type", eqx_models.models.supported_model_types())
def test_every_family_quantized_decodes_the_greedy_tokens_of_its_full_forward(model_type):
    model = _groupable_model(model_type)
    quantized = quantize(model, bits=8 if len(model_type) % 2 else 4)
    assert any(is_quantized(leaf) for leaf in jax.tree.leaves(quantized.model.layers, is_leaf=is_quantized))
    linears = [n for n in jax.tree.leaves(quantized, is_leaf=lambda n: isinstance(n, Linear)) if isinstance(n, Linear)]
    assert all(is_quantized(n.weight) for n in linears if is_expert_stack(n.weight))  # experts too
    prompt = random_ids((2, 7), seed=1) % model.config.vocab_size
    new = np.asarray(eqx_models.generate(quantized, prompt, max_new_tokens=8, eos_token_id=[]))
    # Each token the kernels decoded is the argmax of the same model's full forward
    # (XLA: the weights dequantized, the inputs rounded as the kernels round them).
    tokens = np.concatenate([np.asarray(prompt), new], axis=1)
    logits, _ = quantized(jnp.asarray(tokens[:, :-1]))
    np.testing.assert_array_equal(new, np.argmax(np.asarray(logits[:, 6:]), axis=-1))
    jax.clear_caches()


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    from conftest import make_checkpoint, tiny_config

    folder = tmp_path_factory.mktemp("float_qwen3")
    make_checkpoint(folder, tiny_config("qwen3", hidden_size=64, intermediate_size=128, head_dim=16))
    return folder


def arrays_equal(a, b) -> bool:
    same_structure = jax.tree.structure(a) == jax.tree.structure(b)
    pairs = zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)))
    return same_structure and all(x.dtype == y.dtype and (np.asarray(x) == np.asarray(y)).all() for x, y in pairs)


@pytest.mark.parametrize("preset, options", [("int8", dict(bits=8)), ("int4", dict(bits=4)),
                                             ("int4-affine", dict(bits=4, group_size=64, mode="affine"))])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(float_checkpoint, preset, options):
    loaded = eqx_models.from_pretrained(float_checkpoint, quantize=preset)
    assert arrays_equal(loaded, quantize(eqx_models.from_pretrained(float_checkpoint), **options))
    in_bfloat16 = eqx_models.from_pretrained(float_checkpoint, quantize=preset, dtype="bfloat16")
    assert in_bfloat16.dtype == jnp.bfloat16 and in_bfloat16.model.norm.weight.dtype == jnp.bfloat16
    assert in_bfloat16.model.layers.mlp.up_proj.weight.scales.dtype == jnp.float16


def test_a_saved_quantized_checkpoint_reloads_without_requantizing(float_checkpoint, tmp_path):
    import json

    from safetensors import safe_open

    quantized = eqx_models.from_pretrained(float_checkpoint, quantize=dict(bits=4, group_size=32,
                                                                           scale_dtype="bfloat16"))
    eqx_models.save_pretrained(quantized, tmp_path)
    entry = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert entry == dict(quant_method="eqx_models", format_version=1, bits=4, group_size=32, scale_dtype="bfloat16",
                         activations="int8", embeddings=True, lm_head=True, keep_indivisible=False, experts=True,
                         mode="symmetric")
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "U8"
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [128, 32]
        assert f.get_slice("model.layers.0.mlp.up_proj.scales").get_shape() == [128, 2]
    reloaded = eqx_models.from_pretrained(tmp_path)
    assert arrays_equal(reloaded, quantized)
    ids = random_ids((1, 6)) % 97
    np.testing.assert_array_equal(eqx_models.generate(reloaded, ids, max_new_tokens=5),
                                  eqx_models.generate(quantized, ids, max_new_tokens=5))


def test_an_affine_checkpoint_saves_its_biases_and_reloads_them(float_checkpoint, tmp_path):
    import json

    from safetensors import safe_open

    quantized = eqx_models.from_pretrained(float_checkpoint, quantize="int4-affine")
    eqx_models.save_pretrained(quantized, tmp_path)
    entry = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (entry["bits"], entry["group_size"], entry["mode"]) == (4, 64, "affine")
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.scales").get_shape() == [128, 1]
        biases = f.get_tensor("model.layers.0.mlp.up_proj.biases")
        assert biases.shape == (128, 1) and biases.dtype == np.float16
    reloaded = eqx_models.from_pretrained(tmp_path)
    assert arrays_equal(reloaded, quantized) and reloaded.model.layers.mlp.up_proj.weight.mode == "affine"
    # Asking for the same format again loads it as saved; another one is refused.
    assert arrays_equal(eqx_models.from_pretrained(tmp_path, quantize="int4-affine"), quantized)
    with pytest.raises(ValueError, match="already quantized"):
        eqx_models.from_pretrained(tmp_path, quantize=dict(bits=4, group_size=64))


def _experts(model):
    mlp = model.model.layers.mlp
    return getattr(mlp, "sparse", mlp).experts


# Experts as one tensor each (Qwen3-MoE, with a dense layer between) and as one
# fused tensor a layer, `[experts, in, out]` (gpt-oss).
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_experts_quantize_while_loading_and_reload_from_a_saved_checkpoint(model_type, tmp_path):
    import json

    from conftest import make_checkpoint

    folder = tmp_path / "float"
    make_checkpoint(folder, _groupable_config(model_type))
    loaded = eqx_models.from_pretrained(folder, quantize="int4")
    down = _experts(loaded).down_proj.weight
    assert is_quantized(down) and down.packed.ndim == 4  # [layers, experts, out, in / 2]
    assert arrays_equal(loaded, quantize(eqx_models.from_pretrained(folder), bits=4))

    eqx_models.save_pretrained(loaded, tmp_path / "int4")
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["experts"] is True
    assert arrays_equal(eqx_models.from_pretrained(tmp_path / "int4"), loaded)

    kept = eqx_models.from_pretrained(folder, quantize=dict(bits=4, experts=False))
    assert not is_quantized(_experts(kept).down_proj.weight) and is_quantized(kept.model.layers.self_attn.q_proj.weight)
    eqx_models.save_pretrained(kept, tmp_path / "float_experts")
    config = json.loads((tmp_path / "float_experts" / "config.json").read_text())
    assert config["quantization_config"]["experts"] is False
    # A checkpoint written before experts could be quantized says nothing of them: they were float.
    del config["quantization_config"]["experts"]
    (tmp_path / "float_experts" / "config.json").write_text(json.dumps(config))
    assert arrays_equal(eqx_models.from_pretrained(tmp_path / "float_experts"), kept)


def test_quantized_checkpoints_of_other_formats_and_versions_are_refused(float_checkpoint, tmp_path):
    import json
    import shutil

    for entry, message in [
        (dict(quant_method="gptq", bits=4), "quant_method='gptq', which this library does not read"),
        (dict(quant_method="eqx_models", format_version=99, bits=8), "layout version 99.*reads version 1"),
        (dict(quant_method="eqx_models", format_version=1, bits=4, mode="nf4"), "in mode 'nf4'.*Upgrade"),
    ]:
        folder = tmp_path / f"{entry['quant_method']}-{len(entry)}"
        shutil.copytree(float_checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, quantization_config=entry)))
        with pytest.raises(ValueError, match=message):
            eqx_models.from_pretrained(folder)
    known = "use one of \\['int4', 'int4-affine', 'int8'\\]"
    with pytest.raises(ValueError, match=f"quantize='int3' is not known; {known}"):
        eqx_models.from_pretrained(float_checkpoint, quantize="int3")
    with pytest.raises(ValueError, match="group_size=128 does not divide the input width 64"):
        eqx_models.from_pretrained(float_checkpoint, quantize=dict(bits=8, group_size=128))


def test_layers_a_group_does_not_divide_are_refused_or_kept_float():
    from conftest import STORIES, require_fixture

    stories = eqx_models.from_pretrained(require_fixture(STORIES))  # intermediate_size 172
    with pytest.raises(ValueError, match="does not divide the input width 172 of .*down_proj.*keep_indivisible=True"):
        quantize(stories, bits=8)
    kept = quantize(stories, bits=8, keep_indivisible=True)
    assert not is_quantized(kept.model.layers.mlp.down_proj.weight) and is_quantized(kept.model.layers.mlp.up_proj.weight)


def test_qlora_trains_adapters_on_the_frozen_packed_base_and_compiles_once(float_checkpoint, tmp_path):
    import optax

    from eqx_models.lora import apply_lora, lora_filter, merge_lora
    from eqx_models.training import make_train_step

    base = eqx_models.from_pretrained(float_checkpoint, quantize="int4")
    model = apply_lora(base, rank=4, targets="q_proj|v_proj|down_proj", key=jax.random.key(0))
    before = np.asarray(base.model.layers.self_attn.q_proj.weight.packed).copy()  # the step donates its inputs
    init, step = make_train_step(optax.adam(3e-2), trainable=lora_filter(model))
    opt_state = init(model)
    ids = np.tile(np.arange(16, dtype=np.int32) % 97, (4, 1))
    compiles, losses = [], []
    listener = lambda event, duration, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    for i in range(12):
        if i == 1:
            jax.monitoring.register_event_duration_secs_listener(listener)
        model, opt_state, metrics = step(model, opt_state, {"input_ids": ids, "labels": ids})
        losses.append(float(metrics["loss"]))
    jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [] and losses[-1] < 0.7 * losses[0], losses
    packed = lambda m: m.model.layers.self_attn.q_proj.base.weight.packed
    np.testing.assert_array_equal(packed(model), before)
    merged = merge_lora(model)
    assert is_quantized(merged.model.layers.self_attn.q_proj.weight)
    eqx_models.save_pretrained(merged, tmp_path)
    assert arrays_equal(eqx_models.from_pretrained(tmp_path), merged)


@pytest.mark.parametrize("preset, options", [("int8", dict(bits=8)),
                                             ("int4-affine", dict(bits=4, group_size=64, mode="affine"))])
def test_the_cli_generates_from_a_model_quantized_while_loading(capsys, preset, options):
    from conftest import STORIES, require_fixture

    from eqx_models.cli import main

    path = require_fixture(STORIES)
    assert main(["generate", str(path), "--prompt", "Once upon a time", "--max-new-tokens", "12", "--quantize",
                 preset]) == 0
    text = capsys.readouterr().out
    model = quantize(eqx_models.from_pretrained(path), keep_indivisible=True, **options)
    tokenizer = eqx_models.load_tokenizer(path)
    ids = tokenizer.encode("Once upon a time")
    expected = tokenizer.decode(eqx_models.generate(model, ids, max_new_tokens=12)[0].tolist())
    assert text.strip() == expected.strip()
