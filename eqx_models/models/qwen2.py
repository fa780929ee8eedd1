"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama-style blocks with q/k/v biases."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, require_full_attention
from ..architecture import Architecture


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    require_full_attention(hf, "Qwen2")
    config = decoder_config_from_hf(hf, use_qk_norm=False)
    # Always biased q/k/v and an unbiased output projection; the config has no flag.
    return dataclasses.replace(config, attention_bias=True, o_proj_bias=False)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    del hf["attention_bias"]
    hf.update(use_sliding_window=False, sliding_window=None)
    return hf


ARCHITECTURE = Architecture(
    "qwen2", "Qwen2ForCausalLM", config_from_hf, config_to_hf,
    title="Qwen2 / Qwen2.5",
    summary="biased q/k/v, unbiased output projection",
)
