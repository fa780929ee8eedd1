"""GGUF files in: made by llama.cpp's converter from transformers checkpoints (and
re-quantized with llama.cpp's reference quantizers), loaded, and compared with
transformers running the same weights."""

import json
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import QWEN_TOKENIZER, STORIES, make_checkpoint, release_compiled_code, require_fixture, tiny_config
from gguf_tools import convert, dequantized_file, quantized, random_k_blocks, rewrite, tensor_types

import eqx_models
from eqx_models.config import ConfigError
from eqx_models.quantization import QuantizedWeight, tiles_pay, with_activations
from eqx_models.safetensors_file import CheckpointError

Q = gguf.GGMLQuantizationType
is_quantized = lambda node: isinstance(node, QuantizedWeight)


@pytest.fixture(autouse=True)
def _release():
    yield
    release_compiled_code()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoints and their GGUF files, converted once for the module."""
    root = tmp_path_factory.mktemp("gguf")
    stories = require_fixture(STORIES)
    qwen = root / "qwen3"
    make_checkpoint(qwen, tiny_config("qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=True))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(require_fixture(QWEN_TOKENIZER) / name, qwen)
    wide = root / "llama256"  # widths that K-quant super-blocks of 256 divide
    make_checkpoint(wide, tiny_config("llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(stories / name, wide)
    return dict(
        stories=stories,
        stories_f32=convert(stories, root / "stories-f32.gguf"),
        stories_q8_0=convert(stories, root / "stories-q8_0.gguf", "q8_0"),
        qwen=qwen,
        qwen_f32=convert(qwen, root / "qwen3-f32.gguf"),
        wide=wide,
        wide_f32=convert(wide, root / "llama256-f32.gguf"),
        root=root,
    )


def hf_logits(folder, ids, replace=None):
    """transformers' logits for `ids`, with parameters in `replace` (HF name ->
    array) swapped in first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, value in (replace or {}).items():
            model.get_parameter(name).copy_(torch.from_numpy(np.asarray(value, np.float32)))
        return model(torch.tensor(ids)).logits.numpy()


def ours(model, ids):
    return np.asarray(model(jnp.asarray(ids))[0])


def roundtrip_like(gguf_path, folder, arch):
    """The checkpoint's parameters as the GGUF file stores them: each HF tensor
    quantized and dequantized by llama.cpp's reference code in the type its GGUF
    tensor has (the converter's choice), found through gguf-py's name map. Row
    order does not matter: Q8_0 / Q4_0 / F16 blocks lie along rows. An expert's
    tensor is found by its layer's fused tensor (`experts.3.up_proj` in
    `ffn_up_exps`)."""
    import re

    from safetensors.numpy import load_file

    types = tensor_types(gguf_path)
    weights = load_file(str(folder / "model.safetensors"))
    names = gguf.get_tensor_name_map(arch, 64)
    out = {}
    for name, value in weights.items():
        base = names.get_name(re.sub(r"\.experts\.\d+\.", ".experts.", name), try_suffixes=(".weight", ".bias"))
        kind = Q[types[base]]
        out[name] = gguf.quants.dequantize(gguf.quants.quantize(value.astype(np.float32), kind), kind)
    return out


def test_stories_gguf_matches_transformers_and_llama2c(files):
    """The llama architecture's converter interleaves query and key rows: loading
    must undo it for the logits to agree."""
    cases = json.loads((files["stories"] / "expected.json").read_text())
    case = cases[1]
    ids = np.asarray([case["prompt_ids"]])
    model = eqx_models.from_pretrained(files["stories_f32"])
    assert model.dtype == jnp.float32
    np.testing.assert_allclose(ours(model, ids), hf_logits(files["stories"], ids), atol=1e-4, rtol=0)
    new = eqx_models.generate(model, case["prompt_ids"], max_new_tokens=len(case["output_ids"]))[0]
    assert new.tolist() == case["output_ids"]
    tokenizer = eqx_models.load_tokenizer(files["stories_f32"])
    assert tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    assert tokenizer.decode(case["prompt_ids"] + case["output_ids"]) == case["text"]


def test_stories_tokenizer_from_gguf_matches_the_fixture(files):
    """SentencePiece BPE rebuilt from scores: every fixture case encodes to the same
    ids. (The fixture's tokenizer.json also collapses runs of spaces, as llama2.c
    does and SentencePiece does not, so texts with those are left out.)"""
    ours_tok = eqx_models.load_tokenizer(files["stories_q8_0"])
    theirs = eqx_models.load_tokenizer(files["stories"])
    texts = [c["prompt"] for c in json.loads((files["stories"] / "expected.json").read_text())]
    texts += ["Tom said, \"Look at the big dog!\" and ran.", "naïve café 🤖\ttabs\nlines", "x<s>y</s>"]
    for text in texts:
        assert ours_tok.encode(text) == theirs.encode(text), text
        assert ours_tok.decode(ours_tok.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours_tok.bos_token_id == 1 and ours_tok.eos_token_ids == (2,)


def test_q8_0_loads_packed_and_equals_llama_cpp_dequantized(files):
    path = files["stories_q8_0"]
    types = tensor_types(path)
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "F16"  # 172 wide
    model = eqx_models.from_pretrained(path)
    layers = model.model.layers
    for weight in (layers.self_attn.q_proj.weight, layers.mlp.up_proj.weight, model.model.embed_tokens.weight):
        assert is_quantized(weight) and weight.bits == 8 and weight.group_size == 32
    # The kernel's tiles where they pay and whole tiles of rows fit (not up_proj's 172).
    assert layers.self_attn.q_proj.weight.layout == ("tiles" if tiles_pay() else "rows")
    assert layers.mlp.up_proj.weight.layout == "rows"
    assert not is_quantized(layers.mlp.down_proj.weight)
    ids = np.asarray([[1, 403, 407, 261, 378, 297, 410, 296, 365, 291]])
    reference = hf_logits(files["stories"], ids, roundtrip_like(path, files["stories"], gguf.MODEL_ARCH.LLAMA))
    logits = ours(with_activations(model, "float"), ids)
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
    # And near the float model: Q8_0 moves these logits by about 1% of the largest.
    float_logits = hf_logits(files["stories"], ids)
    assert np.abs(logits - float_logits).max() <= 0.03 * np.abs(float_logits).max()
    assert np.abs(ours(model, ids) - float_logits).max() <= 0.03 * np.abs(float_logits).max()  # int8 activations


def test_qwen3_gguf_logits_tokenizer_and_chat_template(files):
    ids = np.asarray([[9707, 11, 1879, 0, 151644, 872, 198, 151645, 3555, 374]])
    model = eqx_models.from_pretrained(files["qwen_f32"])
    assert model.config.tie_word_embeddings and model.config.model_type == "qwen3"
    np.testing.assert_allclose(ours(model, ids), hf_logits(files["qwen"], ids), atol=1e-4, rtol=0)
    ours_tok = eqx_models.load_tokenizer(files["qwen_f32"])
    theirs = eqx_models.load_tokenizer(files["qwen"])
    for case in json.loads((QWEN_TOKENIZER / "expected.json").read_text()):
        assert ours_tok.encode(case["text"]) == case["ids"], case["text"]
        assert ours_tok.decode(case["ids"]) == theirs.decode(case["ids"])
    chat = [{"role": "user", "content": "Name three primes."}]
    assert ours_tok.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert ours_tok.eos_token_ids == (151645,)
    assert ours_tok.decode([151644, 151667], skip_special_tokens=True) == "<think>"  # user-defined, not special


FAMILIES = {
    "qwen2": dict(model_type="qwen2", tokenizer=QWEN_TOKENIZER, vocab_size=151936),
    "qwen3_moe": dict(model_type="qwen3_moe", tokenizer=QWEN_TOKENIZER, vocab_size=151936, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    # Every matrix Q8_0, experts included: they load packed, `[layers, experts, out, in]`.
    "qwen3_moe_q8_0": dict(model_type="qwen3_moe", tokenizer=QWEN_TOKENIZER, vocab_size=151936, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16,
                           outtype="q8_0", arch=gguf.MODEL_ARCH.QWEN3MOE),
    # The converter writes Llama 3's scaling as per-frequency divisors (rope_freqs).
    "llama3_rope": dict(model_type="llama", tokenizer=STORIES, vocab_size=512, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192), max_position_embeddings=16384),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_match_transformers(family, tmp_path):
    settings = dict(FAMILIES[family])
    model_type, tokenizer = settings.pop("model_type"), settings.pop("tokenizer")
    outtype, arch = settings.pop("outtype", "f32"), settings.pop("arch", None)
    folder = tmp_path / family
    make_checkpoint(folder, tiny_config(model_type, hidden_size=64, intermediate_size=96, **settings))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder)
    path = convert(folder, tmp_path / f"{family}.gguf", outtype)
    model = eqx_models.from_pretrained(path)
    ids = np.asarray([[1, 403, 407, 261, 378, 297, 410, 296]])
    if outtype == "f32":
        np.testing.assert_allclose(ours(model, ids), hf_logits(folder, ids), atol=1e-4, rtol=0)
        return
    experts = model.model.layers.mlp.experts.down_proj.weight
    assert is_quantized(experts) and experts.packed.shape == (3, 4, 64, 32)
    # transformers fuses a layer's experts into one parameter: the stored weights go
    # in through a checkpoint of their own.
    from safetensors.numpy import save_file

    stored = tmp_path / "as_stored"
    shutil.copytree(folder, stored)
    weights = {name: value.astype(np.float32) for name, value in roundtrip_like(path, folder, arch).items()}
    save_file(weights, stored / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_allclose(ours(with_activations(model, "float"), ids), hf_logits(stored, ids), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def q4_0_file(files):
    """Every matrix Q4_0 (as `llama-quantize --pure`), by llama.cpp's reference
    quantizer, and transformers' logits on the weights as the file stores them."""
    path = rewrite(files["qwen_f32"], files["root"] / "qwen3-q4_0.gguf",
                   lambda name, x: quantized(x, Q.Q4_0) if x.ndim == 2 else None)
    ids = np.asarray([[9707, 11, 1879, 0, 3555, 374, 264, 1273]])
    return path, ids, hf_logits(files["qwen"], ids, roundtrip_like(path, files["qwen"], gguf.MODEL_ARCH.QWEN3))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_q4_0_file_loads_packed(q4_0_file, scan_layers):
    """The integers and scales are the file's blocks as they are."""
    path, ids, reference = q4_0_file
    model = eqx_models.from_pretrained(path, scan_layers=scan_layers)
    weights = [w for w in jax.tree.leaves(model, is_leaf=is_quantized) if is_quantized(w)]
    assert len(weights) == 8 and all(w.bits == 4 for w in weights)  # 7 per layer + the tied embedding
    stored = dequantized_file(path)["blk.0.attn_q.weight"]
    q = model.model.layers.self_attn.q_proj.weight
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)[0]), stored)
    np.testing.assert_allclose(ours(with_activations(model, "float"), ids), reference, atol=1e-4, rtol=0)


def test_q4_1_file_loads_packed_as_affine_int4(files):
    """Q4_1 (a scale and an offset per block of 32) is affine int4 in groups of 32:
    the blocks load as they are, the offsets as the biases."""
    path = rewrite(files["qwen_f32"], files["root"] / "qwen3-q4_1.gguf",
                   lambda name, x: quantized(x, Q.Q4_1) if x.ndim == 2 else None)
    ids = np.asarray([[9707, 11, 1879, 0, 3555, 374, 264, 1273]])
    reference = hf_logits(files["qwen"], ids, roundtrip_like(path, files["qwen"], gguf.MODEL_ARCH.QWEN3))
    model = eqx_models.from_pretrained(path)
    weights = [w for w in jax.tree.leaves(model, is_leaf=is_quantized) if is_quantized(w)]
    assert len(weights) == 8 and all(w.mode == "affine" and w.group_size == 32 for w in weights)
    stored = dequantized_file(path)["blk.0.ffn_down.weight"]
    down = model.model.layers.mlp.down_proj.weight
    np.testing.assert_array_equal(np.asarray(down.dequantize(jnp.float32)[0]), stored)
    np.testing.assert_allclose(ours(with_activations(model, "float"), ids), reference, atol=1e-4, rtol=0)


def test_k_quants_are_dequantized(files):
    """Q4_K and Q6_K (random valid blocks: gguf-py has no K-quantizer) load as
    floats equal to llama.cpp's reference dequantization, bfloat16 by default."""
    seeds = iter(range(100))

    def k_quantize(name, x):
        if name.startswith("token_embd") or name.startswith("output.") or ".ffn_down" in name:
            return random_k_blocks(x.shape, Q.Q6_K, next(seeds))
        if ".ffn_" in name and x.ndim == 2:
            return random_k_blocks(x.shape, Q.Q4_K, next(seeds))
        return None

    path = rewrite(files["wide_f32"], files["root"] / "llama256-k.gguf", k_quantize)
    assert eqx_models.from_pretrained(path).dtype == jnp.bfloat16
    model = eqx_models.from_pretrained(path, dtype=jnp.float32)
    stored = dequantized_file(path)
    mlp = model.model.layers.mlp
    np.testing.assert_array_equal(np.asarray(mlp.gate_proj.weight[1]), stored["blk.1.ffn_gate.weight"])
    np.testing.assert_array_equal(np.asarray(mlp.down_proj.weight[0]), stored["blk.0.ffn_down.weight"])
    replace = {
        "model.embed_tokens.weight": stored["token_embd.weight"],
        "lm_head.weight": stored["output.weight"],
        **{f"model.layers.{i}.mlp.{p}_proj.weight": stored[f"blk.{i}.ffn_{p}.weight"]
           for i in range(2) for p in ("gate", "up", "down")},
    }
    ids = np.asarray([[1, 403, 407, 261, 378, 297]])
    np.testing.assert_allclose(ours(model, ids), hf_logits(files["wide"], ids, replace), atol=1e-4, rtol=0)


def test_generate_cli_reads_a_gguf(files, capsys):
    from eqx_models.cli import main

    case = json.loads((files["stories"] / "expected.json").read_text())[1]
    main(["generate", str(files["stories_f32"]), "--prompt", case["prompt"], "--max-new-tokens", "20"])
    printed = capsys.readouterr().out.strip()
    expected = eqx_models.load_tokenizer(files["stories"]).decode(case["prompt_ids"] + case["output_ids"][:20])
    assert len(printed) > 40 and expected.endswith(printed)  # the continuation, as transformers greedy-decodes it


# ------------------------------------------------------------------ bad input


def test_truncated_and_foreign_files_are_clear_errors(files, tmp_path):
    data = files["qwen_f32"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        eqx_models.from_pretrained(truncated)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"\x00" * 4096)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        eqx_models.from_pretrained(foreign)


def test_unknown_architecture_and_quant_type_are_named(files, tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'mamba'.*Hugging Face checkpoint"):
        eqx_models.from_pretrained(tmp_path / "mamba.gguf")
    path = rewrite(files["stories_f32"], tmp_path / "no-embedding.gguf",
                   lambda name, x: False if name == "token_embd.weight" else None)
    with pytest.raises(ConfigError, match="no token_embd.weight"):
        eqx_models.from_pretrained(path)

    def as_q8_1(name, x):  # a type the gguf package cannot dequantize
        if name == "blk.0.attn_v.weight":
            return np.zeros((x.shape[0], x.shape[1] // 32 * 40), np.uint8), Q.Q8_1
        return None

    path = rewrite(files["stories_f32"], tmp_path / "q8_1.gguf", as_q8_1)
    with pytest.raises(CheckpointError, match="blk.0.attn_v.weight is of type Q8_1"):
        eqx_models.from_pretrained(path)


def test_mismatched_tensors_are_listed(files, tmp_path):
    path = rewrite(files["stories_f32"], tmp_path / "odd.gguf",
                   lambda name, x: (x[:, :-1].copy(), Q.F32) if name == "blk.2.ffn_up.weight" else None)
    with pytest.raises(CheckpointError, match=r"blk.2.ffn_up.weight has shape \(172, 63\), expected \(172, 64\)"):
        eqx_models.from_pretrained(path)


def test_a_folder_of_several_gguf_files_asks_which(files, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(files["stories_q8_0"], tmp_path / name)
    with pytest.raises(FileNotFoundError, match="several GGUF files"):
        eqx_models.from_pretrained(tmp_path)
    (tmp_path / "b.gguf").unlink()
    assert is_quantized(eqx_models.from_pretrained(tmp_path).model.embed_tokens.weight)


def test_a_split_gguf_file_loads_from_its_first_part(files, tmp_path):
    """llama.cpp's split files (here its converter's `--split-max-tensors`): the
    first part brings in the others; a later part, or a missing one, is refused
    with what to pass."""
    folder = tmp_path / "split"
    folder.mkdir()
    convert(files["stories"], folder / "stories-q8_0.gguf", "q8_0", "--split-max-tensors", "20")
    parts = sorted(folder.glob("*.gguf"))
    assert len(parts) > 1 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    ids = jnp.asarray([[1, 403, 407, 261, 378]])
    whole = ours(eqx_models.from_pretrained(files["stories_q8_0"]), ids)
    split = eqx_models.from_pretrained(parts[0])
    assert is_quantized(split.model.layers.mlp.up_proj.weight)
    np.testing.assert_array_equal(ours(split, ids), whole)
    np.testing.assert_array_equal(ours(eqx_models.from_pretrained(folder), ids), whole)  # the folder of parts
    with pytest.raises(CheckpointError, match=f"part 2 of {len(parts)} .* pass the first part"):
        eqx_models.from_pretrained(parts[1])
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"{parts[-1].name} is not beside it"):
        eqx_models.from_pretrained(parts[0])


def test_a_gguf_file_of_a_hub_repo_is_fetched_alone(files, tmp_path, monkeypatch):
    """`gguf_file=` names one file of a repo (as in transformers): only it, or every
    part of its split, is asked of the hub."""
    import huggingface_hub

    convert(files["stories"], tmp_path / "stories-f32.gguf", "f32", "--split-max-tensors", "30")
    shutil.copy(files["stories_q8_0"], tmp_path / "stories-q8_0.gguf")
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked.append((repo_id, revision, list(allow_patterns)))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = eqx_models.from_pretrained("someone/stories-GGUF", gguf_file="stories-q8_0.gguf", revision="v1")
    assert is_quantized(model.model.embed_tokens.weight)
    parts = sorted(p.name for p in tmp_path.glob("stories-f32-*.gguf"))
    model = eqx_models.from_pretrained("someone/stories-GGUF", gguf_file=parts[0])
    assert model.dtype == jnp.float32
    assert asked == [("someone/stories-GGUF", "v1", ["stories-q8_0.gguf"]), ("someone/stories-GGUF", None, parts)]
    with pytest.raises(FileNotFoundError, match="has no GGUF file 'stories-q4_0.gguf'; its GGUF files: stories-f32"):
        eqx_models.from_pretrained("someone/stories-GGUF", gguf_file="stories-q4_0.gguf")
