"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): fused projections, LongRoPE.

The queries, keys and values come from one `qkv_proj` (rows: every query head,
then the key heads, then the value heads) and the MLP's gate and up projections
from one `gate_up_proj` (gate rows first). The weights stay fused as in the
checkpoint: one product at prefill, one kernel call at decode, and LoRA adapters
in PEFT's layout. The fused rows are not split over a mesh (each projection keeps
its `qkv` / `gate_up` rows whole; tensor parallelism splits the output
projections).

`rope_scaling` of type `longrope` (`su` in older configs) divides each frequency
by its `short_factor`, or by its `long_factor` for a call that reaches past
`original_max_position_embeddings`, and scales the tables by
`sqrt(1 + ln(factor) / ln(original))`. As in `transformers`, the choice is per
call: keys cached before a sequence crossed that length keep the short rotation
(`transformers` recomputes the whole sequence at the crossing in `generate`).
Phi-4-mini rotates the first `partial_rotary_factor` of each head. With a
`sliding_window` every layer slides (a ring cache), as in Phi-3-mini-4k.
"""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..nn.attention import AbstractRotaryAttention
from ..nn.decoder import AbstractPreNormLayer
from ..nn.linear import Linear
from ..nn.mlp import ACTIVATIONS
from ..nn.norm import RMSNorm
from ..architecture import Architecture

# Dropouts, and the pretraining length (moved into the rope parameters here).
PHI3_KEYS = frozenset({"resid_pdrop", "embd_pdrop", "original_max_position_embeddings"})


class FusedQKVAttention(AbstractRotaryAttention):
    """Rotary attention whose queries, keys and values are one projection,
    `qkv_proj`, split by rows: every query head, then the key heads, the value heads."""

    qkv_proj: Linear
    o_proj: Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    interleave: ClassVar[bool] = False
    sinks: ClassVar[None] = None

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        k_qkv, k_o = jax.random.split(key)
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, (heads + 2 * kv_heads) * dim, axes=("qkv", "embed"), key=k_qkv)
        self.o_proj = Linear(heads * dim, config.hidden_size, axes=("embed", "heads"), key=k_o)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, dim
        self.scale = dim**-0.5
        self.softcap = None

    def project(self, x: Float[Array, "batch seq hidden"]):
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x).reshape(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        kv_start = self.num_heads + self.num_kv_heads
        return qkv[:, :, : self.num_heads], qkv[:, :, self.num_heads : kv_start], qkv[:, :, kv_start:]


class FusedGatedMLP(eqx.Module):
    """`down_proj(act(gate) * up)` with `gate, up = gate_up_proj(x)` halves (gate first)."""

    gate_up_proj: Linear
    down_proj: Linear
    hidden_act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        k_gate_up, k_down = jax.random.split(key)
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * inner, axes=("gate_up", "embed"), key=k_gate_up)
        self.down_proj = Linear(inner, hidden, axes=("embed", "mlp"), key=k_down)
        self.hidden_act = config.hidden_act

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(ACTIVATIONS[self.hidden_act](gate) * up)


class Phi3Layer(AbstractPreNormLayer):
    """The Llama block with Phi-3's fused attention and MLP."""

    self_attn: FusedQKVAttention
    mlp: FusedGatedMLP | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = FusedQKVAttention(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, False) if mlp else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def mlp_for(config: DecoderConfig, key: PRNGKeyArray, sparse: bool) -> FusedGatedMLP:
        return FusedGatedMLP(config, key=key)


def _rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The scaling dict with what longrope needs inside: its type, the pretraining
    length and the factor (`max_position_embeddings / original` unless given)."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("su", "yarn"):  # older names transformers maps to longrope
        rope_type = "longrope"
    if rope_type == "default":
        return scaling or None
    if rope_type != "longrope":
        raise ConfigError(f"Phi-3 rope_scaling of type {rope_type!r} is not supported; expected 'longrope'.")
    original = hf.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
    if original is None:
        raise ConfigError("Phi-3 longrope needs original_max_position_embeddings in config.json.")
    scaling.pop("type", None)
    scaling.update(rope_type="longrope", original_max_position_embeddings=int(original))
    if scaling.get("factor") is None:
        scaling["factor"] = hf["max_position_embeddings"] / original
    return scaling


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("Phi-3 has no biases; attention_bias/mlp_bias true is not a Phi-3 checkpoint this library knows.")
    scaling = _rope_scaling(hf)
    params = {**(hf.get("rope_parameters") or {}), **(scaling or {})}
    window = hf.get("sliding_window")
    return decoder_config_from_hf(
        {**hf, "rope_scaling": None, "rope_parameters": params or None},
        use_qk_norm=False,
        extra_ignored=PHI3_KEYS,
        partial_rotary=True,
        sliding_window=None if window is None else int(window),
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    scaling = config.rope_scaling_dict
    del hf["attention_bias"]
    if scaling and scaling.get("rope_type") == "longrope":
        hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    hf.update(sliding_window=config.sliding_window, partial_rotary_factor=config.partial_rotary_factor)
    return hf


ARCHITECTURE = Architecture(
    "phi3", "Phi3ForCausalLM", config_from_hf, config_to_hf,
    title="Phi-3 / Phi-4-mini",
    summary="fused `qkv_proj` and `gate_up_proj`, LongRoPE, partial rotary",
    layer=Phi3Layer,
)
