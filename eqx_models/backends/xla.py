"""The reference implementation of every op, in plain XLA operations.

Each function computes what its op in `eqx_models.ops` promises, on any device;
the backends fall back to these where they have nothing faster, and the tests
compare every kernel with them. Products and attention are float32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..quantized import dequantize, quantize_activations, tile_scales_to_rows, tiles_to_rows


def layer_of(array: Array | None, layer: Array) -> Array | None:
    """`array[layer]` (None stays None)."""
    return None if array is None else jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)


def float_layer(stack: Array, layer: Array) -> Array:
    """`stack[layer]` in float32."""
    return layer_of(stack, layer).astype(jnp.float32)


def stacked_matvecs(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    x = x.astype(jnp.float32)
    return tuple(jnp.einsum("...i,oi->...o", x, float_layer(stack, layer)) for stack in stacks)


def layer_integers(stack, layer: Array) -> Array:
    """A `QuantizedWeight` stack's integers of one layer, in the rows layout."""
    packed = layer_of(stack.packed, layer)
    return tiles_to_rows(packed) if stack.layout == "tiles" else packed


def layer_scales(stack, scales: Array, layer: Array) -> Array:
    """The layer's slice of `scales` (the stack's, or a tangent of them) in the rows layout."""
    scales = layer_of(scales, layer)
    return tile_scales_to_rows(scales) if stack.layout == "tiles" else scales


def quantized_layer(stack, layer: Array) -> Array:
    """A `QuantizedWeight` stack's layer, dequantized to float32."""
    return dequantize(layer_integers(stack, layer), layer_scales(stack, stack.scales, layer), stack.bits,
                      stack.group_size, biases=layer_of(stack.biases, layer))


def quantized_matvecs(x: Array, stacks: tuple, layer: Array) -> tuple[Array, ...]:
    x = quantize_activations(x) if stacks[0].activations == "int8" else x
    return tuple(jnp.einsum("...i,oi->...o", x, quantized_layer(stack, layer)) for stack in stacks)


_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def grouped_matmul(rows: Array, stack: Array, layer: Array, group_sizes: Array) -> Array:
    weights = layer_of(stack, layer)
    out = jax.lax.ragged_dot_general(rows, weights, group_sizes, _GROUPED, preferred_element_type=jnp.float32)
    return beyond_groups_zeroed(out, group_sizes)


def beyond_groups_zeroed(out: Array, group_sizes: Array) -> Array:
    """`out` with its rows past the groups' total set to zero."""
    inside = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(inside[:, None], out, 0)


def _layer_rows(stack: Array, scales: Array, layer: Array) -> Array:
    """`stack[layer]` in float32, times its per-row `scales[layer]` when they are given."""
    rows = float_layer(stack, layer)
    if scales.size:
        rows = rows * layer_of(scales, layer)[..., None]
    return rows


# Prompts longer than twice this run attention in blocks of this many queries, each
# against the keys up to its last query only (causal): half the work of the full
# square, and score tiles that stay a fraction of the `[seq, seq]` matrix.
QUERY_CHUNK = 512


def masked_attention(query, keys, values, allowed, scale=None, softcap=None, sinks=None):
    # Long prompts are split by query along the last (the new tokens' own, causal) block.
    seq = query.shape[3]
    if seq > 2 * QUERY_CHUNK:
        outputs = []
        for start in range(0, seq, QUERY_CHUNK):
            stop = min(start + QUERY_CHUNK, seq)
            # Exact, not approximate: queries before `stop` never see new keys after it.
            outputs.append(
                masked_attention(
                    query[:, :, :, start:stop],
                    keys[:-1] + [keys[-1][:, :, :stop]],
                    values[:-1] + [values[-1][:, :, :stop]],
                    [a[:, start:stop] for a in allowed[:-1]] + [allowed[-1][:, start:stop, :stop]],
                    scale,
                    softcap,
                    sinks,
                )
            )
        return jnp.concatenate(outputs, axis=3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = [
        jnp.einsum("bkgtd,bksd->bkgts", query, k, preferred_element_type=jnp.float32) * scale for k in keys
    ]
    if softcap is not None:
        scores = [jnp.tanh(s / softcap) * softcap for s in scores]
    # A large finite value rather than -inf: a fully masked row (a padding query)
    # then gets uniform weights instead of NaN, and its output is ignored anyway.
    lowest = jnp.finfo(jnp.float32).min
    scores = [jnp.where(m[:, None, None], s, lowest) for s, m in zip(scores, allowed)]
    row_max = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)[..., None]
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)[None, :, :, None, None]
        row_max = jnp.maximum(row_max, sinks)
    weights = [jnp.exp(s - row_max) for s in scores]
    total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    if sinks is not None:
        total = total + jnp.exp(sinks - row_max)
    return sum(
        jnp.einsum("bkgts,bksd->bkgtd", (w / total).astype(v.dtype), v)
        for w, v in zip(weights, values)
    )


def causal_attention(query, keys, values, attention_mask, segment_ids, window, scale, softcap, sinks):
    seq = keys.shape[2]
    slots = jnp.arange(seq)
    allowed = (slots[None, :, None] >= slots[None, None, :]) & attention_mask.astype(bool)[:, None, :]
    allowed &= slots[None, :, None] - slots[None, None, :] < window
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    return masked_attention(query, [keys], [values], [allowed], scale, softcap, sinks)


def decode_attention(
    query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales, value_scales,
    scale,
):
    value_dim = new_value.shape[-1]
    slots = valid.shape[1]
    keys = _layer_rows(key_stack, key_scales, layer)
    values = _layer_rows(value_stack, value_scales, layer)[..., :value_dim]
    new_key, new_value = new_key.astype(keys.dtype), new_value.astype(values.dtype)
    # The token's own key and value join as one more score and one more term, not
    # appended to the cache: appending copies the layer's whole cache every step.
    scores = jnp.concatenate([
        jnp.einsum("bkgd,bksd->bkgs", query, keys), jnp.einsum("bkgd,bkd->bkg", query, new_key)[..., None],
    ], axis=-1) * scale
    allowed = jnp.concatenate([valid, self_valid[:, None]], axis=1)
    allowed = allowed | ~jnp.any(allowed, axis=1, keepdims=True)  # nothing allowed: average all
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    # The sink joins each row's softmax as one more logit, without a value.
    sink_column = jnp.broadcast_to(sinks[None, :, :, None], (*scores.shape[:3], 1))
    weights = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)
    cached = jnp.einsum("bkgs,bksd->bkgd", weights[..., :slots], values)
    return cached + weights[..., slots, None] * new_value[:, :, None]


def take(table: Array, layer: Array, ids: Array) -> Array:
    """`table[layer, ids]` for a `[layers, rows, ...]` table, ids clamped to the rows."""
    return table[layer, jnp.clip(ids, 0, table.shape[1] - 1)]


def end_to_end(pages: Array) -> Array:
    """`[batch, pages_per_row, kv_heads, page_size, head_dim]` pages as each row's
    slots in order, `[batch, kv_heads, kv_seq, head_dim]`."""
    batch, per_row, kv_heads, page_size, head_dim = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, per_row * page_size, head_dim)


def gather_pages(pool: Array, layer: Array, block_tables: Array) -> Array:
    return end_to_end(take(pool, layer, block_tables))


def gathered_scales(scales: Array, layer: Array, block_tables: Array, gather=gather_pages) -> Array:
    """An int8 pool's per-slot scales gathered like its pages (empty stays empty)."""
    if not scales.size:
        return scales
    return gather(scales[..., None], layer, block_tables)[None, ..., 0]


def paged_decode_attention(
    query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
    value_scales, scale,
):
    keys = gather_pages(key_pool, layer, block_tables)[None]
    values = gather_pages(value_pool, layer, block_tables)[None]
    return decode_attention(
        query, keys, values, jnp.int32(0), valid, self_valid, new_key, new_value, sinks,
        gathered_scales(key_scales, layer, block_tables), gathered_scales(value_scales, layer, block_tables), scale,
    )


def greedy_rows(logits: Array) -> Array:
    # Two plain reductions: XLA:CPU's argmax is one reduction over (value, index)
    # pairs that it does not vectorise (0.67 ms over 151,936 logits against 0.14 ms
    # this way on a 2-core AMD EPYC).
    top = jnp.max(logits, axis=-1, keepdims=True)
    positions = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first = (logits == top) | jnp.isnan(logits)  # a NaN is the max (NumPy's rule); it equals nothing
    return jnp.min(jnp.where(first, positions, logits.shape[-1]), axis=-1)


def write_pages(pool: Array, update: Array, slots: Array) -> Array:
    page_size = pool.shape[3]
    # -1 (padding) becomes a page past the end, which the scatter drops.
    pages = jnp.where(slots < 0, pool.shape[1], slots // page_size)
    by_token = update.transpose(1, 3, 0, 2, *range(4, update.ndim))
    return pool.at[:, pages, :, slots % page_size].set(by_token, mode="drop")


def write_slots(buffer: Array, update: Array, start: Array, wrap: bool) -> Array:
    if wrap:
        slots = (start + jnp.arange(update.shape[3])) % buffer.shape[3]
        return buffer.at[:, :, :, slots].set(update)
    return jax.lax.dynamic_update_slice(buffer, update, (0, 0, 0, start, 0)[: buffer.ndim])


def delta_rule_token(state: Array, q: Array, k: Array, v: Array, g: Array, beta: Array) -> tuple[Array, Array]:
    """One token of the gated delta rule: `S = exp(g) S`, `S += k (beta (v - S^T k))^T`;
    returns the new `S` and `S^T q`."""
    state = state * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q)


def delta_rule_step(pool, layer, slots, fresh, q, k, v, g, beta, member):
    s = jnp.where(fresh[:, None, None, None], 0.0, pool[layer, slots, member])
    s, out = delta_rule_token(s, q, k, v, g, beta)
    return out, pool.at[layer, slots, member].set(s)


def headwise_matvec(x, stack, layer, heads, row_start, rows, transpose):
    per_head = stack.shape[1] // heads
    weight = float_layer(stack, layer).reshape(heads, per_head, stack.shape[2])[:, row_start : row_start + rows]
    return jnp.einsum("bho,hoi->bhi" if transpose else "bhi,hoi->bho", x, weight)
