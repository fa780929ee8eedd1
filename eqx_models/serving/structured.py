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
"""

import dataclasses
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
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)[0]
        )

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
