"""The key/value cache threaded through the scanned decoder layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .config import DecoderConfig
from .kernels import decode_attention, write_slots


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

    keys: Float[Array, "layers batch kv_heads kv_seq head_dim"]
    values: Float[Array, "layers batch kv_heads kv_seq value_dim"]
    index: Int[Array, ""]
    state: StateView | None = None

    @property
    def dtype(self):
        return self.keys.dtype

    def materialize(
        self,
    ) -> tuple[Float[Array, "batch kv_heads kv_seq head_dim"], Float[Array, "batch kv_heads kv_seq value_dim"]]:
        """This layer's keys and values."""
        take = lambda stack: jax.lax.dynamic_index_in_dim(stack, self.index, keepdims=False)
        return take(self.keys), take(self.values)

    def attend_token(
        self,
        query: Float[Array, "batch kv_heads groups head_dim"],
        valid: Bool[Array, "batch kv_seq"],
        self_valid: Bool[Array, " batch"],
        new_key: Float[Array, "batch kv_heads head_dim"],
        new_value: Float[Array, "batch kv_heads value_dim"],
        scale: float,
        sinks: Float[Array, "kv_heads groups"] | None = None,
    ) -> Float[Array, "batch kv_heads groups value_dim"]:
        """One new token per row against this layer's slots (see `kernels.decode_attention`)."""
        values = self.values if self.values.shape[-1] else self.keys
        return decode_attention(
            query, self.keys, values, self.index, valid, self_valid, new_key, new_value, scale, sinks
        )


class KVCache(eqx.Module):
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
    """

    keys: Float[Array, "layers batch kv_heads kv_seq head_dim"]
    values: Float[Array, "layers batch kv_heads kv_seq value_dim"]
    slot_positions: Int[Array, "batch kv_seq"]
    positions: Int[Array, " batch"]
    length: Int[Array, ""]
    window: int | None = eqx.field(static=True, default=None)
    state: eqx.Module | None = None

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical axes of each array (for sharding rules).

        Returns:
            Field name -> axis names.
        """
        kv = ("layers", "batch", "kv_heads", "kv_seq", "head_dim")
        return {"keys": kv, "values": kv, "slot_positions": ("batch", "kv_seq"), "positions": ("batch",), "length": ()}

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
            dtype: keys and values dtype.
            window: the sliding window, or None for a plain buffer.
            value_dim: width of a value row when it differs from `head_dim`; 0 for
                values read from the keys' first channels (see `LayerKV`).
            state: the empty recurrent state, or None.

        Returns:
            A `KVCache` whose slots are all empty (`slot_positions` -1).
        """
        slots = max_length if window is None else min(max_length, window)
        shape = (num_layers, batch_size, num_kv_heads, slots, head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros((*shape[:-1], value_dim), dtype),
            slot_positions=jnp.full((batch_size, slots), -1, jnp.int32),
            positions=jnp.zeros((batch_size,), jnp.int32),
            length=jnp.zeros((), jnp.int32),
            window=window,
            state=state,
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
            dtype: keys and values dtype.
            window: the ring size when every layer slides, else None.

        Returns:
            A `KVCache` with nothing written.
        """
        layout = config.cache_layout()
        return cls.empty(
            config.num_blocks, batch_size, layout.kv_heads, max_length, layout.key_dim, dtype, window,
            layout.value_dim, config.recurrent_state(batch_size, dtype),
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
        state = self.state if state is None else state
        view = None
        if state is not None:
            view = StateView(state, index, jnp.arange(self.batch_size, dtype=jnp.int32), self.positions == 0)
        return LayerKV(self.keys, self.values, index, view)

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

        One write per buffer (`eqx_models.kernels.write_slots`): under a jit that
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
        seq = new_keys.shape[3]
        real = attention_mask.astype(bool)
        new_slot_positions = jnp.where(real, self.new_positions(attention_mask), -1)
        if self.window is None:
            start = eqx.error_if(
                self.length,
                self.length + seq > self.max_length,
                "KVCache overflow: the tokens of this call do not fit in the cache's "
                "max_length slots. Create a larger cache with model.init_cache(batch, max_length).",
            )
            keys = write_slots(self.keys, new_keys, start)
            values = write_slots(self.values, new_values, start) if self.values.size else self.values
            slot_positions = jax.lax.dynamic_update_slice(self.slot_positions, new_slot_positions, (0, start))
        else:
            # Only the newest `max_length` tokens can still be attended to.
            keep = min(seq, self.max_length)
            start = (self.length + seq - keep) % self.max_length
            keys = write_slots(self.keys, new_keys[:, :, :, seq - keep :], start, wrap=True)
            values = (
                write_slots(self.values, new_values[:, :, :, seq - keep :], start, wrap=True)
                if self.values.size else self.values
            )
            slots = (start + jnp.arange(keep)) % self.max_length
            slot_positions = self.slot_positions.at[:, slots].set(new_slot_positions[:, seq - keep :])
        return KVCache(
            keys=keys,
            values=values,
            slot_positions=slot_positions,
            positions=self.positions + jnp.sum(attention_mask, axis=-1, dtype=jnp.int32),
            length=self.length + seq,
            window=self.window,
            state=self.state if new_state is None else new_state,
        )
