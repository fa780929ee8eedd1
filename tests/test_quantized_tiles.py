"""The "tiles" layout of int8 weights: sixteen output rows stored as the CPU
kernel multiplies them (see `eqx_models.quantization`)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import random_ids, small_model
from test_quantization import arrays_equal, close_to_float64, float_checkpoint, heavy_tailed, layer_weight
from test_quantization import product_float64

import eqx_models
from eqx_models.ops import quantized_matvecs
from eqx_models.quantization import (
    QuantizedWeight,
    quantize,
    quantize_weight,
    rows_to_tiles,
    scales_to_tiles,
    tile_scales_to_rows,
    tiles_in_place,
    tiles_fit,
    tiles_pay,
    tiles_to_rows,
    with_activations,
    with_layout,
)

__all__ = ["float_checkpoint"]  # a module fixture, shared with test_quantization

is_quantized = lambda node: isinstance(node, QuantizedWeight)


def layouts(model) -> set[str]:
    return {w.layout for w in jax.tree.leaves(model, is_leaf=is_quantized) if is_quantized(w)}


def picked_by_auto(model) -> bool:
    """Whether every quantized weight of `model` holds the layout `layout="auto"` gives it."""
    fits = lambda w: tiles_pay() and tiles_fit(w.bits, w.activations, w.shape)
    weights = [w for w in jax.tree.leaves(model, is_leaf=is_quantized) if is_quantized(w)]
    return all(w.layout == ("tiles" if fits(w) else "rows") for w in weights)


def test_tiles_hold_the_integers_in_the_documented_order():
    rows = quantize_weight(heavy_tailed((2, 48, 96)), 8, 32)
    tiles = quantize_weight(heavy_tailed((2, 48, 96)), 8, 32, layout="tiles")
    q, t = np.asarray(rows.packed), np.asarray(tiles.packed)
    assert t.shape == (2, 3, 3, 512) and t.dtype == np.uint8 and tiles.shape == rows.shape == (2, 48, 96)
    for layer, tile, block, v, r, i in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 7, 15, 3), (0, 1, 2, 3, 9, 2), (1, 0, 2, 5, 4, 1)]:
        assert t[layer, tile, block, 64 * v + 4 * r + i] == (int(q[layer, 16 * tile + r, 32 * block + 4 * v + i]) + 128)
    np.testing.assert_array_equal(np.asarray(tiles_to_rows(tiles.packed)), q)
    np.testing.assert_array_equal(np.asarray(rows_to_tiles(rows.packed)), t)
    host = q.copy()
    np.testing.assert_array_equal(tiles_in_place(host), t)
    np.testing.assert_array_equal(np.asarray(tiles.dequantize()), np.asarray(rows.dequantize()))
    # The scales: per tile, per group, the 16 rows side by side.
    scales, tiled_scales = np.asarray(rows.scales), np.asarray(tiles.scales)
    assert tiled_scales.shape == (2, 3, 3, 16) and tiled_scales.dtype == scales.dtype
    for layer, tile, group, r in [(0, 0, 0, 0), (1, 2, 1, 15), (0, 1, 2, 9), (1, 0, 2, 4)]:
        assert tiled_scales[layer, tile, group, r] == scales[layer, 16 * tile + r, group]
    np.testing.assert_array_equal(np.asarray(tile_scales_to_rows(tiles.scales)), scales)
    np.testing.assert_array_equal(scales_to_tiles(scales), tiled_scales)
    np.testing.assert_array_equal(np.asarray(tiles.row_scales()), scales)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 100])
def test_tiled_products_equal_the_float64_product(group_size, rows):
    """304 output rows of 1024 inputs: several chunks of whole tiles, from one
    activation row (decode) to a prompt's."""
    stack = quantize_weight(heavy_tailed((2, 304, 1024), seed=rows), 8, group_size, layout="tiles")
    x = jax.random.normal(jax.random.key(rows), (rows, 1024))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(1))
    close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))


@pytest.mark.parametrize("streams", ["0", "1"])
def test_tiles_read_as_one_stream_or_several_give_the_product(streams):
    """Decode (one or two activation rows) reads stored tiles as four streams on
    Intel CPUs and as one on AMD (EQX_MODELS_QUANTIZED_STREAMS forces either, in a
    fresh process: the library reads it once). 304 rows leave tiles over after the
    streams' share; 512 and 2048 rows split into whole runs."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import jax, jax.numpy as jnp, numpy as np
from test_quantization import close_to_float64, heavy_tailed, layer_weight, product_float64
from eqx_models.ops import quantized_matvecs
from eqx_models.quantization import quantize_weight
for out_features in (304, 512, 2048):
    for group_size in (32, 128):
        stack = quantize_weight(heavy_tailed((2, out_features, 1024), seed=out_features), 8, group_size,
                                layout="tiles")
        for rows in (1, 2, 3):
            x = jax.random.normal(jax.random.key(rows), (rows, 1024))
            (got,) = quantized_matvecs(x, (stack,), jnp.int32(1))
            close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))
"""
    env = dict(os.environ, EQX_MODELS_QUANTIZED_STREAMS=streams)
    subprocess.run([sys.executable, "-c", script], env=env, check=True)


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("kind, in_features, group_size", [
    ("int8-tiles", 96, 32), ("int8-tiles", 416, 32), ("int8-tiles", 320, 64), ("int8", 416, 32),
    ("int4", 416, 32), ("int4-affine", 320, 64),
])
@pytest.mark.parametrize("rows", [1, 9])
def test_tiles_read_scales_of_any_group_count(kind, in_features, group_size, scale_dtype, rows):
    """Stored tiles read their 16 rows' scales as stored columns; rows packed into
    tiles on the way (int8 and int4 from 4 activation rows, affine int4 from 2)
    transpose them eight groups at a time. Group counts that are not a multiple of
    eight (3, 13, 5), float16 and bfloat16 scales."""
    bits, mode = {"int8-tiles": (8, "symmetric"), "int8": (8, "symmetric"), "int4": (4, "symmetric"),
                  "int4-affine": (4, "affine")}[kind]
    stack = quantize_weight(heavy_tailed((2, 48, in_features), seed=in_features), bits, group_size, mode=mode,
                            scale_dtype=scale_dtype, layout="tiles" if kind == "int8-tiles" else "rows")
    x = jax.random.normal(jax.random.key(rows), (rows, in_features))
    (got,) = jax.jit(quantized_matvecs)(x, (stack,), jnp.int32(1))
    close_to_float64(got, product_float64(x, stack, 1), x, np.abs(layer_weight(stack, 1)))


def test_one_call_takes_stacks_of_both_layouts():
    tiled = quantize_weight(heavy_tailed((2, 32, 128), seed=1), 8, 32, layout="tiles")
    rows = quantize_weight(heavy_tailed((2, 24, 128), seed=2), 8, 32)  # 24 rows: no whole tiles
    x = jax.random.normal(jax.random.key(0), (3, 128))
    outs = jax.jit(quantized_matvecs)(x, (rows, tiled, rows), jnp.int32(0))
    for out, stack in zip(outs, (rows, tiled, rows)):
        close_to_float64(out, product_float64(x, stack, 0), x, np.abs(layer_weight(stack, 0)))


def test_embedding_rows_of_tiles_are_the_rows_of_the_weight():
    tiled = quantize_weight(heavy_tailed((64, 96)), 8, 32, layout="tiles")
    ids = jnp.asarray([[0, 17, 63], [16, 15, 31]])
    np.testing.assert_array_equal(np.asarray(tiled.take_rows(ids)), np.asarray(tiled.dequantize()[ids]))


def test_a_tiled_model_computes_what_its_rows_compute():
    model = small_model()  # widths 32 / 64 / 101: the vocabulary (101 rows) keeps rows
    tiled, rows = quantize(model, 8, layout="tiles"), quantize(model, 8, layout="rows")
    assert tiled.model.layers.mlp.up_proj.weight.layout == "tiles"
    assert tiled.model.embed_tokens.weight.layout == "rows"
    ids = random_ids((2, 9)) % 101
    np.testing.assert_allclose(np.asarray(tiled(ids)[0]), np.asarray(rows(ids)[0]), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(eqx_models.generate(tiled, ids, max_new_tokens=6),
                                  eqx_models.generate(rows, ids, max_new_tokens=6))
    assert layouts(with_layout(tiled, "rows")) == {"rows"}
    assert arrays_equal(with_layout(tiled, "rows"), rows)
    # The float-activation path reads rows.
    assert layouts(with_activations(tiled, "float")) == {"rows"}


def test_auto_takes_tiles_where_the_kernel_runs_them(float_checkpoint, tmp_path):
    """quantize, from_pretrained and a reload of a saved int8 checkpoint all pick
    the layout by `tiles_pay()`; the file always holds rows."""
    from safetensors import safe_open

    quantized = eqx_models.from_pretrained(float_checkpoint, quantize="int8")
    assert picked_by_auto(quantized)
    assert quantized.model.layers.mlp.up_proj.weight.layout == ("tiles" if tiles_pay() else "rows")
    assert quantized.model.embed_tokens.weight.layout == "rows"  # 97 rows: not whole tiles
    assert arrays_equal(quantized, quantize(eqx_models.from_pretrained(float_checkpoint), 8))
    eqx_models.save_pretrained(quantized, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "I8"
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [128, 64]
        np.testing.assert_array_equal(f.get_tensor("model.layers.1.mlp.up_proj.weight"),
                                      np.asarray(quantized.model.layers.mlp.up_proj.weight.row_integers()[1]))
    reloaded = eqx_models.from_pretrained(tmp_path)
    assert picked_by_auto(reloaded) and arrays_equal(reloaded, quantized)
    ids = random_ids((1, 6)) % 97
    np.testing.assert_array_equal(eqx_models.generate(reloaded, ids, max_new_tokens=5),
                                  eqx_models.generate(with_layout(quantized, "rows"), ids, max_new_tokens=5))


def test_a_sharded_model_holds_rows():
    from eqx_models.sharding import shard_model

    model = quantize(small_model(), 8, layout="tiles")
    mesh = jax.make_mesh((1,), ("tensor",))
    assert layouts(shard_model(model, mesh)) == {"rows"}


def test_merging_adapters_into_a_tiled_base_keeps_its_layout():
    from eqx_models.lora import apply_lora, merge_lora

    model = quantize(small_model(), 8, layout="tiles")
    merged = merge_lora(apply_lora(model, rank=2, targets="up_proj", key=jax.random.key(0)))
    assert merged.model.layers.mlp.up_proj.weight.layout == "tiles"


def test_tiles_where_they_do_not_fit_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="int4 ones are held as rows"):
        quantize_weight(heavy_tailed((32, 64)), 4, 32, layout="tiles")
    with pytest.raises(ValueError, match="16 output rows a tile"):
        quantize_weight(heavy_tailed((24, 64)), 8, 32, layout="tiles")
    with pytest.raises(ValueError, match="layout must be one of"):
        quantize(small_model(), 8, layout="diagonal")
    with pytest.raises(ValueError, match="layout must be one of"):
        with_layout(small_model(), "columns")
    int4 = quantize(small_model(), 4)
    assert layouts(with_layout(int4, "tiles")) == {"rows"}
    weight = quantize_weight(heavy_tailed((32, 64)), 8, 32, layout="tiles")
    with pytest.raises(ValueError, match="do not match scales"):
        dataclasses.replace(weight, scales=weight.scales[:1])
    with pytest.raises(ValueError, match="do not match scales"):  # the scales of rows, not of tiles
        dataclasses.replace(weight, scales=weight.row_scales())
