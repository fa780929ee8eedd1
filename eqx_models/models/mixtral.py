"""Mixtral (`MixtralForCausalLM`): Mistral attention, sparse mixture-of-experts MLPs.

The block is the shared `SparseMoeBlock` (top-k always renormalised); only the
tensor names differ: `block_sparse_moe.{gate,experts.{e}.w1/w2/w3}`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..architecture import Architecture

# Training-only settings: router loss and input jitter.
TRAINING_KEYS = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"})
MOE_KEYS = frozenset({"num_local_experts", "num_experts_per_tok"})
EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    config = decoder_config_from_hf(hf, use_qk_norm=False, extra_ignored=TRAINING_KEYS | MOE_KEYS)
    window = hf.get("sliding_window")
    return dataclasses.replace(
        config,
        sliding_window=None if window is None else int(window),
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=config.intermediate_size,
        norm_topk_prob=True,
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        sliding_window=config.sliding_window,
    )
    return hf


def tensor_name(name: str) -> str:
    """`...mlp.gate...` -> `...block_sparse_moe.gate...`, expert projections -> w1/w2/w3."""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in EXPERT_NAMES.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


ARCHITECTURE = Architecture(
    "mixtral", "MixtralForCausalLM", config_from_hf, config_to_hf,
    title="Mixtral",
    summary="Mistral attention; 8-expert top-2 MLPs under Mixtral's tensor names",
    tensor_name=tensor_name,
)
