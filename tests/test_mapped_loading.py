"""Page-aligned checkpoints: `save_pretrained` writes them, `from_pretrained` maps
them instead of reading, and the mapped model is safe to train, save and outlive
its files."""

import gc
import json
import mmap
import shutil
import struct
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import eqx_models
from eqx_models.training import make_train_step

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

# Every matrix of this shape fills whole 4 KiB pages in float32 (64x128x4 = 32 KiB,
# 32x64x4 = 8 KiB); the norms (64x4 bytes) do not, and are read as before.
PAGE_SIZED = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=128)


def file_mappings(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path`."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def mapped_leaves(model, path) -> dict[str, bool]:
    """For each array leaf, whether its buffer lies in a mapping of `path`."""
    ranges = file_mappings(path)
    out = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]:
        start = leaf.unsafe_buffer_pointer()
        out[jax.tree_util.keystr(key)] = any(a <= start and start + leaf.nbytes <= b for a, b in ranges)
    return out


def logits(model, ids):
    return np.asarray(model(ids)[0])


@pytest.fixture
def saved(checkpoint_factory, tmp_path):
    """(our page-aligned checkpoint folder, the transformers-written one it came from)."""
    folder, _ = checkpoint_factory("qwen3", **PAGE_SIZED)
    out = tmp_path / "ours"
    eqx_models.save_pretrained(eqx_models.from_pretrained(folder), out)
    return out, folder


def test_saved_tensors_start_on_pages_and_the_file_is_valid_safetensors(saved):
    out, folder = saved
    path = out / "model.safetensors"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__")
    page_sized = {n: e for n, e in header.items() if (e["data_offsets"][1] - e["data_offsets"][0]) % mmap.PAGESIZE == 0}
    assert len(page_sized) >= 7 * 2 + 2  # q k v o gate up down per layer, embedding, lm_head
    assert all((8 + length + e["data_offsets"][0]) % mmap.PAGESIZE == 0 for e in page_sized.values())
    # The reference reader checks the offsets cover the data with no gaps.
    ours, theirs = load_file(path), load_file(folder / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_page_aligned_checkpoints_are_mapped_and_others_read(saved):
    out, folder = saved
    ids = np.random.default_rng(0).integers(0, 128, (2, 9))
    mapped = eqx_models.from_pretrained(out)
    where = mapped_leaves(mapped, (out / "model.safetensors").resolve())
    stacked_matrices = [k for k in where if "proj" in k]
    assert len(stacked_matrices) == 7 and all(where[k] for k in stacked_matrices), where
    assert where[".model.embed_tokens.weight"] and not where[".model.norm.weight"]

    read = eqx_models.from_pretrained(out, map_weights=False)
    assert not any(mapped_leaves(read, (out / "model.safetensors").resolve()).values())
    from_transformers_file = eqx_models.from_pretrained(folder)  # tensors off page boundaries
    assert not any(mapped_leaves(from_transformers_file, (folder / "model.safetensors").resolve()).values())
    np.testing.assert_array_equal(logits(mapped, ids), logits(read, ids))
    np.testing.assert_array_equal(logits(mapped, ids), logits(from_transformers_file, ids))
    # A dtype change needs new buffers: nothing is mapped.
    cast = eqx_models.from_pretrained(out, dtype=jnp.bfloat16)
    assert not any(mapped_leaves(cast, (out / "model.safetensors").resolve()).values())


def test_mapped_weights_outlive_their_files(saved):
    out, _ = saved
    ids = np.random.default_rng(1).integers(0, 128, (1, 7))
    expected = logits(eqx_models.from_pretrained(out, map_weights=False), ids)
    model = eqx_models.from_pretrained(out)
    shutil.rmtree(out)
    gc.collect()
    np.testing.assert_array_equal(logits(model, ids), expected)
    del model
    assert released_within(30, (out / "model.safetensors").resolve())  # unmapped with the model


def released_within(seconds: float, path) -> bool:
    """Whether this process's mappings of `path` go within `seconds`. The CPU
    runtime may release a zero-copy buffer on one of its own threads after the
    array is deleted (once the computations that read it have finished marking
    themselves done), so under load the last mapping can outlive `del` briefly."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if not file_mappings(path):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # lets the runtime's thread take the interpreter lock


def test_training_a_mapped_model_leaves_the_file_as_it_was(saved):
    out, _ = saved
    ids = np.random.default_rng(2).integers(0, 128, (2, 12)).astype(np.int32)
    original = eqx_models.from_pretrained(out, map_weights=False)
    before = logits(original, ids)
    model = eqx_models.from_pretrained(out)
    init, step = make_train_step(optax.sgd(0.5))
    opt_state = init(model)
    for _ in range(3):  # the step donates the model: XLA may write where the weights were
        model, opt_state, _ = step(model, opt_state, {"input_ids": ids, "labels": ids})
    assert np.abs(logits(model, ids) - before).max() > 1e-3
    np.testing.assert_array_equal(logits(eqx_models.from_pretrained(out, map_weights=False), ids), before)


def test_saving_over_the_folder_a_model_was_mapped_from(saved):
    out, _ = saved
    ids = np.random.default_rng(3).integers(0, 128, (1, 8))
    model = eqx_models.from_pretrained(out)
    before = logits(model, ids)
    changed = eqx.tree_at(lambda m: m.model.embed_tokens.weight, model, model.model.embed_tokens.weight * 2)
    eqx_models.save_pretrained(changed, out)
    np.testing.assert_array_equal(logits(model, ids), before)  # still the old file's pages
    np.testing.assert_array_equal(logits(eqx_models.from_pretrained(out), ids), logits(changed, ids))
    assert not list(out.glob("*.partial"))
