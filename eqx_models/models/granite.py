"""Granite 3.x (`GraniteForCausalLM`): Llama blocks with four scalar multipliers.

The embeddings are scaled by `embedding_multiplier`, each sublayer's output by
`residual_multiplier` before it joins the residual stream, the attention scores
by `attention_multiplier` (in place of `head_dim ** -0.5`), and the logits are
divided by `logits_scaling`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..nn.attention import Attention, LayerInputs
from ..nn.decoder import AbstractDecoderLayer
from ..nn.moe import mlp_for
from ..nn.norm import RMSNorm
from ..architecture import Architecture

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclasses.dataclass(frozen=True)
class GraniteConfig(DecoderConfig):
    """`DecoderConfig` plus Granite's multipliers (HF names, HF defaults)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteLayer(AbstractDecoderLayer):
    """`x + residual_multiplier * attn(norm(x))`, then the same for the MLP."""

    self_attn: Attention
    mlp: eqx.Module | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    residual_multiplier: float = eqx.field(static=True)

    def __init__(self, config: GraniteConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention.from_config(config, key=k_attn, scale=config.attention_multiplier)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    mlp_for = staticmethod(mlp_for)

    def __call__(
        self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        multiplier = self.residual_multiplier
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), inputs, cached)
        x = x + attn_out * multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * multiplier, new_kv


def config_from_hf(hf: Mapping[str, Any]) -> GraniteConfig:
    multipliers = {name: float(hf.get(name, 1.0)) for name in MULTIPLIERS}
    return decoder_config_from_hf(
        hf, use_qk_norm=False, extra_ignored=frozenset(MULTIPLIERS), config_class=GraniteConfig, **multipliers
    )


def config_to_hf(config: GraniteConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update({name: getattr(config, name) for name in MULTIPLIERS}, mlp_bias=config.mlp_bias)
    return hf


ARCHITECTURE = Architecture(
    "granite", "GraniteForCausalLM", config_from_hf, config_to_hf,
    title="Granite",
    summary="multipliers on the embeddings, the residual branches, the attention scores and the logits",
    layer=GraniteLayer,
    embed_scale=lambda config: config.embedding_multiplier,
    finalize_logits=lambda config, logits: logits / config.logits_scaling,
)
