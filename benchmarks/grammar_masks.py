"""Token-mask cost of three grammar libraries on the 151,936-token Qwen vocabulary:
the measurement behind the choice of llguidance for structured outputs.

For each JSON schema below and each library (llguidance, xgrammar, outlines-core),
the grammar is compiled for the real Qwen tokenizer (`../shared/fixtures/qwen-tokenizer`,
padded to the model's 151,936 rows), then a valid JSON document of the schema is
(laid out as the server asks, `json.dumps`'s separators) walked token by token: at each token the library fills the mask of allowed next
tokens, then consumes the token. Reported per library and schema: compile time,
and the median and worst mask time per token. Every library must allow every
token of the document (checked). One process, the libraries taking turns.

    pip install llguidance xgrammar outlines-core transformers
    python benchmarks/grammar_masks.py

Writes `benchmarks/results/grammar_masks.json`.
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = Path(os.environ.get("EQX_MODELS_FIXTURES", ROOT.parent / "shared" / "fixtures"))
VOCAB = 151936  # Qwen3's embedding rows (the tokenizer has fewer tokens)
# eqx_models.serving.structured.JSON_LAYOUT, the layout the server asks for (not
# imported: this script runs where xgrammar's torch is, without JAX).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "country": {"enum": ["FR", "DE", "US", "JP"]}},
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
PERSON_DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                   "tags": ["mathematics", "engines", "poetry of science"],
                   "address": {"street": "12 St James's Square", "city": "London", "country": "US"}}

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_DOCUMENT = {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}}

CASES = {"person": (PERSON, PERSON_DOCUMENT), "tool_call": (TOOL_CALL, TOOL_DOCUMENT)}


def allowed(mask_words: np.ndarray, token: int) -> bool:
    return bool((int(mask_words[token // 32]) >> (token % 32)) & 1)


def walk(fill, consume, tokens: list[int]) -> list[float]:
    """Seconds per mask along `tokens` (each token checked against its mask; the
    last, EOS, only checked)."""
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    seconds = []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        fill(mask)
        seconds.append(time.perf_counter() - start)
        if not allowed(mask[0], token):
            raise AssertionError(f"token {token} of a valid document was masked out")
        if i < len(tokens) - 1:
            consume(token)
    return seconds


def with_llguidance(tokenizer_json: str, eos: int, schema: dict, tokens: list[int]):
    import llguidance
    import llguidance.numpy

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=eos)
    made_tokenizer = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        {"x-guidance": JSON_LAYOUT, **schema}))
    compile_s = time.perf_counter() - start
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    seconds = walk(lambda mask: llguidance.numpy.fill_next_token_bitmask(matcher, mask),
                   lambda token: matcher.consume_token(token), tokens)
    return made_tokenizer, compile_s, seconds


def with_xgrammar(tokenizer_folder: Path, eos: int, schema: dict, tokens: list[int]):
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer_folder), vocab_size=VOCAB,
                                                   stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    made_tokenizer = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                   separators=(", ", ": ")))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)

    def fill(mask):
        matcher.fill_next_token_bitmask(bitmask)
        mask[:] = bitmask.numpy()

    seconds = walk(fill, lambda token: matcher.accept_token(token), tokens)
    del torch
    return made_tokenizer, compile_s, seconds


def byte_level_vocabulary(tokenizer: Tokenizer) -> dict[bytes, list[int]]:
    """Each token's bytes (undoing the GPT-2 byte-to-character map of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    byte_of = {chr(code): byte for byte, code in zip(printable, codes)}
    vocabulary: dict[bytes, list[int]] = {}
    for text, token in tokenizer.get_vocab(with_added_tokens=False).items():
        vocabulary.setdefault(bytes(byte_of[c] for c in text), []).append(token)
    return vocabulary


def with_outlines_core(tokenizer: Tokenizer, eos: int, schema: dict, tokens: list[int]):
    import outlines_core

    start = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(eos, byte_level_vocabulary(tokenizer))
    made_tokenizer = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_s = time.perf_counter() - start

    def fill(mask):
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)

    seconds = walk(fill, lambda token: guide.advance(token), tokens)
    return made_tokenizer, compile_s, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS / "grammar_masks.json")
    args = parser.parse_args()
    import importlib.metadata as metadata

    folder = FIXTURES / "qwen-tokenizer"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer_json = (folder / "tokenizer.json").read_text()
    eos = tokenizer.token_to_id("<|im_end|>")
    libraries = {
        "llguidance": lambda schema, tokens: with_llguidance(tokenizer_json, eos, schema, tokens),
        "xgrammar": lambda schema, tokens: with_xgrammar(folder, eos, schema, tokens),
        "outlines-core": lambda schema, tokens: with_outlines_core(tokenizer, eos, schema, tokens),
    }
    results = {"benchmark": "grammar_masks", "vocab_size": VOCAB, "tokenizer": "Qwen3 (fixtures/qwen-tokenizer)",
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
               "versions": {name: metadata.version(name) for name in ("llguidance", "xgrammar", "outlines-core")},
               "cases": {}}
    for case, (schema, document) in CASES.items():
        tokens = tokenizer.encode(json.dumps(document), add_special_tokens=False).ids + [eos]
        results["cases"][case] = {"tokens": len(tokens)}
        for name, run in libraries.items():
            made_tokenizer, compile_s, seconds = run(schema, tokens)
            figures = {"tokenizer_s": made_tokenizer, "compile_s": compile_s,
                       "mask_median_us": 1e6 * float(np.median(seconds)), "mask_max_us": 1e6 * max(seconds),
                       "mask_mean_us": 1e6 * float(np.mean(seconds))}
            results["cases"][case][name] = figures
            print(case, name, json.dumps({k: round(v, 4) for k, v in figures.items()}), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
