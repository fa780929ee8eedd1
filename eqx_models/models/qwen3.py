"""Qwen3 (`Qwen3ForCausalLM`): Llama-style blocks plus RMSNorm on queries and keys."""

from collections.abc import Mapping
from typing import Any

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, require_full_attention
from ..architecture import Architecture


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    require_full_attention(hf, "Qwen3")
    return decoder_config_from_hf(hf, use_qk_norm=True)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(use_sliding_window=False, sliding_window=None)
    return hf


ARCHITECTURE = Architecture(
    "qwen3", "Qwen3ForCausalLM", config_from_hf, config_to_hf,
    title="Qwen3",
    summary="RMSNorm on queries and keys; `head_dim` free",
)
