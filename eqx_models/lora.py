"""Low-rank adapters (LoRA) on chosen projections, stacked along `layers` like the
weights they adapt, saved and loaded in PEFT's layout.

    model = apply_lora(model, rank=8, targets="q_proj|v_proj", key=jax.random.key(0))
    init, step = make_train_step(optimizer, trainable=lora_filter(model))
    ...
    save_adapters(model, "adapters")      # adapter_model.safetensors + adapter_config.json
    merged = merge_lora(model)            # plain weights again, for save_pretrained
"""

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray
from safetensors.numpy import load_file, save_file

from .axes import AbstractHasArrayAxes
from .checkpoint import hf_tensor_names, leaf_name
from .models import architecture_for
from .nn.linear import Linear
from .ops import project
from .quantized import QuantizedWeight, quantize_weight

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class LoraLinear(AbstractHasArrayAxes):
    """`base(x) + scaling * (x @ lora_A.T) @ lora_B.T`.

    `lora_A` is `[*layers, rank, in]` and `lora_B` `[*layers, out, rank]`, with the
    same leading `layers` axis as `base.weight` when the projection is stacked.
    """

    base: Linear
    lora_A: Float[Array, "*layers rank in"]
    lora_B: Float[Array, "*layers out rank"]
    scaling: float = eqx.field(static=True)

    @property
    def weight(self):
        return self.base.weight

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        out_axis, in_axis = self.base.axes
        return {"lora_A": (None, in_axis), "lora_B": (out_axis, None)}

    @property
    def bias(self):
        return self.base.bias

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        return self.finish(x, project(x, self.base.weight))

    def finish(self, x: Float[Array, "*batch in"], y: Float[Array, "*batch out"]) -> Float[Array, "*batch out"]:
        """`y = x @ weight.T` completed with the bias and the low-rank term."""
        y = self.base.finish(x, y)
        low = jnp.einsum("...i,ri->...r", x, self.lora_A.astype(x.dtype))
        return (y + self.scaling * jnp.einsum("...r,or->...o", low, self.lora_B.astype(x.dtype))).astype(x.dtype)


def _linear_paths(model) -> list[tuple[str, tuple]]:
    """`(dotted path, tree path)` of every `Linear` outside the expert stacks."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, Linear))[0]
    out = []
    for path, node in found:
        if isinstance(node, Linear):
            name = leaf_name(path)
            if ".experts." not in f".{name}.":
                out.append((name, path))
    return out


def _node(tree, path):
    for key in path:
        tree = getattr(tree, key.name)
    return tree


def apply_lora(
    model,
    *,
    rank: int,
    targets: str = "q_proj|v_proj",
    alpha: float | int | None = None,
    key: PRNGKeyArray,
):
    """`model` with LoRA adapters on every projection matching `targets`.

    Args:
        model: a `CausalLM`.
        rank: the adapters' rank.
        targets: a regular expression matched (in full) against each projection's
            own name (`q_proj`) or its path without layer numbers
            (`model.layers.self_attn.q_proj`). Expert weights are not adapted.
        alpha: the scaling numerator (`scaling = alpha / rank`, as in PEFT);
            default `rank`.
        key: draws `lora_A` (uniform in +-1/sqrt(in), as PEFT's default);
            `lora_B` starts at zero, so the adapted model computes what `model` does.

    Raises a `ValueError` naming the projections there are when nothing matches.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank}.")
    try:
        pattern = re.compile(targets)
    except re.error as e:
        raise ValueError(f"LoRA target pattern {targets!r} is not a regular expression: {e}.") from e
    candidates = _linear_paths(model)
    chosen = [(n, p) for n, p in candidates if pattern.fullmatch(n) or pattern.fullmatch(n.rsplit(".", 1)[-1])]
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in candidates})
        raise ValueError(f"LoRA target pattern {targets!r} matches no projection; the model's projections are {names}.")
    scaling = (rank if alpha is None else alpha) / rank
    keys = jax.random.split(key, len(chosen))
    adapted = []
    for (name, path), k in zip(chosen, keys):
        linear = _node(model, path)
        *lead, out_features, in_features = linear.weight.shape
        bound = 1 / math.sqrt(in_features)
        a = jax.random.uniform(k, (*lead, rank, in_features), minval=-bound, maxval=bound).astype(linear.weight.dtype)
        b = jnp.zeros((*lead, out_features, rank), linear.weight.dtype)
        where = jax.tree.leaves(linear.weight)[0].sharding
        if isinstance(where, jax.sharding.SingleDeviceSharding):
            # Committed like the base weights (and a train step's outputs): jit
            # would otherwise compile the step again after the first call.
            a, b = jax.device_put((a, b), where)
        adapted.append(LoraLinear(linear, a, b, scaling))
    return eqx.tree_at(lambda m: [_node(m, p) for _, p in chosen], model, adapted)


def lora_filter(model):
    """A filter for `eqx.partition` / `make_train_step(trainable=...)`: True on the
    adapters' arrays only."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: getattr(path[-1], "name", None) in ("lora_A", "lora_B"), model
    )


def _adapters(model) -> list[tuple[str, tuple, LoraLinear]]:
    """`(dotted path, tree path, adapter)` of every `LoraLinear` in `model`."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, LoraLinear))[0]
    return [(leaf_name(path), path, node) for path, node in found if isinstance(node, LoraLinear)]


def _replace(model, adapters, replacements):
    """`model` with the modules at the `adapters`' paths replaced, in order."""
    return eqx.tree_at(lambda m: [_node(m, path) for _, path, _ in adapters], model, replacements)


def merge_lora(model):
    """`model` with each adapter folded into its base weight (`W + scaling * B @ A`):
    plain `Linear` layers again, for `save_pretrained` or faster inference. A
    quantized base (QLoRA) is dequantized, summed and quantized again with its
    own settings."""
    adapters = _adapters(model)
    if not adapters:
        return model
    merged = []
    for _, _, node in adapters:
        delta = node.scaling * jnp.einsum("...or,...ri->...oi", node.lora_B.astype(jnp.float32),
                                          node.lora_A.astype(jnp.float32))
        base = node.base
        if isinstance(base.weight, QuantizedWeight):  # QLoRA: the sum quantized again, as the base was
            w = base.weight
            weight = quantize_weight(w.dequantize(jnp.float32) + delta, w.bits, w.group_size, scale_dtype=w.scales.dtype,
                                     activations=w.activations, axes=w.axes, mode=w.mode, layout=w.layout)
            weight = dataclasses.replace(weight, float_dtype=w.float_dtype)
        else:
            weight = (base.weight.astype(jnp.float32) + delta).astype(base.weight.dtype)
        merged.append(eqx.tree_at(lambda l: l.weight, base, weight))
    return _replace(model, adapters, merged)


def _peft_names(model, name: str, leaf: Array, part: str) -> list[str]:
    rename = architecture_for({"model_type": model.config.model_type}).tensor_name
    stacked_names, _ = hf_tensor_names(f"{name}.{part}", leaf.shape, rename, model.model.substack_layers())
    return [f"{PEFT_PREFIX}{n}.weight" for n in stacked_names]


def save_adapters(model, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Writes the adapters alone as PEFT does: `adapter_model.safetensors` (one
    `lora_A` / `lora_B` weight per layer and projection, PEFT's names) and
    `adapter_config.json`; `peft.PeftModel.from_pretrained` loads them onto the
    `transformers` model, and `load_adapters` onto ours."""
    adapters = _adapters(model)
    if not adapters:
        raise ValueError("The model has no LoRA adapters to save; add them with apply_lora.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    ranks, scalings = set(), set()
    for name, _, node in adapters:
        for part in ("lora_A", "lora_B"):
            leaf = getattr(node, part)
            names = _peft_names(model, name, leaf, part)
            stacked = np.asarray(leaf).reshape(len(names), *leaf.shape[-2:]) if leaf.ndim > 2 else np.asarray(leaf)[None]
            tensors.update({n: np.ascontiguousarray(a) for n, a in zip(names, stacked)})
        ranks.add(node.lora_A.shape[-2])
        scalings.add(node.scaling)
    rank, scaling = ranks.pop(), scalings.pop()
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scaling * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _, _ in adapters}),
        "base_model_name_or_path": base_model_name_or_path,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_adapters(model, directory: str | os.PathLike):
    """`model` with the adapters saved in `directory` (by `save_adapters` or PEFT)."""
    directory = Path(directory)
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / required).exists():
            raise FileNotFoundError(f"{directory} has no {required}; it is not a saved LoRA adapter folder.")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{directory}: only plain LoRA adapters load (peft_type LORA, no rsLoRA/DoRA).")
    targets = config["target_modules"]
    pattern = targets if isinstance(targets, str) else "|".join(re.escape(t) for t in targets)
    model = apply_lora(model, rank=config["r"], alpha=config["lora_alpha"], targets=pattern, key=jax.random.key(0))
    saved = load_file(directory / ADAPTER_WEIGHTS)
    filled, used = [], set()
    adapters = _adapters(model)
    for name, _, node in adapters:
        parts = []
        for part in ("lora_A", "lora_B"):
            leaf = getattr(node, part)
            names = _peft_names(model, name, leaf, part)
            missing = [n for n in names if n not in saved]
            if missing:
                raise ValueError(f"{directory / ADAPTER_WEIGHTS} lacks {missing[:3]} (and {max(len(missing) - 3, 0)} more).")
            stack = np.stack([saved[n] for n in names]).reshape(leaf.shape)
            parts.append(jnp.asarray(stack, leaf.dtype))
            used.update(names)
        filled.append(LoraLinear(node.base, *parts, node.scaling))
    unexpected = sorted(set(saved) - used)
    if unexpected:
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} has tensors no adapter takes: {unexpected[:5]}.")
    return _replace(model, adapters, filled)
