"""Serving: a continuous-batching engine over a paged KV cache, and its HTTP server.

`Engine` runs without HTTP (notebooks, tests, batch jobs); `eqx_models.serving.server`
puts the OpenAI-compatible API in front of it (`eqx-models serve`).
"""

from .engine import CompletionOutput, Engine, SequenceUpdate, TokenLogprobs
from .sampling import SamplingParams

__all__ = ["CompletionOutput", "Engine", "SamplingParams", "SequenceUpdate", "TokenLogprobs"]
