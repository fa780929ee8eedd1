"""The experts' grouped product on the TPU: the grouped matmul JAX ships for it
(megablox `gmm`), over one layer of the expert stack read in place.

The stack `[layers, experts, out, in]` enters flattened to `[layers * experts,
out, in]` (a free reshape), with the group sizes laid at the layer's offset and
zero for every other layer's experts. `gmm` visits only groups that have rows, so
it reads the layer's used experts and nothing else, and never copies the layer's
slice out. It leaves rows past the groups unwritten; they are zeroed here.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jaxtyping import Array, Float, Int

from ..xla import beyond_groups_zeroed

# Tile widths for the weights' two axes (a multiple of 128 lanes), the largest
# that divides the axis. Rows go in tiles of up to 128 (at decode a few rows per
# expert: a small row tile wastes less of each weight tile's product).
WEIGHT_TILES = (512, 256, 128)
MAX_ROW_TILE = 128


def _weight_tile(width: int) -> int | None:
    return next((tile for tile in WEIGHT_TILES if width % tile == 0), None)


def row_tile(rows: int) -> int:
    """Rows per tile: a power of two from 16 (bfloat16's sublane packing) to 128."""
    return min(MAX_ROW_TILE, max(16, 1 << (rows - 1).bit_length()))


def fits(rows: Array, stack: Array) -> bool:
    """Whether the kernel takes this product: float weights whose `out` and `in`
    axes are whole multiples of 128."""
    _, _, out, inner = stack.shape
    return (stack.dtype in (jnp.float32, jnp.bfloat16) and rows.dtype in (jnp.float32, jnp.bfloat16)
            and _weight_tile(out) is not None and _weight_tile(inner) is not None)


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
    product = gmm(
        padded,
        stack.reshape(layers * groups, out, inner),
        sizes,
        preferred_element_type=jnp.float32,
        tiling=(tm, _weight_tile(inner), _weight_tile(out)),
        transpose_rhs=True,
        interpret=interpret,
    )
    return beyond_groups_zeroed(product[:count], group_sizes)
