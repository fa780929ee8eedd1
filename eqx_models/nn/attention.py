"""Multi-head attention with grouped key/value heads and an optional KV cache."""

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..axes import AbstractHasArrayAxes
from ..config import DecoderConfig
from ..ops import VisibleSlots, attends_one_token, causal_attention, masked_attention
from ..paged_cache import RaggedPagedLayerKV
from .linear import Linear, project_together
from .norm import RMSNorm
from .rope import apply_rotary, apply_rotary_interleaved


class LayerInputs(eqx.Module):
    """What the decoder hands every layer besides the hidden states: the rotary
    tables, and which tokens each new token sees, described by positions (masks are
    built from them where attention wants one: `new_allowed`, `cached_allowed`,
    and for one token per row `visible_slots`).

    The rotary tables and window are those of the layer's kind (see
    `DecoderConfig.attention_kinds`): a sliding layer sees tokens less than its
    window before it, a layer without rotary positions gets `cos = 1, sin = 0`.

    Attributes:
        cos, sin: rotary tables `[batch, seq, rotary_dim]` for the new tokens.
        positions: `[batch, seq]`, each new token's position (restarting at each
            packed document's first token).
        attention_mask: `[batch, seq]`, 1 for real tokens, 0 for padding.
        segment_ids: `[batch, seq]` document ids of packed sequences, or None.
        slot_positions: `[batch, kv_seq]`, the position of the token in each cache
            slot (-1: none), or None without a cache.
        window: the layer's sliding window (`eqx_models.ops.NO_WINDOW`: none); a
            plain int in a model with one kind of layer (kernels can specialise on
            it), a traced one where kinds alternate.
    """

    cos: Float[Array, "batch seq rotary_dim"]
    sin: Float[Array, "batch seq rotary_dim"]
    positions: Int[Array, "batch seq"]
    attention_mask: Int[Array, "batch seq"]
    segment_ids: Int[Array, "batch seq"] | None
    slot_positions: Int[Array, "batch kv_seq"] | None
    window: int | Int[Array, ""]

    def _in_window(self, keys: Int[Array, "batch keys"]) -> Bool[Array, "batch seq keys"]:
        # Keys among the last `window` positions of each query (itself included),
        # as `transformers` masks them.
        return self.positions[:, :, None] - keys[:, None, :] < self.window

    def new_allowed(self) -> Bool[Array, "batch seq seq"]:
        """Which new tokens each new token sees: earlier or itself, real, in its
        document and its window."""
        seq = self.positions.shape[1]
        allowed = jnp.tril(jnp.ones((seq, seq), bool))[None] & self.attention_mask.astype(bool)[:, None, :]
        if self.segment_ids is not None:
            allowed &= self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        return allowed & self._in_window(self.positions)

    def cached_allowed(self) -> Bool[Array, "batch seq kv_seq"] | None:
        """Which cache slots each new token sees (None without a cache)."""
        if self.slot_positions is None:
            return None
        return (self.slot_positions >= 0)[:, None, :] & self._in_window(self.slot_positions)

    def visible_slots(self) -> VisibleSlots:
        """The slots the first new token of each row sees, as the decode op takes them."""
        query = jnp.where(self.attention_mask[:, 0] > 0, self.positions[:, 0], -1)
        return VisibleSlots(self.slot_positions, query, self.window)


def use_decode_kernel(seq: int, cached, softcap: float | None = None) -> bool:
    """Whether one token per row attends through the cache's `attend_token`
    (`eqx_models.ops.decode_attention`, which the backend may run in place)."""
    return seq == 1 and cached is not None and attends_one_token(cached.dtype, softcap)


def _as_stored(cached, k: Array, v: Array) -> tuple[Array, Array]:
    """`k` and `v` rounded as the cache will hold them (float32). A cache without value
    rows keeps a value as its key's first channels, rounded with the key."""
    stored_k = cached.as_stored(k)
    if not cached.values.shape[-1]:
        return stored_k, stored_k[..., : v.shape[-1]]
    return stored_k, cached.as_stored(v)


def attend(
    q: Float[Array, "batch heads seq head_dim"],
    k: Float[Array, "batch kv_heads seq head_dim"],
    v: Float[Array, "batch kv_heads seq value_dim"],
    inputs: LayerInputs,
    cached=None,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch seq heads value_dim"]:
    """Softmax attention of the new tokens' queries to the cache and to each other.

    `cached` is the layer's view of a cache (`KVCache.layer(i)`, or the same from
    another cache kind): `materialize()` gives its `[batch, kv_heads, kv_seq,
    head_dim]` keys and values, `attend_token` the decode kernel that reads them in
    place; a `RaggedPagedLayerKV` (one ragged batch, `batch` 1) attends each token to
    its own row's pages and new tokens. `k` and `v` are this step's own (already
    rotated). Scores are scaled by
    `scale` and, with `softcap`, squashed to `softcap * tanh(score / softcap)`;
    `sinks` (one logit per query head) join each softmax (see
    `eqx_models.ops.masked_attention`).
    """
    batch, num_heads, seq, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    if isinstance(cached, RaggedPagedLayerKV):
        # One ragged batch (`[1, tokens]`): every token against its own row's pages
        # and new tokens.
        out = cached.attend_tokens(
            q[0].reshape(num_kv_heads, groups, seq, head_dim).transpose(2, 0, 1, 3), k[0].transpose(1, 0, 2),
            v[0].transpose(1, 0, 2), inputs.attention_mask[0], inputs.window, scale, softcap,
            None if sinks is None else sinks.reshape(num_kv_heads, groups),
        )
        return out.reshape(1, seq, num_heads, -1).astype(q.dtype)
    if use_decode_kernel(seq, cached, softcap):
        # One token per row against the cache read in place. The new key/value
        # are rounded first, as the cache will hold them.
        stored_k, stored_v = _as_stored(cached, k[:, :, 0], v[:, :, 0])
        out = cached.attend_token(
            q.reshape(batch, num_kv_heads, groups, head_dim).astype(jnp.float32),
            inputs.visible_slots(),
            stored_k,
            stored_v,
            scale,
            None if sinks is None else sinks.reshape(num_kv_heads, groups),
        ).astype(q.dtype)[:, :, :, None]
    else:
        if cached is not None and seq == 1:  # a decode step without the kernel: rounded alike
            stored_k, stored_v = _as_stored(cached, k, v)
            k, v = stored_k.astype(k.dtype), stored_v.astype(v.dtype)
        q = q.reshape(batch, num_kv_heads, groups, seq, head_dim)
        head_sinks = None if sinks is None else sinks.reshape(num_kv_heads, groups)
        if cached is None:  # the new tokens among themselves: metadata, no mask
            out = causal_attention(q, k, v, inputs.attention_mask, inputs.segment_ids, inputs.window, scale, softcap,
                                   head_sinks)
        else:
            cached_keys, cached_values = cached.materialize(k.dtype)
            if cached_values.shape[-1] < v.shape[-1]:  # no value rows: the keys' first channels
                cached_values = cached_keys[..., : v.shape[-1]]
            out = masked_attention(q, [cached_keys, k], [cached_values, v],
                                   [inputs.cached_allowed(), inputs.new_allowed()], scale, softcap, head_sinks)
    return out.reshape(batch, num_heads, seq, -1).transpose(0, 2, 1, 3)


class AbstractAttention(eqx.Module):
    """Self-attention as a decoder layer holds it: `attn(x, inputs, cached)` returns
    the output and this step's keys and values, which the caller writes into the
    cache.

    `float_children` names the `Linear` children that a subclass reads other than
    through `Linear` (by rows, per head); `eqx_models.quantize` leaves them float.
    """

    float_children: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        inputs: LayerInputs,
        cached=None,
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        """Attends the new tokens to the cached ones (`cached`, this layer's cache
        view) and to each other.

        Returns:
            The output, and this step's keys and values as the cache stores them.
        """


class AbstractRotaryAttention(AbstractAttention):
    """What every rotary self-attention shares: rotate the queries and keys, attend
    (to the cache and the new tokens), project out with `o_proj`.

    Subclasses hold the projections and say how queries, keys and values come from
    the hidden states (`project`): separate `q_proj` / `k_proj` / `v_proj`
    (`Attention`), one fused `qkv_proj` (Phi-3), norms over the whole projection
    (OLMo 2). `interleave` rotates adjacent channel pairs instead of the two halves;
    `sinks` (one logit per query head, or None) join every softmax.
    """

    o_proj: eqx.AbstractVar[Linear]
    num_heads: eqx.AbstractVar[int]
    num_kv_heads: eqx.AbstractVar[int]
    head_dim: eqx.AbstractVar[int]
    scale: eqx.AbstractVar[float]
    softcap: eqx.AbstractVar[float | None]
    interleave: eqx.AbstractVar[bool]
    sinks: eqx.AbstractVar[Float[Array, " heads"] | None]

    @abc.abstractmethod
    def project(
        self, x: Float[Array, "batch seq hidden"]
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values per head, before the rotation."""

    def rotate(
        self,
        x: Float[Array, "batch heads seq head_dim"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
    ) -> Float[Array, "batch heads seq head_dim"]:
        """The rotary positions applied to queries or keys (adjacent pairs with
        `interleave`, else the two halves)."""
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def attend(
        self,
        q: Float[Array, "batch heads seq head_dim"],
        k: Float[Array, "batch kv_heads seq head_dim"],
        v: Float[Array, "batch kv_heads seq head_dim"],
        inputs: LayerInputs,
        cached=None,
    ) -> Float[Array, "batch seq heads head_dim"]:
        """The rotated queries attending to the cache and the new keys (`attend`
        with this module's scale, soft cap and sinks)."""
        return attend(q, k, v, inputs, cached, scale=self.scale, softcap=self.softcap, sinks=self.sinks)

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        inputs: LayerInputs,
        cached=None,
    ) -> tuple[
        Float[Array, "batch seq hidden"],
        tuple[Float[Array, "batch kv_heads seq head_dim"], Float[Array, "batch kv_heads seq head_dim"]],
    ]:
        """Attends the new tokens to the cached ones and to each other.

        Returns the output and this step's keys/values (already rotated), which the
        caller writes into the cache.
        """
        batch, seq, _ = x.shape
        q, k, v = self.project(x)
        q = self.rotate(q.transpose(0, 2, 1, 3), inputs.cos, inputs.sin)
        k = self.rotate(k.transpose(0, 2, 1, 3), inputs.cos, inputs.sin)
        v = v.transpose(0, 2, 1, 3)
        out = self.attend(q, k, v, inputs, cached)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim)), (k, v)


def qkvo_projections(
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    use_bias: bool,
    output_bias: bool,
    key: PRNGKeyArray,
) -> tuple[Linear, Linear, Linear, Linear]:
    """`q_proj`, `k_proj`, `v_proj` and `o_proj` of a `num_heads` / `num_kv_heads`
    attention, with their logical axes."""
    kq, kk, kv, ko = jax.random.split(key, 4)
    return (
        Linear(hidden_size, num_heads * head_dim, axes=("heads", "embed"), use_bias=use_bias, key=kq),
        Linear(hidden_size, num_kv_heads * head_dim, axes=("kv_heads", "embed"), use_bias=use_bias, key=kk),
        Linear(hidden_size, num_kv_heads * head_dim, axes=("kv_heads", "embed"), use_bias=use_bias, key=kv),
        Linear(num_heads * head_dim, hidden_size, axes=("embed", "heads"), use_bias=output_bias, key=ko),
    )


class Attention(AbstractRotaryAttention, AbstractHasArrayAxes):
    """Self-attention with rotary positions; MHA, GQA and MQA by head counts.

    Attribute names mirror Hugging Face (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
    Qwen3's `q_norm` / `k_norm` applied per head before the rotation, gpt-oss's
    `sinks`). An architecture that computes queries, keys and values otherwise
    subclasses `AbstractRotaryAttention` and implements `project`.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    sinks: Float[Array, " heads"] | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    interleave: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        use_bias: bool = False,
        output_bias: bool | None = None,
        qk_norms: tuple[eqx.Module, eqx.Module] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        use_sinks: bool = False,
        interleave: bool = False,
        key: PRNGKeyArray,
    ):
        """`qk_norms` are `q_norm` and `k_norm` (per head, before the rotation);
        `scale` multiplies the scores (default `head_dim ** -0.5`); `softcap` squashes
        them to `softcap * tanh(score / softcap)` (Gemma 2); `use_sinks` adds a sink
        logit per query head (gpt-oss, zeros until loaded); `interleave` rotates
        adjacent channel pairs (Cohere)."""
        output_bias = use_bias if output_bias is None else output_bias
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = qkvo_projections(
            hidden_size, num_heads, num_kv_heads, head_dim, use_bias=use_bias, output_bias=output_bias, key=key
        )
        self.q_norm, self.k_norm = (None, None) if qk_norms is None else qk_norms
        self.sinks = jnp.zeros((num_heads,)) if use_sinks else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.interleave = interleave

    @classmethod
    def from_config(cls, config: DecoderConfig, *, key: PRNGKeyArray, **options) -> "Attention":
        """The attention `config` describes (heads, biases, QK-norm); `options`
        replace constructor arguments (`scale=`, `qk_norms=`, ...)."""
        per_head = lambda: RMSNorm(config.head_dim, config.rms_norm_eps, axis="head_dim")
        qk_norms = (per_head(), per_head()) if config.use_qk_norm else None
        arguments = dict(use_bias=config.attention_bias, output_bias=config.o_proj_bias, qk_norms=qk_norms)
        arguments.update(options)
        return cls(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            key=key, **arguments,
        )

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"sinks": ("heads",)}

    def project(
        self, x: Float[Array, "batch seq hidden"]
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values per head, normalised where there are QK norms
        (before the rotation)."""
        batch, seq, _ = x.shape
        q, k, v = project_together(x, [self.q_proj, self.k_proj, self.v_proj])
        q = q.reshape(batch, seq, self.num_heads, self.head_dim)
        k = k.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v
