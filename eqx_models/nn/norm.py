"""Root-mean-square layer normalisation."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """RMSNorm over the last axis, computed in float32 like `transformers`.

    The statistics are taken in float32; the normalised activations are cast back
    to the input dtype before the weight multiplies them, as Llama and Qwen3 do.
    With `unit_offset` (Gemma) the scale is `1 + weight` (weights start at zero) and
    the product is taken in float32 before the cast.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    unit_offset: bool = eqx.field(static=True, default=False)

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False):
        self.weight = jnp.zeros((dim,)) if unit_offset else jnp.ones((dim,))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)
        return self.weight.astype(x.dtype) * normed.astype(x.dtype)
