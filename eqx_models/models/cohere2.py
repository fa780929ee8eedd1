"""Command R7B / Command A (`Cohere2ForCausalLM`): attention and MLP side by side,
LayerNorm, interleaved rotary pairs on the sliding layers only.

Each layer normalises once and adds both sublayers to the residual stream:
`x + attn(h) + mlp(h)` with `h = input_layernorm(x)`. The norms are LayerNorm
without a bias. Three of every four layers (`layer_types`) attend to the last
`sliding_window` positions and rotate adjacent channel pairs `(2i, 2i + 1)`; the
others attend globally with no rotary positions at all. Logits are multiplied by
`logit_scale`; the head is tied to the embeddings.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import AttentionKind, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf, every_nth_full
from ..nn.attention import Attention, LayerInputs
from ..nn.decoder import AbstractDecoderLayer
from ..nn.moe import mlp_for
from ..nn.norm import LayerNorm
from ..architecture import Architecture

COHERE2_KEYS = frozenset({"logit_scale", "layer_norm_eps", "sliding_window_pattern"})


@dataclasses.dataclass(frozen=True)
class Cohere2Config(DecoderConfig):
    """`DecoderConfig` plus the logits' factor; only sliding layers rotate.

    Attributes:
        logit_scale: the factor on the logits.
    """

    logit_scale: float = 0.0625

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        return tuple(
            kind if kind.window is not None else dataclasses.replace(kind, rope_theta=None)
            for kind in super().attention_kinds()
        )


def cohere_norm(config: DecoderConfig, dim: int) -> LayerNorm:
    return LayerNorm(dim, config.rms_norm_eps)


class ParallelLayer(AbstractDecoderLayer):
    """`x + attn(h) + mlp(h)` with `h = input_layernorm(x)`: one norm, both sublayers
    reading it (Cohere); the attention rotates adjacent channel pairs
    (`interleave`), not the two halves."""

    self_attn: Attention
    mlp: eqx.Module | None
    input_layernorm: LayerNorm

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention.from_config(config, key=k_attn, interleave=True)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = cohere_norm(config, config.hidden_size)

    mlp_for = staticmethod(mlp_for)

    def __call__(
        self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        h = self.input_layernorm(x)
        attn_out, new_kv = self.self_attn(h, inputs, cached)
        return x + attn_out + self.mlp(h), new_kv


def config_from_hf(hf: Mapping[str, Any]) -> Cohere2Config:
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 4)
    layer_types = hf.get("layer_types") or every_nth_full(layers, pattern)
    window = hf.get("sliding_window")
    return decoder_config_from_hf(
        hf,
        use_qk_norm=False,
        extra_ignored=COHERE2_KEYS,
        config_class=Cohere2Config,
        head_dim=hf["hidden_size"] // hf["num_attention_heads"],
        rms_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=None if window is None else int(window),
        layer_types=tuple(layer_types),
        logit_scale=float(hf.get("logit_scale", 0.0625)),
    )


def config_to_hf(config: Cohere2Config) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    del hf["rms_norm_eps"], hf["head_dim"]
    hf.update(
        layer_norm_eps=config.rms_norm_eps,
        logit_scale=config.logit_scale,
        sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
    )
    return hf


ARCHITECTURE = Architecture(
    "cohere2", "Cohere2ForCausalLM", config_from_hf, config_to_hf,
    title="Command R7B / A (Cohere 2)",
    summary="attention and MLP in parallel, LayerNorm, interleaved rotary on sliding layers, NoPE global layers",
    layer=ParallelLayer,
    norm=cohere_norm,
    finalize_logits=lambda config, logits: logits * config.logit_scale,
)
