"""A decoder with a language-model head: the model `from_pretrained` returns."""

import copy
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..cache import KVCache, resolve_cache_dtype
from ..paged_cache import PagedKVCache, RaggedPagedKVCache
from .. import sharding
from ..architecture import architecture_of
from ..config import DecoderConfig
from ..device_memory import free_bytes, gib, refuse_unless_fits
from .decoder import REMAT_POLICIES, Decoder
from .linear import Linear


@functools.lru_cache(maxsize=32)
def _placed_cache_maker(arguments: tuple, placement: "sharding.Placement"):
    """A jitted `KVCache.for_config(*arguments)` whose arrays are made on their
    shards (one compilation per cache shape and layout)."""
    make = lambda: KVCache.for_config(*arguments)
    return jax.jit(make, out_shardings=sharding.shardings(jax.eval_shape(make), placement))


@eqx.filter_jit
def _compiled_forward(model: "CausalLM", *arguments, **keywords):
    """`model._forward` compiled once per shape and option: called outside `jit`,
    a plain forward pass would otherwise run op by op and compile the layer scan
    afresh on every call (a decode loop of eager calls spends most of its time
    there). Inside a caller's `jit` it is inlined."""
    return model._forward(*arguments, **keywords)


class CausalLM(eqx.Module):
    """Decoder-only language model (HF's `*ForCausalLM`): what `from_pretrained`
    returns.

    Weight paths mirror Hugging Face: `model.layers.self_attn.q_proj.weight` here is
    `model.layers.{i}.self_attn.q_proj.weight` there, stacked over `i`. With tied
    embeddings `lm_head` is None and the embedding table projects the logits.
    Construct it directly only for random weights (tests, shapes); otherwise load.

    Args:
        config: the architecture's hyperparameters.
        key: PRNG key for the random initial weights (std 0.02, as `transformers`).
        scan_layers: run the stacked layers under `jax.lax.scan` (True) or in an
            unrolled Python loop over the same stacked weights (False, for debugging).

    Attributes:
        model: the `Decoder`: `embed_tokens`, the stacked `layers`, the final `norm`.
        lm_head: the vocabulary projection `[vocab, hidden]`, or None when tied.
        config: the `DecoderConfig`.
        placement: the mesh layout after `shard_model` or `from_pretrained(mesh=...)`,
            else None.
    """

    model: Decoder
    lm_head: Linear | None
    config: DecoderConfig = eqx.field(static=True)
    placement: sharding.Placement | None = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, scan_layers: bool = True):
        k_model, k_head = jax.random.split(key)
        self.model = Decoder(config, key=k_model, scan_layers=scan_layers)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, axes=("vocab", "embed"), key=k_head)
        )
        self.config = config
        self.placement = None

    def __call__(
        self,
        input_ids: Int[Array | np.ndarray, "batch seq"],
        cache: KVCache | PagedKVCache | RaggedPagedKVCache | None = None,
        attention_mask: Int[Array | np.ndarray, "batch seq"] | None = None,
        *,
        logits_to_keep: int | None = None,
        logits_at: Int[Array | np.ndarray, "batch keep"] | None = None,
        segment_ids: Int[Array | np.ndarray, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch _ vocab"], KVCache | PagedKVCache | RaggedPagedKVCache | None]:
        """Next-token logits for every position, and the updated cache.

        Args:
            input_ids: token ids `[batch, seq]` (a jax or numpy array).
            cache: a `KVCache` from `init_cache` (or a previous call), a
                `PagedKVCache` (the serving engine's), a `RaggedPagedKVCache` (its
                ragged step: `input_ids` of shape `[1, tokens]`), or None for a plain
                forward pass. Prefill, chunked prefill and decode are all this one call
                with a longer or shorter `input_ids`.
            attention_mask: `[batch, seq]`, 1 for real tokens and 0 for padding
                (left padding for a ragged batch). Defaults to all ones.
            logits_to_keep: if given, only the last this-many positions get logits
                (generation needs one; the vocabulary projection is the costly part).
            logits_at: `[batch, keep]` positions of each row whose logits are
                wanted (a ragged step's rows end anywhere); not with `logits_to_keep`.
            segment_ids: `[batch, seq]` document ids of packed sequences (no cache):
                tokens attend only within their run of equal ids, and positions
                restart at the start of each run.

        Returns:
            `(logits, cache)`: logits `[batch, seq or logits_to_keep, vocab]` in the
            activation dtype, and the cache with this call's keys/values appended
            (None when no cache was given).
        """
        if logits_at is not None and logits_to_keep is not None:
            raise ValueError("Give logits_to_keep (the last positions) or logits_at (chosen ones), not both.")
        return _compiled_forward(self, input_ids, attention_mask, cache, None, logits_to_keep, segment_ids=segment_ids,
                                 logits_at=logits_at)

    def prefill(
        self,
        input_ids: Int[Array | np.ndarray, "batch seq"],
        max_length: int,
        attention_mask: Int[Array | np.ndarray, "batch seq"] | None = None,
        *,
        logits_to_keep: int | None = None,
        cache_dtype=None,
    ) -> tuple[Float[Array, "batch _ vocab"], KVCache]:
        """Runs a prompt into a new cache with room for `max_length` tokens per row.

        Equal to `model(input_ids, cache=model.init_cache(batch, max_length), ...)`,
        without attending to the empty cache (which costs `seq x max_length` work).

        Args:
            input_ids: prompt token ids `[batch, seq]`.
            max_length: slots per row of the new cache (prompt plus what will follow;
                with a sliding window, a ring of at most `sliding_window` slots).
            attention_mask: `[batch, seq]`, 1 for real tokens, 0 for left padding.
            logits_to_keep: if given, logits only for the last this-many positions.
            cache_dtype: the new cache's dtype (see `init_cache`); defaults to the model's.

        Returns:
            `(logits, cache)`: logits `[batch, seq or logits_to_keep, vocab]` and the
            `KVCache` holding the prompt.
        """
        cache_dtype = None if cache_dtype is None else resolve_cache_dtype(cache_dtype)
        self.check_cache_fits(np.shape(input_ids)[0], max_length, cache_dtype)
        return _compiled_forward(self, input_ids, attention_mask, None, max_length, logits_to_keep, cache_dtype)

    def _forward(
        self, input_ids, attention_mask, cache, new_cache_length, logits_to_keep, new_cache_dtype=None,
        segment_ids=None, logits_at=None,
    ):
        input_ids = jnp.asarray(input_ids)
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        attention_mask = jnp.asarray(attention_mask, jnp.int32)
        placement = self.placement
        if placement is not None:
            input_ids = placement.constrain(input_ids, ("batch", None))
            attention_mask = placement.constrain(attention_mask, ("batch", None))
        with sharding.active(placement):  # blocks traced below see the mesh
            hidden, cache = self.model(
                input_ids, attention_mask, cache, new_cache_length=new_cache_length, new_cache_dtype=new_cache_dtype,
                segment_ids=None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32),
            )
            if logits_to_keep is not None:
                hidden = hidden[:, -logits_to_keep:]
            if logits_at is not None:
                hidden = jnp.take_along_axis(hidden, jnp.asarray(logits_at, jnp.int32)[..., None], axis=1)
            if self.lm_head is None:
                logits = self.model.embed_tokens.attend(hidden)
            else:
                logits = self.lm_head(hidden)
            finalize = architecture_of(self.config).finalize_logits
            if finalize is not None:
                logits = finalize(self.config, logits)
        if placement is not None:
            logits = placement.constrain(logits, ("batch", None, "vocab"))
            if isinstance(cache, KVCache):
                cache = sharding.constrain_cache(cache, placement)
        return logits, cache

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the weights (and of activations and the cache)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def scan_layers(self) -> bool:
        return self.model.scan_layers

    def with_scan_layers(self, scan_layers: bool) -> "CausalLM":
        """The same weights, run with `jax.lax.scan` or an unrolled loop.

        Args:
            scan_layers: True for the scan, False for a Python loop over the same
                stacked arrays (identical numbers under `jit`; compile time grows
                with depth).

        Returns:
            A `CausalLM` sharing this one's arrays.
        """
        decoder = copy.copy(self.model)
        object.__setattr__(decoder, "scan_layers", scan_layers)
        return eqx.tree_at(lambda m: m.model, self, decoder)

    def with_remat(self, policy: str) -> "CausalLM":
        """The same weights, with each layer's forward pass rematerialised in the
        backward pass. Numbers are identical; peak training memory is not.

        Args:
            policy: `"none"` (keep every activation), `"full"` (keep only each
                layer's input; recompute the layer) or `"dots"` (keep the weight
                matmuls' outputs).

        Returns:
            A `CausalLM` sharing this one's arrays.
        """
        if policy not in REMAT_POLICIES:
            raise ValueError(f"Unknown remat policy {policy!r}; choose one of {sorted(REMAT_POLICIES)}.")
        decoder = copy.copy(self.model)
        object.__setattr__(decoder, "remat", policy)
        return eqx.tree_at(lambda m: m.model, self, decoder)

    def with_placement(self, placement: "sharding.Placement | None") -> "CausalLM":
        """The same model, recorded as laid out by `placement` (see `shard_model`,
        which also moves the weights).

        Args:
            placement: a `sharding.Placement` (mesh and rules), or None for one device.

        Returns:
            A `CausalLM` sharing this one's arrays.
        """
        out = copy.copy(self)
        object.__setattr__(out, "placement", placement)
        return out

    def cache_bytes(self, batch_size: int, max_length: int, dtype=None) -> int:
        """Bytes per device of `init_cache(batch_size, max_length, dtype)`, from shapes
        alone (nothing is allocated).

        Args:
            batch_size: rows.
            max_length: slots per row.
            dtype: the cache dtype (see `init_cache`); defaults to the model's.

        Returns:
            The bytes of the cache's arrays on each device (all of them off a mesh).
        """
        dtype = resolve_cache_dtype(dtype or self.dtype)
        arguments = (self.config, batch_size, max_length, dtype, self.model.ring_window)
        shapes = jax.eval_shape(lambda: KVCache.for_config(*arguments))
        if self.placement is not None:
            return sharding.per_device_bytes(shapes, self.placement)
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))

    def check_cache_fits(self, batch_size: int, max_length: int, dtype=None, *, note: str = "") -> None:
        """Refuses a cache that the model's accelerator has not the free memory for,
        before it is allocated. Nothing is checked on the CPU (it reports no device
        memory) or while tracing.

        Args:
            batch_size: rows.
            max_length: slots per row.
            dtype: the cache dtype (see `init_cache`); defaults to the model's.
            note: added to the message (how a caller sized the cache).

        Raises:
            OutOfDeviceMemory: the cache needs more than the least free memory among
                the model's devices; the message gives the bytes needed and free,
                the largest batch and length that fit, and the int8 cache's size.
        """
        devices = self.devices()
        if not devices:
            return
        dtype = resolve_cache_dtype(dtype or self.dtype)
        needed = self.cache_bytes(batch_size, max_length, dtype)
        free = free_bytes(devices)
        if free is None or needed <= free[0]:
            return
        available = free[0]
        fixes = []
        per_row = self.cache_bytes(1, max_length, dtype)
        if available >= per_row:
            fixes.append(f"batch {available // per_row} at {max_length} slots")
        per_slot = self.cache_bytes(batch_size, max_length + 1, dtype) - needed  # 0 for a ring already full
        if per_slot > 0 and available > needed - per_slot * max_length:
            fixes.append(f"{int((available - (needed - per_slot * max_length)) // per_slot)} slots at batch {batch_size}")
        if dtype != jnp.int8:
            smaller = self.cache_bytes(batch_size, max_length, "int8")
            fixes.append(f"cache_dtype='int8' ({gib(smaller)}{'' if smaller <= available else ', still too large'})")
        fixes.append("(each of these fills the free memory: leave room for the program's temporaries)")
        what = f"A KV cache of batch {batch_size} x {max_length} slots ({jnp.dtype(dtype).name}){note}"
        refuse_unless_fits(what, needed, devices, fixes)

    def devices(self) -> list:
        """The devices holding the model's arrays.

        Returns:
            The mesh's devices on a mesh, else those of the model's first array;
            [] while the model is being traced.
        """
        if self.placement is not None:
            mesh_devices = getattr(self.placement.mesh, "devices", None)  # an abstract mesh has none
            return [] if mesh_devices is None else list(mesh_devices.flat)
        leaf = next((a for a in jax.tree.leaves(self) if isinstance(a, jax.Array)), None)
        if leaf is None or isinstance(leaf, jax.core.Tracer):
            return []
        return list(leaf.devices())

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_length` tokens.

        With sliding-window attention on every layer it is a ring of at most
        `sliding_window` slots that takes any number of tokens. On a mesh it is
        created split by batch and KV heads.

        Args:
            batch_size: rows.
            max_length: slots per row.
            dtype: the cache dtype; defaults to the model's. `"int8"` stores keys
                and values as int8 with a float32 scale per token and head: about
                half the bytes of bfloat16, for long contexts.

        Returns:
            A `KVCache` with keys and values `[layers, batch_size, kv_heads,
            max_length or window, head_dim]`, nothing written.
        """
        dtype = resolve_cache_dtype(dtype or self.dtype)
        self.check_cache_fits(batch_size, max_length, dtype)
        arguments = (self.config, batch_size, max_length, dtype, self.model.ring_window)
        if self.placement is None:
            return KVCache.for_config(*arguments)
        return _placed_cache_maker(arguments, self.placement)()
