"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet linear attention interleaved
with gated full attention, and a mixture of experts with a gated shared expert.

**Layout.** `layer_types` repeats `full_attention_interval - 1` linear-attention
layers, then one full-attention layer (3 + 1 in the releases). The decoder stacks
one *block* of that pattern (`Qwen3NextBlock`) and scans over the blocks, so no
layer carries the other kind's weights and each scanned step runs the same code.
The KV cache has one layer per block (its attention layer); the linear layers'
state rides in the same cache as `KVCache.state` (`DeltaNetState`).

**Gated DeltaNet.** `in_proj_qkvz` gives per key head a query and a key
(`linear_key_head_dim`) and, for the value heads it serves, values and an output
gate `z` (`linear_value_head_dim`); `in_proj_ba` the write strength `b` and the
decay input `a` per value head. Queries, keys and values pass a causal depthwise
convolution of `linear_conv_kernel_dim` taps and SiLU; queries and keys are
L2-normalised (queries also scaled by `key_dim ** -0.5`). Per value head the state
`S` (`key_dim x value_dim`) evolves per token as

    S = exp(g) S;   S += k (beta (v - k^T S))^T;   out = q^T S

with `beta = sigmoid(b)` and `g = -exp(A_log) softplus(a + dt_bias)`. The output
is RMS-normalised per head, gated by `silu(z)` and projected by `out_proj`. The
cache keeps `S` (float32) and the convolution's last `taps - 1` inputs per layer:
a fixed size however long the context. Padding tokens (attention mask 0; left
padding) neither decay nor write the state, and the convolution of a row's first
real tokens reads the inputs before them from the cache.

**Gated attention.** `q_proj` gives each head a query and a gate (`head_dim`
each); the output is multiplied by `sigmoid(gate)` before `o_proj`. Queries and
keys are RMS-normalised per head; `partial_rotary_factor` (0.25) of each head
rotates. Every RMSNorm outside the DeltaNet output scales by `1 + weight`.

**MLP.** Top-k softmax routing as Qwen3-MoE, plus a shared expert whose output is
scaled by `sigmoid(shared_expert_gate(x))`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..axes import AbstractHasArrayAxes
from ..cache import StateView
from ..config import AttentionKind, ConfigError, DecoderConfig, decoder_config_from_hf, decoder_config_to_hf
from ..ops import delta_rule_step, delta_rule_token
from ..nn.attention import AbstractAttention, LayerInputs, attend, qkvo_projections
from ..nn.decoder import AbstractLayerBlock, AbstractPreNormLayer
from ..nn.linear import Linear, project_together
from ..nn.mlp import GatedMLP
from ..nn.moe import AbstractSparseMoeBlock, Experts, dense_mlp, route, router_and_experts
from ..nn.norm import RMSNorm
from ..nn.rope import apply_rotary
from ..architecture import Architecture
from .qwen3_moe import MOE_KEYS, TRAINING_KEYS, moe_fields_from_hf, moe_fields_to_hf

LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")
# Read here, derived, or training-only (router loss).
QWEN3_NEXT_KEYS = frozenset(
    {*LINEAR_FIELDS, *MOE_KEYS, *TRAINING_KEYS, "shared_expert_intermediate_size", "full_attention_interval"}
)
L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig):
    """`DecoderConfig` plus the linear-attention widths and the layer pattern (HF names).

    Attributes:
        linear_conv_kernel_dim: taps of the causal convolution.
        linear_key_head_dim: query/key channels per linear-attention head.
        linear_value_head_dim: value channels per linear-attention head (and the
            state's second axis).
        linear_num_key_heads: query/key heads of a linear-attention layer.
        linear_num_value_heads: value heads (each key head serves an equal share).
        shared_expert_intermediate_size: width of the shared expert (0: none).
        full_attention_interval: every this-many-th layer attends fully; the others
            are linear attention.
    """

    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    shared_expert_intermediate_size: int = 0
    full_attention_interval: int = 4

    @property
    def layers_per_block(self) -> int:
        return self.full_attention_interval

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        return (AttentionKind(self.rope_theta, self.rope_scaling, None),) * self.num_blocks

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: every head's query and key, then the values."""
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * keys + self.linear_num_value_heads * self.linear_value_head_dim

    def recurrent_state(self, batch_size: int, dtype) -> "DeltaNetState":
        members = self.full_attention_interval - 1
        lead = (self.num_blocks, batch_size, members)
        return DeltaNetState(
            # float32 whatever the model's dtype (the inputs it keeps are exact in it):
            # XLA:CPU rewrites a whole 16-bit array to update part of it.
            conv=jnp.zeros((*lead, self.conv_dim, self.linear_conv_kernel_dim - 1), jnp.float32),
            recurrent=jnp.zeros(
                (*lead, self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim), jnp.float32
            ),
        )

    def member_is_sparse(self, member: int) -> bool:
        """Whether layer `member` of every block has a mixture-of-experts MLP."""
        return member in self.sparse_layers


class DeltaNetState(AbstractHasArrayAxes):
    """The linear-attention layers' state in a cache: per block, row and layer of
    the block, the convolution's last inputs and the float32 recurrent state."""

    conv: Float[Array, "*blocks batch members conv_dim taps"]
    recurrent: Float[Array, "*blocks batch members value_heads key_dim value_dim"]

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {
            "conv": ("layers", "batch", None, None, None),
            "recurrent": ("layers", "batch", None, None, None, None),
        }


class DepthwiseConv(AbstractHasArrayAxes):
    """The convolution's weight in the checkpoint's shape `[channels, 1, taps]`."""

    weight: Float[Array, "channels 1 taps"]

    def __init__(self, channels: int, taps: int, *, key: PRNGKeyArray):
        self.weight = jax.random.normal(key, (channels, 1, taps)) / taps**0.5

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": (None, None, None)}


def causal_conv(
    x: Float[Array, "batch seq channels"],
    weight: Float[Array, "channels 1 taps"],
    history: Float[Array, "batch channels taps_1"],
    attention_mask: Int[Array, "batch seq"],
) -> tuple[Float[Array, "batch seq channels"], Float[Array, "batch channels taps_1"]]:
    """Depthwise causal convolution continuing from `history` (the inputs before
    this call), with left padding: each row's real tokens follow its history
    directly, the padding before them counts as zeros in front. Computed in the
    weight's dtype, as `transformers` does.

    Returns the outputs (in `x`'s dtype) and the last `taps - 1` inputs of each row
    (its new history).
    """
    batch, seq, _ = x.shape
    taps = weight.shape[-1]
    past = taps - 1
    w = weight[:, 0]
    joined = jnp.concatenate([history.transpose(0, 2, 1).astype(w.dtype), x.astype(w.dtype)], axis=1)
    # Move each row's history from the front to just before its first real token.
    padding = (seq - jnp.sum(attention_mask, axis=-1))[:, None]
    slot = jnp.arange(past + seq)[None]
    source = jnp.where(slot < padding + past, slot - padding, slot)
    aligned = jnp.take_along_axis(joined, jnp.clip(source, 0, past + seq - 1)[..., None], axis=1)
    aligned = jnp.where((slot < padding)[..., None], 0, aligned)
    out = sum(aligned[:, j : j + seq] * w[:, j] for j in range(taps))
    return out.astype(x.dtype), aligned[:, seq:].transpose(0, 2, 1)


def _l2_normalize(x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gated_delta_rule(
    q: Float[Array, "batch seq heads key_dim"],
    k: Float[Array, "batch seq heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    decay: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    state: Float[Array, "batch heads key_dim value_dim"],
) -> tuple[Float[Array, "batch seq heads value_dim"], Float[Array, "batch heads key_dim value_dim"]]:
    """The gated delta rule token by token (float32): returns each token's read of
    the state and the state after the last token. `decay` is `g` (log space)."""

    time_major = [a.swapaxes(0, 1) for a in (q, k, v, decay, beta)]
    state, out = jax.lax.scan(lambda s, token: delta_rule_token(s, *token), state, time_major)
    return out.swapaxes(0, 1), state


class GatedRMSNorm(AbstractHasArrayAxes):
    """RMSNorm of each head's output (the weight applied in the input dtype), then
    times `silu(gate)` in float32."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float):
        self.weight = jnp.ones((dim,))
        self.eps = eps

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": (None,)}

    def __call__(self, x: Float[Array, "*batch dim"], gate: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = (self.weight.astype(x.dtype) * normed).astype(jnp.float32)
        return (scaled * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(AbstractHasArrayAxes):
    """The linear-attention token mixer (see the module docstring); HF's weight names."""

    in_proj_qkvz: Linear
    in_proj_ba: Linear
    conv1d: DepthwiseConv
    dt_bias: Float[Array, " value_heads"]
    A_log: Float[Array, " value_heads"]
    norm: GatedRMSNorm
    out_proj: Linear
    key_heads: int = eqx.field(static=True)
    value_heads: int = eqx.field(static=True)
    key_dim: int = eqx.field(static=True)
    value_dim: int = eqx.field(static=True)

    def __init__(self, config: Qwen3NextConfig, *, key: PRNGKeyArray):
        k_qkvz, k_ba, k_conv, k_a, k_out = jax.random.split(key, 5)
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        if nv % nk:
            raise ConfigError(f"linear_num_value_heads={nv} must be a multiple of linear_num_key_heads={nk}.")
        hidden = config.hidden_size
        self.in_proj_qkvz = Linear(hidden, 2 * nk * dk + 2 * nv * dv, axes=(None, "embed"), key=k_qkvz)
        self.in_proj_ba = Linear(hidden, 2 * nv, axes=(None, "embed"), key=k_ba)
        self.conv1d = DepthwiseConv(config.conv_dim, config.linear_conv_kernel_dim, key=k_conv)
        self.dt_bias = jnp.ones((nv,))
        self.A_log = jnp.log(jax.random.uniform(k_a, (nv,), minval=0.01, maxval=16.0))
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = Linear(nv * dv, hidden, axes=("embed", None), key=k_out)
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = nk, nv, dk, dv

    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"dt_bias": (None,), "A_log": (None,)}

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        attention_mask: Int[Array, "batch seq"],
        cached: StateView | None = None,
        member: int = 0,
    ) -> tuple[Float[Array, "batch seq hidden"], "DeltaNetState | tuple[Array, Array]"]:
        """The mixer's output, and with `cached` (a cache's `DeltaNetState`, this
        layer at `member` of its block) the whole state with this layer's entries
        advanced; without, this layer's state after the tokens, `(conv, recurrent)`
        from zeros. A single token per row updates the float32 state in place
        (`eqx_models.ops.delta_rule_step`)."""
        batch, seq, _ = x.shape
        nk, nv, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        share = nv // nk
        real = attention_mask.astype(bool)
        x = jnp.where(real[..., None], x, 0)
        qkvz, ba = project_together(x, [self.in_proj_qkvz, self.in_proj_ba])
        # Per key head: its query, its key, then its value heads' values and gates.
        qkvz = qkvz.reshape(batch, seq, nk, 2 * dk + 2 * share * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v, z = qkvz[..., 2 * dk : 2 * dk + share * dv], qkvz[..., 2 * dk + share * dv :]
        ba = ba.reshape(batch, seq, nk, 2 * share)
        b, a = ba[..., :share].reshape(batch, seq, nv), ba[..., share:].reshape(batch, seq, nv)
        mixed = jnp.concatenate(
            [q.reshape(batch, seq, nk * dk), k.reshape(batch, seq, nk * dk), v.reshape(batch, seq, nv * dv)], axis=-1
        )
        if cached is None:
            conv_state = jnp.zeros((batch, mixed.shape[-1], self.conv1d.weight.shape[-1] - 1), jnp.float32)
        else:
            conv_state = cached.read(cached.state.conv, member)
        mixed, conv_state = causal_conv(mixed, self.conv1d.weight, conv_state, attention_mask)
        mixed = jax.nn.silu(mixed)
        as_heads = lambda t, heads, dim: t.reshape(batch, seq, heads, dim).astype(jnp.float32)
        q = as_heads(mixed[..., : nk * dk], nk, dk)
        k = as_heads(mixed[..., nk * dk : 2 * nk * dk], nk, dk)
        v = as_heads(mixed[..., 2 * nk * dk :], nv, dv)
        q = jnp.repeat(_l2_normalize(q), share, axis=2) * dk**-0.5
        k = jnp.repeat(_l2_normalize(k), share, axis=2)
        beta = jnp.where(real[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
        decay = -jnp.exp(self.A_log.astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias.astype(jnp.float32)
        )
        decay = jnp.where(real[..., None], decay, 0.0)
        if cached is None:
            out, recurrent = gated_delta_rule(q, k, v, decay, beta, jnp.zeros((batch, nv, dk, dv), jnp.float32))
            new = (conv_state, recurrent)
        else:
            pool = cached.state
            if seq == 1:
                out, recurrent = delta_rule_step(
                    pool.recurrent, cached.index, member, cached.slots, cached.fresh,
                    q[:, 0], k[:, 0], v[:, 0], decay[:, 0], beta[:, 0],
                )
                out = out[:, None]
            else:
                out, rows = gated_delta_rule(q, k, v, decay, beta, cached.read(pool.recurrent, member))
                recurrent = cached.write(pool.recurrent, rows, member)
            new = DeltaNetState(cached.write(pool.conv, conv_state, member), recurrent)
        out = self.norm(out.astype(x.dtype), z.reshape(batch, seq, nv, dv))
        return self.out_proj(out.reshape(batch, seq, nv * dv)), new


class GatedAttention(AbstractAttention):
    """Attention whose `q_proj` also gives a per-channel output gate (`sigmoid`),
    with `1 + w` per-head QK norms and partial rotary positions."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm
    k_norm: RMSNorm
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, config: Qwen3NextConfig, *, key: PRNGKeyArray):
        k_attn, k_q = jax.random.split(key)
        heads, kv_heads, dim, bias = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.attention_bias
        )
        _, self.k_proj, self.v_proj, self.o_proj = qkvo_projections(
            config.hidden_size, heads, kv_heads, dim, use_bias=bias, output_bias=bias, key=k_attn
        )
        self.q_proj = Linear(config.hidden_size, 2 * heads * dim, axes=("heads", "embed"), use_bias=bias, key=k_q)
        norm = lambda: RMSNorm(dim, config.rms_norm_eps, unit_offset=True, axis="head_dim")
        self.q_norm, self.k_norm = norm(), norm()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, dim

    def __call__(self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None):
        batch, seq, _ = x.shape
        heads, dim = self.num_heads, self.head_dim
        q_gate, k, v = project_together(x, [self.q_proj, self.k_proj, self.v_proj])
        q_gate = q_gate.reshape(batch, seq, heads, 2 * dim)
        q, gate = self.q_norm(q_gate[..., :dim]), q_gate[..., dim:]
        k = self.k_norm(k.reshape(batch, seq, self.num_kv_heads, dim))
        v = v.reshape(batch, seq, self.num_kv_heads, dim).transpose(0, 2, 1, 3)
        q = apply_rotary(q.transpose(0, 2, 1, 3), inputs.cos, inputs.sin)
        k = apply_rotary(k.transpose(0, 2, 1, 3), inputs.cos, inputs.sin)
        out = attend(q, k, v, inputs, cached, scale=dim**-0.5) * jax.nn.sigmoid(gate)
        return self.o_proj(out.reshape(batch, seq, heads * dim)), (k, v)


class Qwen3NextMoeBlock(AbstractSparseMoeBlock):
    """Routed experts (top-k softmax routing as Qwen3-MoE) plus the shared expert,
    scaled by its sigmoid gate."""

    float_children = ("shared_expert_gate",)  # one output: a gate, kept exact like the routers

    gate: Linear
    experts: Experts
    shared_expert: GatedMLP
    shared_expert_gate: Linear
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)

    def __init__(self, config: Qwen3NextConfig, *, key: PRNGKeyArray):
        k_moe, k_shared, k_gate = jax.random.split(key, 3)
        self.gate, self.experts = router_and_experts(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, hidden_act=config.hidden_act, key=k_moe
        )
        self.shared_expert = GatedMLP(
            config.hidden_size, config.shared_expert_intermediate_size, hidden_act=config.hidden_act, key=k_shared
        )
        self.shared_expert_gate = Linear(config.hidden_size, 1, axes=(None, "embed"), key=k_gate)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def route_tokens(
        self, gate: Linear, tokens: Float[Array, "tokens hidden"]
    ) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
        return route(gate(tokens), self.top_k, self.norm_topk_prob)

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.routed_experts(x) + shared


def _norm(config: DecoderConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, unit_offset=True)


def _mlp(config: Qwen3NextConfig, key: PRNGKeyArray, sparse: bool) -> eqx.Module:
    return Qwen3NextMoeBlock(config, key=key) if sparse else dense_mlp(config, key)


class DeltaNetLayer(eqx.Module):
    """A pre-norm layer with Gated DeltaNet as its token mixer (HF's layer with
    `linear_attn`)."""

    input_layernorm: RMSNorm
    linear_attn: GatedDeltaNet
    post_attention_layernorm: RMSNorm
    mlp: eqx.Module

    def __init__(self, config: Qwen3NextConfig, sparse: bool, *, key: PRNGKeyArray):
        k_attn, k_mlp = jax.random.split(key)
        self.input_layernorm = _norm(config, config.hidden_size)
        self.linear_attn = GatedDeltaNet(config, key=k_attn)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.mlp = _mlp(config, k_mlp, sparse)

    def __call__(self, x, attention_mask, cached: StateView | None = None, member: int = 0):
        out, state = self.linear_attn(self.input_layernorm(x), attention_mask, cached, member)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), state


class Qwen3NextAttentionLayer(AbstractPreNormLayer):
    """The full-attention layer: gated attention, `1 + w` norms."""

    self_attn: GatedAttention
    mlp: eqx.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: Qwen3NextConfig, sparse: bool, *, key: PRNGKeyArray):
        k_layer, k_mlp = jax.random.split(key)
        k_attn, _ = jax.random.split(k_layer)
        self.self_attn = GatedAttention(config, key=k_attn)
        self.mlp = self.mlp_for(config, k_mlp, sparse)
        self.input_layernorm = _norm(config, config.hidden_size)
        self.post_attention_layernorm = _norm(config, config.hidden_size)

    mlp_for = staticmethod(_mlp)


class Qwen3NextBlock(AbstractLayerBlock):
    """One period of the layer pattern: `full_attention_interval - 1` DeltaNet
    layers, then the attention layer. Stacked over the blocks and scanned like a
    layer; its new cache entries are the attention's keys/values and the DeltaNet
    layers' `DeltaNetState`."""

    linear_layers: tuple[DeltaNetLayer, ...]
    attention_layer: Qwen3NextAttentionLayer
    period: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)

    def __init__(self, config: Qwen3NextConfig, *, key: PRNGKeyArray, mlp: bool = True):
        period = config.full_attention_interval
        keys = jax.random.split(key, period)
        self.linear_layers = tuple(
            DeltaNetLayer(config, config.member_is_sparse(j), key=keys[j]) for j in range(period - 1)
        )
        self.attention_layer = Qwen3NextAttentionLayer(config, config.member_is_sparse(period - 1), key=keys[-1])
        self.period = period
        self.num_layers = config.num_hidden_layers

    def substack_layers(self) -> dict[str, tuple[int, ...]]:
        """Each member's leaves hold every `period`-th layer (see `Decoder.substack_layers`)."""
        numbers = lambda j: tuple(range(j, self.num_layers, self.period))
        members = {f"linear_layers.{j}.": numbers(j) for j in range(self.period - 1)}
        return {**members, "attention_layer.": numbers(self.period - 1)}

    def __call__(self, x: Float[Array, "batch seq hidden"], inputs: LayerInputs, cached=None):
        view = None if cached is None else cached.state
        if view is None:  # no cache: each DeltaNet layer starts from zeros
            convs, recurrents = [], []
            for layer in self.linear_layers:
                x, (conv, recurrent) = layer(x, inputs.attention_mask)
                convs.append(conv)
                recurrents.append(recurrent)
            state = DeltaNetState(jnp.stack(convs, axis=1), jnp.stack(recurrents, axis=1))
        else:
            for j, layer in enumerate(self.linear_layers):
                x, state = layer(x, inputs.attention_mask, view, j)
                view = StateView(state, view.index, view.slots, view.fresh)
        x, (k, v) = self.attention_layer(x, inputs, cached)
        return x, (k, v, state)


def _layer_pattern(hf: Mapping[str, Any]) -> int:
    """The full-attention interval that `layer_types` (or the interval itself) gives;
    raises for a pattern that is not `interval - 1` linear layers, then one full, repeated."""
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("full_attention_interval") or 4)
    types = hf.get("layer_types")
    if types:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        interval = full[0] + 1 if full else 0
    expected = ["linear_attention" if (i + 1) % max(interval, 1) else "full_attention" for i in range(layers)]
    if interval < 2 or layers % interval or (types and list(types) != expected):
        raise ConfigError(
            f"Qwen3-Next layer_types={types!r} (num_hidden_layers={layers}) is not supported: this library runs "
            "the released pattern, `full_attention_interval - 1` 'linear_attention' layers then one "
            "'full_attention', repeated a whole number of times."
        )
    return interval


def config_from_hf(hf: Mapping[str, Any]) -> Qwen3NextConfig:
    interval = _layer_pattern(hf)
    config = decoder_config_from_hf(
        hf,
        use_qk_norm=True,
        extra_ignored=QWEN3_NEXT_KEYS,
        config_class=Qwen3NextConfig,
        partial_rotary=True,
        **moe_fields_from_hf(hf, norm_topk_prob=True),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        full_attention_interval=interval,
        layer_types=tuple(hf.get("layer_types") or ()) or None,
        **{name: int(hf[name]) for name in LINEAR_FIELDS if name in hf},
    )
    sparse = set(config.sparse_layers)
    for member in range(interval):
        kinds = {layer in sparse for layer in range(member, config.num_hidden_layers, interval)}
        if len(kinds) > 1:
            raise ConfigError(
                f"Qwen3-Next with mlp_only_layers={list(config.mlp_only_layers)} and decoder_sparse_step="
                f"{config.decoder_sparse_step} mixes dense and sparse MLPs at layer {member} of the "
                f"{interval}-layer pattern; this library needs the same kind at each place of the pattern."
            )
    if config.num_experts and not config.shared_expert_intermediate_size:
        raise ConfigError("Qwen3-Next with experts needs shared_expert_intermediate_size > 0 (its shared expert).")
    return config


def config_to_hf(config: Qwen3NextConfig) -> dict[str, Any]:
    hf = decoder_config_to_hf(config)
    hf.update({name: getattr(config, name) for name in LINEAR_FIELDS})
    hf.update(
        moe_fields_to_hf(config),
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        layer_types=[
            "linear_attention" if (i + 1) % config.full_attention_interval else "full_attention"
            for i in range(config.num_hidden_layers)
        ],
        partial_rotary_factor=config.partial_rotary_factor,
    )
    return hf


def tensor_name(name: str) -> str:
    """Our block members' leaves are the checkpoint's layers themselves."""
    return name.replace(".linear_layers.", ".").replace(".attention_layer.", ".")


def skips_tensor(config: DecoderConfig, name: str) -> bool:
    """The multi-token-prediction module (`mtp.*`), which generation does not run."""
    return name.startswith("mtp.")


ARCHITECTURE = Architecture(
    "qwen3_next", "Qwen3NextForCausalLM", config_from_hf, config_to_hf,
    title="Qwen3-Next",
    summary="Gated DeltaNet linear attention (a recurrent state in the cache) between gated full-attention "
            "layers; MoE with a gated shared expert",
    layer=Qwen3NextBlock,
    norm=_norm,
    tensor_name=tensor_name,
    skips_tensor=skips_tensor,
)
