"""The gated feed-forward block (SwiGLU)."""

import functools

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from .linear import Linear, project_together

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
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
        self.gate_proj = Linear(hidden_size, intermediate_size, use_bias=use_bias, key=kg)
        self.up_proj = Linear(hidden_size, intermediate_size, use_bias=use_bias, key=ku)
        self.down_proj = Linear(intermediate_size, hidden_size, use_bias=use_bias, key=kd)
        self.hidden_act = hidden_act

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        act = ACTIVATIONS[self.hidden_act]
        gate, up = project_together(x, [self.gate_proj, self.up_proj])
        return self.down_proj(act(gate) * up)
