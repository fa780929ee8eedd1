"""Gemma 2 (`Gemma2ForCausalLM`): alternating sliding and global layers, soft-capped
scores and logits, norms before and after both sublayers.

Layers alternate between a `sliding_window` (4096 in the released models) and
global attention (`layer_types`, sliding first). Attention scores are scaled by
`query_pre_attn_scalar ** -0.5` and squashed to `c * tanh(score / c)` with
`c = attn_logit_softcapping`; the final logits the same with
`final_logit_softcapping`. Every RMSNorm scales by `1 + w`, the embeddings are
multiplied by `sqrt(hidden_size)`, the MLP gates with GELU (tanh). Gemma 3
(`gemma3.py`) builds on these parts.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, every_nth_full
from ..nn.attention import Attention, LayerInputs
from ..nn.decoder import AbstractDecoderLayer
from ..nn.moe import mlp_for
from ..nn.norm import RMSNorm
from ..architecture import Architecture

# Read here, or only meaningful for other attention backends.
GEMMA2_KEYS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "cache_implementation",
})


@dataclasses.dataclass(frozen=True)
class Gemma2Config(DecoderConfig):
    """`DecoderConfig` plus Gemma 2's own settings (HF names).

    Attributes:
        query_pre_attn_scalar: scores are scaled by `query_pre_attn_scalar ** -0.5`.
        attn_logit_softcapping: the scores' soft cap, or None.
        final_logit_softcapping: the logits' soft cap, or None.
    """

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


def gemma_norm(config: DecoderConfig, dim: int, axis: str = "embed") -> RMSNorm:
    """Gemma's RMSNorm: the scale is `1 + weight`."""
    return RMSNorm(dim, config.rms_norm_eps, unit_offset=True, axis=axis)


class SandwichLayer(AbstractDecoderLayer):
    """Norms before and after both sublayers (Gemma 2 and 3):
    `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
    `x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`; every norm
    scales by `1 + w`, and scores by `query_pre_attn_scalar ** -0.5`."""

    self_attn: Attention
    mlp: eqx.Module | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, config: Gemma2Config, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        per_head = lambda: gemma_norm(config, config.head_dim, "head_dim")
        self.self_attn = Attention.from_config(
            config,
            key=k_attn,
            qk_norms=(per_head(), per_head()) if config.use_qk_norm else None,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping,
        )
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = gemma_norm(config, config.hidden_size)
        self.post_attention_layernorm = gemma_norm(config, config.hidden_size)
        self.pre_feedforward_layernorm = gemma_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = gemma_norm(config, config.hidden_size)

    mlp_for = staticmethod(mlp_for)

    def __call__(
        self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), inputs, cached)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), new_kv


def embed_scale(config: DecoderConfig) -> float:
    return config.hidden_size**0.5


def soft_cap_logits(config: Gemma2Config, logits: Float[Array, "*batch vocab"]) -> Float[Array, "*batch vocab"]:
    cap = config.final_logit_softcapping
    return logits if cap is None else (jnp.tanh(logits / cap) * cap).astype(logits.dtype)


def refuse_bidirectional(hf: Mapping[str, Any], family: str) -> None:
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{family} with use_bidirectional_attention=true is an encoder; this library runs decoders.")


def config_from_hf(hf: Mapping[str, Any]) -> Gemma2Config:
    refuse_bidirectional(hf, "Gemma 2")
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or every_nth_full(layers, 2)
    softcap = lambda key: None if hf.get(key) is None else float(hf[key])
    return decoder_config_from_hf(
        {**hf, "hidden_act": hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))},
        use_qk_norm=False,
        extra_ignored=GEMMA2_KEYS,
        config_class=Gemma2Config,
        head_dim=hf.get("head_dim") or 256,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=None if hf.get("sliding_window") is None else int(hf["sliding_window"]),
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=softcap("attn_logit_softcapping"),
        final_logit_softcapping=softcap("final_logit_softcapping"),
    )


def config_to_hf(config: Gemma2Config) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    scalar = config.query_pre_attn_scalar
    hf.update(
        hidden_activation=hf.pop("hidden_act"),
        sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
    )
    return hf


ARCHITECTURE = Architecture(
    "gemma2", "Gemma2ForCausalLM", config_from_hf, config_to_hf,
    title="Gemma 2",
    summary="alternating sliding and global layers, soft-capped scores and logits, sandwich norms",
    layer=SandwichLayer,
    norm=gemma_norm,
    embed_scale=embed_scale,
    finalize_logits=soft_cap_logits,
)
