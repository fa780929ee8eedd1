"""The mixture-of-experts block: routing, grouping by expert, and the model around it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_models
from eqx_models.config import ConfigError
from eqx_models.nn.moe import SparseMoeBlock, expert_blocks, route
from zoo import tiny_overrides


@pytest.mark.parametrize("count, experts, block_rows", [(8, 64, 16), (40, 4, 16), (33, 8, 4), (5, 5, 1)])
def test_expert_blocks_cover_every_assignment_once_in_single_expert_blocks(count, experts, block_rows):
    chosen = jnp.asarray(np.random.default_rng(count).integers(0, experts, count), jnp.int32)
    rows, block_expert, used = expert_blocks(chosen, experts, block_rows)
    rows, block_expert, used = np.asarray(rows), np.asarray(block_expert), int(used)
    assert rows.shape[1] == block_rows
    real = rows[rows < count]
    np.testing.assert_array_equal(np.sort(real), np.arange(count))  # each assignment exactly once
    for block in range(rows.shape[0]):
        members = rows[block][rows[block] < count]
        if block >= used:
            assert members.size == 0
        else:
            assert members.size > 0 and np.all(np.asarray(chosen)[members] == block_expert[block])
    # As few blocks as the per-expert counts need.
    per_expert = np.bincount(np.asarray(chosen), minlength=experts)
    assert used == int(np.sum(-(-per_expert // block_rows)))


def test_moe_block_equals_the_dense_sum_over_chosen_experts():
    block = SparseMoeBlock(16, 12, num_experts=6, top_k=2, norm_topk_prob=False, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 5, 16))
    weights, chosen = route(block.gate(x.reshape(-1, 16)), 2, normalize=False)
    experts = block.experts
    expected = []
    for t, token in enumerate(x.reshape(-1, 16)):
        total = jnp.zeros(16)
        for w, e in zip(weights[t], chosen[t]):
            hidden = jax.nn.silu(experts.gate_proj.weight[e] @ token) * (experts.up_proj.weight[e] @ token)
            total = total + w * (experts.down_proj.weight[e] @ hidden)
        expected.append(total)
    np.testing.assert_allclose(block(x), jnp.stack(expected).reshape(x.shape), atol=1e-5, rtol=0)


def test_dense_and_sparse_layers_stack_separately_and_run_in_one_scan(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                   mlp_only_layers=[1])
    model = eqx_models.from_pretrained(folder)
    assert model.config.sparse_layers == (0, 2)
    mlp = model.model.layers.mlp
    assert mlp.dense.gate_proj.weight.shape[0] == 1 and mlp.sparse.experts.gate_proj.weight.shape[:2] == (2, 4)
    ids = np.random.default_rng(0).integers(0, 97, (1, 9))
    hlo = jax.jit(lambda m, i: m(i)[0]).lower(model, ids).as_text()
    # The layers run as a loop whose body branches per layer (one scan, not unrolled).
    assert "stablehlo.while" in hlo and ("stablehlo.case" in hlo or "stablehlo.if" in hlo)
    scanned, _ = model(ids)
    unrolled, _ = model.with_scan_layers(False)(ids)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=0)


def test_an_moe_config_without_experts_is_refused(checkpoint_factory, tmp_path):
    import json
    import shutil

    folder, _ = checkpoint_factory("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    config = json.loads((edited / "config.json").read_text())
    config.pop("num_local_experts", None)
    config.pop("num_experts", None)
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_experts"):
        eqx_models.from_pretrained(edited)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("model_type, overrides", [
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                       mlp_only_layers=[1])),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=3, num_experts_per_tok=2, sliding_window=5)),
    ("deepseek_v3", tiny_overrides("deepseek_v3")),  # routing by groups of experts, a shared expert
    ("deepseek_v2", tiny_overrides("deepseek_v2")),
    ("qwen3_next", tiny_overrides("qwen3_next")),  # a gated shared expert
])
def test_grouped_experts_match_transformers(platform, model_type, overrides, checkpoint_factory, monkeypatch):
    """Off the CPU the experts run as grouped products over every assignment
    (`grouped_matmul`); here with the backend a TPU or GPU process picks (its
    policies, the reference ops where its kernels cannot run on the CPU). The TPU
    groups only experts whose widths its kernel tiles, so its models are wider."""
    from conftest import release_compiled_code, torch_logits
    import torch

    from eqx_models.backends import active_backend
    from eqx_models.ops import groups_experts

    if platform == "tpu":  # expert widths the TPU's grouped kernel tiles (multiples of 128)
        width = "intermediate_size" if model_type in ("gpt_oss", "mixtral") else "moe_intermediate_size"
        overrides = dict(overrides, hidden_size=128, **{width: 128})
    folder, reference = checkpoint_factory(model_type, **overrides)
    model = eqx_models.from_pretrained(folder)
    ids = np.random.default_rng(1).integers(0, reference.config.vocab_size, (2, 24))
    expected = torch_logits(reference, ids)
    with torch.no_grad():
        reference_tokens = reference.generate(torch.tensor(ids[:1]), attention_mask=torch.ones((1, 24), dtype=torch.long),
                                              max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 24:].numpy()
    release_compiled_code()
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    try:
        assert active_backend().name == platform
        assert groups_experts(jnp.zeros((4, 128, 256)))  # [experts, out, in]
        assert "ragged_dot_general" in str(jax.make_jaxpr(lambda i: model(i)[0])(ids))
        logits, _ = model(ids)
        np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)
        tokens = eqx_models.generate(model, ids[:1], max_new_tokens=12, eos_token_id=[])
        np.testing.assert_array_equal(tokens[0], reference_tokens)
    finally:
        release_compiled_code()  # the programs traced for another backend must not serve the CPU's calls
