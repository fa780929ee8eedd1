"""The CPU decode kernels against plain XLA, and the model with and without them."""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_models.backends import xla
from eqx_models.backends.cpu import kernels_status
from eqx_models.ops import (
    VisibleSlots, decode_attention, delta_rule_step, gather_pages, headwise_matvec, paged_decode_attention, stacked_matvec,
    stacked_matvecs, write_pages, write_slots,
)


def test_kernels_build_here():
    # CI machines have a C++ compiler; a silent fallback would hide a broken build.
    assert kernels_status() == "ready"


FIRST_GENERATE = """
import sys, jax, eqx_models
if sys.argv[2] == "tpu":  # what a process on a TPU machine sees
    jax.default_backend = lambda: "tpu"
model = eqx_models.from_pretrained(sys.argv[1])
print(eqx_models.generate(model, [1, 403, 407], max_new_tokens=4)[0].tolist())
"""


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_a_first_generate_compiles_only_the_kernels_it_runs(backend, tmp_path):
    """A float32 model's first generate on a fresh machine builds the products, the
    cache write, the greedy pick and float32 attention, saying so on stderr; the
    int8, bfloat16, DeltaNet and MLA kernels wait for a model that needs them (all
    of them were one library, about 100 s of compiling on 2 cores). On a backend
    other than the CPU nothing is compiled."""
    from conftest import STORIES, require_fixture

    env = dict(os.environ, EQX_MODELS_CACHE=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", FIRST_GENERATE, str(require_fixture(STORIES)), backend], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    built = sorted(path.name.split("-")[0] for path in (tmp_path / "kernels").glob("*.so"))
    if backend == "tpu":
        assert built == [] and "compiling" not in run.stderr
        return
    names = ["attention_float32", "cache_write", "greedy", "matvec"]
    assert built == [f"libeqx_models_{name}" for name in names]
    assert "eqx_models: compiling the CPU kernels" in run.stderr
    assert all(name in run.stderr for name in names)


# Activations that are bfloat16 values (a bfloat16 model's) take the CPU's bfloat16
# dot-product instruction where it has one; any other float32 takes the widening path.
@pytest.mark.parametrize("dtype, activations", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("out_features, in_features", [(37, 19), (64, 1024), (130, 48), (20, 70)])
def test_stacked_matvec_equals_dot_of_the_slice(dtype, activations, rows, out_features, in_features):
    rng = np.random.default_rng(rows * 1000 + out_features + in_features)
    stack = jnp.asarray(rng.standard_normal((3, out_features, in_features)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, in_features)), activations).astype(jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(stack[2].astype(jnp.float32), np.float64).T
    got = jax.jit(stacked_matvec)(x, stack, jnp.int32(2))
    assert got.shape == (rows, out_features) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, exact, atol=1e-5 * np.sqrt(in_features), rtol=0)


@pytest.mark.parametrize("dtype, activations", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_stacked_matvecs_runs_several_stacks_as_one_job(dtype, activations, rows):
    # Sizes that split into several chunks each (256 rows of 1024 float32 per chunk)
    # and one smaller than a tile: every output must come from its own stack.
    rng = np.random.default_rng(rows)
    stacks = [jnp.asarray(rng.standard_normal((3, n, 1024)), dtype) for n in (600, 5, 300)]
    x = jnp.asarray(rng.standard_normal((rows, 1024)), activations).astype(jnp.float32)
    outs = jax.jit(stacked_matvecs)(x, stacks, jnp.int32(1))
    assert len(outs) == 3
    for stack, got in zip(stacks, outs):
        exact = np.asarray(x, np.float64) @ np.asarray(stack[1].astype(jnp.float32), np.float64).T
        np.testing.assert_allclose(got, exact, atol=2e-4 * np.abs(exact).max(), rtol=0)


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as info:
        flags = next((line.split() for line in info if line.startswith("flags")), [])
    return "amx_bf16" in flags and "amx_tile" in flags


def test_bfloat16_tiles_are_used_where_the_cpu_has_amx():
    # A CPU with AMX whose tiles the kernels failed to claim would silently fall
    # back to XLA's float32 matmul for every bfloat16 prompt. (Linux grants the
    # tiles from 5.16 on; the environment variables turn them off.)
    from eqx_models.backends.cpu import bf16_tiles_available

    release = tuple(int(part) for part in platform.release().split(".")[:2] if part.isdigit())
    turned_off = os.environ.get("EQX_MODELS_AMX") == "0" or "EQX_MODELS_KERNELS_PORTABLE" in os.environ
    expected = sys.platform == "linux" and release >= (5, 16) and _cpu_has_amx() and not turned_off
    assert bf16_tiles_available() == expected


# bfloat16 activations against bfloat16 weights: on a CPU with AMX, from 5 rows on,
# widths that fill the tiles (in % 32, out % 16) take the tiles; the rest, and CPUs
# without AMX, the dot-product or widening loops. Rows past 32 and weight rows past
# a chunk (512 KiB) cover the blocking; odd sizes the fallback.
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 16, 17, 33, 100])
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 64), (400, 1024), (32, 3072), (37, 19), (20, 64)])
def test_bfloat16_activations_equal_the_float64_product(rows, out_features, in_features):
    rng = np.random.default_rng(rows * 7 + out_features + in_features)
    stacks = [jnp.asarray(rng.standard_normal((3, n, in_features)), jnp.bfloat16) for n in (out_features, 16 * 21)]
    x = jnp.asarray(rng.standard_normal((rows, in_features)), jnp.bfloat16)
    outs = jax.jit(stacked_matvecs)(x, stacks, jnp.int32(2))
    for stack, got in zip(stacks, outs):
        exact = np.asarray(x, np.float64) @ np.asarray(stack[2], np.float64).T
        assert got.shape == exact.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, exact, atol=1e-5 * np.sqrt(in_features) * 4, rtol=0)


def test_a_bfloat16_prompt_goes_through_the_tiles_with_the_same_logits(monkeypatch):
    """With AMX, a bfloat16 model's prompt projections are kernel calls (not XLA's
    matmul), and the logits equal those of the XLA path to bfloat16 rounding."""
    import equinox as eqx

    import eqx_models
    from eqx_models.backends.cpu import MATVEC_TARGET, bf16_tiles_available
    from eqx_models.backends import cpu

    config = eqx_models.DecoderConfig(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, use_qk_norm=True)
    model = eqx_models.CausalLM(config, key=jax.random.key(1))
    scaled = lambda w: w / (0.02 * np.sqrt(w.shape[-1])) if w.ndim >= 2 else w
    model = jax.tree.map(lambda w: scaled(w).astype(jnp.bfloat16) if eqx.is_array(w) and
                         jnp.issubdtype(w.dtype, jnp.floating) else w, model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 24)))
    def logits(model):
        return model(ids)[0]

    def logits_by_xla(model):  # a function of its own: jit caches by function
        return model(ids)[0]

    with_tiles = np.asarray(jax.jit(logits)(model), np.float32)
    assert (MATVEC_TARGET in jax.jit(logits).lower(model).as_text()) == bf16_tiles_available()
    monkeypatch.setattr(cpu, "bf16_tiles_available", lambda: False)
    jax.clear_caches()  # inner jitted calls were traced with the tiles
    without = np.asarray(jax.jit(logits_by_xla)(model), np.float32)
    assert MATVEC_TARGET not in jax.jit(logits_by_xla).lower(model).as_text()
    assert 1.0 < np.abs(without).max() < 100.0
    # One bfloat16 step (2**-8 relative) of the largest logit, for the roundings of
    # intermediate activations that the two paths may place differently.
    np.testing.assert_allclose(with_tiles, without, atol=np.abs(without).max() * 2**-6, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_matvec_of_no_rows_is_empty(dtype):
    stack = jnp.ones((2, 48, 64), dtype)
    got = jax.jit(stacked_matvec)(jnp.ones((0, 64), dtype), stack, jnp.int32(1))
    assert got.shape == (0, 48)


def test_bfloat16_rows_differentiate_under_strict_promotion():
    # The XLA form (other backends, and the derivative) must not mix bfloat16 and
    # float32 implicitly.
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.bfloat16)
    with jax.numpy_dtype_promotion("strict"):
        grad = jax.jit(jax.grad(lambda x: stacked_matvec(x, stack, jnp.int32(1)).sum()))(x)
    want = np.broadcast_to(np.asarray(stack[1], np.float64).sum(axis=0), x.shape)
    np.testing.assert_allclose(np.asarray(grad, np.float64), want, rtol=2**-7, atol=1e-2)


def test_kernels_build_without_amx():
    # The build retries with EQX_MODELS_NO_AMX where AMX does not compile or
    # assemble; that variant must build too.
    from eqx_models.backends.cpu import COMPILE_FLAGS, SOURCES, _compiler

    source = next(path for path in SOURCES if path.name == "matvec.cc")
    flags = [f for f in COMPILE_FLAGS if f != "-shared"]
    command = [_compiler(), "-DEQX_MODELS_NO_AMX", *flags, f"-I{jax.ffi.include_dir()}", "-c", str(source),
               "-o", os.devnull]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_stacked_matvecs_refuses_mixed_dtypes():
    stacks = [jnp.zeros((1, 4, 8), jnp.float32), jnp.zeros((1, 4, 8), jnp.bfloat16)]
    with pytest.raises(ValueError, match="share one dtype"):
        stacked_matvecs(jnp.zeros((1, 8)), stacks, jnp.int32(0))


def test_stacked_matvec_keeps_leading_axes_and_differentiates():
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.standard_normal((2, 6, 5)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 1, 5)), jnp.float32)
    assert stacked_matvec(x, stack, jnp.int32(1)).shape == (2, 1, 6)
    loss = lambda x, s: jnp.sum(stacked_matvec(x, s, jnp.int32(1)) ** 2)
    reference = lambda x, s: jnp.sum(xla.stacked_matvecs(x, (s,), jnp.int32(1))[0] ** 2)
    for got, want in zip(jax.grad(loss, (0, 1))(x, stack), jax.grad(reference, (0, 1))(x, stack)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def attention_float64(query, keys, values, valid, self_valid, new_key, new_value, scale, sinks=None):
    """One token per row against `keys`/`values` `[batch, kv_heads, kv_seq, _]` and
    its own key/value, in float64: values are the first `new_value.shape[-1]`
    channels of `values`' rows; `sinks [kv_heads, groups]` join the softmax; a row
    with nothing allowed averages every slot."""
    f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
    value_dim = new_value.shape[-1]
    keys = np.concatenate([f64(keys), f64(new_key)[:, :, None]], axis=2)
    values = np.concatenate([f64(values)[..., :value_dim], f64(new_value)[:, :, None]], axis=2)
    allowed = np.concatenate([valid, np.asarray(self_valid)[:, None]], axis=1)
    allowed = allowed | ~allowed.any(axis=1, keepdims=True)
    scores = scale * np.einsum("bkgd,bksd->bkgs", f64(query), keys)
    scores = np.where(allowed[:, None, None], scores, -np.inf)
    sink = np.full(scores.shape[1:3], -np.inf) if sinks is None else f64(sinks)
    top = np.maximum(scores.max(axis=-1), sink[None])[..., None]
    weights = np.exp(scores - top)
    weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sink[None, ..., None] - top)
    return np.einsum("bkgs,bksd->bkgd", weights, values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "layers, batch, kv_heads, groups, kv_seq, head_dim",
    [
        (3, 2, 2, 2, 7, 16),
        (2, 1, 8, 2, 300, 128),
        (2, 3, 1, 4, 33, 12),
        (1, 2, 4, 1, 64, 64),
        (2, 2, 2, 4, 50, 128),  # four query heads a group: two passes over the value columns
        (1, 2, 1, 8, 40, 256),  # eight, wide heads
        (1, 2, 2, 3, 20, 32),  # three: the one-head-at-a-time path
    ],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_equals_softmax_attention(dtype, layers, batch, kv_heads, groups, kv_seq, head_dim, with_sinks):
    rng = np.random.default_rng(kv_seq + head_dim)
    query = rng.standard_normal((batch, kv_heads, groups, head_dim)).astype(np.float32)
    keys = jnp.asarray(3 * rng.standard_normal((layers, batch, kv_heads, kv_seq, head_dim)), dtype)
    values = jnp.asarray(rng.standard_normal((layers, batch, kv_heads, kv_seq, head_dim)), dtype)
    valid = rng.random((batch, kv_seq)) < 0.7
    self_valid = np.ones(batch, bool)
    if batch > 1:  # one padding row with nothing to attend to: must stay finite
        valid[-1], self_valid[-1] = False, False
    new_key = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    new_value = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    # Sinks of the scores' size, so they take a real share of the weight.
    sinks = 3 * rng.standard_normal((kv_heads, groups)).astype(np.float32) if with_sinks else None
    args = (query, keys, values, jnp.int32(layers - 1), valid, self_valid, new_key, new_value)
    scale = head_dim**-0.5
    got = jax.jit(decode_attention, static_argnums=7)(*_visible(args, 4), scale, sinks)
    want = attention_float64(query, keys[layers - 1], values[layers - 1], valid, self_valid, new_key, new_value,
                             scale, sinks)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    reference = xla.decode_attention(*args, _sinks_or_none(sinks, kv_heads, groups), *NO_SCALES, scale=scale)
    np.testing.assert_allclose(reference, want, atol=1e-5, rtol=0)


NO_SCALES = (jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32))


def _visible(args: tuple, at: int) -> tuple:
    """The reference's arguments (`valid`, `self_valid` at `at`) as the op takes them:
    the two masks as `VisibleSlots`."""
    return (*args[:at], VisibleSlots.of_mask(args[at], args[at + 1]), *args[at + 2:])


@pytest.mark.parametrize(
    "layers, batch, kv_heads, groups, kv_seq, head_dim",
    [(3, 2, 2, 2, 7, 16), (2, 1, 8, 2, 300, 128), (2, 3, 1, 4, 33, 12), (2, 2, 2, 4, 45, 64)],
)
def test_int8_decode_attention_equals_float64_attention_over_the_scaled_rows(
    layers, batch, kv_heads, groups, kv_seq, head_dim
):
    """An int8 cache: each slot row's integers times its float32 scale, read in place."""
    rng = np.random.default_rng(kv_seq * head_dim)
    ints = lambda: jnp.asarray(rng.integers(-127, 128, (layers, batch, kv_heads, kv_seq, head_dim)), jnp.int8)
    keys, values = ints(), ints()
    key_scales = jnp.asarray(rng.uniform(0.001, 0.05, keys.shape[:-1]), jnp.float32)
    value_scales = jnp.asarray(rng.uniform(0.001, 0.02, keys.shape[:-1]), jnp.float32)
    query = rng.standard_normal((batch, kv_heads, groups, head_dim)).astype(np.float32)
    valid = rng.random((batch, kv_seq)) < 0.7
    self_valid = np.ones(batch, bool)
    if batch > 1:
        valid[-1], self_valid[-1] = False, False
    new_key = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    new_value = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    layer, scale = layers - 1, head_dim**-0.5
    scaled = lambda ints, scales: np.asarray(ints[layer], np.float64) * np.asarray(scales[layer], np.float64)[..., None]
    want = attention_float64(query, scaled(keys, key_scales), scaled(values, value_scales), valid, self_valid,
                             new_key, new_value, scale)
    args = (query, keys, values, jnp.int32(layer), valid, self_valid, new_key, new_value)
    got = jax.jit(decode_attention, static_argnums=7)(*_visible(args, 4), scale, None, key_scales, value_scales)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    reference = xla.decode_attention(*args, _sinks_or_none(None, kv_heads, groups), key_scales, value_scales,
                                     scale=scale)
    np.testing.assert_allclose(reference, want, atol=1e-5, rtol=0)
    # Values that are the keys' first channels share the keys' scales.
    got = jax.jit(decode_attention, static_argnums=7)(
        query, keys, keys, jnp.int32(layer), VisibleSlots.of_mask(valid, self_valid), new_key,
        new_key[..., : head_dim // 2], scale, None, key_scales, key_scales,
    )
    want = attention_float64(query, scaled(keys, key_scales), scaled(keys, key_scales), valid, self_valid, new_key,
                             new_key[..., : head_dim // 2], scale)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_paged_int8_decode_attention_reads_each_rows_pages_and_scales():
    rng = np.random.default_rng(11)
    layers, batch, kv_heads, groups, page_size, per_row, head_dim = 2, 2, 2, 3, 4, 5, 16
    pages = batch * per_row + 3
    keys = jnp.asarray(rng.integers(-127, 128, (layers, pages, kv_heads, page_size, head_dim)), jnp.int8)
    values = jnp.asarray(rng.integers(-127, 128, keys.shape), jnp.int8)
    key_scales = jnp.asarray(rng.uniform(0.001, 0.05, keys.shape[:-1]), jnp.float32)
    value_scales = jnp.asarray(rng.uniform(0.001, 0.02, keys.shape[:-1]), jnp.float32)
    tables = rng.permutation(pages)[: batch * per_row].reshape(batch, per_row).astype(np.int32)
    query = rng.standard_normal((batch, kv_heads, groups, head_dim)).astype(np.float32)
    valid = rng.random((batch, per_row * page_size)) < 0.8
    self_valid = np.ones(batch, bool)
    new_key, new_value = (rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    scale = head_dim**-0.5

    def rows(pool, scales):  # each row's slots, laid end to end, times their scales
        scaled = np.asarray(pool[1], np.float64) * np.asarray(scales[1], np.float64)[..., None]
        return scaled[tables].transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, per_row * page_size, head_dim)

    want = attention_float64(query, rows(keys, key_scales), rows(values, value_scales), valid, self_valid, new_key,
                             new_value, scale)
    args = (query, keys, values, jnp.int32(1), jnp.asarray(tables), valid, self_valid, new_key, new_value)
    got = jax.jit(paged_decode_attention, static_argnums=8)(*_visible(args, 5), scale, None, key_scales, value_scales)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    reference = xla.paged_decode_attention(*args, _sinks_or_none(None, kv_heads, groups), key_scales, value_scales,
                                           scale=scale)
    np.testing.assert_allclose(reference, want, atol=1e-5, rtol=0)


def test_decode_attention_wants_scales_with_an_int8_cache_only():
    keys = jnp.zeros((1, 1, 1, 4, 8), jnp.int8)
    args = (jnp.zeros((1, 1, 1, 8)), keys, keys, jnp.int32(0),
            VisibleSlots.of_mask(jnp.ones((1, 4), bool), jnp.ones(1, bool)), jnp.zeros((1, 1, 8)), jnp.zeros((1, 1, 8)),
            1.0)
    with pytest.raises(ValueError, match="int8 key/value stacks need their scales"):
        decode_attention(*args)
    floats = jnp.zeros((1, 1, 1, 4, 8))
    with pytest.raises(ValueError, match="only they take scales"):
        decode_attention(args[0], floats, floats, *args[3:], None, jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4)))


def _sinks_or_none(sinks, kv_heads, groups):
    return jnp.full((kv_heads, groups), -jnp.inf) if sinks is None else jnp.asarray(sinks)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_attention_reads_values_from_the_keys_first_channels(dtype, paged):
    """Multi-head Latent Attention's cache: one row per token, no value rows; the
    values are the first `value_dim` channels of the keys."""
    rng = np.random.default_rng(7)
    layers, batch, groups, kv_seq, key_dim, value_dim = 2, 2, 6, 24, 40, 32
    keys = jnp.asarray(rng.standard_normal((layers, batch, 1, kv_seq, key_dim)), dtype)
    no_values = jnp.zeros((layers, batch, 1, kv_seq, 0), dtype)
    query = rng.standard_normal((batch, 1, groups, key_dim)).astype(np.float32)
    valid = rng.random((batch, kv_seq)) < 0.8
    self_valid = np.ones(batch, bool)
    new_key = rng.standard_normal((batch, 1, key_dim)).astype(np.float32)
    new_value = new_key[..., :value_dim]
    scale = key_dim**-0.5
    want = attention_float64(query, keys[1], keys[1], valid, self_valid, new_key, new_value, scale)
    visible = VisibleSlots.of_mask(valid, self_valid)
    if paged:  # each row's slots in 4 pages of 6, the pages shuffled in the pool
        pages = keys.reshape(layers, batch, 1, 4, 6, key_dim).transpose(0, 1, 3, 2, 4, 5).reshape(layers, 8, 1, 6, key_dim)
        order = rng.permutation(8)
        pool = pages[:, np.argsort(order)]
        tables = jnp.asarray(order.reshape(batch, 4).astype(np.int32))
        attend = jax.jit(paged_decode_attention, static_argnums=8)
        got = attend(query, pool, pool, jnp.int32(1), tables, visible, new_key, new_value, scale)
    else:
        got = jax.jit(decode_attention, static_argnums=7)(
            query, keys, keys, jnp.int32(1), visible, new_key, new_value, scale
        )
    assert got.shape == (batch, 1, groups, value_dim)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # The cache view makes that choice itself when it holds no value rows.
    from eqx_models.cache import LayerKV

    view = LayerKV(keys, no_values, jnp.int32(1))
    attend_token = jax.jit(lambda view, *args: view.attend_token(*args, scale))
    got = attend_token(view, jnp.asarray(query), visible, jnp.asarray(new_key), jnp.asarray(new_value))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("width", [(4,), ()])  # () : an int8 cache's per-slot scales
def test_write_slots_writes_only_the_new_slots(dtype, width):
    rng = np.random.default_rng(1)
    buffer = jnp.asarray(rng.standard_normal((2, 3, 2, 10, *width)), dtype)
    update = jnp.asarray(rng.standard_normal((2, 3, 2, 3, *width)), dtype)
    got = jax.jit(write_slots)(buffer, update, jnp.int32(6))
    np.testing.assert_array_equal(np.asarray(xla.write_slots(buffer, update, jnp.int32(6), False)), np.asarray(got))
    want = np.asarray(buffer).copy()
    want[:, :, :, 6:9] = np.asarray(update)
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(Exception, match="do not fit"):
        jax.block_until_ready(jax.jit(write_slots)(buffer, update, jnp.int32(8)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("start", [0, 5, 8, 9])
@pytest.mark.parametrize("width", [(4,), ()])
def test_write_slots_wraps_around_a_ring(dtype, start, width):
    rng = np.random.default_rng(start)
    buffer = jnp.asarray(rng.standard_normal((2, 1, 2, 10, *width)), dtype)
    update = jnp.asarray(rng.standard_normal((2, 1, 2, 4, *width)), dtype)
    want = np.asarray(buffer).copy()
    want[:, :, :, [(start + j) % 10 for j in range(4)]] = np.asarray(update)
    write = jax.jit(lambda b, u, s: write_slots(b, u, s, wrap=True))
    np.testing.assert_array_equal(np.asarray(write(buffer, update, jnp.int32(start))), want)
    reference = jax.jit(lambda b, u, s: xla.write_slots(b, u, s, wrap=True))
    np.testing.assert_array_equal(np.asarray(reference(buffer, update, jnp.int32(start))), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size, pages_per_row, head_dim", [(4, 5, 16), (16, 3, 128), (1, 9, 8)])
def test_paged_decode_attention_reads_each_rows_pages(dtype, page_size, pages_per_row, head_dim):
    rng = np.random.default_rng(page_size)
    layers, pages, batch, kv_heads, groups = 2, 40, 3, 2, 2
    keys = jnp.asarray(3 * rng.standard_normal((layers, pages, kv_heads, page_size, head_dim)), dtype)
    values = jnp.asarray(rng.standard_normal((layers, pages, kv_heads, page_size, head_dim)), dtype)
    tables = rng.permutation(pages)[: batch * pages_per_row].reshape(batch, pages_per_row).astype(np.int32)
    kv_seq = pages_per_row * page_size
    valid = np.arange(kv_seq)[None] < np.array([[kv_seq], [kv_seq // 2], [0]])  # full, half, empty row
    self_valid = np.array([True, True, False])
    query = rng.standard_normal((batch, kv_heads, groups, head_dim)).astype(np.float32)
    new_key = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    new_value = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
    args = (query, keys, values, jnp.int32(1), jnp.asarray(tables), valid, self_valid, new_key, new_value)
    got = jax.jit(paged_decode_attention, static_argnums=8)(*_visible(args, 5), head_dim**-0.5)
    # The reference: each row's pages copied out end to end, then contiguous attention.
    gathered = np.stack([np.concatenate([np.asarray(keys[1, p]) for p in row], axis=1) for row in tables])
    gathered_values = np.stack([np.concatenate([np.asarray(values[1, p]) for p in row], axis=1) for row in tables])
    np.testing.assert_array_equal(np.asarray(gather_pages(keys, jnp.int32(1), jnp.asarray(tables))), gathered)
    want = attention_float64(query, gathered, gathered_values, valid, self_valid, new_key, new_value, head_dim**-0.5)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    no_sinks = _sinks_or_none(None, kv_heads, groups)
    np.testing.assert_allclose(
        xla.paged_decode_attention(*args, no_sinks, *NO_SCALES, scale=head_dim**-0.5), want, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_pages_writes_each_token_to_its_slot_and_skips_padding(dtype):
    rng = np.random.default_rng(3)
    layers, pages, kv_heads, page_size, head_dim = 2, 6, 2, 4, 8
    pool = jnp.asarray(rng.standard_normal((layers, pages, kv_heads, page_size, head_dim)), dtype)
    update = jnp.asarray(rng.standard_normal((layers, 2, kv_heads, 3, head_dim)), dtype)
    slots = np.array([[13, 14, 15], [2, 3, -1]], np.int32)  # row 0 ends a page, row 1 has padding
    want = np.asarray(pool).copy()
    for b in range(2):
        for t in range(3):
            if slots[b, t] >= 0:
                want[:, slots[b, t] // page_size, :, slots[b, t] % page_size] = np.asarray(update)[:, b, :, t]
    np.testing.assert_array_equal(np.asarray(jax.jit(write_pages)(pool, update, slots)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(xla.write_pages)(pool, update, slots)), want)
    with pytest.raises(Exception, match="outside the page pool"):
        jax.block_until_ready(jax.jit(write_pages)(pool, update, np.array([[24, 0, 1], [2, 3, -1]], np.int32)))


@pytest.mark.parametrize("batch, heads, key_dim, value_dim", [(1, 1, 8, 12), (3, 4, 16, 16), (2, 32, 128, 128)])
def test_delta_rule_step_updates_each_rows_slot_in_place_as_float64_does(batch, heads, key_dim, value_dim):
    rng = np.random.default_rng(batch + heads)
    layers, slots, members, member, layer = 3, batch + 2, 2, 1, 2
    pool = rng.standard_normal((layers, slots, members, heads, key_dim, value_dim)).astype(np.float32)
    row_slots = rng.permutation(slots)[:batch].astype(np.int32)
    fresh = np.arange(batch) % 2 == 1  # odd rows start from zeros
    q, k = (rng.standard_normal((batch, heads, key_dim)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((batch, heads, value_dim)).astype(np.float32)
    g = -rng.uniform(0, 2, (batch, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (batch, heads)).astype(np.float32)
    out, new_pool = jax.jit(delta_rule_step, static_argnums=2, donate_argnums=0)(
        jnp.asarray(pool), jnp.int32(layer), member, row_slots, fresh, q, k, v, g, beta
    )
    expected_pool = pool.astype(np.float64)
    for b in range(batch):
        s = 0 * expected_pool[layer, row_slots[b], member] if fresh[b] else expected_pool[layer, row_slots[b], member]
        s = s * np.exp(g[b].astype(np.float64))[:, None, None]
        delta = (v[b] - np.einsum("hkv,hk->hv", s, k[b])) * beta[b][:, None]
        s = s + k[b][:, :, None] * delta[:, None, :]
        expected_pool[layer, row_slots[b], member] = s
        np.testing.assert_allclose(np.asarray(out)[b], np.einsum("hkv,hk->hv", s, q[b]), atol=2e-5, rtol=1e-5)
    # Every other slot, member and layer is untouched.
    np.testing.assert_allclose(np.asarray(new_pool), expected_pool, atol=2e-5, rtol=1e-5)
    untouched = np.ones(pool.shape[:3], bool)
    untouched[layer, row_slots, member] = False
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("batch, heads, row_start, rows", [(1, 1, 0, 5), (3, 4, 7, 9), (2, 16, 128, 128)])
def test_headwise_matvec_reads_each_heads_rows_of_one_layer(dtype, transpose, batch, heads, row_start, rows):
    rng = np.random.default_rng(heads + rows)
    layers, per_head, width, layer = 3, row_start + rows + 2, 24 if heads < 16 else 512, 1
    stack = jnp.asarray(rng.standard_normal((layers, heads * per_head, width)), dtype)
    x = rng.standard_normal((batch, heads, rows if transpose else width)).astype(np.float32)
    out = jax.jit(headwise_matvec, static_argnames=("heads", "row_start", "rows", "transpose"))(
        x, stack, jnp.int32(layer), heads=heads, row_start=row_start, rows=rows, transpose=transpose
    )
    weight = np.asarray(stack.astype(jnp.float32), np.float64)[layer].reshape(heads, per_head, width)
    weight = weight[:, row_start : row_start + rows]
    expected = np.einsum("bho,hoi->bhi" if transpose else "bhi,hoi->bho", x.astype(np.float64), weight)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=1e-5)


def test_portable_matvec_loops_equal_the_dot_of_the_slice():
    """The loops CPUs without AVX-512 run: float32 and bfloat16 weights, activations in
    float32 or bfloat16 values, one to seventeen rows, odd widths."""
    script = """
import jax, jax.numpy as jnp, numpy as np
from eqx_models.backends.cpu import kernels_status
from eqx_models.ops import stacked_matvecs
assert kernels_status() == "ready"
rng = np.random.default_rng(0)
for weights, activations in [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16)]:
    for rows, out_features, in_features in [(1, 37, 19), (3, 64, 1024), (9, 130, 48), (17, 20, 70)]:
        stacks = [jnp.asarray(rng.standard_normal((3, n, in_features)), weights) for n in (out_features, 5)]
        x = jnp.asarray(rng.standard_normal((rows, in_features)), activations).astype(jnp.float32)
        for stack, got in zip(stacks, jax.jit(stacked_matvecs)(x, stacks, jnp.int32(2))):
            exact = np.asarray(x, np.float64) @ np.asarray(stack[2].astype(jnp.float32), np.float64).T
            np.testing.assert_allclose(got, exact, atol=1e-5 * np.sqrt(in_features), rtol=0)
"""
    env = dict(os.environ, EQX_MODELS_KERNELS_PORTABLE="1")
    subprocess.run([sys.executable, "-c", script], env=env, check=True)


def test_model_without_kernels_gives_the_same_tokens_and_logits(tmp_path):
    """`EQX_MODELS_KERNELS=0` (no compiler) falls back to XLA with the same results."""
    script = """
import sys, jax, jax.numpy as jnp, numpy as np, eqx_models
from eqx_models.backends.cpu import kernels_status
config = eqx_models.DecoderConfig(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, use_qk_norm=True)
model = eqx_models.CausalLM(config, key=jax.random.key(0))
import equinox as eqx
from eqx_models.nn.linear import Embedding, Linear
is_weighted = lambda x: isinstance(x, (Linear, Embedding))
weights = lambda m: [l.weight for l in jax.tree.leaves(m, is_leaf=is_weighted) if is_weighted(l)]
model = eqx.tree_at(weights, model, [w / (0.02 * np.sqrt(w.shape[-1])) for w in weights(model)])
ids = np.random.default_rng(0).integers(0, 101, (2, 9))
cache = model.init_cache(2, 16)
_, cache = model(ids, cache=cache)
logits, _ = model(ids[:, :1], cache=cache)
tokens = eqx_models.generate(model, ids, max_new_tokens=6)
np.savez(sys.argv[1], logits=np.asarray(logits), tokens=np.asarray(tokens), status=kernels_status())
"""
    results = {}
    for flag in ("1", "0"):
        out = tmp_path / f"kernels_{flag}.npz"
        env = dict(os.environ, EQX_MODELS_KERNELS=flag)
        subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True)
        results[flag] = np.load(out)
    assert str(results["1"]["status"]) == "ready" and "EQX_MODELS_KERNELS=0" in str(results["0"]["status"])
    assert 1.0 < np.abs(results["0"]["logits"]).max() < 100.0
    np.testing.assert_allclose(results["1"]["logits"], results["0"]["logits"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(results["1"]["tokens"], results["0"]["tokens"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_layer_rows_and_pages_are_copied_exactly(dtype):
    from eqx_models.ops import index_layer, take_rows

    rng = np.random.default_rng(7)
    stack = jnp.asarray(rng.standard_normal((4, 6, 5)), dtype)
    pool = jnp.asarray(rng.standard_normal((3, 10, 2, 4, 8)), dtype)
    ids = jnp.asarray([[5, 0, 3], [2, 2, 1]], jnp.int32)

    def per_layer(_, layer):  # inside a scan, as the decoder takes them
        return None, (index_layer(stack, layer), take_rows(stack[layer], ids), gather_pages(pool, layer % 3, ids))

    _, (layers, rows, pages) = jax.jit(lambda: jax.lax.scan(per_layer, None, jnp.arange(4)))()
    host, host_pool = np.asarray(stack), np.asarray(pool)
    np.testing.assert_array_equal(np.asarray(layers), host)
    np.testing.assert_array_equal(np.asarray(rows), host[:, np.asarray(ids)])
    want = np.stack([host_pool[l % 3][np.asarray(ids)].transpose(0, 2, 1, 3, 4).reshape(2, 2, 12, 8) for l in range(4)])
    np.testing.assert_array_equal(np.asarray(pages), want)
    # Ids past the rows are clamped, as XLA's gather clamps them.
    np.testing.assert_array_equal(np.asarray(jax.jit(take_rows)(stack[0], jnp.asarray([9, -2]))), host[0][[5, 0]])


def test_a_bfloat16_layer_loop_copies_no_whole_stack():
    # XLA:CPU hoisted a copy of every 16-bit weight stack out of the layer loop (as
    # float32, or given the bits as integers, as uint16): the whole model moved on
    # every prompt. The compiled loop must only copy out the layer it reads.
    from eqx_models.ops import index_layer, take_rows

    stacks = [jnp.ones((6, 64, 48), jnp.bfloat16), jnp.ones((6, 48, 64), jnp.bfloat16)]
    table = jnp.ones((1000, 48), jnp.bfloat16)

    def forward(stacks, table, ids):
        def layer(x, i):
            return jnp.tanh(x @ index_layer(stacks[0], i).T) @ index_layer(stacks[1], i).T, None

        return jax.lax.scan(layer, take_rows(table, ids), jnp.arange(6))[0]

    text = jax.jit(forward).lower(stacks, table, jnp.arange(16)).compile().as_text()
    whole = [line for line in text.splitlines() if "[6,64,48]" in line or "[6,48,64]" in line or "[1000,48]" in line]
    copies = [line for line in whole if any(op in line for op in ("convert(", "copy(", "bitcast-convert(", "fusion("))]
    assert not copies, "\n".join(copies)
    np.testing.assert_allclose(np.asarray(jax.jit(forward)(stacks, table, jnp.arange(16)), np.float32),
                               np.asarray(_forward_reference(stacks, table), np.float32), rtol=1e-2)


def _forward_reference(stacks, table):
    x = table[:16].astype(jnp.float32)
    for i in range(6):
        x = jnp.tanh(x @ stacks[0][i].astype(jnp.float32).T) @ stacks[1][i].astype(jnp.float32).T
    return x


GREEDY_CASES = """
import jax, jax.numpy as jnp, numpy as np
from eqx_models.ops import greedy_rows
rng = np.random.default_rng(0)
for width in (1, 3, 15, 16, 17, 33, 151937):
    rows = rng.normal(size=(5, width)).astype(np.float32)
    rows[1, [0, width - 1]] = 50.0  # a tie: the first (one position when width is 1)
    rows[2, width // 2] = np.nan
    rows[2, width - 1] = np.nan  # two NaNs: the first
    rows[3] = -np.inf
    rows[4, width - 1] = np.inf
    got = np.asarray(jax.jit(greedy_rows)(jnp.asarray(rows)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(rows, axis=-1), err_msg=str(width))
np.testing.assert_array_equal(np.asarray(greedy_rows(jnp.zeros((2, 3, 7)).at[1, 2, 4].set(1.0))),
                              [[0, 0, 0], [0, 0, 4]])
"""


@pytest.mark.parametrize("path", ["vector", "portable"])
def test_greedy_rows_are_numpys_argmax(path):
    """First position of the largest value, a NaN the largest, rows of -inf pick 0,
    widths that are not whole blocks of lanes; the portable loops forced on this CPU
    in a fresh process (the library picks its path once)."""
    env = dict(os.environ, **({"EQX_MODELS_KERNELS_PORTABLE": "1"} if path == "portable" else {}))
    subprocess.run([sys.executable, "-c", GREEDY_CASES], env=env, check=True)


def test_greedy_rows_refuses_an_empty_vocabulary():
    from eqx_models.ops import greedy_rows

    with pytest.raises(ValueError, match="empty last axis"):
        greedy_rows(jnp.zeros((2, 0)))


def test_visible_slots_are_the_real_tokens_within_the_window():
    # Row 0: left padding, then positions 0-3; row 1: a ring that wrapped (slots
    # 0-1 hold the newest tokens). Each new token is at position 4 / 7, window 3.
    visible = VisibleSlots(jnp.asarray([[-1, 0, 1, 2, 3], [5, 6, 2, 3, 4]], jnp.int32), jnp.asarray([4, 7], jnp.int32),
                           jnp.int32(3))
    np.testing.assert_array_equal(visible.valid(), [[False, False, False, True, True], [True, True, False, False, False]])
    np.testing.assert_array_equal(visible.self_valid(), [True, True])
    # A padding row (position -1) does not see its own token.
    assert not VisibleSlots(visible.slot_positions, jnp.asarray([4, -1], jnp.int32), jnp.int32(3)).self_valid()[1]
    masks = (np.random.default_rng(0).random((3, 6)) < 0.5, np.asarray([True, False, True]))
    of_mask = VisibleSlots.of_mask(*masks)
    np.testing.assert_array_equal(of_mask.valid(), masks[0])
    np.testing.assert_array_equal(of_mask.self_valid(), masks[1])


def test_the_reference_decode_attention_never_copies_the_layers_cache():
    # The token's own key and value join the softmax beside the cache: appended to
    # it, they made every step copy the layer's whole cache (the TPU's reference path).
    layers, batch, kv_heads, groups, slots, head_dim = 2, 3, 2, 2, 64, 16
    stack = jnp.zeros((layers, batch, kv_heads, slots, head_dim), jnp.bfloat16)
    new = jnp.zeros((batch, kv_heads, head_dim), jnp.bfloat16)
    none = jnp.zeros((0,), jnp.float32)
    jaxpr = jax.make_jaxpr(xla.decode_attention, static_argnums=(11,))(
        jnp.zeros((batch, kv_heads, groups, head_dim), jnp.bfloat16), stack, stack + 1, jnp.int32(1),
        jnp.ones((batch, slots), bool), jnp.ones(batch, bool), new, new, jnp.full((kv_heads, groups), -jnp.inf),
        none, none, 0.25).jaxpr
    shapes = [var.aval.shape for eqn in jaxpr.eqns for var in eqn.outvars]
    assert (batch, kv_heads, slots, head_dim) in shapes  # the layer's keys, read as they are
    assert not any(len(shape) == 4 and shape[2] > slots and shape[-1] == head_dim for shape in shapes)
