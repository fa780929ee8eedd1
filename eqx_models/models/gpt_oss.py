"""gpt-oss (`GptOssForCausalLM`): attention sinks, alternating 128-token sliding
and full layers, a mixture of experts with biases and a clamped SwiGLU.

Every attention head has a learned sink: a logit that joins the softmax of each
query without a value, so a head can put weight on nothing. Layers alternate
between a `sliding_window` (128 in the releases, sliding first) and full
attention; positions rotate with YaRN. Every projection has a bias.

Each layer's MLP is a mixture of `num_local_experts` experts: the router (with a
bias) picks the `num_experts_per_tok` largest logits and weighs them by their
softmax. An expert computes `gate_up_proj`, whose outputs interleave gate and up
channels, then `down_proj((up + 1) * gate * sigmoid(alpha * gate))` with the gate
clamped above at `swiglu_limit` and up to `[-limit, limit]`. The checkpoint holds
each layer's experts as one `[experts, in, out]` tensor per projection
(`mlp.experts.gate_up_proj`, `..._bias`); loading transposes them into our
`[experts, out, in]` stacks, which the decode kernels read in place.

Checkpoints published on the hub store the experts in MXFP4 blocks
(`quantization_config`); this library reads the float layout that
`transformers` writes after dequantizing (`Mxfp4Config(dequantize=True)`).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, every_nth_full
from ..nn.attention import Attention
from ..nn.decoder import AbstractPreNormLayer
from ..nn.linear import Linear
from ..nn.moe import AbstractExperts, AbstractSparseMoeBlock, _expert_weight, route
from ..nn.norm import RMSNorm
from ..ops import LayerSlice, grouped_matmul, project
from ..sharding import stacked_field
from ..architecture import Architecture

GPT_OSS_KEYS = frozenset({
    "num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef",
    "output_router_logits", "initial_context_length",
})


@dataclasses.dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """`DecoderConfig` plus the experts' clamped SwiGLU (HF names).

    Attributes:
        swiglu_alpha: the gain inside the gate's sigmoid.
        swiglu_limit: the clamp on gate (above) and up (both sides).
    """

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class GptOssExperts(AbstractExperts):
    """`num_experts` experts, stacked `[experts, out, in]`: `gate_up_proj` (gate and
    up channels interleaved) and `down_proj`, both with biases, and the clamped
    SwiGLU between them. The down projection's bias is the MoE block's to add."""

    gate_up_proj: Linear = stacked_field("experts")
    down_proj: Linear = stacked_field("experts")
    swiglu_alpha: float = eqx.field(static=True)
    swiglu_limit: float = eqx.field(static=True)

    def __init__(self, config: GptOssConfig, *, key: PRNGKeyArray):
        hidden, inner = config.hidden_size, config.intermediate_size

        def expert(k):
            k_gate_up, k_down = jax.random.split(k)
            return (
                Linear(hidden, 2 * inner, axes=("mlp", "embed"), use_bias=True, key=k_gate_up),
                Linear(inner, hidden, axes=("embed", "mlp"), use_bias=True, key=k_down),
            )

        self.gate_up_proj, self.down_proj = eqx.filter_vmap(expert)(jax.random.split(key, config.num_experts))
        self.swiglu_alpha = config.swiglu_alpha
        self.swiglu_limit = config.swiglu_limit

    def arrays(self) -> list[tuple[Array | LayerSlice, tuple[str | None, ...]]]:
        return [(self.gate_up_proj.weight, ("mlp", "embed")), (self.gate_up_proj.bias, ("mlp",)),
                (self.down_proj.weight, ("embed", "mlp"))]

    def forward(self, h: Float[Array, "rows hidden"], expert: Int[Array, ""], arrays) -> Float[Array, "rows hidden"]:
        gate_up_w, gate_up_b, down_w = arrays
        gate_up = project(h, _expert_weight(gate_up_w, expert))
        gate_up = (gate_up + gate_up_b[expert]).astype(h.dtype)
        return project(self._activation(gate_up), _expert_weight(down_w, expert))

    def grouped_forward(
        self, h: Float[Array, "rows hidden"], group_sizes: Int[Array, " experts"], row_expert: Int[Array, " rows"],
        arrays,
    ) -> Float[Array, "rows hidden"]:
        gate_up_w, gate_up_b, down_w = arrays
        gate_up = (grouped_matmul(h, gate_up_w, group_sizes) + gate_up_b[row_expert]).astype(h.dtype)
        return grouped_matmul(self._activation(gate_up), down_w, group_sizes)

    def _activation(self, gate_up: Float[Array, "rows two_inner"]) -> Float[Array, "rows inner"]:
        """The clamped SwiGLU of interleaved gate and up channels."""
        limit = self.swiglu_limit
        gate = jnp.minimum(gate_up[:, ::2], limit)
        up = jnp.clip(gate_up[:, 1::2], -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.swiglu_alpha)


class GptOssMoeBlock(AbstractSparseMoeBlock):
    """The router (`router`, with a bias) and `GptOssExperts`; each token's experts
    weighed by the softmax of their logits.

    The down projection's bias is added outside the per-expert blocks, as the
    routing-weighted sum of the chosen experts' biases: on a mesh the blocks'
    outputs are partial sums over the MLP width, and a bias added inside them
    would be counted once per device.
    """

    gate: Linear
    experts: GptOssExperts
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)

    def __init__(self, config: GptOssConfig, *, key: PRNGKeyArray):
        k_router, k_experts = jax.random.split(key)
        self.gate = Linear(config.hidden_size, config.num_experts, axes=("router", "embed"), use_bias=True, key=k_router)
        self.experts = GptOssExperts(config, key=k_experts)
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok

    def route_tokens(
        self, gate: Linear, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        return route(gate(tokens), self.top_k, normalize=True)  # the softmax over the chosen logits

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route_tokens(self.gate, tokens)
        bias = self.experts.down_proj.bias[chosen].astype(jnp.float32)  # [tokens, top_k, hidden]
        bias_term = jnp.einsum("tk,tkh->th", weights, bias).astype(x.dtype)
        return self.routed_experts(x) + bias_term.reshape(x.shape)


class GptOssLayer(AbstractPreNormLayer):
    """The Llama block with attention sinks and the gpt-oss experts; norms scale in
    float32."""

    self_attn: Attention
    mlp: GptOssMoeBlock | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: GptOssConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            use_bias=config.attention_bias, use_sinks=True, key=k_attn,
        )
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = gpt_oss_norm(config, config.hidden_size)
        self.post_attention_layernorm = gpt_oss_norm(config, config.hidden_size)

    @staticmethod
    def mlp_for(config: GptOssConfig, key: PRNGKeyArray, sparse: bool) -> GptOssMoeBlock:
        return GptOssMoeBlock(config, key=key)


def gpt_oss_norm(config: DecoderConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, float32_scale=True)


def config_from_hf(hf: Mapping[str, Any]) -> GptOssConfig:
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise ConfigError(
            f"This gpt-oss checkpoint is quantized (quantization_config.quant_method={method!r}); this library reads "
            "float weights. Dequantize it with transformers (Mxfp4Config(dequantize=True)) and save_pretrained first."
        )
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or every_nth_full(layers, 2)
    window = hf.get("sliding_window")
    return decoder_config_from_hf(
        hf,
        use_qk_norm=False,
        extra_ignored=GPT_OSS_KEYS,
        config_class=GptOssConfig,
        attention_bias=bool(hf.get("attention_bias", True)),
        o_proj_bias=bool(hf.get("attention_bias", True)),
        sliding_window=None if window is None else int(window),
        layer_types=tuple(layer_types),
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


def config_to_hf(config: GptOssConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
    )
    return hf


def tensor_name(name: str) -> str:
    """Our `mlp.gate` is the checkpoint's `mlp.router`; its fused expert tensors
    are named `gate_up_proj` / `gate_up_proj_bias`, without `.weight`."""
    name = name.replace(".mlp.gate.", ".mlp.router.")
    if ".mlp.experts." in name:
        name = name.replace(".weight", "").replace(".bias", "_bias")
    return name


ARCHITECTURE = Architecture(
    "gpt_oss", "GptOssForCausalLM", config_from_hf, config_to_hf,
    title="gpt-oss",
    summary="attention sinks, alternating 128-token sliding and full layers, experts with biases and a clamped SwiGLU",
    layer=GptOssLayer,
    norm=gpt_oss_norm,
    tensor_name=tensor_name,
    fused_experts=True,
)
