"""The experts' grouped product on the TPU: the grouped matmul JAX ships for it
(megablox `gmm`), over one layer of the expert stack read in place.

The stack `[layers, experts, out, in]` enters flattened to `[layers * experts,
out, in]` (a free reshape), with the group sizes laid at the layer's offset and
zero for every other layer's experts. `gmm` visits only groups that have rows, so
it reads the layer's used experts and nothing else, and never copies the layer's
slice out. It leaves rows past the groups unwritten; they are zeroed here.

The derivative is this module's own: megablox's would write a gradient for every
group of the flattened stack, every layer's experts, at each layer; here the
weights' gradient is computed for the layer's experts only (`tgmm` from the
layer's offset) and placed in the stack's, as the rest of a scanned model's is.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm
from jaxtyping import Array, Float, Int

from ..xla import beyond_groups_zeroed
from . import precision

# Tile widths for the weights' two axes (a multiple of 128 lanes), the largest
# that divides the axis. Rows go in tiles of up to 128, smaller when there are
# few rows in all (a decode step of a small batch wastes less of each tile).
WEIGHT_TILES = (512, 256, 128)
MAX_ROW_TILE = 128


def _weight_tile(width: int) -> int | None:
    return next((tile for tile in WEIGHT_TILES if width % tile == 0), None)


def row_tile(rows: int) -> int:
    """Rows per tile: a power of two from 16 (bfloat16's sublane packing) to 128."""
    return min(MAX_ROW_TILE, max(16, 1 << (rows - 1).bit_length()))


def fits_stack(stack: Array) -> bool:
    """Whether the kernel takes experts stacked as `stack` (`[layers, experts, out,
    in]`): float weights whose `out` and `in` axes are whole multiples of 128."""
    _, _, out, inner = stack.shape
    return stack.dtype in (jnp.float32, jnp.bfloat16) and _weight_tile(out) is not None and _weight_tile(inner) is not None


def fits(rows: Array, stack: Array) -> bool:
    """Whether the kernel takes this product (`fits_stack`, and float rows)."""
    return fits_stack(stack) and rows.dtype in (jnp.float32, jnp.bfloat16)


def grouped_matmul(
    rows: Float[Array, "rows in"],
    stack: Float[Array, "layers groups out in"],
    layer: Int[Array, ""],
    group_sizes: Int[Array, " groups"],
    *,
    interpret: bool = False,
) -> Float[Array, "rows out"]:
    """Row group `g` times `stack[layer, g]`, float32 (see `eqx_models.ops.grouped_matmul`).
    `interpret` runs the kernel in Pallas' interpreter (on any backend)."""
    layers, groups, out, inner = stack.shape
    count = rows.shape[0]
    tm = row_tile(count)
    # `gmm` leaves rows past the groups unwritten, in its output and in the
    # gradient of its input: zeroing those input rows with a `where` drops them
    # from that gradient.
    inside = jnp.arange(count) < jnp.sum(group_sizes)
    padded = jnp.pad(jnp.where(inside[:, None], rows, 0), ((0, -count % tm), (0, 0)))
    sizes = jax.lax.dynamic_update_slice(jnp.zeros((layers * groups,), jnp.int32), group_sizes, (layer * groups,))
    product = _layer_product(padded, stack.reshape(layers * groups, out, inner), sizes, layer * groups, groups, tm,
                             interpret)
    return beyond_groups_zeroed(product[:count], group_sizes)


@functools.cache  # one function per row tile: the kernels compile once per tiling
def _tiling(tm: int):
    """Tiles for any of the products below: `tm` rows, the weights' axes by width."""
    return lambda m, k, n: (tm, _weight_tile(k), _weight_tile(n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _layer_product(rows, flat, sizes, first, groups: int, tm: int, interpret: bool):
    """`rows` times the groups of `flat` (`[layers * groups, out, in]`) that `sizes` gives rows, float32."""
    with precision.for_inputs(rows.dtype, flat.dtype):
        return gmm(rows, flat, sizes, preferred_element_type=jnp.float32, tiling=_tiling(tm), transpose_rhs=True,
                   interpret=interpret)


def _layer_product_forward(rows, flat, sizes, first, groups, tm, interpret):
    return _layer_product(rows, flat, sizes, first, groups, tm, interpret), (rows, flat, sizes, first)


def _layer_product_backward(groups, tm, interpret, residuals, cotangent):
    rows, flat, sizes, first = residuals
    with precision.for_inputs(rows.dtype, flat.dtype):
        d_rows = gmm(cotangent.astype(flat.dtype), flat, sizes, preferred_element_type=jnp.float32,
                     tiling=_tiling(tm), transpose_rhs=False, interpret=interpret)
        # Row group g's outer product with its cotangents, for the layer's groups only.
        d_layer = tgmm(cotangent.T.astype(rows.dtype), rows, sizes, preferred_element_type=jnp.float32,
                       tiling=_tiling(tm), group_offset=first, num_actual_groups=groups, interpret=interpret)
    d_flat = jax.lax.dynamic_update_slice(jnp.zeros_like(flat), d_layer.astype(flat.dtype), (first, 0, 0))
    return d_rows.astype(rows.dtype), d_flat, None, None


_layer_product.defvjp(_layer_product_forward, _layer_product_backward)
