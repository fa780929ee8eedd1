"""One ragged step (prompt chunks and decode tokens of many rows, flattened) keeps
the cache contract: each row's logits and pages are those of its own full pass."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import ARCHITECTURES, small_model
from test_paged_cache import PAGE_SIZE, paged_cache

from eqx_models import ops
from eqx_models.backends import xla
from eqx_models.models.gemma2 import Gemma2Config
from eqx_models.paged_cache import RaggedPagedKVCache, ragged_tokens

RAGGED = {**ARCHITECTURES, "gemma2_softcap": dict(
    model_type="gemma2", sliding_window=5, attn_logit_softcapping=4.0, query_pre_attn_scalar=12.0,
    hidden_act="gelu_pytorch_tanh", use_qk_norm=False, config_class=Gemma2Config,
)}


def ragged(paged, query_starts) -> RaggedPagedKVCache:
    return RaggedPagedKVCache(paged.keys, paged.values, paged.block_tables, paged.positions,
                              jnp.asarray(query_starts, jnp.int32), paged.key_scales, paged.value_scales)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("architecture", RAGGED)
def test_a_ragged_step_of_chunks_and_decodes_equals_each_rows_own_pass(architecture, cache_dtype):
    model = small_model(**RAGGED[architecture])
    rng = np.random.default_rng(2)
    ids = rng.integers(0, model.config.vocab_size, (4, 22)).astype(np.int32)
    tables = rng.permutation(32)[:24].reshape(4, 6).astype(np.int32)
    # Rows 0 and 1 have tokens cached (row 2 none; row 3 is a padding row of the
    # batch bucket), through the plain paged cache.
    cached = np.array([9, 14, 0, 0])
    paged = paged_cache(model, tables, 32, cache_dtype)
    mask = (np.arange(14)[None] < cached[:, None]).astype(np.int32)
    _, paged = model(ids[:, :14], paged, mask)
    np.testing.assert_array_equal(paged.positions, cached)
    # One step: 1 new token of row 1 (a decode) first, then 7 of row 0 (a chunk)
    # and 11 of row 2 (a whole prompt), each in whole blocks of 16; none of row 3.
    # The ragged rows are the paged rows in that order.
    order = np.array([1, 0, 2, 3])
    new = np.array([7, 1, 11, 0])
    spans = np.array([0, 16, 32, 48, 48])  # of ragged rows 0..3, then the end
    starts = {row: spans[i] for i, row in enumerate(order)}
    flat, real = np.zeros((1, 48), np.int32), np.zeros((1, 48), np.int32)
    for row in range(3):
        flat[0, starts[row] : starts[row] + new[row]] = ids[row, cached[row] : cached[row] + new[row]]
        real[0, starts[row] : starts[row] + new[row]] = 1
    step = RaggedPagedKVCache(paged.keys, paged.values, paged.block_tables[order], paged.positions[order],
                              jnp.asarray(spans, jnp.int32), paged.key_scales, paged.value_scales)
    logits, after = model(flat, step, real, logits_at=np.arange(48)[None])
    for row, count in enumerate(new[:3]):
        if cache_dtype == "float32":  # the whole prefix's own pass
            want, _ = model(ids[row : row + 1, : cached[row] + count])
        else:  # an int8 cache rounds what later tokens see: the same cache, row by row
            alone = paged_cache(model, tables[row : row + 1], 32, cache_dtype)
            _, alone = model(ids[row : row + 1, : cached[row]], alone) if cached[row] else (None, alone)
            step, _ = model(ids[row : row + 1, cached[row] : cached[row] + count], alone)
            want = np.concatenate([np.zeros((1, cached[row], step.shape[-1])), step], axis=1)
        got = logits[0, starts[row] : starts[row] + count]
        np.testing.assert_allclose(got, want[0, cached[row] :], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(after.positions, (cached + new)[order])
    # The pages now hold the new tokens: one decode step per row continues each.
    follow = RaggedPagedKVCache(after.keys, after.values, paged.block_tables, jnp.asarray(cached + new, jnp.int32),
                                jnp.asarray([0, 1, 2, 3, 3], jnp.int32), after.key_scales, after.value_scales)
    at = (cached + new)[:3]
    step_ids = np.zeros((1, 16), np.int32)
    step_ids[0, :3] = ids[np.arange(3), at]
    logits, _ = model(step_ids, follow, (np.arange(16) < 3).astype(np.int32)[None], logits_at=np.arange(3)[None])
    for row in range(3):
        if cache_dtype == "float32":
            want, _ = model(ids[row : row + 1, : at[row] + 1])
            np.testing.assert_allclose(logits[0, row], want[0, -1], atol=1e-4, rtol=0)
    if cache_dtype == "int8":  # what the plain paged cache, holding the same int8 pages, gives next
        plain = type(paged)(after.keys, after.values, paged.block_tables, jnp.asarray(cached + new, jnp.int32),
                            key_scales=after.key_scales, value_scales=after.value_scales)
        want, _ = model(step_ids[0, :4, None], plain, (np.arange(4) < 3).astype(np.int32)[:, None])
        np.testing.assert_allclose(logits[0], want[:3, 0], atol=1e-4, rtol=0)


def test_padding_tokens_write_nothing_and_a_row_past_its_pages_is_an_error():
    model = small_model()
    tables = np.array([[3, 1], [2, 2]], np.int32)
    paged = paged_cache(model, tables, 4)
    flat = np.arange(1, 17, dtype=np.int32)[None]
    real = (np.arange(16) < 5).astype(np.int32)[None]  # 5 tokens of row 0; the rest of its span is padding
    _, after = model(flat, ragged(paged, [0, 16, 16]), real, logits_at=np.array([[4, 4]]))
    np.testing.assert_array_equal(after.positions, [5, 0])
    keys = np.asarray(after.keys)
    np.testing.assert_array_equal(keys[:, [0, 2]], 0)  # padding writes nothing: page 2 (row 1's) stays empty
    assert np.abs(keys[:, 3]).sum() > 0 and np.abs(keys[:, 1, :, 0]).sum() > 0
    with pytest.raises(Exception, match="RaggedPagedKVCache overflow"):
        model(np.ones((1, 16), np.int32), ragged(after, [0, 16, 16]), real)
    with pytest.raises(Exception, match="must span whole blocks of 16"):
        model(np.ones((1, 16), np.int32), ragged(paged, [0, 1, 6]), (np.arange(16) < 6).astype(np.int32)[None])


@pytest.mark.parametrize("key_slots", [xla.KEY_SLOTS, 4])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_op_equals_masked_attention_over_each_rows_gathered_pages(softcap, key_slots, monkeypatch):
    """The op alone, with a window, sinks, int8 pages, a value pool that holds none
    (values in the keys' first channels), a row of one token (a decode), a chunk
    over two blocks, with and without a soft cap (without one, one-token rows
    attend as decode steps), keys met all at once or a page (a block) a step."""
    monkeypatch.setattr(xla, "KEY_SLOTS", key_slots)
    rng = np.random.default_rng(3)
    layers, pages, kv_heads, groups, head_dim, value_dim = 2, 20, 2, 3, 8, 5
    key_pool = jnp.asarray(rng.integers(-127, 128, (layers, pages, kv_heads, PAGE_SIZE, head_dim)), jnp.int8)
    key_scales = jnp.asarray(rng.uniform(0.01, 0.02, key_pool.shape[:-1]), jnp.float32)
    tables = jnp.asarray(rng.permutation(pages)[:18].reshape(3, 6), jnp.int32)
    cached, new = np.array([10, 6, 0]), np.array([1, 3, 20])
    spans = np.array([0, 16, 32, 64])
    real = np.zeros(64, np.int32)
    for row in range(3):
        real[spans[row] : spans[row] + new[row]] = 1
    query = jnp.asarray(rng.normal(size=(64, kv_heads, groups, head_dim)), jnp.float32)
    new_keys = jnp.asarray(rng.normal(size=(64, kv_heads, head_dim)), jnp.float32)
    new_values = new_keys[..., :value_dim]
    sinks = jnp.asarray(rng.normal(size=(kv_heads, groups)), jnp.float32)
    layer = jnp.int32(1)
    tokens = ragged_tokens(jnp.asarray(cached, jnp.int32), jnp.asarray(spans, jnp.int32), 64, 4, jnp.asarray(real))
    np.testing.assert_array_equal(tokens.lengths, new)
    got = ops.ragged_paged_attention(query, new_keys, new_values, key_pool, key_pool, layer, tables, tokens,
                                     0.3, softcap, sinks, key_scales, key_scales)
    gathered = xla.gather_pages(key_pool, layer, tables).astype(jnp.float32) * xla.gather_pages(
        key_scales[..., None], layer, tables)
    for row in range(3):
        span = slice(spans[row], spans[row] + new[row])
        q = query[span].transpose(1, 2, 0, 3)[None]
        keys = [gathered[row : row + 1, :, : cached[row]], new_keys[span].transpose(1, 0, 2)[None]]
        at = cached[row] + np.arange(new[row])
        seen = [(at[:, None] - np.arange(cached[row])[None] < 4)[None],
                ((at[:, None] >= at[None]) & (at[:, None] - at[None] < 4))[None]]
        keys, seen = (keys, seen) if cached[row] else (keys[1:], seen[1:])
        want = xla.masked_attention(q, keys, [k[..., :value_dim] for k in keys], seen, 0.3, softcap, sinks)
        np.testing.assert_allclose(got[span], want[0].transpose(2, 0, 1, 3), atol=1e-5, rtol=0)
    assert not np.isnan(np.asarray(got)).any()  # padding tokens average, never NaN


def test_a_batch_of_one_token_rows_leaves_its_padding_at_zero_not_nan():
    """No row of several tokens: no block step runs, and the padding queries, which
    meet no key, come out 0 (the one-token rows as decode steps)."""
    rng = np.random.default_rng(4)
    key_pool = jnp.asarray(rng.normal(size=(1, 4, 2, PAGE_SIZE, 8)), jnp.float32)
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    real = jnp.asarray((np.arange(16) < 2).astype(np.int32))
    tokens = ragged_tokens(jnp.asarray([3, 5], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32), 16, real=real)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    got = np.asarray(ops.ragged_paged_attention(normal(16, 2, 2, 8), normal(16, 2, 8), normal(16, 2, 8), key_pool,
                                                key_pool, jnp.int32(0), tables, tokens, 0.35))
    assert not np.isnan(got).any() and not got[2:].any()
