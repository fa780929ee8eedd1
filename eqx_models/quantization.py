"""Quantizing a model: which layers, with what settings, in which layout, and the
settings a checkpoint records (`quantization_config`).

The formats themselves (`QuantizedWeight`, the int8 / int4 groups, the tiles
layout) are in `eqx_models.quantized`; this module applies them to a model.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .backends import active_backend
from .nn.attention import AbstractAttention
from .nn.linear import Embedding, Linear
from .nn.moe import AbstractSparseMoeBlock
from .quantized import (  # noqa: F401  (the formats, importable from here too)
    ACTIVATION_BLOCK, ACTIVATIONS, GROUP_SIZES, LAYOUTS, MODES, SCALE_DTYPES, TILE_BLOCK, TILE_ROWS, QuantizedWeight,
    _check, dequantize, host_tiles, is_expert_stack, quantize_activations, quantize_weight, quantized_bytes, relayout,
    rows_to_tiles, scales_to_tiles, tile_scales_to_rows, tiles_fit, tiles_in_place, tiles_to_rows, tree_child,
    unpack_int4,
)


def tiles_pay() -> bool:
    """Whether `layout="auto"` means "tiles" in this process: the CPU kernel runs
    its tiles (AVX-512 VNNI) and JAX has one device (sharded weights take XLA's
    path, which reads rows)."""
    return active_backend().prefers_quantized_tiles() and jax.device_count() == 1


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS + ("auto",):
        raise ValueError(f"layout must be one of {LAYOUTS + ('auto',)}, got {layout!r}.")


def with_layout(model, layout: str):
    """`model` with every quantized weight that fits (`tiles_fit`) in `layout`:
    "rows", "tiles", or "auto" ("tiles" where `tiles_pay()`, else "rows").

    Raises:
        ValueError: an unknown layout.
    """
    _check_layout(layout)
    if layout == "auto":
        layout = "tiles" if tiles_pay() else "rows"
    return relayout(model, layout)


def _float_children(module) -> tuple[str, ...]:
    """The `Linear` children a block reads other than through `Linear` (its
    `float_children`), which stay float."""
    if isinstance(module, (AbstractAttention, AbstractSparseMoeBlock)):
        return module.float_children
    return ()


def quantizable_layers(
    model, *, embeddings: bool = True, lm_head: bool = True, experts: bool = True
) -> list[tuple[tuple, Any, tuple]]:
    """The `Linear` and `Embedding` layers of `model` whose weights `quantize`
    replaces: `(path, layer, logical axes of its (out, in) weight)` each.

    Passed over: weights already quantized, routers, the weights a module lists in
    its `float_children`, and the embedding table, an untied head or the expert
    stacks (`[layers, experts, out, in]`) when `embeddings`, `lm_head` or `experts`
    is False.
    """
    is_layer = lambda node: isinstance(node, (Linear, Embedding))
    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)[0]:
        if not is_layer(node) or isinstance(node.weight, QuantizedWeight):
            continue
        parent = model
        for key in path[:-1]:
            parent = tree_child(parent, key)
        name = getattr(path[-1], "name", None)
        keep = name in _float_children(parent) or (name == "lm_head" and not lm_head)
        if isinstance(node, Embedding):
            keep = keep or not embeddings
        elif node.axes[0] == "router":
            keep = True
        elif is_expert_stack(node.weight):
            keep = keep or not experts
        if not keep:
            found.append((tuple(path), node, ("vocab", "embed") if isinstance(node, Embedding) else node.axes))
    return found


def quantize(
    model, bits: int = 8, group_size: int = 32, *, scale_dtype=jnp.float16, activations: str = "int8",
    embeddings: bool = True, lm_head: bool = True, experts: bool = True, keep_indivisible: bool = False,
    mode: str = "symmetric", layout: str = "auto",
):
    """`model` with its linear weights (and embedding table) replaced by `QuantizedWeight`s.

    Args:
        model: a `CausalLM` (or any module holding `nn.Linear` layers, stacked or not).
        bits: 8 or 4.
        group_size: inputs per scale (32, 64 or 128); must divide every quantized
            layer's input width.
        scale_dtype: float16 (as llama.cpp) or bfloat16.
        activations: "int8" (inputs of the products rounded per block of 32, as
            llama.cpp does: the fast CPU path) or "float" (exact products with
            the dequantized weights).
        embeddings: also quantize the token embedding table (rows are dequantized
            as they are looked up; a tied head reads it quantized too).
        lm_head: also quantize an untied output head.
        experts: also quantize the experts of mixture-of-experts layers (most of
            such a model's bytes; each expert's groups lie along its own rows).
        keep_indivisible: leave float the layers whose input width `group_size`
            does not divide (llama.cpp falls back the same way) instead of
            raising.
        mode: "symmetric" (as llama.cpp's Q8_0 / Q4_0) or "affine" (int4 with a
            scale and a bias per group, as mlx-lm; best at group_size=64).
        layout: how int8 integers lie in memory (see `with_layout`): "auto"
            (the CPU kernel's tiles where they pay, else rows), "rows" or "tiles".

    Returns:
        The quantized model. Kept in their dtype: norms, biases, routers, and the
        weights a module lists in its `float_children` (those it reads other than
        through `Linear`).
    """
    _check(0, bits, group_size, mode)
    _check_layout(layout)
    swaps = []
    for path, node, axes in quantizable_layers(model, embeddings=embeddings, lm_head=lm_head, experts=experts):
        if node.weight.shape[-1] % group_size:
            if not keep_indivisible:
                raise ValueError(
                    f"group_size={group_size} does not divide the input width {node.weight.shape[-1]} of "
                    f"{jax.tree_util.keystr(path)}; pick a group size that does "
                    f"({[g for g in GROUP_SIZES if node.weight.shape[-1] % g == 0] or 'none of ' + str(GROUP_SIZES)}), "
                    "or pass keep_indivisible=True to leave such layers float."
                )
            continue
        swaps.append((path, quantize_weight(
            node.weight, bits, group_size, scale_dtype=scale_dtype, activations=activations, axes=axes, mode=mode
        )))
    for path, weight in swaps:
        def where(m, path=path):
            for key in path:
                m = tree_child(m, key)
            return m.weight

        model = eqx.tree_at(where, model, weight)
    return with_layout(model, layout)



def with_activations(model, activations: str):
    """`model` with every quantized weight's products taking their inputs as
    `activations` says: "int8" (rounded per block of 32, the fast CPU path) or
    "float" (the exact product with the dequantized weight)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}.")
    is_quantized = lambda node: isinstance(node, QuantizedWeight)

    def swap(node):
        if not is_quantized(node):
            return node
        if activations == "float" and node.layout == "tiles":  # the tiles are for int8 activations
            node = with_layout(node, "rows")
        return dataclasses.replace(node, activations=activations)

    return jax.tree.map(swap, model, is_leaf=is_quantized)

# ----------------------------------------------------------- checkpoint layout

FORMAT = "eqx_models"
FORMAT_VERSION = 1
PRESETS = {"int8": dict(bits=8), "int4": dict(bits=4), "int4-affine": dict(bits=4, group_size=64, mode="affine")}


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
    """How a model is quantized: `quantize(model, **spec.options())` rebuilds it,
    and `quantization_config` in a saved `config.json` records it."""

    bits: int
    group_size: int = 32
    scale_dtype: str = "float16"
    activations: str = "int8"
    embeddings: bool = True
    lm_head: bool = True
    keep_indivisible: bool = False
    experts: bool = True
    mode: str = "symmetric"

    def options(self) -> dict:
        return dict(bits=self.bits, group_size=self.group_size, scale_dtype=jnp.dtype(self.scale_dtype),
                    activations=self.activations, embeddings=self.embeddings, lm_head=self.lm_head,
                    keep_indivisible=self.keep_indivisible, experts=self.experts, mode=self.mode)

    def to_hf(self) -> dict:
        """The `quantization_config` entry of `config.json`."""
        return dict(quant_method=FORMAT, format_version=FORMAT_VERSION, bits=self.bits, group_size=self.group_size,
                    scale_dtype=self.scale_dtype, activations=self.activations, embeddings=self.embeddings,
                    lm_head=self.lm_head, keep_indivisible=self.keep_indivisible, experts=self.experts, mode=self.mode)


def spec_for(quantize: "str | QuantizationSpec | dict") -> QuantizationSpec:
    """A `QuantizationSpec` from `"int8"` / `"int4"`, a mapping of its fields, or itself."""
    if isinstance(quantize, QuantizationSpec):
        return quantize
    if isinstance(quantize, str):
        if quantize not in PRESETS:
            raise ValueError(f"quantize={quantize!r} is not known; use one of {sorted(PRESETS)} (or a mapping of "
                             "bits, group_size, scale_dtype, activations, embeddings, lm_head, experts, keep_indivisible, mode).")
        return QuantizationSpec(**PRESETS[quantize])
    return QuantizationSpec(**dict(quantize))


def spec_from_hf(entry: dict, where: str) -> QuantizationSpec:
    """The spec a saved `quantization_config` describes; refuses other formats and
    versions with what to do."""
    method = entry.get("quant_method")
    if method != FORMAT:
        raise ValueError(
            f"{where} is quantized with quant_method={method!r}, which this library does not read. Load the "
            "float checkpoint and quantize it here (from_pretrained(..., quantize='int8' or 'int4')), or use a "
            "checkpoint written by eqx_models.save_pretrained."
        )
    version = entry.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where} holds an eqx_models quantized checkpoint of layout version {version!r}; this version of "
            f"eqx_models reads version {FORMAT_VERSION}. Upgrade eqx_models, or re-quantize from the float checkpoint."
        )
    names = [f.name for f in dataclasses.fields(QuantizationSpec)]
    # Checkpoints written before experts could be quantized held them float.
    fields = dict(experts=False) | {k: entry[k] for k in names if k in entry}
    if fields.get("mode", "symmetric") not in MODES:
        raise ValueError(
            f"{where} holds weights quantized in mode {fields['mode']!r}; this version of eqx_models reads "
            f"{MODES}. Upgrade eqx_models, or re-quantize from the float checkpoint."
        )
    return QuantizationSpec(**fields)


def spec_of(model) -> QuantizationSpec | None:
    """The spec of a model quantized by `quantize` (None if nothing in it is quantized).

    Raises:
        ValueError: weights quantized with different settings (no single spec).
    """
    weights = [leaf for leaf in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, QuantizedWeight))
               if isinstance(leaf, QuantizedWeight)]
    if not weights:
        return None
    formats = {(w.bits, w.group_size, jnp.dtype(w.scales.dtype).name, w.activations, w.mode) for w in weights}
    if len(formats) > 1:
        raise ValueError(f"The model's weights are quantized in several ways {sorted(formats)}; save_pretrained "
                         "writes one. Quantize the float model once with eqx_models.quantize.")
    (bits, group_size, scale_dtype, activations, mode), = formats
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    float_layers = [n for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Linear))
                    if isinstance(n, Linear) and not isinstance(n.weight, QuantizedWeight)]
    return QuantizationSpec(
        bits, group_size, scale_dtype, activations,
        embeddings=embed is not None and isinstance(embed.weight, QuantizedWeight),
        lm_head=head is not None and isinstance(head.weight, QuantizedWeight),
        keep_indivisible=any(layer.weight.shape[-1] % group_size for layer in float_layers),
        experts=not any(is_expert_stack(layer.weight) for layer in float_layers),
        mode=mode,
    )


