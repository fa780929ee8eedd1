"""Rotary position embeddings, with the Hugging Face frequency variants."""

import functools
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@functools.lru_cache(maxsize=64)
def inverse_frequencies(dim: int, theta: float, scaling: tuple | None, long: bool = False) -> np.ndarray:
    """Per-pair rotation frequencies, shape `(dim // 2,)`, float32.

    `scaling` is the frozen `rope_scaling` of `DecoderConfig`: `default`, `linear`
    (positions divided by `factor`), `llama3` (long wavelengths divided by
    `factor`, a smooth blend between `low_freq_factor` and `high_freq_factor`),
    `yarn` (interpolated below the `beta_slow` rotations, extrapolated above
    `beta_fast`, a linear ramp between) or `longrope` (each frequency divided by
    its `short_factor`, or with `long` its `long_factor`).
    """
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    powers = np.power(np.float32(theta), exponents).astype(np.float32)
    inv_freq = (1.0 / powers).astype(np.float32)
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "longrope":
        factors = np.asarray(params["long_factor" if long else "short_factor"], np.float32)
        return (1.0 / (factors * powers)).astype(np.float32)
    factor = float(params["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).astype(np.float32)
    original = float(params["original_max_position_embeddings"])
    if rope_type == "llama3":
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        wavelength = 2 * math.pi / inv_freq
        # Between the two wavelength bounds, interpolate linearly in `original / wavelength`.
        blend = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
        return scaled.astype(np.float32)
    if rope_type == "yarn":
        # The dimension that turns `rotations` times over the original context.
        turns = lambda rotations: dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = turns(params.get("beta_fast") or 32), turns(params.get("beta_slow") or 1)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolated = (1 - ramp).astype(np.float32)
        interpolated = (1.0 / (np.float32(factor) * powers)).astype(np.float32)
        return (interpolated * (1 - extrapolated) + inv_freq * extrapolated).astype(np.float32)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def attention_factor(scaling: tuple | None) -> float:
    """The factor on the cos/sin tables (1 unless `yarn` or `longrope` ask otherwise):
    `attention_factor` if given, else yarn's `0.1 ln(factor) + 1` (or the ratio of
    two such with `mscale` / `mscale_all_dim`), longrope's
    `sqrt(1 + ln(factor) / ln(original))`."""
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    if rope_type == "yarn":
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


class RotaryEmbedding(eqx.Module):
    """Computes the cos/sin tables for given positions (no trainable state).

    `dim` is the number of rotated channels: the head width, or less with a partial
    rotary factor. With `theta=None` (a layer without rotary positions, NoPE) the
    tables are `cos = 1, sin = 0`, which `apply_rotary` turns into the identity.
    """

    dim: int = eqx.field(static=True)
    theta: float | None = eqx.field(static=True)
    scaling: tuple | None = eqx.field(static=True)

    def __call__(
        self, positions: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq rotary_dim"], Float[Array, "batch seq rotary_dim"]]:
        if self.theta is None:
            ones = jnp.ones((*positions.shape, self.dim), jnp.float32)
            return ones, jnp.zeros_like(ones)
        inv_freq = jnp.asarray(inverse_frequencies(self.dim, self.theta, self.scaling))
        params = dict(self.scaling or ())
        if params.get("rope_type") == "longrope":
            # As transformers: the long factors for the whole call once it reaches
            # past the pretraining length, else the short ones.
            long = jnp.asarray(inverse_frequencies(self.dim, self.theta, self.scaling, long=True))
            reaches = jnp.max(positions) + 1 > params["original_max_position_embeddings"]
            inv_freq = jnp.where(reaches, long, inv_freq)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = jnp.concatenate([angles, angles], axis=-1)
        factor = attention_factor(self.scaling)
        if factor == 1.0:
            return jnp.cos(angles), jnp.sin(angles)
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rotary(
    x: Float[Array, "batch heads seq head_dim"],
    cos: Float[Array, "batch seq rotary_dim"],
    sin: Float[Array, "batch seq rotary_dim"],
) -> Float[Array, "batch heads seq head_dim"]:
    """Rotates pairs `(x[i], x[i + rotary_dim/2])`: the split-half layout of HF
    checkpoints. Channels past `rotary_dim` (a partial rotary factor) pass unchanged."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None].astype(x.dtype)
    sin = sin[:, None].astype(x.dtype)
    return x * cos + rotated * sin


def apply_rotary_interleaved(
    x: Float[Array, "batch heads seq head_dim"],
    cos: Float[Array, "batch seq rotary_dim"],
    sin: Float[Array, "batch seq rotary_dim"],
) -> Float[Array, "batch heads seq head_dim"]:
    """Rotates adjacent pairs `(x[2i], x[2i + 1])` (Cohere, GLM), from the same tables
    as `apply_rotary` (whose halves repeat each pair's angle)."""
    half = cos.shape[-1] // 2
    cos = cos[:, None, :, :half].astype(x.dtype)
    sin = sin[:, None, :, :half].astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape)
