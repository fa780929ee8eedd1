"""Checkpoints that are broken, tampered with or half written: nothing is lost,
nothing loads silently wrong. Each refusal names what was wrong (the tensor, the
config field, the value found and what is allowed)."""

import errno
import json
import shutil
import struct

import gguf
import jax
import numpy as np
import pytest
from conftest import make_checkpoint, tiny_config

import eqx_models
from eqx_models import safetensors_file
from eqx_models.config import ConfigError
from eqx_models.safetensors_file import CheckpointError

IDS = np.asarray([[1, 5, 9, 13, 2]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama checkpoint written by transformers, and its logits for `IDS`."""
    folder = tmp_path_factory.mktemp("trust") / "llama"
    make_checkpoint(folder, tiny_config("llama"))
    return folder


def copy_of(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


def logits(folder):
    return np.asarray(eqx_models.from_pretrained(folder)(IDS)[0])


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------ save_pretrained


class DiskFillsUp:
    """A file whose writes fail with ENOSPC once `budget` bytes (shared by every
    file opened through the same budget) are written, as a full disk does."""

    def __init__(self, file, budget: list[int]):
        self.file, self.budget = file, budget

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) > self.budget[0]:
            self.file.write(data[: self.budget[0]])
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.mark.parametrize("old_sharded", [False, True])
@pytest.mark.parametrize("new_sharded", [False, True])
def test_a_save_that_fails_midway_leaves_the_old_checkpoint_whole(llama, tmp_path, monkeypatch, old_sharded, new_sharded):
    model = eqx_models.from_pretrained(llama)
    folder = tmp_path / "saved"
    eqx_models.save_pretrained(model, folder, max_shard_size=20_000 if old_sharded else 10**9)
    before, expected = listing(folder), logits(folder)
    contents = {name: (folder / name).read_bytes() for name in before}

    budget = [sum(len(c) for c in contents.values()) // 2]  # the disk fills up halfway through the new files
    monkeypatch.setattr(safetensors_file, "open", lambda path, mode: DiskFillsUp(open(path, mode), budget),
                        raising=False)
    changed = eqx_models.CausalLM(model.config, key=jax.random.key(1))
    with pytest.raises(OSError, match="No space left"):
        eqx_models.save_pretrained(changed, folder, max_shard_size=12_000 if new_sharded else 10**9)
    monkeypatch.undo()

    assert listing(folder) == before  # nothing new, nothing partial, nothing lost
    assert all((folder / name).read_bytes() == content for name, content in contents.items())
    np.testing.assert_array_equal(logits(folder), expected)


def test_a_save_replaces_the_old_checkpoint_and_removes_its_stale_shards(llama, tmp_path):
    model = eqx_models.from_pretrained(llama)
    folder = tmp_path / "saved"
    eqx_models.save_pretrained(model, folder, max_shard_size=20_000)
    assert "model.safetensors.index.json" in listing(folder)
    eqx_models.save_pretrained(model, folder)  # one file now: the shards and the index go
    assert listing(folder) == ["config.json", "model.safetensors"]
    eqx_models.save_pretrained(model, folder, max_shard_size=20_000)  # and back: the single file goes
    assert "model.safetensors" not in listing(folder)
    assert not [name for name in listing(folder) if name.startswith(".") or name.endswith(".partial")]
    np.testing.assert_array_equal(logits(folder), logits(llama))


# --------------------------------------------------------- safetensors headers


def read_header(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_header(path, header_text: str, body: bytes):
    encoded = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


def edit_header(folder, edit):
    """Rewrites the header of `folder`'s model.safetensors with `edit(header)`
    (which may return a replacement), keeping the tensors' bytes."""
    path = folder / "model.safetensors"
    header, body = read_header(path)
    edited = edit(header)
    write_header(path, json.dumps(header if edited is None else edited), body)


NORM = "model.layers.1.input_layernorm.weight"
OTHER_NORM = "model.layers.1.post_attention_layernorm.weight"


def shift(name, by):
    def edit(header):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + by, end + by]

    return edit


def same_bytes_as(name, other):
    def edit(header):
        header[name]["data_offsets"] = list(header[other]["data_offsets"])

    return edit


def setting(name, field, value):
    def edit(header):
        header[name][field] = value

    return edit


def removing(name, field):
    def edit(header):
        del header[name][field]

    return edit


def last_shifted_back(header):
    """The last tensor's bytes moved 4 earlier, into the tensor before it."""
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    shift(last, -4)(header)


HEADER_CASES = {
    "negative offsets": (lambda h: shift(NORM, -h[NORM]["data_offsets"][0] - 64)(h), f"tensor {NORM}.*data_offsets"),
    "end before begin": (setting(NORM, "data_offsets", [128, 0]), f"tensor {NORM}.*end >= begin"),
    "offsets past the file": (shift(NORM, 10**9), f"truncated or corrupt: tensor {NORM}"),
    "two tensors on the same bytes": (same_bytes_as(OTHER_NORM, NORM), "overlaps the tensor before it"),
    "overlapping ranges": (last_shifted_back, "overlaps the tensor before it"),
    "a header that is a list": (lambda h: [h], "the header is a JSON list"),
    "an entry that is not an object": (lambda h: h.update({NORM: 7}), f"tensor {NORM} has the header entry 7"),
    "an entry without dtype": (removing(NORM, "dtype"), f"tensor {NORM} has the header entry"),
    "an entry without data_offsets": (removing(NORM, "data_offsets"), f"tensor {NORM} has the header entry"),
    "a shape of strings": (setting(NORM, "shape", ["32"]), f"tensor {NORM} has shape \\['32'\\]"),
    "a negative dimension": (setting(NORM, "shape", [-32]), f"tensor {NORM} has shape \\[-32\\]"),
    "an unknown dtype": (setting(NORM, "dtype", "F8_E9"), f"tensor {NORM} has dtype 'F8_E9'"),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_malformed_safetensors_headers_are_refused_naming_the_tensor(llama, tmp_path, case):
    edit, message = HEADER_CASES[case]
    folder = copy_of(llama, tmp_path)
    edit_header(folder, edit)
    with pytest.raises(CheckpointError, match=message):
        eqx_models.from_pretrained(folder)


def test_a_tensor_listed_twice_in_a_header_is_refused(llama, tmp_path):
    folder = copy_of(llama, tmp_path)
    path = folder / "model.safetensors"
    header, body = read_header(path)
    entry = json.dumps(header[NORM])
    text = json.dumps(header)
    write_header(path, text[:-1] + f', "{NORM}": {entry}}}', body)  # the same name again, last
    with pytest.raises(CheckpointError, match=f"names '{NORM}' twice"):
        eqx_models.from_pretrained(folder)


def test_bytes_after_the_last_tensor_are_refused(llama, tmp_path):
    folder = copy_of(llama, tmp_path)
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(CheckpointError, match="its tensors end at data byte .* but the file holds"):
        eqx_models.from_pretrained(folder)


def test_a_float_tensor_relabelled_as_integers_is_refused(llama, tmp_path):
    """A float32 norm whose header says I32 has the same size, so only its dtype
    gives it away; loaded, it became numbers of order 1e9."""
    folder = copy_of(llama, tmp_path)
    edit_header(folder, setting(NORM, "dtype", "I32"))
    with pytest.raises(CheckpointError, match=f"tensor {NORM} has dtype int32, expected a floating-point dtype"):
        eqx_models.from_pretrained(folder)


def test_quantized_integers_must_keep_their_dtype(tmp_path):
    make_checkpoint(tmp_path / "float", tiny_config("llama", intermediate_size=64))  # widths that groups of 32 divide
    folder = tmp_path / "int8"
    eqx_models.save_pretrained(eqx_models.from_pretrained(tmp_path / "float", quantize="int8"), folder)
    expected = logits(folder)
    header, _ = read_header(folder / "model.safetensors")
    packed = next(name for name, entry in header.items() if isinstance(entry, dict) and entry.get("dtype") == "I8")
    edit_header(folder, setting(packed, "dtype", "U8"))
    with pytest.raises(CheckpointError, match=f"tensor {packed} has dtype uint8, expected int8"):
        eqx_models.from_pretrained(folder)
    edit_header(folder, setting(packed, "dtype", "I8"))
    np.testing.assert_array_equal(logits(folder), expected)


def sharded_copy(llama, tmp_path):
    folder = tmp_path / "sharded"
    eqx_models.save_pretrained(eqx_models.from_pretrained(llama), folder, max_shard_size=20_000)
    return folder


def edit_index(folder, edit):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edited = edit(index)
    path.write_text(json.dumps(index if edited is None else edited))


def test_an_index_naming_shards_outside_the_folder_is_refused(llama, tmp_path):
    folder = sharded_copy(llama, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][NORM]
    outside = tmp_path / "elsewhere" / shard
    outside.parent.mkdir()
    shutil.copy(folder / shard, outside)  # a loadable file, so only the path gives it away
    for name in (f"../elsewhere/{shard}", str(outside), f"sub/../../elsewhere/{shard}"):
        weight_map = {k: name if v == shard else v for k, v in index["weight_map"].items()}
        edit_index(folder, lambda i: i.update(weight_map=weight_map))
        with pytest.raises(CheckpointError, match="is not a file inside the model folder"):
            eqx_models.from_pretrained(folder)


@pytest.mark.parametrize("weight_map", [["model-00001-of-00002.safetensors"], {NORM: 3}, "model.safetensors"])
def test_a_malformed_index_is_refused(llama, tmp_path, weight_map):
    folder = sharded_copy(llama, tmp_path)
    edit_index(folder, lambda i: i.update(weight_map=weight_map))
    with pytest.raises(CheckpointError, match="weight_map maps tensor names to shard file names"):
        eqx_models.from_pretrained(folder)


def test_a_tensor_in_two_shards_is_refused(llama, tmp_path):
    folder = sharded_copy(llama, tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shutil.copy(shard, folder / "model-copy.safetensors")
    with pytest.raises(CheckpointError, match="is in both"):
        eqx_models.from_pretrained(folder)


# ---------------------------------------------------------------- config.json


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


CONFIG_CASES = {
    "a size as a string": (dict(hidden_size="32"), "hidden_size is '32' \\(str\\); it must be an integer >= 1"),
    "a size as a float": (dict(num_hidden_layers=3.0), "num_hidden_layers is 3.0 \\(float\\)"),
    "a fractional size": (dict(intermediate_size=47.5), "intermediate_size is 47.5"),
    "a size as a boolean": (dict(vocab_size=True), "vocab_size is True \\(bool\\)"),
    "a negative size": (dict(hidden_size=-32), "hidden_size is -32"),
    "zero layers": (dict(num_hidden_layers=0), "num_hidden_layers is 0"),
    "zero heads": (dict(num_attention_heads=0), "num_attention_heads is 0"),
    "zero key/value heads": (dict(num_key_value_heads=0), "num_key_value_heads is 0"),
    "zero head_dim": (dict(head_dim=0), "head_dim is 0"),
    "zero vocabulary": (dict(vocab_size=0), "vocab_size is 0"),
    "zero context": (dict(max_position_embeddings=0), "max_position_embeddings is 0"),
    "a zero epsilon": (dict(rms_norm_eps=0), "rms_norm_eps is 0 .*a finite number > 0"),
    "a negative epsilon": (dict(rms_norm_eps=-1e-6), "rms_norm_eps is -1e-06"),
    "a zero rope base": (dict(rope_theta=0.0), "rope_theta is 0.0"),
    "a negative rope base": (dict(rope_theta=-10000.0), "rope_theta is -10000.0"),
    "a string for a boolean": (dict(tie_word_embeddings="false"), "tie_word_embeddings is 'false' .*true or false"),
    "a number for a boolean": (dict(attention_bias=0), "attention_bias is 0 \\(int\\)"),
    "linear rope without factor": (dict(rope_scaling={"rope_type": "linear"}), "rope type 'linear' but no factor"),
    "llama3 rope without its bounds": (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}),
        "rope type 'llama3' but no low_freq_factor, high_freq_factor",
    ),
    "a negative rope factor": (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}), "rope_scaling.factor is -2.0"),
    "heads not a multiple of key/value heads": (
        dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"
    ),
    "a rope type the zoo does not compute": (
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not supported"
    ),
    "an unsupported rope type without its factor": (
        dict(rope_scaling={"rope_type": "dynamic"}), "rope type 'dynamic' is not supported"
    ),
    "an eos id as a string": (dict(eos_token_id="2"), "eos_token_id is '2'"),
    "layer_types of the wrong length": (dict(layer_types=["full_attention"]), "layer_types lists 1 layers"),
    "a zero window pattern with a sliding window": (
        dict(sliding_window=4, sliding_window_pattern=0), "sliding_window_pattern is 0 .*>= 1 with a sliding_window"
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_values_of_the_wrong_type_or_range_are_refused(llama, tmp_path, case):
    changes, message = CONFIG_CASES[case]
    folder = copy_of(llama, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=message):
        eqx_models.from_pretrained(folder)


def test_a_zero_window_pattern_without_a_window_passes():
    """What transformers writes for EXAONE 4 without a sliding window (its
    `sliding_window_pattern` becomes 0): no layer slides, nothing to refuse."""
    from eqx_models.config import validate_hf_config

    validate_hf_config({"model_type": "exaone4", "sliding_window": None, "sliding_window_pattern": 0})


def test_more_layers_than_the_checkpoint_has_tensors_is_refused_before_building_them(llama, tmp_path):
    """10^7 layers were built until the machine ran out of memory: a checkpoint
    holds at least one tensor per layer, so the count is refused first."""
    folder = copy_of(llama, tmp_path)
    edit_config(folder, num_hidden_layers=10**7)
    with pytest.raises(ConfigError, match="num_hidden_layers is 10000000, but the checkpoint .* holds only 30 tensors"):
        eqx_models.from_pretrained(folder)


def test_a_config_that_is_not_an_object_is_refused(llama, tmp_path):
    folder = copy_of(llama, tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json holds a JSON list, not an object"):
        eqx_models.from_pretrained(folder)


def test_the_configs_transformers_writes_pass_validation():
    """Every family's default config as transformers writes it (null fields,
    optional parts at 0) is valid (the published configs:
    tests/test_published_configs.py)."""
    from transformers import AutoConfig

    from eqx_models.config import validate_hf_config

    for model_type in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text",
                       "phi3", "granite", "olmo2", "cohere2", "deepseek_v3", "smollm3", "gpt_oss", "qwen3_next"):
        validate_hf_config(json.loads(AutoConfig.for_model(model_type).to_json_string()))


def read_config(hf):
    from eqx_models.models import architecture_for

    return architecture_for(hf).config_from_hf(hf)


def without_original_length(folder):
    """Takes `original_max_position_embeddings` out of the rope settings
    transformers wrote (it writes the one it fell back to)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key):
            config[key].pop("original_max_position_embeddings", None)
    path.write_text(json.dumps(config))
    return config


def test_yarn_without_its_original_length_loads_and_matches_transformers(tmp_path):
    """transformers reads YaRN's missing original_max_position_embeddings as
    max_position_embeddings; the config was refused, and the rope tables had no
    length to read."""
    from conftest import torch_logits

    folder = tmp_path / "yarn"
    reference = make_checkpoint(folder, tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    written = without_original_length(folder)
    assert "original_max_position_embeddings" not in (written.get("rope_parameters") or written["rope_scaling"])
    ids = np.random.default_rng(1).integers(0, 97, (1, 12))
    model = eqx_models.from_pretrained(folder)
    assert model.config.rope_scaling_dict["original_max_position_embeddings"] == 256
    np.testing.assert_allclose(np.asarray(model(ids)[0]), torch_logits(reference, ids), atol=1e-4, rtol=0)


LLAMA_DICT = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {"type": "yarn", "factor": 4.0},
])
def test_rope_scalings_without_their_original_length_read_max_position_embeddings(scaling):
    config = read_config(dict(LLAMA_DICT, rope_scaling=scaling))
    assert config.rope_scaling_dict["original_max_position_embeddings"] == 256


def test_phi3_longrope_under_its_old_yarn_name_loads():
    """transformers reads Phi-3's `"type": "yarn"` (an early name) as longrope,
    which needs no factor: validation refused it for yarn's keys."""
    from transformers import AutoConfig

    hf = dict(LLAMA_DICT, model_type="phi3", original_max_position_embeddings=64,
              rope_scaling={"type": "yarn", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 3.0, 4.0, 5.0]})
    config = read_config(hf)
    assert config.rope_scaling_dict["rope_type"] == "longrope" and config.rope_scaling_dict["factor"] == 4.0
    fields = {k: v for k, v in json.loads(json.dumps(hf)).items() if k != "model_type"}
    assert AutoConfig.for_model("phi3", **fields).rope_parameters["rope_type"] == "longrope"


GEMMA3_NESTED = dict(
    LLAMA_DICT, model_type="gemma3_text", head_dim=8, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
)
NESTED_ROPE_CASES = {
    "a zero global base": (
        {"full_attention": {"rope_type": "default", "rope_theta": 0.0}},
        "rope_parameters.full_attention.rope_theta is 0.0 .*a finite number > 0",
    ),
    "a negative local base": (
        {"sliding_attention": {"rope_type": "default", "rope_theta": -1.0}},
        "rope_parameters.sliding_attention.rope_theta is -1.0",
    ),
    "a linear global scaling without factor": (
        {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0}}, "rope type 'linear' but no factor",
    ),
    "a negative factor": (
        {"full_attention": {"rope_type": "linear", "factor": -8.0, "rope_theta": 1000000.0}},
        "rope_parameters.full_attention.factor is -8.0",
    ),
    "a set that is not an object": ({"full_attention": "default"}, "rope_parameters.full_attention is 'default'"),
}


@pytest.mark.parametrize("case", NESTED_ROPE_CASES)
def test_per_layer_type_rope_parameters_are_checked_like_flat_ones(case):
    """Gemma 3's rope_parameters as transformers 5 writes them, one set per layer
    type: a base of 0 gave NaN tables and a missing factor a KeyError when run."""
    changes, message = NESTED_ROPE_CASES[case]
    hf = dict(GEMMA3_NESTED, rope_parameters={**GEMMA3_NESTED["rope_parameters"], **changes})
    with pytest.raises(ConfigError, match=message):
        read_config(hf)


def test_per_layer_type_rope_parameters_are_refused_where_the_family_reads_one_set():
    hf = dict(LLAMA_DICT, rope_parameters=GEMMA3_NESTED["rope_parameters"])
    with pytest.raises(ConfigError, match="rope_parameters holds one set per layer type .* model_type 'llama' does "
                                          "not read"):
        read_config(hf)


# ----------------------------------------------------------------------- GGUF


LAYER_TENSORS = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tiny_gguf(path, *, layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=40, metadata=None):
    """A small llama GGUF file written with the gguf package; `metadata` replaces
    values: `{key: (add method, value)}`."""
    writer = gguf.GGUFWriter(path, "llama")
    values = {
        "llama.embedding_length": ("add_uint32", hidden),
        "llama.attention.head_count": ("add_uint32", heads),
        "llama.attention.head_count_kv": ("add_uint32", kv_heads),
        "llama.block_count": ("add_uint32", layers),
        "llama.context_length": ("add_uint32", 128),
        "llama.feed_forward_length": ("add_uint32", ffn),
        "llama.attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
        "llama.rope.freq_base": ("add_float32", 10000.0),
        "tokenizer.ggml.tokens": ("add_array", [f"t{i}" for i in range(vocab)]),
        **(metadata or {}),
    }
    for key, (method, value) in values.items():
        getattr(writer, method)(key, value)
    rng = np.random.default_rng(0)
    floats = lambda *shape: rng.normal(size=shape).astype(np.float32)
    head_dim = hidden // heads
    shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (hidden, hidden),
              "attn_k": (kv_heads * head_dim, hidden), "attn_v": (kv_heads * head_dim, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    writer.add_tensor("token_embd.weight", floats(vocab, hidden))
    writer.add_tensor("output_norm.weight", floats(hidden))
    writer.add_tensor("output.weight", floats(vocab, hidden))
    for i in range(layers):
        for name in LAYER_TENSORS:
            writer.add_tensor(f"blk.{i}.{name}.weight", floats(*shapes[name]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_entry_positions(path, name):
    """Where in the file tensor `name`'s entry keeps its type and its data offset."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    type_at = tensor.field.offset + 8 + len(name.encode()) + 4 + 8 * len(tensor.shape)
    return type_at, type_at + 4


def patch(path, at, form, value):
    data = bytearray(path.read_bytes())
    struct.pack_into(form, data, at, value)
    path.write_bytes(bytes(data))


def data_offset(path, name):
    return struct.unpack_from("<Q", path.read_bytes(), tensor_entry_positions(path, name)[1])[0]


@pytest.fixture
def gguf_file(tmp_path):
    path = tiny_gguf(tmp_path / "tiny.gguf")
    assert eqx_models.from_pretrained(path)(IDS)[0].shape == (1, 5, 40)  # the untouched file loads
    return path


Q_NAME, K_NAME = "blk.1.attn_q.weight", "blk.1.attn_k.weight"


def test_gguf_tensors_on_the_same_bytes_are_refused(gguf_file):
    patch(gguf_file, tensor_entry_positions(gguf_file, K_NAME)[1], "<Q", data_offset(gguf_file, Q_NAME))
    with pytest.raises(CheckpointError, match=f"tensor {K_NAME} starts at data offset .*they overlap"):
        eqx_models.from_pretrained(gguf_file)


def test_an_unaligned_gguf_tensor_is_refused(gguf_file):
    patch(gguf_file, tensor_entry_positions(gguf_file, K_NAME)[1], "<Q", data_offset(gguf_file, K_NAME) + 4)
    with pytest.raises(CheckpointError, match=f"tensor {K_NAME} starts at data offset .*not a multiple of the file's "
                                              "alignment of 32"):
        eqx_models.from_pretrained(gguf_file)


def test_a_gguf_tensor_listed_twice_is_refused(gguf_file):
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data.replace(K_NAME.encode(), Q_NAME.encode(), 1))  # names of the same length
    with pytest.raises(CheckpointError, match=f"tensor {Q_NAME} is listed twice"):
        eqx_models.from_pretrained(gguf_file)


def test_a_relabelled_gguf_tensor_type_is_refused(gguf_file, tmp_path):
    f16 = gguf.GGMLQuantizationType.F16
    patch(gguf_file, tensor_entry_positions(gguf_file, Q_NAME)[0], "<I", f16)  # half its size: the next one is off
    with pytest.raises(CheckpointError, match=f"tensor {K_NAME} starts at data offset .*gap after tensor {Q_NAME}"):
        eqx_models.from_pretrained(gguf_file)

    last = tiny_gguf(tmp_path / "last.gguf")  # the last tensor: the bytes left over give it away
    patch(last, tensor_entry_positions(last, "blk.1.ffn_down.weight")[0], "<I", f16)
    with pytest.raises(CheckpointError, match="bytes follow the last tensor's data"):
        eqx_models.from_pretrained(last)

    blocks = tiny_gguf(tmp_path / "blocks.gguf", hidden=48, heads=4, kv_heads=2)  # rows of 48: not Q8_0 blocks of 32
    patch(blocks, tensor_entry_positions(blocks, "output_norm.weight")[0], "<I", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(CheckpointError, match="tensor output_norm.weight of type Q8_0 has rows of 48 elements"):
        eqx_models.from_pretrained(blocks)

    integers = tiny_gguf(tmp_path / "integers.gguf")  # same size: only the load can tell
    patch(integers, tensor_entry_positions(integers, "output_norm.weight")[0], "<I", gguf.GGMLQuantizationType.I32)
    with pytest.raises(CheckpointError, match="tensor output_norm.weight is of integer type I32"):
        eqx_models.from_pretrained(integers)


@pytest.mark.parametrize("count", ["tensor", "metadata", "array"])
def test_absurd_gguf_counts_are_refused_before_anything_is_built(gguf_file, count):
    at = {"tensor": 8, "metadata": 16}.get(count)
    if count == "array":  # the token list's length, after its key and the element type
        key = b"tokenizer.ggml.tokens"
        at = gguf_file.read_bytes().index(key) + len(key) + 4 + 4
    patch(gguf_file, at, "<Q", 2**64 - 1)
    with pytest.raises(CheckpointError, match="claims 18,446,744,073,709,551,615 entries"):
        eqx_models.from_pretrained(gguf_file)


@pytest.mark.parametrize("blocks", [1000, 2**32 - 1])
def test_a_gguf_block_count_beyond_its_tensors_is_refused(tmp_path, blocks):
    path = tiny_gguf(tmp_path / "blocks.gguf", metadata={"llama.block_count": ("add_uint32", blocks)})
    with pytest.raises(ConfigError, match=f"num_hidden_layers is {blocks}, but .* holds only 21 tensors"):
        eqx_models.from_pretrained(path)


GGUF_METADATA_CASES = {
    "zero heads": ({"llama.attention.head_count": ("add_uint32", 0)}, "llama.attention.head_count is 0"),
    "a width as a string": ({"llama.embedding_length": ("add_string", "32")}, "llama.embedding_length is '32'"),
    "a width as a float": ({"llama.embedding_length": ("add_float32", 32.0)}, "llama.embedding_length is 32.0"),
    "a zero epsilon": ({"llama.attention.layer_norm_rms_epsilon": ("add_float32", 0.0)},
                       "layer_norm_rms_epsilon is 0.0; it must be a finite number > 0"),
    "a negative rope base": ({"llama.rope.freq_base": ("add_float32", -1.0)}, "llama.rope.freq_base is -1.0"),
    "heads not a multiple of key/value heads": ({"llama.attention.head_count_kv": ("add_uint32", 3)},
                                                "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "a negative linear factor": (
        {"llama.rope.scaling.type": ("add_string", "linear"), "llama.rope.scaling.factor": ("add_float32", -2.0)},
        "llama.rope.scaling.factor is -2.0",
    ),
    "yarn without its factor": (
        {"llama.rope.scaling.type": ("add_string", "yarn"), "llama.rope.scaling.factor": ("add_float32", 0.0),
         "llama.rope.scaling.original_context_length": ("add_uint32", 64)},
        "yarn rope scaling without llama.rope.scaling.factor",
    ),
}


@pytest.mark.parametrize("case", GGUF_METADATA_CASES)
def test_gguf_hyperparameters_of_the_wrong_type_or_range_are_refused(tmp_path, case):
    metadata, message = GGUF_METADATA_CASES[case]
    path = tiny_gguf(tmp_path / "bad.gguf", metadata=metadata)
    with pytest.raises(ConfigError, match=message):
        eqx_models.from_pretrained(path)


@pytest.mark.parametrize("kind", ["none", "linear"])
def test_a_gguf_rope_factor_of_zero_means_no_scaling(tmp_path, kind):
    """llama.cpp reads rope.scaling.factor 0.0 as no scaling (converters write it
    with type none); it was refused as a factor that must be > 0."""
    plain = eqx_models.from_pretrained(tiny_gguf(tmp_path / "plain.gguf"))
    path = tiny_gguf(tmp_path / "zero.gguf", metadata={
        "llama.rope.scaling.type": ("add_string", kind), "llama.rope.scaling.factor": ("add_float32", 0.0)})
    model = eqx_models.from_pretrained(path)
    assert model.config.rope_scaling is None
    np.testing.assert_array_equal(np.asarray(model(IDS)[0]), np.asarray(plain(IDS)[0]))
