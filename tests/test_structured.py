"""Structured outputs in the serving engine: JSON schemas, regular expressions,
grammars and choices enforced by llguidance's token masks, row by row.

The model is a tiny random Qwen3 over the real Qwen vocabulary (151,936 rows) with
its byte-level tokenizer, the case the masks are built for."""

import json
import re

import llguidance
import numpy as np
import pytest
from conftest import QWEN_TOKENIZER, make_checkpoint, require_fixture, tiny_config

import eqx_models
from eqx_models.serving import Engine, SamplingParams, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_vocab")
    make_checkpoint(folder, tiny_config("qwen3", vocab_size=151936, head_dim=8, max_position_embeddings=512,
                                        eos_token_id=151645))
    return eqx_models.from_pretrained(folder), eqx_models.load_tokenizer(require_fixture(QWEN_TOKENIZER))


@pytest.fixture(scope="module", params=[False, True], ids=["by_length", "ragged"])
def engine(qwen, request):
    model, tokenizer = qwen
    return Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=256,
                  ragged_steps=request.param)


def test_each_row_keeps_to_its_own_constraint_and_free_rows_are_untouched(engine, qwen):
    model, tokenizer = qwen
    prompt = tokenizer.encode("Once upon a time")
    free = SamplingParams(max_tokens=24, temperature=0)
    params = [
        free,
        SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput(json_schema=PERSON)),
        SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutput(regex=r"[A-Z][a-z]{1,8} is [0-9]{1,2}")),
        SamplingParams(max_tokens=8, temperature=0.9, seed=3, structured=StructuredOutput(choice=["happy", "sad"])),
        SamplingParams(max_tokens=60, temperature=0.8, seed=5, structured=StructuredOutput(
            grammar='start: "The " animal " " verb "."\nanimal: "cat" | "dog" | "bird"\nverb: /[a-z]{2,8}/')),
        free,
    ]
    outs = engine.generate([prompt] * len(params), params)
    alone = eqx_models.generate(model, prompt, max_new_tokens=24)[0].tolist()
    assert outs[0].token_ids == outs[5].token_ids == alone  # masks never reach other rows
    person = json.loads(outs[1].text)
    assert set(person) == {"name", "age", "pet"} and len(person["name"]) <= 12 and 0 <= person["age"] <= 120
    assert person["pet"] in ("cat", "dog") and outs[1].text == json.dumps(person, ensure_ascii=False)  # json.dumps's layout
    assert re.fullmatch(r"[A-Z][a-z]{1,8} is [0-9]{1,2}", outs[2].text)
    assert outs[3].text in ("happy", "sad")
    assert re.fullmatch(r"The (cat|dog|bird) [a-z]{2,8}\.", outs[4].text)
    # A complete output ends the request (nothing else could follow).
    assert [out.finish_reason for out in outs[1:5]] == ["stop"] * 4


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """llguidance's own mask for the matcher's next token, as token ids."""
    import llguidance.numpy

    words = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def test_constrained_greedy_is_the_argmax_over_the_allowed_tokens(engine, qwen):
    model, tokenizer = qwen
    prompt = tokenizer.encode("Lily wanted to play with")
    constraint = StructuredOutput(regex=r"(a|the) [a-z]{1,6}( and [a-z]{1,6})?")
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0, structured=constraint))[0]
    # The same decode, step by step: the model's logits, llguidance's mask, the best allowed token.
    vocab = model.config.vocab_size
    lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_token_ids[0])
    matcher = llguidance.LLMatcher(lltokenizer, constraint.llguidance_grammar())
    tokens = []
    while not matcher.is_stopped() and len(tokens) < 30:
        logits = np.asarray(model(np.array([prompt + tokens]))[0][0, -1])
        allowed = allowed_tokens(matcher, vocab)
        token = int(allowed[np.argmax(logits[allowed])])
        assert matcher.consume_token(token)
        tokens.append(token)
    assert out.token_ids == tokens and out.finish_reason == "stop"


@pytest.mark.parametrize("fields, message", [
    (dict(json_schema={"type": "nonsense"}), "(?s)not valid: .*nonsense"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(regex="[0-9"), "(?s)not valid: .*unclosed character class"),
    (dict(grammar="start: missing_rule"), "(?s)not valid: .*missing_rule"),
])
def test_an_invalid_constraint_is_refused_with_the_reason(engine, qwen, fields, message):
    _, tokenizer = qwen
    with pytest.raises(ValueError, match=message):
        engine.add_request(tokenizer.encode("Tom"), SamplingParams(structured=StructuredOutput(**fields)))
    assert not engine.has_work  # nothing was queued


def test_a_constraint_names_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of .* got regex, choice"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput(choice=[])


def test_new_constraints_compile_no_new_code(engine, qwen):
    import jax

    _, tokenizer = qwen
    prompts = [tokenizer.encode(p) for p in ("Once upon a time", "The dog")]
    run = lambda constraint: engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                     structured=constraint))
    run(StructuredOutput(regex="[a-z ]+"))
    compiles = []
    listener = lambda event, duration, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        run(StructuredOutput(regex="[A-Z][a-z ]+!"))
        run(StructuredOutput(json_object=True))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
