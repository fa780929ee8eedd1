"""Qwen3-Next beyond the zoo's one-block config: two blocks of the layer pattern,
the checkpoint's layer numbering, the recurrent state through the cache, and the
convolution's history under left padding.

The zoo (`test_zoo.py`) compares one block with `transformers` in float32. With two
blocks transformers' own float32 logits sit ~1e-4 from its float64 ones on random
weights (see `zoo.py`), so the checks here that span blocks compare exact tensors
or our own paths with each other.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_models
from conftest import make_checkpoint, tiny_config
from eqx_models.checkpoint import hf_tensor_names, leaf_name
from eqx_models.models import architecture_for
from eqx_models.models.qwen3_next import causal_conv
from zoo import tiny_overrides

TWO_BLOCKS = dict(tiny_overrides("qwen3_next"), num_hidden_layers=6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next_two_blocks")
    reference = make_checkpoint(folder, tiny_config("qwen3_next", **TWO_BLOCKS))
    return folder, reference, eqx_models.from_pretrained(folder)


def _our_tensors(model) -> dict[str, np.ndarray]:
    """Every leaf of `model` split into the checkpoint's tensors, by HF name."""
    arch = architecture_for({"model_type": model.config.model_type})
    substacks = model.model.substack_layers()
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array)):
        names, stacked = hf_tensor_names(leaf_name(path), leaf.shape, arch.tensor_name, substacks)
        parts = np.asarray(leaf).reshape(len(names), *leaf.shape[len(stacked):])
        out.update(zip(names, parts))
    return out


def test_every_checkpoint_tensor_lands_in_its_layer_of_its_block(checkpoint):
    from safetensors.numpy import load_file

    folder, _, model = checkpoint
    expected = {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}
    ours = _our_tensors(model)
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)


def test_save_pretrained_writes_the_checkpoint_transformers_reads(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    _, reference, model = checkpoint
    eqx_models.save_pretrained(model, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(reloaded[name], tensor, rtol=0, atol=0, msg=name)


def test_two_blocks_scanned_equal_unrolled_through_the_cache(checkpoint):
    _, _, model = checkpoint
    ids = np.random.default_rng(0).integers(0, 97, (2, 12))

    @eqx.filter_jit
    def prefill_and_steps(m):
        logits, cache = m(ids, cache=m.init_cache(2, 16))
        outs = [logits]
        for t in range(2):
            step, cache = m(ids[:, t : t + 1], cache=cache)
            outs.append(step)
        return outs, cache.state

    (scanned, scanned_state), (unrolled, unrolled_state) = (
        prefill_and_steps(model), prefill_and_steps(model.with_scan_layers(False))
    )
    for a, b in zip(scanned + jax.tree.leaves(scanned_state), unrolled + jax.tree.leaves(unrolled_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_decoding_from_the_state_equals_the_full_forward(checkpoint):
    _, _, model = checkpoint
    ids = np.random.default_rng(1).integers(0, 97, (2, 20))
    full = np.asarray(model(ids)[0])
    logits, cache = model.prefill(ids[:, :7], max_length=24)
    pieces = [np.asarray(logits)]
    step = eqx.filter_jit(lambda m, x, c: m(x, cache=c))
    for t in range(7, 20):
        logits, cache = step(model, ids[:, t : t + 1], cache)
        pieces.append(np.asarray(logits))
    # Incremental and whole-sequence float32 sums round differently, and this model
    # magnifies that (see the module docstring): held to the parity bar.
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)


def test_a_left_padded_chunk_continues_each_row_as_if_alone(checkpoint):
    # Row 1's second chunk is left-padded: its convolution must read the inputs of
    # its first chunk, not the padding, and the padding must not touch its state.
    _, _, model = checkpoint
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, 97, (2, 6)), rng.integers(0, 97, (2, 5))
    mask = np.ones((2, 5), np.int32)
    mask[1, :3] = 0
    _, cache = model.prefill(first, max_length=16)
    logits, cache = model(second, cache=cache, attention_mask=mask)
    for row, start in ((0, 0), (1, 3)):
        alone = np.asarray(model(np.concatenate([first[row], second[row, start:]])[None])[0])[0, 6:]
        np.testing.assert_allclose(np.asarray(logits)[row, start:], alone, atol=1e-4, rtol=0)
    assert np.asarray(cache.positions).tolist() == [11, 8]


def test_causal_conv_with_history_and_left_padding_equals_the_plain_convolution():
    rng = np.random.default_rng(3)
    channels, taps = 5, 4
    weight = rng.standard_normal((channels, 1, taps)).astype(np.float32)
    history = rng.standard_normal((2, channels, taps - 1)).astype(np.float32)
    x = rng.standard_normal((2, 6, channels)).astype(np.float32)
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int32)
    out, new_history = causal_conv(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(history), jnp.asarray(mask))
    for row, pad in ((0, 0), (1, 2)):
        inputs = np.concatenate([history[row].T, x[row, pad:]])  # [time, channels]
        expected = np.stack([
            sum(weight[:, 0, j] * inputs[t + j] for j in range(taps)) for t in range(len(inputs) - taps + 1)
        ])
        np.testing.assert_allclose(np.asarray(out)[row, pad:], expected, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(new_history)[row], inputs[-(taps - 1):].T)


def test_layer_patterns_other_than_the_released_one_are_refused():
    from eqx_models.config import ConfigError

    hf = tiny_config("qwen3_next", **TWO_BLOCKS).to_dict()
    hf["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                         "linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="layer_types"):
        architecture_for(hf).config_from_hf(hf)


def test_the_engines_memory_budget_holds_the_recurrent_state_pool(checkpoint):
    from conftest import STORIES, require_fixture
    from eqx_models.serving import Engine

    model = checkpoint[2]
    tokenizer = eqx_models.load_tokenizer(require_fixture(STORIES))
    state = model.config.recurrent_state(4 + 1, model.dtype)  # 4 sequences and the scratch slot
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    layout = model.config.cache_layout()
    page_bytes = model.config.num_blocks * layout.kv_heads * 4 * (layout.key_dim + layout.value_dim) * 4
    budget = state_bytes + 3 * page_bytes + page_bytes // 2
    engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, kv_cache_memory=budget)
    assert engine.allocator.num_pages == 3
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.pools))
    assert held == state_bytes + 3 * page_bytes <= budget
    with pytest.raises(ValueError, match="holds no page .* after the recurrent state of 4 \\+ 1 sequences"):
        Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, kv_cache_memory=state_bytes)


def test_the_engine_steps_a_recurrent_state_by_chunk_length_where_the_backend_prefers_ragged_steps(
        checkpoint, monkeypatch):
    from conftest import STORIES, require_fixture
    from eqx_models.backends import active_backend
    from eqx_models.serving import Engine

    model, tokenizer = checkpoint[2], eqx_models.load_tokenizer(require_fixture(STORIES))
    monkeypatch.setattr(type(active_backend()), "prefers_ragged_steps", lambda self: True)  # as on an accelerator
    options = dict(max_num_seqs=2, max_num_batched_tokens=8, page_size=4, num_pages=16)
    assert not Engine(model, tokenizer, **options)._ragged
    with pytest.raises(ValueError, match="recurrent state .* steps by chunk length"):
        Engine(model, tokenizer, ragged_steps=True, **options)
