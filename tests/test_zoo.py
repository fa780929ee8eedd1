"""Every registered architecture against `transformers`, from its tiny config in
`zoo.TINY`: logits, greedy tokens, the cache, scanning, ragged batches, saving,
LoRA and the serving engine. A new `model_type` is tested here by adding one entry
to `zoo.TINY`; a registered one without an entry fails."""

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_models
from conftest import STORIES, make_checkpoint, release_compiled_code, require_fixture, tiny_config, torch_logits
from zoo import tiny_overrides

PROMPT_LEN = 40
NEW_TOKENS = 30


@dataclasses.dataclass
class Family:
    model_type: str
    folder: Path
    reference: torch.nn.Module
    model: eqx_models.CausalLM

    @property
    def vocab(self) -> int:
        return self.reference.config.vocab_size

    def ids(self, shape, seed: int = 1) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, self.vocab, shape)


@pytest.fixture(scope="module", params=eqx_models.supported_model_types())
def family(request, tmp_path_factory):
    model_type = request.param
    folder = tmp_path_factory.mktemp(model_type)
    reference = make_checkpoint(folder, tiny_config(model_type, **tiny_overrides(model_type)))
    yield Family(model_type, folder, reference, eqx_models.from_pretrained(folder))
    release_compiled_code()  # a family's programs are not used again (see conftest)


def test_logits_match_transformers(family):
    ids = family.ids((2, PROMPT_LEN))
    expected = torch_logits(family.reference, ids)
    assert 1.0 < np.abs(expected).max() < 100.0  # the comparison is on realistic logits
    np.testing.assert_allclose(np.asarray(family.model(ids)[0]), expected, atol=1e-4, rtol=0)


def test_greedy_tokens_with_the_cache_match_transformers(family):
    ids = family.ids((1, PROMPT_LEN))
    with torch.no_grad():
        expected = family.reference.generate(
            torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids)), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False,
        )[0, PROMPT_LEN:].numpy()
    tokens = eqx_models.generate(family.model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    np.testing.assert_array_equal(tokens[0], expected)


def test_prefill_then_decode_matches_the_full_forward_of_transformers(family):
    ids = family.ids((2, PROMPT_LEN), seed=2)
    expected = torch_logits(family.reference, ids)
    prefix = 24
    step = eqx.filter_jit(lambda m, x, c: m(x, cache=c))
    logits, cache = family.model.prefill(ids[:, :prefix], max_length=PROMPT_LEN + 4)
    pieces = [np.asarray(logits)]
    for t in range(prefix, PROMPT_LEN):
        logits, cache = step(family.model, ids[:, t : t + 1], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), expected, atol=1e-4, rtol=0)


def test_scanned_layers_equal_unrolled_layers(family):
    ids = family.ids((2, 16), seed=3)

    @eqx.filter_jit
    def prefill_and_step(m):
        logits, cache = m(ids, cache=m.init_cache(2, 20))
        step_logits, cache = m(ids[:, :1], cache=cache)
        return logits, step_logits

    scanned = prefill_and_step(family.model)
    unrolled = prefill_and_step(family.model.with_scan_layers(False))
    for a, b in zip(scanned, unrolled):
        # Same weights and math, but XLA fuses and orders float32 operations
        # differently in a loop body than in straight-line code (a scale that is not a
        # power of two, a soft cap): rounding differences, held to the parity bar.
        # tests/test_cache.py checks bit-for-bit equality where the order is the same.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)


def in_float64_throughout(monkeypatch) -> None:
    """Makes transformers' float64 models exact: some of their code casts to float32
    whatever the model's dtype (RMSNorm's `.float()`, Qwen3-Next's delta rule and
    router softmax), which left its "float64" Qwen3-Next logits 5e-5 from the exact
    ones. Call after loading (the checkpoint's float32 bytes must read as float32)."""
    monkeypatch.setattr(torch, "float32", torch.float64)
    monkeypatch.setattr(torch, "float", torch.float64)
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *args, **kwargs: self.to(torch.float64))


def test_left_padded_rows_match_transformers_on_each_prompt_alone(family, monkeypatch):
    """Against transformers in float64, the exact answer: two float32 computations
    of the same logits (around 20 here) can each be 7e-5 off, in opposite directions."""
    from transformers import AutoModelForCausalLM

    exact = AutoModelForCausalLM.from_pretrained(family.folder, dtype=torch.float64, experts_implementation="eager")
    lengths = (PROMPT_LEN, 23, 9)
    ids = family.ids((len(lengths), PROMPT_LEN), seed=4)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, PROMPT_LEN - length :] = 1
    logits = np.asarray(family.model(ids, attention_mask=mask)[0])
    in_float64_throughout(monkeypatch)
    for row, length in enumerate(lengths):
        with torch.no_grad():
            alone = exact.eval()(torch.tensor(ids[row : row + 1, PROMPT_LEN - length :])).logits.numpy()[0]
        assert alone.dtype == np.float64
        np.testing.assert_allclose(logits[row, PROMPT_LEN - length :], alone, atol=1e-4, rtol=0)


def test_save_pretrained_loads_in_transformers_with_identical_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM

    eqx_models.save_pretrained(family.model, tmp_path)
    ids = family.ids((2, 12), seed=5)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    np.testing.assert_array_equal(torch_logits(reloaded, ids), torch_logits(family.reference, ids))
    again = eqx_models.from_pretrained(tmp_path)
    assert again.config == family.model.config
    np.testing.assert_array_equal(np.asarray(again(ids)[0]), np.asarray(family.model(ids)[0]))


def test_lora_adapters_match_peft(family, tmp_path):
    import peft

    from eqx_models.lora import apply_lora, load_adapters, save_adapters

    lora = apply_lora(family.model, rank=4, alpha=8, targets="o_proj", key=jax.random.key(1))
    rng = np.random.default_rng(0)
    lora = jax.tree_util.tree_map_with_path(
        lambda path, leaf: 0.3 * jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype)
        if getattr(path[-1], "name", None) == "lora_B" else leaf,
        lora,
    )
    save_adapters(lora, tmp_path, base_model_name_or_path=str(family.folder))
    ids = family.ids((2, 11), seed=6)
    ours = np.asarray(lora(ids)[0])
    assert np.abs(ours - np.asarray(family.model(ids)[0])).max() > 1e-2  # the adapters matter
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(family.reference, tmp_path).eval()
        theirs = adapted(torch.tensor(ids)).logits.numpy()
        adapted.unload()  # the module-scoped reference stays a plain model
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(load_adapters(family.model, tmp_path)(ids)[0]), ours, atol=1e-6, rtol=0)


def test_the_serving_engine_gives_what_generate_gives(family):
    from eqx_models.serving import Engine, SamplingParams

    tokenizer = eqx_models.load_tokenizer(require_fixture(STORIES))  # covers the tiny vocabulary
    shared = family.ids(9, seed=20).tolist()  # two full pages that two prompts begin with
    prompts = [family.ids(n, seed=n).tolist() for n in (3, 11, 7)]
    prompts += [shared + family.ids(4, seed=21).tolist(), shared + family.ids(2, seed=22).tolist()]
    engine = Engine(family.model, tokenizer, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=32)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    again = engine.generate(prompts, params)  # with prefix caching, from the cached pages
    for prompt, out, out_again in zip(prompts, outs, again):
        alone = eqx_models.generate(family.model, prompt, max_new_tokens=14, eos_token_id=[])[0].tolist()
        assert out.token_ids == out_again.token_ids == alone
    # Every cache kind reuses pages; a recurrent state (not kept per prefix) turns it off.
    hits = engine.stats()["prefix_cache_hits_total"]
    assert hits > 0 if family.model.config.recurrent_state(1, family.model.dtype) is None else hits == 0
