"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention, sparse mixture-of-experts MLPs."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, require_full_attention
from . import Architecture

# Training-only settings (router loss), and the experts count's other spelling.
TRAINING_KEYS = frozenset({"output_router_logits", "router_aux_loss_coef"})
MOE_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    require_full_attention(hf, "Qwen3-MoE")
    # transformers 5 writes `num_local_experts`; the published configs `num_experts`.
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not num_experts:
        raise ConfigError("A Qwen3-MoE config needs num_experts > 0.")
    config = decoder_config_from_hf(hf, use_qk_norm=True, extra_ignored=TRAINING_KEYS | MOE_KEYS)
    return dataclasses.replace(
        config,
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        # Layers in mlp_only_layers, and all but every decoder_sparse_step-th, stay dense.
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers),
        use_sliding_window=False,
        sliding_window=None,
    )
    return hf


ARCHITECTURE = Architecture(
    "qwen3_moe", "Qwen3MoeForCausalLM", config_from_hf, config_to_hf,
    title="Qwen3-MoE",
    summary="Qwen3 attention; top-k mixture-of-experts MLPs, dense layers possible",
)
