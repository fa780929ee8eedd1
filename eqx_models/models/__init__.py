"""The architectures this library implements, keyed by Hugging Face `model_type`.

Each lives in one module of this package that defines `ARCHITECTURE`; `FAMILIES`
lists those modules, one line each. `register` adds an architecture defined
elsewhere (a user's own), which `from_pretrained` and `CausalLM` then build like
the built-in ones.
"""

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ConfigError, DecoderConfig, validate_hf_config

FAMILIES = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen2",
    "mistral",
    "mixtral",
    "gemma2",
    "gemma3",
    "granite",
    "smollm3",
    "olmo2",
    "phi3",
    "exaone4",
    "cohere2",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "qwen3_next",
)


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
        layer: the decoder layer class, called as `layer(config, key=key)` and
            stacked with `eqx.filter_vmap`; None for the shared
            `eqx_models.nn.DecoderLayer`. It may be any module with that class's
            call signature (see `DecoderLayer.__call__`).
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


_REGISTERED: dict[str, Architecture] = {}


@functools.cache
def _built_in() -> dict[str, Architecture]:
    modules = [importlib.import_module(f"{__name__}.{name}") for name in FAMILIES]
    return {module.ARCHITECTURE.model_type: module.ARCHITECTURE for module in modules}


def _registry() -> dict[str, Architecture]:
    return {**_built_in(), **_REGISTERED}


def register(architecture: Architecture) -> None:
    """Makes `architecture` loadable by its `model_type` (and `hf_class`).

    Args:
        architecture: an `Architecture`; one registered under a built-in
            `model_type` replaces the built-in one.

    Returns:
        None.
    """
    _REGISTERED[architecture.model_type] = architecture


def architecture_for(hf_config: Mapping[str, Any]) -> Architecture:
    """The `Architecture` of an HF config, by `model_type` or else `architectures`.

    Every config on its way to `config_from_hf` passes here, so the common
    fields' types and ranges are checked here, once for all families
    (`eqx_models.config.validate_hf_config`): a `ConfigError` names the field."""
    validate_hf_config(hf_config)
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


def architecture_of(config: DecoderConfig) -> Architecture:
    """The `Architecture` that builds models with `config` (by its `model_type`)."""
    return architecture_for({"model_type": config.model_type})


def supported_model_types() -> list[str]:
    """The Hugging Face `model_type` values `from_pretrained` can load.

    Returns:
        Sorted model types, e.g. `["gemma3_text", "llama", ...]`.
    """
    return sorted(_registry())


def families() -> list[tuple[str, Architecture]]:
    """`(module name, Architecture)` of every built-in family, in `FAMILIES` order
    (the module name is also its docs page, `docs/models/<name>.md`)."""
    return [(name, importlib.import_module(f"{__name__}.{name}").ARCHITECTURE) for name in FAMILIES]


def models_table(page_prefix: str = "") -> str:
    """The built-in families as a markdown table (the docs' models index).

    Args:
        page_prefix: prepended to each family's page, `<name>.md`.

    Returns:
        The table, one row per family.
    """
    rows = ["| `model_type` | class | page | what differs from Llama |", "|---|---|---|---|"]
    for name, arch in families():
        rows.append(f"| `{arch.model_type}` | `{arch.hf_class}` | [{arch.title}]({page_prefix}{name}.md) | {arch.summary} |")
    return "\n".join(rows)


def models_sentence() -> str:
    """The built-in families' names in one line (the README's feature table)."""
    return ", ".join(arch.title for _, arch in families())

