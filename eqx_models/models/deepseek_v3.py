"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): Multi-head Latent Attention with a
compressed cache, and a mixture of experts with shared experts and group-limited
sigmoid routing.

**Attention (MLA).** Keys and values come from one latent per token:
`kv_a_proj_with_mqa` gives `kv_lora_rank` latent channels (normalised by
`kv_a_layernorm`) and `qk_rope_head_dim` channels of one rotary key shared by
every head; `kv_b_proj` would expand the latent into each head's key
(`qk_nope_head_dim`) and value (`v_head_dim`). Queries come from `q_proj`, or
through a low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`.

Here the expansion is folded into the queries and the output instead of the keys
("absorbed"): each head's query is multiplied by its key expansion, so it scores
the latent itself; the softmax-weighted latents are expanded by the value
expansion afterwards. The cache therefore holds one row per token and layer,
`[latent ; rotary key]` (576 numbers for the released shapes, against
`2 * 128 * 128` for the expanded keys and values of 128 heads), and the values
are that row's first `kv_lora_rank` channels: `cache_layout()` is one head of
`kv_lora_rank + qk_rope_head_dim` key channels and no value channels. The decode
kernel reads the rows in place, once for the scores and once for the values.

**MLP.** The first `first_k_dense_replace` layers are dense; the others route each
token to `num_experts_per_tok` of `n_routed_experts` experts and add
`n_shared_experts` always-on experts (one MLP of their combined width). Routing:
sigmoid scores plus `e_score_correction_bias` choose; experts are grouped into
`n_group` groups, each group scored by its two best, and only the `topk_group`
best groups are eligible; the chosen experts are weighted by their scores without
the bias, renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`.

Rotary positions (YaRN in the releases, with `mscale_all_dim` also scaling the
scores) rotate adjacent channel pairs when `rope_interleave`.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..axes import AbstractHasArrayAxes
from ..config import CacheLayout, ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..nn.attention import AbstractAttention, LayerInputs, attend
from ..nn.decoder import AbstractPreNormLayer
from ..nn.linear import INIT_STD, Linear
from ..nn.mlp import GatedMLP
from ..nn.moe import AbstractSparseMoeBlock, Experts, MixedMLP, dense_mlp, router_and_experts
from ..nn.norm import RMSNorm
from ..nn.rope import apply_rotary, apply_rotary_interleaved
from ..ops import LayerSlice, headwise_in_place, headwise_matvec
from ..architecture import Architecture

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROUTING_FIELDS = ("n_shared_experts", "routed_scaling_factor", "n_group", "topk_group")
# transformers builds the latent norms with its RMSNorm's default, not `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6
# Read here; derived; training-only; or describing the multi-token-prediction layers, which are not run.
DEEPSEEK_KEYS = frozenset({
    *MLA_FIELDS, *ROUTING_FIELDS, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "first_k_dense_replace", "norm_topk_prob", "rope_interleave", "qk_head_dim", "topk_method", "scoring_func",
    "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits", "num_nextn_predict_layers",
    "num_mtp_layers",
})


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """`DecoderConfig` plus MLA's widths and the routing settings (HF names).

    Attributes:
        q_lora_rank: width of the queries' low-rank bottleneck, or None for one
            `q_proj`.
        kv_lora_rank: width of the key/value latent.
        qk_nope_head_dim: query/key channels per head without rotary positions.
        qk_rope_head_dim: query/key channels per head with them (the key's shared
            by all heads); also `head_dim`, the rotary width.
        v_head_dim: value channels per head.
        n_shared_experts: always-on experts (their MLPs merged into one).
        routed_scaling_factor: the factor on the routed experts' weights.
        n_group: expert groups for group-limited routing.
        topk_group: groups a token's experts may come from.
        rope_interleave: rotate adjacent channel pairs (True) or the two halves.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    rope_interleave: bool = True

    def cache_layout(self) -> CacheLayout:
        return CacheLayout(1, self.kv_lora_rank + self.qk_rope_head_dim, 0)

    @property
    def score_scale(self) -> float:
        """`(nope + rope) ** -0.5`, times YaRN's `mscale_all_dim` factor squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            factor = float(scaling["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale


def _whole(weight: Array | LayerSlice) -> Array:
    return weight.materialize() if isinstance(weight, LayerSlice) else weight


class MultiHeadLatentAttention(AbstractAttention):
    """MLA with the key/value expansion absorbed into queries and output (see the
    module docstring). Weight names are the checkpoint's. Called like every
    attention (`attn(x, inputs, cached) -> (out, (new_keys, new_values))`); its new
    keys are `[batch, 1, seq, kv_lora_rank + qk_rope_head_dim]` rows and its new
    values have no channels."""

    float_children = ("kv_b_proj",)  # read per head by headwise_matvec, not through Linear

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_layernorm: RMSNorm | None
    q_b_proj: Linear | None
    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: RMSNorm
    kv_b_proj: Linear
    o_proj: Linear
    num_heads: int = eqx.field(static=True)
    nope_dim: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    value_dim: int = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    interleave: bool = eqx.field(static=True)

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray):
        k_q, k_q_b, k_kv_a, k_kv_b, k_o = jax.random.split(key, 5)
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        rank = config.kv_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_dim, axes=("heads", "embed"), key=k_q)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, config.q_lora_rank, axes=(None, "embed"), use_bias=bias, key=k_q)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, axis=None)
            self.q_b_proj = Linear(config.q_lora_rank, heads * qk_dim, axes=("heads", None), key=k_q_b)
        self.kv_a_proj_with_mqa = Linear(
            hidden, rank + config.qk_rope_head_dim, axes=(None, "embed"), use_bias=bias, key=k_kv_a
        )
        self.kv_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS, axis=None)
        self.kv_b_proj = Linear(
            rank, heads * (config.qk_nope_head_dim + config.v_head_dim), axes=("heads", None), key=k_kv_b
        )
        self.o_proj = Linear(heads * config.v_head_dim, hidden, axes=("embed", "heads"), use_bias=bias, key=k_o)
        self.num_heads = heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.value_dim, self.rank = config.v_head_dim, rank
        self.scale = config.score_scale
        self.interleave = config.rope_interleave

    def rotate(self, x, cos, sin):
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def __call__(
        self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Float[Array, "batch 1 seq _"], Float[Array, "batch 1 seq 0"]]]:
        batch, seq, _ = x.shape
        heads, nope, rank = self.num_heads, self.nope_dim, self.rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(batch, seq, heads, nope + self.rope_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :rank])[:, None]  # [batch, 1, seq, rank]
        q_rope = self.rotate(q[..., nope:].transpose(0, 2, 1, 3), inputs.cos, inputs.sin)
        k_rope = self.rotate(compressed[:, None, :, rank:], inputs.cos, inputs.sin)
        weight = self.kv_b_proj.weight
        decode = seq == 1 and cached is not None and isinstance(weight, LayerSlice)
        if decode and headwise_in_place(batch, weight.stack):
            # Decode: the expansions are read where they lie in the stacked weight.
            expand = lambda t, start, rows, transpose: headwise_matvec(
                t, weight.stack, weight.index, heads=heads, row_start=start, rows=rows, transpose=transpose
            )
            key_expand = lambda t: expand(t[:, 0], 0, nope, True)[:, :, None].astype(q.dtype)
            value_expand = lambda t: expand(t[:, 0], nope, self.value_dim, False)[:, None].astype(t.dtype)
        else:
            expansion = _whole(weight).reshape(heads, nope + self.value_dim, rank)
            key_expand = lambda t: jnp.einsum("bshn,hnr->bhsr", t, expansion[:, :nope].astype(t.dtype))
            value_expand = lambda t: jnp.einsum("bshr,hvr->bshv", t, expansion[:, nope:].astype(t.dtype))
        query = jnp.concatenate([key_expand(q[..., :nope]), q_rope], axis=-1)
        new_keys = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
        out = attend(query, new_keys, latent, inputs, cached, scale=self.scale)  # [batch, seq, heads, rank]
        out = value_expand(out)
        return self.o_proj(out.reshape(batch, seq, heads * self.value_dim)), (new_keys, latent[..., :0])


class DeepseekRouter(AbstractHasArrayAxes):
    """The router's logits weight and the bias that only steers the choice."""

    weight: Float[Array, "experts hidden"]
    e_score_correction_bias: Float[Array, " experts"]

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray):
        self.weight = INIT_STD * jax.random.normal(key, (config.num_experts, config.hidden_size))
        self.e_score_correction_bias = jnp.zeros((config.num_experts,))

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": ("router", "embed"), "e_score_correction_bias": ("router",)}


class DeepseekMoeBlock(AbstractSparseMoeBlock):
    """Routed experts with group-limited sigmoid routing, plus the shared experts."""

    gate: DeepseekRouter
    experts: Experts
    shared_experts: GatedMLP
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)
    routed_scaling_factor: float = eqx.field(static=True)
    n_group: int = eqx.field(static=True)
    topk_group: int = eqx.field(static=True)

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray):
        k_gate, k_moe, k_shared = jax.random.split(key, 3)
        self.gate = DeepseekRouter(config, key=k_gate)
        _, self.experts = router_and_experts(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, hidden_act=config.hidden_act, key=k_moe
        )
        self.shared_experts = shared_experts_mlp(config, k_shared)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group

    def route_tokens(
        self, gate: DeepseekRouter, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        logits = jnp.einsum("th,eh->te", tokens.astype(jnp.float32), _whole(gate.weight).astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        choice = scores + gate.e_score_correction_bias.astype(jnp.float32)
        count = tokens.shape[0]
        groups = choice.reshape(count, self.n_group, self.num_experts // self.n_group)
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)
        _, best_groups = jax.lax.top_k(group_scores, self.topk_group)
        eligible = jnp.any(best_groups[:, :, None] == jnp.arange(self.n_group)[None, None], axis=1)
        choice = jnp.where(eligible[:, :, None], groups, -jnp.inf).reshape(count, self.num_experts)
        _, chosen = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        return self.routed_experts(x) + self.shared_experts(x)


def shared_experts_mlp(config: DeepseekV3Config, key: PRNGKeyArray) -> GatedMLP:
    """The `n_shared_experts` always-on experts, as one MLP of their combined width."""
    return GatedMLP(
        config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
        hidden_act=config.hidden_act, key=key,
    )


class DeepseekV3Layer(AbstractPreNormLayer):
    """The Llama block with MLA and DeepSeek's MoE (dense in the first layers)."""

    self_attn: MultiHeadLatentAttention
    mlp: GatedMLP | DeepseekMoeBlock | MixedMLP | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = MultiHeadLatentAttention(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def mlp_for(config: DeepseekV3Config, key: PRNGKeyArray, sparse: bool) -> GatedMLP | DeepseekMoeBlock:
        return DeepseekMoeBlock(config, key=key) if sparse else dense_mlp(config, key)


def _refuse(hf: Mapping[str, Any], key: str, expected) -> None:
    if key in hf and hf[key] not in (expected,):
        raise ConfigError(f"DeepSeek-V3 {key}={hf[key]!r} is not supported; this library implements {expected!r}.")


def mla_config_from_hf(hf: Mapping[str, Any], config_class: type, **fields: Any) -> DeepseekV3Config:
    """The `config_class` (a `DeepseekV3Config`) of a DeepSeek config's MLA, expert
    and routing fields; `fields` add the family's own."""
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    q_rank = hf.get("q_lora_rank")
    return decoder_config_from_hf(
        hf,
        use_qk_norm=False,
        extra_ignored=DEEPSEEK_KEYS,
        config_class=config_class,
        head_dim=int(hf["qk_rope_head_dim"]),
        o_proj_bias=bool(hf.get("attention_bias", False)),
        num_experts=int(hf["n_routed_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        mlp_only_layers=tuple(range(min(first_dense, hf["num_hidden_layers"]))),
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        **fields,
    )


def mla_config_to_hf(config: DeepseekV3Config) -> dict[str, Any]:
    """The HF fields `mla_config_from_hf` reads."""
    hf = decoder_config_to_hf(config)
    hf.update({name: getattr(config, name) for name in MLA_FIELDS + ROUTING_FIELDS})
    hf.update(
        n_routed_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        first_k_dense_replace=len(config.mlp_only_layers),
        norm_topk_prob=config.norm_topk_prob,
    )
    return hf


def config_from_hf(hf: Mapping[str, Any]) -> DeepseekV3Config:
    _refuse(hf, "scoring_func", "sigmoid")
    _refuse(hf, "topk_method", "noaux_tc")
    _refuse(hf, "moe_layer_freq", 1)
    experts, groups = int(hf["n_routed_experts"]), int(hf.get("n_group") or 1)
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"n_routed_experts={experts} must split into n_group={groups} groups of at least two.")
    return mla_config_from_hf(
        hf, DeepseekV3Config, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def config_to_hf(config: DeepseekV3Config) -> dict[str, Any]:
    hf = mla_config_to_hf(config)
    hf.update(rope_interleave=config.rope_interleave, num_nextn_predict_layers=0)
    return hf


def skips_tensor(config: DecoderConfig, name: str) -> bool:
    """The multi-token-prediction layers after the last decoder layer."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= config.num_hidden_layers


ARCHITECTURE = Architecture(
    "deepseek_v3", "DeepseekV3ForCausalLM", config_from_hf, config_to_hf,
    title="DeepSeek-V3",
    summary="Multi-head Latent Attention with a compressed cache; shared experts, group-limited sigmoid routing",
    layer=DeepseekV3Layer,
    skips_tensor=skips_tensor,
)
