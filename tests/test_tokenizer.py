"""Tokenizers: real vocabularies, EOS ids, chat templates and streaming detokenisation."""

import json

import pytest

import eqx_models
from eqx_models.tokenizer import StreamDecoder
from conftest import QWEN_TOKENIZER, STORIES, require_fixture


@pytest.fixture(scope="module")
def qwen():
    return eqx_models.load_tokenizer(require_fixture(QWEN_TOKENIZER))


def test_qwen_vocabulary_reproduces_reference_ids(qwen):
    cases = json.loads((QWEN_TOKENIZER / "expected.json").read_text())
    assert len(cases) == 47
    for case in cases:
        assert qwen.encode(case["text"]) == case["ids"], case["text"]
        assert qwen.decode(case["ids"]) == case["text"]


def test_qwen_special_tokens_and_eos(qwen):
    assert qwen.eos_token_ids == (qwen.backend.token_to_id("<|im_end|>"),) == (151645,)
    assert qwen.pad_token_id == 151643
    assert qwen.bos_token_id is None
    assert qwen.encode("Seattle is a") == [71672, 374, 264]  # no BOS added


def test_chat_template_renders_and_tokenizes(qwen):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = qwen.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = qwen.apply_chat_template(messages)
    assert ids[0] == qwen.backend.token_to_id("<|im_start|>")
    assert qwen.decode(ids, skip_special_tokens=False) == text
    no_prompt = qwen.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_chat_template_matches_transformers(qwen):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(QWEN_TOKENIZER)
    messages = [{"role": "user", "content": "Wie geht's? 你好"}, {"role": "assistant", "content": "Gut."}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert qwen.apply_chat_template(messages, tokenize=False) == expected


def test_missing_chat_template_is_a_clear_error():
    tokenizer = eqx_models.load_tokenizer(require_fixture(STORIES))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_stories_tokenizer_adds_bos_and_reads_eos():
    tokenizer = eqx_models.load_tokenizer(require_fixture(STORIES))
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tokenizer.encode("") == [1]
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 1


def test_stream_decoder_never_splits_a_multibyte_character(qwen):
    text = "Grüße 🎉 日本語 and more"
    ids = qwen.encode(text)
    # One emoji spans several byte-level tokens: partial pieces must be held back.
    assert any("\ufffd" in qwen.decode([i]) for i in ids)
    stream = StreamDecoder(qwen)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_keeps_the_space_after_the_prompt():
    tokenizer = eqx_models.load_tokenizer(require_fixture(STORIES))
    prompt = tokenizer.encode("Once upon")
    rest = tokenizer.encode("Once upon a time", add_special_tokens=True)[len(prompt):]
    stream = StreamDecoder(tokenizer, prompt)
    assert "".join(stream.push([i]) for i in rest) == " a time"
    assert stream.text == " a time"


def test_a_checkpoint_saved_with_its_tokenizer_runs_in_the_cli(tmp_path, capsys):
    """`save_pretrained(model, folder, tokenizer=...)` writes a folder that
    `eqx-models generate` and `transformers` take whole; without the tokenizer the
    README's own checkpoint did not load in `eqx-models generate`."""
    from transformers import AutoTokenizer

    from eqx_models.cli import main

    stories = require_fixture(STORIES)
    tokenizer = eqx_models.load_tokenizer(stories)
    eqx_models.save_pretrained(eqx_models.from_pretrained(stories), tmp_path, tokenizer=tokenizer)
    case = json.loads((stories / "expected.json").read_text())[1]
    assert main(["generate", str(tmp_path), "--prompt", case["prompt"], "--max-new-tokens",
                 str(len(case["output_ids"]))]) == 0
    printed = capsys.readouterr().out
    assert case["prompt"] + printed.rstrip("\n") == case["text"]
    reloaded = eqx_models.load_tokenizer(tmp_path)
    assert reloaded.eos_token_ids == tokenizer.eos_token_ids and reloaded.bos_token_id == tokenizer.bos_token_id
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(case["prompt"])["input_ids"] == case["prompt_ids"]


def test_qwen_tokenizer_saved_and_reloaded_keeps_its_template_and_tokens(qwen, tmp_path):
    qwen.save_pretrained(tmp_path)
    reloaded = eqx_models.load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "Hi there"}]
    assert reloaded.apply_chat_template(messages) == qwen.apply_chat_template(messages)
    assert (reloaded.eos_token_ids, reloaded.pad_token_id) == (qwen.eos_token_ids, qwen.pad_token_id)
    assert not list(tmp_path.glob("*.partial"))
