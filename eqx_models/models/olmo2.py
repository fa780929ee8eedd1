"""OLMo 2 (`Olmo2ForCausalLM`): norms after the sublayers only, and QK-norm over the
whole query and key projections.

Each sublayer's output is normalised before it joins the residual stream
(`x + post_attention_layernorm(attn(x))`, then `x + post_feedforward_layernorm(mlp(x))`);
nothing is normalised on the way in. `q_norm` / `k_norm` span all heads of the
projection (`num_heads * head_dim` weights), not one head. The norms scale in
float32 before casting back, as `transformers` does.
"""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..nn.attention import AbstractAttention, AbstractRotaryAttention, LayerInputs, qkvo_projections
from ..nn.decoder import AbstractDecoderLayer
from ..nn.linear import Linear, project_together
from ..nn.moe import mlp_for
from ..nn.norm import RMSNorm
from ..architecture import Architecture


def olmo_norm(config: DecoderConfig, dim: int, axis: str = "embed") -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, float32_scale=True, axis=axis)


class WholeProjectionQKNormAttention(AbstractRotaryAttention):
    """Attention whose `q_norm` / `k_norm` normalise each token's whole query and
    key projections (every head together), before they are split into heads."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm
    k_norm: RMSNorm
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    softcap: ClassVar[None] = None
    interleave: ClassVar[bool] = False
    sinks: ClassVar[None] = None

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = qkvo_projections(
            config.hidden_size, heads, kv_heads, dim,
            use_bias=config.attention_bias, output_bias=config.o_proj_bias, key=key,
        )
        self.q_norm = olmo_norm(config, heads * dim, "heads")
        self.k_norm = olmo_norm(config, kv_heads * dim, "kv_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, dim
        self.scale = dim**-0.5

    def project(self, x: Float[Array, "batch seq hidden"]):
        batch, seq, _ = x.shape
        q, k, v = project_together(x, [self.q_proj, self.k_proj, self.v_proj])
        q, k = self.q_norm(q), self.k_norm(k)
        heads = lambda a, n: a.reshape(batch, seq, n, self.head_dim)
        return heads(q, self.num_heads), heads(k, self.num_kv_heads), heads(v, self.num_kv_heads)


class AbstractPostNormLayer(AbstractDecoderLayer):
    """`x + post_attention_layernorm(attn(x))`, then `x + post_feedforward_layernorm(mlp(x))`
    (OLMo 2, EXAONE 4): nothing is normalised on the way in."""

    self_attn: eqx.AbstractVar[AbstractAttention]
    post_attention_layernorm: eqx.AbstractVar[RMSNorm]
    post_feedforward_layernorm: eqx.AbstractVar[RMSNorm]

    def __call__(
        self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        attn_out, new_kv = self.self_attn(x, inputs, cached)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(x)), new_kv


class PostNormLayer(AbstractPostNormLayer):
    """OLMo 2's post-norm layer: QK-norm over the whole projections, norms that scale
    in float32."""

    self_attn: WholeProjectionQKNormAttention
    mlp: eqx.Module | None
    post_attention_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = WholeProjectionQKNormAttention(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.post_attention_layernorm = olmo_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = olmo_norm(config, config.hidden_size)

    mlp_for = staticmethod(mlp_for)


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    return decoder_config_from_hf(hf, use_qk_norm=True, o_proj_bias=bool(hf.get("attention_bias", False)))


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    return decoder_config_to_hf(config)


ARCHITECTURE = Architecture(
    "olmo2", "Olmo2ForCausalLM", config_from_hf, config_to_hf,
    title="OLMo 2",
    summary="norms after each sublayer only; QK-norm over the whole projection",
    layer=PostNormLayer,
    norm=olmo_norm,
)
