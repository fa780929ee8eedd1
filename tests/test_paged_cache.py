"""The paged cache keeps the cache contract: chunks and decode steps equal one full pass."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import ARCHITECTURES, small_model

from eqx_models.paged_cache import PagedKVCache

PAGE_SIZE = 4


def paged_cache(model, tables: np.ndarray, num_pages: int) -> PagedKVCache:
    config = model.config
    keys, values = PagedKVCache.empty_pool(
        config.num_hidden_layers, num_pages, config.num_key_value_heads, PAGE_SIZE, config.head_dim
    )
    return PagedKVCache(keys, values, jnp.asarray(tables, jnp.int32), jnp.zeros(len(tables), jnp.int32))


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
