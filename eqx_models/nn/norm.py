"""Root-mean-square layer normalisation."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..axes import AbstractHasArrayAxes


class RMSNorm(AbstractHasArrayAxes):
    """RMSNorm over the last axis, computed in float32 like `transformers`.

    The statistics are taken in float32; the normalised activations are cast back
    to the input dtype before the weight multiplies them, as Llama and Qwen3 do.
    With `unit_offset` (Gemma) the scale is `1 + weight` (weights start at zero); with
    it or `float32_scale` (OLMo 2) the product is taken in float32 before the cast.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    unit_offset: bool = eqx.field(static=True, default=False)
    axis: str | None = eqx.field(static=True, default="embed")
    float32_scale: bool = eqx.field(static=True, default=False)

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        unit_offset: bool = False,
        float32_scale: bool = False,
        axis: str | None = "embed",
    ):
        """`axis` is the logical axis of `dim` (`"head_dim"` for a per-head norm)."""
        self.weight = jnp.zeros((dim,)) if unit_offset else jnp.ones((dim,))
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_scale = float32_scale
        self.axis = axis

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": (self.axis,)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)
        if self.float32_scale:
            return (normed * self.weight.astype(jnp.float32)).astype(x.dtype)
        return self.weight.astype(x.dtype) * normed.astype(x.dtype)


class LayerNorm(AbstractHasArrayAxes):
    """Layer normalisation over the last axis without a bias (Cohere), in float32:
    the mean is subtracted, the variance divided out, the weight multiplied, then
    the result cast back to the input dtype."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    axis: str | None = eqx.field(static=True, default="embed")

    def __init__(self, dim: int, eps: float = 1e-5, *, axis: str | None = "embed"):
        """`axis` is the logical axis of `dim`."""
        self.weight = jnp.ones((dim,))
        self.eps = eps
        self.axis = axis

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": (self.axis,)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(variance + self.eps)
        return (self.weight.astype(jnp.float32) * normed).astype(x.dtype)
