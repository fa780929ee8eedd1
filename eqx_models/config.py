"""The configuration shared by every decoder, in Hugging Face field names."""

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

# Keys every `transformers` config carries that never change the forward pass.
GENERIC_IGNORED_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tokenizer_class",
        "pretraining_tp",
        "max_window_layers",
        "layer_types",
        "use_sliding_window",
        "sliding_window",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "head_dim",
        "torchscript",
        "pruned_heads",
        "tf_legacy_loss",
        "use_bfloat16",
        "task_specific_params",
        "finetuning_task",
        "cross_attention_hidden_size",
        "add_cross_attention",
        "is_decoder",
        "tie_encoder_decoder",
        "decoder_start_token_id",
        "sep_token_id",
        "prefix",
        "bad_words_ids",
        "num_return_sequences",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "num_beam_groups",
        "diversity_penalty",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "tf32",
    }
)

# Every rope type the zoo computes, and the `rope_scaling` keys its frequencies
# read. The one table both `validate_hf_config` and `DecoderConfig` follow.
# `original_max_position_embeddings` may be left out of config.json: as
# transformers does, `read_rope` then takes `max_position_embeddings`.
ROPE_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_TYPE_KEYS)
# What generation allows when config.json does not say.
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """A `config.json` this library cannot represent faithfully."""


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """How one layer attends, as far as the decoder prepares it for the layer.

    Layers of the same kind share their rotary tables and masks; the decoder builds
    them once per distinct kind and hands each layer its own.

    Attributes:
        rope_theta: the rotary base, or None for a layer without rotary positions
            (NoPE).
        rope_scaling: the frozen `rope_scaling` (see `DecoderConfig`), or None.
        window: the sliding window (the last `window` positions, the token itself
            included), or None for full attention.
    """

    rope_theta: float | None
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    window: int | None = None


class CacheLayout(NamedTuple):
    """Per layer and token, what a KV cache stores (see `DecoderConfig.cache_layout`).

    Attributes:
        kv_heads: rows per token.
        key_dim: key channels per row.
        value_dim: value channels per row; 0 when the values are the keys' first
            channels and are not stored apart.
    """

    kv_heads: int
    key_dim: int
    value_dim: int


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hyperparameters of a decoder-only language model.

    Field names follow Hugging Face `transformers`. The dataclass is frozen and
    hashable, so models keep it as a static field. Each architecture's
    `config_from_hf` fills it from `config.json`. The fields here are the ones that
    cut across families; an architecture with settings of its own subclasses it
    (`eqx_models.models.gemma3.Gemma3Config`) and overrides `attention_kinds` when
    its layers attend differently.

    Attributes:
        model_type: HF `model_type` (`"qwen3"`, `"llama"`, ...).
        vocab_size: rows of the embedding table and the head.
        hidden_size: width of the residual stream.
        intermediate_size: width of a dense MLP.
        num_hidden_layers: decoder layers (the length of the stacked axis).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (fewer: grouped-query attention).
        head_dim: width of one head.
        max_position_embeddings: the longest sequence generation allows.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        rope_scaling: HF's `rope_scaling` dict frozen as sorted `(key, value)` pairs,
            or None.
        partial_rotary_factor: the fraction of each query/key head that rotates
            (the first channels).
        tie_word_embeddings: the head reuses the embedding table.
        attention_bias: biases on the q/k/v projections.
        o_proj_bias: a bias on the attention output projection (Llama: as
            `attention_bias`; Qwen2: none).
        mlp_bias: biases on the MLP projections.
        use_qk_norm: RMSNorm on every query and key head (Qwen3, Gemma 3).
        hidden_act: the MLP's gate activation (`silu` or `gelu_pytorch_tanh`).
        sliding_window: each token sees the last `sliding_window` positions; None
            for full attention.
        layer_types: per layer, `"sliding_attention"` or `"full_attention"` (Gemma,
            gpt-oss, ...); None means every layer slides when `sliding_window` is set.
        num_experts: experts per sparse layer (0: every MLP is dense).
        num_experts_per_tok: experts each token is routed to.
        moe_intermediate_size: width of one expert.
        norm_topk_prob: renormalise the kept routing weights to sum to one.
        mlp_only_layers: layers kept dense in an MoE model.
        decoder_sparse_step: only every `decoder_sparse_step`-th layer is sparse.
        bos_token_id, pad_token_id: special token ids, or None.
        eos_token_id: the ids that end generation.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention "
                "needs every key/value head to serve the same number of query heads. Fix "
                "these fields (see the model's published config.json)."
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported; expected one of "
                f"{SUPPORTED_ACTIVATIONS}."
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}."
            )
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        """Refuses a rope type the zoo does not compute, or one without the keys its
        frequencies read (`ROPE_TYPE_KEYS`)."""
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPE_KEYS:
            raise ConfigError(
                f"rope type {rope_type!r} is not supported; expected one of "
                f"{SUPPORTED_ROPE_TYPES}."
            )
        scaling = self.rope_scaling_dict or {}
        needed = ROPE_TYPE_KEYS[rope_type]
        missing = [key for key in needed if scaling.get(key) is None]
        if missing:
            raise ConfigError(
                f"the rope scaling (config.json's rope_scaling or rope_parameters) has rope type "
                f"{rope_type!r} but no {', '.join(missing)}; that type needs {', '.join(needed)}. "
                "Add them (see the model's published config.json)."
            )

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through the sliding window."""
        if self.sliding_window is None:
            return (False,) * self.num_hidden_layers
        if self.layer_types is None:
            return (True,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def cache_layout(self) -> "CacheLayout":
        """What the KV cache holds per layer and token: `kv_heads` rows of
        `key_dim` key channels and `value_dim` value channels.

        The default: the attention's key/value heads and `head_dim`. An attention
        that caches something else overrides it (Multi-head Latent Attention: one
        latent row per token, whose first channels serve as the values, so
        `value_dim` 0).

        Returns:
            A `CacheLayout`.
        """
        return CacheLayout(self.num_key_value_heads, self.head_dim, self.head_dim)

    @property
    def layers_per_block(self) -> int:
        """Layers in one element of the decoder's stack: 1, unless the architecture's
        layer class is a block of several layers with one attention among them (a
        hybrid such as Qwen3-Next: three linear-attention layers, then one full)."""
        return 1

    @property
    def num_blocks(self) -> int:
        """Elements of the stack the decoder scans over (and layers of the KV cache)."""
        return self.num_hidden_layers // self.layers_per_block

    def recurrent_state(self, batch_size: int, dtype) -> Any:
        """What a block carries from one call to the next besides keys and values: an
        `eqx.Module` of zeroed arrays `[blocks, batch, ...]` declaring their logical
        axes, or None (attention alone needs nothing else).

        Args:
            batch_size: rows.
            dtype: the cache dtype (a state may keep its own, e.g. float32 sums).

        Returns:
            The empty state, or None.
        """
        return None

    @property
    def rotary_dim(self) -> int:
        """Channels of a query/key head that rotate (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_kinds(self) -> tuple["AttentionKind", ...]:
        """Per layer (per block, see `layers_per_block`), how it attends: its rotary
        base and scaling, and its window.

        The default: every layer rotates with `rope_theta` / `rope_scaling`, and the
        sliding layers see the last `sliding_window` positions.

        Returns:
            One `AttentionKind` per layer.
        """
        full = AttentionKind(self.rope_theta, self.rope_scaling, None)
        local = AttentionKind(self.rope_theta, self.rope_scaling, self.sliding_window)
        return tuple(local if sliding else full for sliding in self.sliding_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none without experts)."""
        if not self.num_experts:
            return ()
        return tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """`rope_scaling` as the dict Hugging Face writes, or None."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling_dict or {}
        return scaling.get("rope_type", scaling.get("type", "default"))


def freeze_rope_scaling(scaling: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """Turns a `rope_scaling` dict into the hashable form `DecoderConfig` stores."""
    if not scaling:
        return None
    frozen = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in scaling.items()
        if k not in ("rope_theta", "partial_rotary_factor")
    }
    if "type" in frozen:  # the old spelling; `rope_type` wins where both are given, as in transformers
        frozen.setdefault("rope_type", frozen.pop("type"))
    if frozen.get("rope_type", "default") == "default" and len(frozen) <= 1:
        return None
    return tuple(sorted(frozen.items()))


def read_rope(hf: Mapping[str, Any], *, partial_rotary: bool = False) -> tuple[float, tuple | None, float]:
    """Reads `rope_theta`, the scaling and the partial rotary factor from either HF
    spelling.

    transformers 5 writes `rope_parameters` (theta and the factor inside); older
    configs write a top-level `rope_theta`, `partial_rotary_factor` and a
    `rope_scaling` dict. A factor other than 1 is refused unless the family
    implements it (`partial_rotary`). As transformers does, a scaling that needs
    the pretraining length and does not give it takes `max_position_embeddings`,
    and a longrope scaling without `factor` takes `max_position_embeddings /
    original_max_position_embeddings`.
    """
    params = hf.get("rope_parameters") or {}
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ConfigError(
            f"config field rope_parameters holds one set per layer type ({sorted(params)}), which model_type "
            f"{hf.get('model_type')!r} does not read; give one flat set (rope_type, rope_theta, ...)."
        )
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor") or (hf.get("rope_scaling") or {}).get("partial_rotary_factor")
    partial = float(partial or hf.get("partial_rotary_factor") or 1.0)
    if partial != 1.0 and not partial_rotary:
        raise ConfigError(
            f"partial_rotary_factor={partial} is not supported for model_type {hf.get('model_type')!r}, whose "
            "reference rotates every channel of a head."
        )
    max_positions = hf.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS
    return float(theta), freeze_rope_scaling(_with_length_defaults(scaling, max_positions)), partial


def _with_length_defaults(scaling: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
    """`scaling` with the pretraining length (and longrope's factor) filled in
    where it needs them and leaves them out, as transformers' `standardize_rope_params`
    and `_compute_longrope_parameters` do."""
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if "original_max_position_embeddings" not in ROPE_TYPE_KEYS.get(rope_type, ()):
        return scaling
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = max_positions
    if rope_type == "longrope" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def eos_ids(value: Any) -> tuple[int, ...]:
    """Normalises an `eos_token_id` (None, int or list) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def check_keys(hf: Mapping[str, Any], model_type: str, used: set[str], ignored: frozenset[str]) -> None:
    """Raises if `hf` has keys that are neither used nor known to be harmless."""
    unknown = sorted(set(hf) - used - ignored - GENERIC_IGNORED_KEYS)
    if unknown:
        raise ConfigError(
            f"config.json for model_type {model_type!r} has keys this library does not "
            f"implement: {unknown}. They may change the model's math, so loading stops here "
            "rather than computing something different from the reference. If they are "
            "harmless, remove them from config.json."
        )


def require_full_attention(hf: Mapping[str, Any], family: str) -> None:
    """Raises unless every layer of a Qwen-family config attends to the whole context.

    Their configs carry sliding-window fields that every released checkpoint
    leaves off (`use_sliding_window: false`); this library does not implement them
    for these families yet.
    """
    windowed = hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ())
    if windowed:
        raise ConfigError(
            f"{family} with sliding-window layers (use_sliding_window=true or layer_types other than "
            f"'full_attention') is not supported yet; every released {family} checkpoint has them off."
        )


def every_nth_full(num_layers: int, period: int) -> tuple[str, ...]:
    """`layer_types` for a pattern of `period - 1` sliding layers then one full
    layer, repeated (Gemma, gpt-oss, Cohere 2, EXAONE 4)."""
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers))


def decoder_config_from_hf(
    hf: Mapping[str, Any],
    *,
    use_qk_norm: bool,
    extra_ignored: frozenset[str] = frozenset(),
    config_class: type[DecoderConfig] = DecoderConfig,
    partial_rotary: bool = False,
    **fields: Any,
) -> DecoderConfig:
    """Builds a `DecoderConfig` (or `config_class`) from the Llama-family fields of
    an HF config dict; `fields` set or replace fields (an architecture's own, or
    what it reads differently). `partial_rotary` accepts a `partial_rotary_factor`
    other than 1."""
    model_type = hf.get("model_type", "?")
    required = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ]
    missing = [k for k in required if k not in hf]
    if missing:
        raise ConfigError(f"config.json for {model_type!r} lacks required keys {missing}.")
    used = set(required) | {
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "partial_rotary_factor",  # read (and refused unless implemented) by read_rope
    }
    check_keys(hf, model_type, used, extra_ignored)
    heads = hf["num_attention_heads"]
    theta, scaling, partial = read_rope(hf, partial_rotary=partial_rotary)
    common = dict(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        o_proj_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        use_qk_norm=use_qk_norm,
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    return config_class(**{**common, **fields})


def decoder_config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The Llama-family fields of `config` as an HF config dict (both rope spellings)."""
    rope = {"rope_type": "default", **(config.rope_scaling_dict or {})}
    eos = list(config.eos_token_id)
    return {
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling_dict,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor},
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
    }


# The fields `validate_hf_config` checks, by what each must hold. They are the
# fields the families read from `config.json` (and that GGUF metadata becomes); a
# field that is absent, or null, is left to the family's default.
POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
    "sliding_window", "moe_intermediate_size",
    "num_local_experts", "n_routed_experts", "decoder_sparse_step", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "full_attention_interval",
    "no_rope_layer_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads",
)
COUNT_FIELDS = (  # integers >= 0: 0 means none
    "num_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
    "shared_expert_intermediate_size",
    # 0 where there is no sliding window (transformers writes it so for EXAONE 4); at
    # least 1 where there is one (see `validate_hf_config`).
    "sliding_window_pattern", "_sliding_window_pattern",
)
TOKEN_ID_FIELDS = ("bos_token_id", "pad_token_id")  # an integer (eos_token_id: one or a list)
POSITIVE_NUMBER_FIELDS = (
    "rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_local_base_freq", "routed_scaling_factor",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "embedding_multiplier",
    "residual_multiplier", "attention_multiplier", "logits_scaling", "logit_scale", "swiglu_limit", "swiglu_alpha",
)
BOOL_FIELDS = (
    "tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window", "use_qk_norm",
    "rope_interleave", "use_bidirectional_attention",
)
STRING_FIELDS = ("model_type", "hidden_act", "hidden_activation")
ROPE_NUMBER_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta", "attention_factor")
ROPE_FACTOR_LIST_KEYS = ("short_factor", "long_factor")


def validate_hf_config(hf: Mapping[str, Any]) -> None:
    """Checks the type and range of every common field of an HF config dict, before
    any family reads it (and before anything is sized by it).

    JSON has one spelling for each: sizes and counts are integers (`64`, not
    `"64"` nor `64.0`), at least 1 (counts of optional parts at least 0); epsilons,
    bases and scales are finite numbers above 0; switches are `true` / `false`
    (a string `"false"` would read as true). The rope scaling's values are checked
    the same way, in each per-layer-type set of a nested `rope_parameters` too;
    whether its type is supported and has the keys it needs is `DecoderConfig`'s
    check (`ROPE_TYPE_KEYS`), made once the family has read it, before anything
    is built, as is `num_attention_heads` being a multiple of `num_key_value_heads`.

    Args:
        hf: the config dict (`config.json`, or what a GGUF file's metadata became).

    Raises:
        ConfigError: naming the first field that is wrong, its value and what is
            allowed.
    """
    if not isinstance(hf, Mapping):
        raise ConfigError(f"config.json holds a JSON {type(hf).__name__}; it must be an object of fields.")
    present = lambda names: [(k, hf[k]) for k in names if hf.get(k) is not None]
    for key, value in present(POSITIVE_INT_FIELDS):
        _require(key, value, is_positive_integer(value), POSITIVE_INTEGER)
    for key, value in present(COUNT_FIELDS):
        _require(key, value, is_integer(value) and value >= 0, "an integer >= 0")
    if hf.get("sliding_window") is not None:  # one layer in every `pattern` is global: 0 would divide by zero
        for key, value in present(("sliding_window_pattern", "_sliding_window_pattern")):
            _require(key, value, value >= 1, f"an integer >= 1 with a sliding_window ({hf['sliding_window']})")
    for key, value in present(TOKEN_ID_FIELDS):
        _require(key, value, is_integer(value), "an integer token id")
    for key, value in present(POSITIVE_NUMBER_FIELDS):
        _require(key, value, is_positive_number(value), POSITIVE_NUMBER)
    for key, value in present(BOOL_FIELDS):
        _require(key, value, isinstance(value, bool), "true or false (a JSON boolean, not a string or number)")
    for key, value in present(STRING_FIELDS):
        _require(key, value, isinstance(value, str), "a string")
    if hf.get("eos_token_id") is not None:
        eos = hf["eos_token_id"]
        _require("eos_token_id", eos, is_integer(eos) or (isinstance(eos, list) and all(map(is_integer, eos))),
                 "an integer token id or a list of them")
    if hf.get("partial_rotary_factor") is not None:
        value = hf["partial_rotary_factor"]
        _require("partial_rotary_factor", value, _is_number(value) and 0 < value <= 1, "a number in (0, 1]")
    _validate_layer_lists(hf)
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None:
            for name, scaling in _rope_sets(key, hf[key]):
                _validate_rope(name, scaling)


def _validate_layer_lists(hf: Mapping[str, Any]) -> None:
    """`layer_types` (one string per layer) and the lists of layer numbers."""
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is not None:
        _require("layer_types", types, isinstance(types, list) and all(isinstance(t, str) for t in types),
                 "a list of strings, one per layer")
        if layers is not None and len(types) != layers:
            raise ConfigError(
                f"config field layer_types lists {len(types)} layers, but num_hidden_layers is {layers}; "
                "it needs one entry per layer."
            )
    for key in ("mlp_only_layers", "no_rope_layers"):
        value = hf.get(key)
        if value is not None:
            _require(key, value, isinstance(value, list) and all(is_integer(v) and v >= 0 for v in value),
                     "a list of integers >= 0")


def _rope_sets(key: str, value: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """The rope parameter sets in `value`, each with the name to report it by: the
    one set, or, where transformers 5 writes one per layer type (`{"full_attention":
    {...}, "sliding_attention": {...}}`, Gemma 3), each of those (a null one is a
    layer type without rotary positions)."""
    _require(key, value, isinstance(value, Mapping), "an object (or null)")
    if not any(isinstance(entry, Mapping) for entry in value.values()):
        return [(key, value)]
    sets = []
    for layer_type, entry in value.items():
        if entry is not None:
            _require(f"{key}.{layer_type}", entry, isinstance(entry, Mapping), "an object (or null)")
            sets.append((f"{key}.{layer_type}", entry))
    return sets


def _validate_rope(key: str, scaling: Mapping[str, Any]) -> None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    _require(f"{key}.rope_type", rope_type, isinstance(rope_type, str), "a string")
    for name in ROPE_NUMBER_KEYS:
        if scaling.get(name) is not None:
            _require(f"{key}.{name}", scaling[name], is_positive_number(scaling[name]), POSITIVE_NUMBER)
    if scaling.get("original_max_position_embeddings") is not None:
        value = scaling["original_max_position_embeddings"]
        _require(f"{key}.original_max_position_embeddings", value, is_positive_integer(value), POSITIVE_INTEGER)
    for name in ROPE_FACTOR_LIST_KEYS:
        if scaling.get(name) is not None:
            value = scaling[name]
            _require(f"{key}.{name}", value, isinstance(value, list) and all(map(is_positive_number, value)),
                     f"a list of {POSITIVE_NUMBER}s")


POSITIVE_INTEGER = "an integer >= 1"
POSITIVE_NUMBER = "a finite number > 0"


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer: a Python (or JSON) int or a NumPy integer, and
    not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_positive_integer(value: Any) -> bool:
    """Whether `value` is `POSITIVE_INTEGER`: a size, a count of heads or layers."""
    return is_integer(value) and value >= 1


def is_positive_number(value: Any) -> bool:
    """Whether `value` is `POSITIVE_NUMBER`: an epsilon, a base, a scale."""
    return _is_number(value) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(key: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config field {key} is {value!r} ({type(value).__name__}); it must be {allowed}.")


def check_layer_count(hf: Mapping[str, Any], tensor_count: int, source: str) -> None:
    """Refuses a `num_hidden_layers` the checkpoint cannot hold, before anything
    is built per layer: every layer has at least one tensor of its own, so a file
    of `tensor_count` tensors holds at most that many layers.

    Args:
        hf: the HF config dict (already through `validate_hf_config`).
        tensor_count: how many tensors the checkpoint holds.
        source: the checkpoint, for the message.

    Raises:
        ConfigError: more layers than tensors.
    """
    layers = hf.get("num_hidden_layers")
    if is_integer(layers) and layers > tensor_count:
        raise ConfigError(
            f"config field num_hidden_layers is {layers}, but {source} holds only {tensor_count} tensors, and "
            "every layer has tensors of its own: the config does not describe this checkpoint. Fix "
            "num_hidden_layers (or use the config.json that came with the weights)."
        )


def load_json(path) -> dict[str, Any]:
    """Reads a JSON file that holds an object, naming the file when it is malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download or fix the file.") from e
    if not isinstance(content, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(content).__name__}, not an object of fields; re-download or fix the file."
        )
    return content

