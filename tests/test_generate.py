"""Generation on the real stories260K model, sampling, the CLI and input errors."""

import inspect
import json
import subprocess
import sys

import numpy as np
import pytest

import eqx_models
from eqx_models.cli import main
from conftest import STORIES, require_fixture


@pytest.fixture(scope="module")
def stories():
    return eqx_models.from_pretrained(require_fixture(STORIES))


@pytest.fixture(scope="module")
def stories_tokenizer():
    return eqx_models.load_tokenizer(STORIES)


CASES = json.loads((STORIES / "expected.json").read_text()) if STORIES.exists() else []


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c["prompt"]))
def test_expected_greedy_outputs_through_the_python_api(case, stories, stories_tokenizer):
    prompt_ids = stories_tokenizer.encode(case["prompt"])
    assert prompt_ids == case["prompt_ids"]
    new = eqx_models.generate(stories, prompt_ids, max_new_tokens=len(case["output_ids"]))
    assert new[0].tolist() == case["output_ids"]
    assert stories_tokenizer.decode(prompt_ids + new[0].tolist()) == case["text"]


def test_expected_outputs_as_one_ragged_batch(stories):
    longest = max(len(c["output_ids"]) for c in CASES[1:])
    new = eqx_models.generate(stories, [c["prompt_ids"] for c in CASES[1:]], max_new_tokens=longest)
    for row, case in zip(new, CASES[1:]):
        assert row[: len(case["output_ids"])].tolist() == case["output_ids"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c["prompt"]))
def test_expected_outputs_through_the_cli(case, capsys, stories_tokenizer):
    code = main(
        ["generate", str(STORIES), "--prompt", case["prompt"], "--max-new-tokens", str(len(case["output_ids"]))]
    )
    out, err = capsys.readouterr()
    assert code == 0
    prompt_text = stories_tokenizer.decode(case["prompt_ids"])
    assert out == case["text"][len(prompt_text):] + "\n"
    assert "tokens/s" in err and f"decode: {len(case['output_ids'])} tokens" in err


def test_console_script_runs_offline_on_the_fixture():
    case = CASES[1]
    result = subprocess.run(
        [sys.executable, "-m", "eqx_models.cli", "generate", str(STORIES), "--prompt", case["prompt"], "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = eqx_models.load_tokenizer(STORIES)
    assert result.stdout == tokenizer.decode(case["prompt_ids"] + case["output_ids"][:8])[len(case["prompt"]):] + "\n"


def test_cli_reports_a_missing_model_folder(capsys, tmp_path):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "No folder at" in capsys.readouterr().err


def test_sampling_is_reproducible_by_seed(stories):
    kwargs = dict(max_new_tokens=20, temperature=1.0, top_k=50, eos_token_id=[])
    a = eqx_models.generate(stories, [1, 403], seed=7, **kwargs)
    b = eqx_models.generate(stories, [1, 403], seed=7, **kwargs)
    c = eqx_models.generate(stories, [1, 403], seed=8, **kwargs)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_k_one_and_tiny_top_p_are_greedy(stories):
    greedy = eqx_models.generate(stories, [1, 326, 269], max_new_tokens=16)
    top_k = eqx_models.generate(stories, [1, 326, 269], max_new_tokens=16, temperature=0.8, top_k=1, seed=3)
    top_p = eqx_models.generate(stories, [1, 326, 269], max_new_tokens=16, temperature=0.8, top_p=1e-6, seed=3)
    np.testing.assert_array_equal(top_k, greedy)
    np.testing.assert_array_equal(top_p, greedy)


@pytest.mark.parametrize("restriction", [dict(top_k=3), dict(top_p=0.5)])
def test_sampled_tokens_respect_top_k_and_top_p(stories, restriction):
    prompt = [1, 403, 407]
    new = eqx_models.generate(stories, prompt, max_new_tokens=24, temperature=1.5, seed=11, eos_token_id=[], **restriction)
    sequence = np.asarray([prompt + new[0].tolist()])
    logits = np.asarray(stories(sequence)[0][0, len(prompt) - 1 : -1]) / 1.5
    for step, token in enumerate(new[0]):
        order = np.argsort(-logits[step])
        if "top_k" in restriction:
            allowed = order[: restriction["top_k"]]
        else:
            probs = np.exp(logits[step] - logits[step].max())
            probs = probs[order] / probs.sum()
            allowed = order[: int(np.sum(np.cumsum(probs) - probs < restriction["top_p"]))]
        assert token in allowed, (step, token, allowed)


def test_rows_that_finish_are_padded_after_eos(stories):
    # Token 13 appears in the greedy story; make it the EOS.
    greedy = eqx_models.generate(stories, [1], max_new_tokens=80, eos_token_id=[])[0]
    stop = int(np.nonzero(greedy == 13)[0][0])
    new = eqx_models.generate(stories, [[1], [1, 403]], max_new_tokens=80, eos_token_id=13, pad_token_id=0)
    assert new[0, : stop + 1].tolist() == greedy[: stop + 1].tolist()
    assert (new[0, stop + 1 :] == 0).all()


def test_prompt_plus_new_tokens_beyond_positions_is_refused(stories):
    with pytest.raises(ValueError, match=r"beyond the model's max_position_embeddings \(512\)"):
        eqx_models.generate(stories, [1] * 500, max_new_tokens=13)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[1, 2], max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(input_ids=[], max_new_tokens=4), "at least one token"),
        (dict(input_ids=[[1, 2, 3]], attention_mask=[[1, 1, 0]], max_new_tokens=4), "left-padded"),
        (dict(input_ids=[1, 2], max_new_tokens=4, temperature=-1.0), "temperature must be >= 0"),
        (dict(input_ids=[1, 2], max_new_tokens=4, top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_generation_arguments(stories, kwargs, message):
    with pytest.raises(ValueError, match=message):
        eqx_models.generate(stories, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[1, 512]), r"token id 512, outside the model's vocabulary of 512 \(ids 0-511\)"),
        (dict(input_ids=[[1, 2], [1, -3]]), r"token id -3, outside the model's vocabulary"),
        (dict(input_ids=[1, 2**40]), "beyond int32"),
        (dict(input_ids=[1.0, 2.5]), "input_ids must be integer token ids; got an array of float64"),
        (dict(input_ids=[1, 2], max_new_tokens=True), "max_new_tokens must be at least 1 and an integer"),
        (dict(input_ids=[1, 2], temperature=float("inf")), "temperature must be >= 0 and finite"),
    ],
)
def test_generate_refuses_ids_and_counts_it_cannot_use(stories, kwargs, message):
    """Ids outside the vocabulary were clamped by the embedding lookup and decoded as
    if they were the last token; non-integer ids and counts were truncated."""
    with pytest.raises(ValueError, match=message):
        eqx_models.generate(stories, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=2.5), "max_new_tokens must be at least 1 and an integer, got 2.5"),
        (dict(seed=0.5), "seed must be an integer"),
    ],
)
def test_generate_refuses_counts_that_are_not_integers_without_a_type_checker(stories, kwargs, message):
    """What a user without runtime type checking gets (the test suite runs with
    jaxtyping's checks on, which would refuse these first)."""
    stream = inspect.unwrap(eqx_models.stream_generate)
    with pytest.raises(ValueError, match=message):
        list(stream(stories, [1, 2], **{"max_new_tokens": 4, **kwargs}))


def test_padding_outside_the_vocabulary_is_not_an_error(stories):
    """Only real tokens are checked: positions the mask leaves out may hold anything."""
    padded = eqx_models.generate(stories, [[-1, 1, 403], [1, 500, 403]], attention_mask=[[0, 1, 1], [1, 1, 1]],
                                 max_new_tokens=4)
    assert padded[0].tolist() == eqx_models.generate(stories, [1, 403], max_new_tokens=4)[0].tolist()


def test_a_tiny_temperature_samples_the_greedy_token(stories):
    """From 1e-38 down (below float32's smallest normal number, flushed to zero)
    the logits divided by the temperature were +-inf and NaN, and every draw the
    same token; shifted first, the draw is the argmax."""
    prompt = CASES[1]["prompt_ids"]
    for temperature in (1e-45, 1e-40, 1e-38, 1e-37, 1e-6):
        sampled = eqx_models.generate(stories, prompt, max_new_tokens=8, temperature=temperature, seed=3)
        assert sampled[0].tolist() == eqx_models.generate(stories, prompt, max_new_tokens=8)[0].tolist()


def test_the_cli_decodes_with_an_int8_kv_cache(capsys, stories, stories_tokenizer):
    case = CASES[0]
    steps = 20
    code = main(["generate", str(STORIES), "--prompt", case["prompt"], "--max-new-tokens", str(steps),
                 "--kv-cache-dtype", "int8"])
    out, _ = capsys.readouterr()
    assert code == 0
    tokens = eqx_models.generate(stories, case["prompt_ids"], max_new_tokens=steps, cache_dtype="int8")[0].tolist()
    full = stories_tokenizer.decode(case["prompt_ids"] + tokens)
    assert out == full[len(stories_tokenizer.decode(case["prompt_ids"])):] + "\n"


def test_greedy_tokens_are_numpys_argmax():
    """First position of the largest value; a NaN counts as the largest (as in
    NumPy and XLA); rows of -inf pick 0; float16 and bfloat16 logits too."""
    import jax.numpy as jnp

    from eqx_models.generation import greedy_tokens

    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 151936)).astype(np.float32)
    rows[1, [7, 90000]] = 50.0  # a tie: the first
    rows[2, [5, 151935]] = np.nan
    rows[3] = -np.inf
    rows[4, -1] = 99.0
    rows[5, [3, 4]] = [np.inf, np.inf]
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        logits = jnp.asarray(rows, dtype)
        got = np.asarray(greedy_tokens(logits))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(np.asarray(logits, np.float32), axis=-1))
    assert int(greedy_tokens(jnp.asarray([1.0, 3.0, 2.0]))) == 1


def test_every_option_with_a_default_shows_it_in_help():
    """`--help` named no defaults: a newcomer could not tell what a bare command does."""
    import argparse

    from eqx_models.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.option_strings and action.default is not None and action.default is not False \
                    and action.default != argparse.SUPPRESS:
                shown = action.help and "default" in action.help
                assert shown or f"(default: {action.default})" in text, (name, action.option_strings)
    assert "--max-new-tokens MAX_NEW_TOKENS Most tokens to generate. (default: 64)" in " ".join(
        commands.choices["generate"].format_help().split())


@pytest.mark.parametrize("steps_per_call", [3, 16])
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.9, top_k=20, seed=4)])
def test_several_decode_steps_per_call_give_the_same_tokens(stories, monkeypatch, steps_per_call, settings):
    """An accelerator runs several decode steps per launch (`decode_steps_per_call`);
    tokens, early stopping at EOS and the streamed steps are those of one step per
    call, also when `max_new_tokens` is no multiple of the chunk."""
    from eqx_models.backends.cpu import Cpu

    prompts = [[1, 403, 407, 261], [1, 304]]
    first = eqx_models.generate(stories, prompts[:1], max_new_tokens=9, **settings)[0]
    eos = int(first[6])
    stop = int(np.nonzero(first == eos)[0][0])  # where the single row ends with this EOS
    one = lambda rows, **extra: (eqx_models.generate(stories, rows, **settings, **extra),
                                 list(eqx_models.stream_generate(stories, rows, **settings, **extra)))
    runs = lambda: [one(prompts, max_new_tokens=n) for n in (1, 29)] + [
        one(prompts, max_new_tokens=29, eos_token_id=eos), one(prompts[:1], max_new_tokens=29, eos_token_id=eos)]
    expected = runs()
    monkeypatch.setattr(Cpu, "decode_steps_per_call", lambda self: steps_per_call)
    got = runs()
    for (want_tokens, want_steps), (got_tokens, got_steps) in zip(expected, got):
        np.testing.assert_array_equal(got_tokens, want_tokens)
        assert len(got_steps) == len(want_steps)
        np.testing.assert_array_equal(np.stack(got_steps), np.stack(want_steps))
    assert len(expected[1][1]) == 29 and len(got[3][1]) == stop + 1 < 29
