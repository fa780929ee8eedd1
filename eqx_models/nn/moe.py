"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral).

Each token is routed to its `top_k` experts by a softmax router; an expert is a
gated MLP. Compute follows the assignments, not the expert count, in one of two
ways, as the backend chooses (`eqx_models.ops.groups_experts`):

- grouped (TPU, GPU): the assignments sorted by expert go through one grouped
  product per projection (`grouped_matmul`: megablox `gmm` on a TPU, XLA's
  ragged dot elsewhere), and are gathered back to their tokens;
- in blocks (CPU): the sorted assignments are cut into blocks of at most
  `block_rows` rows that each belong to one expert, and every block multiplies
  its rows by its expert's weights: read in place from the `[experts, out, in]`
  stacks by the decode kernel for blocks of up to 16 rows, copied out for XLA's
  matmul for taller ones. At decode each used expert is one block; blocks past
  the last used one are skipped.

No token is dropped.
"""

import abc
import math
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import sharding
from ..config import DecoderConfig
from ..ops import LayerSlice, grouped_matmul, groups_experts, project, project_many
from ..quantized import QuantizedWeight
from ..sharding import stacked_field
from .linear import AbstractLayerSelectable, Linear, layer_view
from .mlp import ACTIVATIONS, GatedMLP

MAX_BLOCK_ROWS = 128


class AbstractExperts(eqx.Module):
    """`num_experts` feed-forward blocks whose weights are stacked along a leading
    `experts` axis, as an MoE block reads them: the arrays, and one expert applied
    to rows with them."""

    @abc.abstractmethod
    def arrays(self) -> list[tuple[Array | LayerSlice, tuple[str | None, ...]]]:
        """The `[experts, ...]` arrays `forward` reads, each with the logical axes of
        its per-expert part (for splitting them over a mesh)."""

    @abc.abstractmethod
    def forward(self, h: Float[Array, "rows hidden"], expert: Int[Array, ""], arrays) -> Float[Array, "rows hidden"]:
        """Expert `expert` applied to the rows `h`; `arrays` are `arrays()`'s arrays
        (or each device's part of them)."""

    @abc.abstractmethod
    def grouped_forward(
        self, h: Float[Array, "rows hidden"], group_sizes: Int[Array, " experts"], row_expert: Int[Array, " rows"],
        arrays,
    ) -> Float[Array, "rows hidden"]:
        """The experts applied to rows sorted by expert: the first `group_sizes[0]`
        rows go through expert 0, the next `group_sizes[1]` through expert 1, ...;
        `row_expert` is each row's expert. Rows past the groups give zeros."""


class Experts(AbstractExperts):
    """`num_experts` gated MLPs whose weights are stacked `[experts, out, in]`."""

    gate_proj: Linear = stacked_field("experts")
    up_proj: Linear = stacked_field("experts")
    down_proj: Linear = stacked_field("experts")
    hidden_act: str = eqx.field(static=True)

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, hidden_act: str = "silu", key: PRNGKeyArray
    ):
        mlps = eqx.filter_vmap(lambda k: GatedMLP(hidden_size, intermediate_size, key=k))(
            jax.random.split(key, num_experts)
        )
        self.gate_proj, self.up_proj, self.down_proj = mlps.gate_proj, mlps.up_proj, mlps.down_proj
        self.hidden_act = hidden_act

    def arrays(self) -> list[tuple[Array | LayerSlice, tuple[str | None, ...]]]:
        return [(self.gate_proj.weight, ("mlp", "embed")), (self.up_proj.weight, ("mlp", "embed")),
                (self.down_proj.weight, ("embed", "mlp"))]

    def forward(self, h: Float[Array, "rows hidden"], expert: Int[Array, ""], arrays) -> Float[Array, "rows hidden"]:
        gate_w, up_w, down_w = arrays
        gate, up = project_many(h, [_expert_weight(gate_w, expert), _expert_weight(up_w, expert)])
        return project(ACTIVATIONS[self.hidden_act](gate) * up, _expert_weight(down_w, expert))

    def grouped_forward(
        self, h: Float[Array, "rows hidden"], group_sizes: Int[Array, " experts"], row_expert: Int[Array, " rows"],
        arrays,
    ) -> Float[Array, "rows hidden"]:
        gate_w, up_w, down_w = arrays
        gate, up = grouped_matmul(h, gate_w, group_sizes), grouped_matmul(h, up_w, group_sizes)
        return grouped_matmul(ACTIVATIONS[self.hidden_act](gate) * up, down_w, group_sizes)


def _expert_weight(weight: Array | QuantizedWeight | LayerSlice, expert: Int[Array, ""]) -> LayerSlice:
    """Expert `expert` of `[experts, out, in]` weights (or of one layer's, in a stack
    `[layers, experts, out, in]`), as a slice of a flat `[layers * experts, out, in]`
    stack so the kernels read it in place."""
    if isinstance(weight, LayerSlice):
        layers, experts = weight.stack.shape[:2]
        # A quantized stack's integers and scales share their leading axes.
        flat = jax.tree.map(lambda a: a.reshape(layers * experts, *a.shape[2:]), weight.stack)
        return LayerSlice(flat, weight.index * experts + expert)
    return LayerSlice(weight, expert)


def route(
    router_logits: Float[Array, "tokens experts"], top_k: int, normalize: bool
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
    """Softmax over experts (float32), the `top_k` largest, optionally renormalised."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def expert_blocks(
    experts: Int[Array, " assignments"], num_experts: int, block_rows: int, *, counted: int | None = None
) -> tuple[Int[Array, "blocks block_rows"], Int[Array, " blocks"], Int[Array, ""]]:
    """Groups assignments by expert into blocks of at most `block_rows` rows.

    Returns `rows` (assignment ids per block, `len(experts)` marking an empty slot),
    each block's expert, and how many blocks are used (the rest are empty; with
    `counted`, only the blocks of experts below it count as used). The
    block count is a static bound: at most `min(E, A)` experts have a partly filled
    block, so `ceil((A + min(E, A) * (block_rows - 1)) / block_rows)`.
    """
    count = experts.shape[0]
    bound = -(-(count + min(num_experts, count) * (block_rows - 1)) // block_rows)
    order = jnp.argsort(experts, stable=True)
    sorted_experts = experts[order]
    per_expert = jnp.bincount(experts, length=num_experts)
    first = jnp.cumsum(per_expert) - per_expert
    blocks_per_expert = -(-per_expert // block_rows)
    block_end = jnp.cumsum(blocks_per_expert)
    rank = jnp.arange(count) - first[sorted_experts]
    block = (block_end - blocks_per_expert)[sorted_experts] + rank // block_rows
    rows = jnp.full((bound, block_rows), count, jnp.int32).at[block, rank % block_rows].set(order.astype(jnp.int32))
    block_expert = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(bound), side="right"), num_experts - 1)
    used = block_end[-1] if counted is None else block_end[counted - 1]
    return rows, block_expert.astype(jnp.int32), used


class AbstractSparseMoeBlock(eqx.Module):
    """What every mixture-of-experts block shares: each token routed to `top_k` of
    the `experts` by the router `gate`, the experts run over blocks of assignments
    (on a mesh, each device its own experts), their outputs weighed and summed
    (`routed_experts`).

    Subclasses say how tokens are routed (`route_tokens`) and what the block adds
    around the routed experts (`__call__`: shared experts, biases). `float_children`
    names `Linear` children that `eqx_models.quantize` leaves float.
    """

    float_children: ClassVar[tuple[str, ...]] = ()

    gate: eqx.AbstractVar[eqx.Module]
    experts: eqx.AbstractVar[AbstractExperts]
    num_experts: eqx.AbstractVar[int]
    top_k: eqx.AbstractVar[int]

    @abc.abstractmethod
    def route_tokens(
        self, gate: eqx.Module, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        """Each token's experts and their weights, from the router `gate` (this
        layer's, its weights whole)."""

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        """The block's output: the routed experts' (`routed_experts`) and whatever
        the family adds."""

    def routed_experts(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        """Each token's `top_k` experts' outputs, weighted by the router and summed."""
        placement = sharding.current()
        if placement is not None and placement.num_devices > 1:
            return self._on_mesh(x, placement)
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route_tokens(self.gate, tokens)
        stacks = tuple(array for array, _ in self.experts.arrays())
        return self._run_experts(tokens, weights, chosen, stacks, self.num_experts).reshape(x.shape)

    def _run_experts(self, tokens, weights, chosen, stacks, num_experts: int, *, local_experts: int | None = None):
        """Each token's `top_k` experts' outputs, weighted and summed. With
        `local_experts`, only experts below it run (id `local_experts` marks an
        assignment that another device computes; its weight must be 0)."""
        if groups_experts(stacks[0]):
            return self._grouped(tokens, weights, chosen, stacks, num_experts if local_experts is None else local_experts)
        hidden = tokens.shape[-1]
        count = chosen.size
        # Blocks about as tall as an expert's share of the assignments (a power of
        # two): one row per block at decode, where the assignments mostly go to
        # different experts (each block then reads its expert once, in place); for a
        # long prompt, blocks tall enough that XLA's matmul pays for copying the
        # expert's weights out (measured: 64-row blocks prefill 2x faster than 16).
        share = -(-count // self.num_experts)  # assignments per expert (all devices' experts)
        block_rows = min(MAX_BLOCK_ROWS, 1 << (share - 1).bit_length())
        rows, block_expert, used = expert_blocks(chosen.reshape(-1), num_experts, block_rows, counted=local_experts)
        padded = jnp.concatenate([tokens, jnp.zeros((1, hidden), tokens.dtype)])
        token_of = jnp.where(rows < count, rows // self.top_k, tokens.shape[0])

        def run_block(_, block):
            index, token_rows, expert = block

            def compute():
                return self.experts.forward(padded[token_rows], expert, stacks)

            out = jax.lax.cond(
                index < used, compute, lambda: _zeros_varying_like((token_rows.shape[0], hidden), tokens.dtype, padded, *stacks)
            )
            return None, out

        indices = jnp.arange(rows.shape[0])
        _, outputs = jax.lax.scan(run_block, None, (indices, token_of, block_expert))
        scale = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])
        contributions = outputs * scale[jnp.minimum(rows, count)][..., None].astype(outputs.dtype)
        out = jnp.zeros((tokens.shape[0] + 1, hidden), tokens.dtype).at[token_of.reshape(-1)].add(
            contributions.reshape(-1, hidden)
        )
        return out[:-1]

    def _grouped(self, tokens, weights, chosen, stacks, counted: int):
        """`_run_experts` as grouped products: the assignments sorted by expert
        (ids from `counted` on, another device's experts, last and left out), each
        token's rows gathered back and summed (float32) with their weights."""
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=counted).astype(jnp.int32)
        out = self.experts.grouped_forward(tokens[order // self.top_k], group_sizes, flat[order], stacks)
        per_token = out[jnp.argsort(order)].reshape(tokens.shape[0], self.top_k, tokens.shape[-1])
        summed = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), per_token.astype(jnp.float32))
        return summed.astype(tokens.dtype)

    def _on_mesh(self, x, placement):
        """The experts on a mesh, as one program per device (`shard_map`).

        Each device takes its own tokens, plus those of the devices that share its
        token rows but hold other experts or another slice of the MLP width (the
        `expert` and, under Megatron rules, `tensor` axes), routes them, and runs the
        assignments to its own experts with its own width slice. The partial outputs
        are summed (float32) back onto the devices that own the tokens: a
        reduce-scatter over the axes the tokens were gathered over, an all-reduce over
        the rest. So expert parallelism moves tokens, not weights, and attention stays
        data-parallel across `expert`. Routing and sorting per device keep a split
        batch split (a global top-k and sort would gather every token). Only this
        layer's expert weights enter, so weights split along `embed` (FSDP) are
        gathered one layer at a time.
        """
        token_spec = placement.spec(("batch",) + (None,) * (x.ndim - 1), x.shape)
        token_axes = _axes(_entry(token_spec, 0))
        weights, axes, splits = [], [], []
        for weight, own in self.experts.arrays():
            weight = weight.materialize() if isinstance(weight, LayerSlice) else weight
            own = ("experts",) + tuple(None if a == "embed" else a for a in own)  # whole rows of `embed` each
            # A quantized stack splits by its count of groups (see sharding.partition_specs).
            shape = weight.scales.shape if isinstance(weight, QuantizedWeight) else weight.shape
            weights.append(weight)
            axes.append(own)
            splits.append({a: e for a, e in zip(own, placement.spec(own, shape)) if a is not None})
        # Each logical axis splits one way in all the weights (the `mlp` output of
        # gate/up is down's input) or not at all: a quantized down projection
        # whose groups the split does not divide keeps the MLP width whole.
        agreed = {a: splits[0].get(a) if all(s.get(a) == splits[0].get(a) for s in splits) else None
                  for s in splits for a in s}
        specs = [PartitionSpec(*(None if a is None else agreed.get(a) for a in own)) for own in axes]
        array_specs = [jax.tree.map(lambda _, spec=spec: spec, w) if isinstance(w, QuantizedWeight) else spec
                       for w, spec in zip(weights, specs)]
        expert_axes = _axes(_entry(specs[0], 0))
        width_axes = _axes(_entry(specs[0], 1))
        partial_axes = expert_axes + width_axes  # devices whose outputs are partial sums
        gather_axes = tuple(a for a in token_axes if a in partial_axes)
        sum_axes = tuple(a for a in partial_axes if a not in gather_axes)
        sizes = placement.axis_sizes
        local = self.num_experts // math.prod(sizes[a] for a in expert_axes)
        whole = lambda a: a.materialize() if isinstance(a, LayerSlice) else a
        router = jax.tree.map(whole, self.gate, is_leaf=lambda a: isinstance(a, LayerSlice))

        def on_device(x, router, weights):
            tokens = x.reshape(-1, x.shape[-1])
            if gather_axes:
                tokens = jax.lax.all_gather(tokens, gather_axes, tiled=True)
            # Everything the expert loop reads varies over the same axes from here on:
            # otherwise JAX casts inside its `cond` branches, and those casts
            # transpose to collectives that only the devices taking a branch reach.
            arrays, structure = jax.tree.flatten(weights)
            tokens, *arrays = _vary_alike(tokens, *arrays)
            weights = jax.tree.unflatten(structure, arrays)
            weights_of, chosen = self.route_tokens(router, tokens)
            if expert_axes:
                first = jax.lax.axis_index(expert_axes) * local
                mine = (chosen >= first) & (chosen < first + local)
                chosen = jnp.where(mine, chosen - first, local)  # `local`: another device's expert
                weights_of = jnp.where(mine, weights_of, 0)
                out = self._run_experts(tokens, weights_of, chosen, weights, local + 1, local_experts=local)
            else:
                out = self._run_experts(tokens, weights_of, chosen, weights, local)
            out = out.astype(jnp.float32)
            if gather_axes:
                out = jax.lax.psum_scatter(out, gather_axes, tiled=True)
            if sum_axes:
                out = jax.lax.psum(out, sum_axes)
            return out.astype(x.dtype).reshape(x.shape)

        return jax.shard_map(
            on_device,
            mesh=placement.mesh,
            in_specs=(token_spec, PartitionSpec(), tuple(array_specs)),
            out_specs=token_spec,
        )(x, router, tuple(weights))


def _vary_alike(*arrays) -> list[Array]:
    """`arrays`, each cast (inside `shard_map`) to vary over every mesh axis that any
    of them varies over."""
    varying = lambda a: set(jax.typeof(a).manual_axis_type.varying)
    union = set().union(*map(varying, arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def _zeros_varying_like(shape, dtype, *references) -> Array:
    """Zeros that, inside `shard_map`, vary over the same mesh axes as any of
    `references` (the other branch of a `cond` computes from them, and both branches
    must have one type). Made by arithmetic on one element of each: a `pcast`
    would transpose to a collective inside the branch that only some devices take,
    and the backward pass would deadlock."""
    arrays = jax.tree.leaves([r.stack if isinstance(r, LayerSlice) else r for r in references])
    zero = sum(jnp.zeros_like(a.reshape(-1)[0]).astype(dtype) for a in arrays)
    return jnp.broadcast_to(zero, shape)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry, as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(spec: PartitionSpec, axis: int):
    return spec[axis] if axis < len(spec) else None


def router_and_experts(
    hidden_size: int, intermediate_size: int, num_experts: int, *, hidden_act: str, key: PRNGKeyArray
) -> tuple[Linear, Experts]:
    """A router `Linear` (`[experts, hidden]`, no bias) and `num_experts` gated MLPs."""
    k_gate, k_experts = jax.random.split(key)
    gate = Linear(hidden_size, num_experts, axes=("router", "embed"), key=k_gate)
    return gate, Experts(num_experts, hidden_size, intermediate_size, hidden_act=hidden_act, key=k_experts)


class SparseMoeBlock(AbstractSparseMoeBlock):
    """Router (`gate`) plus `experts`, HF's `Qwen3MoeSparseMoeBlock` / Mixtral's block:
    a softmax over the router's logits, the `top_k` largest, renormalised with
    `norm_topk_prob`."""

    gate: Linear
    experts: Experts
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        hidden_act: str = "silu",
        key: PRNGKeyArray,
    ):
        self.gate, self.experts = router_and_experts(
            hidden_size, intermediate_size, num_experts, hidden_act=hidden_act, key=key
        )
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def route_tokens(
        self, gate: eqx.Module, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        return route(gate(tokens), self.top_k, self.norm_topk_prob)

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        return self.routed_experts(x)


def dense_mlp(config: DecoderConfig, key: PRNGKeyArray) -> GatedMLP:
    """A layer's dense feed-forward block as `config` describes it."""
    return GatedMLP(
        config.hidden_size, config.intermediate_size, hidden_act=config.hidden_act, use_bias=config.mlp_bias, key=key
    )


def sparse_mlp(config: DecoderConfig, key: PRNGKeyArray) -> SparseMoeBlock:
    """A layer's mixture-of-experts block as `config` describes it."""
    return SparseMoeBlock(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        hidden_act=config.hidden_act,
        key=key,
    )


def mlp_for(config: DecoderConfig, key: PRNGKeyArray, sparse: bool) -> GatedMLP | SparseMoeBlock:
    """A layer's MLP: the mixture-of-experts block if `sparse`, else the dense one."""
    return sparse_mlp(config, key) if sparse else dense_mlp(config, key)


class MixedMLP(AbstractLayerSelectable):
    """The MLPs of a layer stack in which only some layers are sparse (Qwen3-MoE's
    `mlp_only_layers` / `decoder_sparse_step`).

    Dense MLPs are stacked over the dense layers, MoE blocks over the sparse ones,
    so neither kind carries weights for the other's layers. Inside the scan, layer
    `i` looks up its kind and its place in that stack (`select_layer`) and runs one
    branch of a `lax.cond`: still one scan over all layers.
    """

    dense: GatedMLP
    sparse: AbstractSparseMoeBlock
    sparse_layers: tuple[int, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)

    def __init__(
        self,
        config: DecoderConfig,
        sparse_layers: tuple[int, ...],
        make_mlp: Callable[[DecoderConfig, PRNGKeyArray, bool], eqx.Module] | None = None,
        *,
        key: PRNGKeyArray,
    ):
        """`make_mlp(config, key, sparse)` builds one layer's MLP of either kind
        (default: `GatedMLP` or `SparseMoeBlock` as `config` describes them)."""
        make_mlp = make_mlp or mlp_for
        k_dense, k_sparse = jax.random.split(key)
        self.num_layers = config.num_hidden_layers
        self.sparse_layers = tuple(sparse_layers)
        dense_keys = jax.random.split(k_dense, len(self.dense_layers))
        self.dense = eqx.filter_vmap(lambda k: make_mlp(config, k, False))(dense_keys)
        sparse_keys = jax.random.split(k_sparse, len(sparse_layers))
        self.sparse = eqx.filter_vmap(lambda k: make_mlp(config, k, True))(sparse_keys)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.sparse_layers)

    def substack_layers(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}dense.": self.dense_layers, f"{prefix}sparse.": self.sparse_layers}

    def select_layer(self, index: Int[Array, ""]) -> "MixedMLPLayer":
        is_sparse = [i in self.sparse_layers for i in range(self.num_layers)]
        # Each layer's position in its own kind's stack (0 in the other, unused).
        slot = [(self.sparse_layers if s else self.dense_layers).index(i) for i, s in enumerate(is_sparse)]
        here, sparse_here = jnp.asarray(slot, jnp.int32)[index], jnp.asarray(is_sparse)[index]
        return MixedMLPLayer(
            layer_view(self.dense, jnp.where(sparse_here, 0, here)),
            layer_view(self.sparse, jnp.where(sparse_here, here, 0)),
            sparse_here,
        )


class MixedMLPLayer(eqx.Module):
    """One layer of a `MixedMLP`: both kinds' views, and which one this layer is."""

    dense: GatedMLP
    sparse: AbstractSparseMoeBlock
    is_sparse: Array

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        return jax.lax.cond(self.is_sparse, lambda h: self.sparse(h), lambda h: self.dense(h), x)
