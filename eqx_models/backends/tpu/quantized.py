"""Rows times one layer of an int8 weight stack on the TPU, in Pallas, reading the
integers where they lie.

XLA's dequantize-then-multiply writes a float copy of the layer and reads it
again, four to nine bytes a weight where the integers are one. Here the stack
`[layers, out, in]` enters whole with the layer index (scalar prefetch); each
grid step reads a block of whole output rows (every input), widens it in VMEM
and multiplies it group by group of `group_size` inputs on the MXU, each
group's product scaled by its scales before it is added in. The grid's inner
axis walks blocks of the rows with the weight block unchanged, which Pallas does
not fetch again: each weight byte is read once a call.

Symmetric int8 in the rows layout whose groups are whole multiples of 128 inputs
(the lanes), and whose outputs are whole multiples of 128, go here; other
formats keep XLA's form.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from ...quantized import QuantizedWeight
from .. import xla

# A weight block's bytes, at most: large enough that the per-step cost (about a
# third of a microsecond) is a few percent of its transfer, small enough that two
# in flight and the widened copy of a group fit VMEM beside the rows.
WEIGHT_BLOCK_BYTES = 4 << 20
# The rows' block is fetched again for every block of weights when the rows take
# more than one: a decode batch's rows in one block (256 bfloat16 rows of 9,728).
ROW_BLOCK_BYTES = 8 << 20
MAX_ROW_TILE = 256
LANES = 128
VMEM_LIMIT_BYTES = 64 << 20  # a v5e core has 128 MiB; the default scope is 16


def fits(stack) -> bool:
    """Whether the kernel takes this stack: symmetric int8 in the rows layout,
    groups and outputs in whole multiples of 128."""
    return (
        isinstance(stack, QuantizedWeight)
        and stack.bits == 8
        and stack.mode == "symmetric"
        and stack.layout == "rows"
        and stack.packed.ndim == 3  # [layers, out, in]: experts keep their own path
        and stack.group_size % LANES == 0
        and stack.shape[-2] % LANES == 0
    )


def out_tile(out: int, inner: int) -> int:
    """Output rows a grid step: the largest multiple of 128 that divides `out`
    with a block of at most `WEIGHT_BLOCK_BYTES` (128 at least)."""
    tiles = [t for t in range(LANES, out + 1, LANES) if out % t == 0 and t * inner <= WEIGHT_BLOCK_BYTES]
    return max(tiles, default=LANES)


def row_tile(rows: int, inner: int, itemsize: int) -> int:
    """Rows a grid step: all of them up to `MAX_ROW_TILE`, in multiples of 16
    (bfloat16's sublane packing), fewer where a block would pass `ROW_BLOCK_BYTES`."""
    cap = max(16, min(MAX_ROW_TILE, ROW_BLOCK_BYTES // (inner * itemsize)) // 16 * 16)
    return min(cap, -(-rows // 16) * 16)


def _kernel(layer_ref, x_ref, q_ref, s_ref, out_ref, *, groups: int, group_size: int):
    del layer_ref
    x = x_ref[...]
    # A 16-bit product is exact at the default precision, the one Mosaic takes it at.
    precision = jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16 else None
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for g in range(groups):  # static: slices on whole lanes
        part = slice(g * group_size, (g + 1) * group_size)
        weights = q_ref[:, part].astype(jnp.float32).astype(x.dtype)  # int8 values are exact in bfloat16
        product = jax.lax.dot_general(x[:, part], weights, (((1,), (1,)), ((), ())), precision=precision,
                                      preferred_element_type=jnp.float32)
        acc = acc + product * s_ref[g : g + 1, :]
    out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("group_size", "interpret"))
def layer_product(
    x: Float[Array, "rows in"],
    integers: Int[Array, "layers out in"],
    scales: Float[Array, "groups out"],
    layer: Int[Array, ""],
    *,
    group_size: int,
    interpret: bool = False,
) -> Float[Array, "rows out"]:
    """`x @ (integers[layer] * scales).T` in float32, `scales` the layer's, transposed
    (`[groups, out]`). `x`'s dtype is the product's (bfloat16 or float32).
    `interpret` runs the kernel in Pallas' interpreter (on any backend)."""
    rows, inner = x.shape
    _, out, _ = integers.shape
    groups = inner // group_size
    tm, tn = row_tile(rows, inner, x.dtype.itemsize), out_tile(out, inner)
    padded = jnp.pad(x, ((0, -rows % tm), (0, 0)))
    call = pl.pallas_call(
        functools.partial(_kernel, groups=groups, group_size=group_size),
        out_shape=jax.ShapeDtypeStruct((padded.shape[0], out), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(out // tn, padded.shape[0] // tm),  # rows inner: the weight block stays put
            in_specs=[
                pl.BlockSpec((tm, inner), lambda j, i, layer: (i, 0)),
                pl.BlockSpec((None, tn, inner), lambda j, i, layer: (layer[0], j, 0)),
                pl.BlockSpec((groups, tn), lambda j, i, layer: (0, j)),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda j, i, layer: (i, j)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
    )
    return call(jnp.reshape(layer, (1,)).astype(jnp.int32), padded, integers, scales)[:rows]


def _product(x: Array, stack: QuantizedWeight, scales: Array, layer: Array, interpret: bool) -> Array:
    """One stack's product through the kernel, `x` flat `[rows, in]` in float32."""
    scales = jnp.swapaxes(xla.layer_of(scales, layer), 0, 1)
    # A bfloat16 model's float activations are bfloat16 values: the product takes
    # them as they are. Rounded int8 activations carry a float32 scale: float32.
    exact = stack.float_dtype == jnp.bfloat16 and stack.activations == "float"
    dtype = jnp.bfloat16 if exact else jnp.float32
    return layer_product(x.astype(dtype), stack.packed, scales.astype(jnp.float32), layer,
                         group_size=stack.group_size, interpret=interpret)


def quantized_matvecs(x: Float[Array, "*rows in"], stacks: tuple, layer: Int[Array, ""], *,
                      interpret: bool = False) -> tuple[Float[Array, "*rows _"], ...]:
    """`eqx_models.ops.quantized_matvecs` for stacks the kernel takes (`fits`), float32.
    Differentiable in `x` and the scales: the derivative is XLA's form's."""

    def reference(x, scales):
        swapped = tuple(eqx.tree_at(lambda s: s.scales, stack, new) for stack, new in zip(stacks, scales))
        return xla.quantized_matvecs(x, swapped, layer)

    @jax.custom_vjp
    def run(x, scales):
        flat = stacks[0].prepare_input(x).reshape(-1, x.shape[-1])
        return tuple(_product(flat, stack, s, layer, interpret).reshape(*x.shape[:-1], -1)
                     for stack, s in zip(stacks, scales))

    def forward(x, scales):
        return run(x, scales), (x, scales)

    def backward(residuals, cotangents):
        return jax.vjp(reference, *residuals)[1](cotangents)

    run.defvjp(forward, backward)
    return run(x, tuple(stack.scales for stack in stacks))
