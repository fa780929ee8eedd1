"""Gemma 3 text (`Gemma3ForCausalLM`): local sliding-window and global layers in one scan.

Layers marked "sliding_attention" in `layer_types` (five of every six in the
released models, from `sliding_window_pattern`) see only the last `sliding_window`
positions and rotate with their own base; the others attend globally. The blocks:
RMSNorm scaled by `1 + w`, norms before and after both sublayers, QK-norm,
embeddings scaled by `sqrt(hidden_size)`, GELU (tanh) MLP, scores scaled by
`query_pre_attn_scalar ** -0.5`. The cache keeps every position (the global layers
need them); the sliding layers are masked.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import AttentionKind, ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, every_nth_full
from ..architecture import Architecture
from .gemma2 import Gemma2Config, SandwichLayer, embed_scale, gemma_norm, refuse_bidirectional

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
# Read here (or only meaningful for other attention backends / training).
GEMMA_KEYS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "sliding_window_pattern", "rope_local_base_freq",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention", "cache_implementation",
    "_sliding_window_pattern",  # what transformers 5 writes beside layer_types
})


@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """`Gemma2Config` (without soft caps) plus the sliding layers' rotary base.

    Attributes:
        local_rope_theta: the rotary base of the sliding layers (no scaling).
    """

    local_rope_theta: float = LOCAL_THETA

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        full = AttentionKind(self.rope_theta, self.rope_scaling, None)
        local = AttentionKind(self.local_rope_theta, None, self.sliding_window)
        return tuple(local if sliding else full for sliding in self.sliding_layers)


def _rope(hf: Mapping[str, Any]) -> tuple[dict, float]:
    """(global rope parameters in the flat spelling, local rotary base), from either format."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported.")
        return full, float(local.get("rope_theta", LOCAL_THETA))
    full = dict(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", GLOBAL_THETA))
    return full, float(hf.get("rope_local_base_freq", LOCAL_THETA))


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"Gemma 3 with {key}={hf[key]} is not supported (the released models set it to null).")
    refuse_bidirectional(hf, "Gemma 3")
    full_rope, local_theta = _rope(hf)
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    layer_types = hf.get("layer_types") or every_nth_full(layers, pattern)
    flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    flat.update(rope_parameters=full_rope, hidden_act=hf.get("hidden_activation", "gelu_pytorch_tanh"))
    return decoder_config_from_hf(
        flat,
        use_qk_norm=True,
        extra_ignored=GEMMA_KEYS,
        config_class=Gemma3Config,
        head_dim=hf.get("head_dim") or 256,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=int(hf.get("sliding_window") or 4096),
        layer_types=tuple(layer_types),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    full = hf.pop("rope_parameters")
    del hf["rope_theta"], hf["rope_scaling"]
    hf.update(
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_theta}},
        hidden_activation=hf.pop("hidden_act"),
        sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
        query_pre_attn_scalar=int(config.query_pre_attn_scalar)
        if float(config.query_pre_attn_scalar).is_integer()
        else config.query_pre_attn_scalar,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return hf


ARCHITECTURE = Architecture(
    "gemma3_text", "Gemma3ForCausalLM", config_from_hf, config_to_hf,
    title="Gemma 3",
    summary="local and global layers, `(1 + w)` norms, sandwich norms, scaled embeddings, GELU",
    layer=SandwichLayer, norm=gemma_norm, embed_scale=embed_scale,
)
