"""`eqx-models finetune`: a run on the real fixture, and the data errors it reports."""

import json
import re

import numpy as np

from conftest import STORIES, require_fixture
from eqx_models import from_pretrained, load_tokenizer
from eqx_models.cli import main
from eqx_models.data import pack, read_documents


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_finetune_runs_and_saves_a_model_that_loads(tmp_path, capsys):
    data = write_lines(tmp_path / "data.jsonl", [json.dumps({"text": f"Tom saw a big red ball number {i}."})
                                                 for i in range(40)]
                       + [json.dumps({"prompt": "Q: what colour? A:", "completion": " red."})] * 10)
    out = tmp_path / "out"
    assert main(["finetune", str(require_fixture(STORIES)), "--data", str(data), "--steps", "12", "--seq-len", "64",
                 "--batch-size", "4", "--lora-rank", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "finetune" in err and "loss=" in err and "tok_s=" in err  # the progress bar
    tuned, base = from_pretrained(out), from_pretrained(STORIES)
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "adapter" / "adapter_model.safetensors").exists()
    assert load_tokenizer(out).encode("Tom saw") == load_tokenizer(STORIES).encode("Tom saw")
    ids = np.asarray([load_tokenizer(out).encode("Tom saw a big")])
    assert np.max(np.abs(np.asarray(tuned(ids)[0]) - np.asarray(base(ids)[0]))) > 1e-3  # the weights moved


def test_packing_keeps_documents_whole_and_counts_only_completions(tmp_path):
    tokenizer = load_tokenizer(require_fixture(STORIES))
    data = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "Once", "completion": " upon"}),
                                              json.dumps({"text": "a time there was"}), ""])
    documents = read_documents(data, tokenizer, max_tokens=32)
    batch = pack(documents, 16, pad_token_id=0)
    first, second = documents
    assert batch["input_ids"].shape == (1, 16)  # both fit in one row
    n1, n2 = len(first[0]), len(second[0])
    np.testing.assert_array_equal(batch["input_ids"][0, : n1 + n2], first[0] + second[0])
    np.testing.assert_array_equal(batch["segment_ids"][0, : n1 + n2], [0] * n1 + [1] * n2)
    prompt_tokens = len(tokenizer.encode("Once"))
    assert (batch["labels"][0, :prompt_tokens] == -100).all() and (batch["labels"][0, prompt_tokens:n1] >= 0).all()
    assert (batch["labels"][0, n1 + n2:] == -100).all() and (batch["attention_mask"][0, n1 + n2:] == 0).all()


def test_bad_data_gets_a_clear_error(tmp_path, capsys):
    model = str(require_fixture(STORIES))
    cases = [
        ([], "holds no documents"),
        (['{"text": "fine"}', "{not json"], ":2 is not valid JSON"),
        (['{"content": "x"}'], ':1: expected an object with a "text" string'),
        ([json.dumps({"text": "word " * 400})], ":1: the document is .* tokens, longer than the 64 a row holds"),
    ]
    for lines, message in cases:
        data = write_lines(tmp_path / "bad.jsonl", lines)
        assert main(["finetune", model, "--data", str(data), "--steps", "1", "--seq-len", "64",
                     "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), (message, err)
    good = write_lines(tmp_path / "good.jsonl", ['{"text": "Once upon a time"}'])
    assert main(["finetune", model, "--data", str(good), "--seq-len", "100000", "--out", str(tmp_path / "o")]) == 2
    assert "longer than the model's max_position_embeddings" in capsys.readouterr().err
    assert main(["finetune", model, "--data", str(good), "--lora-targets", "query", "--out", str(tmp_path / "o")]) == 2
    assert "matches no projection" in capsys.readouterr().err
    assert main(["finetune", model, "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "No data file at" in capsys.readouterr().err
