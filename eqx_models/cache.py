"""The key/value cache threaded through the scanned decoder layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from .axes import AbstractHasArrayAxes
from .config import DecoderConfig
from .ops import VisibleSlots, decode_attention, index_layer, write_slots

# The dtypes a cache stores its keys and values in. "int8" keeps one float32 scale
# per token and head beside the integers (about half of bfloat16's bytes at
# head_dim 128), see `quantize_rows`.
CACHE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int8")


def resolve_cache_dtype(dtype) -> jnp.dtype:
    """`dtype` as a cache dtype, or a ValueError naming the ones there are."""
    try:
        resolved = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in CACHE_DTYPES:
        raise ValueError(f"A KV cache dtype must be one of {', '.join(CACHE_DTYPES)}; got {dtype!r}.")
    if resolved == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("A float64 KV cache needs JAX's 64-bit mode: jax.config.update('jax_enable_x64', True).")
    return resolved


def quantize_rows(x: Float[Array, "*rows width"]) -> tuple[Int[Array, "*rows width"], Float[Array, " *rows"]]:
    """Symmetric int8 of each row of `x` with one float32 scale per row: `x ~ q * scale`.

    The scale is the row's largest magnitude over 127, so the largest entry is
    exact to float32 rounding and the others within half a step; a row of zeros
    gets scale 0.
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def dequantize_rows(q: Int[Array, "*rows width"], scale: Float[Array, " *rows"], dtype=jnp.float32) -> Array:
    """`q * scale` per row, in `dtype` (what `quantize_rows` stored)."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def read_rows(view, take, take_scales, dtype=None) -> tuple[Array, Array]:
    """A layer view's keys and values, each stack read through `take` (its scales
    through `take_scales`); an int8 cache's dequantized to `dtype` (default float32).
    Serves `LayerKV` and `PagedLayerKV`, which differ only in how they read a layer."""
    if view.key_scales is None:
        return take(view.keys), take(view.values)
    dtype = dtype or jnp.float32
    keys = dequantize_rows(take(view.keys), take_scales(view.key_scales), dtype)
    if not view.values.shape[-1]:
        return keys, take(view.values).astype(dtype)
    return keys, dequantize_rows(take(view.values), take_scales(view.value_scales), dtype)


def round_as_stored(x: Float[Array, "*rows width"], dtype) -> Float[Array, "*rows width"]:
    """`x` rounded as a cache of `dtype` stores it (int8: per row, see `quantize_rows`), in float32."""
    if dtype == jnp.int8:
        return dequantize_rows(*quantize_rows(x))
    return x.astype(dtype).astype(jnp.float32)


class StateView(eqx.Module):
    """A layer's access to a cache's recurrent state (see `DecoderConfig.recurrent_state`).

    `state` holds the whole arrays, `[layers, slots, ...]` (carried through the
    scan, so a layer updates them where they lie); row `b` of a call owns slot
    `slots[b]` and, where `fresh[b]` (no tokens cached yet), starts from zeros.
    """

    state: eqx.Module
    index: Int[Array, ""]
    slots: Int[Array, " batch"]
    fresh: Bool[Array, " batch"]

    def read(self, array: Array, *within: int) -> Array:
        """Each row's entry of `array` (a leaf of `state`) for this layer, at `within`
        on the axes after the slots; zeros for fresh rows."""
        rows = array[(self.index, self.slots, *within)]
        return jnp.where(self.fresh.reshape(-1, *(1,) * (rows.ndim - 1)), 0, rows).astype(array.dtype)

    def write(self, array: Array, rows: Array, *within: int) -> Array:
        """`array` with each row's entry for this layer (at `within`) replaced by `rows`."""
        # In bounds by construction; the default (drop what is out of bounds) costs a select.
        return array.at[(self.index, self.slots, *within)].set(rows.astype(array.dtype), mode="promise_in_bounds")


class LayerKV(eqx.Module):
    """One layer of a `KVCache`, referred to by index into the whole stacks.

    Inside the scanned decoder the attention sees its layer's cache this way, so
    the decode kernel reads the slice in place; `materialize()` gives the slice
    for everything else. Every cache kind has such a view with the same methods.
    A cache without value channels (`value_dim` 0) keeps its values in the keys'
    first channels: `attend_token` then reads them there. `state` gives the layer
    the cache's recurrent state, or is None.
    """

    keys: Shaped[Array, "layers batch kv_heads kv_seq head_dim"]
    values: Shaped[Array, "layers batch kv_heads kv_seq value_dim"]
    index: Int[Array, ""]
    state: StateView | None = None
    key_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None
    value_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None

    @property
    def dtype(self):
        return self.keys.dtype

    def materialize(
        self, dtype=None
    ) -> tuple[Float[Array, "batch kv_heads kv_seq head_dim"], Float[Array, "batch kv_heads kv_seq value_dim"]]:
        """This layer's keys and values (an int8 cache's dequantized to `dtype`,
        default float32)."""
        take = lambda stack: index_layer(stack, self.index)
        return read_rows(self, take, take, dtype)

    def as_stored(self, x: Float[Array, "*rows width"]) -> Float[Array, "*rows width"]:
        """`x` (keys or values of new tokens) rounded as this cache stores it, in float32."""
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
        """One new token per row against this layer's slots (see `eqx_models.ops.decode_attention`)."""
        values, value_scales = (
            (self.values, self.value_scales) if self.values.shape[-1] else (self.keys, self.key_scales)
        )
        return decode_attention(
            query, self.keys, values, self.index, visible, new_key, new_value, scale, sinks,
            self.key_scales, value_scales,
        )


class KVCache(AbstractHasArrayAxes):
    """Keys and values of every layer, preallocated for `max_length` slots.

    Slots are written left to right, the same number per call for every row;
    `slot_positions` holds each slot's rotary position (-1 where a slot holds no
    real token: unwritten, or left padding) and `positions` counts each row's real
    tokens, which is the position of that row's next token. `model(ids, cache=cache)`
    returns the updated cache: the same call serves prefill, chunked prefill and
    single-token decode.

    With a `window` (sliding-window attention, where a token sees only the last
    `window` positions) the buffer is a ring of at most `window` slots: writing
    continues at slot 0 past the end and overwrites the oldest tokens, so memory
    stays bounded however long generation runs. Without one, writing past
    `max_length` is an error.

    A model whose layers also carry a recurrent state (Gated DeltaNet's, see
    `DecoderConfig.recurrent_state`) keeps it in `state`, arrays `[layers, batch,
    ...]`: the decoder carries it through the scan, each layer updating its own
    entries (`StateView`), and the call returns the state after its tokens.

    Attributes:
        keys: `[layers, batch, kv_heads, kv_seq, head_dim]`, already rotated.
        values: `[layers, batch, kv_heads, kv_seq, value_dim]` (`value_dim` 0: the keys' first channels serve).
        slot_positions: `[batch, kv_seq]`, each slot's token position or -1.
        positions: `[batch]`, real tokens seen per row.
        length: scalar, slots written so far (same for every row; past `max_length`
            only for a ring).
        window: the sliding window, or None.
        state: the recurrent state, or None.
        key_scales, value_scales: `[layers, batch, kv_heads, kv_seq]` float32, one
            per token and head, when keys and values are int8 (`dtype="int8"`:
            a key is `keys[..., :] * key_scales[..., None]`); else None.
    """

    keys: Shaped[Array, "layers batch kv_heads kv_seq head_dim"]
    values: Shaped[Array, "layers batch kv_heads kv_seq value_dim"]
    slot_positions: Int[Array, "batch kv_seq"]
    positions: Int[Array, " batch"]
    length: Int[Array, ""]
    window: int | None = eqx.field(static=True, default=None)
    state: eqx.Module | None = None
    key_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None
    value_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical axes of each array (for sharding rules).

        Returns:
            Field name -> axis names.
        """
        kv = ("layers", "batch", "kv_heads", "kv_seq", "head_dim")
        per_token = kv[:-1]
        return {
            "keys": kv, "values": kv, "slot_positions": ("batch", "kv_seq"), "positions": ("batch",), "length": (),
            "key_scales": per_token, "value_scales": per_token,
        }

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype=jnp.float32,
        window: int | None = None,
        value_dim: int | None = None,
        state: eqx.Module | None = None,
    ) -> "KVCache":
        """A cache with nothing written (`KVCache.for_config` fills these in).

        Args:
            num_layers: layers (the leading axis of keys and values).
            batch_size: rows.
            num_kv_heads: key/value heads.
            max_length: slots per row (a ring of `min(max_length, window)` slots with
                a `window`).
            head_dim: width of one key (and, by default, value) row.
            dtype: keys and values dtype: float32, bfloat16, float16, float64 (with
                JAX's x64 mode), or int8 (with a float32 scale per token and head).
            window: the sliding window, or None for a plain buffer.
            value_dim: width of a value row when it differs from `head_dim`; 0 for
                values read from the keys' first channels (see `LayerKV`).
            state: the empty recurrent state, or None.

        Returns:
            A `KVCache` whose slots are all empty (`slot_positions` -1).
        """
        dtype = resolve_cache_dtype(dtype)
        slots = max_length if window is None else min(max_length, window)
        shape = (num_layers, batch_size, num_kv_heads, slots, head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        scales = lambda width: jnp.zeros(shape[:-1], jnp.float32) if dtype == jnp.int8 and width else None
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros((*shape[:-1], value_dim), dtype),
            slot_positions=jnp.full((batch_size, slots), -1, jnp.int32),
            positions=jnp.zeros((batch_size,), jnp.int32),
            length=jnp.zeros((), jnp.int32),
            window=window,
            state=state,
            key_scales=scales(head_dim),
            value_scales=scales(value_dim),
        )

    @classmethod
    def for_config(
        cls, config: DecoderConfig, batch_size: int, max_length: int, dtype, window: int | None = None
    ) -> "KVCache":
        """The empty cache of a model with `config` (`CausalLM.init_cache`).

        Args:
            config: the model's config (its `cache_layout`, `num_blocks` and
                `recurrent_state`).
            batch_size: rows.
            max_length: slots per row.
            dtype: keys and values dtype (see `empty`).
            window: the ring size when every layer slides, else None.

        Returns:
            A `KVCache` with nothing written.
        """
        layout = config.cache_layout()
        dtype = resolve_cache_dtype(dtype)
        # A recurrent state is a running sum, never stored in int8.
        state_dtype = jnp.float32 if dtype == jnp.int8 else dtype
        return cls.empty(
            config.num_blocks, batch_size, layout.kv_heads, max_length, layout.key_dim, dtype, window,
            layout.value_dim, config.recurrent_state(batch_size, state_dtype),
        )

    @property
    def max_length(self) -> int:
        """Slots per row."""
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def layer(self, index: Int[Array, ""], state: eqx.Module | None = None) -> LayerKV:
        """Layer `index` of the cache, read in place by the decode kernel.

        Args:
            index: the layer (a traced scalar inside the scan).
            state: the recurrent state as the scan carries it (default: the cache's).

        Returns:
            A `LayerKV` view: the whole stacks plus the index, nothing copied.
        """
        _check_scales(self)
        state = self.state if state is None else state
        view = None
        if state is not None:
            view = StateView(state, index, jnp.arange(self.batch_size, dtype=jnp.int32), self.positions == 0)
        return LayerKV(self.keys, self.values, index, view, self.key_scales, self.value_scales)

    @property
    def valid(self) -> Bool[Array, "batch kv_seq"]:
        """Where a slot holds a real token."""
        return self.slot_positions >= 0

    def new_positions(self, attention_mask: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
        """Rotary positions of the tokens about to be appended.

        Args:
            attention_mask: `[batch, seq]` of the tokens to append (1 real, 0 padding).

        Returns:
            `[batch, seq]` positions, continuing each row's count; padding repeats
            its neighbour's position.
        """
        return self.positions[:, None] + jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)

    def append(
        self,
        new_keys: Float[Array, "layers batch kv_heads seq head_dim"],
        new_values: Float[Array, "layers batch kv_heads seq value_dim"],
        attention_mask: Int[Array, "batch seq"],
        new_state: eqx.Module | None = None,
    ) -> "KVCache":
        """Writes one step's keys/values after the last written slot.

        One write per buffer (`eqx_models.ops.write_slots`): under a jit that
        donates the cache, the update happens in place. Writing past `max_length`
        raises (XLA would otherwise clamp the index and overwrite the last slots
        silently), except in a ring, which keeps the newest `max_length` slots.

        Args:
            new_keys: every layer's new keys `[layers, batch, kv_heads, seq, head_dim]`
                (rotated).
            new_values: the matching values.
            attention_mask: `[batch, seq]`, 0 for left padding (stored with position -1).
            new_state: the recurrent state after these tokens (all of it, replacing
                the cache's), or None to keep it.

        Returns:
            The updated `KVCache`.
        """
        _check_scales(self)
        seq = new_keys.shape[3]
        real = attention_mask.astype(bool)
        new_slot_positions = jnp.where(real, self.new_positions(attention_mask), -1)
        # Every buffer (keys, values, per-token scales) is written at the same slots.
        if self.window is None:
            start = eqx.error_if(
                self.length,
                self.length + seq > self.max_length,
                "KVCache overflow: the tokens of this call do not fit in the cache's "
                "max_length slots. Create a larger cache with model.init_cache(batch, max_length).",
            )
            write = lambda buffer, update: write_slots(buffer, update, start)
            slot_positions = jax.lax.dynamic_update_slice(self.slot_positions, new_slot_positions, (0, start))
        else:
            # Only the newest `max_length` tokens can still be attended to.
            keep = min(seq, self.max_length)
            start = (self.length + seq - keep) % self.max_length
            write = lambda buffer, update: write_slots(buffer, update[:, :, :, seq - keep :], start, wrap=True)
            slots = (start + jnp.arange(keep)) % self.max_length
            slot_positions = self.slot_positions.at[:, slots].set(new_slot_positions[:, seq - keep :])
        key_scales, value_scales = self.key_scales, self.value_scales
        if key_scales is not None:
            new_keys, new_key_scales = quantize_rows(new_keys)
            key_scales = write(key_scales, new_key_scales)
        if value_scales is not None:
            new_values, new_value_scales = quantize_rows(new_values)
            value_scales = write(value_scales, new_value_scales)
        keys = write(self.keys, new_keys)
        values = write(self.values, new_values) if self.values.size else self.values
        return KVCache(
            keys=keys,
            values=values,
            slot_positions=slot_positions,
            positions=self.positions + jnp.sum(attention_mask, axis=-1, dtype=jnp.int32),
            length=self.length + seq,
            window=self.window,
            state=self.state if new_state is None else new_state,
            key_scales=key_scales,
            value_scales=value_scales,
        )


def _check_scales(cache) -> None:
    """Raises unless an int8 cache (`KVCache` or `PagedKVCache`) carries its scales and a float one none."""
    for name, rows, scales in (("key", cache.keys, cache.key_scales), ("value", cache.values, cache.value_scales)):
        if rows.shape[-1] and (rows.dtype == jnp.int8) != (scales is not None):
            raise ValueError(
                f"A KV cache's {name}s are {rows.dtype} with{'out' if scales is None else ''} {name}_scales: int8 "
                "rows need one float32 scale per token and head, float rows none. Make caches with "
                "model.init_cache(..., dtype=...) or PagedKVCache.empty_pool(...)."
            )
