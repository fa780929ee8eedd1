"""The decoder layer, and the stack of layers run with `jax.lax.scan`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import sharding
from ..cache import KVCache
from ..paged_cache import PagedKVCache
from ..config import DecoderConfig
from .attention import Attention
from .linear import Embedding, layer_view
from .mlp import GatedMLP
from .moe import MixedMLP, SparseMoeBlock, dense_mlp, sparse_mlp
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


class DecoderLayer(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    With sandwich norms (Gemma) each sublayer's output is normalised too:
    `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
    `x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`; otherwise
    `post_attention_layernorm` is the norm before the MLP, as in Llama.
    """

    self_attn: Attention
    mlp: GatedMLP | SparseMoeBlock | MixedMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm | None
    post_feedforward_layernorm: RMSNorm | None

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, mlp: bool = True):
        """`mlp=False` leaves `mlp` as None, for a stack that sets a `MixedMLP` after."""
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            use_bias=config.attention_bias,
            output_bias=config.o_proj_bias,
            qk_norm_eps=config.rms_norm_eps if config.use_qk_norm else None,
            norm_unit_offset=config.norm_unit_offset,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            key=k_attn,
        )
        every_layer_sparse = len(config.sparse_layers) == config.num_hidden_layers
        self.mlp = (sparse_mlp(config, k_mlp) if every_layer_sparse else dense_mlp(config, k_mlp)) if mlp else None
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms else None

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
        new_allowed: Bool[Array, "batch seq seq"],
        cached=None,
        cached_allowed: Bool[Array, "batch seq kv_seq"] | None = None,
    ) -> tuple[
        Float[Array, "batch seq hidden"],
        tuple[Float[Array, "batch kv_heads seq head_dim"], Float[Array, "batch kv_heads seq head_dim"]],
    ]:
        attn_out, new_kv = self.self_attn(
            self.input_layernorm(x), cos, sin, new_allowed, cached, cached_allowed
        )
        if self.pre_feedforward_layernorm is None:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x)), new_kv
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), new_kv


class Decoder(eqx.Module):
    """Embeddings, the stacked decoder layers and the final norm (HF's `model`).

    `layers` is one `DecoderLayer` whose array leaves carry a leading `layers` axis.
    With `scan_layers=True` the stack runs under `jax.lax.scan`, so compile time
    does not grow with depth; `scan_layers=False` unrolls a Python loop over the
    same stacked weights (for debugging and comparison; the numbers are identical).
    """

    embed_tokens: Embedding
    layers: DecoderLayer
    norm: RMSNorm
    rotary_emb: RotaryEmbedding
    local_rotary_emb: RotaryEmbedding | None
    scan_layers: bool = eqx.field(static=True)
    remat: str = eqx.field(static=True)
    sliding_window: int | None = eqx.field(static=True)
    sliding_layers: tuple[bool, ...] = eqx.field(static=True)
    embed_scale: float | None = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, scan_layers: bool = True):
        k_embed, k_layers = jax.random.split(key)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, key=k_embed)
        layer_keys = jax.random.split(k_layers, config.num_hidden_layers)
        sparse_layers = config.sparse_layers
        if 0 < len(sparse_layers) < config.num_hidden_layers:
            # Some layers dense, some sparse: each kind stacked over its own layers.
            layers = eqx.filter_vmap(lambda k: DecoderLayer(config, key=k, mlp=False))(layer_keys)
            mixed = MixedMLP(config, sparse_layers, key=jax.random.fold_in(k_layers, 1))
            self.layers = eqx.tree_at(lambda l: l.mlp, layers, mixed, is_leaf=lambda x: x is None)
        else:
            self.layers = eqx.filter_vmap(lambda k: DecoderLayer(config, key=k))(layer_keys)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = (
            None if config.local_rope_theta is None else RotaryEmbedding(config.head_dim, config.local_rope_theta, None)
        )
        self.scan_layers = scan_layers
        self.remat = "none"
        self.sliding_window = config.sliding_window
        self.sliding_layers = config.sliding_layers
        self.embed_scale = config.embed_scale

    @property
    def num_layers(self) -> int:
        return self.layers.input_layernorm.weight.shape[0]

    @property
    def ring_window(self) -> int | None:
        """The cache's ring size: the window when every layer slides, else None
        (global layers need every position; sliding ones are masked)."""
        return self.sliding_window if self.sliding_layers and all(self.sliding_layers) else None

    def _in_window(self, query_positions: Int[Array, "batch seq"], key_positions: Int[Array, "batch keys"]):
        """`[batch, seq, keys]`: keys among the last `sliding_window` positions of each
        query (itself included), as `transformers` masks them."""
        return query_positions[:, :, None] - key_positions[:, None, :] < self.sliding_window

    def substack_layers(self) -> dict[str, tuple[int, ...]]:
        """Leaves of `layers` stacked over a subset of the layers: their path under
        `layers` -> the layer numbers they hold, in order (for the checkpoint names)."""
        if isinstance(self.layers.mlp, MixedMLP):
            return self.layers.mlp.substack_layers("mlp.")
        return {}

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
        cache: KVCache | PagedKVCache | None = None,
        *,
        new_cache_length: int | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], KVCache | PagedKVCache | None]:
        """Runs the stack; returns the final hidden states and the updated cache.

        With `cache=None` and `new_cache_length`, the tokens attend only to each
        other and their keys/values go into a new cache of that many slots (a
        prefill that does not read an empty cache). `segment_ids` (packed
        documents, no cache) keeps attention within each run of equal ids and
        restarts positions at each run's first token.
        """
        seq = input_ids.shape[1]
        if segment_ids is not None and (cache is not None or new_cache_length is not None):
            raise ValueError("segment_ids (packed sequences) are for a forward pass without a cache.")
        x = sharding.constrain(self.embed_tokens(input_ids), ("batch", None, None))
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        if cache is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
            cached_allowed = None
        else:
            positions = cache.new_positions(attention_mask)
            cached_allowed = jnp.broadcast_to(
                cache.valid[:, None, :], (cache.batch_size, seq, cache.max_length)
            )
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        new_allowed = causal[None] & attention_mask.astype(bool)[:, None, :]
        if segment_ids is not None:
            new_allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
            positions = _positions_in_segments(segment_ids)
        # What a layer attends with, per kind: (rotary tables, new-token mask, cache mask).
        any_sliding, all_sliding = any(self.sliding_layers), all(self.sliding_layers)
        if not all_sliding:
            full = (self.rotary_emb(positions), new_allowed, cached_allowed)
        if any_sliding:
            rotary = self.rotary_emb if self.local_rotary_emb is None else self.local_rotary_emb
            windowed_cache = None if cache is None else cached_allowed & self._in_window(positions, cache.slot_positions)
            local = (rotary(positions), new_allowed & self._in_window(positions, positions), windowed_cache)
        sliding = jnp.asarray(self.sliding_layers)

        def run_layer(h, index):
            # Weights and cache enter the loop whole; each layer refers to its slice
            # by index (see `LayerSlice`, `LayerKV`) rather than receiving a copy.
            layer = layer_view(self.layers, index)
            layer_kv = None if cache is None else cache.layer(index)
            if all_sliding:
                inputs = local
            elif not any_sliding:
                inputs = full
            else:  # local and global layers (Gemma 3): this layer's kind
                inputs = jax.tree.map(lambda a, b: jnp.where(sliding[index], a, b), local, full)
            (cos, sin), allowed, allowed_cached = inputs
            h, new_kv = layer(h, cos, sin, allowed, layer_kv, allowed_cached)
            return sharding.constrain(h, ("batch", None, None)), new_kv

        if self.remat != "none":
            # Inside a scan CSE across iterations is impossible anyway; preventing it
            # only costs (as jax.checkpoint's documentation advises for loops).
            run_layer = jax.checkpoint(run_layer, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)
        indices = jnp.arange(self.num_layers, dtype=jnp.int32)
        if self.scan_layers:
            x, (new_keys, new_values) = jax.lax.scan(run_layer, x, indices)
        else:
            per_layer = []
            for i in range(self.num_layers):
                x, kv = run_layer(x, indices[i])
                per_layer.append(kv)
            new_keys = jnp.stack([k for k, _ in per_layer])
            new_values = jnp.stack([v for _, v in per_layer])
        if cache is None and new_cache_length is not None:
            layers, batch, kv_heads, _, head_dim = new_keys.shape
            cache = KVCache.empty(
                layers, batch, kv_heads, new_cache_length, head_dim, self.embed_tokens.weight.dtype, self.ring_window
            )
        if cache is not None:
            cache = cache.append(new_keys, new_values, attention_mask)
        return self.norm(x), cache
