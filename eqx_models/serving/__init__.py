"""Serving: a continuous-batching engine over a paged KV cache, and its HTTP server.

`Engine` runs without HTTP (notebooks, tests, batch jobs); `eqx_models.serving.server`
puts the OpenAI-compatible API in front of it (`eqx-models serve`). `Scheduler` is the
engine's pure part: which tokens of which requests each step computes.
"""

from .engine import CompletionOutput, Engine, SequenceUpdate, TokenLogprobs
from .sampling import SamplingParams
from .scheduler import ScheduledSequence, Scheduler, StepPlan
from .structured import StructuredOutput

__all__ = ["CompletionOutput", "Engine", "SamplingParams", "ScheduledSequence", "Scheduler", "SequenceUpdate",
           "StepPlan", "StructuredOutput", "TokenLogprobs"]
