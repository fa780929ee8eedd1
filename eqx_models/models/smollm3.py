"""SmolLM3 (`SmolLM3ForCausalLM`): Llama blocks, with rotary positions left out of
some layers (NoPE).

`no_rope_layers[i]` is 1 where layer `i` rotates its queries and keys and 0
where it does not (every fourth layer by default: `no_rope_layer_interval`). The
released models attend globally everywhere; with `use_sliding_window` the layers
that `layer_types` marks `"sliding_attention"` see only the last `sliding_window`
positions. Nothing else differs from Llama, so there is no layer of its own: the
per-layer rotary choice is the decoder's kinds of attention.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import AttentionKind, ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..architecture import Architecture

SMOLLM3_KEYS = frozenset({"no_rope_layers", "no_rope_layer_interval"})


@dataclasses.dataclass(frozen=True)
class SmolLM3Config(DecoderConfig):
    """`DecoderConfig` plus which layers rotate.

    Attributes:
        no_rope_layers: per layer, 1 with rotary positions, 0 without (HF's name).
    """

    no_rope_layers: tuple[int, ...] = ()

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        return tuple(
            dataclasses.replace(kind, rope_theta=kind.rope_theta if rotates else None)
            for kind, rotates in zip(super().attention_kinds(), self.no_rope_layers)
        )


def config_from_hf(hf: Mapping[str, Any]) -> SmolLM3Config:
    layers = hf["num_hidden_layers"]
    interval = int(hf.get("no_rope_layer_interval", 4))
    no_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(no_rope) != layers:
        raise ConfigError(f"no_rope_layers has {len(no_rope)} entries for num_hidden_layers={layers}.")
    layer_types = hf.get("layer_types")
    windowed = bool(hf.get("use_sliding_window")) and hf.get("sliding_window") is not None
    if not windowed and any(t == "sliding_attention" for t in layer_types or ()):
        raise ConfigError(
            "SmolLM3 config with 'sliding_attention' in layer_types but use_sliding_window false or no sliding_window; "
            "set both, or mark every layer 'full_attention'."
        )
    if windowed and layer_types is None:  # transformers' default: the layers without rotary slide
        layer_types = ["full_attention" if rotates else "sliding_attention" for rotates in no_rope]
    return decoder_config_from_hf(
        hf,
        use_qk_norm=False,
        extra_ignored=SMOLLM3_KEYS,
        config_class=SmolLM3Config,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        no_rope_layers=tuple(int(r) for r in no_rope),
        sliding_window=int(hf["sliding_window"]) if windowed else None,
        layer_types=tuple(layer_types) if windowed else None,
    )


def config_to_hf(config: SmolLM3Config) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update(
        no_rope_layers=list(config.no_rope_layers),
        use_sliding_window=config.sliding_window is not None,
        sliding_window=config.sliding_window,
        layer_types=None if config.layer_types is None else list(config.layer_types),
        mlp_bias=config.mlp_bias,
    )
    return hf


ARCHITECTURE = Architecture(
    "smollm3", "SmolLM3ForCausalLM", config_from_hf, config_to_hf,
    title="SmolLM3",
    summary="no rotary positions in every fourth layer (NoPE, `no_rope_layers`)",
)
