"""One tiny `transformers` config per registered architecture: the zoo-wide tests
(`test_zoo.py`, the logical-axes walk, the engine and mesh cases) run every
`model_type` that `eqx_models.supported_model_types()` lists from these, and fail
for one that has no entry here.

Each entry is the overrides `conftest.tiny_config` applies, chosen so the
family's own features are on: windows shorter than the test prompts, experts,
local and global layers.
"""

TINY = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]),
    "qwen2": dict(),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "gemma3_text": dict(
        num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2, head_dim=16, query_pre_attn_scalar=12
    ),
    "granite": dict(
        embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=2.5,
        tie_word_embeddings=True,
    ),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2, tie_word_embeddings=True),
    "olmo2": dict(),
    "gemma2": dict(
        num_hidden_layers=4, sliding_window=8, head_dim=16, query_pre_attn_scalar=12,
        attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
    ),
    # LongRoPE on half of each head; the tests stay below the pretraining length
    # (tests/test_parity.py runs a prompt past it).
    "phi3": dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=128,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[2.0, 3.0]),
    ),
    "exaone4": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2),
    "cohere2": dict(num_hidden_layers=4, sliding_window=8, logit_scale=0.5, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    # Windows shorter than the prompts; sinks and biases random like the rest; a
    # SwiGLU limit the activations cross often; YaRN over an original length the
    # prompts pass.
    "gpt_oss": dict(
        num_hidden_layers=4, sliding_window=8, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        swiglu_limit=1.5, rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                               truncate=False, original_max_position_embeddings=32, rope_theta=10000.0),
    ),
    # Low-rank queries, dense first layer, groups of experts of which two may serve a
    # token, shared experts, YaRN whose mscale_all_dim also scales the scores.
    "deepseek_v3": dict(
        num_hidden_layers=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, num_key_value_heads=4,
        rope_parameters=dict(rope_type="yarn", factor=8.0, mscale=0.8, mscale_all_dim=0.8, beta_fast=32.0,
                             beta_slow=1.0, original_max_position_embeddings=32, rope_theta=10000.0),
    ),
    # Queries through one q_proj (V2-Lite), a dense first layer, group-limited
    # softmax routing over four groups, two shared experts.
    "deepseek_v2": dict(
        num_hidden_layers=3, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, n_routed_experts=8, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=2,
        routed_scaling_factor=1.5, num_key_value_heads=4,
    ),
    # One block of (DeltaNet, DeltaNet, gated attention); value heads sharing key
    # heads; experts and the shared expert; a quarter of each attention head rotates.
    # With random weights the DeltaNet outputs the norm then scales up are small
    # differences of larger terms, so transformers' own float32 logits are ~1e-4
    # from its float64 ones with two blocks (2e-5 with one): tests/test_qwen3_next.py
    # checks two blocks where no float32 reference is involved.
    "qwen3_next": dict(
        num_hidden_layers=3, full_attention_interval=3, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    ),
}


def tiny_overrides(model_type: str) -> dict:
    """The overrides for `model_type`; a registered type without an entry fails here."""
    if model_type not in TINY:
        raise KeyError(
            f"No tiny test config for registered model_type {model_type!r}: add one to tests/zoo.py TINY."
        )
    return TINY[model_type]
