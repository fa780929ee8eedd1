"""Root-mean-square layer normalisation."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """RMSNorm over the last axis, computed in float32 like `transformers`.

    The statistics are taken in float32; the normalised activations are cast back
    to the input dtype before the weight multiplies them, as Llama and Qwen3 do.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,))
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight.astype(x.dtype) * normed
