"""The published configs build (shapes only, nothing allocated) with the published sizes."""

import math

import equinox as eqx
import jax
import pytest
import torch

from eqx_models.models import architecture_for
from eqx_models.nn.causal_lm import CausalLM

QWEN3_0_6B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    use_sliding_window=False, sliding_window=None, max_window_layers=28, attention_bias=False, hidden_act="silu",
)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
    max_window_layers=48, attention_bias=False, hidden_act="silu", output_router_logits=False,
    router_aux_loss_coef=0.001,
)
LLAMA_3_1_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    attention_bias=False, mlp_bias=False, hidden_act="silu",
)
LLAMA_3_1_70B = dict(
    LLAMA_3_1_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
)
QWEN2_5_7B = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    use_sliding_window=False, sliding_window=131072, max_window_layers=28, hidden_act="silu",
)
MISTRAL_7B_V0_1 = dict(
    model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=4096, hidden_act="silu",
)
GEMMA_3_1B = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
    rms_norm_eps=1e-6, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh", attention_bias=False, final_logit_softcapping=None,
    attn_logit_softcapping=None, cache_implementation="hybrid", tie_word_embeddings=True,
)
MIXTRAL_8X7B = dict(
    model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, hidden_act="silu",
    output_router_logits=False, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
)

# Totals as published on the model cards / safetensors metadata.
PUBLISHED = {
    "Qwen3-0.6B": (QWEN3_0_6B, 596_049_920),
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30_532_122_624),
    "Llama-3.1-8B": (LLAMA_3_1_8B, 8_030_261_248),
    "Llama-3.1-70B": (LLAMA_3_1_70B, 70_553_706_496),
    "Qwen2.5-7B": (QWEN2_5_7B, 7_615_616_512),
    "Mistral-7B-v0.1": (MISTRAL_7B_V0_1, 7_241_732_096),
    "Gemma-3-1B": (GEMMA_3_1B, 999_885_952),
    "Mixtral-8x7B-v0.1": (MIXTRAL_8X7B, 46_702_792_704),
}


def shapes_of(hf_config: dict) -> CausalLM:
    config = architecture_for(hf_config).config_from_hf(hf_config)
    return eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))


def parameter_count(model) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model) if hasattr(leaf, "shape"))


def transformers_parameter_count(hf_config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "cache_implementation")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_config["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_builds_without_allocating_and_counts_match(name):
    hf_config, published = PUBLISHED[name]
    model = shapes_of(hf_config)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(model))
    count = parameter_count(model)
    assert count == published
    assert count == transformers_parameter_count(hf_config)


def test_qwen3_30b_a3b_active_parameters_per_token():
    model = shapes_of(QWEN3_30B_A3B)
    experts = model.model.layers.mlp.experts
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    active = parameter_count(model) - expert_params * (128 - 8) // 128
    # "30.5B total, 3.3B activated" on the model card (3.35B: the card truncates).
    assert 3.3e9 <= active < 3.4e9
