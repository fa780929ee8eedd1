"""The published configs build (shapes only, nothing allocated) with the published sizes,
and pass config validation as published."""

import copy
import math

import equinox as eqx
import jax
import pytest
import torch

from eqx_models.config import validate_hf_config
from eqx_models.models import architecture_for
from eqx_models.nn.causal_lm import CausalLM

QWEN3_0_6B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=None, max_window_layers=28,
    attention_bias=False, attention_dropout=0.0, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
    torch_dtype="bfloat16", transformers_version="4.51.0", use_cache=True, initializer_range=0.02,
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
# Qwen2.5's model card: add this rope_scaling for inputs past 32,768 tokens.
QWEN2_5_7B_INSTRUCT_YARN = dict(
    QWEN2_5_7B, max_position_embeddings=32768,
    rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
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
# Gemma 3 1B as transformers 5 writes it (save_pretrained): one rope parameter set
# per layer type, the layer types listed, the old rope fields gone.
GEMMA_3_1B_TRANSFORMERS_5 = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], transformers_version="5.0.0", dtype="bfloat16",
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
    initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    attention_bias=False, attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
    final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
    cache_implementation="hybrid",
)
# The 4B and larger Gemma 3 stretch their global layers' positions 8 times.
GEMMA_3_LINEAR_TRANSFORMERS_5 = dict(
    GEMMA_3_1B_TRANSFORMERS_5,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
)
MIXTRAL_8X7B = dict(
    model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, hidden_act="silu",
    output_router_logits=False, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
)

GEMMA_2_2B = dict(
    model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=2304,
    intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=4096,
    query_pre_attn_scalar=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", attention_bias=False,
    tie_word_embeddings=True, cache_implementation="hybrid",
)
PHI_3_MINI_4K = dict(
    model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=32064, hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None,
    rms_norm_eps=1e-5, sliding_window=2047, hidden_act="silu", tie_word_embeddings=False, embd_pdrop=0.0,
    resid_pdrop=0.0, attention_dropout=0.0,
)
# Long and short factors: 48 each in the release (their values do not change any shape).
PHI_4_MINI = dict(
    PHI_3_MINI_4K, vocab_size=200064, num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
    max_position_embeddings=131072, sliding_window=262144, tie_word_embeddings=True,
    rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[1.0] * 48),
)
# Phi-3.5-mini-instruct: LongRoPE, the pretraining length outside rope_scaling.
# 48 factors each in the release; the values here are stand-ins of the same form.
PHI_3_5_MINI = dict(
    PHI_3_MINI_4K, max_position_embeddings=131072, original_max_position_embeddings=4096, sliding_window=262144,
    bos_token_id=1, eos_token_id=32000, pad_token_id=32000, attention_bias=False, torch_dtype="bfloat16",
    rope_scaling={
        "long_factor": [1.0800000429153442 + 0.5 * i for i in range(48)],
        "short_factor": [1.0 + 0.01 * i for i in range(48)],
        "type": "longrope",
    },
)
OLMO_2_7B = dict(
    model_type="olmo2", architectures=["Olmo2ForCausalLM"], vocab_size=100352, hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=4096, rope_theta=500000, rms_norm_eps=1e-6, attention_bias=False,
    tie_word_embeddings=False, hidden_act="silu",
)
SMOLLM3_3B = dict(
    model_type="smollm3", architectures=["SmolLM3ForCausalLM"], vocab_size=128256, hidden_size=2048,
    intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6,
    no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)], use_sliding_window=False, sliding_window=None,
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
)
GRANITE_3_1_8B = dict(
    model_type="granite", architectures=["GraniteForCausalLM"], vocab_size=49155, hidden_size=4096,
    intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=10000000.0, rms_norm_eps=1e-5, embedding_multiplier=12.0,
    residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0, tie_word_embeddings=True,
    attention_bias=False, mlp_bias=False, hidden_act="silu",
)
EXAONE_4_0_32B = dict(
    model_type="exaone4", architectures=["Exaone4ForCausalLM"], vocab_size=102400, hidden_size=5120,
    intermediate_size=27392, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, sliding_window=4096, sliding_window_pattern=4, rope_theta=1000000.0,
    rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
)
COMMAND_R7B = dict(
    model_type="cohere2", architectures=["Cohere2ForCausalLM"], vocab_size=256000, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, sliding_window=4096, sliding_window_pattern=4, layer_norm_eps=1e-5,
    logit_scale=0.25, rope_theta=50000.0, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
)
GPT_OSS_20B = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, hidden_act="silu", swiglu_limit=7.0,
    initial_context_length=4096, router_aux_loss_coef=0.9, output_router_logits=False,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096), rope_theta=150000,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096),
    topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, num_nextn_predict_layers=1,
    aux_loss_alpha=0.001, seq_aux=True,
)
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
    num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096),
    topk_method="greedy", scoring_func="softmax", moe_layer_freq=1, aux_loss_alpha=0.001, seq_aux=True,
    bos_token_id=100000, eos_token_id=100001,
)
QWEN3_NEXT_80B_A3B = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, partial_rotary_factor=0.25, max_position_embeddings=262144, rope_theta=10000000,
    rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, attention_bias=False,
    hidden_act="silu", output_router_logits=False, router_aux_loss_coef=0.001, bos_token_id=151643,
    eos_token_id=151645,
)

# Totals as published on the model cards / safetensors metadata.
PUBLISHED = {
    "Qwen3-0.6B": (QWEN3_0_6B, 596_049_920),
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30_532_122_624),
    "Llama-3.1-8B": (LLAMA_3_1_8B, 8_030_261_248),
    "Llama-3.1-70B": (LLAMA_3_1_70B, 70_553_706_496),
    "Qwen2.5-7B": (QWEN2_5_7B, 7_615_616_512),
    "Qwen2.5-7B-Instruct with YaRN": (QWEN2_5_7B_INSTRUCT_YARN, 7_615_616_512),
    "Mistral-7B-v0.1": (MISTRAL_7B_V0_1, 7_241_732_096),
    "Gemma-3-1B": (GEMMA_3_1B, 999_885_952),
    "Gemma-3-1B (transformers 5)": (GEMMA_3_1B_TRANSFORMERS_5, 999_885_952),
    "Mixtral-8x7B-v0.1": (MIXTRAL_8X7B, 46_702_792_704),
    "Gemma-2-2B": (GEMMA_2_2B, 2_614_341_888),
    "Phi-3-mini-4k": (PHI_3_MINI_4K, 3_821_079_552),
    "Phi-3.5-mini": (PHI_3_5_MINI, 3_821_079_552),
    "Phi-4-mini": (PHI_4_MINI, 3_836_021_760),
    "OLMo-2-1124-7B": (OLMO_2_7B, 7_298_617_344),
}
# Model cards that give the count in billions only: (config, billions, embeddings counted).
PUBLISHED_ROUNDED = {
    "SmolLM3-3B": (SMOLLM3_3B, 3.08, True),
    "Granite-3.1-8B": (GRANITE_3_1_8B, 8.17, True),
    "EXAONE-4.0-32B": (EXAONE_4_0_32B, 30.95, False),  # "without embeddings" on the card
    "Command-R7B": (COMMAND_R7B, 8.03, True),
    "gpt-oss-20b": (GPT_OSS_20B, 20.91, True),  # OpenAI's model card: 20.91B total, 3.61B active
}
# Cards that round to whole billions.
PUBLISHED_WHOLE_BILLIONS = {
    "DeepSeek-V3": (DEEPSEEK_V3, 671),  # the main model; the card's 685B adds the 14B MTP module
    "Qwen3-Next-80B-A3B": (QWEN3_NEXT_80B_A3B, 80),  # the card: "80B in total and 3B activated"
}


EVERY_PUBLISHED_CONFIG = {
    **{name: config for name, (config, *_) in PUBLISHED.items()},
    **{name: config for name, (config, *_) in PUBLISHED_ROUNDED.items()},
    **{name: config for name, (config, *_) in PUBLISHED_WHOLE_BILLIONS.items()},
    "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    "Gemma-3 linear (transformers 5)": GEMMA_3_LINEAR_TRANSFORMERS_5,
}


def shapes_of(hf_config: dict) -> CausalLM:
    config = architecture_for(hf_config).config_from_hf(hf_config)
    return eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))


def parameter_count(model) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model) if hasattr(leaf, "shape"))


def transformers_parameter_count(hf_config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers fills in the rope dicts it is given: a copy keeps the published ones as published.
    fields = {k: copy.deepcopy(v) for k, v in hf_config.items()
              if k not in ("model_type", "architectures", "cache_implementation")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_config["model_type"], **fields))
    saved = set(model.state_dict())  # saved buffers are weights too (DeepSeek-V3's routing bias)
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in saved)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_builds_without_allocating_and_counts_match(name):
    hf_config, published = PUBLISHED[name]
    model = shapes_of(hf_config)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(model))
    count = parameter_count(model)
    assert count == published
    assert count == transformers_parameter_count(hf_config)


@pytest.mark.parametrize("name", PUBLISHED_ROUNDED)
def test_published_config_builds_with_the_rounded_published_count(name):
    hf_config, billions, with_embeddings = PUBLISHED_ROUNDED[name]
    model = shapes_of(hf_config)
    count = parameter_count(model)
    assert count == transformers_parameter_count(hf_config)
    if not with_embeddings:
        head = 0 if model.lm_head is None else parameter_count(model.lm_head)
        count -= parameter_count(model.model.embed_tokens) + head
    assert round(count / 1e9, 2) == billions


@pytest.mark.parametrize("name", PUBLISHED_WHOLE_BILLIONS)
def test_published_config_builds_with_the_whole_billions_published(name):
    hf_config, billions = PUBLISHED_WHOLE_BILLIONS[name]
    count = parameter_count(shapes_of(hf_config))
    assert count == transformers_parameter_count(hf_config)
    assert round(count / 1e9) == billions


def test_deepseek_v3_active_parameters_per_token():
    model = shapes_of(DEEPSEEK_V3)
    assert model.config.cache_layout() == (1, 576, 0)  # the compressed cache: latent and rotary key
    experts = model.model.layers.mlp.sparse.experts
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    active = parameter_count(model) - expert_params * (256 - 8) // 256
    assert 37e9 <= active < 38e9  # "37B activated" on the card


def test_every_registered_architecture_has_a_published_config_here():
    from eqx_models import supported_model_types

    published = [*PUBLISHED.values(), *PUBLISHED_ROUNDED.values(), *PUBLISHED_WHOLE_BILLIONS.values()]
    covered = {config["model_type"] for config, *_ in published} | {DEEPSEEK_V2_LITE["model_type"]}
    assert set(supported_model_types()) <= covered, sorted(set(supported_model_types()) - covered)


def test_qwen3_30b_a3b_active_parameters_per_token():
    model = shapes_of(QWEN3_30B_A3B)
    experts = model.model.layers.mlp.experts
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    active = parameter_count(model) - expert_params * (128 - 8) // 128
    # "30.5B total, 3.3B activated" on the model card (3.35B: the card truncates).
    assert 3.3e9 <= active < 3.4e9


def test_gpt_oss_20b_active_parameters_per_token():
    model = shapes_of(GPT_OSS_20B)
    experts = model.model.layers.mlp.experts
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    embeddings = parameter_count(model.model.embed_tokens)
    # The card counts the unembedding, not the embedding table, as active.
    active = parameter_count(model) - embeddings - expert_params * (32 - 4) // 32
    assert round(active / 1e9, 2) == 3.61


def test_qwen3_next_80b_a3b_active_parameters_and_its_fixed_size_state():
    model = shapes_of(QWEN3_NEXT_80B_A3B)
    block = model.model.layers
    experts = [layer.mlp.experts for layer in (*block.linear_layers, block.attention_layer)]
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    embeddings = parameter_count(model.model.embed_tokens) + parameter_count(model.lm_head)
    active = parameter_count(model) - embeddings - expert_params * (512 - 10) // 512
    assert round(active / 1e9, 2) == 3.25  # "3B activated" on the card, embedding and head aside
    # 12 attention layers cache keys/values; 36 DeltaNet layers keep 32 heads of a
    # 128 x 128 float32 state and the convolution's last 3 inputs, whatever the length.
    state = model.config.recurrent_state(1, jax.numpy.bfloat16)
    assert model.config.num_blocks == 12 and state.recurrent.shape == (12, 1, 3, 32, 128, 128)
    assert state.conv.shape == (12, 1, 3, 2 * 16 * 128 + 32 * 128, 3)


def test_deepseek_v2_lite_total_and_active_parameters():
    model = shapes_of(DEEPSEEK_V2_LITE)
    count = parameter_count(model)
    assert count == transformers_parameter_count(DEEPSEEK_V2_LITE)
    experts = model.model.layers.mlp.sparse.experts
    expert_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(experts))
    # The card: "15.7B total parameters and 2.4B activated" (2.45B: truncated, and,
    # as gpt-oss's card, counting the unembedding but not the embedding table).
    active = count - parameter_count(model.model.embed_tokens) - expert_params * (64 - 6) // 64
    assert round(count / 1e9, 1) == 15.7 and 2.4e9 <= active < 2.5e9
    assert model.config.cache_layout() == (1, 576, 0)


@pytest.mark.parametrize("name", EVERY_PUBLISHED_CONFIG)
def test_published_config_passes_validation_and_reads(name):
    hf_config = EVERY_PUBLISHED_CONFIG[name]
    validate_hf_config(hf_config)
    config = architecture_for(hf_config).config_from_hf(hf_config)
    assert config.num_hidden_layers == hf_config["num_hidden_layers"]


def test_published_rope_settings_read_as_published():
    read = lambda hf: architecture_for(hf).config_from_hf(hf)
    assert read(LLAMA_3_1_8B).rope_scaling_dict == dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert read(QWEN2_5_7B_INSTRUCT_YARN).rope_scaling_dict == dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32768
    )
    assert read(DEEPSEEK_V3).rope_scaling_dict["original_max_position_embeddings"] == 4096
    phi = read(PHI_3_5_MINI).rope_scaling_dict
    assert phi["rope_type"] == "longrope" and phi["original_max_position_embeddings"] == 4096
    assert phi["factor"] == 32.0 and len(phi["long_factor"]) == len(phi["short_factor"]) == 48
    gemma = read(GEMMA_3_1B_TRANSFORMERS_5)
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.rope_scaling) == (1e6, 1e4, None)
    assert read(GEMMA_3_LINEAR_TRANSFORMERS_5).rope_scaling_dict == dict(rope_type="linear", factor=8.0)
    assert read(MIXTRAL_8X7B).sliding_window is None
    qwen3 = read(QWEN3_0_6B)
    assert (qwen3.head_dim, qwen3.rope_scaling) == (128, None)
