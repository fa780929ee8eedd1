"""Fine-tuning: the causal-LM loss and a jitted optax train step.

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    init, step = make_train_step(optimizer)
    opt_state = init(model)
    for batch in batches:  # dicts of input_ids, labels (and attention_mask / segment_ids)
        model, opt_state, metrics = step(model, opt_state, batch)
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

IGNORE_INDEX = -100  # label of a position that does not count, as in transformers


def causal_lm_loss_sum(
    model,
    input_ids: Int[Array | np.ndarray, "batch seq"],
    labels: Int[Array | np.ndarray, "batch seq"],
    attention_mask: Int[Array | np.ndarray, "batch seq"] | None = None,
    *,
    segment_ids: Int[Array | np.ndarray, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """The summed next-token cross-entropy and the number of positions it covers.

    Position `t` predicts `labels[:, t + 1]`; labels equal to -100 do not count, nor
    (with `segment_ids`) a prediction across a document boundary. Log-softmax in
    float32 whatever the activation dtype.
    """
    logits, _ = model(input_ids, attention_mask=attention_mask, segment_ids=segment_ids)
    targets = jnp.asarray(labels)[:, 1:]
    counted = targets != IGNORE_INDEX
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        counted &= segment_ids[:, 1:] == segment_ids[:, :-1]
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.where(counted, targets, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(counted, picked, 0.0)), jnp.sum(counted, dtype=jnp.int32)


def causal_lm_loss(
    model,
    input_ids: Int[Array | np.ndarray, "batch seq"],
    labels: Int[Array | np.ndarray, "batch seq"],
    attention_mask: Int[Array | np.ndarray, "batch seq"] | None = None,
    *,
    segment_ids: Int[Array | np.ndarray, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy over the positions whose label is not -100,
    as `transformers` computes `loss` when given `labels` (aligned with `input_ids`,
    shifted here). Differentiable with `eqx.filter_grad`; NaN when no label counts
    (as in `transformers`).

    Args:
        model: a `CausalLM`.
        input_ids: `[batch, seq]` token ids.
        labels: `[batch, seq]` target ids aligned with `input_ids`; -100 masks a position.
        attention_mask: `[batch, seq]`, 0 for padding (right padding for training).
        segment_ids: `[batch, seq]` ids of packed documents: no attention across
            documents, positions restart, and no loss across a boundary.

    Returns:
        The scalar mean loss (float32).
    """
    total, count = causal_lm_loss_sum(model, input_ids, labels, attention_mask, segment_ids=segment_ids)
    return total / count


def _widen(tree):
    """Floating leaves as float32 (optimizer state and updates stay float32 when
    the parameters are bfloat16)."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, tree)


def _place_like(state, params):
    """`state` committed where `params` live: subtrees shaped like `params` (Adam's
    moments, ...) leaf by leaf with the parameters' shardings, anything else beside
    the first parameter (replicated over its mesh). The states `step` returns are
    committed; an uncommitted first state would make the second step compile again."""
    arrays = [p for p in jax.tree.leaves(params) if eqx.is_array(p)]
    first = arrays[0].sharding
    beside = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else first
    structure = jax.tree.structure(params)
    like_params = lambda node: not eqx.is_array(node) and jax.tree.structure(node) == structure

    def place(node):
        if like_params(node):
            return jax.tree.map(lambda a, p: jax.device_put(a, p.sharding), node, params)
        return jax.device_put(node, beside) if eqx.is_array(node) else node

    return jax.tree.map(place, state, is_leaf=like_params)


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    trainable: Callable | object = eqx.is_inexact_array,
    accumulation_steps: int = 1,
) -> tuple[Callable, Callable]:
    """An `init(model) -> opt_state` and a jitted `step(model, opt_state, batch) ->
    (model, opt_state, metrics)`.

    Args:
        optimizer: any optax transformation (chain clipping and schedules into it).
        trainable: an `eqx.partition` filter: which leaves train (default: every
            floating array; `eqx_models.lora.lora_filter(model)` for adapters only).
            The rest stay frozen and get no gradient or optimizer state.
        accumulation_steps: the batch is split along its rows into this many
            micro-batches whose gradients are summed before one update; the loss is
            the mean over every counted token of the whole batch, as without
            accumulation.

    Returns:
        `(init, step)`. `init(model)` gives the optimizer state of the trainable
        part (float32, placed like the parameters). `step(model, opt_state, batch)`
        takes `batch`, a dict with `input_ids` and `labels` (and optionally
        `attention_mask`, `segment_ids`), each `[batch, seq]`, and returns
        `(model, opt_state, metrics)` with `metrics` holding the mean `loss` and the
        counted `tokens`. The model and optimizer state are donated (updated in
        place). Parameters may be bfloat16: gradients, optimizer state and the
        update are then computed in float32 and the result rounded back.
    """
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}.")

    def init(model):
        params = _widen(eqx.filter(model, trainable))
        return _place_like(optimizer.init(params), params)

    @eqx.filter_jit(donate="all")
    def step(model, opt_state, batch):
        params, frozen = eqx.partition(model, trainable)
        rows = batch["input_ids"].shape[0]
        if rows % accumulation_steps:
            raise ValueError(f"The batch's {rows} rows do not split into {accumulation_steps} micro-batches.")
        micro = jax.tree.map(lambda a: a.reshape(accumulation_steps, rows // accumulation_steps, *a.shape[1:]), batch)

        def loss_sum(params, part):
            return causal_lm_loss_sum(eqx.combine(params, frozen), **part)

        def accumulate(carry, part):
            grads, total, count = carry
            (part_total, part_count), part_grads = eqx.filter_value_and_grad(loss_sum, has_aux=True)(params, part)
            grads = jax.tree.map(lambda g, p: g + p.astype(jnp.float32), grads, part_grads)
            return (grads, total + part_total, count + part_count), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads, total, count), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0), jnp.int32(0)), micro)
        grads = jax.tree.map(lambda g: g / count, grads)
        wide = _widen(params)
        updates, opt_state = optimizer.update(grads, opt_state, wide)
        new = jax.tree.map(
            lambda p, w: w.astype(p.dtype), params, eqx.apply_updates(wide, updates)
        )
        return eqx.combine(new, frozen), opt_state, {"loss": total / count, "tokens": count}

    return init, step
