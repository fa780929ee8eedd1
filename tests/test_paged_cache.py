"""The paged cache keeps the cache contract: chunks and decode steps equal one full pass."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import ARCHITECTURES, small_model

from eqx_models.paged_cache import PagedKVCache

PAGE_SIZE = 4


def paged_cache(model, tables: np.ndarray, num_pages: int, dtype=jnp.float32) -> PagedKVCache:
    config = model.config
    keys, values, key_scales, value_scales = PagedKVCache.empty_pool(
        config.num_hidden_layers, num_pages, config.num_key_value_heads, PAGE_SIZE, config.head_dim, dtype
    )
    return PagedKVCache(keys, values, jnp.asarray(tables, jnp.int32), jnp.zeros(len(tables), jnp.int32),
                        key_scales=key_scales, value_scales=value_scales)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunks_with_right_padding_and_decode_steps_equal_the_full_pass(architecture):
    model = small_model(**ARCHITECTURES[architecture])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (2, 24)).astype(np.int32)
    full, _ = model(ids)
    # Pages scattered over the pool, in a different order for each row.
    tables = rng.permutation(20)[:14].reshape(2, 7).astype(np.int32)
    cache = paged_cache(model, tables, 20)

    first, cache = model(ids[:, :9], cache)
    np.testing.assert_allclose(first, full[:, :9], atol=1e-5, rtol=0)
    # The next chunk is 6 tokens for row 0 and 8 for row 1, right-padded to 8.
    lengths = (6, 8)
    chunk, mask = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32)
    for row, length in enumerate(lengths):
        chunk[row, :length], mask[row, :length] = ids[row, 9 : 9 + length], 1
    second, cache = model(chunk, cache, mask)
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(second[row, :length], full[row, 9 : 9 + length], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.positions, [15, 17])
    # Single-token steps, each row at its own position (the decode kernel's path).
    at = np.array([15, 17])
    for _ in range(3):
        step, cache = model(ids[np.arange(2), at][:, None], cache)
        for row in range(2):
            np.testing.assert_allclose(step[row, 0], full[row, at[row]], atol=1e-5, rtol=0)
        at += 1
    np.testing.assert_array_equal(cache.positions, at)


def test_padding_rows_write_nothing_and_a_row_past_its_pages_is_an_error():
    model = small_model()
    tables = np.array([[3, 1], [0, 0]], np.int32)
    cache = paged_cache(model, tables, 4)
    ids = np.arange(1, 6, dtype=np.int32)[None].repeat(2, axis=0)
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.int32)  # row 1 is an unused row
    _, after = model(ids, cache, mask)
    np.testing.assert_array_equal(after.positions, [5, 0])
    untouched = np.asarray(after.keys)[:, [0, 2]]
    np.testing.assert_array_equal(untouched, 0)  # page 0 belongs to row 1's empty table
    assert np.abs(np.asarray(after.keys)[:, 3]).sum() > 0 and np.abs(np.asarray(after.keys)[:, 1, :, 0]).sum() > 0
    with pytest.raises(Exception, match="PagedKVCache overflow"):
        model(np.ones((2, 4), np.int32), after, np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.int32))


@pytest.mark.parametrize("architecture", ["qwen3", "mistral_window"])
def test_an_int8_pool_gives_what_an_int8_kv_cache_gives(architecture):
    """The same integers and scales per token, kept in pages: prompt chunks, then decode."""
    model = small_model(**ARCHITECTURES[architecture])
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.config.vocab_size, (2, 20)).astype(np.int32)
    tables = rng.permutation(16)[:12].reshape(2, 6).astype(np.int32)
    paged, contiguous = paged_cache(model, tables, 16, "int8"), model.init_cache(2, 24, dtype="int8")
    for start, stop in [(0, 7), (7, 12), *((t, t + 1) for t in range(12, 20))]:
        want, contiguous = model(ids[:, start:stop], contiguous)
        got, paged = model(ids[:, start:stop], paged)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert paged.keys.dtype == jnp.int8 and paged.key_scales.shape == paged.keys.shape[:-1]
    for row in range(2 if contiguous.window is None else 0):  # token t sits in page tables[row, t // PAGE_SIZE]
        pages = paged.keys[:, tables[row]].transpose(0, 2, 1, 3, 4).reshape(*contiguous.keys.shape[:1], -1, 24, 16)
        np.testing.assert_array_equal(pages[:, :, :20], contiguous.keys[:, row, :, :20])
