"""Qwen3 (`Qwen3ForCausalLM`): Llama-style blocks plus RMSNorm on queries and keys."""

from collections.abc import Mapping
from typing import Any

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from . import Architecture


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    if hf.get("use_sliding_window"):
        raise ConfigError(
            "Qwen3 with use_sliding_window=true is not supported yet; every released "
            "Qwen3 checkpoint sets it to false."
        )
    return decoder_config_from_hf(hf, use_qk_norm=True)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(use_sliding_window=False, sliding_window=None)
    return hf


ARCHITECTURE = Architecture("qwen3", "Qwen3ForCausalLM", config_from_hf, config_to_hf)
