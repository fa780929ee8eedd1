"""Where a model's leaves meet a checkpoint's tensors: the names a leaf goes by (ours,
the checkpoint's, the Hugging Face tensors it stacks), and the arrays read from a file
made into JAX arrays.

Shared by the readers and writers of every checkpoint format (`hub`, `gguf_file`,
`lora`), so none of them reaches into another for these.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

STACKED_PREFIX = "model.layers."
# Inside a layer, leaves under this component carry an experts axis after the layers
# axis: HF names them one tensor per expert, `...experts.{e}...`.
EXPERTS_COMPONENT = "experts."
# A quantized weight's arrays in a checkpoint: `<module>.weight` the integers,
# `<module>.scales` one scale per group, `<module>.biases` affine int4's offset per
# group (the layout of docs/quantization.md).
QUANTIZED_LEAVES = {".weight.packed": ".weight", ".weight.scales": ".scales", ".weight.biases": ".biases"}


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's dotted name in our model (`model.layers.mlp.up_proj.weight`).

    Args:
        path: the leaf's key path, as `jax.tree_util.tree_flatten_with_path` gives it.

    Returns:
        Its attribute names, dictionary keys and sequence indices joined by dots.
    """
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def checkpoint_name(path: Sequence[Any]) -> str:
    """A leaf's name as a checkpoint spells it (before the architecture's renames):
    `leaf_name`, with a quantized weight's arrays named as `QUANTIZED_LEAVES` says.

    Args:
        path: the leaf's key path.

    Returns:
        The dotted name.
    """
    name = leaf_name(path)
    for ours, theirs in QUANTIZED_LEAVES.items():
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


def hf_tensor_names(
    name: str,
    leaf_shape: tuple[int, ...],
    rename: Callable[[str], str],
    substacks: dict[str, tuple[int, ...]],
    fused_experts: bool = False,
) -> tuple[list[str], tuple[int, ...]]:
    """HF tensor names of one of our leaves, and the leading axes they stack along.

    A leaf of the layer stack holds one tensor per layer (`model.layers.{i}....`),
    an experts leaf one per layer and expert (`....experts.{e}....`), or with
    `fused_experts` one per layer holding every expert; the names come in C order
    of those axes.

    Args:
        name: the leaf's `checkpoint_name`.
        leaf_shape: the leaf's shape, stacked axes first.
        rename: maps our names to the architecture's.
        substacks: paths (`mlp.dense.`) whose leaves hold only the layers listed for
            them; such a path's last component is not part of the HF name.
        fused_experts: the architecture stores a layer's experts in one tensor.

    Returns:
        The names, and the leading axes of `leaf_shape` they stack along.
    """
    if not name.startswith(STACKED_PREFIX):
        return [rename(name)], ()
    rest = name[len(STACKED_PREFIX):]
    layers = range(leaf_shape[0])
    for path, numbers in substacks.items():
        if rest.startswith(path):
            layers = numbers
            rest = path.rstrip(".").rsplit(".", 1)[0] + "." + rest[len(path):]
    if fused_experts or f".{EXPERTS_COMPONENT}" not in f".{rest}":
        return [rename(f"{STACKED_PREFIX}{i}.{rest}") for i in layers], leaf_shape[:1]
    before, after = rest.split(EXPERTS_COMPONENT, 1)
    names = [
        rename(f"{STACKED_PREFIX}{i}.{before}{EXPERTS_COMPONENT}{e}.{after}")
        for i in layers
        for e in range(leaf_shape[1])
    ]
    return names, leaf_shape[:2]


def to_jax(array: np.ndarray) -> jax.Array:
    """The array as a JAX array on the default device, without a copy on the CPU
    backend when possible.

    Committed to that device whichever way it is made, as the outputs of jitted
    functions are: a train step that returns the model would otherwise see
    uncommitted weights once and committed ones after, and compile twice.

    Args:
        array: a host array (read from a checkpoint file, or mapped from one).

    Returns:
        The JAX array, sharing `array`'s memory where the backend allows.
    """
    if jax.default_backend() == "cpu":
        try:
            return jax.device_put(jax.dlpack.from_dlpack(array), jax.devices()[0])
        except (TypeError, BufferError, RuntimeError, ValueError):  # e.g. bfloat16 via dlpack
            pass
    return jax.device_put(array, jax.devices()[0])
