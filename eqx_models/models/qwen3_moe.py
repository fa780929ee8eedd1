"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention, sparse mixture-of-experts MLPs."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, require_full_attention
from ..architecture import Architecture

# Training-only settings (router loss), and the experts count's other spelling.
TRAINING_KEYS = frozenset({"output_router_logits", "router_aux_loss_coef"})
MOE_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})


def moe_fields_from_hf(hf: Mapping[str, Any], norm_topk_prob: bool = False) -> dict[str, Any]:
    """The `DecoderConfig` fields of the Qwen MoE settings (Qwen3-MoE, Qwen3-Next);
    `norm_topk_prob` is the family's default."""
    # transformers 5 writes `num_local_experts`; the published configs `num_experts`.
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_prob)),
        # Layers in mlp_only_layers, and all but every decoder_sparse_step-th, stay dense.
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
    )


def moe_fields_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The Qwen MoE settings of `config` in HF names."""
    return dict(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers),
    )


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    require_full_attention(hf, "Qwen3-MoE")
    moe = moe_fields_from_hf(hf)
    if not moe["num_experts"]:
        raise ConfigError("A Qwen3-MoE config needs num_experts > 0.")
    config = decoder_config_from_hf(hf, use_qk_norm=True, extra_ignored=TRAINING_KEYS | MOE_KEYS)
    return dataclasses.replace(config, **moe)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(moe_fields_to_hf(config), use_sliding_window=False, sliding_window=None)
    return hf


ARCHITECTURE = Architecture(
    "qwen3_moe", "Qwen3MoeForCausalLM", config_from_hf, config_to_hf,
    title="Qwen3-MoE",
    summary="Qwen3 attention; top-k mixture-of-experts MLPs, dense layers possible",
)
