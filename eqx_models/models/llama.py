"""Llama 2/3.x (`LlamaForCausalLM`), including the `llama3` rope scaling."""

from collections.abc import Mapping
from typing import Any

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..architecture import Architecture


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    return decoder_config_from_hf(hf, use_qk_norm=False)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf["mlp_bias"] = config.mlp_bias
    return hf


ARCHITECTURE = Architecture(
    "llama", "LlamaForCausalLM", config_from_hf, config_to_hf,
    title="Llama",
    summary="the reference",
)
