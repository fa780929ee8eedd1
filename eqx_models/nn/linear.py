"""Linear and embedding layers that store weights in the Hugging Face layout."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..axes import AbstractHasArrayAxes
from ..ops import LayerSlice, Weight, index_layer, project, project_many, take_rows
from ..quantized import QuantizedWeight

INIT_STD = 0.02  # transformers' default `initializer_range`


def project_together(x: Float[Array, "*batch in"], layers: list["Linear"]) -> list[Float[Array, "*batch _"]]:
    """`[layer(x) for layer in layers]`, as one operation over all their weights
    (see `eqx_models.ops.project_many`)."""
    outs = project_many(x, [l.weight for l in layers])
    return [l.finish(x, y) for y, l in zip(outs, layers)]


class AbstractLayerSelectable(eqx.Module):
    """A module that, stacked along a leading layers axis, gives its own view of one
    layer (`layer_view` asks it rather than slicing its arrays)."""

    @abc.abstractmethod
    def select_layer(self, index: Int[Array, ""]) -> eqx.Module:
        """This stacked module's layer `index`."""


class Linear(AbstractLayerSelectable, AbstractHasArrayAxes):
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

    An `AbstractLayerSelectable` gives its own view (a `Linear` keeps its weight in
    the stack as a `LayerSlice`, so decode reads it in place); every other array is
    sliced.
    """
    selects = lambda node: isinstance(node, AbstractLayerSelectable)

    def select(node):
        if selects(node):
            return node.select_layer(index)
        if eqx.is_array(node):
            return index_layer(node, index)
        return node

    return jax.tree.map(select, stacked, is_leaf=selects)


class Embedding(AbstractHasArrayAxes):
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
