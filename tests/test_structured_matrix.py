"""Structured outputs on every kind of vocabulary the zoo loads: byte-level BPE
(Qwen, Llama 3), SentencePiece with byte fallback (Llama 2, stories260K) and both
rebuilt from GGUF metadata, at temperatures 0 and 1 and several seeds, for every
kind of constraint (JSON schemas of each type, regular expressions, choices, tool
calls). Every output must be complete, parse and satisfy its constraint.

Grammars force text (the space after `":"`, the `" is "` of a regular expression)
and llguidance's mask then allows only the tokens it tokenized that text into: if
those do not spell the text, the matcher refuses the token its own mask allowed.
The walks here check mask and matcher against each other on each vocabulary with
a stand-in model (fixed random logits); the engine runs real models end to end.
"""

import json
import re

import gguf
import jsonschema
import numpy as np
import pytest
import tokenizers
from conftest import QWEN_TOKENIZER, STORIES, require_fixture
from starlette.testclient import TestClient

import eqx_models
from eqx_models.serving import Engine, SamplingParams, StructuredOutput
from eqx_models.serving.server import Server
from eqx_models.serving.structured import GrammarCompiler
from eqx_models.serving.tools import CLOSE, OPEN, parse_tool_calls, required_call
from eqx_models.tokenizer import StreamDecoder, Tokenizer


def whole(**properties) -> dict:
    """An object schema requiring exactly `properties`."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Bounded so that any model finishes within MAX_TOKENS (a number's digits are bounded by multipleOf).
SCHEMAS = {
    "string": whole(name={"type": "string", "maxLength": 8}),
    "integer": whole(age={"type": "integer", "minimum": -5, "maximum": 120}),
    "number": whole(score={"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}),
    "boolean": whole(ok={"type": "boolean"}),
    "enum": whole(pet={"enum": ["cat", "big dog", 3, None, True]}),
    "array": whole(tags={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                         "minItems": 1, "maxItems": 3}),
    "nested": whole(who=whole(name={"type": "string", "maxLength": 6},
                              likes={"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
                    n={"type": "number", "minimum": 0, "maximum": 99, "multipleOf": 0.5}),
    # The text of special tokens is text: spelled by ordinary tokens, never the special ones.
    "special-token text": whole(note={"const": "<|im_end|> or </s>"}, more={"enum": ["<s>", "x"]}),
}
REGEX = r"[A-Z][a-z]{1,6} is [0-9]{1,2} years old"
CHOICES = ["the red ball", "the blue box", "a cat"]
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": whole(
    hour={"type": "integer", "minimum": 0, "maximum": 23}, loud={"type": "boolean"},
    days={"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2})}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": whole(
    city={"type": "string", "maxLength": 8}, celsius={"type": "number", "minimum": -50, "maximum": 50,
                                                      "multipleOf": 0.5})}}
TOOLS = [ALARM, WEATHER]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CONSTRAINTS = [*SCHEMAS, "regex", "choice", "tool_choice=required", "tool_choice=named"]
MAX_TOKENS = 96
TEMPERATURES_AND_SEEDS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
ENGINE_TEMPERATURES_AND_SEEDS = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]  # 60 requests: one batch of 64


def constraint(kind: str, tokenizer) -> StructuredOutput:
    """The structured output of a constraint kind (tool calls as the server builds them)."""
    if kind in SCHEMAS:
        return StructuredOutput(json_schema=SCHEMAS[kind])
    if kind == "regex":
        return StructuredOutput(regex=REGEX)
    if kind == "choice":
        return StructuredOutput(choice=CHOICES)
    tags = {tag for tag in (OPEN, CLOSE) if tokenizer.backend.token_to_id(tag) is not None}
    return required_call(TOOLS, "set_alarm" if kind == "tool_choice=named" else None, tags)


def check(kind: str, text: str) -> None:
    """Raises if `text` does not satisfy the constraint kind."""
    if kind in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        content, calls = parse_tool_calls(text)
        assert content is None and len(calls) == 1, text
        check_call(kind, calls[0])


def check_call(kind: str, call: dict) -> None:
    """Raises if an OpenAI tool call is not one that `tool_choice` allows."""
    name = call["function"]["name"]
    assert name == "set_alarm" or (kind == "tool_choice=required" and name in PARAMETERS), call
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])


# ------------------------------------------------------------ the vocabularies


def sentencepiece_gguf(folder, path):
    """A GGUF file holding only the SentencePiece vocabulary of `folder`'s
    tokenizer.json (scores in id order, as its merges were learnt)."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    kinds = {"<unk>": gguf.TokenType.UNKNOWN, "<s>": gguf.TokenType.CONTROL, "</s>": gguf.TokenType.CONTROL}
    types = [kinds.get(t, gguf.TokenType.BYTE if re.fullmatch("<0x..>", t) else gguf.TokenType.NORMAL) for t in tokens]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    return _written(writer, path)


def byte_level_gguf(folder, path, size: int = 1024):
    """A GGUF file holding a byte-level BPE vocabulary as llama.cpp's converter
    writes Qwen2's: the first `size` tokens of `folder`'s tokenizer.json (its 256
    bytes and the pieces of its earliest merges) and its added tokens after them."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted((t for t in vocab if vocab[t] < size), key=vocab.get)
    merges = [m if isinstance(m, list) else m.split(" ") for m in spec["model"]["merges"]]
    merges = [" ".join(m) for m in merges if max(vocab[m[0]], vocab[m[1]], vocab["".join(m)]) < size]
    added = spec["added_tokens"]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    types += [gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED for a in added]
    tokens += [a["content"] for a in added]
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    return _written(writer, path)


def llama2_layout(folder) -> Tokenizer:
    """`folder`'s SentencePiece vocabulary laid out as Llama 2's tokenizer.json is:
    the normalizer prepends "▁" and writes spaces as "▁", no pre-tokenizer."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>")


def _written(writer, path):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
    """Tokenizer kind -> (tokenizer, model vocabulary size)."""
    root = tmp_path_factory.mktemp("vocabularies")
    stories, qwen = require_fixture(STORIES), require_fixture(QWEN_TOKENIZER)
    return {
        "sentencepiece": (eqx_models.load_tokenizer(stories), 512),
        "sentencepiece-llama2": (llama2_layout(stories), 512),
        "sentencepiece-gguf": (eqx_models.load_tokenizer(sentencepiece_gguf(stories, root / "stories.gguf")), 512),
        "byte-level": (eqx_models.load_tokenizer(qwen), 151936),
        "byte-level-gguf": (eqx_models.load_tokenizer(byte_level_gguf(qwen, root / "qwen.gguf")), 1056),
    }


@pytest.fixture(scope="module")
def compilers(vocabularies):
    """Tokenizer kind -> its GrammarCompiler, made on first use."""
    made = {}

    def compiler(kind):
        if kind not in made:
            tokenizer, vocab_size = vocabularies[kind]
            made[kind] = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)
        return made[kind]

    return compiler


TOKENIZER_KINDS = ["sentencepiece", "sentencepiece-llama2", "sentencepiece-gguf", "byte-level", "byte-level-gguf"]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_forced_text_is_tokenized_into_tokens_that_spell_it(vocabularies, compilers, kind):
    """The root of the refusals: stories260K's tokenizer.json strips a text's outer
    spaces, so the forced `": "` came back as the tokens of `":"`; and a special
    token's text (`</s>`) came back as that special token."""
    _, vocab_size = vocabularies[kind]
    lltokenizer = compilers(kind).lltokenizer
    for text in [" ", ": ", '": ', ", ", "  x  ", " 12", "\n\t", "caf\u00e9", "</s>", "<|im_end|>", "<s>"]:
        tokens = lltokenizer.tokenize_str(text)
        assert bytes(lltokenizer.decode_bytes(tokens)) == text.encode(), (text, tokens)
        assert not any(lltokenizer.is_special_token(t) for t in tokens), (text, tokens)
    assert lltokenizer.vocab_size == vocab_size


def test_a_vocabulary_that_cannot_spell_forced_text_is_refused_up_front():
    """Without byte fallback stories260K's vocabulary writes "{" (a byte token of
    its) as <unk>: a grammar forcing it could only be refused mid-request, so
    structured outputs are refused before any request, naming the text."""
    spec = json.loads((require_fixture(STORIES) / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), eos_token="</s>")
    with pytest.raises(ValueError, match="cannot use this tokenizer: it turns the text '{.* that spell '<unk>"):
        GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids)


def walk(compiler, structured, *, temperature: float, seed: int, prompt_ids, tokenizer) -> tuple[str, bool]:
    """What the engine does for one constrained request, with a stand-in model
    (fixed random logits): mask, pick, feed the token to the matcher. Returns the
    text and whether the output is complete."""
    rng = np.random.default_rng(seed)
    logits = 3.0 * rng.standard_normal(compiler.vocab_size)
    matcher = compiler.matcher(structured)
    decoder = StreamDecoder(tokenizer, prompt_ids)
    words = np.zeros((1, compiler.mask_words), np.int32)
    text, eos = "", set(tokenizer.eos_token_ids)
    for _ in range(MAX_TOKENS):
        if matcher.done:
            break
        words[:] = 0
        compiler.fill_masks([(matcher, 0)], words)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: compiler.vocab_size])
        if temperature == 0:
            token = int(allowed[np.argmax(logits[allowed])])
        else:
            weights = np.exp((logits[allowed] - logits[allowed].max()) / temperature)
            token = int(rng.choice(allowed, p=weights / weights.sum()))
        matcher.consume(token)  # RuntimeError if the grammar refuses what its mask allowed
        if token not in eos:
            text += decoder.push([token])
    return text + decoder.flush(), matcher.done


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
@pytest.mark.parametrize("constraint_kind", CONSTRAINTS)
def test_masks_and_matcher_agree_on_every_vocabulary(vocabularies, compilers, kind, constraint_kind):
    tokenizer, _ = vocabularies[kind]
    prompt_ids = tokenizer.encode("Once upon a time")
    for temperature, seed in TEMPERATURES_AND_SEEDS:
        text, complete = walk(compilers(kind), constraint(constraint_kind, tokenizer), temperature=temperature,
                              seed=seed, prompt_ids=prompt_ids, tokenizer=tokenizer)
        assert complete, (temperature, seed, text)
        check(constraint_kind, text)


# ------------------------------------------------------------ a real model, end to end


@pytest.fixture(scope="module")
def stories():
    """stories260K (trained, SentencePiece with byte fallback: the vocabulary whose
    forced spaces were refused) in an engine wide enough for every case at once."""
    folder = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(folder), eqx_models.load_tokenizer(folder)
    return Engine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=512, page_size=8, num_pages=1024), tokenizer


def test_every_constraint_completes_through_the_engine(stories):
    """All constraints at temperatures 0 and 1 and several seeds, batched in one
    call: none is refused by its grammar, each ends complete ("stop") and satisfies
    its constraint, and greedy outputs do not depend on the seed."""
    engine, tokenizer = stories
    prompt = tokenizer.encode("Once upon a time")
    cases = [(kind, temperature, seed) for kind in CONSTRAINTS for temperature, seed in ENGINE_TEMPERATURES_AND_SEEDS]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                             structured=constraint(kind, tokenizer)) for kind, temperature, seed in cases]
    outputs = engine.generate([prompt] * len(cases), params)
    greedy = {}
    for (kind, temperature, seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (kind, temperature, seed, out.finish_reason, out.text)
        check(kind, out.text)
        if temperature == 0:
            assert greedy.setdefault(kind, out.text) == out.text, (kind, seed)


# Short enough for stories260K's 512 positions: the tools by name only.
TOOL_TEMPLATE = """{%- if tools %}<|system|>Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}
{% endif %}{%- for message in messages %}<|{{ message.role }}|>{{ message.content }}
{% endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_the_api_answers_tool_calls_and_schemas_on_a_byte_fallback_vocabulary(stories):
    """The requests that returned 500 on stories260K ("The grammar refused token
    ...: forced bytes: got ' '"), through the OpenAI app."""
    engine, _ = stories
    templated = eqx_models.load_tokenizer(require_fixture(STORIES))
    templated.chat_template = TOOL_TEMPLATE
    requests = [
        ("tool_choice=named", 0, dict(tools=TOOLS, tool_choice={"type": "function",
                                                                "function": {"name": "set_alarm"}})),
        ("tool_choice=required", 1, dict(tools=TOOLS, tool_choice="required")),
        ("integer", 1, dict(response_format={"type": "json_schema",
                                             "json_schema": {"name": "age", "schema": SCHEMAS["integer"]}})),
    ]
    with TestClient(Server(engine, templated, "stories").app()) as client:
        for kind, temperature, body in requests:
            response = client.post("/v1/chat/completions", json={
                "model": "stories", "messages": [{"role": "user", "content": "Wake me at seven."}],
                "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 3, **body})
            assert response.status_code == 200, (kind, response.text)
            message = response.json()["choices"][0]["message"]
            if kind.startswith("tool_choice"):
                (call,) = message["tool_calls"]
                assert message["content"] is None
                check_call(kind, call)
            else:
                check(kind, message["content"])
