"""Linear and embedding layers that store weights in the Hugging Face layout."""

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from ..kernels import (
    bf16_tiles_available, index_layer, kernels_available, quantized_matvecs, quantized_tiles_available, stacked_matvecs,
    take_rows,
)
from ..quantization import QuantizedWeight
from ..sharding import spans_devices

INIT_STD = 0.02  # transformers' default `initializer_range`
# Up to this many rows (batch x seq) a product with a weight goes through the
# matrix-vector kernel, which reads each weight once for all rows; beyond, XLA's
# matmul reuses operands better and a slice copy is amortised over many rows.
# Quantized weights with int8 activations go through the kernel at any row count
# where `quantized_tiles_available()` (the CPU backend, AVX-512 VNNI): its integer
# tiles outrun the float matmul of the dequantized weight. So do bfloat16 rows
# against bfloat16 weights where `bf16_tiles_available()` (AMX): XLA:CPU widens
# them to float32 for its matmul.
MAX_KERNEL_ROWS = 16
# Widths the AMX tiles take: 32 inputs per tile row, 16 outputs per tile.
TILE_IN, TILE_OUT = 32, 16


class LayerSlice(eqx.Module):
    """One layer of a stacked array (weights `[layers, out, in]`, a KV cache
    `[layers, batch, kv_heads, kv_seq, head_dim]`), referred to by index.

    Inside the scanned decoder each `Linear` and the attention see their layer this
    way, so the decode kernels read the slice in place instead of XLA copying it
    out first. `materialize()` gives the slice itself for everything else.
    """

    stack: Shaped[Array, "layers *rest"] | QuantizedWeight
    index: Int[Array, ""]

    def materialize(self) -> Shaped[Array, "*rest"] | QuantizedWeight:
        take = lambda a: index_layer(a, self.index)
        return jax.tree.map(take, self.stack) if isinstance(self.stack, QuantizedWeight) else take(self.stack)


Weight = Float[Array, "out in"] | QuantizedWeight | LayerSlice


def is_quantized(weight: Weight) -> bool:
    """Whether `weight` (or the stack a `LayerSlice` refers to) is a `QuantizedWeight`."""
    return isinstance(weight.stack if isinstance(weight, LayerSlice) else weight, QuantizedWeight)


def use_matvec_kernel(x: Array, weight: Weight) -> bool:
    """Whether `x @ weight.T` should go through one of the decode kernels
    (`eqx_models.kernels.stacked_matvec`, or `quantized_matvecs`)."""
    dtype = weight.stack.dtype if isinstance(weight, LayerSlice) else weight.dtype
    if is_quantized(weight) and _input_kind(weight) == "int8" and quantized_tiles_available():
        return True
    if _bf16_tiles_fit(x, weight) and bf16_tiles_available():
        return True
    return (
        math.prod(x.shape[:-1]) <= MAX_KERNEL_ROWS
        and (is_quantized(weight) or dtype in (jnp.float32, jnp.bfloat16))
        and kernels_available()
    )


def _bf16_tiles_fit(x: Array, weight: Weight) -> bool:
    if is_quantized(weight):
        return False
    array = weight.stack if isinstance(weight, LayerSlice) else weight
    out, width = array.shape[-2:]
    return (x.dtype == jnp.bfloat16 and array.dtype == jnp.bfloat16
            and width % TILE_IN == 0 and out % TILE_OUT == 0)


def _as_stack(weight: Weight) -> tuple[Array | QuantizedWeight, Array]:
    if isinstance(weight, LayerSlice):
        return weight.stack, weight.index
    return jax.tree.map(lambda a: a[None], weight), jnp.int32(0)


def _matvecs(x: Array, stacks: tuple, index: Array) -> tuple[Array, ...]:
    if isinstance(stacks[0], QuantizedWeight):
        return quantized_matvecs(x, stacks, index)
    return stacked_matvecs(x, stacks, index)


def _whole(weight: Weight, dtype) -> Float[Array, "out in"]:
    """The float weight for XLA's matmul (dequantized in `dtype` when quantized)."""
    if isinstance(weight, LayerSlice):
        weight = weight.materialize()
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight


def _input_kind(weight: Weight) -> str:
    return (weight.stack if isinstance(weight, LayerSlice) else weight).activations if is_quantized(weight) else "float"


def _prepared(x: Array, weight: Weight) -> Array:
    """`x` as a product with `weight` sees it (rounded if it takes int8 activations)."""
    if is_quantized(weight):
        return (weight.stack if isinstance(weight, LayerSlice) else weight).prepare_input(x)
    return x


def project(x: Float[Array, "*batch in"], weight: Weight) -> Float[Array, "*batch out"]:
    """`x @ weight.T`, with the decode kernel for a few rows and XLA's matmul otherwise.

    Beyond the kernel's rows a quantized weight is dequantized for the matmul (one
    layer at a time, in `x`'s dtype): prefill reuses each weight over many rows.
    With int8 activations on a CPU with AVX-512 VNNI the kernel takes any number
    of rows (see `use_matvec_kernel`).
    """
    if use_matvec_kernel(x, weight):
        stack, index = _as_stack(weight)
        return _matvecs(x, (stack,), index)[0].astype(x.dtype)
    return jnp.einsum("...i,oi->...o", _prepared(x, weight), _whole(weight, x.dtype))


def project_together(x: Float[Array, "*batch in"], layers: list["Linear"]) -> list[Float[Array, "*batch _"]]:
    """`[layer(x) for layer in layers]`, as one operation over all their weights
    (see `project_many`)."""
    outs = project_many(x, [l.weight for l in layers])
    return [l.finish(x, y) for y, l in zip(outs, layers)]


def project_many(x: Float[Array, "*batch in"], weights: list[Weight]) -> list[Float[Array, "*batch _"]]:
    """`[x @ w.T for w in weights]`, as one operation over all the weights.

    For a few rows (decode), and for int8-activation quantized weights where
    `use_matvec_kernel` says so, the projections go through the kernel as one call
    that streams every weight in place. For many rows (prefill) otherwise one
    matmul over the concatenated weights beats several smaller ones that XLA
    would run side by side on the same cores, and the weights of a scanned layer
    are copied out of the stack either way.
    """
    if all(use_matvec_kernel(x, w) for w in weights):
        stacks, indices = zip(*map(_as_stack, weights))
        kinds = {(type(s), s.dtype, getattr(s, "bits", None), getattr(s, "group_size", None),
                  getattr(s, "activations", None), getattr(s, "mode", None)) for s in stacks}
        if len(kinds) == 1 and all(i is indices[0] for i in indices):
            outs = _matvecs(x, stacks, indices[0])
        else:
            outs = [project(x, w) for w in weights]
    elif spans_devices():  # weights split over a mesh: a concatenation would reshard them
        outs = [project(x, w) for w in weights]
    elif len({_input_kind(w) for w in weights}) > 1:
        outs = [project(x, w) for w in weights]  # the weights see their input differently
    else:
        x_in, weights = _prepared(x, weights[0]), [_whole(w, x.dtype) for w in weights]
        joined = jnp.einsum("...i,oi->...o", x_in, jnp.concatenate(weights, axis=0))
        outs = jnp.split(joined, list(itertools.accumulate(w.shape[0] for w in weights))[:-1], axis=-1)
    return [y.astype(x.dtype) for y in outs]


class Linear(eqx.Module):
    """`y = x @ weight.T + bias`, with `weight` shaped `(out, in)` as in torch.

    Works on any leading axes, so one module serves `[batch, seq, in]` activations.
    `axes` names the logical axes of `(out, in)` (`("heads", "embed")` for a query
    projection), which sharding rules map onto a mesh.
    """

    weight: Weight
    bias: Float[Array, " out"] | None
    axes: tuple[str | None, str | None] = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None],
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        self.weight = INIT_STD * jax.random.normal(key, (out_features, in_features))
        self.bias = jnp.zeros((out_features,)) if use_bias else None
        self.axes = tuple(axes)

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        if isinstance(self.weight, QuantizedWeight):  # it declares its own arrays' axes
            return {"bias": self.axes[:1]}
        return {"weight": self.axes, "bias": self.axes[:1]}

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        return self.finish(x, project(x, self.weight))

    def finish(self, x: Float[Array, "*batch in"], y: Float[Array, "*batch out"]) -> Float[Array, "*batch out"]:
        """`y = x @ weight.T` completed into this layer's output (the bias added)."""
        return y if self.bias is None else (y + self.bias).astype(x.dtype)

    def select_layer(self, index: Int[Array, ""]) -> "Linear":
        """This stacked `Linear`'s layer `index`, with the weight left in the stack."""
        out = eqx.tree_at(lambda m: m.weight, self, LayerSlice(self.weight, index))
        if self.bias is not None:
            out = eqx.tree_at(lambda m: m.bias, out, index_layer(self.bias, index))
        return out


def layer_view(stacked, index: Int[Array, ""]):
    """Layer `index` of a tree of stacked modules (arrays with a leading layers axis).

    Modules with a `select_layer(index)` method give their own view (a `Linear`
    keeps its weight in the stack as a `LayerSlice`, so decode reads it in place);
    every other array is sliced.
    """
    selects = lambda node: isinstance(node, eqx.Module) and hasattr(node, "select_layer")

    def select(node):
        if selects(node):
            return node.select_layer(index)
        if eqx.is_array(node):
            return index_layer(node, index)
        return node

    return jax.tree.map(select, stacked, is_leaf=selects)


class Embedding(eqx.Module):
    """Token embedding table shaped `(vocab, hidden)`.

    With a `scale` (Gemma's `sqrt(hidden_size)`, Granite's `embedding_multiplier`)
    the looked-up rows are multiplied by it, in the activation dtype; the tied head
    (`attend`) uses the table unscaled.
    """

    weight: Float[Array, "vocab hidden"] | QuantizedWeight
    scale: float | None = eqx.field(static=True)

    def __init__(self, vocab_size: int, hidden_size: int, *, scale: float | None = None, key: PRNGKeyArray):
        self.weight = INIT_STD * jax.random.normal(key, (vocab_size, hidden_size))
        self.scale = scale

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {} if isinstance(self.weight, QuantizedWeight) else {"weight": ("vocab", "embed")}

    def __call__(self, input_ids: Int[Array, "*batch"]) -> Float[Array, "*batch hidden"]:
        if isinstance(self.weight, QuantizedWeight):
            rows = self.weight.take_rows(input_ids)
        else:
            rows = take_rows(self.weight, input_ids)
        return rows if self.scale is None else rows * jnp.asarray(self.scale, rows.dtype)

    def attend(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch vocab"]:
        """Projects hidden states onto the vocabulary with the same table (tied head)."""
        return project(x, self.weight)
