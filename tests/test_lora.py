"""LoRA adapters: zero start, training only the adapters, merging, PEFT's layout."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from eqx_models import from_pretrained, save_pretrained
from eqx_models.lora import apply_lora, load_adapters, lora_filter, merge_lora, save_adapters
from eqx_models.training import make_train_step


@pytest.fixture
def adapted(checkpoint_factory):
    folder, torch_model = checkpoint_factory("qwen3", num_hidden_layers=2)
    model = from_pretrained(folder, dtype=jnp.float32)
    return folder, torch_model, model, apply_lora(model, rank=4, alpha=8, targets="q_proj|v_proj|down_proj", key=jax.random.key(1))


def with_random_b(model, seed=0):
    """The adapters' B matrices drawn at random (as after training), so they change logits."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    rng = np.random.default_rng(seed)
    new = [0.3 * jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype) if path[-1].name == "lora_B" else leaf
           for path, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


def test_zero_adapters_leave_logits_unchanged(adapted):
    _, _, model, lora = adapted
    ids = np.random.default_rng(0).integers(0, 97, (2, 9))
    np.testing.assert_array_equal(np.asarray(lora(ids)[0]), np.asarray(model(ids)[0]))
    adapters = [p for p, leaf in jax.tree_util.tree_flatten_with_path(lora)[0] if p[-1].name in ("lora_A", "lora_B")]
    assert len(adapters) == 6  # q, v, down: A and B each, stacked over the 2 layers
    assert lora.model.layers.self_attn.q_proj.lora_A.shape == (2, 4, 32)
    assert lora.model.layers.mlp.down_proj.lora_B.shape == (2, 32, 4)


def test_training_moves_only_the_adapters_and_merging_keeps_the_logits(adapted):
    _, _, model, lora = adapted
    ids = np.tile(np.arange(12, dtype=np.int32), (4, 1))
    init, step = make_train_step(optax.adam(1e-2), trainable=lora_filter(lora))
    opt_state = init(lora)
    before = jax.tree.map(lambda a: np.asarray(a).copy(), eqx.filter(lora, eqx.is_array))
    losses = []
    for _ in range(15):
        lora, opt_state, metrics = step(lora, opt_state, {"input_ids": ids, "labels": ids})
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                                jax.tree.leaves(eqx.filter(lora, eqx.is_array))):
        changed = not np.array_equal(old, np.asarray(new))
        assert changed == (path[-1].name in ("lora_A", "lora_B")), path
    merged = merge_lora(lora)
    assert not any(p[-1].name.startswith("lora") for p, _ in jax.tree_util.tree_flatten_with_path(merged)[0])
    probe = np.random.default_rng(3).integers(0, 97, (2, 9))
    assert np.max(np.abs(np.asarray(merged(probe)[0]) - np.asarray(lora(probe)[0]))) < 1e-4
    with pytest.raises(ValueError, match="carries LoRA adapters"):
        save_pretrained(lora, "unused")


def test_saved_adapters_load_in_peft_and_back(adapted, tmp_path):
    import peft

    folder, torch_model, model, lora = adapted
    lora = with_random_b(lora)
    save_adapters(lora, tmp_path / "adapters", base_model_name_or_path=str(folder))
    ids = np.random.default_rng(4).integers(0, 97, (2, 9))
    ours = np.asarray(lora(ids)[0])
    assert np.max(np.abs(ours - np.asarray(model(ids)[0]))) > 1e-2  # the adapters matter

    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(torch_model, tmp_path / "adapters").eval()
        theirs = peft_model(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) < 1e-4
    loaded = load_adapters(model, tmp_path / "adapters")
    np.testing.assert_allclose(np.asarray(loaded(ids)[0]), ours, rtol=0, atol=1e-6)


def test_a_pattern_that_matches_nothing_names_the_projections(adapted):
    _, _, model, _ = adapted
    with pytest.raises(ValueError, match="matches no projection; the model's projections are .*'q_proj'"):
        apply_lora(model, rank=4, targets="query", key=jax.random.key(0))
    with pytest.raises(ValueError, match="not a regular expression"):
        apply_lora(model, rank=4, targets="q_proj(", key=jax.random.key(0))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        apply_lora(model, rank=0, key=jax.random.key(0))
