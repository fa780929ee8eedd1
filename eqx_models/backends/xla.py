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


# A ragged batch's tokens in blocks of this many: a row of more than one new token
# fills whole blocks of its own (`RaggedTokens`), so a block reads its row's pages
# once for all its tokens.
QUERY_BLOCK = 16
# Keys a block of queries meets per step of the online softmax: a few whole pages
# (or blocks of new tokens) at once, so each step's products are not tiny.
KEY_SLOTS = 128


def ragged_paged_attention(
    query, new_keys, new_values, key_pool, value_pool, layer, block_tables, tokens, sinks, key_scales, value_scales,
    scale, softcap, take=take, decode=None,
):
    """The reference. A backend may pass its own page gather (`take(pool, layer,
    pages)`) and its one-token-per-row attention (`decode`, as
    `paged_decode_attention`; default this module's, used without a soft cap).

    Rows of several tokens (prompt chunks) run by blocks of `QUERY_BLOCK` tokens:
    each block against its row's new tokens block by block, then against its row's
    pages column by column (online softmax, as flash attention). Rows of one token
    (decodes) run as a decode step does, one query per row."""
    num_tokens, kv_heads, groups, head_dim = query.shape
    value_dim = new_values.shape[-1]
    rows, positions = tokens.rows, tokens.positions
    row = jnp.clip(rows, 0, block_tables.shape[0] - 1)
    lengths = tokens.lengths
    single = (rows >= 0) & (lengths[row] == 1)
    pages_of = lambda pool, scales, page: _page_rows(take, pool, scales, layer, page)

    def scored(q, k, seen):  # [n, b, kv, g, d] x [n, p, kv, d] -> [n, kv, g, b, p], unseen at the lowest
        scores = jnp.einsum("nbkgd,npkd->nkgbp", q, k) * scale
        if softcap is not None:
            scores = jnp.tanh(scores / softcap) * softcap
        return jnp.where(seen[:, None, None], scores, _LOWEST)

    def page_columns(q, q_rows, q_positions, seen_rows, cached, state):
        """`state` after the pages of each group's row (`q_rows`, one per group),
        `per_step` table columns at a time."""
        tables, (width, page_size) = block_tables[q_rows], (block_tables.shape[1], key_pool.shape[3])
        per_step = max(1, min(width, KEY_SLOTS // page_size))
        # [n, pages, kv, page_size, d] -> [n, pages * page_size, kv, d]
        side_by_side = lambda pages: pages.transpose(0, 1, 3, 2, 4).reshape(len(q), -1, kv_heads, pages.shape[-1])

        def columns(j, state):
            # Columns past the table repeat its last (their slots are past every row's tokens).
            pages = tables[:, jnp.minimum(j * per_step + jnp.arange(per_step), width - 1)]
            keys = side_by_side(pages_of(key_pool, key_scales, pages))
            values = side_by_side(pages_of(value_pool, value_scales, pages))[..., :value_dim]
            slots = j * per_step * page_size + jnp.arange(per_step * page_size)
            seen = seen_rows[:, :, None] & (slots[None, None] < cached[:, None, None])
            seen &= q_positions[:, :, None] - slots[None, None] < tokens.window
            return _online(state, scored(q, keys, seen), values)

        steps = _ceil_div(jnp.max(jnp.where(jnp.any(seen_rows, axis=1), cached, 0)), per_step * page_size)
        return jax.lax.fori_loop(0, steps, columns, state)

    # Rows of several tokens, block by block.
    blocks = num_tokens // QUERY_BLOCK
    shaped = lambda a: a.reshape(blocks, QUERY_BLOCK, *a.shape[1:])
    q_blocks, block_rows, block_positions = shaped(query), shaped(rows), shaped(positions)
    block_row = block_rows[:, 0]
    chunk = (block_rows >= 0) & ~shaped(single)
    state = _empty_state(blocks, kv_heads, groups, QUERY_BLOCK, value_dim)

    per_step = max(1, KEY_SLOTS // QUERY_BLOCK)
    flat = lambda a: a.reshape(blocks, per_step * QUERY_BLOCK, *a.shape[3:])

    def new_blocks(step, state):  # the new tokens of the blocks `offsets` before each
        offsets = step * per_step + jnp.arange(per_step)
        source = jnp.arange(blocks)[:, None] - offsets[None]  # [blocks, per_step]
        inside = source >= 0
        source = jnp.maximum(source, 0)
        key_rows = jnp.where(inside[..., None], block_rows[source], -1).reshape(blocks, -1)
        before = block_positions[:, :, None] - block_positions[source].reshape(blocks, -1)[:, None, :]
        seen = chunk[:, :, None] & (block_rows[:, :, None] == key_rows[:, None, :]) & (before >= 0)
        seen &= before < tokens.window
        return _online(state, scored(q_blocks, flat(shaped(new_keys)[source]), seen), flat(shaped(new_values)[source]))

    longest = jnp.max(jnp.where(lengths > 1, lengths, 0))
    steps = _ceil_div(_ceil_div(longest, QUERY_BLOCK), per_step)  # the blocks a chunk spans, per_step a step
    state = jax.lax.fori_loop(0, steps, new_blocks, state)
    block_cached = tokens.cached[jnp.maximum(block_row, 0)]
    state = page_columns(q_blocks, jnp.maximum(block_row, 0), block_positions, chunk, block_cached, state)
    out = _finished(state, sinks).transpose(0, 3, 1, 2, 4).reshape(num_tokens, kv_heads, groups, value_dim)

    # Rows of one token, one query per row.
    first = jnp.minimum(tokens.query_starts[:-1], num_tokens - 1)
    alone = (lengths == 1)
    if softcap is None:
        slots = jnp.arange(block_tables.shape[1] * key_pool.shape[3])
        valid = (slots[None] < tokens.cached[:, None]) & (tokens.cached[:, None] - slots[None] < tokens.window)
        valid &= alone[:, None]  # a chunk's row is answered above: its pages are not read here
        decoded = (decode or paged_decode_attention)(
            query[first], key_pool, value_pool, layer, block_tables, valid, alone, new_keys[first],
            new_values[first], sinks, key_scales, value_scales, scale,
        )
    else:
        batch = block_tables.shape[0]
        state = _online(_empty_state(batch, kv_heads, groups, 1, value_dim),
                        scored(query[first][:, None], new_keys[first][:, None], alone[:, None, None]),
                        new_values[first][:, None])
        state = page_columns(query[first][:, None], jnp.arange(batch), tokens.cached[:, None], alone[:, None],
                             tokens.cached, state)
        decoded = _finished(state, sinks)[:, :, :, 0]
    return jnp.where(single[:, None, None, None], decoded[row], out)


def _ceil_div(count: Array, size: int) -> Array:
    return (count + size - 1) // size


_LOWEST = float(jnp.finfo(jnp.float32).min)  # finite: a query that sees nothing averages junk, never NaN


def _empty_state(count: int, kv_heads: int, groups: int, queries: int, value_dim: int) -> tuple:
    """Running (max, sum, weighted values) of an online softmax, before any key."""
    shape = (count, kv_heads, groups, queries)
    return (jnp.full(shape, _LOWEST, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, value_dim), jnp.float32))


def _online(state: tuple, scores: Array, values: Array) -> tuple:
    """`state` after keys with `scores` `[n, kv, g, q, p]` and `values` `[n, p, kv, d]`."""
    top, total, out = state
    new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
    weights = jnp.exp(scores - new_top[..., None])
    rescale = jnp.exp(top - new_top)
    out = out * rescale[..., None] + jnp.einsum("nkgqp,npkd->nkgqd", weights, values)
    return new_top, total * rescale + jnp.sum(weights, axis=-1), out


def _finished(state: tuple, sinks: Array) -> Array:
    """The attention output of an online softmax's `state`, the sinks joining it."""
    top, total, out = state
    sink = sinks[None, :, :, None]
    new_top = jnp.maximum(top, sink)
    rescale = jnp.exp(top - new_top)
    # A query that met no key (padding, with no sink) has nothing to divide: 0, not NaN.
    total = jnp.maximum(total * rescale + jnp.exp(sink - new_top), jnp.finfo(jnp.float32).tiny)
    return out * rescale[..., None] / total[..., None]


def _page_rows(take, pool: Array, scales: Array, layer: Array, pages: Array) -> Array:
    """Pages `pool[layer, pages]` in float32, times their per-row scales when given."""
    rows = take(pool, layer, pages).astype(jnp.float32)
    if scales.size:
        rows = rows * take(scales, layer, pages)[..., None]
    return rows


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
