"""`from_pretrained` / `save_pretrained`: Hugging Face checkpoints <-> stacked models."""

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .checkpoint import EXPERTS_COMPONENT, QUANTIZED_LEAVES, checkpoint_name, hf_tensor_names, leaf_name, to_jax
from .config import check_layer_count, load_json
from .device_memory import free_bytes, gib, refuse_unless_fits
from .gguf_file import find_gguf, load_gguf, split_parts
from .models import architecture_for
from .nn.causal_lm import CausalLM
from .quantization import QuantizationSpec, QuantizedWeight, quantize_weight, spec_for, spec_from_hf, spec_of
from .quantization import quantize as quantize_model
from .quantization import host_tiles, rows_to_tiles, scales_to_tiles, tiles_fit, tiles_pay, with_layout
from .safetensors_file import CheckpointError, TensorSource, aligned_empty, replacing, write_safetensors
from .sharding import ShardingRules, per_device_bytes, placement_for, shard_model, shardings

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
    "chat_template.json",
]
# Tensors some checkpoints carry that are derived, not learned.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"


def resolve_model_dir(name_or_path: str | os.PathLike, *, revision: str | None = None, allow_patterns=None) -> Path:
    """A local folder for `name_or_path`: the folder itself, or a hub snapshot.

    Hub ids go through `huggingface_hub.snapshot_download` (only `allow_patterns`),
    which uses the local cache and honours `HF_HUB_OFFLINE`.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the folder that holds config.json.")
    text = str(name_or_path)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text
    if looks_local:
        raise FileNotFoundError(f"No folder at {path}. Check the path, or pass a hub id like 'Qwen/Qwen3-0.6B'.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=allow_patterns))
    except HFValidationError as e:
        raise FileNotFoundError(f"{text!r} is neither a local folder nor a valid hub repo id ({e}).") from e
    except Exception as e:  # offline, not cached, no such repo, no network: all end here
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        hint = (
            "HF_HUB_OFFLINE is set and the repo is not in the local cache"
            if offline
            else "the hub could not be reached or has no such repo/revision"
        )
        raise FileNotFoundError(
            f"Could not load {text!r}: no local folder by that name, and {hint} "
            f"({type(e).__name__}: {e}). Pass an existing folder, or download the repo "
            "first with network access."
        ) from e


def _gguf_in(name_or_path: str | os.PathLike, gguf_file: str, revision: str | None) -> Path:
    """The GGUF file `gguf_file` of a hub repo or local folder, fetched with the
    other parts of its split if it has them."""
    parts = split_parts(Path(gguf_file))
    patterns = [gguf_file] if parts is None else [str(part) for part in parts]
    folder = resolve_model_dir(name_or_path, revision=revision, allow_patterns=patterns)
    path = folder / gguf_file
    if not path.is_file():
        listing = sorted(str(f.relative_to(folder)) for f in folder.rglob("*.gguf"))
        raise FileNotFoundError(
            f"{name_or_path!r} has no GGUF file {gguf_file!r}"
            + (f"; its GGUF files: {', '.join(listing)}." if listing else ".")
        )
    return path


def _checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `folder`: the shards its index
    names, or else every `*.safetensors` file in it."""
    index = folder / INDEX_FILE
    if index.exists():
        files = sorted({_shard_path(folder, index, f) for f in _weight_map(index).values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that are missing: {missing}. Re-download them.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"No *.safetensors files in {folder}. Only safetensors checkpoints are supported; "
            "convert .bin/.pt weights with transformers' save_pretrained(safe_serialization=True)."
        )
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a `model.safetensors.index.json`: tensor name -> shard file."""
    weight_map = load_json(index).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index} is malformed: it should be an object whose weight_map maps tensor names to shard file "
            "names (strings). Re-download it, or delete it to load every *.safetensors file in the folder."
        )
    return weight_map


def _shard_path(folder: Path, index: Path, name: str) -> Path:
    """The shard file `name` of the index, refused unless it names a file inside
    `folder`: an index is data, and must not make loading open files elsewhere.

    The check is on the name (no root or drive, no `..`), not on where the file
    resolves: a hub snapshot's files are links into the cache's blobs folder."""
    relative = Path(name)
    if not name or relative.anchor or ".." in relative.parts:
        raise CheckpointError(
            f"{index} names the shard file {name!r}, which is not a file inside the model folder {folder}; shard "
            "files are plain names inside it (model-00001-of-00002.safetensors). Re-download the index."
        )
    return folder / relative


def _dtype_fits(found: np.dtype, parameter: np.dtype) -> bool:
    """Whether a tensor of dtype `found` can fill a parameter of dtype `parameter`:
    a float parameter takes any float (it is cast), an integer one (a quantized
    weight's packed integers) only its own dtype. An integer tensor read into a
    float parameter would be converted number by number, not reinterpreted: a
    relabelled float tensor then loads as garbage of any size."""
    if jnp.issubdtype(parameter, jnp.floating):
        return bool(jnp.issubdtype(found, jnp.floating))
    return np.dtype(found) == np.dtype(parameter)


def _dtype_wanted(parameter: np.dtype) -> str:
    if jnp.issubdtype(parameter, jnp.floating):
        return f"a floating-point dtype (F32, F16, BF16 or F64) for a {np.dtype(parameter)} parameter"
    return f"{np.dtype(parameter)}, the dtype of its parameter"


def _transposed_in_checkpoint(name: str, tensor_shape: tuple[int, ...], fused_experts: bool) -> bool:
    """Whether the checkpoint holds this tensor `[experts, in, out]` where we hold
    `[experts, out, in]`: the expert weights of an architecture with `fused_experts`."""
    return fused_experts and f".{EXPERTS_COMPONENT}" in f".{name}" and len(tensor_shape) == 3


def _swap_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


def from_pretrained(
    name_or_path: str | os.PathLike,
    *,
    dtype=None,
    revision: str | None = None,
    scan_layers: bool = True,
    mesh: Mesh | None = None,
    sharding: "str | ShardingRules | Mapping | None" = None,
    map_weights: bool = True,
    quantize: "str | Mapping | QuantizationSpec | None" = None,
    gguf_file: str | None = None,
) -> CausalLM:
    """Loads a Hugging Face checkpoint into a stacked `CausalLM`.

    Args:
        name_or_path: a local folder (with `config.json` and safetensors), a hub
            repo id such as `"Qwen/Qwen3-0.6B"`, or a llama.cpp GGUF file (or a
            folder holding one and no `config.json`): config and weights come from
            the file, Q8_0 / Q4_0 weights stay packed (see `docs/loading.md`).
        dtype: dtype for the floating-point weights (`jnp.float32`, `"bfloat16"`, ...);
            None keeps the checkpoint's (for GGUF: float32, or bfloat16 when most
            weights are BF16 or K-quants).
        revision: hub branch, tag or commit.
        scan_layers: run the layers under `jax.lax.scan` (True) or unrolled (False).
        mesh: a `jax.sharding.Mesh` with axes named from `data`, `fsdp`, `tensor`,
            `expert`: each tensor goes straight onto its shards (each device's block
            read from the files on its own), and the model runs split over the mesh.
        sharding: with `mesh`, the rules: a preset name (`"default"`, `"dp"`,
            `"fsdp"`, `"tp"`, `"ep"`), a mapping of logical axes to mesh axes, or
            `ShardingRules`. None means the default rules for the mesh's axes.
        map_weights: on the CPU backend, map tensors that sit on page boundaries of
            their file and need no dtype change (checkpoints written by
            `save_pretrained`) instead of reading them: loading then costs no
            memory of the process's own, and pages are read from the file as they
            are first used. False reads every tensor into memory, for files that
            may change while the model is in use.
        quantize: `"int8"`, `"int4"` or `"int4-affine"` (or a mapping of `eqx_models.quantize`'s
            options): quantize the linear weights and the embedding table while
            loading, one tensor (or block of rows) at a time, so the float model
            is never held whole. A checkpoint written by `save_pretrained` from a
            quantized model loads quantized without this (its `quantization_config`
            says how).
        gguf_file: a GGUF file's name within the hub repo (or local folder)
            `name_or_path`, as transformers takes it: only that file is
            downloaded, or every part of a split one (`...-00001-of-0000N.gguf`).

    Returns:
        The `CausalLM`, its layers stacked along a leading axis.

    Raises:
        FileNotFoundError: no such folder, or a hub id that cannot be resolved
            (offline and not cached, no network, no such repo).
        ConfigError: a `model_type` or config keys this library does not implement,
            a config field of the wrong type or out of range, or more layers than
            the checkpoint has tensors.
        CheckpointError: missing, unexpected, wrongly shaped or wrongly typed
            tensors (all of them reported, by their HF names), malformed or
            unreadable safetensors files, or an index naming shards outside the
            folder.

    Tensors are read one at a time straight into the final stacked buffers, which
    the CPU backend adopts without a copy, so peak memory stays near the model's size.
    Mapped tensors are copy-on-write: nothing the model does writes to the file, but
    a file truncated or rewritten in place while mapped (not replaced, as
    `save_pretrained` does) changes or loses those weights.
    """
    if sharding is not None and mesh is None:
        raise ValueError("sharding= needs mesh=: pass the jax.sharding.Mesh to lay the model out on.")
    gguf_path = find_gguf(name_or_path) if gguf_file is None else _gguf_in(name_or_path, gguf_file, revision)
    if gguf_path is not None:
        return load_gguf(gguf_path, dtype=dtype, scan_layers=scan_layers, mesh=mesh, sharding=sharding,
                         quantize=quantize)
    folder = resolve_model_dir(name_or_path, revision=revision, allow_patterns=MODEL_FILES)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json; it is not a Hugging Face model folder.")
    hf_config = load_json(config_path)
    arch = architecture_for(hf_config)  # checks the common fields' types and ranges first
    saved = hf_config.pop("quantization_config", None)
    saved_spec = None if saved is None else spec_from_hf(saved, str(config_path))
    spec = None if quantize is None else spec_for(quantize)
    if saved_spec is not None and spec is not None:
        if (spec.bits, spec.group_size, spec.mode) != (saved_spec.bits, saved_spec.group_size, saved_spec.mode):
            raise ValueError(f"{folder} is already quantized ({saved_spec}); drop quantize= to load it as it is.")
        spec = None  # loaded as saved
    source = TensorSource(_checkpoint_files(folder))
    check_layer_count(hf_config, len(source.location), f"the checkpoint in {folder}")
    config = arch.config_from_hf(hf_config)
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0), scan_layers=scan_layers)
    placement = None if mesh is None else placement_for(config, mesh, sharding)
    target_dtype = None if dtype is None else jnp.dtype(dtype)
    float_dtype = target_dtype or _checkpoint_float_dtype(source, arch, hf_config, saved_spec is not None)
    if saved_spec is not None:  # the skeleton of the saved quantized model
        skeleton = _quantized_skeleton(skeleton, saved_spec, float_dtype)
    quantized_skeleton = None if spec is None else _quantized_skeleton(skeleton, spec, float_dtype)
    # int8 weights go into the CPU kernel's tiles as they load (see
    # `quantization.with_layout`): `tiled` holds the paths of those weights.
    final_skeleton = quantized_skeleton if quantized_skeleton is not None else skeleton
    tiled = _tiled_weight_paths(final_skeleton) if placement is None else set()
    tiled = tiled if tiled and tiles_pay() else set()  # asked only of quantized models: it builds their kernels
    if tiled:
        final_skeleton = eqx.filter_eval_shape(lambda m: with_layout(m, "tiles"), final_skeleton)

    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    plan = []
    problems = []
    consumed = set()
    targets = [None] * len(leaves) if placement is None else jax.tree.leaves(shardings(skeleton, placement))
    quantized_paths = set() if quantized_skeleton is None else _quantized_weight_paths(quantized_skeleton)
    for (path, leaf), target in zip(leaves, targets):
        ours = checkpoint_name(path)
        names, stacked = hf_tensor_names(ours, leaf.shape, arch.tensor_name, skeleton.model.substack_layers(),
                                   arch.fused_experts)
        expected = leaf.shape[len(stacked):]
        transposed = _transposed_in_checkpoint(ours, expected, arch.fused_experts)
        expected = _swap_last(expected) if transposed else expected
        for name in names:
            if name not in source.location:
                problems.append(f"missing tensor {name} (expected shape {tuple(expected)})")
            elif source.shape(name) != tuple(expected):
                problems.append(f"tensor {name} has shape {source.shape(name)}, expected {tuple(expected)}")
            elif not _dtype_fits(source.dtype(name), leaf.dtype):
                problems.append(f"tensor {name} has dtype {source.dtype(name)}, expected {_dtype_wanted(leaf.dtype)}")
        consumed.update(names)
        # Scales and integers keep their dtype; floats take `dtype`.
        leaf_dtype = None if leaf_name(path).endswith(tuple(QUANTIZED_LEAVES)) else target_dtype
        quantized = spec if tuple(path) in quantized_paths else None
        # In tiles: a weight quantized as it loads ("weight"), or a saved weight's
        # integers ("packed") or scales ("scales").
        part = getattr(path[-1], "name", None)
        tiles = "weight" if tuple(path) in tiled else part if part in _TILED and tuple(path[:-1]) in tiled else None
        plan.append((names, stacked, target, transposed, leaf_dtype, quantized, tiles))
    unexpected = sorted(
        n
        for n in set(source.location) - consumed
        if not n.endswith(IGNORED_TENSOR_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
        and not (arch.skips_tensor is not None and arch.skips_tensor(config, n))
    )
    problems += [f"unexpected tensor {n} (shape {source.shape(n)})" for n in unexpected]
    if problems:
        listing = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        raise CheckpointError(
            f"The checkpoint in {folder} does not match its config.json "
            f"(model_type {config.model_type!r}):\n  {listing}"
        )
    _refuse_weights_beyond_memory(final_skeleton, skeleton, float_dtype, placement, spec or saved_spec, folder)

    def load(entry):
        names, stacked, target, transposed, leaf_dtype, quantized, tiles = entry
        if quantized is not None:
            return _load_quantized_leaf(source, names, stacked, quantized, transposed, tiles == "weight")
        leaf = _load_leaf(source, names, stacked, leaf_dtype, target, map_weights and tiles is None, transposed)
        return _TILED[tiles](leaf) if tiles else leaf

    # Reading is copying from the page cache (or disk) in the kernel, outside the
    # GIL: one thread per core overlaps the copies and the page faults of new buffers.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        arrays = list(pool.map(load, plan))
    if quantized_skeleton is not None:
        loaded = {tuple(path): array for (path, _), array in zip(leaves, arrays)}
        q_leaves = jax.tree_util.tree_flatten_with_path(quantized_skeleton)[0]
        arrays = [loaded[tuple(path)] if tuple(path) in loaded else loaded[tuple(path[:-1])][_PART[path[-1].name]]
                  for path, _ in q_leaves]
    model = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(final_skeleton), arrays)
    if placement is not None and quantized_skeleton is not None:
        # Quantized in host memory a block of rows at a time, then split: each
        # device receives whole groups of its weights' share.
        return shard_model(model, mesh, sharding)
    return model if placement is None else model.with_placement(placement)


_PART = {"packed": 0, "scales": 1, "biases": 2}


def _quantized_skeleton(skeleton: CausalLM, spec: QuantizationSpec, float_dtype) -> CausalLM:
    """The shapes of `skeleton` quantized by `spec`, its floats in `float_dtype`."""
    as_float = lambda s: jax.ShapeDtypeStruct(s.shape, float_dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s
    floats = jax.tree.map(as_float, skeleton)
    return eqx.filter_eval_shape(lambda m: quantize_model(m, **spec.options(), layout="rows"), floats)


def _checkpoint_float_dtype(source: TensorSource, arch, hf_config: Mapping, saved_quantized: bool) -> np.dtype:
    """The dtype the checkpoint's float weights load in without `dtype=`: its
    embedding table's (a saved quantized model's `torch_dtype`)."""
    name = hf_tensor_names("model.embed_tokens.weight", (), arch.tensor_name, {})[0][0]
    if saved_quantized or name not in source.location:
        return jnp.dtype(hf_config.get("torch_dtype", "float32"))
    return np.dtype(source.dtype(name))


def _refuse_weights_beyond_memory(final: CausalLM, float_skeleton: CausalLM, float_dtype, placement, spec,
                                  folder) -> None:
    """Refuses (`OutOfDeviceMemory`) weights that the target accelerator has not
    the free memory for, before any is read, naming what would fit: int8 or
    bfloat16 weights, or more chips."""
    devices = [jax.devices()[0]] if placement is None else list(placement.mesh.devices.flat)

    def per_device(shapes, cast: bool) -> int:
        """Bytes per device; `cast`: the float leaves load in `float_dtype` (a
        quantized skeleton has its dtypes already)."""
        as_dtype = lambda s: jax.ShapeDtypeStruct(s.shape, float_dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s
        shapes = eqx.filter(shapes, lambda s: isinstance(s, jax.ShapeDtypeStruct))
        shapes = jax.tree.map(as_dtype, shapes) if cast else shapes
        if placement is not None:
            return per_device_bytes(shapes, placement)
        return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))

    free = free_bytes(devices)
    needed = per_device(final, cast=spec is None) if free is not None else 0
    if free is None or needed <= free[0]:
        return
    fixes = []
    if spec is None:
        # The estimate must not fail on widths the groups do not divide.
        int8_spec = dataclasses.replace(spec_for("int8"), keep_indivisible=True)
        int8 = per_device(_quantized_skeleton(float_skeleton, int8_spec, float_dtype), cast=False)
        fixes.append(f"quantize='int8' ({gib(int8)}{'' if int8 <= free[0] else ', still too large'})")
    if float_dtype == jnp.float32 and spec is None:
        fixes.append(f"dtype=jnp.bfloat16 (about {gib(needed / 2)})")
    fixes.append(f"a mesh of about {-(-needed * len(devices) // max(free[0], 1))} devices or more (mesh=...), "
                 "the weights split over them")
    what = f"The weights of {folder} ({len(devices)} device{'s' if len(devices) > 1 else ''}, {np.dtype(float_dtype).name})"
    refuse_unless_fits(what, needed, devices, fixes)


def _tiled_weight_paths(model: CausalLM) -> set[tuple]:
    """Paths of the quantized weights of `model` that fit the tiles layout."""
    is_quantized = lambda node: isinstance(node, QuantizedWeight)
    return {tuple(path) for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_quantized)[0]
            if is_quantized(node) and tiles_fit(node.bits, node.activations, node.shape)}


def _quantized_weight_paths(quantized: CausalLM) -> set[tuple]:
    """Paths (in the float model) of the weights that `quantized` holds quantized."""
    return {tuple(path[:-1]) for path, _ in jax.tree_util.tree_flatten_with_path(quantized)[0]
            if getattr(path[-1], "name", None) == "packed"}


# Rows of float32 quantized at a time while loading: what is held beside the
# quantized model, per loading thread.
QUANTIZE_CHUNK_BYTES = 16 << 20


@functools.cache
def _quantizer(spec: QuantizationSpec):
    options = dict(bits=spec.bits, group_size=spec.group_size, scale_dtype=jnp.dtype(spec.scale_dtype), mode=spec.mode)
    return jax.jit(lambda rows: (lambda q: (q.packed, q.scales, q.biases))(quantize_weight(rows, **options)))


def _load_quantized_leaf(
    source: TensorSource, names: list[str], stacked: tuple[int, ...], spec: QuantizationSpec, transposed: bool = False,
    tiles: bool = False,
):
    """Reads a float weight leaf a block of rows at a time and quantizes each
    block into the leaf's integers, scales and (affine) biases, returned in that
    order; with `tiles` the integers are rearranged into the tiles layout in
    place. A tensor holding several matrices (a layer's fused experts,
    `transposed` as `[experts, in, out]`) is read whole, one tensor at a time."""
    tensor_shape = source.shape(names[0])
    *inner, out_features, in_features = _swap_last(tensor_shape) if transposed else tensor_shape
    packed = aligned_empty((*stacked, *inner, out_features, in_features * spec.bits // 8),
                           np.dtype(np.int8 if spec.bits == 8 else np.uint8))
    per_group = lambda: aligned_empty((*stacked, *inner, out_features, in_features // spec.group_size),
                                      jnp.dtype(spec.scale_dtype))
    outputs = [packed, per_group()] + ([per_group()] if spec.mode == "affine" else [])
    parts = [out.reshape(-1, *out.shape[-2:]) for out in outputs]
    block = max(1, min(out_features, QUANTIZE_CHUNK_BYTES // (4 * in_features)))
    staging = np.zeros((block, in_features), np.float32)  # one compiled shape: the last block is padded
    quantizer = _quantizer(spec)

    def quantize_matrix(part: int, read_rows) -> None:
        for start in range(0, out_features, block):
            rows = range(start, min(out_features, start + block))
            read_rows(rows, staging[: len(rows)])
            for into, array in zip(parts, quantizer(staging)):
                into[part, start : rows.stop] = np.asarray(array)[: len(rows)]

    if not inner and not transposed:
        for i, name in enumerate(names):
            quantize_matrix(i, lambda rows, into: source.read_into(name, into, rows))
        if tiles:
            outputs[:2] = host_tiles(packed, outputs[1])
        return tuple(map(to_jax, outputs))
    whole = np.empty(tensor_shape, np.float32)
    for i, name in enumerate(names):
        source.read_into(name, whole)
        matrices = whole.reshape(-1, *tensor_shape[-2:])
        for j, matrix in enumerate(matrices):
            matrix = matrix.T if transposed else matrix
            quantize_matrix(i * len(matrices) + j, lambda rows, into: np.copyto(into, matrix[rows.start : rows.stop]))
    if tiles:
        outputs[:2] = host_tiles(packed, outputs[1])
    return tuple(map(to_jax, outputs))


# A saved quantized weight's arrays as the tiles layout holds them.
_TILED = {"packed": rows_to_tiles, "scales": scales_to_tiles}


def _load_leaf(
    source: TensorSource, names: list[str], stacked: tuple[int, ...], target_dtype, sharding=None, map_weights=False,
    transposed=False,
) -> jax.Array:
    """Reads one leaf (its per-layer / per-expert tensors stacked) into one final
    buffer, or with a `sharding`, each device's part of it into that device; maps
    the file's pages instead where `map_weights` and the layout allow. With
    `transposed` the file's tensors are `[..., in, out]` and are read whole, one at
    a time, and transposed into the leaf."""
    dtype = source.dtype(names[0])
    if target_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        dtype = np.dtype(target_dtype)
    shape = source.shape(names[0])
    if transposed:
        out = aligned_empty((*stacked, *_swap_last(shape)), dtype)
        parts = out.reshape(-1, *out.shape[len(stacked):])
        staging = np.empty(shape, source.dtype(names[0]))
        for i, name in enumerate(names):
            source.read_into(name, staging)
            parts[i] = np.swapaxes(staging, -1, -2)
        return to_jax(out) if sharding is None else jax.device_put(out, sharding)
    if sharding is not None:
        return _load_sharded_leaf(source, names, stacked, shape, dtype, sharding)
    if map_weights and dtype == source.dtype(names[0]) and jax.default_backend() == "cpu":
        mapped = source.map_stack(names)
        if mapped is not None:
            return to_jax(mapped.view(dtype).reshape(*stacked, *shape))
    out = aligned_empty((*stacked, *shape), dtype)
    parts = out.reshape(-1, *shape)  # a view: C order, as the names come
    for i, name in enumerate(names):
        source.read_into(name, parts[i])
    return to_jax(out)


def _load_sharded_leaf(source, names, stacked, shape, dtype, sharding) -> jax.Array:
    """Each addressable device's block of the stacked leaf, read from the files
    (only the layers, experts and rows the block covers) and put on its device
    before the next is read, so the host holds one block at a time; a block that
    several devices share is read once."""
    global_shape = (*stacked, *shape)
    targets = sharding.addressable_devices_indices_map(global_shape)
    ranges_of = {d: [range(*s.indices(size)) for s, size in zip(index, global_shape)] for d, index in targets.items()}
    key = lambda ranges: tuple((r.start, r.stop) for r in ranges)
    uses: dict[tuple, int] = {}
    for ranges in ranges_of.values():
        uses[key(ranges)] = uses.get(key(ranges), 0) + 1
    held: dict[tuple, np.ndarray] = {}
    pieces = []
    for device, ranges in ranges_of.items():
        k = key(ranges)
        if k not in held:
            out = np.empty([len(r) for r in ranges], dtype)
            per_tensor = out.reshape(-1, *out.shape[len(stacked):])
            for i, position in enumerate(itertools.product(*ranges[: len(stacked)])):
                name = names[int(np.ravel_multi_index(position, stacked))] if stacked else names[0]
                source.read_part_into(name, ranges[len(stacked):], per_tensor[i])
            held[k] = out
        pieces.append(jax.device_put(held[k], device))
        uses[k] -= 1
        if not uses[k]:
            del held[k]
    return jax.make_array_from_single_device_arrays(global_shape, sharding, pieces)


def _hf_tensors(model: CausalLM, arch) -> list[tuple[str, jax.Array, tuple[int, ...], bool]]:
    """`(hf_name, leaf, index into the leaf, transposed in the file)` for every weight,
    layers and experts unstacked."""
    out = []
    substacks = model.model.substack_layers()
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]:
        ours = checkpoint_name(path)
        names, stacked = hf_tensor_names(ours, leaf.shape, arch.tensor_name, substacks, arch.fused_experts)
        transposed = _transposed_in_checkpoint(ours, leaf.shape[len(stacked):], arch.fused_experts)
        out += [(hf, leaf, tuple(map(int, np.unravel_index(i, stacked))), transposed) for i, hf in enumerate(names)]
    return out


def save_pretrained(
    model: CausalLM, directory: str | os.PathLike, *, max_shard_size: int = 5 * 10**9, tokenizer=None
) -> None:
    """Writes `config.json` and safetensors in the Hugging Face layout.

    Checkpoints past `max_shard_size` bytes are split into
    `model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`,
    as `transformers` does; `transformers` and `from_pretrained` both load them.
    Only one shard is held on the host at a time. With `tokenizer` its files are
    written beside the weights, so `eqx-models generate FOLDER` runs on the folder.
    Every tensor that fills whole memory pages starts on a page boundary of its
    file, so `from_pretrained` maps such files rather than reading them.

    Into a folder that already holds a checkpoint, the new files are written
    beside the old ones (in a hidden staging folder, so the disk needs room for
    both) and renamed into place only once all are complete; then the old shards
    the new checkpoint does not use are removed. A write that fails (a full disk,
    an interrupted process) leaves the old checkpoint as it was.

    Args:
        model: a `CausalLM` without LoRA adapters (merge them first with
            `eqx_models.lora.merge_lora`).
        directory: the folder to write (created if needed; an earlier checkpoint
            in it is replaced once the new one is complete).
        max_shard_size: most bytes per safetensors file.
        tokenizer: an `eqx_models.Tokenizer` (from `load_tokenizer`), or anything
            with a `save_pretrained(folder)` (a `transformers` tokenizer), written
            after the weights; None writes no tokenizer.

    Returns:
        None.
    """
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer= takes an eqx_models.Tokenizer (load_tokenizer), got {type(tokenizer).__name__}.")
    if any("lora_" in leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]):
        raise ValueError(
            "The model carries LoRA adapters, which have no place in a transformers checkpoint: save "
            "eqx_models.lora.merge_lora(model), or the adapters alone with eqx_models.lora.save_adapters."
        )
    model = with_layout(model, "rows")  # the checkpoint layout, whatever the layout in memory
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    arch = architecture_for({"model_type": config.model_type})
    hf_config = arch.config_to_hf(config)
    hf_config["architectures"] = [arch.hf_class]
    hf_config["torch_dtype"] = jnp.dtype(model.dtype).name
    spec = spec_of(model)
    if spec is not None:  # read back by from_pretrained; transformers does not know this layout
        hf_config["quantization_config"] = spec.to_hf()

    shards: list[list[tuple[str, jax.Array, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for entry in _hf_tensors(model, arch):
        leaf, index = entry[1], entry[2]
        nbytes = leaf.nbytes // math.prod(leaf.shape[: len(index)])
        if shards[-1] and shard_bytes + nbytes > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
    file_names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    # Everything is written into a folder beside the old checkpoint and moved into
    # place only once complete: a failed write (a full disk) leaves the old one whole.
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
    try:
        weight_map = {}
        total = 0
        for file_name, shard in zip(file_names, shards):
            tensors = [
                (name, np.ascontiguousarray(np.swapaxes(np.asarray(leaf[index]), -1, -2)) if transposed
                 else np.asarray(leaf[index]))
                for name, leaf, index, transposed in shard
            ]
            write_safetensors(staging / file_name, tensors, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys((name for name, _ in tensors), file_name))
            total += sum(a.nbytes for _, a in tensors)
        _write_json(staging / "config.json", hf_config)
        if len(shards) > 1:
            _write_json(staging / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _move_into_place(staging, directory, file_names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


# The folder a save writes into before moving its files into place (hidden, so
# nothing that lists the model folder's files sees it).
STAGING_PREFIX = ".eqx_models-saving-"


def _write_json(path: Path, content: dict) -> None:
    with replacing(path) as f:
        f.write((json.dumps(content, indent=2) + "\n").encode())


def _move_into_place(staging: Path, directory: Path, weight_files: list[str]) -> None:
    """Moves a complete checkpoint from `staging` into `directory` (renames within
    one file system), then removes the old checkpoint's files it does not reuse.

    The weights go first, then `config.json`, then the index (or the old index
    goes), so the files a reader finds name only weights already in place; stale
    shards go last."""
    for name in [*weight_files, "config.json"]:
        os.replace(staging / name, directory / name)
    if (staging / INDEX_FILE).exists():
        os.replace(staging / INDEX_FILE, directory / INDEX_FILE)
    else:
        (directory / INDEX_FILE).unlink(missing_ok=True)
    for old in directory.glob("model*.safetensors"):
        if old.name not in weight_files:
            old.unlink()
    _sync_folder(directory)


def _sync_folder(directory: Path) -> None:
    """Makes the renames in `directory` durable (where the platform can open a
    folder to sync it)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
