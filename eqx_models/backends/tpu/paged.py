"""One new token per row attending to its pages of a layer of the paged KV pool, in
Pallas for the TPU, reading the pages where they lie.

The pools `[layers, pages, kv_heads, page_size, head_dim]` enter whole with the
layer index and the rows' block tables (scalar prefetch), so neither the layer
nor a row's pages are ever copied out. A grid step reads `per_step` pages of a
row side by side, each through a block spec of its own that fetches the page
straight from its place in the pool: a step of one page of 16 tokens would spend
more on the step than on its bytes. Steps before a row's first live page or
after its last map to the nearest live step, which Pallas does not fetch again,
and the kernel skips them: the bytes read are the row's live pages.

The softmax runs as `attention.kernel` runs it for the dense cache, and
`attention.fold` adds the token's own key/value and the sinks.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from .attention import float_kv, fold, kernel, live_block, live_blocks, softmax_parts

# Slots a grid step reads, at least (whole pages).
SLOTS_PER_STEP = 128
# Block table entries the kernel takes: they go to the core's scalar memory (1 MiB on
# a v5e), a quarter of it for them.
MAX_TABLE_ENTRIES = 1 << 16


def pages_per_step(page_size: int, width: int) -> int:
    """Pages a grid step reads: enough for `SLOTS_PER_STEP` slots, at most the table's width."""
    return max(1, min(width, SLOTS_PER_STEP // page_size))


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_attention_parts(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_pool: Float[Array, "layers pages kv_heads page_size head_dim"],
    value_pool: Float[Array, "layers pages kv_heads page_size head_dim"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch width"],
    valid: Bool[Array, "batch slots"],
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[Array, Array, Array]:
    """Softmax parts `(acc, max, sum)` of one token per row over the valid slots of
    its pages of `key_pool[layer]` / `value_pool[layer]` (slot `s` of a row is slot
    `s % page_size` of page `block_tables[row, s // page_size]`), as
    `attention.cached_attention` gives them for the dense cache."""
    batch, kv_heads, groups, head_dim = query.shape
    page_size = key_pool.shape[3]
    width = block_tables.shape[1]
    per_step = pages_per_step(page_size, width)
    steps = -(-width // per_step)
    padded = steps * per_step
    # Columns past the table name page 0 and see nothing: whole steps of pages.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - width))).reshape(-1)
    mask = jnp.pad(valid[:, : width * page_size], ((0, 0), (0, (padded - width) * page_size)))
    first, last = live_blocks(mask, per_step * page_size)

    def page_spec(n: int) -> pl.BlockSpec:
        def where(row, j, layer, tables, first, last):
            return (layer[0], tables[row * padded + live_block(j, row, first, last) * per_step + n], 0, 0, 0)
        return pl.BlockSpec((None, None, kv_heads, page_size, head_dim), where)

    per_row = lambda last_axis: pl.BlockSpec(
        (1, kv_heads, groups, last_axis), lambda row, j, layer, tables, first, last: (row, 0, 0, 0)
    )
    parts = softmax_parts(batch, kv_heads, groups, head_dim)
    step = lambda layer_ref, tables_ref, *refs: kernel(*refs, scale=scale, blocks=steps, per_step=per_step)
    call = pl.pallas_call(
        step,
        out_shape=parts["out_shape"],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, steps),
            in_specs=[
                per_row(head_dim),
                *[page_spec(n) for n in range(per_step)],
                *[page_spec(n) for n in range(per_step)],
                pl.BlockSpec((1, 1, per_step * page_size),
                             lambda row, j, layer, tables, first, last: (row, 0, live_block(j, row, first, last))),
            ],
            out_specs=[per_row(head_dim), per_row(1), per_row(1)],
            scratch_shapes=parts["scratch_shapes"],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )
    pages = [key_pool] * per_step + [value_pool] * per_step
    return call(jnp.reshape(layer, (1,)).astype(jnp.int32), tables, first, last, query, *pages,
                mask.astype(jnp.int32)[:, None, :])


def paged_decode_attention(
    query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, scale, *,
    interpret=False,
) -> Float[Array, "batch kv_heads groups head_dim"]:
    """`eqx_models.ops.paged_decode_attention` for pools the kernel takes (`fits`):
    the row's pages through the kernel, its own key/value and the sinks folded in
    here, float32."""
    parts = paged_attention_parts(query, key_pool, value_pool, layer, block_tables, valid, scale=scale,
                                  interpret=interpret)
    return fold(parts, query, self_valid, new_key, new_value, sinks, scale)


def fits(query, key_pool, value_pool, block_tables, new_value, key_scales, value_scales) -> bool:
    """Whether `paged_decode_attention` takes these pools: `attention.float_kv`, in
    pages of whole sublane tiles (16 slots: bfloat16 packs two rows a sublane) whose
    steps are whole lanes of the mask (pages of 16, 32, 64 or a multiple of 128), and
    block tables that fit the scalar memory beside the rest."""
    page_size = key_pool.shape[3]
    return (
        float_kv(key_pool, value_pool, new_value, key_scales, value_scales)
        and page_size % 16 == 0
        and (SLOTS_PER_STEP % page_size == 0 or page_size % SLOTS_PER_STEP == 0)
        and block_tables.size <= MAX_TABLE_ENTRIES
    )
