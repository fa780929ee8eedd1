"""Loading and saving checkpoints, and the errors bad checkpoints give."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import eqx_models
from conftest import STORIES, require_fixture, torch_logits


SAVE_CASES = {
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "qwen3_moe_mixed": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0, 2]),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2)),
    "mistral": ("mistral", dict(sliding_window=8)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, sliding_window=4, sliding_window_pattern=2, head_dim=8)),
}


@pytest.mark.parametrize("case", SAVE_CASES)
def test_save_pretrained_loads_in_transformers_with_identical_logits(case, checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    model_type, overrides = SAVE_CASES[case]
    folder, reference = checkpoint_factory(model_type, **overrides)
    model = eqx_models.from_pretrained(folder)
    ids = np.random.default_rng(0).integers(0, 97, (2, 12))
    out = tmp_path / "saved"
    eqx_models.save_pretrained(model, out)

    reloaded_torch = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_array_equal(torch_logits(reloaded_torch, ids), torch_logits(reference, ids))
    reloaded = eqx_models.from_pretrained(out)
    np.testing.assert_array_equal(np.asarray(reloaded(ids)[0]), np.asarray(model(ids)[0]))
    assert reloaded.config == model.config


def test_sharded_save_round_trips(checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, reference = checkpoint_factory("llama", tie_word_embeddings=True)
    model = eqx_models.from_pretrained(folder)
    out = tmp_path / "sharded"
    eqx_models.save_pretrained(model, out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).exists() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied

    ids = np.random.default_rng(1).integers(0, 97, (1, 10))
    reloaded_torch = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_array_equal(torch_logits(reloaded_torch, ids), torch_logits(reference, ids))
    np.testing.assert_array_equal(
        np.asarray(eqx_models.from_pretrained(out)(ids)[0]), np.asarray(model(ids)[0])
    )


def test_bfloat16_loading_casts_weights_and_cache():
    import jax.numpy as jnp

    model = eqx_models.from_pretrained(require_fixture(STORIES), dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    assert model.init_cache(1, 8).keys.dtype == jnp.bfloat16
    reference = eqx_models.from_pretrained(STORIES)
    ids = np.asarray([[1, 403, 407, 261, 378]])
    difference = np.abs(np.asarray(model(ids)[0], np.float32) - np.asarray(reference(ids)[0]))
    assert difference.max() < 0.5  # bfloat16 keeps ~3 significant digits


def copy_checkpoint(folder, tmp_path):
    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    return target


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No folder at"):
        eqx_models.from_pretrained(tmp_path / "does-not-exist")


def test_unknown_hub_repo_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set and the repo is not in the local cache"):
        eqx_models.from_pretrained("nobody-has/this-model-xyz")


def test_unsupported_model_type_names_it(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("llama")
    edited = copy_checkpoint(folder, tmp_path)
    config = json.loads((edited / "config.json").read_text())
    config.update(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"])
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(eqx_models.ConfigError, match="Unsupported model_type 'gpt_bigcode'.*llama.*qwen3"):
        eqx_models.from_pretrained(edited)


def test_config_keys_that_change_the_math_are_refused(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("llama")
    edited = copy_checkpoint(folder, tmp_path)
    config = json.loads((edited / "config.json").read_text())
    config["logit_softcapping"] = 30.0
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(eqx_models.ConfigError, match="logit_softcapping"):
        eqx_models.from_pretrained(edited)


@pytest.mark.parametrize(
    "model_type, overrides, edit, message",
    [
        ("gemma3_text", dict(num_hidden_layers=2, head_dim=8), dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
        ("gemma3_text", dict(num_hidden_layers=2, head_dim=8), dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        ("qwen2", {}, dict(use_sliding_window=True), "sliding-window layers"),
    ],
)
def test_unimplemented_architecture_settings_are_refused(checkpoint_factory, tmp_path, model_type, overrides, edit, message):
    folder, _ = checkpoint_factory(model_type, **overrides)
    edited = copy_checkpoint(folder, tmp_path)
    config = json.loads((edited / "config.json").read_text())
    config.update(edit)
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(eqx_models.ConfigError, match=message):
        eqx_models.from_pretrained(edited)


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("qwen3")
    edited = copy_checkpoint(folder, tmp_path)
    edit_tensors(edited, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(eqx_models.CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_norm\.weight"):
        eqx_models.from_pretrained(edited)


def test_wrongly_shaped_tensor_reports_both_shapes(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("llama")
    edited = copy_checkpoint(folder, tmp_path)

    def shrink(tensors):
        tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"][:40]

    edit_tensors(edited, shrink)
    with pytest.raises(
        eqx_models.CheckpointError,
        match=r"model\.layers\.2\.mlp\.up_proj\.weight has shape \(40, 32\), expected \(48, 32\)",
    ):
        eqx_models.from_pretrained(edited)


def test_unexpected_tensor_is_named(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("llama")
    edited = copy_checkpoint(folder, tmp_path)
    edit_tensors(edited, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(eqx_models.CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm\.weight"):
        eqx_models.from_pretrained(edited)


def test_truncated_safetensors_file_is_a_clear_error(tmp_path):
    edited = copy_checkpoint(require_fixture(STORIES), tmp_path)
    path = edited / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(eqx_models.CheckpointError, match="truncated or corrupt"):
        eqx_models.from_pretrained(edited)


def test_no_weights_at_all_is_a_clear_error(tmp_path):
    edited = copy_checkpoint(require_fixture(STORIES), tmp_path)
    (edited / "model.safetensors").unlink()
    with pytest.raises(eqx_models.CheckpointError, match=r"No \*\.safetensors files"):
        eqx_models.from_pretrained(edited)
