"""One new token per row attending to a layer of the dense KV cache, in Pallas for
the TPU, reading only the blocks of slots a row can see.

The cache stacks `[layers, batch, kv_heads, kv_seq, head_dim]` enter whole with
the layer index (scalar prefetch), so the layer's slice is never copied out.
The grid walks each row's blocks of `block` slots; a block before the row's first
valid slot or after its last maps to the nearest live block, which Pallas does
not fetch again, and the kernel skips it: the bytes read are the live part of
the cache, not its capacity. All key/value heads of a row go in one grid step.

The kernel returns the softmax's running parts over the cached slots (the
un-normalised sum, the maximum and the total of the weights), and
`decode_attention` folds in the token's own key/value and the sinks in XLA.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

# Far below any score, but finite: `exp(LOWEST - LOWEST)` is 1, not NaN.
LOWEST = -1e30
BLOCK_SIZES = (512, 256, 128)


def block_for(kv_seq: int) -> int | None:
    """The slots per grid step for a cache of `kv_seq` slots (None: it has no whole block)."""
    return next((size for size in BLOCK_SIZES if kv_seq % size == 0), None)


def live_blocks(valid: Bool[Array, "batch kv_seq"], block: int) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """Each row's first and last block holding a valid slot (0 and 0 for a row with none)."""
    per_block = valid.reshape(valid.shape[0], -1, block).any(axis=-1)
    count = per_block.shape[1]
    first = jnp.argmax(per_block, axis=1)
    last = count - 1 - jnp.argmax(per_block[:, ::-1], axis=1)
    return first.astype(jnp.int32), jnp.where(per_block.any(axis=1), last, 0).astype(jnp.int32)


def live_block(j, row, first, last):
    """Grid step `j` of `row` as the block it reads: the nearest of the row's live
    blocks `[first[row], last[row]]` (Pallas does not fetch a repeated block again)."""
    return jnp.clip(j, first[row], last[row])


def kernel(first_ref, last_ref, q_ref, *refs, scale: float, blocks: int, per_step: int = 1):
    """The grid step of one row (`program_id(0)`) and block of slots (`program_id(1)`):
    the block's keys and values come as `per_step` refs each (pages side by side, or
    one block of the dense cache), then the block's mask, the three outputs and
    their three scratch accumulators. Blocks outside `[first, last]` are skipped."""
    keys, values = refs[:per_step], refs[per_step : 2 * per_step]
    mask_ref, acc_out, max_out, sum_out, acc_scr, max_scr, sum_scr = refs[2 * per_step :]
    row, step = pl.program_id(0), pl.program_id(1)

    @pl.when(step == 0)
    def _start():
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        max_scr[...] = jnp.full(max_scr.shape, LOWEST, jnp.float32)
        sum_scr[...] = jnp.zeros(sum_scr.shape, jnp.float32)

    @pl.when((step >= first_ref[row]) & (step <= last_ref[row]))
    def _block():
        side_by_side = lambda parts: jnp.concatenate([part[...] for part in parts], axis=1) if per_step > 1 else parts[0][...]
        q = q_ref[0].astype(jnp.float32)  # [kv_heads, groups, head_dim]
        k = side_by_side(keys).astype(jnp.float32)  # [kv_heads, block, head_dim]
        v = side_by_side(values).astype(jnp.float32)
        scores = jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32) * scale
        allowed = mask_ref[0] > 0  # [1, block]
        scores = jnp.where(allowed[None], scores, LOWEST)
        previous = max_scr[...]
        current = jnp.maximum(previous, scores.max(axis=-1, keepdims=True))
        weights = jnp.where(allowed[None], jnp.exp(scores - current), 0.0)
        decay = jnp.exp(previous - current)
        sum_scr[...] = decay * sum_scr[...] + weights.sum(axis=-1, keepdims=True)
        acc_scr[...] = decay * acc_scr[...] + jax.lax.dot_general(
            weights, v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32
        )
        max_scr[...] = current

    @pl.when(step == blocks - 1)
    def _finish():
        acc_out[0] = acc_scr[...]
        max_out[0] = max_scr[...]
        sum_out[0] = sum_scr[...]


def softmax_parts(batch: int, kv_heads: int, groups: int, head_dim: int) -> dict:
    """The `pallas_call` pieces both decode kernels share: the three outputs (per
    row) and their scratch accumulators."""
    return dict(
        out_shape=(
            jax.ShapeDtypeStruct((batch, kv_heads, groups, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, groups, 1), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, groups, 1), jnp.float32),
        ),
        scratch_shapes=[
            pltpu.VMEM((kv_heads, groups, head_dim), jnp.float32),
            pltpu.VMEM((kv_heads, groups, 1), jnp.float32),
            pltpu.VMEM((kv_heads, groups, 1), jnp.float32),
        ],
    )


@functools.partial(jax.jit, static_argnames=("scale", "block", "interpret"))
def cached_attention(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_stack: Float[Array, "layers batch kv_heads kv_seq head_dim"],
    value_stack: Float[Array, "layers batch kv_heads kv_seq head_dim"],
    layer: Int[Array, ""],
    valid: Bool[Array, "batch kv_seq"],
    *,
    scale: float,
    block: int,
    interpret: bool = False,
) -> tuple[Float[Array, "batch kv_heads groups head_dim"], Float[Array, "batch kv_heads groups 1"],
           Float[Array, "batch kv_heads groups 1"]]:
    """Softmax parts of one token per row over the valid slots of `key_stack[layer]`
    / `value_stack[layer]`: `(acc, max, sum)` with `acc = sum_s exp(score_s - max) v_s`
    and `sum = sum_s exp(score_s - max)` (`sum` 0 for a row with no valid slot).
    `interpret` runs the kernel in Pallas' interpreter (on any backend)."""
    batch, kv_heads, groups, head_dim = query.shape
    kv_seq = key_stack.shape[3]
    blocks = kv_seq // block
    first, last = live_blocks(valid, block)
    cache_spec = pl.BlockSpec(
        (None, None, kv_heads, block, head_dim),
        lambda row, j, layer, first, last: (layer[0], row, 0, live_block(j, row, first, last), 0),
    )
    per_row = lambda width: pl.BlockSpec(
        (1, kv_heads, groups, width), lambda row, j, layer, first, last: (row, 0, 0, 0)
    )
    parts = softmax_parts(batch, kv_heads, groups, head_dim)
    step = lambda layer_ref, *refs: kernel(*refs, scale=scale, blocks=blocks)
    call = pl.pallas_call(
        step,
        out_shape=parts["out_shape"],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, blocks),
            in_specs=[
                per_row(head_dim),
                cache_spec,
                cache_spec,
                pl.BlockSpec((1, 1, block), lambda row, j, layer, first, last: (row, 0, live_block(j, row, first, last))),
            ],
            out_specs=[per_row(head_dim), per_row(1), per_row(1)],
            scratch_shapes=parts["scratch_shapes"],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,  # the plain interpreter: no threads or callbacks
    )
    mask = valid.astype(jnp.int32)[:, None, :]
    return call(jnp.reshape(layer, (1,)).astype(jnp.int32), first, last, query, key_stack, value_stack, mask)


def decode_attention(
    query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, scale, *, interpret=False
) -> Float[Array, "batch kv_heads groups value_dim"]:
    """`eqx_models.ops.decode_attention` for float caches whose values have the
    keys' width (the caller checks, `fits`): the cached slots through the kernel,
    the token's own key/value and the sinks folded in here, float32."""
    block = block_for(key_stack.shape[3])
    parts = cached_attention(query, key_stack, value_stack, layer, valid, scale=scale, block=block,
                             interpret=interpret)
    return fold(parts, query, self_valid, new_key, new_value, sinks, scale)


def fold(parts, query, self_valid, new_key, new_value, sinks, scale: float) -> Float[Array, "batch kv_heads groups d"]:
    """The attention output from the cached slots' softmax parts `(acc, max, sum)`,
    the token's own key/value (where `self_valid`) and the sinks, float32."""
    acc, top, total = parts
    own = scale * jnp.einsum("bkgd,bkd->bkg", query, new_key.astype(jnp.float32))[..., None]
    own = jnp.where(self_valid[:, None, None, None], own, LOWEST)
    sink = jnp.broadcast_to(sinks[None, :, :, None], own.shape)
    peak = jnp.maximum(jnp.maximum(top, own), sink)
    cached_weight = jnp.exp(top - peak)
    own_weight = jnp.where(self_valid[:, None, None, None], jnp.exp(own - peak), 0.0)
    total = cached_weight * total + own_weight + jnp.exp(sink - peak)
    out = cached_weight * acc + own_weight * new_value.astype(jnp.float32)[:, :, None]
    # A row with nothing to attend to (padding) gets zeros rather than 0 / 0.
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)


# Fewer blocks than this and XLA's own attention over the whole cache was as fast
# or faster on a v5e (Qwen3-0.6B shape, 256 slots in one block: 17.2 against 15.4 ms
# a step at batch 256); at 4,096 slots the two took the same time with every slot
# live. The kernel pays where a row's live slots are a fraction of the cache.
MIN_BLOCKS = 4


def float_kv(keys, values, new_value, key_scales, value_scales) -> bool:
    """Whether a cache's keys and values (dense or paged) are what the decode kernels
    read: float, values of their own (not the keys' prefix), as wide as the keys."""
    return (
        keys.dtype in (jnp.float32, jnp.bfloat16)
        and values.dtype == keys.dtype
        and values is not keys
        and values.shape == keys.shape
        and new_value.shape[-1] == keys.shape[-1]
        and not key_scales.size
        and not value_scales.size
    )


def fits(query, key_stack, value_stack, new_value, key_scales, value_scales) -> bool:
    """Whether `decode_attention` takes this cache: `float_kv`, in at least
    `MIN_BLOCKS` whole blocks of slots."""
    block = block_for(key_stack.shape[3])
    return (float_kv(key_stack, value_stack, new_value, key_scales, value_scales) and block is not None
            and key_stack.shape[3] // block >= MIN_BLOCKS)
