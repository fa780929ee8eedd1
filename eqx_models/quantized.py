"""Weight-only quantization of linear layers: int8 and int4 in groups along the input.

Each group of `group_size` consecutive input weights of an output row shares one
scale, stored as float16 (llama.cpp's block shape at group 32: Q8_0 and Q4_0):

- int8: `w = q * scale`, `q` in [-127, 127], one signed byte per weight.
- int4: `w = (q - 8) * scale`, `q` in [0, 15], two weights per byte; in each group
  byte `j` holds weight `j` in its low nibble and weight `j + group_size / 2` in its
  high one (Q4_0's order, so GGUF blocks load without reshuffling).

With `mode="affine"` (int4 only; mlx-lm's kind, at its group of 64) each group also
has a float16 offset, its `bias`: `w = q * scale + bias`, `q` in [0, 15], the 16
levels spread from the group's minimum to its maximum. Lopsided groups lose less,
at 2 more bytes per group.

A `QuantizedWeight` takes the place of a `Linear`'s float weight. Stacked along
`layers` like any other leaf, it is scanned, sliced per layer in place at decode
(`eqx_models.ops.project`) and dequantized layer by layer for prefill.

Activations: with `activations="int8"` (the default, as llama.cpp computes Q8_0 and
Q4_0 products) the input of each quantized product is rounded per block of 32 to
int8 with one float32 scale (`quantize_activations`), so the CPU kernel sums the
products in integers; prefill rounds the same way, so both compute one function.
With `activations="float"` the inputs stay as they are (slower decode on the CPU,
the exact product with the dequantized weight).

Layout: `layout="rows"` keeps each output row's integers together (`[..., out,
in * bits / 8]`, what checkpoints hold). `layout="tiles"` (int8 only) stores them
as the CPU kernel multiplies them, sixteen output rows at a time:
`[..., out / 16, in / 32, 512]` bytes `q + 128`, byte `64 * v + 4 * r + i` of
block `j` of tile `t` being input `32 * j + 4 * v + i` of row `16 * t + r`, and
the scales `[..., out / 16, groups, 16]`, a tile's sixteen rows side by side per
group. The kernel then reads the bytes and scales as they lie instead of
transposing each tile per call (as llama.cpp repacks its Q8_0 weights at load).
`eqx_models.quantize` and `from_pretrained` pick it where it pays (`layout="auto"`: a CPU with AVX-512
VNNI, one device); `save_pretrained` writes rows whatever the layout in memory.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped

from .axes import AbstractHasArrayAxes

GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (jnp.float16, jnp.bfloat16)
ACTIVATIONS = ("int8", "float")
MODES = ("symmetric", "affine")
LAYOUTS = ("rows", "tiles")
ACTIVATION_BLOCK = 32  # inputs per activation scale with activations="int8"
TILE_ROWS = 16  # output rows per tile in the "tiles" layout
TILE_BLOCK = 32  # inputs per block of a tile


@jax.custom_jvp
def quantize_activations(x: Float[Array, "*rows in"]) -> Float[Array, "*rows in"]:
    """`x` rounded per block of 32 inputs to `dx * q`, `q = round(x * 127 / max|x|)`
    an int8 and `dx = max|x| / 127` (float32), as the int8-activation kernels see it.

    Differentiated as the identity (the straight-through estimator): the rounding
    has no useful derivative, and training through a quantized model (QLoRA)
    wants the gradient of the unrounded product.
    """
    *rows, width = x.shape
    blocks = x.astype(jnp.float32).reshape(*rows, width // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inverse = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    return (jnp.round(blocks * inverse) * (amax / 127.0)).reshape(x.shape)


@quantize_activations.defjvp
def _quantize_activations_jvp(primals, tangents):
    return quantize_activations(*primals), tangents[0].astype(jnp.float32)


class QuantizedWeight(AbstractHasArrayAxes):
    """A `(out, in)` weight held as integers and one scale per group of inputs.

    Leading axes (a stack of layers or experts) may precede both arrays.
    """

    # rows: [*stack, out, in * bits / 8]; tiles: [*stack, out / 16, in / 32, 512]
    packed: Shaped[Array, "..."]
    # rows: [*stack, out, groups]; tiles: [*stack, out / 16, groups, 16]
    scales: Float[Array, "..."]
    bits: int = eqx.field(static=True)
    group_size: int = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True)
    float_dtype: np.dtype = eqx.field(static=True)  # the weight's dtype before: activations keep it
    activations: str = eqx.field(static=True, default="int8")
    biases: Float[Array, "*stack out groups"] | None = None  # affine mode: `w = q * scale + bias`
    layout: str = eqx.field(static=True, default="rows")  # "rows" or "tiles" (see the module docstring)

    def __check_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"QuantizedWeight: bits must be 8 or 4, got {self.bits}.")
        if self.biases is not None and self.bits != 4:
            raise ValueError(f"QuantizedWeight: affine weights (with biases) are int4 only, got bits={self.bits}.")
        if self.biases is not None and self.biases.shape != self.scales.shape:
            raise ValueError(f"QuantizedWeight: biases {self.biases.shape} and scales {self.scales.shape} must match.")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"QuantizedWeight: activations must be one of {ACTIVATIONS}, got {self.activations!r}.")
        if self.layout not in LAYOUTS:
            raise ValueError(f"QuantizedWeight: layout must be one of {LAYOUTS}, got {self.layout!r}.")
        if self.layout == "tiles":
            *stack, tiles, blocks, tile_bytes = self.packed.shape
            if self.bits != 8 or tile_bytes != TILE_ROWS * TILE_BLOCK:
                raise ValueError(f"QuantizedWeight: the tiles layout holds int8 as [..., out / {TILE_ROWS}, in / "
                                 f"{TILE_BLOCK}, {TILE_ROWS * TILE_BLOCK}], got bits={self.bits}, {self.packed.shape}.")
            if tuple(self.scales.shape) != (*stack, tiles, blocks * TILE_BLOCK // self.group_size, TILE_ROWS):
                raise ValueError(f"QuantizedWeight: tiles {self.packed.shape} do not match scales {self.scales.shape}.")
            return
        per_byte = 8 // self.bits
        if self.packed.shape[-1] * per_byte != self.scales.shape[-1] * self.group_size:
            raise ValueError(
                f"QuantizedWeight: {self.packed.shape[-1]} bytes per row hold {self.packed.shape[-1] * per_byte} "
                f"inputs but {self.scales.shape[-1]} scales of groups of {self.group_size} cover "
                f"{self.scales.shape[-1] * self.group_size}."
            )

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        # Both arrays split like the float weight: a device's share of the input
        # axis holds whole groups as long as it is a multiple of group_size.
        tile_axis = (None,) if self.layout == "tiles" else ()
        return {"packed": self.axes + tile_axis, "scales": self.axes + tile_axis, "biases": self.axes}

    @property
    def mode(self) -> str:
        """"affine" (integers with a scale and a bias per group) or "symmetric"."""
        return "symmetric" if self.biases is None else "affine"

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape (with any leading stack axes)."""
        if self.layout == "tiles":
            return (*self.packed.shape[:-3], self.packed.shape[-3] * TILE_ROWS, self.packed.shape[-2] * TILE_BLOCK)
        return (*self.packed.shape[:-1], self.packed.shape[-1] * (8 // self.bits))

    @property
    def dtype(self) -> np.dtype:
        """The float weight's dtype (the model's activations), not the scales'."""
        return self.float_dtype

    def dequantize(self, dtype=None) -> Float[Array, "*stack out in"]:
        """The float weight these integers and scales stand for (in `dtype`, by
        default the weight's dtype before quantization)."""
        return dequantize(self.row_integers(), self.row_scales(), self.bits, self.group_size,
                          dtype or self.float_dtype, self.biases)

    def row_integers(self) -> Shaped[Array, "*stack out packed_in"]:
        """The integers in the "rows" layout (`packed` itself unless tiled)."""
        return tiles_to_rows(self.packed) if self.layout == "tiles" else self.packed

    def row_scales(self) -> Float[Array, "*stack out groups"]:
        """The scales in the "rows" layout (`scales` itself unless tiled)."""
        return tile_scales_to_rows(self.scales) if self.layout == "tiles" else self.scales

    def prepare_input(self, x: Float[Array, "*rows in"]) -> Float[Array, "*rows in"]:
        """`x` as the products with this weight see it (`quantize_activations` with
        int8 activations), in `x`'s dtype."""
        return quantize_activations(x).astype(x.dtype) if self.activations == "int8" else x

    def take_rows(self, rows: Int[Array, "*batch"]) -> Float[Array, "*batch in"]:
        """Rows of the dequantized weight (an embedding lookup), reading only those
        rows (tiled: only the tiles that hold them)."""
        take = lambda a: None if a is None else jnp.take(a, rows, axis=-2)
        if self.layout == "tiles":  # each row's tile as its 16 rows, then the row within it
            tiles = jnp.take(self.packed, rows // TILE_ROWS, axis=-3)[..., None, :, :]
            within = (rows % TILE_ROWS)[..., None, None]
            integers = jnp.take_along_axis(tiles_to_rows(tiles), within, axis=-2)[..., 0, :]
        else:
            integers = take(self.packed)
        scales = take(self.row_scales())
        return dequantize(integers, scales, self.bits, self.group_size, self.float_dtype, take(self.biases))


def rows_to_tiles(
    packed: Shaped[Array | np.ndarray, "*stack out in"],
) -> Shaped[Array | np.ndarray, "*stack tiles blocks 512"]:
    """int8 integers `[..., out, in]` in the "tiles" layout (see the module
    docstring); a NumPy array gives a NumPy array."""
    *stack, out, width = packed.shape
    tiles = (packed.view(jnp.uint8) ^ 0x80).reshape(*stack, out // TILE_ROWS, TILE_ROWS, width // TILE_BLOCK, 8, 4)
    n = len(stack)
    order = (*range(n), n, n + 2, n + 3, n + 1, n + 4)  # [tile, block, word, row, byte]
    return tiles.transpose(order).reshape(*stack, out // TILE_ROWS, width // TILE_BLOCK, TILE_ROWS * TILE_BLOCK)


def tiles_to_rows(
    tiles: Shaped[Array | np.ndarray, "*stack tiles blocks 512"],
) -> Shaped[Array | np.ndarray, "*stack out in"]:
    """The int8 integers `[..., out, in]` of the "tiles" layout (NumPy in, NumPy out)."""
    *stack, count, blocks, _ = tiles.shape
    words = tiles.reshape(*stack, count, blocks, 8, TILE_ROWS, 4)
    n = len(stack)
    order = (*range(n), n, n + 3, n + 1, n + 2, n + 4)  # [tile, row, block, word, byte]
    rows = words.transpose(order).reshape(*stack, count * TILE_ROWS, blocks * TILE_BLOCK)
    return (rows ^ 0x80).view(jnp.int8)


def scales_to_tiles(
    scales: Float[Array | np.ndarray, "*stack out groups"],
) -> Float[Array | np.ndarray, "*stack tiles groups 16"]:
    """Scales `[..., out, groups]` in the "tiles" layout: per tile of 16 rows, per
    group, the 16 rows' scales together (NumPy in, NumPy out)."""
    *stack, out, groups = scales.shape
    return scales.reshape(*stack, out // TILE_ROWS, TILE_ROWS, groups).swapaxes(-1, -2)


def tile_scales_to_rows(
    scales: Float[Array | np.ndarray, "*stack tiles groups 16"],
) -> Float[Array | np.ndarray, "*stack out groups"]:
    """The scales `[..., out, groups]` of the "tiles" layout (NumPy in, NumPy out)."""
    *stack, tiles, groups, _ = scales.shape
    return scales.swapaxes(-1, -2).reshape(*stack, tiles * TILE_ROWS, groups)


def tiles_in_place(packed: np.ndarray) -> np.ndarray:
    """A host int8 buffer `[..., out, in]` rearranged in place into the "tiles"
    layout, one matrix at a time (so loading holds one matrix's copy, not the
    leaf's); returns the same memory as uint8 `[..., out / 16, in / 32, 512]`."""
    *stack, out, width = packed.shape
    matrices = packed.reshape(-1, out, width)
    for matrix in matrices:
        matrix.view(np.uint8).reshape(-1)[:] = rows_to_tiles(matrix).reshape(-1)
    return matrices.view(np.uint8).reshape(*stack, out // TILE_ROWS, width // TILE_BLOCK, TILE_ROWS * TILE_BLOCK)


def host_tiles(integers: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A host int8 weight's integers `[..., out, in]` (rearranged in place, see
    `tiles_in_place`) and scales `[..., out, groups]` in the "tiles" layout."""
    return tiles_in_place(integers), np.ascontiguousarray(scales_to_tiles(scales))


def tiles_fit(bits: int, activations: str, shape: tuple[int, ...]) -> bool:
    """Whether a quantized weight of the float `shape` (`[..., out, in]`) can
    take the "tiles" layout: int8 with int8 activations, whole tiles of output
    rows, not a stack of experts."""
    return bits == 8 and activations == "int8" and shape[-2] % TILE_ROWS == 0 and len(shape) <= 3


def relayout(tree, layout: str):
    """`tree` with every quantized weight that fits (`tiles_fit`) in `layout`,
    "rows" or "tiles" (`eqx_models.quantization.with_layout` also takes "auto").

    Raises:
        ValueError: an unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    is_quantized = lambda node: isinstance(node, QuantizedWeight)

    def swap(node):
        if not is_quantized(node) or node.layout == layout:
            return node
        if layout == "tiles" and not tiles_fit(node.bits, node.activations, node.shape):
            return node
        if layout == "tiles":
            return dataclasses.replace(node, packed=rows_to_tiles(node.packed), scales=scales_to_tiles(node.scales),
                                       layout=layout)
        return dataclasses.replace(node, packed=node.row_integers(), scales=node.row_scales(), layout=layout)

    return jax.tree.map(swap, tree, is_leaf=is_quantized)


def _check(in_features: int, bits: int, group_size: int, mode: str = "symmetric") -> None:
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}.")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if mode == "affine" and bits != 4:
        raise ValueError(f"mode='affine' is int4 only (bits=4), got bits={bits}; use mode='symmetric' for int8.")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}.")
    if in_features % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the input width {in_features}; pick a group size that "
            f"does (one of {[g for g in GROUP_SIZES if in_features % g == 0] or 'none: leave this layer float'})."
        )


def quantize_weight(
    weight: Float[Array, "*stack out in"],
    bits: int = 8,
    group_size: int = 32,
    *,
    scale_dtype=jnp.float16,
    activations: str = "int8",
    axes: tuple[str | None, str | None] = (None, None),
    mode: str = "symmetric",
    layout: str = "rows",
) -> QuantizedWeight:
    """Quantizes a float `(out, in)` weight (any leading axes) per group.

    int8: `scale = max|w| / 127`, `q = round(w / scale)`. int4 (as Q4_0): the
    group's value of largest magnitude `m` gets `q = 0`, `scale = -m / 8`,
    `q = clip(round(w / scale) + 8, 0, 15)`. Affine int4: `bias = min w`,
    `scale = (max w - min w) / 15`, `q = clip(round((w - bias) / scale), 0, 15)`.
    The integers are computed against the scale (and bias) as stored (rounded to
    `scale_dtype`), so the error is at most half a step (a whole step for the
    symmetric int4 value at the clipped end of the range; half a step plus the
    bias's rounding for affine values clipped at either end).

    Args:
        weight: the float weight, `[..., out, in]`.
        bits: 8 or 4.
        group_size: inputs per scale (32, 64 or 128), dividing `in`.
        scale_dtype: float16 or bfloat16.
        activations: "int8" or "float": how products with the weight treat their
            input (see the module docstring).
        axes: the logical axes of `(out, in)`, for sharding.
        mode: "symmetric" or "affine" (int4 only: a bias per group too).
        layout: "rows" or "tiles" (int8 with int8 activations and whole tiles of
            16 output rows; see the module docstring).

    Returns:
        The `QuantizedWeight`.

    Raises:
        ValueError: bits other than 8 or 4, a group size not in `GROUP_SIZES` or
            one that does not divide the input width, an unknown mode or affine
            int8, a tiles layout the weight does not fit.
    """
    *stack, out, in_features = weight.shape
    float_dtype = np.dtype(weight.dtype)
    _check(in_features, bits, group_size, mode)
    if jnp.dtype(scale_dtype) not in [jnp.dtype(d) for d in SCALE_DTYPES]:
        raise ValueError(f"scale_dtype must be float16 or bfloat16, got {scale_dtype}.")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}.")
    packed, scale, biases = _integers(jnp.asarray(weight), bits, group_size, jnp.dtype(scale_dtype), mode)
    if bits == 4:
        if layout != "rows":
            raise ValueError(f"layout={layout!r} is for int8 weights; int4 ones are held as rows (layout='rows').")
        return QuantizedWeight(packed, scale, 4, group_size, tuple(axes), float_dtype, activations, biases)
    weight = QuantizedWeight(packed, scale, 8, group_size, tuple(axes), float_dtype, activations)
    if layout == "rows":
        return weight
    if layout != "tiles" or not tiles_fit(8, activations, weight.shape):
        raise ValueError(f"layout={layout!r}: use 'rows', or 'tiles' for int8 weights with int8 activations, "
                         f"{TILE_ROWS} output rows a tile and no expert axis (got {weight.shape}).")
    return dataclasses.replace(weight, packed=rows_to_tiles(weight.packed), scales=scales_to_tiles(scale),
                               layout="tiles")


# One compiled program, so that XLA fuses the steps: run op by op, a weight
# stack's float32 copy and each step's result are whole-stack temporaries
# (several times a Qwen3-4B layer stack's bytes: more than a 16 GB accelerator
# holds beside the model).
@functools.partial(jax.jit, static_argnames=("bits", "group_size", "scale_dtype", "mode"))
def _integers(weight: Array, bits: int, group_size: int, scale_dtype, mode: str):
    """The packed integers, scales and biases (None but for affine int4) of `quantize_weight`."""
    *stack, out, in_features = weight.shape
    groups = weight.astype(jnp.float32).reshape(*stack, out, in_features // group_size, group_size)
    if bits == 8:
        scale = (jnp.max(jnp.abs(groups), axis=-1) / 127).astype(scale_dtype)
        step = scale.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(groups / jnp.where(step == 0, 1, step)), -127, 127).astype(jnp.int8)
        return q.reshape(*stack, out, in_features), scale, None
    biases = None
    if mode == "affine":
        low, high = jnp.min(groups, axis=-1), jnp.max(groups, axis=-1)
        scale, biases = ((high - low) / 15).astype(scale_dtype), low.astype(scale_dtype)
        step = scale.astype(jnp.float32)[..., None]
        shifted = groups - biases.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(shifted / jnp.where(step == 0, 1, step)), 0, 15).astype(jnp.uint8)
    else:
        extreme = jnp.take_along_axis(groups, jnp.argmax(jnp.abs(groups), axis=-1)[..., None], axis=-1)[..., 0]
        scale = (-extreme / 8).astype(scale_dtype)
        step = scale.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(groups / jnp.where(step == 0, 1, step)) + 8, 0, 15).astype(jnp.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(*stack, out, in_features // 2), scale, biases


def unpack_int4(packed: Shaped[Array, "*rows bytes"], group_size: int) -> Int[Array, "*rows values"]:
    """The 4-bit integers `q` (0..15) of packed bytes, in weight order."""
    *rows, width = packed.shape
    pairs = packed.reshape(*rows, width * 2 // group_size, group_size // 2)
    low, high = pairs & 0xF, pairs >> 4
    return jnp.concatenate([low, high], axis=-1).reshape(*rows, width * 2).astype(jnp.int32)


def dequantize(
    packed: Shaped[Array, "*stack out packed_in"],
    scales: Float[Array, "*stack out groups"],
    bits: int,
    group_size: int,
    dtype=jnp.float32,
    biases: Float[Array, "*stack out groups"] | None = None,
) -> Float[Array, "*stack out in"]:
    """`q * scale` (int8), `(q - 8) * scale` (int4) or, with `biases` (affine
    int4), `q * scale + bias` as a float array.

    Args:
        packed: the integers (int8, or two int4 per uint8 byte).
        scales: one scale per group of `group_size` inputs.
        bits: 8 or 4.
        group_size: inputs per scale.
        dtype: the result's dtype.
        biases: affine int4's offset per group, or None.

    Returns:
        The float weight, `[..., out, in]`.
    """
    if bits == 8:
        q = packed.astype(jnp.float32)
    else:
        q = (unpack_int4(packed, group_size) - (0 if biases is not None else 8)).astype(jnp.float32)
    *stack, out, in_features = q.shape
    groups = q.reshape(*stack, out, in_features // group_size, group_size) * scales.astype(jnp.float32)[..., None]
    if biases is not None:
        groups = groups + biases.astype(jnp.float32)[..., None]
    return groups.reshape(*stack, out, in_features).astype(dtype)


def tree_child(node, key):
    """The child of `node` at one key of a `jax.tree_util` path."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    return node[key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key]


def is_expert_stack(weight) -> bool:
    """Whether a (float or quantized) linear weight is a stack of experts'
    weights, `[layers, experts, out, in]`."""
    return len(weight.shape) > 3



def quantized_bytes(tree) -> int:
    """Bytes of every array in `tree` (a quantized model's size in memory)."""
    return int(sum(np.dtype(leaf.dtype).itemsize * leaf.size for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array))))
