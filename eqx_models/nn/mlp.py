"""The gated feed-forward block (SwiGLU)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .linear import Linear, project_together


def gelu_tanh(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """GELU with the tanh approximation, as torch's `gelu(approximate="tanh")`.

    tanh is written through `exp`: XLA:CPU's own tanh is off by up to 2.6e-7
    (torch's by 3e-8), which over a few Gemma layers moved float32 logits by
    ~1e-4 from `transformers`; this form is within 1.8e-7 and the GELU within
    3.7e-7 of float64 (torch's: 4.3e-7). exp overflowing to inf still gives 1.
    """
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
    tanh = 1 - 2 / (jnp.exp(2 * inner) + 1)
    return 0.5 * x * (1 + tanh)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu_pytorch_tanh": gelu_tanh,
}


class GatedMLP(eqx.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`, HF's `LlamaMLP` / `Qwen3MLP`."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    hidden_act: str = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        hidden_act: str = "silu",
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), use_bias=use_bias, key=kg)
        self.up_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), use_bias=use_bias, key=ku)
        self.down_proj = Linear(intermediate_size, hidden_size, axes=("embed", "mlp"), use_bias=use_bias, key=kd)
        self.hidden_act = hidden_act

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        act = ACTIVATIONS[self.hidden_act]
        gate, up = project_together(x, [self.gate_proj, self.up_proj])
        return self.down_proj(act(gate) * up)
