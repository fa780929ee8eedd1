"""Fine-tuning: loss and gradients against transformers (torch autograd), packed
sequences, remat, gradient accumulation, the train step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from eqx_models import causal_lm_loss, from_pretrained
from eqx_models.hub import _hf_tensors
from eqx_models.models import architecture_for
from eqx_models.training import make_train_step
from zoo import tiny_overrides


def padded_batch(vocab: int, seed: int = 0):
    """Right-padded rows of different lengths, some labels masked with -100."""
    rng = np.random.default_rng(seed)
    lengths = [10, 7, 4]
    ids = np.zeros((3, 10), np.int64)
    mask = np.zeros((3, 10), np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(0, vocab, length)
        mask[row, :length] = 1
    labels = np.where(mask == 1, ids, -100)
    labels[0, :3] = -100  # a prompt whose tokens do not count
    return ids, mask, labels


def hf_gradients(torch_model, ids, mask, labels):
    torch_model.zero_grad()
    out = torch_model(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    return float(out.loss.detach()), {name: p.grad.numpy() for name, p in torch_model.named_parameters() if p.grad is not None}


# gpt-oss: sinks, biased experts, and expert tensors that the checkpoint holds transposed.
GRADIENT_CASES = {"qwen3": {}, "llama": {}, "gpt_oss": {**tiny_overrides("gpt_oss"), "sliding_window": 4}}


@pytest.mark.parametrize("model_type", GRADIENT_CASES)
def test_loss_and_every_gradient_equal_transformers(checkpoint_factory, model_type):
    folder, torch_model = checkpoint_factory(model_type, **{**GRADIENT_CASES[model_type], "num_hidden_layers": 2})
    model = from_pretrained(folder, dtype=jnp.float32)
    ids, mask, labels = padded_batch(model.config.vocab_size)
    hf_loss, hf_grads = hf_gradients(torch_model, ids, mask, labels)

    loss, grads = eqx.filter_value_and_grad(causal_lm_loss)(model, ids, labels, mask)
    assert abs(float(loss) - hf_loss) < 1e-5
    arch = architecture_for({"model_type": model.config.model_type})
    compared = set()
    for name, leaf, index, transposed in _hf_tensors(grads, arch):
        ours, theirs = np.asarray(leaf[index]), hf_grads[name]
        ours = np.swapaxes(ours, -1, -2) if transposed else ours
        scale = np.max(np.abs(theirs))
        assert np.max(np.abs(ours - theirs)) <= 1e-4 * scale, f"{name}: {np.max(np.abs(ours - theirs))} vs {scale}"
        compared.add(name)
    assert compared == set(hf_grads)  # every parameter's gradient, by its HF name


def test_packed_documents_equal_each_document_alone(checkpoint_factory):
    folder, torch_model = checkpoint_factory("qwen3", num_hidden_layers=2)
    model = from_pretrained(folder, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 97, n) for n in (5, 8, 3)]
    ids = np.concatenate(documents)[None]
    segments = np.concatenate([np.full(len(d), i) for i, d in enumerate(documents)])[None]
    packed = causal_lm_loss(model, ids, ids, segment_ids=segments)
    # transformers on each document alone; the packed loss is the token-weighted mean.
    with torch.no_grad():
        losses = [float(torch_model(torch.tensor(d[None]), labels=torch.tensor(d[None])).loss) for d in documents]
    expected = sum(l * (len(d) - 1) for l, d in zip(losses, documents)) / sum(len(d) - 1 for d in documents)
    assert abs(float(packed) - expected) < 1e-5
    with pytest.raises(ValueError, match="segment_ids \\(packed sequences\\) are for a forward pass without a cache"):
        model(ids, model.init_cache(1, 32), segment_ids=segments)


def test_remat_policies_give_identical_gradients_and_less_memory(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3", num_hidden_layers=3, hidden_size=64, intermediate_size=256)
    model = from_pretrained(folder, dtype=jnp.float32)
    ids = np.random.default_rng(2).integers(0, 97, (4, 64))
    grad = eqx.filter_jit(eqx.filter_grad(causal_lm_loss))
    reference = None
    temp = {}
    for policy in ("none", "dots", "full"):
        remat = model.with_remat(policy)
        grads = grad(remat, ids, ids)
        leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
        if reference is None:
            reference = leaves
        else:
            for a, b in zip(leaves, reference):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
        params, static = eqx.partition(remat, eqx.is_array)
        compiled = jax.jit(
            lambda p, i: eqx.filter_grad(causal_lm_loss)(eqx.combine(p, static), i, i)
        ).lower(params, jnp.asarray(ids)).compile()
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["dots"] < temp["none"], temp
    with pytest.raises(ValueError, match="Unknown remat policy 'some'"):
        model.with_remat("some")


def test_accumulated_steps_equal_one_step_on_the_whole_batch(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3", num_hidden_layers=2)
    model = from_pretrained(folder, dtype=jnp.float32)
    ids, mask, labels = padded_batch(model.config.vocab_size)
    ids, mask, labels = (np.concatenate([a, a[::-1]]).astype(np.int32) for a in (ids, mask, labels))
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    results = []
    for steps in (1, 3):
        init, step = make_train_step(optax.sgd(0.1), accumulation_steps=steps)
        copy = jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, model)
        new, _, metrics = step(copy, init(copy), dict(batch))
        results.append((new, metrics))
    assert abs(float(results[0][1]["loss"]) - float(results[1][1]["loss"])) < 1e-5
    assert int(results[0][1]["tokens"]) == int((labels[:, 1:] != -100).sum())
    for a, b in zip(jax.tree.leaves(eqx.filter(results[0][0], eqx.is_array)),
                    jax.tree.leaves(eqx.filter(results[1][0], eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="accumulation_steps must be at least 1"):
        make_train_step(optax.sgd(0.1), accumulation_steps=0)


def test_training_lowers_the_loss_in_float32_and_bfloat16(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3", num_hidden_layers=2)
    ids = np.tile(np.arange(16, dtype=np.int32), (4, 1))  # a pattern to learn
    batch = {"input_ids": ids, "labels": ids}
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(3e-3, 1e-3, 20)))
    for dtype in (jnp.float32, jnp.bfloat16):
        model = from_pretrained(folder, dtype=dtype)
        init, step = make_train_step(optimizer)
        opt_state = init(model)
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(opt_state) if eqx.is_inexact_array(leaf))
        losses = []
        compiles = []
        listener = lambda event, duration, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
        for i in range(20):
            if i == 1:  # the first step compiles; the states it returns must not make the next compile again
                jax.monitoring.register_event_duration_secs_listener(listener)
            model, opt_state, metrics = step(model, opt_state, dict(batch))
            losses.append(float(metrics["loss"]))
        jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == [], dtype
        assert model.dtype == dtype
        assert losses[-1] < 0.5 * losses[0], (dtype, losses)
