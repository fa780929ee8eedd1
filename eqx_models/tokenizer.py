"""Tokenizers from `tokenizer.json`, with EOS ids and chat templates."""

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from .config import eos_ids, load_json
from .gguf_file import GGUFFile, find_gguf
from .gguf_tokenizer import gguf_tokenizer
from .hub import TOKENIZER_FILES, resolve_model_dir
from .safetensors_file import replacing


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the settings Hugging Face keeps beside it.

    Attributes:
        backend: the underlying `tokenizers.Tokenizer`.
        eos_token_ids: ids that end generation (from `generation_config.json`, else
            `config.json`, else the tokenizer's `eos_token`).
        bos_token_id, pad_token_id: ids or None.
        chat_template: the Jinja chat template, or None.

    Args:
        backend: a `tokenizers.Tokenizer` (from `tokenizer.json`).
        eos_token_ids: the ids that end generation; defaults to `eos_token`'s id.
        bos_token: the BOS token's text, or None.
        eos_token: the EOS token's text, or None.
        pad_token: the padding token's text, or None.
        chat_template: the Jinja chat template, or None.

    `load_tokenizer` builds one from a folder or hub id.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.pad_token_id = backend.token_to_id(pad_token) if pad_token else None
        eos_from_token = backend.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids = tuple(eos_token_ids) or ((eos_from_token,) if eos_from_token is not None else ())
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`.

        Args:
            text: the text.
            add_special_tokens: add what the tokenizer's post-processor adds (e.g. BOS).

        Returns:
            The ids.
        """
        # The batch call lets go of the GIL while it works (`encode` holds it): a long
        # text does not stop the other threads (a server's event loop) meanwhile.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`.

        Args:
            ids: token ids.
            skip_special_tokens: drop special tokens (BOS, EOS, chat markers).

        Returns:
            The text.
        """
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Renders a conversation with the tokenizer's chat template.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]`.
            add_generation_prompt: end with the assistant's turn opening, so the
                model writes the reply.
            tokenize: return token ids (the default, as in `transformers`) rather
                than the rendered string.
            **template_kwargs: further variables for the template (Qwen3's
                `enable_thinking`, `tools`, ...).

        Returns:
            Token ids, or the rendered string. The template's text already holds its
            special tokens, so none are added when tokenizing it. A tokenizer without
            a template raises `ValueError`.
        """
        if not self.chat_template:
            raise ValueError(
                "This tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); format the prompt yourself or use a chat model's tokenizer."
            )
        text = _compile_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Writes the tokenizer in the Hugging Face layout, so `load_tokenizer`,
        `eqx-models generate` and `transformers`' `AutoTokenizer` read it back.

        Args:
            directory: the folder (created if needed). `tokenizer.json` and
                `tokenizer_config.json` are written (each under a temporary name,
                then renamed into place); the EOS ids go into
                `generation_config.json`. Settings already in either config file
                that this tokenizer does not hold are kept.

        Returns:
            None.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        config_path = directory / "tokenizer_config.json"
        config = load_json(config_path) if config_path.exists() else {"tokenizer_class": "PreTrainedTokenizerFast"}
        config.update({k: v for k, v in special.items() if v is not None})
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        _replace_text(directory / "tokenizer.json", self.backend.to_str())
        _replace_text(config_path, json.dumps(config, indent=2) + "\n")
        if self.eos_token_ids:
            generation_path = directory / "generation_config.json"
            generation = load_json(generation_path) if generation_path.exists() else {}
            generation["eos_token_id"] = list(self.eos_token_ids)
            _replace_text(generation_path, json.dumps(generation, indent=2) + "\n")


def _replace_text(path: Path, text: str) -> None:
    with replacing(path) as f:
        f.write(text.encode())


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


# The most items a chat template may make by repeating a string or list (`'a' * n`),
# and the largest power it may raise an integer to: beyond them a single operation
# could take all memory (or hours) before a render's time limit is looked at.
TEMPLATE_MAX_REPEAT = 10**7
TEMPLATE_MAX_EXPONENT = 10**4


class _TemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with `*` and `**` held to the limits above."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                if isinstance(items, (str, list, tuple)) and isinstance(times, int) and \
                        len(items) * times > TEMPLATE_MAX_REPEAT:
                    raise jinja2.sandbox.SecurityError(
                        f"the chat template repeats a {type(items).__name__} of {len(items)} items {times} times, "
                        f"more than the {TEMPLATE_MAX_REPEAT} items a template may make at once")
        if operator == "**" and isinstance(left, int) and abs(left) > 1 and isinstance(right, (int, float)) \
                and abs(right) > TEMPLATE_MAX_EXPONENT:
            raise jinja2.sandbox.SecurityError(
                f"the chat template raises {left} to the power {right}, beyond the {TEMPLATE_MAX_EXPONENT} allowed")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)  # a server renders the same template for every chat request
def _compile_template(source: str) -> jinja2.Template:
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env.from_string(source)


def _read_chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").exists():
        return load_json(folder / "chat_template.json").get("chat_template")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def load_tokenizer(name_or_path: str | os.PathLike, *, revision: str | None = None) -> Tokenizer:
    """Loads the tokenizer of a hub repo id or local folder.

    Args:
        name_or_path: a local folder or a hub repo id, or a GGUF file (its
            vocabulary rebuilt, see `eqx_models.gguf_tokenizer`). A folder needs
            `tokenizer.json` (fast tokenizers), and reads `tokenizer_config.json`,
            `special_tokens_map.json`, `generation_config.json`, `config.json` and a
            chat template when they are there.
        revision: hub branch, tag or commit.

    Returns:
        A `Tokenizer` with EOS ids from `generation_config.json`, else `config.json`,
        else the tokenizer's `eos_token`.
    """
    gguf_path = find_gguf(name_or_path)
    if gguf_path is not None:
        rebuilt = gguf_tokenizer(GGUFFile(gguf_path))
        return Tokenizer(
            rebuilt.backend,
            eos_token_ids=rebuilt.eos_token_ids,
            bos_token=rebuilt.bos_token,
            eos_token=rebuilt.eos_token,
            pad_token=rebuilt.pad_token,
            chat_template=rebuilt.chat_template,
        )
    folder = resolve_model_dir(name_or_path, revision=revision, allow_patterns=TOKENIZER_FILES)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json. Only fast (tokenizers-library) tokenizers are "
            "supported; convert a slow one with transformers' AutoTokenizer(...).save_pretrained()."
        )
    backend = tokenizers.Tokenizer.from_file(str(path))
    tokenizer_config = load_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    special = load_json(folder / "special_tokens_map.json") if (folder / "special_tokens_map.json").exists() else {}
    eos = ()
    for source in ("generation_config.json", "config.json"):
        if not eos and (folder / source).exists():
            eos = eos_ids(load_json(folder / source).get("eos_token_id"))

    def token(name: str) -> str | None:
        return _token_text(tokenizer_config.get(name)) or _token_text(special.get(name))

    return Tokenizer(
        backend,
        eos_token_ids=eos,
        bos_token=token("bos_token"),
        eos_token=token("eos_token"),
        pad_token=token("pad_token"),
        chat_template=_read_chat_template(folder, tokenizer_config),
    )


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, safe for multi-byte characters.

    Text is released only once it no longer ends in an incomplete UTF-8 sequence
    (which decodes as U+FFFD), so a character split over two tokens is never printed
    half. The prompt ids given at the start set the context (e.g. the leading space
    that SentencePiece tokenizers drop at the start of a text) but are not emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.emitted = tokenizer.decode(self.ids)
        self.prompt_text = self.emitted

    def push(self, ids: Sequence[int]) -> str:
        """Adds tokens; returns the new text that is complete so far."""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece = text[len(self.emitted):]
        self.emitted = text
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (including a trailing replacement character)."""
        text = self.tokenizer.decode(self.ids)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece

    @property
    def text(self) -> str:
        """Everything generated after the prompt."""
        return self.emitted[len(self.prompt_text):]
