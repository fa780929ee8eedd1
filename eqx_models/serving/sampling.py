"""Per-request sampling settings and the batched sampler of the serving engine.

Every row of a step carries its own temperature, top-k, top-p and random stream,
so requests with different settings share one compiled step. A row's random key
is derived from its seed and how many tokens it has generated, so a request
draws the same tokens whatever it is batched with, and again after preemption.
"""

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..config import is_integer
from ..generation import greedy_tokens
from .structured import StructuredOutput

# Most alternatives per token `logprobs` may ask for (vLLM's default limit).
MAX_LOGPROBS = 20
# The sampler holds each row's top-k as an int32 and its temperature as a float32.
MAX_TOP_K = int(np.iinfo(np.int32).max)
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


class SamplingParamError(ValueError):
    """A sampling setting of the wrong type or outside what the sampler holds;
    `field` names it (the HTTP server answers 400 with it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _shown(value) -> str:
    """`repr(value)`, cut short: a message must not carry a 400-digit number whole."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more than 4300 digits
        return "an integer of more than 4300 digits"
    return text if len(text) <= 40 else text[:40] + "..."


def _check_integer(field: str, value, low: int, high: int | None = None, note: str = "") -> None:
    if is_integer(value) and value >= low and (high is None or value <= high):
        return
    allowed = f"from {low} to {high}" if high is not None else f"of at least {low}"
    raise SamplingParamError(field, f"'{field}' must be an integer {allowed}{note}, got {_shown(value)}.")


def _check_number(field: str, value, low: float | int, high: float | int, *, above_low: bool = False,
                  note: str = "") -> None:
    # The comparisons also refuse NaN and infinities.
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if number and (value > low if above_low else value >= low) and value <= high:
        return
    allowed = f"in ({low}, {high}]" if above_low else f"from {low} to {high:.4g}"
    raise SamplingParamError(field, f"'{field}' must be a number {allowed}{note}, got {_shown(value)}.")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is continued (names and defaults as in OpenAI's completions API).

    Attributes:
        max_tokens: tokens to generate at most.
        temperature: 0 picks the most likely token; otherwise logits are divided by it
            and sampled. However small it is, the draw stays well defined: a
            temperature too small to matter picks the most likely token (ties
            shared), as the limit of the distribution does.
        top_p: sample from the smallest set of tokens with this much probability
            (the most likely token always stays).
        top_k: sample from the k most likely tokens; 0 or -1 for all.
        seed: makes sampling reproducible; None draws one per request.
        stop: strings that end the text (not included in it).
        stop_token_ids: ids that end generation besides the tokenizer's EOS.
        ignore_eos: keep going after EOS (for benchmarks).
        logprobs: also return the log-probabilities of this many most likely tokens
            at each step (0 for only the chosen token), or None. They are the
            model's, before a structured output's mask.
        structured: constrain the output to a JSON schema, a regular expression, a
            grammar or a list of choices (`StructuredOutput`); the request ends
            when the output is complete.

    Raises `SamplingParamError` (a ValueError naming the field) for a setting of
    the wrong type or outside what the sampler holds.
    """

    max_tokens: int = 16
    temperature: float | int = 1.0
    top_p: float | int = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self):
        _check_integer("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature, 0, MAX_TEMPERATURE, note=" (0 is greedy)")
        _check_number("top_p", self.top_p, 0, 1, above_low=True)
        _check_integer("top_k", self.top_k, -1, MAX_TOP_K, " (-1 or 0: all tokens)")
        if self.seed is not None and not is_integer(self.seed):
            raise SamplingParamError("seed", f"'seed' must be an integer, got {_shown(self.seed)}.")
        if self.logprobs is not None:
            _check_integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not all(isinstance(stop, str) and stop for stop in self.stop):
            raise SamplingParamError("stop", f"'stop' strings must not be empty, got {list(self.stop)!r}.")
        if not all(is_integer(token) for token in self.stop_token_ids):
            raise SamplingParamError(
                "stop_token_ids", f"'stop_token_ids' must be integers, got {list(self.stop_token_ids)!r}.")

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn (not greedy)."""
        return self.temperature > 0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p restricts the draw (the sampler then sorts the vocabulary)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


def sample_rows(
    logits: Float[Array, "batch vocab"],
    seeds: Int[Array, " batch"],
    counters: Int[Array, " batch"],
    temperature: Float[Array, " batch"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
    *,
    sampled: bool,
    filters: bool,
) -> Int[Array, " batch"]:
    """One token per row: argmax where `temperature == 0`, else a draw.

    `sampled` (static) is whether any row draws at all: an all-greedy batch skips
    the draw. `filters` (static) applies each row's top-k (0: off) and top-p;
    without it the vocabulary is not sorted. The draw of a row depends only on its
    logits, settings, seed and counter: one uniform number per row, looked up in
    the row's cumulative distribution (Gumbel noise over the vocabulary cost
    170 ms for 32 rows of 151,936 here).
    """
    logits = logits.astype(jnp.float32)
    greedy = greedy_tokens(logits)
    if not sampled:
        return greedy
    # The gaps below the best logit are scaled, not the logits: a temperature as small
    # as 1e-37 would take logits / temperature to inf and the softmax to NaN, where the
    # gaps go to -inf and leave the most likely token(s) at 0.
    best = jnp.take_along_axis(logits, greedy[:, None], axis=-1)
    scaled = (logits - best) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if filters:
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        rank = jnp.arange(ordered.shape[-1])[None]
        in_top_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
        # A token stays if the mass strictly before it is below top_p; the top one always
        # (a top_p below float32's smallest number is 0 here, and would keep none).
        keep = in_top_k & (((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | (rank == 0))
        threshold = jnp.take_along_axis(ordered, jnp.sum(keep, axis=-1, keepdims=True) - 1, axis=-1)
        scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    # The best token's scaled gap is 0, so its weight exp(0) = 1 bounds the total from
    # below and the weights need no normalising: the draw is scaled by their total.
    cumulative = jnp.cumsum(jnp.exp(scaled), axis=-1)
    keys = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.key(seed), counter))(seeds, counters)
    uniform = jax.vmap(jax.random.uniform)(keys) * cumulative[:, -1]
    # The first token whose cumulative mass exceeds the draw (never a zero-mass one).
    drawn = jnp.sum(cumulative <= uniform[:, None], axis=-1).astype(jnp.int32)
    drawn = jnp.minimum(drawn, jnp.argmax(cumulative, axis=-1).astype(jnp.int32))
    return jnp.where(temperature > 0, drawn, greedy)


def token_logprobs(
    logits: Float[Array, "*rows vocab"], chosen: Int[Array, "*rows"]
) -> tuple[Float[Array, "*rows"], Int[Array, "*rows top"], Float[Array, "*rows top"]]:
    """Log-probability of `chosen` under the model's distribution, and the
    `MAX_LOGPROBS` most likely tokens with theirs."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, chosen[..., None], axis=-1)[..., 0]
    top_values, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
    return picked, top_ids.astype(jnp.int32), top_values
