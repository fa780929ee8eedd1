"""The new tokens' attention to each other on the TPU: JAX's splash attention, a
flash attention that computes only the blocks of the `[seq, seq]` square its
mask keeps (the causal half, or the band of a sliding window), forward and
backward.

The mask is static (built when the program is traced), so the kernel takes a
window that is a plain int; left padding and packed documents go in as segment
ids (a padding token is a segment of its own). Grouped key/value heads run as
splash's one-key-head form, mapped over the key/value heads and the batch.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jaxtyping import Array, Float, Int

from . import precision

# The largest of these that divides the sequence is the kernel's block of queries
# and of keys (forward and backward).
BLOCK_SIZES = (512, 256, 128)
PADDING_SEGMENT = int(jnp.iinfo(jnp.int32).min)


def _block(seq: int) -> int | None:
    return next((size for size in BLOCK_SIZES if seq % size == 0), None)


def fits(query, keys, values, window, sinks) -> bool:
    """Whether the kernel takes this attention: a static window, no sinks, float
    inputs, values as wide as the keys, heads a multiple of 128 lanes wide and a
    sequence of whole blocks."""
    seq, head_dim = keys.shape[2], keys.shape[3]
    return (
        isinstance(window, int)
        and sinks is None
        and values.shape[-1] == head_dim
        and head_dim % 128 == 0
        and _block(seq) is not None
        and all(a.dtype in (jnp.float32, jnp.bfloat16) for a in (query, keys, values))
    )


@functools.cache
def _kernel(seq: int, groups: int, window: int, softcap: float | None, interpret: bool):
    """The splash kernel for `groups` query heads over one key/value head."""
    if window >= seq:
        mask = splash.CausalMask((seq, seq))
    else:  # keys at most `window - 1` slots before the query, none after
        mask = splash.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    block = _block(seq)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )
    # The kernel holds its mask's block tables as arrays: made concrete here, not
    # as values of whichever trace first asks for the kernel, so it can be reused.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa_single_device(
            splash.MultiHeadMask([mask] * groups), block_sizes=sizes, attn_logits_soft_cap=softcap,
            interpret=interpret,
        )


def causal_attention(
    query: Float[Array, "batch kv_heads groups seq head_dim"],
    keys: Float[Array, "batch kv_heads seq head_dim"],
    values: Float[Array, "batch kv_heads seq head_dim"],
    attention_mask: Int[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"] | None,
    window: int,
    scale: float,
    softcap: float | None,
    *,
    interpret: bool = False,
) -> Float[Array, "batch kv_heads groups seq head_dim"]:
    """`eqx_models.ops.causal_attention` (without sinks) through splash attention.
    A padding query sees the padding before it, not nothing: its output differs
    from the reference's, and is ignored as padding is. `interpret` runs the kernel
    in Pallas' interpreter (on any backend)."""
    seq, groups = keys.shape[2], query.shape[2]
    kernel = _kernel(seq, groups, window, softcap, interpret)
    documents = jnp.zeros_like(attention_mask) if segment_ids is None else segment_ids
    documents = jnp.where(attention_mask > 0, documents, PADDING_SEGMENT).astype(jnp.int32)

    def one_head(q, k, v, ids):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))
    heads = precision.traced_for_inputs(jax.vmap(per_row), query.dtype, keys.dtype, values.dtype)
    out = heads((query * scale).astype(query.dtype), keys, values, documents)
    return out.astype(values.dtype)
