"""EXAONE 4.0 (`Exaone4ForCausalLM`): OLMo 2's post-norm block with per-head QK-norm,
and sliding layers beside global layers without rotary positions.

With a `sliding_window`, three of every four layers (`sliding_window_pattern`, or
`layer_types`) attend to the last `sliding_window` positions with rotary
positions, and the others attend globally without them (NoPE); without one,
every layer is global and rotates (the 1.2B model). The block normalises each
sublayer's output only (OLMo 2's `AbstractPostNormLayer`), the norms are Llama's
RMSNorm, and queries and keys are normalised per head as in Qwen3.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ..config import AttentionKind, ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, every_nth_full
from ..nn.attention import Attention
from ..nn.moe import mlp_for
from ..nn.norm import RMSNorm
from ..architecture import Architecture
from .olmo2 import AbstractPostNormLayer

EXAONE4_KEYS = frozenset({"sliding_window_pattern"})


@dataclasses.dataclass(frozen=True)
class Exaone4Config(DecoderConfig):
    """`DecoderConfig` whose global layers skip the rotation when there are sliding ones."""

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        kinds = super().attention_kinds()
        if self.sliding_window is None:
            return kinds
        return tuple(kind if kind.window is not None else dataclasses.replace(kind, rope_theta=None) for kind in kinds)


class Exaone4Layer(AbstractPostNormLayer):
    """OLMo 2's post-norm layout with Llama's norms and per-head QK-norm."""

    self_attn: Attention
    mlp: eqx.Module | None
    post_attention_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention.from_config(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    mlp_for = staticmethod(mlp_for)


def _layer_types(hf: Mapping[str, Any]) -> tuple[str, ...] | None:
    if hf.get("sliding_window") is None:
        return None
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        raise ConfigError(
            f"EXAONE 4 sliding_window_pattern={pattern!r} (a string) is not supported; give layer_types instead."
        )
    return every_nth_full(hf["num_hidden_layers"], pattern)


def config_from_hf(hf: Mapping[str, Any]) -> Exaone4Config:
    window = hf.get("sliding_window")
    return decoder_config_from_hf(
        hf,
        use_qk_norm=True,
        extra_ignored=EXAONE4_KEYS,
        config_class=Exaone4Config,
        attention_bias=False,
        mlp_bias=False,
        sliding_window=None if window is None else int(window),
        layer_types=_layer_types(hf),
    )


def config_to_hf(config: Exaone4Config) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    del hf["attention_bias"]
    hf.update(
        sliding_window=config.sliding_window,
        layer_types=None if config.layer_types is None else list(config.layer_types),
    )
    return hf


ARCHITECTURE = Architecture(
    "exaone4", "Exaone4ForCausalLM", config_from_hf, config_to_hf,
    title="EXAONE 4.0",
    summary="post-sublayer norms, per-head QK-norm, sliding layers with rotary beside global layers without",
    layer=Exaone4Layer,
)
