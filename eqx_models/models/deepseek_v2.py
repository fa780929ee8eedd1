"""DeepSeek-V2 (`DeepseekV2ForCausalLM`): DeepSeek-V3's Multi-head Latent Attention
and shared experts (see `deepseek_v3.py`), with softmax routing.

The router scores the experts with a softmax (float32) and keeps the
`num_experts_per_tok` best (`topk_method: greedy`), or first the `topk_group`
groups of `n_group` with the best single expert and then the best experts among
them (`group_limited_greedy`, DeepSeek-V2 itself). The kept scores are not
renormalised; they are multiplied by `routed_scaling_factor`. No correction bias.
DeepSeek-V2-Lite runs its queries through one `q_proj` (`q_lora_rank` null).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import ConfigError
from ..nn.decoder import AbstractPreNormLayer
from ..nn.linear import Linear
from ..nn.moe import AbstractSparseMoeBlock, Experts, MixedMLP, dense_mlp, router_and_experts
from ..nn.mlp import GatedMLP
from ..nn.norm import RMSNorm
from ..architecture import Architecture
from .deepseek_v3 import (
    DeepseekV3Config, MultiHeadLatentAttention, _refuse, _whole, mla_config_from_hf, mla_config_to_hf,
    shared_experts_mlp, skips_tensor,
)

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config(DeepseekV3Config):
    """`DeepseekV3Config` plus the routing method (HF name `topk_method`)."""

    topk_method: str = "greedy"


class DeepseekV2MoeBlock(AbstractSparseMoeBlock):
    """Routed experts with softmax routing (greedy or group-limited), plus the shared experts."""

    gate: Linear
    experts: Experts
    shared_experts: GatedMLP
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    routed_scaling_factor: float = eqx.field(static=True)
    n_group: int = eqx.field(static=True)
    topk_group: int = eqx.field(static=True)
    topk_method: str = eqx.field(static=True)

    def __init__(self, config: DeepseekV2Config, *, key: PRNGKeyArray):
        k_moe, k_shared = jax.random.split(key)
        self.gate, self.experts = router_and_experts(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, hidden_act=config.hidden_act, key=k_moe
        )
        self.shared_experts = shared_experts_mlp(config, k_shared)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group, self.topk_method = config.n_group, config.topk_group, config.topk_method

    def route_tokens(
        self, gate, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        logits = jnp.einsum("th,eh->te", tokens.astype(jnp.float32), _whole(gate.weight).astype(jnp.float32))
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        if self.topk_method == "group_limited_greedy":
            count = tokens.shape[0]
            groups = scores.reshape(count, self.n_group, self.num_experts // self.n_group)
            _, best_groups = jax.lax.top_k(jnp.max(groups, axis=-1), self.topk_group)
            eligible = jnp.any(best_groups[:, :, None] == jnp.arange(self.n_group)[None, None], axis=1)
            choice = jnp.where(eligible[:, :, None], groups, 0.0).reshape(count, self.num_experts)
        weights, chosen = jax.lax.top_k(choice, self.top_k)
        return weights * self.routed_scaling_factor, chosen

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        return self.routed_experts(x) + self.shared_experts(x)


class DeepseekV2Layer(AbstractPreNormLayer):
    """DeepSeek-V3's layer (MLA) with the softmax-routed MoE."""

    self_attn: MultiHeadLatentAttention
    mlp: GatedMLP | DeepseekV2MoeBlock | MixedMLP | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: DeepseekV2Config, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = MultiHeadLatentAttention(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def mlp_for(config: DeepseekV2Config, key: PRNGKeyArray, sparse: bool) -> GatedMLP | DeepseekV2MoeBlock:
        return DeepseekV2MoeBlock(config, key=key) if sparse else dense_mlp(config, key)


def config_from_hf(hf: Mapping[str, Any]) -> DeepseekV2Config:
    _refuse(hf, "scoring_func", "softmax")
    _refuse(hf, "moe_layer_freq", 1)
    method = hf.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ConfigError(
            f"DeepSeek-V2 topk_method={method!r} is not supported; this library implements {TOPK_METHODS}."
        )
    experts, groups = int(hf["n_routed_experts"]), int(hf.get("n_group") or 1)
    if method == "group_limited_greedy" and experts % groups:
        raise ConfigError(f"n_routed_experts={experts} must split into n_group={groups} equal groups.")
    return mla_config_from_hf(hf, DeepseekV2Config, norm_topk_prob=False, rope_interleave=True, topk_method=method)


def config_to_hf(config: DeepseekV2Config) -> dict[str, Any]:
    hf = mla_config_to_hf(config)
    hf.update(topk_method=config.topk_method)
    return hf


ARCHITECTURE = Architecture(
    "deepseek_v2", "DeepseekV2ForCausalLM", config_from_hf, config_to_hf,
    title="DeepSeek-V2",
    summary="DeepSeek-V3's latent attention and shared experts; softmax routing, greedy or group-limited",
    layer=DeepseekV2Layer,
    skips_tensor=skips_tensor,
)
