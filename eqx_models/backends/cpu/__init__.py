"""The CPU backend: C++ kernels for decode, compiled on first use and called
through XLA's FFI (`Cpu`, the ops of `eqx_models.ops` as this machine runs them).

The kernels read one layer of a stacked array in place, given the stack and the
layer index. Under `jax.lax.scan` over stacked layers XLA:CPU copies a dynamically
sliced operand before its `dot` (and, written as a reduction instead, fuses
element-wise producers into the loop and recomputes them per weight), so a decode
step otherwise moves each layer's weights and cache slice two or three times.

- the stacked-layer product (`ops.stacked_matvecs`): `x @ stack[layer].T` for a
  few rows and one or more stacks; bfloat16 rows against bfloat16 weights on a
  CPU with AMX (`bf16_tiles_available()`) for a prompt's rows too, on the tiles
  (amx.h); group-quantized int8 / int4 weights widened in registers
  (`ops.quantized_matvecs`), with AVX-512 VNNI (`quantized_tiles_available()`)
  also for a prompt's rows.
- one new token per row attending to a layer of the KV cache and to its own
  key/value (`ops.decode_attention`), and the same over a pool of pages.
- the cache write of a step, in place for every dtype (XLA:CPU widens a bfloat16
  update to float32 and rewrites the whole buffer), dense or paged.
- one token of the gated delta rule (Gated DeltaNet) per row, updating a pool of
  recurrent states in place; per-head products with a layer's rows of a stacked
  weight (Multi-head Latent Attention's absorbed expansions at decode).
- the greedy pick (argmax of each row: two passes over a row XLA:CPU took 250 us
  to reduce); a layer of a stack, rows of a table, a layer's KV pages, 16-bit
  floats copied as raw bytes (XLA:CPU would copy or widen the whole array).

The C++ source ships with the package. Each group of kernels (`UNITS`: the
products, decode attention for one cache dtype, the cache writes, ...) is its own
library, compiled the first time a model on the CPU backend needs it (once per
source, jaxlib and compiler, into `$EQX_MODELS_CACHE`, default
`~/.cache/eqx_models`), the units a decode step needs in parallel, with a line on
stderr while they compile. Without a C++ compiler, or with `EQX_MODELS_KERNELS=0`,
everything falls back to the reference ops (`eqx_models.backends.xla`: same
numbers to rounding, slower decode); `kernels_status()` says which path is active.
Nothing here is compiled or loaded unless JAX's default backend is the CPU. The
kernels split their work over one thread per core the process may use
(`EQX_MODELS_KERNEL_THREADS` overrides).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ...quantized import QuantizedWeight, dequantize, quantize_activations
from ...sharding import spans_devices
from .. import xla
from ..base import Backend

MATVEC_TARGET = "eqx_models_stacked_matvec"
ATTENTION_TARGET = "eqx_models_decode_attention"
WRITE_TARGET = "eqx_models_write_slots"
PAGED_ATTENTION_TARGET = "eqx_models_paged_decode_attention"
WRITE_PAGES_TARGET = "eqx_models_write_pages"
DELTA_RULE_TARGET = "eqx_models_delta_rule_step"
HEADWISE_TARGET = "eqx_models_headwise_matvec"
QUANTIZED_TARGET = "eqx_models_quantized_matvec"
TAKE_ROWS_TARGET = "eqx_models_take_rows"
GREEDY_TARGET = "eqx_models_greedy_rows"
COMPILE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One library of kernels: a source file, the preprocessor names it is built
    with, and the FFI targets it registers as `(target, exported handler)` pairs."""

    source: str
    targets: tuple[tuple[str, str], ...]
    defines: tuple[str, ...] = ()


# The cache dtypes decode attention is built for, each its own library (with the
# paged form): one model reads one of them.
ATTENTION_DTYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "S8"}

# Each unit is built the first time a model on the CPU backend needs one of its
# kernels, so a float32 model never waits for the int8 or Gated DeltaNet kernels.
UNITS = {
    "matvec": Unit("matvec.cc", ((MATVEC_TARGET, "EqxStackedMatvec"),)),
    **{
        f"attention_{dtype}": Unit(
            "attention.cc",
            ((f"{ATTENTION_TARGET}_{dtype}", "EqxDecodeAttention"),
             (f"{PAGED_ATTENTION_TARGET}_{dtype}", "EqxPagedDecodeAttention")),
            (f"-DEQX_MODELS_CACHE_{code}",),
        )
        for dtype, code in ATTENTION_DTYPES.items()
    },
    "cache_write": Unit("cache_write.cc", ((WRITE_TARGET, "EqxWriteSlots"), (WRITE_PAGES_TARGET, "EqxWritePages"))),
    "greedy": Unit("greedy.cc", ((GREEDY_TARGET, "EqxGreedyRows"),)),
    "gather": Unit("gather.cc", ((TAKE_ROWS_TARGET, "EqxTakeRows"),)),
    "quantized": Unit("quantized.cc", ((QUANTIZED_TARGET, "EqxQuantizedMatvec"),)),
    "delta_rule": Unit("delta_rule.cc", ((DELTA_RULE_TARGET, "EqxDeltaRuleStep"),)),
    "headwise": Unit("headwise.cc", ((HEADWISE_TARGET, "EqxHeadwiseMatvec"),)),
}
# Started beside the first unit a process asks for: what every decode step runs.
DECODE_UNITS = ("matvec", "cache_write", "greedy")
SOURCES = tuple(sorted({Path(__file__).with_name(unit.source) for unit in UNITS.values()}))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("amx.h", "bfloat16.h", "parallel_for.h", "prefetch.h"))


def _cache_dir() -> Path:
    root = os.environ.get("EQX_MODELS_CACHE") or Path.home() / ".cache" / "eqx_models"
    return Path(root) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _library_path(name: str, compiler: str) -> Path:
    """Where unit `name`'s library lives: named by its source, the headers, the
    flags, jaxlib and the compiler, so a change to any of them builds it anew."""
    unit = UNITS[name]
    source = Path(__file__).with_name(unit.source).read_bytes() + b"".join(path.read_bytes() for path in HEADERS)
    recipe = " ".join((jax.__version__, compiler, *COMPILE_FLAGS, *unit.defines)).encode()
    stamp = hashlib.sha256(source + recipe).hexdigest()[:16]
    return _cache_dir() / f"libeqx_models_{name}-{stamp}.so"


def _build(name: str, compiler: str) -> Path:
    """Compiles unit `name` unless its library exists."""
    library = _library_path(name, compiler)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    unit = UNITS[name]
    # Build next to the destination and rename: concurrent first uses never see a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name
        command = [compiler, *COMPILE_FLAGS, *unit.defines, f"-I{jax.ffi.include_dir()}",
                   str(Path(__file__).with_name(unit.source)), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode > 0 and "amx" in result.stderr.lower():  # a compiler or assembler without AMX
            command.insert(1, "-DEQX_MODELS_NO_AMX")
            result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the {name} kernels failed:\n{' '.join(command)}\n{result.stderr[-4000:]}")
        os.replace(partial, library)
    return library


@functools.cache
def _unavailable() -> str | None:
    """Why the kernels cannot be used in this process at all, or None."""
    if os.environ.get("EQX_MODELS_KERNELS", "1") == "0":
        return "disabled by EQX_MODELS_KERNELS=0"
    if jax.default_backend() != "cpu":
        return f"they are CPU kernels and the default backend is {jax.default_backend()}"
    if _compiler() is None:
        return "no C++ compiler found (set CXX)"
    return None


_libraries: dict[str, ctypes.CDLL] = {}
_builds: dict[str, concurrent.futures.Future] = {}
_builds_lock = threading.Lock()


@functools.cache
def _build_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="eqx-cc")


def _register(name: str, path: Path) -> None:
    """Loads unit `name`'s library and registers its FFI targets; on the thread that
    traces (XLA's handler registry may not be safe to write while it compiles)."""
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in UNITS[name].targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    _libraries[name] = library


def _start(names: Sequence[str]) -> None:
    """Starts building the units `names` not started yet (at once where their
    library is cached), one compiler per core; says so on stderr where any must
    be compiled (a first use on this machine). A process that exits meanwhile
    waits for the compilers it started."""
    with _builds_lock:
        fresh = [name for name in dict.fromkeys(names) if name not in _builds]
        compiling = [name for name in fresh if not _library_path(name, _compiler()).exists()]
        if compiling:
            print(
                f"eqx_models: compiling the CPU kernels {', '.join(compiling)} for this machine (once; cached in "
                f"{_cache_dir()}; EQX_MODELS_KERNELS=0 runs without them)...",
                file=sys.stderr, flush=True,
            )
        for name in fresh:
            _builds[name] = _build_pool().submit(_build, name, _compiler())


def _unit_status(name: str, ahead: Sequence[str] = ()) -> str | None:
    """Loads unit `name` (starting `ahead` and the decode units beside it) and
    returns None, or why its kernels are not used."""
    reason = _unavailable()
    if reason is not None:
        return reason
    _start((name, *ahead, *DECODE_UNITS))  # the units asked for first: they take the free cores
    error = _builds[name].exception()
    if error is None and name not in _libraries:
        try:
            with _builds_lock:
                if name not in _libraries:
                    _register(name, _builds[name].result())
        except OSError as failure:  # a library that does not load
            error = failure
    if error is None:
        return None
    if not isinstance(error, (OSError, RuntimeError)):
        raise error
    _warn_once(name, str(error))
    return str(error)


@functools.cache
def _warn_once(name: str, reason: str) -> None:
    warnings.warn(f"eqx_models: CPU kernels {name} unavailable, using plain XLA ({reason})", stacklevel=4)


def kernels_status() -> str:
    """`"ready"`, or the reason the CPU kernels are not used. Builds every kernel
    library this machine lacks (in parallel), which models otherwise build one at
    a time, the first time they need it."""
    if (reason := _unavailable()) is not None:
        return reason
    _start(tuple(UNITS))
    for name in UNITS:
        if (reason := _unit_status(name)) is not None:
            return f"{name}: {reason}"
    return "ready"


def kernels_available() -> bool:
    """Whether the compiled kernels are used: the CPU backend with a compiler (and
    `EQX_MODELS_KERNELS` not 0), and the model being traced on one device (the
    kernels are single-device; on a mesh XLA's own operations run and the SPMD
    partitioner splits them). Nothing is compiled to answer this."""
    return _unavailable() is None and not spans_devices()


def quantized_tiles_available() -> bool:
    """Whether `quantized_matvecs` should take many rows (a prompt) too: the CPU
    backend with the kernels available, on a CPU with AVX-512 VNNI, where 16
    weight rows at a time meet the rows in integer products (measured faster than
    XLA's dot of the dequantized weight on 2 cores)."""
    return (kernels_available() and _unit_status("quantized") is None
            and bool(_libraries["quantized"].EqxQuantizedTiles()))


def bf16_tiles_available() -> bool:
    """Whether `stacked_matvecs` should take many rows (a prompt) of bfloat16
    activations against bfloat16 weights too: the CPU backend with the kernels
    available, on a CPU with AMX (bfloat16 tiles) that the OS lets this process
    use. `EQX_MODELS_AMX=0` turns it off."""
    return kernels_available() and _unit_status("matvec") is None and _bf16_tiles_granted()


@functools.cache
def _bf16_tiles_granted() -> bool:
    # Asked for on the first bfloat16 product, not when the library loads: once
    # granted, the AMX state enlarges every signal frame of the process (and Linux
    # then refuses smaller alternate signal stacks). A CPU without AMX is answered
    # without asking.
    return bool(_libraries["matvec"].EqxBf16Tiles())


def _dispatch(unit: str, kernel, reference, *args, ahead: Sequence[str] = ()):
    """`kernel(*args)` when lowering for the CPU with unit `unit` built, else
    `reference(*args)`. `ahead`: units the model will want next, built meanwhile."""
    if not kernels_available() or _unit_status(unit, ahead) is not None:
        return reference(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=reference)


def _attention_unit(cache: Array) -> str | None:
    """The attention library for a cache of this dtype, or None where none is built."""
    return f"attention_{cache.dtype.name}" if cache.dtype.name in ATTENTION_DTYPES else None


def _bits(a: Array) -> Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype.itemsize == 2 else a


def _in_bits(reference):
    """`reference(array, *rest)` on the raw patterns of 16-bit floats (and of any
    16-bit float among `rest`): XLA:CPU widens a bfloat16 gather or update to
    float32 and rewrites the whole buffer. (Elsewhere the bitcast itself costs a
    copy: the TPU copied a whole bfloat16 cache before its in-place update.)"""

    def run(array: Array, *rest, **keywords):
        if array.dtype.itemsize != 2:
            return reference(array, *rest, **keywords)
        rest = [_bits(a) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating) else a for a in rest]
        return jax.lax.bitcast_convert_type(reference(_bits(array), *rest, **keywords), array.dtype)

    return run


_take_reference = _in_bits(xla.take)
_write_slots_reference = _in_bits(xla.write_slots)
_write_pages_reference = _in_bits(xla.write_pages)


def _matvec_kernel(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    shapes = tuple(jax.ShapeDtypeStruct(x.shape[:-1] + stack.shape[1:2], jnp.float32) for stack in stacks)
    call = jax.ffi.ffi_call(MATVEC_TARGET, shapes, vmap_method="sequential")
    return tuple(call(x, layer.astype(jnp.int32).reshape(()), *stacks))


@jax.custom_jvp
def _matvecs(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    # A model's products come with decode attention over a cache of (by default)
    # the weights' dtype: the longest build, started now.
    ahead = [unit] if (unit := _attention_unit(stacks[0])) else []
    return _dispatch("matvec", _matvec_kernel, xla.stacked_matvecs, x, stacks, layer, ahead=ahead)


@_matvecs.defjvp
def _matvecs_jvp(primals, tangents):
    x, stacks, layer = primals
    x_dot, stacks_dot, _ = tangents
    outs = _matvecs(x, stacks, layer)
    x, x_dot = x.astype(jnp.float32), x_dot.astype(jnp.float32)
    outs_dot = tuple(
        jnp.einsum("...i,oi->...o", x_dot, xla.float_layer(stack, layer))
        + jnp.einsum("...i,oi->...o", x, xla.float_layer(stack_dot, layer))
        for stack, stack_dot in zip(stacks, stacks_dot)
    )
    return outs, outs_dot


def _attention_kernel(
    query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales, value_scales,
    scale,
):
    out = jax.ShapeDtypeStruct((*query.shape[:3], new_value.shape[-1]), jnp.float32)
    call = jax.ffi.ffi_call(f"{ATTENTION_TARGET}_{key_stack.dtype.name}", out, vmap_method="sequential")
    return call(
        query, key_stack, value_stack, layer.astype(jnp.int32).reshape(()), valid, self_valid, new_key, new_value,
        sinks, key_scales, value_scales, scale=np.float32(scale),
    )


def _decode_attention(query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales,
                      value_scales, scale):
    args = (query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales,
            value_scales)
    reference = functools.partial(xla.decode_attention, scale=scale)
    if (unit := _attention_unit(key_stack)) is None or value_stack.dtype != key_stack.dtype:
        return reference(*args)
    return _dispatch(unit, functools.partial(_attention_kernel, scale=scale), reference, *args)


def _rows_kernel(table: Array, layer: Array, ids: Array) -> Array:
    """`table[layer, ids]` for a `[layers, rows, ...]` table, copied by the kernel."""
    out = jax.ShapeDtypeStruct((*ids.shape, *table.shape[2:]), table.dtype)
    call = jax.ffi.ffi_call(TAKE_ROWS_TARGET, out, vmap_method="sequential")
    return call(table, layer.astype(jnp.int32).reshape(()), ids.astype(jnp.int32))


def _take(table: Array, layer: Array, ids: Array) -> Array:
    """`table[layer, ids]` (ids clamped to the rows). For 16-bit floats on the CPU the
    kernel copies just the rows: given the bits as integers, XLA:CPU still copied the
    whole table (hoisted out of the layer loop, for a weight stack) on every call."""
    if table.dtype.itemsize == 2 and table.shape[1] > 0:
        return _dispatch("gather", _rows_kernel, _take_reference, table, layer, ids)
    return _take_reference(table, layer, ids)


def _greedy_kernel(logits: Array) -> Array:
    out = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call(GREEDY_TARGET, out, vmap_method="expand_dims")(logits)


@jax.custom_jvp
def _index_layer(stack: Array, index: Array) -> Array:
    # 16-bit floats copied as raw bytes (see `_take`): XLA:CPU otherwise widens the
    # whole stack to float32 in front of the layer loop (every layer, every call).
    return _take(stack[None], jnp.int32(0), jnp.reshape(index, (1,)))[0]


@_index_layer.defjvp
def _index_layer_jvp(primals, tangents):
    stack, index = primals
    return _index_layer(stack, index), jax.lax.dynamic_index_in_dim(tangents[0], index, keepdims=False)


@jax.custom_jvp
def _take_rows(table: Array, ids: Array) -> Array:
    # As `_index_layer`: XLA:CPU would widen the whole table to float32 first (622 MB
    # for Qwen3's embedding, every prompt).
    return _take(table[None], jnp.int32(0), ids)


@_take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    table, ids = primals
    return _take_rows(table, ids), jnp.take(tangents[0], ids, axis=0, mode="clip")


def _gather_pages(pool: Array, layer: Array, block_tables: Array) -> Array:
    return xla.end_to_end(_take(pool, layer, block_tables))  # one gather: the layer is never copied whole


def _paged_attention_reference(
    query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
    value_scales, scale,
):
    keys = _gather_pages(key_pool, layer, block_tables)[None]
    values = _gather_pages(value_pool, layer, block_tables)[None]
    scales = lambda s: xla.gathered_scales(s, layer, block_tables, _gather_pages)
    return xla.decode_attention(query, keys, values, jnp.int32(0), valid, self_valid, new_key, new_value, sinks,
                                scales(key_scales), scales(value_scales), scale)


def _paged_attention_kernel(
    query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
    value_scales, scale,
):
    out = jax.ShapeDtypeStruct((*query.shape[:3], new_value.shape[-1]), jnp.float32)
    call = jax.ffi.ffi_call(f"{PAGED_ATTENTION_TARGET}_{key_pool.dtype.name}", out, vmap_method="sequential")
    return call(
        query, key_pool, value_pool, layer.astype(jnp.int32).reshape(()), block_tables.astype(jnp.int32), valid,
        self_valid, new_key, new_value, sinks, key_scales, value_scales, scale=np.float32(scale),
    )


def _paged_decode_attention(query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value,
                            sinks, key_scales, value_scales, scale):
    args = (query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
            value_scales)
    reference = functools.partial(_paged_attention_reference, scale=scale)
    if (unit := _attention_unit(key_pool)) is None or value_pool.dtype != key_pool.dtype:
        return reference(*args)
    return _dispatch(unit, functools.partial(_paged_attention_kernel, scale=scale), reference, *args)


def _write_pages_kernel(pool: Array, update: Array, slots: Array) -> Array:
    call = jax.ffi.ffi_call(
        WRITE_PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(pool, update, slots.astype(jnp.int32))


def _write_kernel(buffer: Array, update: Array, start: Array, wrap: bool) -> Array:
    call = jax.ffi.ffi_call(
        WRITE_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype), input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(buffer, update, start.astype(jnp.int32).reshape(()), wrap=np.int32(wrap))


def _delta_rule_kernel(pool, layer, slots, fresh, q, k, v, g, beta, member):
    shapes = (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, jnp.float32))
    call = jax.ffi.ffi_call(DELTA_RULE_TARGET, shapes, input_output_aliases={0: 1}, vmap_method="sequential")
    return tuple(call(pool, layer.astype(jnp.int32).reshape(()), slots.astype(jnp.int32), fresh, q, k, v, g, beta,
                      member=np.int32(member)))


def _headwise_kernel(x, stack, layer, heads, row_start, rows, transpose):
    width = stack.shape[2] if transpose else rows
    call = jax.ffi.ffi_call(HEADWISE_TARGET, jax.ShapeDtypeStruct((*x.shape[:2], width), jnp.float32),
                            vmap_method="sequential")
    return call(x, stack, layer.astype(jnp.int32).reshape(()), heads=np.int32(heads), row_start=np.int32(row_start),
                rows=np.int32(rows), transpose=np.int32(transpose))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6))
def _headwise(x, stack, layer, heads, row_start, rows, transpose):
    shape = dict(heads=heads, row_start=row_start, rows=rows, transpose=transpose)
    return _dispatch("headwise", functools.partial(_headwise_kernel, **shape),
                     functools.partial(xla.headwise_matvec, **shape), x, stack, layer)


@_headwise.defjvp
def _headwise_jvp(heads, row_start, rows, transpose, primals, tangents):
    x, stack, layer = primals
    x_dot, stack_dot, _ = tangents
    out = _headwise(x, stack, layer, heads, row_start, rows, transpose)
    out_dot = xla.headwise_matvec(x_dot, stack, layer, heads, row_start, rows, transpose) + xla.headwise_matvec(
        x, stack_dot, layer, heads, row_start, rows, transpose
    )
    return out, out_dot


def _quantized_kernel(x, stacks, layer):
    bits, group, int8 = stacks[0].bits, stacks[0].group_size, stacks[0].activations == "int8"
    affine = stacks[0].biases is not None
    tiled = stacks[0].layout == "tiles"
    shapes = tuple(jax.ShapeDtypeStruct(x.shape[:-1] + s.shape[-2:-1], jnp.float32) for s in stacks)
    call = jax.ffi.ffi_call(QUANTIZED_TARGET, shapes, vmap_method="sequential")
    arrays = [a for s in stacks for a in ((s.packed, s.scales, s.biases) if affine else (s.packed, s.scales))]
    return tuple(call(x, layer.astype(jnp.int32).reshape(()), *arrays, bits=np.int32(bits), group=np.int32(group),
                      int8_activations=np.int32(int8), affine=np.int32(affine), tiled=np.int32(tiled)))


@jax.custom_jvp
def _quantized_matvecs(x, stacks, layer):
    if len({s.layout for s in stacks}) > 1:  # one call reads one layout
        by_layout = {layout: [i for i, s in enumerate(stacks) if s.layout == layout] for layout in ("rows", "tiles")}
        outs = [None] * len(stacks)
        for members in by_layout.values():
            for i, out in zip(members, _quantized_matvecs(x, tuple(stacks[i] for i in members), layer)):
                outs[i] = out
        return tuple(outs)
    if any(s.scales.dtype not in (jnp.float16, jnp.bfloat16) for s in stacks):  # the kernel reads 16-bit scales
        return xla.quantized_matvecs(x, stacks, layer)
    if any(s.biases is not None and s.biases.dtype != s.scales.dtype for s in stacks):
        return xla.quantized_matvecs(x, stacks, layer)
    if stacks[0].layout == "tiles" and not (quantized_tiles_available() and stacks[0].activations == "int8"):
        # the kernel reads tiles with VNNI and int8 activations only
        return xla.quantized_matvecs(x, stacks, layer)
    return _dispatch("quantized", _quantized_kernel, xla.quantized_matvecs, x, stacks, layer)


def _is_zero(tangent) -> bool:
    return tangent is None or isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def _quantized_matvecs_jvp(primals, tangents):
    x, stacks, layer = primals
    x_dot, stacks_dot, _ = tangents
    outs = _quantized_matvecs(x, stacks, layer)
    # The inputs' rounding (int8 activations) differentiates as the identity.
    x_seen = quantize_activations(x) if stacks[0].activations == "int8" else x
    outs_dot = []
    for out, stack, stack_dot in zip(outs, stacks, stacks_dot):
        # Terms whose tangent is a symbolic zero (a frozen base under QLoRA: its
        # scales; inputs that are not differentiated) are left out, not multiplied.
        out_dot = jnp.zeros(out.shape, out.dtype)
        if not _is_zero(x_dot):
            out_dot = out_dot + jnp.einsum("...i,oi->...o", x_dot, xla.quantized_layer(stack, layer))
        scales_dot, biases_dot = stack_dot.scales, stack_dot.biases
        if not (_is_zero(scales_dot) and _is_zero(biases_dot)):
            # Linear in the scales and biases: the integers over the scales' tangent plus the biases'.
            if _is_zero(scales_dot):
                scales_dot = jnp.zeros(stack.scales.shape, stack.scales.dtype)
            if stack.biases is None:
                biases_dot = None
            elif _is_zero(biases_dot):
                biases_dot = jnp.zeros(stack.biases.shape, stack.biases.dtype)
            weight_dot = dequantize(xla.layer_integers(stack, layer), xla.layer_scales(stack, scales_dot, layer),
                                    stack.bits, stack.group_size, biases=xla.layer_of(biases_dot, layer))
            out_dot = out_dot + jnp.einsum("...i,oi->...o", x_seen, weight_dot)
        outs_dot.append(out_dot)
    return outs, tuple(outs_dot)


_quantized_matvecs.defjvp(_quantized_matvecs_jvp, symbolic_zeros=True)


# Up to this many rows (batch x seq) a product with a layer's weight goes through
# the matrix-vector kernel, which reads each weight once for all rows; beyond,
# XLA's matmul reuses operands better and a slice copy is amortised over many rows.
# Quantized weights with int8 activations take the kernel at any row count where
# `quantized_tiles_available()` (AVX-512 VNNI): its integer tiles outrun the float
# matmul of the dequantized weight. So do bfloat16 rows against bfloat16 weights
# where `bf16_tiles_available()` (AMX): XLA:CPU widens them to float32 for its matmul.
MAX_KERNEL_ROWS = 16
# Widths the AMX tiles take: 32 inputs per tile row, 16 outputs per tile.
TILE_IN, TILE_OUT = 32, 16


def _bf16_tiles_fit(x: Array, stack: Array) -> bool:
    out, width = stack.shape[-2:]
    return x.dtype == jnp.bfloat16 and stack.dtype == jnp.bfloat16 and width % TILE_IN == 0 and out % TILE_OUT == 0


class Cpu(Backend):
    """The CPU: the C++ kernels above where they are built and fit, XLA otherwise."""

    name = "cpu"

    def reads_layers_in_place(self, x: Array, stack) -> bool:
        if isinstance(stack, QuantizedWeight):
            if stack.activations == "int8" and quantized_tiles_available():
                return True
        elif _bf16_tiles_fit(x, stack) and bf16_tiles_available():
            return True
        fits = isinstance(stack, QuantizedWeight) or stack.dtype in (jnp.float32, jnp.bfloat16)
        return math.prod(x.shape[:-1]) <= MAX_KERNEL_ROWS and fits and kernels_available()

    def headwise_in_place(self, rows: int, stack: Array) -> bool:
        # A few rows only: the headwise kernel has no tiles for a prompt's rows.
        return rows <= MAX_KERNEL_ROWS and stack.dtype in (jnp.float32, jnp.bfloat16) and kernels_available()

    def joins_products(self, x: Array) -> bool:
        # One matmul over the joined weights beats several smaller ones that XLA:CPU
        # runs side by side on the same cores (the copy is amortised over a prompt's rows).
        return True

    def attends_one_token(self, cache_dtype, softcap: float | None) -> bool:
        return softcap is None and jnp.dtype(cache_dtype).name in ATTENTION_DTYPES and kernels_available()

    def groups_experts(self, stack) -> bool:
        # XLA:CPU expands a ragged product into a masked product per group (the
        # experts' count times the work); blocks read each expert once.
        return False

    def decode_steps_per_call(self) -> int:
        return 1  # launching costs tens of microseconds next to steps of tens of milliseconds

    def prefers_quantized_tiles(self) -> bool:
        return quantized_tiles_available()

    def prefers_ragged_steps(self) -> bool:
        # Not yet: the ragged attention runs in XLA here (small products, a block
        # of queries at a time), and a step of Qwen3-0.6B-shaped prompt chunks took
        # longer than the calls by chunk length with their one dense product each
        # (benchmarks: serving throughput, CPU).
        return False

    @staticmethod
    def stacked_matvecs(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
        return _matvecs(x, stacks, layer)

    @staticmethod
    def quantized_matvecs(x: Array, stacks: tuple, layer: Array) -> tuple[Array, ...]:
        return _quantized_matvecs(x, stacks, layer)

    masked_attention = staticmethod(xla.masked_attention)
    causal_attention = staticmethod(xla.causal_attention)
    grouped_matmul = staticmethod(xla.grouped_matmul)
    decode_attention = staticmethod(_decode_attention)
    paged_decode_attention = staticmethod(_paged_decode_attention)
    ragged_paged_attention = staticmethod(
        functools.partial(xla.ragged_paged_attention, take=_take, decode=_paged_decode_attention))
    index_layer = staticmethod(_index_layer)
    take_rows = staticmethod(_take_rows)
    gather_pages = staticmethod(_gather_pages)

    @staticmethod
    def greedy_rows(logits: Array) -> Array:
        return _dispatch("greedy", _greedy_kernel, xla.greedy_rows, logits)

    @staticmethod
    def write_slots(buffer: Array, update: Array, start: Array, wrap: bool) -> Array:
        # A cache written is a cache attended to: its attention library is built meanwhile.
        ahead = [unit] if (unit := _attention_unit(buffer)) else []
        return _dispatch("cache_write", functools.partial(_write_kernel, wrap=wrap),
                         functools.partial(_write_slots_reference, wrap=wrap), buffer, update, start, ahead=ahead)

    @staticmethod
    def write_pages(pool: Array, update: Array, slots: Array) -> Array:
        ahead = [unit] if (unit := _attention_unit(pool)) else []
        return _dispatch("cache_write", _write_pages_kernel, _write_pages_reference, pool, update, slots, ahead=ahead)

    @staticmethod
    def delta_rule_step(pool, layer, slots, fresh, q, k, v, g, beta, member):
        return _dispatch("delta_rule", functools.partial(_delta_rule_kernel, member=member),
                         functools.partial(xla.delta_rule_step, member=member),
                         pool, layer, slots, fresh, q, k, v, g, beta)

    @staticmethod
    def headwise_matvec(x, stack, layer, heads, row_start, rows, transpose):
        return _headwise(x, stack, layer, heads, row_start, rows, transpose)
