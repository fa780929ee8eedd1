"""A paged KV cache: one pool of fixed-size pages shared by many sequences.

The serving engine keeps the pool for its whole life and hands the model, per
step, the block table of each row it runs (which pages hold that row's tokens, in
order) and how many tokens each row already has. Rows can grow, finish and be
replaced between steps without moving any cached key or value.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from .axes import AbstractHasArrayAxes
from .cache import StateView, _check_scales, quantize_rows, read_rows, resolve_cache_dtype, round_as_stored
from .backends.xla import QUERY_BLOCK
from .ops import (NO_WINDOW, RaggedTokens, VisibleSlots, gather_pages, paged_decode_attention,
                  ragged_paged_attention, write_pages)


class PagedLayerKV(eqx.Module):
    """One layer of a `PagedKVCache`: the pool stacks, the layer index and the tables.

    The same methods as `LayerKV`: `materialize()` gathers each row's pages end to
    end (`[batch, kv_heads, pages_per_row * page_size, head_dim]`), `attend_token`
    reads them in place.
    """

    keys: Shaped[Array, "layers pages kv_heads page_size head_dim"]
    values: Shaped[Array, "layers pages kv_heads page_size value_dim"]
    block_tables: Int[Array, "batch pages_per_row"]
    index: Int[Array, ""]
    state: StateView | None = None
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None

    @property
    def dtype(self):
        return self.keys.dtype

    def materialize(
        self, dtype=None
    ) -> tuple[Float[Array, "batch kv_heads kv_seq head_dim"], Float[Array, "batch kv_heads kv_seq value_dim"]]:
        """Each row's keys and values of this layer, slot `s` = the row's token `s`
        (an int8 pool's dequantized to `dtype`, default float32)."""
        gather = lambda pool: gather_pages(pool, self.index, self.block_tables)
        return read_rows(self, gather, lambda scales: gather(scales[..., None])[..., 0], dtype)

    def as_stored(self, x: Float[Array, "*rows width"]) -> Float[Array, "*rows width"]:
        """`x` (keys or values of new tokens) rounded as the pool stores it, in float32."""
        return round_as_stored(x, self.dtype)

    def attend_token(
        self,
        query: Float[Array, "batch kv_heads groups head_dim"],
        visible: VisibleSlots,
        new_key: Float[Array, "batch kv_heads head_dim"],
        new_value: Float[Array, "batch kv_heads value_dim"],
        scale: float,
        sinks: Float[Array, "kv_heads groups"] | None = None,
    ) -> Float[Array, "batch kv_heads groups value_dim"]:
        """One new token per row against this layer's pages (`eqx_models.ops.paged_decode_attention`)."""
        values, value_scales = (
            (self.values, self.value_scales) if self.values.shape[-1] else (self.keys, self.key_scales)
        )
        return paged_decode_attention(
            query, self.keys, values, self.index, self.block_tables, visible, new_key, new_value, scale,
            sinks, self.key_scales, value_scales,
        )


def _written(cache, new_keys: Array, new_values: Array, slots: Int[Array, "batch seq"]) -> dict[str, Array | None]:
    """A paged cache's pools (and an int8 pool's scales) with every layer's new
    keys and values (`[layers, batch, kv_heads, seq, width]`) at `slots` (page *
    page_size + offset; -1 writes nothing), in place when donated."""
    key_scales, value_scales = cache.key_scales, cache.value_scales
    if key_scales is not None:
        new_keys, new_key_scales = quantize_rows(new_keys)
        key_scales = write_pages(key_scales, new_key_scales, slots)
    if value_scales is not None:
        new_values, new_value_scales = quantize_rows(new_values)
        value_scales = write_pages(value_scales, new_value_scales, slots)
    return dict(
        keys=write_pages(cache.keys, new_keys, slots),
        values=write_pages(cache.values, new_values, slots) if cache.values.size else cache.values,
        key_scales=key_scales,
        value_scales=value_scales,
    )


class PagedKVCache(AbstractHasArrayAxes):
    """Keys and values in a pool of pages, with a block table per row.

    Row `b`'s token at position `p` lives in page `block_tables[b, p // page_size]`
    at offset `p % page_size`. A step appends each row's real tokens (attention
    mask 1; a chunk may be right-padded) after the row's `positions[b]` cached
    tokens; padding writes nothing. The caller (the engine's scheduler) owns the
    pages: it gives every row enough pages for the tokens it appends, and gives a
    page to several rows only where none of them appends to it (the full pages of
    a prefix they share). Table entries past a row's tokens may name any page
    (they are never read unmasked), so unused rows can point at page 0.

    A model with a recurrent state (`DecoderConfig.recurrent_state`) keeps it in a
    pool of per-sequence slots, `state` (`[layers, slots, ...]` arrays): row `b`
    reads and writes slot `state_slots[b]`, and a row with no cached tokens starts
    from zeros whatever its slot holds. Rows that compute nothing may share a
    scratch slot.

    `model(ids, cache=cache)` takes it wherever it takes a `KVCache`.

    Attributes:
        keys: `[layers, pages, kv_heads, page_size, head_dim]`, already rotated.
        values: `[layers, pages, kv_heads, page_size, value_dim]`.
        block_tables: `[batch, pages_per_row]` page ids.
        positions: `[batch]`, tokens already cached per row.
        state: the pool of recurrent states, or None.
        state_slots: `[batch]`, each row's slot in `state` (None without one).
        key_scales, value_scales: `[layers, pages, kv_heads, page_size]` float32
            scales of an int8 pool (one per token and head, see `KVCache`), else None.
    """

    keys: Shaped[Array, "layers pages kv_heads page_size head_dim"]
    values: Shaped[Array, "layers pages kv_heads page_size value_dim"]
    block_tables: Int[Array, "batch pages_per_row"]
    positions: Int[Array, " batch"]
    state: eqx.Module | None = None
    state_slots: Int[Array, " batch"] | None = None
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical axes of each array (for sharding rules); pages are never split.

        Returns:
            Field name -> axis names.
        """
        pool = self.pool_axes()
        return {"keys": pool, "values": pool, "block_tables": ("batch", None), "positions": ("batch",),
                "state_slots": ("batch",), "key_scales": pool[:-1], "value_scales": pool[:-1]}

    @staticmethod
    def pool_axes() -> tuple[str | None, ...]:
        """The logical axes of a pool (for sharding rules): split by key/value heads,
        never by pages.

        Returns:
            Axis names of `[layers, pages, kv_heads, page_size, head_dim]` (an int8
            pool's scales take the first four).
        """
        return ("layers", None, "kv_heads", None, "head_dim")

    @staticmethod
    def empty_pool(
        num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, dtype=jnp.float32,
        value_dim: int | None = None,
    ) -> tuple[Array, Array, Array | None, Array | None]:
        """Zeroed key and value pools, and their scales for an int8 pool.

        Args:
            num_layers: layers (the leading axis of the pools).
            num_pages: pages in the pool.
            num_kv_heads: key/value heads.
            page_size: token slots per page.
            head_dim: width of one key (and, by default, value) row.
            dtype: keys and values dtype (float32, bfloat16, float16 or int8).
            value_dim: width of a value row when it differs from `head_dim`; 0 for
                values read from the keys' first channels.

        Returns:
            `(keys, values, key_scales, value_scales)`: `[num_layers, num_pages,
            num_kv_heads, page_size, head_dim]`, the same with `value_dim` last,
            and for int8 float32 scales without the last axis (else None).
        """
        dtype = resolve_cache_dtype(dtype)
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        scales = lambda width: jnp.zeros(shape[:-1], jnp.float32) if dtype == jnp.int8 and width else None
        return (jnp.zeros(shape, dtype), jnp.zeros((*shape[:-1], value_dim), dtype), scales(head_dim),
                scales(value_dim))

    @property
    def page_size(self) -> int:
        return self.keys.shape[3]

    @property
    def num_pages(self) -> int:
        return self.keys.shape[1]

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_length(self) -> int:
        """Slots each row can reach through its block table."""
        return self.block_tables.shape[1] * self.page_size

    @property
    def slot_positions(self) -> Int[Array, "batch kv_seq"]:
        """Position held by each slot of a row's gathered pages, or -1 past its tokens."""
        slots = jnp.arange(self.max_length, dtype=jnp.int32)[None]
        return jnp.where(slots < self.positions[:, None], slots, -1)

    @property
    def valid(self) -> Bool[Array, "batch kv_seq"]:
        return self.slot_positions >= 0

    def layer(self, index: Int[Array, ""], state: eqx.Module | None = None) -> PagedLayerKV:
        """Layer `index`, read in place by the decode kernel.

        Args:
            index: the layer (a traced scalar inside the scan).
            state: the recurrent-state pool as the scan carries it (default: the cache's).

        Returns:
            A `PagedLayerKV` view: the whole pools, the block tables and the index.
        """
        _check_scales(self)
        state = self.state if state is None else state
        view = None if state is None else StateView(state, index, self.state_slots, self.positions == 0)
        return PagedLayerKV(self.keys, self.values, self.block_tables, index, view, self.key_scales,
                            self.value_scales)

    def new_positions(self, attention_mask: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
        """Positions of the tokens about to be appended.

        Args:
            attention_mask: `[batch, seq]` of the tokens to append (a chunk may be
                right-padded with 0).

        Returns:
            `[batch, seq]` positions after each row's cached tokens; padding repeats
            the last real position.
        """
        return self.positions[:, None] + jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)

    def append(
        self,
        new_keys: Float[Array, "layers batch kv_heads seq head_dim"],
        new_values: Float[Array, "layers batch kv_heads seq value_dim"],
        attention_mask: Int[Array, "batch seq"],
        new_state: eqx.Module | None = None,
    ) -> "PagedKVCache":
        """Writes each row's real new tokens into its pages (in place when donated).

        Args:
            new_keys: every layer's new keys `[layers, batch, kv_heads, seq, head_dim]`
                (rotated).
            new_values: the matching values.
            attention_mask: `[batch, seq]`, 1 for tokens to store; padding writes nothing.
            new_state: the recurrent-state pool after these tokens (its rows' slots
                updated by the layers), or None to leave it as it is.

        Returns:
            The updated `PagedKVCache` (a row past its block table's pages raises).
        """
        _check_scales(self)
        real = attention_mask.astype(bool)
        positions = self.new_positions(attention_mask)
        checked = eqx.error_if(
            positions,
            real & (positions >= self.max_length),
            "PagedKVCache overflow: a row's tokens run past the pages of its block table. "
            "Give the row more pages (block_tables wider) before appending.",
        )
        page_index = jnp.minimum(checked // self.page_size, self.block_tables.shape[1] - 1)
        page = jnp.take_along_axis(self.block_tables, page_index, axis=1)
        slots = jnp.where(real, page * self.page_size + checked % self.page_size, -1)
        return PagedKVCache(
            **_written(self, new_keys, new_values, slots),
            block_tables=self.block_tables,
            positions=self.positions + jnp.sum(attention_mask, axis=-1, dtype=jnp.int32),
            state=self.state if new_state is None else new_state,
            state_slots=self.state_slots,
        )


class RaggedPagedLayerKV(eqx.Module):
    """One layer of a `RaggedPagedKVCache`: the pool stacks, the layer index, and
    the ragged batch's tables and tokens. Attention reads the pages in place
    (`attend_tokens`); nothing is materialized."""

    keys: Shaped[Array, "layers pages kv_heads page_size head_dim"]
    values: Shaped[Array, "layers pages kv_heads page_size value_dim"]
    block_tables: Int[Array, "batch pages_per_row"]
    positions: Int[Array, " batch"]
    query_starts: Int[Array, " batch_plus_one"]
    index: Int[Array, ""]
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None

    @property
    def dtype(self):
        return self.keys.dtype

    def as_stored(self, x: Float[Array, "*rows width"]) -> Float[Array, "*rows width"]:
        """`x` (keys or values of new tokens) rounded as the pool stores it, in float32."""
        return round_as_stored(x, self.dtype)

    def attend_tokens(
        self,
        query: Float[Array, "tokens kv_heads groups head_dim"],
        new_keys: Float[Array, "tokens kv_heads head_dim"],
        new_values: Float[Array, "tokens kv_heads value_dim"],
        real: Int[Array, " tokens"],
        window: int | Int[Array, ""],
        scale: float,
        softcap: float | None = None,
        sinks: Float[Array, "kv_heads groups"] | None = None,
    ) -> Float[Array, "tokens kv_heads groups value_dim"]:
        """Every token (`real`: 1, else padding) against its row's pages and its
        row's new tokens (`eqx_models.ops.ragged_paged_attention`), in the layer's
        `window`."""
        values, value_scales = (
            (self.values, self.value_scales) if self.values.shape[-1] else (self.keys, self.key_scales)
        )
        tokens = ragged_tokens(self.positions, self.query_starts, query.shape[0], window, real)
        # A row computing one token (a decode) sees it as its pages will hold it, and
        # a chunk its own tokens as computed: what the plain cache's steps see.
        alone = (tokens.lengths[jnp.maximum(tokens.rows, 0)] == 1)[:, None, None]
        stored_keys = self.as_stored(new_keys)
        stored_values = self.as_stored(new_values) if self.values.shape[-1] else stored_keys[..., : new_values.shape[-1]]
        new_keys = jnp.where(alone, stored_keys, new_keys)
        new_values = jnp.where(alone, stored_values, new_values)
        return ragged_paged_attention(
            query, new_keys, new_values, self.keys, values, self.index, self.block_tables, tokens, scale, softcap,
            sinks, self.key_scales, value_scales,
        )


class RaggedPagedKVCache(AbstractHasArrayAxes):
    """A `PagedKVCache` for one ragged step: the new tokens of many rows (prompt
    chunks and single decode tokens) flattened into one sequence, `[1, tokens]`.

    Row `r`'s span of the flattened tokens is `query_starts[r]` to
    `query_starts[r + 1]`: its new tokens (attention mask 1) after its
    `positions[r]` cached tokens, then padding (mask 0) to the span's end. A row
    of several new tokens spans whole blocks of `QUERY_BLOCK` (16) tokens; a row
    of one (a decode) needs no padding. Tokens after `query_starts[-1]` and
    padding write nothing and nobody sees them. Each token attends to its own
    row's cached and new tokens only. Pages are owned as in `PagedKVCache`; there
    is no recurrent state (a family with one steps with `PagedKVCache`).

    `model(ids, cache=cache, attention_mask=mask)` with `ids` of shape
    `[1, tokens]` takes it; the logits each row samples from are at its last new
    token (`logits_at`).

    Attributes:
        keys: `[layers, pages, kv_heads, page_size, head_dim]`, already rotated.
        values: `[layers, pages, kv_heads, page_size, value_dim]`.
        block_tables: `[batch, pages_per_row]` page ids.
        positions: `[batch]`, tokens already cached per row.
        query_starts: `[batch + 1]`, where each row's span starts among the
            flattened tokens, then where the last one ends.
        key_scales, value_scales: an int8 pool's float32 scales, else None.
    """

    keys: Shaped[Array, "layers pages kv_heads page_size head_dim"]
    values: Shaped[Array, "layers pages kv_heads page_size value_dim"]
    block_tables: Int[Array, "batch pages_per_row"]
    positions: Int[Array, " batch"]
    query_starts: Int[Array, " batch_plus_one"]
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical axes of each array (for sharding rules); pages are never split.

        Returns:
            Field name -> axis names.
        """
        pool = PagedKVCache.pool_axes()
        return {"keys": pool, "values": pool, "block_tables": (None, None), "positions": (None,),
                "query_starts": (None,), "key_scales": pool[:-1], "value_scales": pool[:-1]}

    @property
    def page_size(self) -> int:
        return self.keys.shape[3]

    @property
    def max_length(self) -> int:
        """Slots each row can reach through its block table."""
        return self.block_tables.shape[1] * self.page_size

    @property
    def state(self) -> None:
        """No recurrent state: a ragged step holds attention layers only."""
        return None

    @property
    def slot_positions(self) -> None:
        """None: the ragged attention takes positions (`RaggedTokens`), not slots."""
        return None

    def new_positions(self, attention_mask: Int[Array, "1 tokens"]) -> Int[Array, "1 tokens"]:
        """Positions of the flattened tokens in their rows (padding: 0); raises
        where a row of several tokens does not span whole blocks of
        `QUERY_BLOCK` tokens (see `RaggedTokens`).

        Args:
            attention_mask: `[1, tokens]`, 1 for a row's tokens, 0 for padding.

        Returns:
            `[1, tokens]` positions.
        """
        tokens = ragged_tokens(self.positions, self.query_starts, attention_mask.shape[1], real=attention_mask[0])
        ends = jnp.minimum(self.query_starts, attention_mask.shape[1])
        misaligned = (tokens.lengths > 1) & ((ends[:-1] % QUERY_BLOCK != 0) | (ends[1:] % QUERY_BLOCK != 0))
        positions = eqx.error_if(
            tokens.positions, jnp.any(misaligned),
            f"RaggedPagedKVCache: a row of several new tokens must span whole blocks of {QUERY_BLOCK} "
            "tokens (query_starts of that row and the next at multiples of it; pad the span's end).",
        )
        return positions[None]

    def layer(self, index: Int[Array, ""], state: eqx.Module | None = None) -> RaggedPagedLayerKV:
        """Layer `index`: the whole pools, the tables and the tokens, read in place.

        Args:
            index: the layer (a traced scalar inside the scan).
            state: must be None (no recurrent state in a ragged step).

        Returns:
            A `RaggedPagedLayerKV` view.
        """
        _check_scales(self)
        if state is not None:
            raise ValueError("A ragged step holds no recurrent state: step a model with one with PagedKVCache.")
        return RaggedPagedLayerKV(self.keys, self.values, self.block_tables, self.positions, self.query_starts, index,
                                  self.key_scales, self.value_scales)

    def append(
        self,
        new_keys: Float[Array, "layers 1 kv_heads tokens head_dim"],
        new_values: Float[Array, "layers 1 kv_heads tokens value_dim"],
        attention_mask: Int[Array, "1 tokens"],
        new_state: None = None,
    ) -> "RaggedPagedKVCache":
        """Writes every real token's keys and values into its row's pages (in
        place when donated); `attention_mask` 0 also keeps a token out.

        Args:
            new_keys: every layer's new keys `[layers, 1, kv_heads, tokens, head_dim]`.
            new_values: the matching values.
            attention_mask: `[1, tokens]`, 1 for tokens to store.
            new_state: must be None.

        Returns:
            The updated cache: the rows' positions advanced past their new tokens
            (a row past its block table's pages raises).
        """
        _check_scales(self)
        tokens = ragged_tokens(self.positions, self.query_starts, attention_mask.shape[1], real=attention_mask[0])
        real = tokens.rows >= 0
        positions = eqx.error_if(
            tokens.positions,
            real & (tokens.positions >= self.max_length),
            "RaggedPagedKVCache overflow: a row's tokens run past the pages of its block table. "
            "Give the row more pages (block_tables wider) before the step.",
        )
        row = jnp.maximum(tokens.rows, 0)
        page = self.block_tables[row, jnp.minimum(positions // self.page_size, self.block_tables.shape[1] - 1)]
        slots = jnp.where(real, page * self.page_size + positions % self.page_size, -1)[None]
        return RaggedPagedKVCache(
            **_written(self, new_keys, new_values, slots),
            block_tables=self.block_tables,
            positions=self.positions + tokens.lengths,
            query_starts=self.query_starts,
        )


def ragged_tokens(
    cached: Int[Array, " batch"], query_starts: Int[Array, " batch_plus_one"], num_tokens: int,
    window: int | Int[Array, ""] = NO_WINDOW, real: Int[Array, " tokens"] | None = None,
) -> RaggedTokens:
    """Each of `num_tokens` flattened tokens' row (-1: padding) and position, rows
    holding `cached` tokens before the step.

    Args:
        cached: `[batch]` tokens in each row's pages before the step.
        query_starts: `[batch + 1]` where each row's span starts, then the last's end.
        num_tokens: the flattened length (padding included).
        window: the sliding window the tokens see through.
        real: `[tokens]`, 1 for a row's new token, 0 for padding (the end of a
            span, after the row's tokens); default: every token of a span.

    Returns:
        The `RaggedTokens`.
    """
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    rows = jnp.searchsorted(query_starts[1:], index, side="right").astype(jnp.int32)
    inside = index < query_starts[-1]
    if real is not None:
        inside &= real.astype(bool)
    row = jnp.minimum(rows, cached.shape[0] - 1)
    positions = cached[row] + index - query_starts[row]
    lengths = jnp.zeros_like(cached).at[row].add(inside.astype(cached.dtype))
    return RaggedTokens(jnp.where(inside, rows, -1), jnp.where(inside, positions, 0), cached, query_starts, lengths,
                        window)
