"""The key/value cache threaded through the scanned decoder layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .kernels import write_slots


class KVCache(eqx.Module):
    """Keys and values of every layer, preallocated for `max_length` slots.

    Slots are written left to right, the same number per call for every row; the
    per-row `valid` mask marks which slots hold real tokens (left padding does not)
    and `positions` counts each row's real tokens, which is the rotary position of
    that row's next token. `model(ids, cache=cache)` returns the updated cache: the
    same call serves prefill, chunked prefill and single-token decode.

    Attributes:
        keys: `[layers, batch, kv_heads, kv_seq, head_dim]`, already rotated.
        values: `[layers, batch, kv_heads, kv_seq, head_dim]`.
        valid: `[batch, kv_seq]`, True where a slot holds a real token.
        positions: `[batch]`, real tokens seen per row.
        length: scalar, slots written so far (same for every row).
    """

    keys: Float[Array, "layers batch kv_heads kv_seq head_dim"]
    values: Float[Array, "layers batch kv_heads kv_seq head_dim"]
    valid: Bool[Array, "batch kv_seq"]
    positions: Int[Array, " batch"]
    length: Int[Array, ""]

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype=jnp.float32,
    ) -> "KVCache":
        """A cache with room for `max_length` tokens per row and nothing written."""
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch_size, max_length), bool),
            positions=jnp.zeros((batch_size,), jnp.int32),
            length=jnp.zeros((), jnp.int32),
        )

    @property
    def max_length(self) -> int:
        """Slots per row."""
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def new_positions(self, attention_mask: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
        """Rotary positions of the tokens about to be appended (padding repeats its neighbour)."""
        return self.positions[:, None] + jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)

    def append(
        self,
        new_keys: Float[Array, "layers batch kv_heads seq head_dim"],
        new_values: Float[Array, "layers batch kv_heads seq head_dim"],
        attention_mask: Int[Array, "batch seq"],
    ) -> "KVCache":
        """Writes one step's keys/values after the last written slot.

        One write per buffer (`eqx_models.kernels.write_slots`): under a jit that
        donates the cache, the update happens in place. Writing past `max_length` raises (XLA would
        otherwise clamp the index and overwrite the last slots silently).
        """
        seq = new_keys.shape[3]
        length = eqx.error_if(
            self.length,
            self.length + seq > self.max_length,
            "KVCache overflow: the tokens of this call do not fit in the cache's "
            "max_length slots. Create a larger cache with model.init_cache(batch, max_length).",
        )
        keys = write_slots(self.keys, new_keys, length)
        values = write_slots(self.values, new_values, length)
        valid = jax.lax.dynamic_update_slice(self.valid, attention_mask.astype(bool), (0, length))
        return KVCache(
            keys=keys,
            values=values,
            valid=valid,
            positions=self.positions + jnp.sum(attention_mask, axis=-1, dtype=jnp.int32),
            length=length + seq,
        )

