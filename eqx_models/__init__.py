"""eqx_models: decoder language models in Equinox, with scanned layers and one KV cache."""

__version__ = "0.1.0"

from .cache import KVCache
from .config import ConfigError, DecoderConfig
from .device_memory import OutOfDeviceMemory
from .generation import Sampling, generate, stream_generate
from .hub import CheckpointError, from_pretrained, save_pretrained
from .models import supported_model_types
from .nn.causal_lm import CausalLM
from .paged_cache import PagedKVCache, RaggedPagedKVCache
from .quantization import quantize
from .sharding import ShardingRules, shard_model
from .tokenizer import Tokenizer, load_tokenizer
from .training import causal_lm_loss, make_train_step

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "OutOfDeviceMemory",
    "DecoderConfig",
    "KVCache",
    "PagedKVCache",
    "RaggedPagedKVCache",
    "Sampling",
    "ShardingRules",
    "Tokenizer",
    "causal_lm_loss",
    "from_pretrained",
    "generate",
    "load_tokenizer",
    "make_train_step",
    "quantize",
    "save_pretrained",
    "shard_model",
    "stream_generate",
    "supported_model_types",
]
