"""Linear and embedding layers that store weights in the Hugging Face layout."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._xla_flags import REDUCTION_MATVEC

INIT_STD = 0.02  # transformers' default `initializer_range`
# Up to this many rows (batch x seq) a matrix-vector product is written as a
# reduction. Measured on a 2-core x86 CPU: at 8 rows the matmul (with its slice
# copy) is twice as fast as the reduction, at 1 row the reduction wins.
MAX_REDUCTION_ROWS = 1


def use_reduction_matvec(x: Array, weight: Array) -> bool:
    """Whether `x @ weight.T` should be computed as multiply + sum (see `_xla_flags`)."""
    return (
        REDUCTION_MATVEC
        and weight.dtype == jnp.float32  # a bfloat16 sum would also accumulate in bfloat16
        and math.prod(x.shape[:-1]) <= MAX_REDUCTION_ROWS
    )


class Linear(eqx.Module):
    """`y = x @ weight.T + bias`, with `weight` shaped `(out, in)` as in torch.

    Works on any leading axes, so one module serves `[batch, seq, in]` activations.
    """

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, key: PRNGKeyArray):
        self.weight = INIT_STD * jax.random.normal(key, (out_features, in_features))
        self.bias = jnp.zeros((out_features,)) if use_bias else None

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        if use_reduction_matvec(x, self.weight):
            # Decode: one row against a (possibly scanned, stacked) weight. As
            # multiply + sum the layer's slice is read in place; a `dot` copies it.
            y = jnp.sum(self.weight * x[..., None, :], axis=-1)
        else:
            y = jnp.einsum("...i,oi->...o", x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y


class Embedding(eqx.Module):
    """Token embedding table shaped `(vocab, hidden)`."""

    weight: Float[Array, "vocab hidden"]

    def __init__(self, vocab_size: int, hidden_size: int, *, key: PRNGKeyArray):
        self.weight = INIT_STD * jax.random.normal(key, (vocab_size, hidden_size))

    def __call__(self, input_ids: Int[Array, "*batch"]) -> Float[Array, "*batch hidden"]:
        return jnp.take(self.weight, input_ids, axis=0)

    def attend(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch vocab"]:
        """Projects hidden states onto the vocabulary with the same table (tied head)."""
        return jnp.einsum("...h,vh->...v", x, self.weight)
