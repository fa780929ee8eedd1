"""Weights and caches that would not fit an accelerator's free memory are refused
before anything is allocated, with the bytes and what would fit. The CPU reports
no device memory, so these tests give the CPU device an accelerator's report."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_models
from eqx_models import device_memory, generation
from eqx_models.device_memory import OutOfDeviceMemory

LIMIT = 16 << 30


def array_bytes(tree) -> int:
    """The bytes of the arrays in `tree` (a model or a cache)."""
    return sum(a.nbytes for a in jax.tree.leaves(tree) if isinstance(a, jax.Array))


@pytest.fixture
def reported_memory(monkeypatch):
    """`set(free)`: from now on the devices report `free` bytes free of 16 GiB."""

    def set_free(free: int):
        stats = {"bytes_limit": LIMIT, "bytes_in_use": LIMIT - free}
        monkeypatch.setattr(device_memory, "memory_stats", lambda device: stats)

    return set_free


@pytest.fixture
def checkpoint(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3", num_key_value_heads=2)
    return folder


def test_the_cpu_reports_no_device_memory_and_nothing_is_checked():
    assert device_memory.free_bytes(jax.devices()) is None


def test_weights_beyond_the_free_memory_are_refused_with_what_would_fit(checkpoint, reported_memory):
    model = eqx_models.from_pretrained(checkpoint)  # the CPU: no check
    weight_bytes = array_bytes(model)
    reported_memory(weight_bytes // 3)
    with pytest.raises(OutOfDeviceMemory) as refused:
        eqx_models.from_pretrained(checkpoint)
    message = str(refused.value)
    assert f"needs {device_memory.gib(weight_bytes)} ({weight_bytes:,} bytes)" in message
    assert f"({weight_bytes // 3:,} bytes) free of 16.00 GiB" in message
    assert "quantize='int8'" in message and "dtype=jnp.bfloat16" in message and "mesh=" in message
    assert "Nothing was allocated" in message
    # bfloat16 weights take half the bytes: they fit in 0.6 of float32's.
    reported_memory(int(weight_bytes * 0.6))
    half = eqx_models.from_pretrained(checkpoint, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16


def test_a_cache_beyond_the_free_memory_is_refused_naming_the_batch_and_length_that_fit(checkpoint, reported_memory):
    model = eqx_models.from_pretrained(checkpoint)
    needed = model.cache_bytes(8, 256)
    cache = model.init_cache(8, 256)
    assert needed == array_bytes(cache)  # the count is the cache's real size
    free = needed * 3 // 8 + 100
    reported_memory(free)
    with pytest.raises(OutOfDeviceMemory) as refused:
        model.init_cache(8, 256)
    message = str(refused.value)
    assert f"({needed:,} bytes)" in message and f"({free:,} bytes) free" in message
    assert "batch 8 x 256 slots (float32)" in message and "cache_dtype='int8'" in message
    batch = int(re.search(r"batch (\d+) at 256 slots", message).group(1))
    slots = int(re.search(r"(\d+) slots at batch 8", message).group(1))
    # Each is the largest that fits.
    assert model.cache_bytes(batch, 256) <= free < model.cache_bytes(batch + 1, 256)
    assert model.cache_bytes(8, slots) <= free < model.cache_bytes(8, slots + 1)
    model.init_cache(batch, 256)
    model.init_cache(8, slots)


def test_generate_refuses_a_batch_whose_cache_does_not_fit_before_compiling(checkpoint, reported_memory):
    model = eqx_models.from_pretrained(checkpoint)
    ids = np.ones((4, 10), np.int32)
    # generate's cache: the prompt padded to its bucket (16) plus max_new_tokens (20), to a power of two.
    needed = model.cache_bytes(4, 64)
    reported_memory(needed - 1)
    before = dict(generation.trace_counts())
    with pytest.raises(OutOfDeviceMemory, match="generate's: the prompt padded to"):
        eqx_models.generate(model, ids, max_new_tokens=20)
    assert dict(generation.trace_counts()) == before  # nothing compiled, nothing allocated
    reported_memory(needed)
    assert eqx_models.generate(model, ids, max_new_tokens=20, eos_token_id=[]).shape == (4, 20)


def test_a_long_prompts_cache_is_its_bucket_plus_room_for_the_new_tokens(checkpoint_factory, reported_memory):
    # 3,968 tokens pad to a bucket of 4,096; 128 more slots hold the new tokens, where
    # the whole rounded up to a power of two would be 8,192 slots (twice the memory).
    folder, _ = checkpoint_factory("qwen3", num_key_value_heads=2, max_position_embeddings=8192)
    model = eqx_models.from_pretrained(folder)
    ids = np.ones((1, 3968), np.int32)
    needed = model.cache_bytes(1, 4224)
    reported_memory(needed - 1)
    with pytest.raises(OutOfDeviceMemory, match=f"4224 slots.*needs .*{needed:,} bytes"):
        eqx_models.generate(model, ids, max_new_tokens=100)
    reported_memory(needed)
    assert eqx_models.generate(model, ids, max_new_tokens=1, eos_token_id=[]).shape == (1, 1)


def test_xlas_out_of_memory_in_generate_becomes_an_error_with_the_sizes(checkpoint, monkeypatch):
    model = eqx_models.from_pretrained(checkpoint)

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")

    monkeypatch.setattr(generation, "_prefill", exhausted)
    with pytest.raises(OutOfDeviceMemory, match="batch 2 with a cache of 64 slots") as refused:
        eqx_models.generate(model, np.ones((2, 10), np.int32), max_new_tokens=20)
    assert "quantize='int8'" in str(refused.value) and "RESOURCE_EXHAUSTED" in str(refused.value)
    # Any other runtime error passes through as it is.
    monkeypatch.setattr(generation, "_prefill", lambda *a, **k: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("INTERNAL: something else")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        eqx_models.generate(model, np.ones((2, 10), np.int32), max_new_tokens=20)


def test_the_serving_engines_page_pool_is_refused_with_the_pages_that_fit(reported_memory):
    from conftest import STORIES, require_fixture

    from eqx_models.serving import Engine

    path = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)
    pool = Engine(model, tokenizer, max_num_seqs=2, page_size=4, num_pages=64).pools
    pool_bytes = array_bytes(pool)
    reported_memory(pool_bytes // 2)
    with pytest.raises(OutOfDeviceMemory, match="64 pages of 4 tokens") as refused:
        Engine(model, tokenizer, max_num_seqs=2, page_size=4, num_pages=64)
    fitting = int(re.search(r"num_pages=(\d+)", str(refused.value)).group(1))
    assert fitting == 32 and "kv_cache_dtype='int8'" in str(refused.value)
    assert Engine(model, tokenizer, max_num_seqs=2, page_size=4, num_pages=fitting).allocator.num_pages == fitting


def test_a_gguf_file_beyond_the_free_memory_is_refused_before_its_weights_go_to_the_device(reported_memory, tmp_path):
    from conftest import STORIES, require_fixture
    from gguf_tools import convert

    path = convert(require_fixture(STORIES), tmp_path / "stories-f32.gguf")
    model = eqx_models.from_pretrained(path)  # the CPU: no check
    weight_bytes = array_bytes(model)
    reported_memory(weight_bytes // 2)
    with pytest.raises(OutOfDeviceMemory) as refused:
        eqx_models.from_pretrained(path)
    message = str(refused.value)
    assert f"needs {device_memory.gib(weight_bytes)} ({weight_bytes:,} bytes)" in message and "(float32)" in message
    assert "Q8_0" in message and "dtype=jnp.bfloat16" in message
    reported_memory(weight_bytes)
    assert eqx_models.from_pretrained(path).dtype == jnp.float32


def test_the_engines_pool_fills_its_share_of_the_memory_after_the_weights_and_a_steps_temporaries(reported_memory):
    from conftest import STORIES, require_fixture

    from eqx_models.serving import Engine

    path = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)
    options = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=16)
    page_bytes = array_bytes(Engine(model, tokenizer, num_pages=1, **options).pools)
    pages_per_seq = model.config.max_position_embeddings // 16
    # 16 GiB, of which 15.5 GiB are held already: a 0.99 share leaves about 0.34 GiB
    # less the step's temporaries.
    reported_memory(LIMIT // 32)
    engine = Engine(model, tokenizer, memory_utilization=0.99, **options)
    share = int(0.99 * LIMIT) - (LIMIT - LIMIT // 32)
    assert pages_per_seq <= engine.allocator.num_pages < share // page_bytes
    assert engine.allocator.num_pages > 0.9 * share // page_bytes  # a small model's step takes little of it
    # Where the share holds less than one max_model_len sequence: refused with the numbers.
    reported_memory(LIMIT // 8)
    with pytest.raises(OutOfDeviceMemory, match=r"holds 0 pages of 16 tokens: less than one sequence of "
                                                r"max_model_len=\d+ tokens .* It needs memory_utilization >= 0\.8\d"):
        Engine(model, tokenizer, memory_utilization=0.5, **options)
    with pytest.raises(ValueError, match="not several"):
        Engine(model, tokenizer, memory_utilization=0.5, num_pages=8, **options)


def test_memory_utilization_on_a_device_that_reports_no_memory_is_refused_with_the_fix():
    from conftest import STORIES, require_fixture

    from eqx_models.serving import Engine

    path = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)
    with pytest.raises(ValueError, match="report none: give kv_cache_memory"):
        Engine(model, tokenizer, memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"in \(0, 1\]; got 1.5"):
        Engine(model, tokenizer, memory_utilization=1.5)


def test_the_memory_probe_compiles_the_largest_call_the_scheduler_can_make():
    """By chunk length: a bucket's chunks are longer than half of it and share the
    step's budget, so at 32 sequences and 512 tokens no call holds more than 1,024
    (not 32 x 512)."""
    from conftest import STORIES, require_fixture

    from eqx_models.serving import Engine

    path = require_fixture(STORIES)
    model, tokenizer = eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)
    engine = Engine(model, tokenizer, max_num_seqs=32, max_num_batched_tokens=512, page_size=16, num_pages=8,
                    ragged_steps=False)
    rows, length = engine._largest_chunk_call()
    assert rows * length == 1024 and rows <= 32 and length <= 512
