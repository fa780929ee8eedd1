"""What a Hugging Face architecture is to this library (`Architecture`), and the
registry of them by `model_type`.

The blocks (`eqx_models.nn`) look their family up here by the config's
`model_type`; the families themselves (`eqx_models.models`) register here.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .config import ConfigError, DecoderConfig, validate_hf_config


def _identity(name: str) -> str:
    return name


def _no_embed_scale(config: DecoderConfig) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture maps onto the shared blocks.

    Attributes:
        model_type: HF `model_type` (`"qwen3"`).
        hf_class: the `*ForCausalLM` class name written to `architectures`.
        config_from_hf: HF config dict -> `DecoderConfig` (raises `ConfigError` on
            anything that would change the math and is not implemented).
        config_to_hf: `DecoderConfig` -> HF config dict, for `save_pretrained`.
        title: the family's name in the docs and tables (`"Qwen3"`).
        summary: what differs from Llama, in a few words (for the tables).
        layer: the decoder layer class, built as `layer(config, key=key)` and
            stacked with `eqx.filter_vmap`; None for the shared
            `eqx_models.nn.DecoderLayer`. It is a final subclass of
            `eqx_models.nn.AbstractDecoderLayer` (also built with `mlp=False`, its
            `mlp` then set from its static `mlp_for(config, key, sparse)` when only
            some layers are sparse, and called as `layer(x, inputs, cached)`), or,
            when `DecoderConfig.layers_per_block > 1`, of
            `eqx_models.nn.AbstractLayerBlock` (several layers scanned as one step).
        norm: `norm(config, dim)` -> the final norm after the stack; None for
            RMSNorm with `rms_norm_eps`.
        embed_scale: `embed_scale(config)` -> a factor on the embedding output, or
            None.
        finalize_logits: `finalize_logits(config, logits)` -> the logits the model
            returns (a scale, a soft cap); None leaves them as the head gives them.
        tensor_name: our tensor name (with layer and expert indices filled in) ->
            the checkpoint's, where the architecture names a block differently.
        fused_experts: the checkpoint holds each layer's expert weights as one
            tensor `[experts, in, out]` (gpt-oss), not one `[out, in]` per expert;
            our names then carry no expert index, and loading and saving transpose.
        skips_tensor: `skips_tensor(config, name)` -> True for a checkpoint tensor
            the model does not use and loading should pass over (DeepSeek-V3's
            multi-token-prediction layers); None: every tensor is used.
    """

    model_type: str
    hf_class: str
    config_from_hf: Callable[[Mapping[str, Any]], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig], dict[str, Any]]
    title: str = ""
    summary: str = ""
    layer: type | None = None
    norm: Callable[[DecoderConfig, int], Any] | None = None
    embed_scale: Callable[[DecoderConfig], float | None] = _no_embed_scale
    finalize_logits: Callable[[DecoderConfig, Any], Any] | None = None
    tensor_name: Callable[[str], str] = _identity
    fused_experts: bool = False
    skips_tensor: Callable[[DecoderConfig, str], bool] | None = None


# By `model_type`: the built-in families (`eqx_models.models` registers them as
# it is imported, which importing `eqx_models` does first), then users' own.
_REGISTRY: dict[str, Architecture] = {}


def registered() -> dict[str, Architecture]:
    """Every registered architecture by `model_type`."""
    return dict(_REGISTRY)


def register(architecture: Architecture) -> None:
    """Makes `architecture` loadable by its `model_type` (and `hf_class`).

    Args:
        architecture: an `Architecture`; one registered under a built-in
            `model_type` replaces the built-in one.

    Returns:
        None.
    """
    _REGISTRY[architecture.model_type] = architecture


def architecture_for(hf_config: Mapping[str, Any]) -> Architecture:
    """The `Architecture` of an HF config, by `model_type` or else `architectures`.

    Every config on its way to `config_from_hf` passes here, so the common
    fields' types and ranges are checked here, once for all families
    (`eqx_models.config.validate_hf_config`): a `ConfigError` names the field."""
    validate_hf_config(hf_config)
    registry = _REGISTRY
    model_type = hf_config.get("model_type")
    if model_type in registry:
        return registry[model_type]
    by_class = {arch.hf_class: arch for arch in registry.values()}
    for name in hf_config.get("architectures") or ():
        if name in by_class:
            return by_class[name]
    raise ConfigError(
        f"Unsupported model_type {model_type!r} (architectures "
        f"{hf_config.get('architectures')}). Supported model types: {sorted(registry)}."
    )


def architecture_of(config: DecoderConfig) -> Architecture:
    """The `Architecture` that builds models with `config` (by its `model_type`)."""
    return architecture_for({"model_type": config.model_type})
