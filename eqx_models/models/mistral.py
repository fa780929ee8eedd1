"""Mistral (`MistralForCausalLM`): Llama-style blocks with sliding-window attention.

Every layer attends to the last `sliding_window` positions; the cache is then a
ring of that many slots (`KVCache.window`), so generating far past the window
keeps memory bounded.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..architecture import Architecture


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    # `transformers` applies `sliding_window` to every Mistral layer (`layer_types` is
    # not read by this class), and so does this one.
    config = decoder_config_from_hf(hf, use_qk_norm=False)
    window = hf.get("sliding_window")
    return dataclasses.replace(config, sliding_window=None if window is None else int(window))


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    del hf["attention_bias"]
    hf["sliding_window"] = config.sliding_window
    return hf


ARCHITECTURE = Architecture(
    "mistral", "MistralForCausalLM", config_from_hf, config_to_hf,
    title="Mistral",
    summary="sliding-window attention; ring-buffer cache",
)
