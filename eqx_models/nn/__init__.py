"""Shared building blocks: every architecture is assembled from these."""

from .attention import Attention
from .causal_lm import CausalLM
from .decoder import Decoder, DecoderLayer
from .linear import Embedding, Linear
from .mlp import GatedMLP
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary, inverse_frequencies

__all__ = [
    "Attention",
    "CausalLM",
    "Decoder",
    "DecoderLayer",
    "Embedding",
    "GatedMLP",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "inverse_frequencies",
]
