"""Linear and embedding layers that store weights in the Hugging Face layout."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

INIT_STD = 0.02  # transformers' default `initializer_range`


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
