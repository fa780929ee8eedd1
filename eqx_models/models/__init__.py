"""The architectures this library implements, keyed by Hugging Face `model_type`.

Each lives in one module of this package that defines `ARCHITECTURE`; `FAMILIES`
lists those modules, one line each, and importing this package registers them
(`eqx_models.architecture`). `register` adds an architecture defined elsewhere (a
user's own), which `from_pretrained` and `CausalLM` then build like the built-in
ones.
"""

from ..architecture import Architecture, architecture_for, architecture_of, register, registered
from . import (
    cohere2, deepseek_v2, deepseek_v3, exaone4, gemma2, gemma3, gpt_oss, granite, llama, mistral, mixtral, olmo2, phi3,
    qwen2, qwen3, qwen3_moe, qwen3_next, smollm3,
)

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


_MODULES = {name: globals()[name] for name in FAMILIES}
for _name in FAMILIES:
    register(_MODULES[_name].ARCHITECTURE)


def supported_model_types() -> list[str]:
    """The Hugging Face `model_type` values `from_pretrained` can load.

    Returns:
        Sorted model types, e.g. `["gemma3_text", "llama", ...]`.
    """
    return sorted(registered())


def families() -> list[tuple[str, Architecture]]:
    """`(module name, Architecture)` of every built-in family, in `FAMILIES` order
    (the module name is also its docs page, `docs/models/<name>.md`)."""
    return [(name, _MODULES[name].ARCHITECTURE) for name in FAMILIES]


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

