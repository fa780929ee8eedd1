"""Shared building blocks: every architecture is assembled from these.

The `Abstract...` classes are the bases a family's own blocks extend (Equinox's
abstract/final pattern): each holds the shared behaviour and leaves abstract what
differs; the concrete classes here are final (pass them arguments, do not subclass
them). OLMo 2's `AbstractPostNormLayer` lives with its family, in
`eqx_models.models.olmo2`.
"""

from ..axes import AbstractHasArrayAxes
from .attention import AbstractAttention, AbstractRotaryAttention, Attention
from .causal_lm import CausalLM
from .decoder import AbstractDecoderLayer, AbstractLayerBlock, AbstractPreNormLayer, Decoder, DecoderLayer
from .linear import Embedding, Linear
from .mlp import GatedMLP
from .moe import AbstractExperts, AbstractSparseMoeBlock, SparseMoeBlock
from .norm import LayerNorm, RMSNorm
from .rope import RotaryEmbedding, apply_rotary, inverse_frequencies

__all__ = [
    "AbstractAttention",
    "AbstractDecoderLayer",
    "AbstractExperts",
    "AbstractHasArrayAxes",
    "AbstractLayerBlock",
    "AbstractPreNormLayer",
    "AbstractRotaryAttention",
    "AbstractSparseMoeBlock",
    "Attention",
    "CausalLM",
    "Decoder",
    "DecoderLayer",
    "Embedding",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SparseMoeBlock",
    "apply_rotary",
    "inverse_frequencies",
]
