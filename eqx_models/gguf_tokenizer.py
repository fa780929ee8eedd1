"""The tokenizer a GGUF file carries, rebuilt with the `tokenizers` library.

Two kinds of vocabulary are read, as `tokenizer.ggml.model` names them:

- `gpt2`: byte-level BPE with the file's merges, split first by the pattern of its
  pre-tokenizer (`tokenizer.ggml.pre`: Qwen2's, Llama 3's, GPT-2's).
- `llama`: SentencePiece BPE (Llama 2, Mistral, TinyStories): the merges are not
  stored, so they are derived from the scores (a pair of pieces merges as early as
  the piece it makes scores high), with byte fallback and the `▁` word marker.

Control tokens become special added tokens, user-defined ones plain added tokens.
"""

from typing import NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from .gguf_file import GGUFFile, read_generation_eos

# Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (split pattern or None for GPT-2's own, NFC normalisation).
BPE_PRE_TOKENIZERS = {
    "qwen2": (QWEN2_PATTERN, True),
    "llama-bpe": (LLAMA3_PATTERN, False),
    "llama3": (LLAMA3_PATTERN, False),
    "gpt-2": (None, False),
    "default": (None, False),
}
WORD_MARK = "\u2581"


class GGUFTokenizer(NamedTuple):
    """A GGUF file's tokenizer: the `tokenizers` backend and the settings that
    `eqx_models.Tokenizer` keeps beside it (`load_tokenizer` wraps it in one).

    Attributes:
        backend: the rebuilt `tokenizers.Tokenizer`.
        eos_token_ids: the ids that end generation (EOS, and an end-of-turn token
            if the file names one).
        bos_token, eos_token, pad_token: the tokens' texts, or None.
        chat_template: the Jinja chat template, or None.
    """

    backend: Backend
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None


def gguf_tokenizer(file: GGUFFile) -> GGUFTokenizer:
    """The tokenizer a GGUF file carries (vocabulary, merges, special tokens,
    BOS/EOS, chat template from its metadata).

    Args:
        file: the open GGUF file.

    Returns:
        The backend and its settings; `eqx_models.load_tokenizer` makes a
        `Tokenizer` of them.

    Raises:
        ValueError: a tokenizer model or pre-tokenizer this reader does not rebuild
            (it names it; load the original repo's `tokenizer.json` instead).
    """
    kind = file.value("tokenizer.ggml.model")
    tokens = file.value("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{file.path} carries no tokenizer (no tokenizer.ggml.tokens); load one with load_tokenizer.")
    types = file.value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(file, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(file, tokens, types)
    else:
        raise ValueError(
            f"{file.path}: tokenizer model {kind!r} is not rebuilt here (gpt2 and llama are); load the original "
            "repo's tokenizer with load_tokenizer(repo or folder)."
        )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    def token(key):
        value = file.value(key)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise ValueError(f"{file.path}: {key} = {value} is outside the {len(tokens)}-token vocabulary.")
        return None if value is None else tokens[int(value)]

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    # Where the file does not say, llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies.
    adds_bos = kind == "llama" or file.value("tokenizer.ggml.pre") in ("llama-bpe", "llama3")
    specials = []
    if bos is not None and file.value("tokenizer.ggml.add_bos_token", adds_bos):
        specials.append((bos, "bos"))
    if eos is not None and file.value("tokenizer.ggml.add_eos_token", False):
        specials.append((eos, "eos"))
    if specials:
        ids = {text: int(file.value(f"tokenizer.ggml.{which}_token_id")) for text, which in specials}
        starts = [t for t, which in specials if which == "bos"]
        ends = [t for t, which in specials if which == "eos"]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*starts, "$A", *ends]),
            pair=" ".join([*starts, "$A", *ends, *starts, "$B", *ends]),
            special_tokens=list(ids.items()),
        )
    return GGUFTokenizer(
        backend,
        eos_token_ids=read_generation_eos(file),
        bos_token=bos,
        eos_token=eos,
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=file.value("tokenizer.chat_template"),
    )


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> Backend:
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise ValueError(
            f"{file.path}: pre-tokenizer {pre!r} is not rebuilt here ({sorted(BPE_PRE_TOKENIZERS)} are); load the "
            "original repo's tokenizer with load_tokenizer(repo or folder)."
        )
    pattern, nfc = BPE_PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in file.value("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pattern is not None))
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str], types: list[int]) -> Backend:
    scores = file.value("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(candidates)]
    unknown = file.value("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab, merges, unk_token=None if unknown is None else tokens[int(unknown)],
                                 fuse_unk=True, byte_fallback=True))
    prefix = file.value("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_MARK, prepend_scheme="always" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace(WORD_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend
