"""The architectures this library implements, keyed by Hugging Face `model_type`."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ConfigError, DecoderConfig


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture maps onto the shared blocks.

    Attributes:
        model_type: HF `model_type` (`"qwen3"`).
        hf_class: the `*ForCausalLM` class name written to `architectures`.
        config_from_hf: HF config dict -> `DecoderConfig` (raises `ConfigError` on
            anything that would change the math and is not implemented).
        config_to_hf: `DecoderConfig` -> HF config dict, for `save_pretrained`.
        tensor_name: our tensor name (with layer and expert indices filled in) ->
            the checkpoint's, where the architecture names a block differently.
    """

    model_type: str
    hf_class: str
    config_from_hf: Callable[[Mapping[str, Any]], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig], dict[str, Any]]
    tensor_name: Callable[[str], str] = lambda name: name


def _registry() -> dict[str, Architecture]:
    from . import gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe

    architectures = (gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe)
    return {module.ARCHITECTURE.model_type: module.ARCHITECTURE for module in architectures}


def architecture_for(hf_config: Mapping[str, Any]) -> Architecture:
    """The `Architecture` of an HF config, by `model_type` or else `architectures`."""
    registry = _registry()
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


def supported_model_types() -> list[str]:
    """The Hugging Face `model_type` values `from_pretrained` can load.

    Returns:
        Sorted model types, e.g. `["gemma3_text", "llama", ...]`.
    """
    return sorted(_registry())
