"""Fine-tuning data: JSON-lines documents, tokenized and packed into rows."""

import json
import os
from pathlib import Path

import numpy as np

from .training import IGNORE_INDEX


def read_documents(path: str | os.PathLike, tokenizer, *, max_tokens: int) -> list[tuple[list[int], list[bool]]]:
    """Token ids and which of them count in the loss, one entry per line of `path`.

    Each line is a JSON object with `"text"` (every token counts) or `"prompt"` and
    `"completion"` (only the completion's tokens count). An EOS token ends each
    document. Raises `ValueError` naming the line for an empty file, a line that is
    not such an object, or a document longer than `max_tokens` (nothing is cut).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No data file at {path}; pass a JSON-lines file (one JSON object per line).")
    eos = (tokenizer.eos_token_ids or [None])[0]
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not valid JSON ({e.msg}); write one JSON object per line.") from None
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                ids = tokenizer.encode(record["text"])
                counted = [True] * len(ids)
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(
                record.get("completion"), str
            ):
                prompt, completion = tokenizer.encode(record["prompt"]), tokenizer.encode(record["completion"])
                ids, counted = prompt + completion, [False] * len(prompt) + [True] * len(completion)
            else:
                raise ValueError(
                    f'{path}:{number}: expected an object with a "text" string, or "prompt" and "completion" '
                    f"strings; got {line.strip()[:80]!r}."
                )
            if eos is not None:
                ids, counted = ids + [eos], counted + [True]
            if len(ids) > max_tokens:
                raise ValueError(
                    f"{path}:{number}: the document is {len(ids)} tokens, longer than the {max_tokens} a row holds. "
                    "Split it, or raise --seq-len (up to the model's max_position_embeddings)."
                )
            if len(ids) >= 2:
                documents.append((ids, counted))
    if not documents:
        raise ValueError(f"{path} holds no documents of two or more tokens; nothing to train on.")
    return documents


def pack(documents: list[tuple[list[int], list[bool]]], seq_len: int, *, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """Documents packed whole into rows of `seq_len` (first fit, in order).

    Returns `input_ids`, `labels` (-100 where a token does not count or is padding),
    `attention_mask` and `segment_ids` (a document's number within its row; padding
    gets its own), each `[rows, seq_len]` int32.
    """
    rows: list[list[tuple[list[int], list[bool]]]] = []
    used: list[int] = []
    for document in documents:
        for i, taken in enumerate(used):
            if taken + len(document[0]) <= seq_len:
                rows[i].append(document)
                used[i] += len(document[0])
                break
        else:
            rows.append([document])
            used.append(len(document[0]))
    shape = (len(rows), seq_len)
    input_ids = np.full(shape, pad_token_id, np.int32)
    labels = np.full(shape, IGNORE_INDEX, np.int32)
    mask = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    for r, row in enumerate(rows):
        start = 0
        for number, (ids, counted) in enumerate(row):
            stop = start + len(ids)
            input_ids[r, start:stop] = ids
            labels[r, start:stop] = np.where(counted, ids, IGNORE_INDEX)
            mask[r, start:stop] = 1
            segments[r, start:stop] = number
            start = stop
        segments[r, start:] = len(row)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "segment_ids": segments}
