"""Text generation: bucketed prefill, one compiled decode step, sampling."""

import collections
import dataclasses
import functools
import math
import numbers
from collections.abc import Iterator, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .backends import active_backend
from .cache import KVCache, resolve_cache_dtype
from .config import is_integer
from .device_memory import OutOfDeviceMemory, gib, is_out_of_memory
from .ops import greedy_rows
from .nn.causal_lm import CausalLM

MIN_PROMPT_BUCKET = 16

# How many times each jitted function has been traced (each trace is a compile).
_TRACE_COUNTS: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """Traces so far of the prefill and decode functions (tests assert on these)."""
    return dict(_TRACE_COUNTS)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at `temperature == 0`, else sampled.

    Attributes:
        temperature: 0 for argmax; otherwise the logits are divided by it.
        top_k: keep only the `top_k` most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probability
            reaches `top_p` (None or 1: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) or not (
            0 <= self.temperature < math.inf
        ):
            raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), got {self.temperature!r}.")
        if self.top_k is not None and (not is_integer(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}.")
        if self.top_p is not None and (
            isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}.")


def greedy_tokens(logits: Float[Array, "*batch vocab"]) -> Int[Array, " *batch"]:
    """`jnp.argmax(logits, axis=-1)`: the first position of the largest value (of
    the first NaN, if any), as int32 (`eqx_models.ops.greedy_rows`)."""
    return greedy_rows(logits)


def sample_tokens(
    logits: Float[Array, "batch vocab"], key: PRNGKeyArray, sampling: Sampling
) -> Int[Array, " batch"]:
    """Picks one token per row: argmax, or a draw after temperature, top-k and top-p."""
    logits = logits.astype(jnp.float32)
    if sampling.temperature == 0:
        return greedy_tokens(logits)
    # Shifted so each row's largest logit is 0, which stays 0: a tiny temperature
    # (one XLA flushes to zero included) then sends the others to -inf, a greedy
    # pick, where dividing the raw logits gave +-inf and NaN probabilities. The
    # softmax is the same either way.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0.0, shifted / sampling.temperature)
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the
        # mass strictly before it is still below top_p (the top token always stays).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
        threshold = jnp.take_along_axis(ordered, jnp.sum(keep, axis=-1, keepdims=True) - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class DecodeState(eqx.Module):
    """What one decode step hands to the next; donated, so updated in place."""

    cache: KVCache
    token: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    key: PRNGKeyArray


def _finished(token: Int[Array, " batch"], eos_ids: tuple[int, ...]) -> Bool[Array, " batch"]:
    return jnp.isin(token, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros(token.shape, bool)


@eqx.filter_jit
def _prefill(
    model, input_ids, attention_mask, key, max_length: int, sampling: Sampling, eos_ids: tuple,
    cache_dtype: str | None = None,
):
    _TRACE_COUNTS["prefill"] += 1
    logits, cache = model.prefill(input_ids, max_length, attention_mask, logits_to_keep=1, cache_dtype=cache_dtype)
    key, step_key = jax.random.split(key)
    token = sample_tokens(logits[:, -1], step_key, sampling)
    state = DecodeState(cache, token, _finished(token, eos_ids), key)
    return state, token


def _step(model, state: DecodeState, sampling: Sampling, eos_ids: tuple, pad_token_id: int):
    _TRACE_COUNTS["decode"] += 1
    logits, cache = model(state.token[:, None], state.cache)
    key, step_key = jax.random.split(state.key)
    token = sample_tokens(logits[:, -1], step_key, sampling)
    token = jnp.where(state.done, pad_token_id, token)
    state = DecodeState(cache, token, state.done | _finished(token, eos_ids), key)
    # The token goes out as its own buffer so the host can read it while the
    # next (donating) step is already running.
    return state, jnp.copy(token)


# One decode step, the state donated (updated in place). For lowering and
# inspection; the generation loop runs `_decode_stepper`'s form of the same step.
_decode_step = functools.partial(eqx.filter_jit, donate="all-except-first")(_step)


def _split_model(model) -> tuple[list, object, tuple]:
    """`model` as its arrays, its treedef and its other leaves (None where an array
    was): split once per generate call rather than on every token."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    arrays = [leaf for leaf in leaves if eqx.is_array(leaf)]
    return arrays, treedef, tuple(None if eqx.is_array(leaf) else leaf for leaf in leaves)


def _join_model(arrays: list, treedef, static_leaves: tuple):
    """The model `_split_model` split."""
    found = iter(arrays)
    return jax.tree_util.tree_unflatten(treedef, [next(found) if s is None else s for s in static_leaves])


@functools.lru_cache(maxsize=16)
def _jitted_step(treedef, static_leaves: tuple, sampling: Sampling, eos_ids: tuple, pad_token_id: int):
    def step(arrays: list, state: DecodeState):
        return _step(_join_model(arrays, treedef, static_leaves), state, sampling, eos_ids, pad_token_id)

    return jax.jit(step, donate_argnums=1)


def _decode_stepper(model, sampling: Sampling, eos_ids: tuple = (), pad_token_id: int = 0):
    """`state -> (state, token)`: `_decode_step` for this model and these settings,
    with the model split into arrays and static parts once instead of on every
    token (equinox's `filter_jit` did that per call: about 0.5 ms of a 25 ms int8
    step on a 2-core Xeon). Compiles once per model structure and settings."""
    arrays, treedef, static_leaves = _split_model(model)
    jitted = _jitted_step(treedef, static_leaves, sampling, eos_ids, pad_token_id)
    return lambda state: jitted(arrays, state)


@functools.lru_cache(maxsize=16)
def _jitted_steps(treedef, static_leaves: tuple, sampling: Sampling, eos_ids: tuple, pad_token_id: int, chunk: int):
    def steps(arrays: list, state: DecodeState, count: Int[Array, ""]):
        model = _join_model(arrays, treedef, static_leaves)

        def one(i, carry):
            state, tokens = carry
            state, token = _step(model, state, sampling, eos_ids, pad_token_id)
            return state, tokens.at[i].set(token)

        tokens = jnp.full((chunk, state.token.shape[0]), pad_token_id, jnp.int32)
        return jax.lax.fori_loop(0, count, one, (state, tokens))

    return jax.jit(steps, donate_argnums=1)


def _decode_advancer(model, sampling: Sampling, eos_ids: tuple, pad_token_id: int, chunk: int):
    """`(state, count) -> (state, tokens)`: `count` (at most `chunk`) decode steps
    in one call, `tokens` `[count or chunk, batch]` (rows past `count` are padding).

    Where launching a program costs a good part of a step (an accelerator, whose
    host waits for each donating step to finish before launching the next), several
    steps go as one call (`Backend.decode_steps_per_call`); with one the call is
    `_decode_stepper`'s."""
    if chunk == 1:
        stepper = _decode_stepper(model, sampling, eos_ids, pad_token_id)

        def advance(state, count):
            state, token = stepper(state)
            return state, token[None]

        return advance
    arrays, treedef, static_leaves = _split_model(model)
    jitted = _jitted_steps(treedef, static_leaves, sampling, eos_ids, pad_token_id, chunk)
    return lambda state, count: jitted(arrays, state, jnp.int32(count))


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# The least room `generate` leaves for new tokens after a prompt: one block of
# slots of the TPU's decode attention kernel, which takes caches of whole blocks.
NEW_TOKEN_ROOM = 128


def _cache_length(bucket: int, max_new_tokens: int) -> int:
    """Slots of `generate`'s cache for a prompt padded to `bucket` tokens: the
    smaller of the whole rounded up to a power of two and the bucket (at least
    `NEW_TOKEN_ROOM`) plus the new tokens rounded up to a power of two (at least
    `NEW_TOKEN_ROOM`). Either way the number of distinct caches, and of
    compilations, stays logarithmic in the lengths, and a cache of 512 slots or
    more is whole blocks; the second keeps a long prompt's cache from doubling
    for a few new tokens."""
    room = max(NEW_TOKEN_ROOM, _next_power_of_two(max_new_tokens))
    return min(_next_power_of_two(bucket + max_new_tokens), max(bucket, NEW_TOKEN_ROOM) + room)


def prepare_prompts(
    input_ids, attention_mask=None, *, pad_token_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Turns prompts into left-padded `[batch, seq]` ids and mask (numpy, int32).

    Accepts one sequence, a batch array (with an optional mask, 1 = real token), or
    a list of sequences of different lengths (left-padded here).
    """
    if isinstance(input_ids, Sequence) and input_ids and isinstance(input_ids[0], (Sequence, np.ndarray)):
        if attention_mask is None and len({len(row) for row in input_ids}) > 1:
            width = max(len(row) for row in input_ids)
            ids = np.full((len(input_ids), width), pad_token_id, np.int32)
            mask = np.zeros((len(input_ids), width), np.int32)
            for i, row in enumerate(input_ids):
                if len(row):
                    ids[i, width - len(row):] = row
                    mask[i, width - len(row):] = 1
            input_ids, attention_mask = ids, mask
    ids = np.asarray(input_ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(
            f"input_ids must be integer token ids; got an array of {ids.dtype}. Tokenize the text first "
            "(eqx_models.load_tokenizer(...).encode) or convert the ids with .astype(int)."
        )
    limits = np.iinfo(np.int32)
    if ids.size and (ids.min() < limits.min or ids.max() > limits.max):
        raise ValueError(f"input_ids holds values beyond int32 ({ids.min()}..{ids.max()}); token ids are far smaller.")
    ids = ids.astype(np.int32)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [seq] or [batch, seq]; got shape {ids.shape}.")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32).reshape(ids.shape)
    if ids.shape[1] == 0 or (mask.sum(axis=1) == 0).any():
        raise ValueError("Every prompt needs at least one token (for example the BOS token); got an empty one.")
    if (mask[:, -1] == 0).any():
        raise ValueError(
            "The last column of attention_mask is 0 for some rows: prompts must be left-padded "
            "(padding before the tokens), so every row ends on a real token."
        )
    return ids, mask


def stream_generate(
    model: CausalLM,
    input_ids,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask=None,
    pad_token_id: int | None = None,
    cache_dtype: str | None = None,
) -> Iterator[np.ndarray]:
    """Like `generate`, but yields each step's tokens as they come.

    Args:
        model: a `CausalLM`.
        input_ids: `[seq]` or `[batch, seq]` token ids, or a list of
            different-length lists (left-padded for you).
        max_new_tokens: most tokens to generate per row.
        temperature: 0 for greedy decoding; otherwise logits are divided by it and sampled.
        top_k: sample only among the `top_k` most likely tokens.
        top_p: sample only among the smallest set of most likely tokens whose
            probability reaches `top_p`.
        seed: sampling is reproducible for a given seed.
        eos_token_id: id or ids that end a row; defaults to the model config's.
        attention_mask: `[batch, seq]`, 1 for real tokens, for left-padded batches.
        pad_token_id: yielded for rows that have ended; defaults to the first EOS id.
        cache_dtype: the KV cache's dtype (`"int8"` for about half of bfloat16's
            bytes, see `CausalLM.init_cache`); defaults to the model's.

    Yields:
        `[batch]` int32 numpy arrays, one per step; stops early once every row has
        produced an EOS token.
    """
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1 and an integer, got {max_new_tokens!r}.")
    if not is_integer(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    sampling = Sampling(temperature, top_k, top_p)
    cache_dtype = None if cache_dtype is None else resolve_cache_dtype(cache_dtype).name
    eos_ids = _eos_tuple(model, eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    ids, mask = prepare_prompts(input_ids, attention_mask, pad_token_id=pad)
    vocab = model.config.vocab_size
    outside = ids[(mask == 1) & ((ids < 0) | (ids >= vocab))]
    if outside.size:
        raise ValueError(
            f"input_ids holds token id {int(outside[0])}, outside the model's vocabulary of {vocab} "
            f"(ids 0-{vocab - 1}); {outside.size} such id(s) in all. Was the prompt encoded with this "
            "model's tokenizer?"
        )
    longest = int(mask.sum(axis=1).max())
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"The prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) is "
            f"{longest + max_new_tokens} positions, beyond the model's max_position_embeddings "
            f"({limit}). Shorten the prompt or ask for fewer tokens."
        )
    # Pad prompts to a power-of-two bucket and size the cache from powers of two
    # too (`_cache_length`), so the number of compilations stays small whatever
    # the lengths.
    bucket = max(MIN_PROMPT_BUCKET, _next_power_of_two(ids.shape[1]))
    ids = np.pad(ids, ((0, 0), (bucket - ids.shape[1], 0)), constant_values=pad)
    mask = np.pad(mask, ((0, 0), (bucket - mask.shape[1], 0)))
    max_length = _cache_length(bucket, max_new_tokens)

    sized = (f" (generate's: the prompt padded to {bucket} tokens, then room for max_new_tokens: "
             f"{max_length} slots)")
    model.check_cache_fits(ids.shape[0], max_length, cache_dtype, note=sized)
    try:
        state, token = _prefill(
            model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed), max_length, sampling, eos_ids,
            cache_dtype,
        )
    except jax.errors.JaxRuntimeError as error:
        _explain_out_of_memory(error, model, ids.shape[0], max_length, cache_dtype)
        raise
    done = np.zeros(ids.shape[0], bool)
    chunk = active_backend().decode_steps_per_call()
    advance = _decode_advancer(model, sampling, eos_ids, pad, chunk)
    # The next call is launched before the host waits on the tokens it has.
    queued, ready, left = token[None], 1, max_new_tokens - 1
    while True:
        count = min(chunk, left)
        if count:
            try:
                state, following = advance(state, count)
            except jax.errors.JaxRuntimeError as error:
                _explain_out_of_memory(error, model, ids.shape[0], max_length, cache_dtype)
                raise
            left -= count
        for host in np.asarray(queued)[:ready]:
            yield host
            done |= np.isin(host, eos_ids)
            if done.all():
                return
        if not count:
            return
        queued, ready = following, count


def _explain_out_of_memory(error: Exception, model: CausalLM, batch: int, max_length: int, cache_dtype) -> None:
    """Raises `OutOfDeviceMemory` in place of XLA's RESOURCE_EXHAUSTED from the
    prefill or a decode step (the cache fitted, the program's temporaries did
    not), naming the sizes; any other error is left to propagate."""
    if not is_out_of_memory(error):
        return
    cache = model.cache_bytes(batch, max_length, cache_dtype)
    raise OutOfDeviceMemory(
        f"Generating ran out of device memory at batch {batch} with a cache of {max_length} slots "
        f"({gib(cache)} of cache): the program's temporaries did not fit beside the weights and the cache. Use a smaller "
        f"batch (or fewer prompt tokens per call), or int8 weights (quantize='int8') or an int8 cache "
        f"(cache_dtype='int8') to free room. XLA said: {str(error)[:300]}"
    ) from error


def generate(
    model: CausalLM,
    input_ids,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask=None,
    pad_token_id: int | None = None,
    cache_dtype: str | None = None,
) -> Int[np.ndarray, "batch new"]:
    """Generates up to `max_new_tokens` tokens after each prompt.

    Args:
        model: a `CausalLM`.
        input_ids: `[seq]` or `[batch, seq]` token ids (array or lists); a list of
            different-length lists is left-padded for you.
        max_new_tokens: tokens to generate per row.
        temperature: 0 for greedy decoding; otherwise logits are divided by it and sampled.
        top_k: sample only among the `top_k` most likely tokens.
        top_p: sample only among the smallest set of most likely tokens whose
            probability reaches `top_p`.
        seed: sampling is reproducible for a given seed.
        eos_token_id: id or ids that end a row; defaults to the model config's.
        attention_mask: `[batch, seq]`, 1 for real tokens, for left-padded batches.
        pad_token_id: written after a row's EOS; defaults to the first EOS id.
        cache_dtype: the KV cache's dtype (see `stream_generate`).

    Returns:
        `[batch, max_new_tokens]` int32 numpy array of new tokens (the prompt is not
        repeated). Each row of a padded batch gets exactly what its prompt gets alone.
    """
    eos_ids = _eos_tuple(model, eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    steps = list(
        stream_generate(
            model,
            input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_ids,
            attention_mask=attention_mask,
            pad_token_id=pad,
            cache_dtype=cache_dtype,
        )
    )
    out = np.full((steps[0].shape[0], max_new_tokens), pad, np.int32)
    out[:, : len(steps)] = np.stack(steps, axis=1)
    return out


def _eos_tuple(model: CausalLM, eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return tuple(model.config.eos_token_id)
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(i) for i in eos_token_id)
