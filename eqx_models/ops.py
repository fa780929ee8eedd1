"""The ops the blocks are written in, with contracts that do not depend on the machine.

Each op checks its arguments here and runs as `active_backend()` implements it
(`eqx_models.backends`: C++ kernels on the CPU, the reference XLA ops elsewhere);
every implementation computes the same function as the reference
(`eqx_models.backends.xla`), to rounding.

- the stacked-layer product: `project` / `project_many` (a weight that may be a
  `LayerSlice` of a stack, float or quantized), `stacked_matvecs` /
  `quantized_matvecs` (one layer of stacks, read in place where the backend can);
- the experts' grouped product: `groups_experts`, `grouped_matmul` (rows
  sorted by expert, each group times its expert's weights);
- attention: `causal_attention` (the new tokens among themselves, by metadata),
  `masked_attention` (blocks of keys with masks: a cache and the new tokens);
- one token's attention to a layer of the cache: `decode_attention`,
  `paged_decode_attention`, the slots it sees given by positions (`VisibleSlots`);
  a ragged batch's (prompt chunks and decodes flattened together) to its rows'
  pages and to each other: `ragged_paged_attention` (`RaggedTokens`);
- the cache write: `write_slots`, `write_pages`; and reading a layer or rows:
  `index_layer`, `take_rows`, `gather_pages`;
- the greedy pick: `greedy_rows`;
- the recurrent and per-head products some families need: `delta_rule_step`,
  `headwise_matvec`.
"""

import itertools
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Shaped

from .backends import active_backend
from .backends.xla import delta_rule_token  # noqa: F401  (an op of its own: one token of the rule in XLA)
from .quantized import QuantizedWeight
from .sharding import spans_devices


class LayerSlice(eqx.Module):
    """One layer of a stacked array (weights `[layers, out, in]`, a KV cache
    `[layers, batch, kv_heads, kv_seq, head_dim]`), referred to by index.

    Inside the scanned decoder each `Linear` and the attention see their layer this
    way, so a backend can read the slice in place instead of XLA copying it out
    first. `materialize()` gives the slice itself for everything else.
    """

    stack: Shaped[Array, "layers *rest"] | QuantizedWeight
    index: Int[Array, ""]

    def materialize(self) -> Shaped[Array, "*rest"] | QuantizedWeight:
        take = lambda a: index_layer(a, self.index)
        return jax.tree.map(take, self.stack) if isinstance(self.stack, QuantizedWeight) else take(self.stack)


Weight = Float[Array, "out in"] | QuantizedWeight | LayerSlice


def is_quantized(weight: Weight) -> bool:
    """Whether `weight` (or the stack a `LayerSlice` refers to) is a `QuantizedWeight`."""
    return isinstance(weight.stack if isinstance(weight, LayerSlice) else weight, QuantizedWeight)


def _as_stack(weight: Shaped[Array, "..."] | QuantizedWeight | LayerSlice) -> tuple[Array | QuantizedWeight, Array]:
    """`weight` (any rank: one matrix, or the `[experts, out, in]` of a layer) as a
    stack of one layer and index 0, or a `LayerSlice`'s stack and index."""
    if isinstance(weight, LayerSlice):
        return weight.stack, weight.index
    return jax.tree.map(lambda a: a[None], weight), jnp.int32(0)


def reads_in_place(x: Array, weight: Weight) -> bool:
    """Whether `x @ weight.T` goes through the backend's in-place layer product
    (`stacked_matvecs` / `quantized_matvecs`) rather than a matmul of the slice."""
    return active_backend().reads_layers_in_place(x, _as_stack(weight)[0])


def _matvecs(x: Array, stacks: tuple, index: Array) -> tuple[Array, ...]:
    if isinstance(stacks[0], QuantizedWeight):
        return quantized_matvecs(x, stacks, index)
    return stacked_matvecs(x, stacks, index)


def _whole(weight: Weight, dtype) -> Float[Array, "out in"]:
    """The float weight for XLA's matmul (dequantized in `dtype` when quantized)."""
    if isinstance(weight, LayerSlice):
        weight = weight.materialize()
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight


def _input_kind(weight: Weight) -> str:
    return (weight.stack if isinstance(weight, LayerSlice) else weight).activations if is_quantized(weight) else "float"


def _prepared(x: Array, weight: Weight) -> Array:
    """`x` as a product with `weight` sees it (rounded if it takes int8 activations)."""
    if is_quantized(weight):
        return (weight.stack if isinstance(weight, LayerSlice) else weight).prepare_input(x)
    return x


def project(x: Float[Array, "*batch in"], weight: Weight) -> Float[Array, "*batch out"]:
    """`x @ weight.T` in `x`'s dtype: the backend's in-place layer product where it
    takes these rows (`reads_in_place`), XLA's matmul otherwise.

    For the matmul a quantized weight is dequantized (one layer at a time, in
    `x`'s dtype): prefill reuses each weight over many rows.
    """
    if reads_in_place(x, weight):
        stack, index = _as_stack(weight)
        return _matvecs(x, (stack,), index)[0].astype(x.dtype)
    return jnp.einsum("...i,oi->...o", _prepared(x, weight), _whole(weight, x.dtype))


def project_many(x: Float[Array, "*batch in"], weights: list[Weight]) -> list[Float[Array, "*batch _"]]:
    """`[x @ w.T for w in weights]`, as one operation over all the weights.

    Where the backend reads them in place, the projections go as one call that
    streams every weight; otherwise as one matmul over the weights joined where
    the backend prefers that (`joins_products`), else one matmul each.
    """
    if all(reads_in_place(x, w) for w in weights):
        stacks, indices = zip(*map(_as_stack, weights))
        kinds = {(type(s), s.dtype, getattr(s, "bits", None), getattr(s, "group_size", None),
                  getattr(s, "activations", None), getattr(s, "mode", None)) for s in stacks}
        if len(kinds) == 1 and all(i is indices[0] for i in indices):
            outs = _matvecs(x, stacks, indices[0])
        else:
            outs = [project(x, w) for w in weights]
    elif spans_devices() or not active_backend().joins_products(x):  # on a mesh a join would reshard them
        outs = [project(x, w) for w in weights]
    elif len({_input_kind(w) for w in weights}) > 1:
        outs = [project(x, w) for w in weights]  # the weights see their input differently
    else:
        x_in, weights = _prepared(x, weights[0]), [_whole(w, x.dtype) for w in weights]
        joined = jnp.einsum("...i,oi->...o", x_in, jnp.concatenate(weights, axis=0))
        outs = jnp.split(joined, list(itertools.accumulate(w.shape[0] for w in weights))[:-1], axis=-1)
    return [y.astype(x.dtype) for y in outs]


def stacked_matvecs(
    x: Float[Array, "*rows in"], stacks: Sequence[Float[Array, "layers _ in"]], layer: Int[Array, ""]
) -> tuple[Float[Array, "*rows _"], ...]:
    """`x @ stack[layer].T` in float32 for each stack, reading the layer's slices in place
    where the backend can (on the CPU, one custom call for all the stacks, so
    projections of the same input stream their weights as one job).

    The stacks share `x` and one dtype (float32 or bfloat16). Differentiable (the
    derivative uses the reference form).
    """
    stacks = tuple(stacks)
    if len({stack.dtype for stack in stacks}) != 1:
        raise ValueError(f"stacked_matvecs: the stacks must share one dtype, got {[s.dtype for s in stacks]}.")
    # bfloat16 activations against bfloat16 weights go as they are (the CPU's AMX tiles take them).
    keep = x.dtype == jnp.bfloat16 and stacks[0].dtype == jnp.bfloat16
    return active_backend().stacked_matvecs(x if keep else x.astype(jnp.float32), stacks, layer)


def stacked_matvec(
    x: Float[Array, "*rows in"], stack: Float[Array, "layers out in"], layer: Int[Array, ""]
) -> Float[Array, "*rows out"]:
    """`x @ stack[layer].T` in float32 (`stacked_matvecs` of one stack)."""
    return stacked_matvecs(x, (stack,), layer)[0]


def quantized_matvecs(
    x: Float[Array, "*rows in"], stacks: Sequence[QuantizedWeight], layer: Int[Array, ""]
) -> tuple[Float[Array, "*rows _"], ...]:
    """`x @ dequantize(stack[layer]).T` in float32 for each `QuantizedWeight` stack
    (`[layers, out, ...]`); with int8 activations `x` is `quantize_activations(x)`
    first. Where the backend can, the layer's integers and scales are read in
    place and widened in registers (no float copy of any weight).

    The stacks share `bits`, `group_size`, `activations` and `mode`.
    Differentiable in `x` and the scales (the derivative uses the reference form).
    """
    stacks = tuple(stacks)
    formats = [(s.bits, s.group_size, s.activations, s.mode) for s in stacks]
    if len(set(formats)) != 1:
        raise ValueError(
            f"quantized_matvecs: the stacks must share bits, group_size, activations and mode, got {formats}."
        )
    return active_backend().quantized_matvecs(x.astype(jnp.float32), stacks, layer)


def groups_experts(stack: Array | QuantizedWeight | LayerSlice) -> bool:
    """Whether a mixture-of-experts layer whose experts are stacked as `stack`
    (`[experts, out, in]`, or a `LayerSlice` of `[layers, experts, out, in]`) runs
    them as `grouped_matmul`s over all its assignments at once, rather than one
    block of assignments at a time."""
    return active_backend().groups_experts(_as_stack(stack)[0])


def grouped_matmul(
    rows: Float[Array, "rows in"],
    weight: Float[Array, "groups out in"] | LayerSlice,
    group_sizes: Int[Array, " groups"],
) -> Float[Array, "rows out"]:
    """Each group of `rows` times its own weights, in `rows`' dtype.

    The rows come sorted by group: the first `group_sizes[0]` take `weight[0]`,
    the next `group_sizes[1]` take `weight[1]`, and so on; rows past the groups'
    total give zeros (on a mesh they are another device's experts). `weight` is
    float, `[groups, out, in]` or one layer of a `[layers, groups, out, in]` stack
    (read in place where the backend can). Differentiable.
    """
    stack, layer = _as_stack(weight)
    if isinstance(stack, QuantizedWeight):
        raise ValueError("grouped_matmul: the weights are quantized; quantized experts run block by block "
                         "(`groups_experts` is False for them).")
    if rows.ndim != 2 or stack.ndim != 4 or rows.shape[1] != stack.shape[3]:
        raise ValueError(f"grouped_matmul: rows {rows.shape} do not fit weights {stack.shape[1:]} "
                         "([rows, in] and [groups, out, in]).")
    if group_sizes.shape != (stack.shape[1],):
        raise ValueError(f"grouped_matmul: {group_sizes.shape} group sizes for {stack.shape[1]} groups of weights.")
    out = active_backend().grouped_matmul(rows, stack, layer, group_sizes.astype(jnp.int32))
    return out.astype(rows.dtype)


def masked_attention(
    query: Float[Array, "batch kv_heads groups seq head_dim"],
    keys: list[Float[Array, "batch kv_heads _ head_dim"]],
    values: list[Float[Array, "batch kv_heads _ value_dim"]],
    allowed: list[Bool[Array, "batch seq _"]],
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Float[Array, "kv_heads groups"] | None = None,
) -> Float[Array, "batch kv_heads groups seq value_dim"]:
    """Softmax attention over several key/value blocks as if they were concatenated.

    Each block comes with its own `allowed` mask (`[batch, seq, keys]`), so the
    cached keys and the new keys of a step never need to be copied into one buffer
    first. The last block must be the new tokens' own (causal) block. Scores and
    the softmax are float32 whatever the activation dtype; scores are scaled by
    `scale` (default `head_dim ** -0.5`) and, with `softcap`, squashed to
    `softcap * tanh(score / softcap)` before the mask. `sinks` are per-head logits
    that join every row's softmax without a value (attention sinks, gpt-oss): they
    take a share of the weight and contribute nothing. A query that sees nothing
    averages every key (its output is padding). Differentiable.
    """
    return active_backend().masked_attention(query, list(keys), list(values), list(allowed), scale, softcap, sinks)


def causal_attention(
    query: Float[Array, "batch kv_heads groups seq head_dim"],
    keys: Float[Array, "batch kv_heads seq head_dim"],
    values: Float[Array, "batch kv_heads seq value_dim"],
    attention_mask: Int[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"] | None,
    window: int | Int[Array, ""],
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, "kv_heads groups"] | None = None,
) -> Float[Array, "batch kv_heads groups seq value_dim"]:
    """The new tokens' attention to each other, with no cache: described by
    metadata, not a mask (a backend builds one only if its kernel wants it).

    Token `i` of a row sees token `j` where `j <= i`, `j` is a real token
    (`attention_mask` 1; padding is on the left), both are in the same document
    (`segment_ids`, packed sequences; None: one document) and `i - j < window`
    (a sliding window; `NO_WINDOW` for none; a plain int lets a kernel specialise
    on it). The scores as in `masked_attention`. Differentiable.
    """
    return active_backend().causal_attention(query, keys, values, attention_mask, segment_ids, window, scale, softcap,
                                             sinks)


def attends_one_token(cache_dtype, softcap: float | None) -> bool:
    """Whether a one-token step over a cache of `cache_dtype` attends through
    `decode_attention` (reading the cache in place) rather than the blocks' masked
    softmax over the materialized cache."""
    return active_backend().attends_one_token(cache_dtype, softcap)


def _no_sinks(query: Array) -> Array:
    return jnp.full(query.shape[1:3], -jnp.inf, jnp.float32)


def _checked_scales(keys: Array, values: Array, key_scales, value_scales) -> tuple[Array, Array]:
    """The scales to pass (empty for a float cache), or a ValueError when they do not go with the dtypes."""
    if (keys.dtype == jnp.int8) != (key_scales is not None) or (values.dtype == jnp.int8) != (
        value_scales is not None
    ):
        raise ValueError("decode_attention: int8 key/value stacks need their scales, and only they take scales.")
    none = jnp.zeros((0,), jnp.float32)
    return (none if key_scales is None else key_scales, none if value_scales is None else value_scales)


# The window of a layer that sees every earlier token (no sliding window).
NO_WINDOW = int(jnp.iinfo(jnp.int32).max)


class VisibleSlots(eqx.Module):
    """Which cache slots one new token per row sees, described by positions rather
    than by a mask (a backend builds a mask only if its kernel wants one).

    Slot `s` of row `b` holds the token at position `slot_positions[b, s]` (-1: no
    token there, unwritten or left padding); the row's new token is at
    `query_positions[b]` (-1: the row is padding and its own token is not seen). A
    token sees the cached tokens less than `window` positions before it (a
    sliding window; `NO_WINDOW` for every earlier one).
    """

    slot_positions: Int[Array, "batch kv_seq"]
    query_positions: Int[Array, " batch"]
    window: int | Int[Array, ""]

    @classmethod
    def of_mask(
        cls, valid: Bool[Array | np.ndarray, "batch kv_seq"], self_valid: Bool[Array | np.ndarray, " batch"]
    ) -> "VisibleSlots":
        """The slots `valid` marks, and the new token where `self_valid`, as positions
        (for callers whose caches keep a mask rather than positions)."""
        valid, self_valid = jnp.asarray(valid, bool), jnp.asarray(self_valid, bool)
        slots = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32), valid.shape)
        return cls(jnp.where(valid, slots, -1), jnp.where(self_valid, valid.shape[1], -1).astype(jnp.int32),
                   jnp.int32(NO_WINDOW))

    def valid(self) -> Bool[Array, "batch kv_seq"]:
        """The slots each row's new token sees, as a mask."""
        distance = self.query_positions[:, None] - self.slot_positions
        return (self.slot_positions >= 0) & (distance < self.window)

    def self_valid(self) -> Bool[Array, " batch"]:
        """Whether each row's new token sees itself (it is a real token)."""
        return self.query_positions >= 0


def decode_attention(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_stack: Shaped[Array, "layers batch kv_heads kv_seq head_dim"],
    value_stack: Shaped[Array, "layers batch kv_heads kv_seq value_width"],
    layer: Int[Array, ""],
    visible: VisibleSlots,
    new_key: Float[Array, "batch kv_heads head_dim"],
    new_value: Float[Array, "batch kv_heads value_dim"],
    scale: float,
    sinks: Float[Array, "kv_heads groups"] | None = None,
    key_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None,
    value_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None,
) -> Float[Array, "batch kv_heads groups value_dim"]:
    """Softmax attention of one new token per row, float32.

    Each row's `groups` query heads per key/value head attend to the slots of
    `key_stack[layer]`/`value_stack[layer]` that `visible` says the row's token
    sees, and to the token's own `new_key`/`new_value` unless the row is padding;
    a row that sees nothing averages every slot (its output is padding). A value is the first `value_dim` channels
    of its row of `value_stack` (`value_stack` may be `key_stack` itself: values
    that are a prefix of the keys, as in Multi-head Latent Attention). `sinks`
    are per-head logits that join the softmax without a value. The stacks may be
    float32, bfloat16 or int8; int8 stacks come with `key_scales` / `value_scales`,
    one float32 per slot row (a key is `key_stack[..., s, :] * key_scales[..., s]`).
    Inference only: no derivative is defined.
    """
    sinks = _no_sinks(query) if sinks is None else sinks.astype(jnp.float32)
    key_scales, value_scales = _checked_scales(key_stack, value_stack, key_scales, value_scales)
    return active_backend().decode_attention(query, key_stack, value_stack, layer, visible.valid(),
                                             visible.self_valid(), new_key, new_value, sinks, key_scales, value_scales,
                                             scale)


def paged_decode_attention(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_pool: Shaped[Array, "layers pages kv_heads page_size head_dim"],
    value_pool: Shaped[Array, "layers pages kv_heads page_size value_width"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch pages_per_row"],
    visible: VisibleSlots,
    new_key: Float[Array, "batch kv_heads head_dim"],
    new_value: Float[Array, "batch kv_heads value_dim"],
    scale: float,
    sinks: Float[Array, "kv_heads groups"] | None = None,
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
) -> Float[Array, "batch kv_heads groups value_dim"]:
    """`decode_attention` over a paged pool: row `b`'s slot `s` (of
    `kv_seq = pages_per_row * page_size`) is in page `block_tables[b, s // page_size]`.
    Every table entry must name a page of the pool."""
    sinks = _no_sinks(query) if sinks is None else sinks.astype(jnp.float32)
    key_scales, value_scales = _checked_scales(key_pool, value_pool, key_scales, value_scales)
    return active_backend().paged_decode_attention(query, key_pool, value_pool, layer, block_tables, visible.valid(),
                                                   visible.self_valid(), new_key, new_value, sinks, key_scales,
                                                   value_scales, scale)


class RaggedTokens(eqx.Module):
    """A ragged batch's tokens as attention sees them: flattened, each belonging
    to one row of the block tables and sitting at one position of that row.

    Row `r` holds `cached[r]` tokens in its pages before this step; its
    `lengths[r]` new tokens follow them, the first ones of its span of the batch,
    `query_starts[r]` to `query_starts[r + 1]` (the rest of a span is padding).
    Token `t` is at `positions[t]` of row `rows[t]` (-1: padding, a token that sees
    nothing and that nobody sees). A token sees its row's cached tokens and its
    row's new tokens up to itself, less than `window` positions before it.

    A row of more than one new token spans whole blocks of
    `eqx_models.backends.xla.QUERY_BLOCK` tokens (its span starts and ends at a
    multiple of it): attention can then read its pages once per block.
    """

    rows: Int[Array, " tokens"]
    positions: Int[Array, " tokens"]
    cached: Int[Array, " batch"]
    query_starts: Int[Array, " batch_plus_one"]
    lengths: Int[Array, " batch"]
    window: int | Int[Array, ""]


def ragged_paged_attention(
    query: Float[Array, "tokens kv_heads groups head_dim"],
    new_keys: Float[Array, "tokens kv_heads head_dim"],
    new_values: Float[Array, "tokens kv_heads value_dim"],
    key_pool: Shaped[Array, "layers pages kv_heads page_size head_dim"],
    value_pool: Shaped[Array, "layers pages kv_heads page_size value_width"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch pages_per_row"],
    tokens: RaggedTokens,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, "kv_heads groups"] | None = None,
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
) -> Float[Array, "tokens kv_heads groups value_dim"]:
    """Attention of a ragged batch: prompt chunks and single decode tokens of many
    rows flattened together, each token against its row's cached pages (layer
    `layer` of the pools, read in place) and its row's new tokens (`new_keys`,
    `new_values`, not yet written), as `tokens` describes them.

    Scores are scaled by `scale`, squashed by `softcap` where given; `sinks` join
    each softmax as one more logit without a value. A value pool narrower than
    `new_values` holds none: values are the keys' first channels. Float32 out.
    """
    sinks = _no_sinks(query) if sinks is None else sinks.astype(jnp.float32)
    key_scales, value_scales = _checked_scales(key_pool, value_pool, key_scales, value_scales)
    return active_backend().ragged_paged_attention(
        query.astype(jnp.float32), new_keys.astype(jnp.float32), new_values.astype(jnp.float32), key_pool,
        value_pool, layer, block_tables, tokens, sinks, key_scales, value_scales, scale, softcap,
    )


def greedy_rows(logits: Float[Array, "*batch vocab"]) -> Int[Array, " *batch"]:
    """`jnp.argmax(logits, axis=-1)` as int32: the first position of each row's
    largest value, or of its first NaN. Not differentiable (an index)."""
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] == 0:
        raise ValueError("greedy_rows: the logits have an empty last axis; there is no token to pick.")
    return active_backend().greedy_rows(logits)


def index_layer(stack: Shaped[Array, "layers *rest"], index: Int[Array, ""]) -> Shaped[Array, "*rest"]:
    """`stack[index]` (on the CPU, 16-bit floats copied as raw bytes: XLA:CPU
    otherwise widens the whole stack in front of the layer loop). Differentiable:
    the tangent is the same slice of the stack's tangent."""
    return active_backend().index_layer(stack, index)


def take_rows(table: Shaped[Array, "rows *rest"], ids: Int[Array, "*batch"]) -> Shaped[Array, "..."]:
    """`table[ids]` (ids clamped to the rows). Differentiable like `jnp.take`."""
    return active_backend().take_rows(table, ids)


def gather_pages(
    pool: Shaped[Array, "layers pages kv_heads page_size head_dim"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch pages_per_row"],
) -> Shaped[Array, "batch kv_heads kv_seq head_dim"]:
    """One layer's pages of each row, laid end to end: slot `s` of row `b` is
    `pool[layer, block_tables[b, s // page_size], :, s % page_size]`."""
    return active_backend().gather_pages(pool, layer, block_tables)


def write_slots(
    buffer: Shaped[Array, "layers batch kv_heads kv_seq *head_dim"],
    update: Shaped[Array, "layers batch kv_heads new *head_dim"],
    start: Int[Array, ""],
    *,
    wrap: bool = False,
) -> Shaped[Array, "layers batch kv_heads kv_seq *head_dim"]:
    """`buffer` with `update` written at slot `start` of axis 3 (in place when donated).
    The last axis may be absent (one item per slot: an int8 cache's scales).

    With `wrap` the buffer is a ring: slots past the end continue at slot 0 (the
    update must not be longer than the buffer). Otherwise the caller checks that
    the slots fit; the CPU kernel refuses to write past the end.
    """
    return active_backend().write_slots(buffer, update.astype(buffer.dtype), start, wrap)


def write_pages(
    pool: Shaped[Array, "layers pages kv_heads page_size *head_dim"],
    update: Shaped[Array, "layers batch kv_heads new *head_dim"],
    slots: Int[Array, "batch new"],
) -> Shaped[Array, "layers pages kv_heads page_size *head_dim"]:
    """`pool` with token `t` of row `b` written at slot `slots[b, t]` (page * page_size
    + offset) of every layer; -1 writes nothing. In place when the pool is donated.
    The last axis may be absent (one item per slot: an int8 cache's scales)."""
    return active_backend().write_pages(pool, update.astype(pool.dtype), slots)


def delta_rule_step(
    pool: Float[Array, "layers slots members heads key_dim value_dim"],
    layer: Int[Array, ""],
    member: int,
    slots: Int[Array, " batch"],
    fresh: Bool[Array, " batch"],
    q: Float[Array, "batch heads key_dim"],
    k: Float[Array, "batch heads key_dim"],
    v: Float[Array, "batch heads value_dim"],
    g: Float[Array, "batch heads"],
    beta: Float[Array, "batch heads"],
) -> tuple[Float[Array, "batch heads value_dim"], Float[Array, "layers slots members heads key_dim value_dim"]]:
    """One token per row of the gated delta rule, on float32 states kept in a pool.

    Row `b` reads and writes `pool[layer, slots[b], member]` (zeros first where
    `fresh[b]`): `S = exp(g) S`, `S += k (beta (v - S^T k))^T`, and returns
    `S^T q` with the pool updated (in place when donated or carried).
    """
    return active_backend().delta_rule_step(pool, layer, slots, fresh, q, k, v, g, beta, member)


def headwise_in_place(rows: int, stack: Array) -> bool:
    """Whether `rows` rows' `headwise_matvec` with a layer of `stack` reads it in
    place (else the caller's einsum of the slice is as good)."""
    return active_backend().headwise_in_place(rows, stack)


def headwise_matvec(
    x: Float[Array, "batch heads n"],
    stack: Float[Array, "layers heads_rows width"],
    layer: Int[Array, ""],
    *,
    heads: int,
    row_start: int,
    rows: int,
    transpose: bool,
) -> Float[Array, "batch heads m"]:
    """Per-head products with rows `[row_start, row_start + rows)` of each head's
    group in `stack[layer]` (`[heads * per_head, width]`), float32.

    `transpose=False`: `out[b, h] = W_h @ x[b, h]` (`x` has `width` channels, the
    output `rows`); `transpose=True`: `out[b, h] = x[b, h] @ W_h` (`x` has `rows`,
    the output `width`). Differentiable (the derivative uses the reference form).
    """
    return active_backend().headwise_matvec(x.astype(jnp.float32), stack, layer, heads, row_start, rows,
                                            bool(transpose))
