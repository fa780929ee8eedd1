"""Sharding on a `jax.sharding.Mesh`: logical axes, rules that map them to mesh axes, placement.

Every parameter and cache array has logical axis names (`layers`, `vocab`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `experts`, `router`, `batch`, `kv_seq`).
`ShardingRules` maps each logical axis to mesh axes (`data`, `fsdp`, `tensor`,
`expert`); a `Placement` (a mesh and rules) turns an array's logical axes into
its `NamedSharding`. JAX's SPMD partitioner does the rest: the model code is the
same on one device and on many. The stacked `layers` axis is never split, so the
scan over layers is unchanged.

A mesh axis that does not divide an axis's size (two KV heads over four `tensor`
devices, a batch of one over `data`) leaves that axis whole, i.e. replicated
over that mesh axis, rather than padding it.
"""

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .axes import AbstractHasArrayAxes
from .quantized import QuantizedWeight, relayout

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# What each mesh axis splits (the `default` preset): data-like axes split the
# batch (attention stays data-parallel across `expert`, as in expert-parallel
# serving), `fsdp` splits the weights along the hidden size, `tensor` splits heads,
# the MLP and the vocabulary Megatron-style (column-parallel q/k/v, gate/up and
# head; row-parallel o_proj and down_proj), `expert` splits the experts.
_DEFAULT = {
    "batch": ("data", "fsdp", "expert"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes split each logical axis; logical axes not listed stay whole.

    Build one from a mapping (`ShardingRules.from_mapping({"mlp": "tensor", ...})`)
    or take a preset with `ShardingRules.preset(name)`: `"default"` (everything
    below, for whichever axes the mesh has), `"dp"` (weights replicated, the batch
    over every mesh axis), `"fsdp"` (weights split along `embed` over `fsdp`),
    `"tp"` (heads, MLP and vocabulary over `tensor`), `"ep"` (experts over
    `expert`, the batch over `data` and `expert`).

    Attributes:
        rules: `(logical axis, mesh axes)` pairs, e.g. `(("mlp", ("tensor",)),)`.
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str | tuple[str, ...] | None]) -> "ShardingRules":
        """Rules from a mapping.

        Args:
            mapping: logical axis -> a mesh axis, a tuple of mesh axes (split over
                all of them, in order), or None (never split).

        Returns:
            The `ShardingRules`.
        """
        pairs = []
        for logical, axes in mapping.items():
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            pairs.append((logical, axes))
        return cls(tuple(pairs))

    @classmethod
    def preset(cls, name: str) -> "ShardingRules":
        """One of the named presets.

        Args:
            name: `"default"`, `"dp"`, `"fsdp"`, `"tp"` or `"ep"`.

        Returns:
            The preset's `ShardingRules` (a `ValueError` lists the names otherwise).
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown sharding preset {name!r}; choose one of {sorted(PRESETS)} or pass ShardingRules.")
        return PRESETS[name]

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes that split `logical`.

        Args:
            logical: a logical axis name, or None for an axis that has none.

        Returns:
            The mesh axes, in order; empty when the axis stays whole.
        """
        return dict(self.rules).get(logical, ()) if logical is not None else ()


PRESETS = {
    "default": ShardingRules.from_mapping(_DEFAULT),
    "dp": ShardingRules.from_mapping({"batch": MESH_AXES}),
    "fsdp": ShardingRules.from_mapping({"batch": ("data", "fsdp"), "embed": "fsdp"}),
    "tp": ShardingRules.from_mapping(
        {"batch": "data", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    ),
    "ep": ShardingRules.from_mapping({"batch": ("data", "expert"), "experts": "expert"}),
}


def resolve_rules(sharding: "str | ShardingRules | Mapping | None") -> ShardingRules:
    """Rules from a preset name, a mapping, or `ShardingRules` (None: the default preset)."""
    if sharding is None:
        return PRESETS["default"]
    if isinstance(sharding, str):
        return ShardingRules.preset(sharding)
    if isinstance(sharding, Mapping):
        return ShardingRules.from_mapping(sharding)
    if isinstance(sharding, ShardingRules):
        return sharding
    raise TypeError(f"sharding must be a preset name, a mapping or ShardingRules; got {type(sharding).__name__}.")


def partition_spec(
    logical_axes: tuple[str | None, ...],
    sizes: tuple[int, ...],
    rules: ShardingRules,
    axis_sizes: Mapping[str, int],
) -> PartitionSpec:
    """The spec that splits each axis over its rule's mesh axes, keeping only mesh
    axes that exist, are unused by an earlier axis, and divide the size.

    `sizes` are the counts a split must divide: the array's dimensions, except for
    flattened head axes, where it is the number of heads (a head is never cut).
    """
    used: set[str] = set()
    spec = []
    for logical, size in zip(logical_axes, sizes):
        chosen = []
        for axis in rules.mesh_axes(logical):
            parts = axis_sizes.get(axis, 1)
            if axis in used or parts == 1:
                continue
            if size % (math.prod(axis_sizes[a] for a in chosen) * parts) == 0:
                chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh and the rules that lay the model out on it.

    A model placed on a mesh (`from_pretrained(..., mesh=)` or `shard_model`)
    carries its placement; its forward pass constrains activations and the cache
    with it, and `init_cache` creates the cache already split.
    """

    mesh: Mesh | jax.sharding.AbstractMesh  # abstract: for memory plans only
    rules: ShardingRules
    head_counts: tuple[tuple[str, int], ...] = ()  # logical head axis -> number of heads

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def spec(self, logical_axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
        counts = dict(self.head_counts)
        sizes = tuple(counts.get(name, size) for name, size in zip(logical_axes, shape))
        return partition_spec(logical_axes, sizes, self.rules, self.axis_sizes)

    def sharding(self, logical_axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """`x` with a sharding constraint for its logical axes (inside jit: a hint to
        the partitioner; outside: a reshard)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes, x.shape))


def check_mesh(mesh: Mesh) -> None:
    """Refuses meshes with axis names the rules do not know."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    unknown = [name for name in mesh.axis_names if name not in MESH_AXES]
    if unknown:
        raise ValueError(
            f"Mesh axis names {unknown} are not known; name mesh axes from {list(MESH_AXES)} "
            "(for example jax.make_mesh((4, 2), ('data', 'tensor')))."
        )


# ---------------------------------------------------------------- logical axes

# Every module that holds arrays declares their logical axes beside them: it extends
# `AbstractHasArrayAxes` (eqx_models.axes) and implements `array_axes()`, field name
# -> axes of one array as the module would hold it alone (one layer, one expert). A
# field declared with `stacked_field(axis)` holds modules built by `eqx.filter_vmap`,
# whose arrays all carry a leading `axis` (the decoder's `layers`, an MoE block's
# `experts`).
STACKED_AXIS = "eqx_models_stacked_axis"


def stacked_field(axis: str, **kwargs):
    """A dataclass field whose arrays (at any depth) carry a leading `axis`.

    Args:
        axis: the logical name of the stacked axis (`"layers"`, `"experts"`).
        **kwargs: passed on to `eqx.field`.

    Returns:
        The field.
    """
    return eqx.field(metadata={STACKED_AXIS: axis}, **kwargs)


def _is_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _array_like(x) -> bool:
    return eqx.is_array(x) or _is_shape(x)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _declared_axes(node, leading: tuple[str, ...], path: tuple, found: dict) -> None:
    """Fills `found[path] = axes` for every array under `node`."""
    if isinstance(node, eqx.Module):
        own = node.array_axes() if isinstance(node, AbstractHasArrayAxes) else {}
        for field in dataclasses.fields(node):
            if field.metadata.get("static"):
                continue
            value = getattr(node, field.name, None)
            here = path + (jax.tree_util.GetAttrKey(field.name),)
            if field.name in own and value is not None:
                axes = leading + tuple(own[field.name])
                if not _array_like(value) or len(value.shape) != len(axes):
                    raise ValueError(
                        f"{_path_name(here)} has shape {getattr(value, 'shape', None)} but its logical axes are "
                        f"{axes}; fix {type(node).__name__}.array_axes()."
                    )
                found[here] = axes
            else:
                extra = (field.metadata[STACKED_AXIS],) if STACKED_AXIS in field.metadata else ()
                _declared_axes(value, leading + extra, here, found)
        return
    if _array_like(node):
        raise ValueError(
            f"No logical axes declared for the array at {_path_name(path)} (shape {node.shape}); the module that "
            "holds it should extend AbstractHasArrayAxes (eqx_models.axes) and declare them in its array_axes()."
        )
    if isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            _declared_axes(child, leading, path + (jax.tree_util.SequenceKey(i),), found)
    elif isinstance(node, dict):
        for key, child in node.items():
            _declared_axes(child, leading, path + (jax.tree_util.DictKey(key),), found)


def logical_axes(tree) -> object:
    """A pytree like `tree` (a model or a cache) with each array replaced by the
    tuple of its logical axis names, as the modules holding them declare.

    Raises:
        ValueError: an array whose module declares no axes for it, or declares a
            different number of axes than it has.
    """
    found: dict = {}
    _declared_axes(tree, (), (), found)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: found[tuple(path)] if _array_like(leaf) else leaf, tree, is_leaf=_is_shape
    )


def head_counts(config) -> tuple[tuple[str, int], ...]:
    return (("heads", config.num_attention_heads), ("kv_heads", config.cache_layout().kv_heads))


def placement_for(config, mesh: Mesh, sharding=None) -> Placement:
    """The `Placement` of a model with `config` on `mesh` under `sharding` (a preset
    name, a mapping of logical to mesh axes, or `ShardingRules`; default rules if None)."""
    check_mesh(mesh)
    # The model leaves the layout of intermediate values to the partitioner (Auto
    # axes); `jax.make_mesh` makes Explicit axes by default, which would require a
    # sharding for every operation's output.
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Placement(auto, resolve_rules(sharding), head_counts(config))


def partition_specs(tree, placement: Placement):
    """The `PartitionSpec` of every array (or shape) of a model or cache (None for
    other leaves).

    A quantized weight's integers, scales and biases split alike, by the count of
    groups along the input: a device's share of the input axis then holds whole
    groups (a split the groups do not divide is not made), and each integer sits
    beside its scale.
    """

    def spec(leaf, names):
        if isinstance(leaf, QuantizedWeight):
            # A head axis splits by whole heads, and here by whole groups too.
            by_heads = placement.spec(names.scales, leaf.scales.shape)
            by_groups = partition_spec(names.scales, leaf.scales.shape, placement.rules, placement.axis_sizes)
            both = [a if a == _entry(by_groups, i) else None for i, a in enumerate(by_heads)]
            while both and both[-1] is None:
                both.pop()
            return jax.tree.map(lambda _: PartitionSpec(*both), leaf)
        return placement.spec(names, leaf.shape) if _array_like(leaf) else None

    is_leaf = lambda x: _is_shape(x) or isinstance(x, QuantizedWeight)
    return jax.tree.map(spec, tree, logical_axes(tree), is_leaf=is_leaf)


def _entry(spec: PartitionSpec, axis: int):
    return spec[axis] if axis < len(spec) else None


def shardings(tree, placement: Placement):
    """`NamedSharding` for every array (or shape) of a model or cache."""
    named = lambda spec: NamedSharding(placement.mesh, spec)
    return jax.tree.map(lambda s: None if s is None else named(s), partition_specs(tree, placement),
                        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))


def shard_model(model, mesh: Mesh, sharding=None):
    """Places every parameter of a loaded model on `mesh` by the rules.

    Args:
        model: a `CausalLM` (on one device, or already placed).
        mesh: a `jax.sharding.Mesh` with axes named from `data`, `fsdp`, `tensor`,
            `expert`.
        sharding: a preset name, a mapping of logical axes to mesh axes, or
            `ShardingRules`; None means the default rules for the mesh's axes.

    Returns:
        The model with its arrays on their shards. It keeps its placement, so its
        calls, `init_cache` and `generate` run split over the mesh.
    """
    placement = placement_for(model.config, mesh, sharding)
    model = relayout(model, "rows")  # split weights take XLA's path, which reads rows
    params, static = eqx.partition(model, eqx.is_array)
    placed = jax.tree.map(jax.device_put, params, shardings(params, placement))
    return eqx.combine(placed, static).with_placement(placement)


def constrain_cache(cache, placement: Placement):
    """A cache with each array constrained to its sharding."""
    return jax.tree.map(
        lambda leaf, names: placement.constrain(leaf, names) if eqx.is_array(leaf) else leaf,
        cache,
        logical_axes(cache),
    )


# ------------------------------------------------ the placement while tracing

_ACTIVE: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("eqx_models_placement", default=None)


@contextlib.contextmanager
def active(placement: Placement | None) -> Iterator[None]:
    """Makes `placement` the one blocks see (`current()`) while the model is traced."""
    token = _ACTIVE.set(placement)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> Placement | None:
    """The placement of the model being traced, or None on one device."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """`x` constrained to its logical axes under the current placement (as is without one)."""
    placement = current()
    return x if placement is None else placement.constrain(x, logical_axes)


def spans_devices() -> bool:
    """Whether the model being traced is laid out over more than one device (the
    single-device CPU kernels then give way to XLA, which the partitioner splits)."""
    placement = current()
    return placement is not None and placement.num_devices > 1


# ------------------------------------------------------------- memory plans


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` split by `spec`."""
    out = list(shape)
    for i, axes in enumerate(spec):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        out[i] //= math.prod(axis_sizes[a] for a in axes)
    return tuple(out)


def per_device_bytes(tree, placement: Placement) -> int:
    """Bytes each device holds of `tree`'s arrays (or shapes) under `placement`."""

    def nbytes(leaf, spec):
        if not _array_like(leaf):
            return 0
        return math.prod(shard_shape(leaf.shape, spec, placement.axis_sizes)) * np.dtype(leaf.dtype).itemsize

    specs = partition_specs(tree, placement)
    return sum(jax.tree.leaves(jax.tree.map(nbytes, tree, specs, is_leaf=_is_shape)))


def parse_mesh_shape(text: str) -> dict[str, int]:
    """`"tensor=4,expert=2"` -> `{"tensor": 4, "expert": 2}` (the CLI's `--mesh`)."""
    shape = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1 or name in shape:
            raise ValueError(
                f"Bad mesh axis {part!r} in {text!r}: write AXIS=SIZE pairs separated by commas, "
                f"AXIS one of {list(MESH_AXES)} (each once), SIZE a positive integer, e.g. tensor=4,expert=2."
            )
        shape[name] = int(size)
    if not shape:
        raise ValueError(f"No mesh axes in {text!r}; write e.g. tensor=4,expert=2.")
    return shape


def device_mesh(shape: dict[str, int]) -> Mesh:
    """A mesh of this process's devices with `shape`'s axes (the CLI's `--mesh`);
    refuses a shape whose sizes do not multiply to the device count."""
    devices = jax.devices()
    if math.prod(shape.values()) != len(devices):
        sizes = " x ".join(f"{name}={size}" for name, size in shape.items())
        raise ValueError(f"The mesh {sizes} has {math.prod(shape.values())} devices but {len(devices)} are here "
                         f"({devices[0].platform}); give sizes that multiply to {len(devices)}.")
    return jax.make_mesh(tuple(shape.values()), tuple(shape))
