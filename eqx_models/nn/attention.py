"""Multi-head attention with grouped key/value heads and an optional KV cache."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..kernels import kernels_available
from .linear import Linear, project_together
from .norm import RMSNorm
from .rope import apply_rotary


# Prompts longer than twice this run attention in blocks of this many queries, each
# against the keys up to its last query only (causal): half the work of the full
# square, and score tiles that stay a fraction of the `[seq, seq]` matrix.
QUERY_CHUNK = 512


def masked_softmax_attention(
    query: Float[Array, "batch kv_heads groups seq head_dim"],
    keys: list[Float[Array, "batch kv_heads _ head_dim"]],
    values: list[Float[Array, "batch kv_heads _ head_dim"]],
    allowed: list[Bool[Array, "batch seq _"]],
    scale: float | None = None,
) -> Float[Array, "batch kv_heads groups seq head_dim"]:
    """Softmax attention over several key/value blocks as if they were concatenated.

    Each block comes with its own `allowed` mask, so the cached keys and the new keys
    of a step never need to be copied into one buffer first. Scores and the softmax
    are float32 whatever the activation dtype. The last block must be the new
    tokens' own (causal) block: long prompts are split by query along it. Scores
    are scaled by `scale` (default `head_dim ** -0.5`).
    """
    seq = query.shape[3]
    if seq > 2 * QUERY_CHUNK:
        outputs = []
        for start in range(0, seq, QUERY_CHUNK):
            stop = min(start + QUERY_CHUNK, seq)
            # Exact, not approximate: queries before `stop` never see new keys after it.
            outputs.append(
                masked_softmax_attention(
                    query[:, :, :, start:stop],
                    keys[:-1] + [keys[-1][:, :, :stop]],
                    values[:-1] + [values[-1][:, :, :stop]],
                    [a[:, start:stop] for a in allowed[:-1]] + [allowed[-1][:, start:stop, :stop]],
                    scale,
                )
            )
        return jnp.concatenate(outputs, axis=3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = [
        jnp.einsum("bkgtd,bksd->bkgts", query, k, preferred_element_type=jnp.float32) * scale for k in keys
    ]
    # A large finite value rather than -inf: a fully masked row (a padding query)
    # then gets uniform weights instead of NaN, and its output is ignored anyway.
    lowest = jnp.finfo(jnp.float32).min
    scores = [jnp.where(m[:, None, None], s, lowest) for s, m in zip(scores, allowed)]
    row_max = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)[..., None]
    weights = [jnp.exp(s - row_max) for s in scores]
    total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    return sum(
        jnp.einsum("bkgts,bksd->bkgtd", (w / total).astype(v.dtype), v)
        for w, v in zip(weights, values)
    )


def use_decode_kernel(seq: int, cached) -> bool:
    """Whether attention goes through the cache's decode kernel (`attend_token`)."""
    return seq == 1 and cached is not None and cached.dtype in (jnp.float32, jnp.bfloat16) and kernels_available()


class Attention(eqx.Module):
    """Self-attention with rotary positions; MHA, GQA and MQA by head counts.

    Attribute names mirror Hugging Face (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
    and Qwen3's `q_norm` / `k_norm` applied per head before the rotation).
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        use_bias: bool = False,
        output_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        norm_unit_offset: bool = False,
        query_pre_attn_scalar: float | None = None,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = Linear(hidden_size, num_heads * head_dim, use_bias=use_bias, key=kq)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, use_bias=use_bias, key=kk)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, use_bias=use_bias, key=kv)
        output_bias = use_bias if output_bias is None else output_bias
        self.o_proj = Linear(num_heads * head_dim, hidden_size, use_bias=output_bias, key=ko)
        use_norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=norm_unit_offset) if use_norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=norm_unit_offset) if use_norm else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = (head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar) ** -0.5

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
        """Attends the new tokens to the cached ones and to each other.

        `cached` is this layer's view of the cache (`KVCache.layer(i)`, or the same
        from another cache kind): `materialize()` gives `[batch, kv_heads, kv_seq,
        head_dim]` keys and values, and `attend_token` the decode kernel that reads
        them in place. Returns the output and this step's keys/values (already
        rotated), which the caller writes into the cache.
        """
        batch, seq, _ = x.shape
        q, k, v = project_together(x, [self.q_proj, self.k_proj, self.v_proj])
        q = q.reshape(batch, seq, self.num_heads, self.head_dim)
        k = k.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(0, 2, 1, 3), cos, sin)
        k = apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
        v = v.transpose(0, 2, 1, 3)
        groups = self.num_heads // self.num_kv_heads
        if use_decode_kernel(seq, cached):
            # One token per row against the cache read in place. The new key/value
            # are rounded to the cache dtype first, as the cache will hold them.
            as_cached = lambda a: a[:, :, 0].astype(cached.dtype).astype(jnp.float32)
            out = cached.attend_token(
                q.reshape(batch, self.num_kv_heads, groups, self.head_dim).astype(jnp.float32),
                cached_allowed[:, 0],
                new_allowed[:, 0, 0],
                as_cached(k),
                as_cached(v),
                self.scale,
            ).astype(x.dtype)
        else:
            q = q.reshape(batch, self.num_kv_heads, groups, seq, self.head_dim)
            keys, values, allowed = [k], [v], [new_allowed]
            if cached is not None:
                cached_keys, cached_values = cached.materialize()
                keys.insert(0, cached_keys)
                values.insert(0, cached_values)
                allowed.insert(0, cached_allowed)
            out = masked_softmax_attention(q, keys, values, allowed, self.scale)
        out = out.reshape(batch, self.num_heads, seq, self.head_dim).transpose(0, 2, 1, 3)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim)), (k, v)
