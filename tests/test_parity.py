"""Parity with `transformers` on tiny random checkpoints: logits and greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_models
from conftest import release_compiled_code, torch_logits

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-llama3-rope": ("llama", dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3-mha-tied": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-gqa-head-dim": ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
    "qwen3-mqa": ("qwen3", dict(num_key_value_heads=1, head_dim=12)),
    # Qwen3's long-context setting: YaRN with a factor of 4 over an original length the prompt passes.
    "qwen3-yarn-rope": ("qwen3", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32), max_position_embeddings=128)),
    "qwen2-gqa": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2-mha-tied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-moe-norm-topk": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    ),
    "qwen3-moe-raw-topk": (
        "qwen3_moe",
        dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False, head_dim=12),
    ),
    # Dense and sparse layers in one scan: layer 1 listed dense, or only every second layer sparse.
    "qwen3-moe-mlp-only-layers": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]),
    ),
    "qwen3-moe-sparse-step": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, decoder_sparse_step=2),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Windows shorter than the prompt (40) and the generation (24): the ring cache wraps.
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "mistral-no-window": ("mistral", dict(sliding_window=None, num_key_value_heads=1)),
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    # Local and global layers in one scan; 5 layers with the pattern of 2 (not a multiple).
    "gemma3-pattern": (
        "gemma3_text",
        dict(num_hidden_layers=5, sliding_window=8, sliding_window_pattern=2, head_dim=16, query_pre_attn_scalar=12),
    ),
    "gemma3-layer-types-tied": (
        "gemma3_text",
        dict(
            num_hidden_layers=4,
            sliding_window=6,
            head_dim=8,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
    ),
    # A prompt (40) past original_max_position_embeddings (32): every call uses the long factors.
    "phi3-longrope-long": (
        "phi3",
        dict(partial_rotary_factor=0.75, original_max_position_embeddings=32, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0, 1.2, 1.5], long_factor=[2.0, 3.0, 4.0])),
    ),
    "phi3-mini-4k-window": ("phi3", dict(sliding_window=7, num_key_value_heads=4)),
    "smollm3-sliding-nope-layers": ("smollm3", dict(use_sliding_window=True, sliding_window=6, no_rope_layer_interval=3)),
    "gemma2-no-softcaps-tied": (
        "gemma2", dict(sliding_window=6, head_dim=8, attn_logit_softcapping=None, final_logit_softcapping=None),
    ),
    "exaone4-global-rope": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 3, head_dim=16)),
    "cohere2-pattern": ("cohere2", dict(num_hidden_layers=5, sliding_window=7, sliding_window_pattern=3, logit_scale=2.0)),
    "olmo2-gqa-tied": ("olmo2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # One expert per token, one key/value head, YaRN with its default truncation, no bias on q/k/v/o.
    "gpt-oss-top1-mqa-no-attention-bias": ("gpt_oss", dict(
        num_local_experts=3, num_experts_per_tok=1, num_key_value_heads=1, sliding_window=5, attention_bias=False,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=5000.0),
    )),
    "granite-untied-gqa": ("granite", dict(num_key_value_heads=1, embedding_multiplier=0.5, logits_scaling=0.5)),
}

# Longer than the llama3 case's original_max_position_embeddings (32), so the
# scaled frequencies matter.
PROMPT_LEN = 40
NEW_TOKENS = 30


@pytest.fixture(autouse=True)
def _release_each_cases_programs():
    yield
    release_compiled_code()  # every case is a model of its own (see conftest)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case, checkpoint_factory):
    model_type, overrides = CASES[case]
    folder, reference = checkpoint_factory(model_type, **overrides)
    model = eqx_models.from_pretrained(folder)

    ids = np.random.default_rng(1).integers(0, reference.config.vocab_size, (2, PROMPT_LEN))
    expected = torch_logits(reference, ids)
    logits, cache = model(ids)
    assert cache is None
    assert 1.0 < np.abs(expected).max() < 100.0  # the comparison is on realistic logits
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)

    with torch.no_grad():
        reference_tokens = reference.generate(
            torch.tensor(ids[:1]),
            attention_mask=torch.ones((1, PROMPT_LEN), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, PROMPT_LEN:].numpy()
    tokens = eqx_models.generate(model, ids[:1], max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert tokens.shape == (1, NEW_TOKENS)
    np.testing.assert_array_equal(tokens[0], reference_tokens)


def test_config_head_dim_differs_from_hidden_over_heads(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3", head_dim=16)
    config = eqx_models.from_pretrained(folder).config
    assert config.head_dim == 16 != config.hidden_size // config.num_attention_heads


def test_gelu_tanh_is_as_accurate_as_torchs():
    # Gemma's MLP activation: XLA:CPU's tanh (2.6e-7 off) made jax.nn.gelu 8.5e-7 off
    # float64, twice torch's error, enough to move 5-layer Gemma logits by ~1e-4.
    from eqx_models.nn.mlp import gelu_tanh

    x = np.linspace(-12, 12, 400_001, dtype=np.float32)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    ours = np.asarray(jax.jit(gelu_tanh)(x), np.float64)
    theirs = torch.nn.functional.gelu(torch.tensor(x), approximate="tanh").double().numpy()
    assert np.abs(ours - exact).max() <= np.abs(theirs - exact).max()
    assert np.isfinite(np.asarray(gelu_tanh(jnp.asarray([-1e4, 1e4], jnp.float32)))).all()
