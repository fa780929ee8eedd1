"""CPU kernels for decode, compiled on first use and called through XLA's FFI.

Both read one layer of a stacked array in place, given the stack and the layer
index. Under `jax.lax.scan` over stacked layers XLA:CPU copies a dynamically
sliced operand before its `dot` (and, written as a reduction instead, fuses
element-wise producers into the loop and recomputes them per weight), so a decode
step otherwise moves each layer's weights and cache slice two or three times.

- `stacked_matvecs(x, stacks, layer)`: `x @ stack[layer].T` for a few rows of `x`
  and one or more stacks (`stacked_matvec` for one); bfloat16 rows against
  bfloat16 weights on a CPU with AMX (`bf16_tiles_available()`) for a prompt's
  rows too, on the tiles (amx.h).
- `decode_attention(...)`: one new token per row attending to a layer of the
  KV cache and to its own key/value; `paged_decode_attention(...)` the same over
  a pool of pages reached through per-row block tables.
- `write_slots(buffer, update, start)`: the cache write of a step, in place for
  every dtype (XLA:CPU widens a bfloat16 update to float32 and rewrites the
  whole buffer); `write_pages(pool, update, slots)` for a paged pool.
- `delta_rule_step(...)`: one token of the gated delta rule (Gated DeltaNet) per
  row, updating a pool of recurrent states in place.
- `headwise_matvec(...)`: per-head products with a layer's rows of a stacked
  weight (Multi-head Latent Attention's absorbed expansions at decode).
- `quantized_matvecs(x, stacks, layer)`: `stacked_matvecs` for group-quantized
  int8 / int4 weights, widened in registers (no float copy of any weight); with
  AVX-512 VNNI (`quantized_tiles_available()`) also the product for a prompt's rows.
- `greedy_rows(logits)`: the argmax of each row (first position of the largest
  value, or of the first NaN), two passes over a row XLA:CPU took 250 us to reduce.
- `index_layer`, `take_rows`, `gather_pages`: a layer of a stack, rows of a table,
  a layer's KV pages, 16-bit floats copied as raw bytes (XLA:CPU would copy or
  widen the whole array).

The C++ source ships with the package. Each group of kernels (`UNITS`: the
products, decode attention for one cache dtype, the cache writes, ...) is its own
library, compiled the first time a model on the CPU backend needs it (once per
source, jaxlib and compiler, into `$EQX_MODELS_CACHE`, default
`~/.cache/eqx_models`), the units a decode step needs in parallel, with a line on
stderr while they compile. Without a C++ compiler, or with `EQX_MODELS_KERNELS=0`,
everything falls back to plain XLA (same numbers to rounding, slower decode);
`kernels_status()` says which path is active. On other backends nothing is
compiled and the XLA path is used. The kernels split their work over one thread
per core the process may use (`EQX_MODELS_KERNEL_THREADS` overrides).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
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
from jaxtyping import Array, Bool, Float, Int, Shaped

from ..quantization import dequantize, quantize_activations, tile_scales_to_rows, tiles_to_rows
from ..sharding import spans_devices

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


def _slice(stack: Array, layer: Array) -> Array:
    return jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(jnp.float32)


def _reference(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    x = x.astype(jnp.float32)
    return tuple(jnp.einsum("...i,oi->...o", x, _slice(stack, layer)) for stack in stacks)


def _kernel(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    shapes = tuple(jax.ShapeDtypeStruct(x.shape[:-1] + stack.shape[1:2], jnp.float32) for stack in stacks)
    call = jax.ffi.ffi_call(MATVEC_TARGET, shapes, vmap_method="sequential")
    return tuple(call(x, layer.astype(jnp.int32).reshape(()), *stacks))


@jax.custom_jvp
def _matvecs(x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]:
    # A model's products come with decode attention over a cache of (by default)
    # the weights' dtype: the longest build, started now.
    ahead = [unit] if (unit := _attention_unit(stacks[0])) else []
    return _dispatch("matvec", _kernel, _reference, x, stacks, layer, ahead=ahead)


@_matvecs.defjvp
def _matvecs_jvp(primals, tangents):
    x, stacks, layer = primals
    x_dot, stacks_dot, _ = tangents
    outs = _matvecs(x, stacks, layer)
    x, x_dot = x.astype(jnp.float32), x_dot.astype(jnp.float32)
    outs_dot = tuple(
        jnp.einsum("...i,oi->...o", x_dot, _slice(stack, layer))
        + jnp.einsum("...i,oi->...o", x, _slice(stack_dot, layer))
        for stack, stack_dot in zip(stacks, stacks_dot)
    )
    return outs, outs_dot


def stacked_matvecs(
    x: Float[Array, "*rows in"], stacks: Sequence[Float[Array, "layers _ in"]], layer: Int[Array, ""]
) -> tuple[Float[Array, "*rows _"], ...]:
    """`x @ stack[layer].T` in float32 for each stack, reading the layer's slices in place.

    Meant for a few rows (decode), or a prompt's rows of bfloat16 against bfloat16
    weights where `bf16_tiles_available()`. The stacks share `x` and one dtype (float32 or
    bfloat16); on the CPU with the kernels built they go as one custom call, so
    projections of the same input (q/k/v, gate/up) stream their weights as one
    job. Elsewhere each is the XLA `dot` of its slice. Differentiable (the
    derivative uses the XLA form).
    """
    stacks = tuple(stacks)
    if len({stack.dtype for stack in stacks}) != 1:
        raise ValueError(f"stacked_matvecs: the stacks must share one dtype, got {[s.dtype for s in stacks]}.")
    # bfloat16 activations go to the kernel as they are (see matvec.cc).
    keep = x.dtype == jnp.bfloat16 and stacks[0].dtype == jnp.bfloat16
    return _matvecs(x if keep else x.astype(jnp.float32), stacks, layer)


def stacked_matvec(
    x: Float[Array, "*rows in"], stack: Float[Array, "layers out in"], layer: Int[Array, ""]
) -> Float[Array, "*rows out"]:
    """`x @ stack[layer].T` in float32, reading the layer's slice of `stack` in place.

    Meant for a few rows (decode), or a prompt's bfloat16 rows against a bfloat16
    stack where `bf16_tiles_available()`; `stack` may be float32 or bfloat16. On the CPU
    with the kernels built this is one custom call; elsewhere it is the XLA
    `dot` of the slice. Differentiable (the derivative uses the XLA form).
    """
    return stacked_matvecs(x, (stack,), layer)[0]


def _no_sinks(query: Array) -> Array:
    return jnp.full(query.shape[1:3], -jnp.inf, jnp.float32)


def _no_scales() -> Array:
    return jnp.zeros((0,), jnp.float32)


def _checked_scales(keys: Array, values: Array, key_scales, value_scales) -> tuple[Array, Array]:
    """The scales to pass (empty for a float cache), or a ValueError when they do not go with the dtypes."""
    if (keys.dtype == jnp.int8) != (key_scales is not None) or (values.dtype == jnp.int8) != (
        value_scales is not None
    ):
        raise ValueError("decode_attention: int8 key/value stacks need their scales, and only they take scales.")
    return (_no_scales() if key_scales is None else key_scales, _no_scales() if value_scales is None else value_scales)


def _layer_rows(stack: Array, scales: Array, layer: Array) -> Array:
    """`stack[layer]` in float32, times its per-row `scales[layer]` when they are given."""
    rows = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(jnp.float32)
    if scales.size:
        rows = rows * jax.lax.dynamic_index_in_dim(scales, layer, keepdims=False)[..., None]
    return rows


def _attention_reference(
    query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales, value_scales,
    scale,
):
    value_dim = new_value.shape[-1]
    keys = _layer_rows(key_stack, key_scales, layer)
    values = _layer_rows(value_stack, value_scales, layer)[..., :value_dim]
    keys = jnp.concatenate([keys, new_key[:, :, None]], axis=2)
    values = jnp.concatenate([values, new_value[:, :, None]], axis=2)
    allowed = jnp.concatenate([valid, self_valid[:, None]], axis=1)
    allowed = allowed | ~jnp.any(allowed, axis=1, keepdims=True)  # nothing allowed: average all
    scores = scale * jnp.einsum("bkgd,bksd->bkgs", query, keys)
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    # The sink joins each row's softmax as one more logit, without a value.
    sink_column = jnp.broadcast_to(sinks[None, :, :, None], (*scores.shape[:3], 1))
    weights = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkgs,bksd->bkgd", weights, values)


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


def decode_attention(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_stack: Shaped[Array, "layers batch kv_heads kv_seq head_dim"],
    value_stack: Shaped[Array, "layers batch kv_heads kv_seq value_width"],
    layer: Int[Array, ""],
    valid: Bool[Array, "batch kv_seq"],
    self_valid: Bool[Array, " batch"],
    new_key: Float[Array, "batch kv_heads head_dim"],
    new_value: Float[Array, "batch kv_heads value_dim"],
    scale: float,
    sinks: Float[Array, "kv_heads groups"] | None = None,
    key_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None,
    value_scales: Float[Array, "layers batch kv_heads kv_seq"] | None = None,
) -> Float[Array, "batch kv_heads groups value_dim"]:
    """Softmax attention of one new token per row, float32.

    Each row's `groups` query heads per key/value head attend to the slots of
    `key_stack[layer]`/`value_stack[layer]` where `valid`, and to the token's own
    `new_key`/`new_value` where `self_valid`; a row with nothing allowed averages
    every slot (its output is padding). A value is the first `value_dim` channels
    of its row of `value_stack` (`value_stack` may be `key_stack` itself: values
    that are a prefix of the keys, as in Multi-head Latent Attention). `sinks`
    are per-head logits that join the softmax without a value. The stacks may be
    float32, bfloat16 or int8; int8 stacks come with `key_scales` / `value_scales`,
    one float32 per slot row (a key is `key_stack[..., s, :] * key_scales[..., s]`),
    widened in registers. Inference only: no derivative is defined.
    """
    sinks = _no_sinks(query) if sinks is None else sinks.astype(jnp.float32)
    key_scales, value_scales = _checked_scales(key_stack, value_stack, key_scales, value_scales)
    args = (query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales,
            value_scales)
    reference = functools.partial(_attention_reference, scale=scale)
    if (unit := _attention_unit(key_stack)) is None or value_stack.dtype != key_stack.dtype:
        return reference(*args)
    return _dispatch(unit, functools.partial(_attention_kernel, scale=scale), reference, *args)


def _as_bits(x: Array) -> Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _from_bits(x: Array, dtype) -> Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _rows_kernel(table: Array, layer: Array, ids: Array) -> Array:
    """`table[layer, ids]` for a `[layers, rows, ...]` table, copied by the kernel."""
    out = jax.ShapeDtypeStruct((*ids.shape, *table.shape[2:]), table.dtype)
    call = jax.ffi.ffi_call(TAKE_ROWS_TARGET, out, vmap_method="sequential")
    return call(table, layer.astype(jnp.int32).reshape(()), ids.astype(jnp.int32))


def _rows_reference(table: Array, layer: Array, ids: Array) -> Array:
    # As 16-bit integers: XLA:CPU would widen the whole table to float32 first.
    return _from_bits(_as_bits(table)[layer, jnp.clip(ids, 0, table.shape[1] - 1)], table.dtype)


def _take(table: Array, layer: Array, ids: Array) -> Array:
    """`table[layer, ids]` (ids clamped to the rows). For 16-bit floats on the CPU the
    kernel copies just the rows: given the bits as integers, XLA:CPU still copied the
    whole table (hoisted out of the layer loop, for a weight stack) on every call."""
    if table.dtype.itemsize == 2 and table.shape[1] > 0:
        return _dispatch("gather", _rows_kernel, _rows_reference, table, layer, ids)
    return _rows_reference(table, layer, ids)


def _greedy_reference(logits: Array) -> Array:
    # Two plain reductions: XLA:CPU's argmax is one reduction over (value, index)
    # pairs that it does not vectorise (0.67 ms over 151,936 logits against 0.14 ms
    # this way on a 2-core AMD EPYC).
    top = jnp.max(logits, axis=-1, keepdims=True)
    positions = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first = (logits == top) | jnp.isnan(logits)  # a NaN is the max (NumPy's rule); it equals nothing
    return jnp.min(jnp.where(first, positions, logits.shape[-1]), axis=-1)


def _greedy_kernel(logits: Array) -> Array:
    out = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call(GREEDY_TARGET, out, vmap_method="expand_dims")(logits)


def greedy_rows(logits: Float[Array, "*batch vocab"]) -> Int[Array, " *batch"]:
    """`jnp.argmax(logits, axis=-1)` as int32: the first position of each row's
    largest value, or of its first NaN. Not differentiable (an index)."""
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] == 0:
        raise ValueError("greedy_rows: the logits have an empty last axis; there is no token to pick.")
    return _dispatch("greedy", _greedy_kernel, _greedy_reference, logits)


@jax.custom_jvp
def index_layer(stack: Shaped[Array, "layers *rest"], index: Int[Array, ""]) -> Shaped[Array, "*rest"]:
    """`stack[index]`, 16-bit floats copied as raw bytes (see `_take`): XLA:CPU
    otherwise widens the whole stack to float32 in front of the layer loop (every
    layer, on every call). Differentiable: the tangent is the same slice of the
    stack's tangent."""
    return _take(stack[None], jnp.int32(0), jnp.reshape(index, (1,)))[0]


@index_layer.defjvp
def _index_layer_jvp(primals, tangents):
    stack, index = primals
    return index_layer(stack, index), jax.lax.dynamic_index_in_dim(tangents[0], index, keepdims=False)


@jax.custom_jvp
def take_rows(table: Shaped[Array, "rows *rest"], ids: Int[Array, "*batch"]) -> Shaped[Array, "*batch *rest"]:
    """`table[ids]` (ids clamped to the rows), 16-bit floats copied as raw bytes (XLA:CPU
    would widen the whole table to float32 first: 622 MB for Qwen3's embedding, every
    prompt). Differentiable like `jnp.take`."""
    return _take(table[None], jnp.int32(0), ids)


@take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    table, ids = primals
    return take_rows(table, ids), jnp.take(tangents[0], ids, axis=0, mode="clip")


def gather_pages(
    pool: Shaped[Array, "layers pages kv_heads page_size head_dim"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch pages_per_row"],
) -> Shaped[Array, "batch kv_heads kv_seq head_dim"]:
    """One layer's pages of each row, laid end to end: slot `s` of row `b` is
    `pool[layer, block_tables[b, s // page_size], :, s % page_size]`."""
    pages = _take(pool, layer, block_tables)  # one gather: the layer is never copied whole
    batch, per_row, kv_heads, page_size, head_dim = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, per_row * page_size, head_dim)


def _gathered_scales(scales: Array, layer: Array, block_tables: Array) -> Array:
    if not scales.size:
        return scales
    return gather_pages(scales[..., None], layer, block_tables)[None, ..., 0]


def _paged_attention_reference(
    query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
    value_scales, scale,
):
    keys = gather_pages(key_pool, layer, block_tables)[None]
    values = gather_pages(value_pool, layer, block_tables)[None]
    return _attention_reference(
        query, keys, values, jnp.int32(0), valid, self_valid, new_key, new_value, sinks,
        _gathered_scales(key_scales, layer, block_tables), _gathered_scales(value_scales, layer, block_tables), scale,
    )


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


def paged_decode_attention(
    query: Float[Array, "batch kv_heads groups head_dim"],
    key_pool: Shaped[Array, "layers pages kv_heads page_size head_dim"],
    value_pool: Shaped[Array, "layers pages kv_heads page_size value_width"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "batch pages_per_row"],
    valid: Bool[Array, "batch kv_seq"],
    self_valid: Bool[Array, " batch"],
    new_key: Float[Array, "batch kv_heads head_dim"],
    new_value: Float[Array, "batch kv_heads value_dim"],
    scale: float,
    sinks: Float[Array, "kv_heads groups"] | None = None,
    key_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
    value_scales: Float[Array, "layers pages kv_heads page_size"] | None = None,
) -> Float[Array, "batch kv_heads groups value_dim"]:
    """`decode_attention` over a paged pool: row `b`'s slot `s` (of
    `kv_seq = pages_per_row * page_size`) is in page `block_tables[b, s // page_size]`.
    The pages (and an int8 pool's scales, laid out like them) are read in place;
    every table entry must name a page of the pool."""
    sinks = _no_sinks(query) if sinks is None else sinks.astype(jnp.float32)
    key_scales, value_scales = _checked_scales(key_pool, value_pool, key_scales, value_scales)
    args = (query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks, key_scales,
            value_scales)
    reference = functools.partial(_paged_attention_reference, scale=scale)
    if (unit := _attention_unit(key_pool)) is None or value_pool.dtype != key_pool.dtype:
        return reference(*args)
    return _dispatch(unit, functools.partial(_paged_attention_kernel, scale=scale), reference, *args)


def _write_pages_reference(pool: Array, update: Array, slots: Array) -> Array:
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype.itemsize == 2 else a
    page_size = pool.shape[3]
    # -1 (padding) becomes a page past the end, which the scatter drops.
    pages = jnp.where(slots < 0, pool.shape[1], slots // page_size)
    by_token = bits(update).transpose(1, 3, 0, 2, *range(4, update.ndim))
    written = bits(pool).at[:, pages, :, slots % page_size].set(by_token, mode="drop")
    return jax.lax.bitcast_convert_type(written, pool.dtype) if pool.dtype.itemsize == 2 else written


def _write_pages_kernel(pool: Array, update: Array, slots: Array) -> Array:
    call = jax.ffi.ffi_call(
        WRITE_PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(pool, update, slots.astype(jnp.int32))


def write_pages(
    pool: Shaped[Array, "layers pages kv_heads page_size *head_dim"],
    update: Shaped[Array, "layers batch kv_heads new *head_dim"],
    slots: Int[Array, "batch new"],
) -> Shaped[Array, "layers pages kv_heads page_size *head_dim"]:
    """`pool` with token `t` of row `b` written at slot `slots[b, t]` (page * page_size
    + offset) of every layer; -1 writes nothing. In place when the pool is donated.
    The last axis may be absent (one item per slot: an int8 cache's scales)."""
    # A cache written is a cache attended to: its attention library is built meanwhile.
    ahead = [unit] if (unit := _attention_unit(pool)) else []
    return _dispatch("cache_write", _write_pages_kernel, _write_pages_reference, pool, update.astype(pool.dtype),
                     slots, ahead=ahead)


def _write_reference(buffer: Array, update: Array, start: Array, wrap: bool) -> Array:
    # On the raw 16-bit patterns: no float arithmetic for XLA to widen.
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype.itemsize == 2 else a
    if wrap:
        slots = (start + jnp.arange(update.shape[3])) % buffer.shape[3]
        written = bits(buffer).at[:, :, :, slots].set(bits(update))
    else:
        written = jax.lax.dynamic_update_slice(bits(buffer), bits(update), (0, 0, 0, start, 0)[: buffer.ndim])
    return jax.lax.bitcast_convert_type(written, buffer.dtype) if buffer.dtype.itemsize == 2 else written


def _write_kernel(buffer: Array, update: Array, start: Array, wrap: bool) -> Array:
    call = jax.ffi.ffi_call(
        WRITE_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype), input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(buffer, update, start.astype(jnp.int32).reshape(()), wrap=np.int32(wrap))


def write_slots(
    buffer: Shaped[Array, "layers batch kv_heads kv_seq *head_dim"],
    update: Shaped[Array, "layers batch kv_heads new *head_dim"],
    start: Int[Array, ""],
    *,
    wrap: bool = False,
) -> Shaped[Array, "layers batch kv_heads kv_seq *head_dim"]:
    """`buffer` with `update` written at slot `start` of axis 3 (in place when donated).
    The last axis may be absent (one item per slot: an int8 cache's scales).

    With `wrap` the buffer is a ring: slots past the end continue at slot 0 (the
    update must not be longer than the buffer). Otherwise the caller checks that
    the slots fit; the kernel refuses to write past the end.
    """
    # A cache written is a cache attended to: its attention library is built meanwhile.
    ahead = [unit] if (unit := _attention_unit(buffer)) else []
    return _dispatch(
        "cache_write",
        functools.partial(_write_kernel, wrap=wrap),
        functools.partial(_write_reference, wrap=wrap),
        buffer, update.astype(buffer.dtype), start, ahead=ahead,
    )


def delta_rule_token(
    state: Float[Array, "batch heads key_dim value_dim"],
    q: Float[Array, "batch heads key_dim"],
    k: Float[Array, "batch heads key_dim"],
    v: Float[Array, "batch heads value_dim"],
    g: Float[Array, "batch heads"],
    beta: Float[Array, "batch heads"],
) -> tuple[Float[Array, "batch heads key_dim value_dim"], Float[Array, "batch heads value_dim"]]:
    """One token of the gated delta rule in XLA (what `delta_rule_step` computes):
    `S = exp(g) S`, `S += k (beta (v - S^T k))^T`; returns the new `S` and `S^T q`."""
    state = state * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q)


def _delta_rule_reference(pool, layer, slots, fresh, q, k, v, g, beta, member):
    s = jnp.where(fresh[:, None, None, None], 0.0, pool[layer, slots, member])
    s, out = delta_rule_token(s, q, k, v, g, beta)
    return out, pool.at[layer, slots, member].set(s)


def _delta_rule_kernel(pool, layer, slots, fresh, q, k, v, g, beta, member):
    shapes = (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, jnp.float32))
    call = jax.ffi.ffi_call(DELTA_RULE_TARGET, shapes, input_output_aliases={0: 1}, vmap_method="sequential")
    return tuple(call(pool, layer.astype(jnp.int32).reshape(()), slots.astype(jnp.int32), fresh, q, k, v, g, beta,
                      member=np.int32(member)))


def delta_rule_step(
    pool: Float[Array, "layers slots members heads key_dim value_dim"],
    layer: Int[Array, ""],
    member: int,
    slots: Int[Array, " batch"],
    fresh: Bool[Array, " batch"],
    q: Float[Array, "batch heads key_dim"],
    k: Float[Array, "batch heads key_dim"],
    v: Float[Array, "batch heads value_dim"],
    g: Float[Array, "batch heads"],
    beta: Float[Array, "batch heads"],
) -> tuple[Float[Array, "batch heads value_dim"], Float[Array, "layers slots members heads key_dim value_dim"]]:
    """One token per row of the gated delta rule, on float32 states kept in a pool.

    Row `b` reads and writes `pool[layer, slots[b], member]` (zeros first where
    `fresh[b]`): `S = exp(g) S`, `S += k (beta (v - S^T k))^T`, and returns
    `S^T q` with the pool updated (in place when donated or carried: the CPU
    kernel writes the states where they lie; elsewhere XLA's gather and scatter).
    """
    args = (pool, layer, slots, fresh, q, k, v, g, beta)
    return _dispatch(
        "delta_rule", functools.partial(_delta_rule_kernel, member=member),
        functools.partial(_delta_rule_reference, member=member), *args,
    )


def _head_rows(stack: Array, layer: Array, heads: int, row_start: int, rows: int) -> Array:
    per_head = stack.shape[1] // heads
    weight = _slice(stack, layer).reshape(heads, per_head, stack.shape[2])
    return weight[:, row_start : row_start + rows]


def _headwise_reference(x, stack, layer, heads, row_start, rows, transpose):
    weight = _head_rows(stack, layer, heads, row_start, rows)
    return jnp.einsum("bho,hoi->bhi" if transpose else "bhi,hoi->bho", x, weight)


def _headwise_kernel(x, stack, layer, heads, row_start, rows, transpose):
    width = stack.shape[2] if transpose else rows
    call = jax.ffi.ffi_call(HEADWISE_TARGET, jax.ShapeDtypeStruct((*x.shape[:2], width), jnp.float32),
                            vmap_method="sequential")
    return call(x, stack, layer.astype(jnp.int32).reshape(()), heads=np.int32(heads), row_start=np.int32(row_start),
                rows=np.int32(rows), transpose=np.int32(transpose))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6))
def _headwise(x, stack, layer, heads, row_start, rows, transpose):
    kernel = functools.partial(_headwise_kernel, heads=heads, row_start=row_start, rows=rows, transpose=transpose)
    reference = functools.partial(
        _headwise_reference, heads=heads, row_start=row_start, rows=rows, transpose=transpose
    )
    return _dispatch("headwise", kernel, reference, x, stack, layer)


@_headwise.defjvp
def _headwise_jvp(heads, row_start, rows, transpose, primals, tangents):
    x, stack, layer = primals
    x_dot, stack_dot, _ = tangents
    out = _headwise(x, stack, layer, heads, row_start, rows, transpose)
    out_dot = _headwise_reference(x_dot, stack, layer, heads, row_start, rows, transpose) + _headwise_reference(
        x, stack_dot, layer, heads, row_start, rows, transpose
    )
    return out, out_dot


def headwise_matvec(
    x: Float[Array, "batch heads n"],
    stack: Float[Array, "layers heads_rows width"],
    layer: Int[Array, ""],
    *,
    heads: int,
    row_start: int,
    rows: int,
    transpose: bool,
) -> Float[Array, "batch heads m"]:
    """Per-head products with rows `[row_start, row_start + rows)` of each head's
    group in `stack[layer]` (`[heads * per_head, width]`), float32.

    `transpose=False`: `out[b, h] = W_h @ x[b, h]` (`x` has `width` channels, the
    output `rows`); `transpose=True`: `out[b, h] = x[b, h] @ W_h` (`x` has `rows`,
    the output `width`). On the CPU with the kernels built the layer's rows are read
    in place; elsewhere the XLA `einsum` of the slice. Differentiable (the
    derivative uses the XLA form).
    """
    return _headwise(x.astype(jnp.float32), stack, layer, heads, row_start, rows, bool(transpose))


def _layer_of(array, layer: Array):
    return None if array is None else jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)


def _layer_integers(stack, layer: Array) -> Array:
    """The layer's integers in the rows layout."""
    packed = _layer_of(stack.packed, layer)
    return tiles_to_rows(packed) if stack.layout == "tiles" else packed


def _layer_scales(stack, scales, layer: Array) -> Array:
    """The layer's slice of `scales` (the stack's, or a tangent of them) in the rows layout."""
    scales = _layer_of(scales, layer)
    return tile_scales_to_rows(scales) if stack.layout == "tiles" else scales


def _quantized_slice(stack, layer: Array) -> Array:
    return dequantize(_layer_integers(stack, layer), _layer_scales(stack, stack.scales, layer), stack.bits,
                      stack.group_size, biases=_layer_of(stack.biases, layer))


def _quantized_reference(x, stacks, layer):
    x = quantize_activations(x) if stacks[0].activations == "int8" else x
    return tuple(jnp.einsum("...i,oi->...o", x, _quantized_slice(stack, layer)) for stack in stacks)


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
        return _quantized_reference(x, stacks, layer)
    if any(s.biases is not None and s.biases.dtype != s.scales.dtype for s in stacks):
        return _quantized_reference(x, stacks, layer)
    if stacks[0].layout == "tiles" and not (quantized_tiles_available() and stacks[0].activations == "int8"):
        # the kernel reads tiles with VNNI and int8 activations only
        return _quantized_reference(x, stacks, layer)
    return _dispatch("quantized", _quantized_kernel, _quantized_reference, x, stacks, layer)


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
            out_dot = out_dot + jnp.einsum("...i,oi->...o", x_dot, _quantized_slice(stack, layer))
        scales_dot, biases_dot = stack_dot.scales, stack_dot.biases
        if not (_is_zero(scales_dot) and _is_zero(biases_dot)):
            # Linear in the scales and biases: the integers over the scales' tangent plus the biases'.
            if _is_zero(scales_dot):
                scales_dot = jnp.zeros(stack.scales.shape, stack.scales.dtype)
            if stack.biases is None:
                biases_dot = None
            elif _is_zero(biases_dot):
                biases_dot = jnp.zeros(stack.biases.shape, stack.biases.dtype)
            weight_dot = dequantize(_layer_integers(stack, layer), _layer_scales(stack, scales_dot, layer), stack.bits,
                                    stack.group_size, biases=_layer_of(biases_dot, layer))
            out_dot = out_dot + jnp.einsum("...i,oi->...o", x_seen, weight_dot)
        outs_dot.append(out_dot)
    return outs, tuple(outs_dot)


_quantized_matvecs.defjvp(_quantized_matvecs_jvp, symbolic_zeros=True)


def quantized_matvecs(
    x: Float[Array, "*rows in"], stacks: Sequence, layer: Int[Array, ""]
) -> tuple[Float[Array, "*rows _"], ...]:
    """`x @ dequantize(stack[layer]).T` in float32 for each `QuantizedWeight` stack
    (`[layers, out, ...]`), reading the layer's integers and scales in place; with
    int8 activations `x` is `quantize_activations(x)` first.

    The stacks share `x`, `bits`, `group_size` and `activations`. On the CPU with the kernels built
    they go as one custom call that widens the integers in registers; elsewhere
    each is the XLA `dot` of the dequantized slice. Differentiable in `x` and the
    scales (the derivative uses the XLA form).
    """
    stacks = tuple(stacks)
    formats = [(s.bits, s.group_size, s.activations, s.mode) for s in stacks]
    if len(set(formats)) != 1:
        raise ValueError(
            f"quantized_matvecs: the stacks must share bits, group_size, activations and mode, got {formats}."
        )
    return _quantized_matvecs(x.astype(jnp.float32), stacks, layer)
