"""Rotary position embeddings, with the Hugging Face frequency variants."""

import functools
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@functools.lru_cache(maxsize=64)
def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Per-pair rotation frequencies, shape `(head_dim // 2,)`, float32.

    `scaling` is the frozen `rope_scaling` of `DecoderConfig`: `default`, `linear`
    (positions divided by `factor`) or `llama3` (long wavelengths divided by
    `factor`, a smooth blend between `low_freq_factor` and `high_freq_factor`).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.power(np.float32(theta), exponents)).astype(np.float32)
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = float(params["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).astype(np.float32)
    if rope_type == "llama3":
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        original = float(params["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        # Between the two wavelength bounds, interpolate linearly in `original / wavelength`.
        blend = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
        return scaled.astype(np.float32)
    raise ValueError(f"rope type {rope_type!r} is not supported")


class RotaryEmbedding(eqx.Module):
    """Computes the cos/sin tables for given positions (no trainable state)."""

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: tuple | None = eqx.field(static=True)

    def __call__(
        self, positions: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq head_dim"], Float[Array, "batch seq head_dim"]]:
        inv_freq = jnp.asarray(inverse_frequencies(self.head_dim, self.theta, self.scaling))
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(
    x: Float[Array, "batch heads seq head_dim"],
    cos: Float[Array, "batch seq head_dim"],
    sin: Float[Array, "batch seq head_dim"],
) -> Float[Array, "batch heads seq head_dim"]:
    """Rotates pairs `(x[i], x[i + head_dim/2])`: the split-half layout of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None].astype(x.dtype)
    sin = sin[:, None].astype(x.dtype)
    return x * cos + rotated * sin
