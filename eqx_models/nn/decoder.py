"""The decoder layer, and the stack of layers run with `jax.lax.scan`."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import sharding
from ..architecture import architecture_of
from ..cache import KVCache
from ..config import DecoderConfig
from ..ops import NO_WINDOW
from ..paged_cache import PagedKVCache, RaggedPagedKVCache
from ..sharding import stacked_field
from .attention import AbstractAttention, Attention, LayerInputs
from .linear import Embedding, layer_view
from .moe import AbstractSparseMoeBlock, MixedMLP, mlp_for
from .mlp import GatedMLP
from .norm import RMSNorm
from .rope import RotaryEmbedding

# What the backward pass keeps from a layer's forward pass (`CausalLM.with_remat`):
# "none" keeps everything, "full" only the layer's input (the layer is recomputed),
# "dots" the outputs of the weight matmuls (the rest is recomputed).
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _positions_in_segments(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Each token's distance from the first token of its run of equal segment ids."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class AbstractDecoderLayer(eqx.Module):
    """The contract every architecture's layer follows.

    Built as `layer(config, key=key)` (with `mlp=False` it leaves `mlp` as None, for
    a stack that sets a `MixedMLP` after, built from `mlp_for`), stacked with
    `eqx.filter_vmap`, and called as `layer(x, inputs, cached)` with the decoder's
    `LayerInputs` and this layer's cache view, returning the new hidden states and
    this step's keys/values. A layer with a recurrent state returns a third item:
    with a cache, the cache's whole state with its own entries updated
    (`StateView`); without one, its own state after the tokens.
    """

    mlp: eqx.AbstractVar[eqx.Module | None]

    @staticmethod
    @abc.abstractmethod
    def mlp_for(config: DecoderConfig, key: PRNGKeyArray, sparse: bool) -> eqx.Module:
        """This layer's MLP when dense (`sparse=False`) or a mixture of experts."""

    @abc.abstractmethod
    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        inputs: LayerInputs,
        cached=None,
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        """The layer applied to `x`.

        Returns:
            The new hidden states and this step's keys and values.
        """


class AbstractPreNormLayer(AbstractDecoderLayer):
    """Pre-norm block (Llama): `x + attn(input_layernorm(x))`, then
    `x + mlp(post_attention_layernorm(x))`, whatever the attention, MLP and norms."""

    self_attn: eqx.AbstractVar[AbstractAttention]
    input_layernorm: eqx.AbstractVar[eqx.Module]
    post_attention_layernorm: eqx.AbstractVar[eqx.Module]

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        inputs: LayerInputs,
        cached=None,
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        """The block applied to `x`.

        Returns:
            The new hidden states and this step's keys and values.
        """
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), inputs, cached)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class DecoderLayer(AbstractPreNormLayer):
    """Llama's layer: `Attention`, `GatedMLP` or `SparseMoeBlock` (`mlp_for`), RMSNorm."""

    self_attn: Attention
    mlp: GatedMLP | AbstractSparseMoeBlock | MixedMLP | None
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention.from_config(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, bool(config.sparse_layers)) if mlp else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    mlp_for = staticmethod(mlp_for)


class AbstractLayerBlock(eqx.Module):
    """Several layers stacked and scanned as one step (`DecoderConfig.layers_per_block
    > 1`; Qwen3-Next's period of DeltaNet and attention layers): built as
    `block(config, key=key)` and called like a layer, its cache entries one per block.
    """

    @abc.abstractmethod
    def substack_layers(self) -> dict[str, tuple[int, ...]]:
        """Leaves stacked over a subset of the layers: their path under the block ->
        the layer numbers they hold, in order (for the checkpoint names)."""

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None) -> tuple:
        """The block's layers applied to `x` in turn.

        Returns:
            The new hidden states and the block's new cache entries.
        """


def _stack_layers(layer_cls, config: DecoderConfig, key: PRNGKeyArray):
    """`config.num_blocks` layers (or blocks of layers) of `layer_cls` stacked along
    a leading axis.

    When only some layers are sparse, each kind of MLP is stacked over its own
    layers (`MixedMLP`), so neither carries weights for the other's layers. A block
    of several layers arranges its MLPs itself.
    """
    layer_keys = jax.random.split(key, config.num_blocks)
    sparse_layers = config.sparse_layers
    if config.layers_per_block > 1 or not 0 < len(sparse_layers) < config.num_hidden_layers:
        return eqx.filter_vmap(lambda k: layer_cls(config, key=k))(layer_keys)
    layers = eqx.filter_vmap(lambda k: layer_cls(config, key=k, mlp=False))(layer_keys)
    mixed = MixedMLP(config, sparse_layers, layer_cls.mlp_for, key=jax.random.fold_in(key, 1))
    return eqx.tree_at(lambda l: l.mlp, layers, mixed, is_leaf=lambda x: x is None)


class Decoder(eqx.Module):
    """Embeddings, the stacked decoder layers and the final norm (HF's `model`).

    `layers` is one layer module (the architecture's class; `DecoderLayer` unless it
    brings its own) whose array leaves carry a leading `layers` axis. With
    `scan_layers=True` the stack runs under `jax.lax.scan`, so compile time does not
    grow with depth; `scan_layers=False` unrolls a Python loop over the same stacked
    weights (for debugging and comparison; the numbers are identical).

    Layers may attend differently (`DecoderConfig.attention_kinds`: sliding or
    global, their own rotary base, no rotary at all): the rotary tables and masks
    are built once per distinct kind, and each layer takes its own kind's.
    """

    embed_tokens: Embedding
    layers: eqx.Module = stacked_field("layers")
    norm: eqx.Module
    kinds: tuple[RotaryEmbedding, ...]
    windows: tuple[int | None, ...] = eqx.field(static=True)
    layer_kinds: tuple[int, ...] = eqx.field(static=True)
    scan_layers: bool = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, scan_layers: bool = True):
        arch = architecture_of(config)
        k_embed, k_layers = jax.random.split(key)
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, scale=arch.embed_scale(config), key=k_embed
        )
        self.layers = _stack_layers(arch.layer or DecoderLayer, config, k_layers)
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if arch.norm is None else arch.norm(config, config.hidden_size)
        )
        per_layer = config.attention_kinds()
        distinct = list(dict.fromkeys(per_layer))
        self.kinds = tuple(RotaryEmbedding(config.rotary_dim, kind.rope_theta, kind.rope_scaling) for kind in distinct)
        self.windows = tuple(kind.window for kind in distinct)
        self.layer_kinds = tuple(distinct.index(kind) for kind in per_layer)
        self.scan_layers = scan_layers
        self.remat = "none"

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def ring_window(self) -> int | None:
        """The cache's ring size: the window when every layer slides through the
        same one, else None (full layers need every position; sliding ones are
        masked)."""
        return self.windows[0] if len(set(self.windows)) == 1 else None

    def substack_layers(self) -> dict[str, tuple[int, ...]]:
        """Leaves of `layers` stacked over a subset of the layers: their path under
        `layers` -> the layer numbers they hold, in order (for the checkpoint names).
        A block of several layers says which through its own `substack_layers()`."""
        if isinstance(self.layers, AbstractLayerBlock):
            return self.layers.substack_layers()
        if isinstance(self.layers, AbstractDecoderLayer) and isinstance(self.layers.mlp, MixedMLP):
            return self.layers.mlp.substack_layers("mlp.")
        return {}

    def _layer_inputs(self, positions, attention_mask, segment_ids, cache) -> list[LayerInputs]:
        """The rotary tables and window of each kind of layer, with the positions."""
        slot_positions = None if cache is None else cache.slot_positions
        out = []
        for rotary, window in zip(self.kinds, self.windows):
            cos, sin = rotary(positions)
            window = NO_WINDOW if window is None else window
            out.append(LayerInputs(cos, sin, positions, attention_mask, segment_ids, slot_positions, window))
        return out

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
        cache: KVCache | PagedKVCache | RaggedPagedKVCache | None = None,
        *,
        new_cache_length: int | None = None,
        new_cache_dtype=None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], KVCache | PagedKVCache | RaggedPagedKVCache | None]:
        """Runs the stack; returns the final hidden states and the updated cache.

        With `cache=None` and `new_cache_length`, the tokens attend only to each
        other and their keys/values go into a new cache of that many slots (a
        prefill that does not read an empty cache), of `new_cache_dtype` (default:
        the embeddings' dtype). `segment_ids` (packed
        documents, no cache) keeps attention within each run of equal ids and
        restarts positions at each run's first token.
        """
        if segment_ids is not None and (cache is not None or new_cache_length is not None):
            raise ValueError("segment_ids (packed sequences) are for a forward pass without a cache.")
        x = sharding.constrain(self.embed_tokens(input_ids), ("batch", None, None))
        if cache is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        else:
            positions = cache.new_positions(attention_mask)
        if segment_ids is not None:
            positions = _positions_in_segments(segment_ids)
        kinds = self._layer_inputs(positions, attention_mask, segment_ids, cache)
        if len(kinds) > 1:
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *kinds)
            kind_of = jnp.asarray(self.layer_kinds, jnp.int32)

        # A cache's recurrent state is carried through the loop: each layer updates
        # its entries where they lie, and no copy of the whole state is made.
        carried = None if cache is None else cache.state

        def run_layer(carry, index):
            # Weights and cache enter the loop whole; each layer refers to its slice
            # by index (see `LayerSlice`, `LayerKV`) rather than receiving a copy.
            h, state = carry
            layer = layer_view(self.layers, index)
            layer_kv = None if cache is None else cache.layer(index, state)
            inputs = kinds[0] if len(kinds) == 1 else jax.tree.map(lambda a: a[kind_of[index]], stacked)
            h, new = layer(h, inputs, layer_kv)
            if state is not None:
                *new, state = new
            return (sharding.constrain(h, ("batch", None, None)), state), tuple(new)

        if self.remat != "none":
            # Inside a scan CSE across iterations is impossible anyway; preventing it
            # only costs (as jax.checkpoint's documentation advises for loops).
            run_layer = jax.checkpoint(run_layer, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)
        indices = jnp.arange(self.num_layers, dtype=jnp.int32)
        if self.scan_layers:
            (x, carried), new = jax.lax.scan(run_layer, (x, carried), indices)
        else:
            per_layer = []
            for i in range(self.num_layers):
                (x, carried), layer_new = run_layer((x, carried), indices[i])
                per_layer.append(layer_new)
            new = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        # Keys, values and, where the layers have one, the recurrent state after this
        # call: carried with a cache, else each layer's own, stacked.
        new_keys, new_values, new_state = (*new, carried)[:3]
        if cache is None and new_cache_length is not None:
            layers, batch, kv_heads, _, head_dim = new_keys.shape
            cache = KVCache.empty(
                layers, batch, kv_heads, new_cache_length, head_dim, new_cache_dtype or self.embed_tokens.weight.dtype,
                self.ring_window,
                new_values.shape[-1],
            )
        if cache is not None:
            cache = cache.append(new_keys, new_values, attention_mask, new_state)
        return self.norm(x), cache
