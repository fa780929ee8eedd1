"""Structured outputs: a request's text constrained to a JSON schema, a regular
expression, a grammar or a list of choices, by masking the tokens that cannot
continue it.

The grammars are llguidance's (the library vLLM, SGLang and llama.cpp also use):
it needs only the tokenizer's JSON, compiles a schema in about a millisecond and
fills a 151,936-token mask in tens of microseconds (`benchmarks/grammar_masks.py`
measured it beside xgrammar, which needs torch, and outlines-core, which took
seconds to compile a schema). Each constrained sequence has a `Matcher`: before a
step samples its next token the engine asks it for the row's mask (one bit per
vocabulary entry), after the step it feeds it the token.

Where the grammar forces text (the space after `":"`), llguidance tokenizes it and
the mask allows only the first of those tokens, so its tokenizer must spell every
text exactly: `llguidance_tokenizer` gives it one that does, for byte-level BPE
and SentencePiece byte-fallback vocabularies alike, and checks it before any
request uses it.
"""

import dataclasses
import functools
import json
from typing import Any

import numpy as np

from ..tokenizer import Tokenizer


# JSON laid out as Python's json.dumps does: free whitespace let models emit newlines
# until max_tokens. A schema's own "x-guidance" key overrides it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of the fields.

    Attributes:
        json_schema: a JSON schema (a dict, or its JSON text): the output is one
            JSON value it accepts.
        json_object: the output is one JSON object, any keys.
        regex: the whole output matches this regular expression (Rust `regex` syntax).
        grammar: a Lark grammar (llguidance's dialect, which also takes `%json`
            and regular-expression terminals); its `start` rule is the output.
        choice: the output is exactly one of these strings.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | list[str] | None = None

    def __post_init__(self):
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(self, name) is not None]
        given += ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise ValueError(
                "A structured output takes exactly one of json_schema, json_object, regex, grammar or choice; "
                f"got {', '.join(given) or 'none'}."
            )
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema must be a JSON object or its text, got {type(self.json_schema).__name__}.")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {list(self.choice)!r}.")

    def llguidance_grammar(self) -> str:
        """This constraint as an llguidance grammar (its JSON text)."""
        from llguidance import LLMatcher

        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}.") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}.")
            return LLMatcher.grammar_from_json_schema({"x-guidance": JSON_LAYOUT, **schema})
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"x-guidance": JSON_LAYOUT, "type": "object"})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return LLMatcher.grammar_from_lark(self.grammar)
        # JSON string literals are Lark string literals.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))


# Texts a grammar forces in JSON, regular expressions and tool calls, and the
# whitespace and characters that tokenizers reshape: each must come back from
# llguidance's tokenizer as tokens that spell it byte for byte.
SPELLING_PROBES = (
    " ", "  ", ": ", ", ", '": ', '{"a": 1, "b": [true, false, null], "c": "x y"}', " 0.5", "-7",
    "\n", "\t", " \n ", "a  b ", "caf\u00e9", "cafe\u0301", "\U0001f916",
)
SPECIAL_MARKER = b"\xff"  # llguidance's first byte of a special token's name: no text holds it


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_id: int):
    """llguidance's tokenizer for the model's `vocab_size` rows, whose tokenization
    of any text gives tokens that spell exactly that text.

    llguidance tokenizes the text a grammar forces (the `" "` after `":"`) and its
    mask allows only the first of those tokens, so a tokenization that loses, adds
    or hides bytes makes the mask force a token the grammar then refuses. Its own
    tokenizer from `tokenizer.json` does that in two ways: it keeps the normalizer
    and pre-tokenizer, which reshape a whole prompt (a SentencePiece vocabulary
    converted with `remove_extra_whitespaces` strips outer spaces, so `": "` came
    back as `":"`), and it reads the text of a special token (`</s>`,
    `<|im_end|>`) as that token. Here llguidance keeps its own reading of the
    vocabulary (each token's bytes, which tokens are special), and the text is
    tokenized by `_Spelling`.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's vocabulary rows (ids past the tokenizer's own are
            special placeholders that no mask allows).
        eos_token_id: the token that ends a complete output.

    Returns:
        An `llguidance.LLTokenizer` for `LLMatcher`s.

    Raises:
        ValueError: the vocabulary cannot spell one of `SPELLING_PROBES` or the
            text of an added token (a tokenizer without byte fallback), or
            llguidance cannot read it.
    """
    import llguidance

    spec = _spelling_spec(json.loads(tokenizer.backend.to_str()))
    # Read for its tokens only: no slices, which speed up masks.
    vocabulary = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos_token_id, slices=[])
    lltokenizer = llguidance.LLTokenizer(_Spelling(spec, vocabulary, eos_token_id), eos_token=eos_token_id)
    check_spelling(lltokenizer, SPELLING_PROBES + tuple(added["content"] for added in spec["added_tokens"]))
    return lltokenizer


class _Spelling:
    """A tokenizer as llguidance takes one from Python (its `TokenizerWrapper`'s
    attributes): every token's bytes, and a call from text to token ids.

    The text is tokenized with the model's vocabulary and merges only: the added
    tokens that llguidance counts as special (chat markers, BOS/EOS) stand for no
    text, so the text of one is spelled out as ordinary tokens."""

    is_tokenizer_wrapper = True
    bos_token_id = None
    special_token_ids = ()  # their bytes already start with SPECIAL_MARKER

    def __init__(self, spec: dict, vocabulary, eos_token_id: int):
        import tokenizers

        self.eos_token_id = eos_token_id
        # The bytes llguidance's trie gives each token (a special one's name after the marker).
        spelled = [bytes(vocabulary.decode_bytes([token])) for token in range(vocabulary.vocab_size)]
        self.tokens = [SPECIAL_MARKER + text if text and vocabulary.is_special_token(token) else text
                       for token, text in enumerate(spelled)]
        ordinary = [added for added in spec["added_tokens"] if not vocabulary.is_special_token(added["id"])]
        spelling = tokenizers.Tokenizer.from_str(json.dumps({**spec, "added_tokens": ordinary}))
        # Called from llguidance's mask threads, holding the GIL, whenever a grammar
        # forces text (most steps inside a JSON object's keys): the same few texts
        # recur, so each is tokenized once.
        self._encode = functools.lru_cache(maxsize=4096)(
            lambda text: tuple(spelling.encode(text, add_special_tokens=False).ids))

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


def _spelling_spec(spec: dict) -> dict:
    """A `tokenizer.json` object less what reshapes a whole text rather than spells
    a piece of it: normalizer steps other than literal replacements (a space
    written as `▁`, which the decoder undoes; gone: stripping and collapsing
    spaces, NFC, a leading `▁`), a space or `▁` put before the text, truncation
    and padding."""
    return {**spec, "normalizer": _literal_replacements(spec.get("normalizer")),
            "pre_tokenizer": _without_prefix_space(spec.get("pre_tokenizer")), "truncation": None, "padding": None}


def _literal_replacements(normalizer: dict | None) -> dict | None:
    """The `Replace` steps of `normalizer` whose pattern is a plain string."""
    if normalizer is None:
        return None
    if normalizer["type"] == "Sequence":
        steps = [kept for step in normalizer["normalizers"] if (kept := _literal_replacements(step))]
        return {"type": "Sequence", "normalizers": steps} if steps else None
    return normalizer if normalizer["type"] == "Replace" and "String" in normalizer["pattern"] else None


def _without_prefix_space(pre_tokenizer: dict | None) -> dict | None:
    """`pre_tokenizer` with no space or word marker put before the text."""
    if pre_tokenizer is None:
        return None
    kind = pre_tokenizer["type"]
    if kind == "Sequence":
        return {**pre_tokenizer, "pretokenizers": [_without_prefix_space(p) for p in pre_tokenizer["pretokenizers"]]}
    fixed = dict(pre_tokenizer)
    if kind == "Metaspace" and "prepend_scheme" in fixed:
        fixed["prepend_scheme"] = "never"
    if kind in ("Metaspace", "ByteLevel") and "add_prefix_space" in fixed:
        fixed["add_prefix_space"] = False
    return fixed


def check_spelling(lltokenizer, probes=SPELLING_PROBES) -> None:
    """Raises ValueError if llguidance's tokenizer turns one of `probes` into
    tokens that spell something else or include a special token (the masks would
    then force tokens that the grammar refuses).

    Args:
        lltokenizer: an `llguidance.LLTokenizer`.
        probes: the texts to tokenize.
    """
    for probe in probes:
        tokens = lltokenizer.tokenize_str(probe)
        spelled = bytes(lltokenizer.decode_bytes(tokens))
        special = [token for token in tokens if lltokenizer.is_special_token(token)]
        if spelled != probe.encode() or special:
            found = f"{spelled.decode(errors='replace')!r}" + (f" with special tokens {special}" if special else "")
            raise ValueError(
                f"Structured outputs cannot use this tokenizer: it turns the text {probe!r} into tokens {tokens} "
                f"that spell {found}, so a grammar forcing that text would be refused. They need a vocabulary that "
                "can write any text (byte-level BPE, or SentencePiece with byte fallback)."
            )


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill_mask(self, words: np.ndarray) -> None:
        """Writes the allowed next tokens into `words` (int32, bit `t % 32` of word
        `t // 32` set for token `t`)."""
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def consume(self, token: int) -> None:
        """Advances past a sampled token (raises RuntimeError if the grammar refuses it)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"The grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the output is complete (no token can follow)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Makes `Matcher`s for one tokenizer and vocabulary size (the model's rows:
    ids past the tokenizer's own are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        try:
            import llguidance
        except ImportError as error:
            raise ValueError(
                f"structured outputs need llguidance: pip install 'eqx_models[serve]' ({error})"
            ) from None
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()  # one thread per core
        self._tokenizer = llguidance_tokenizer(tokenizer, vocab_size, sorted(eos_token_ids)[0])

    def matcher(self, structured: StructuredOutput) -> Matcher:
        """A fresh matcher; ValueError naming the problem if the grammar is invalid."""
        from llguidance import LLMatcher

        grammar = structured.llguidance_grammar()
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"The structured output is not valid: {error}")
        matcher = LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"The structured output is not valid: {matcher.get_error()}")
        return Matcher(matcher)

    @property
    def lltokenizer(self):
        """llguidance's tokenizer, which the matchers share (see `llguidance_tokenizer`)."""
        return self._tokenizer

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_masks(self, matchers: list[tuple[Matcher, int]], words: np.ndarray) -> None:
        """Each `(matcher, row)`'s mask into `words[row]` (int32 `[rows, mask_words]`),
        the rows computed in parallel on llguidance's threads."""
        if len(matchers) == 1:
            matcher, row = matchers[0]
            return matcher.fill_mask(words[row])
        assert words.dtype == np.int32 and words.flags["C_CONTIGUOUS"] and words.shape[1] == self.mask_words
        self._executor.unsafe_compute_mask_ptr([(m._matcher, row) for m, row in matchers], words.ctypes.data,
                                               words.shape[1] * 4, words.shape[0])
