"""Correctness on the accelerator, in one command: the TPU backend's kernels (decode
attention over the dense cache and over pages, the experts' grouped product, splash attention over prompts, the int8
layer product) against the reference ops on the chip, greedy tokens of a float32 model on the chip
against the same model on the host's CPU, and logits against `transformers`
(float32 at `jax.default_matmul_precision("highest")`, and bfloat16), and the
serving engine's ragged steps against its steps by chunk length and `generate`.

Run on the TPU machine (CI has no TPU; the kernels are also tested there in
Pallas' interpreter, `tests/test_tpu_kernels.py`):

    python benchmarks/tpu_check.py        # writes benchmarks/results/tpu_check.json, exits 1 on a failure

The `transformers` part runs where `torch` and `transformers` import.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqx_models
from eqx_models.backends import active_backend, xla
from eqx_models.backends.tpu import attention, experts, paged, quantized, splash
from eqx_models.quantized import quantize_weight

from tpu_decode import RESULTS

# The stories260K tokenizer (512 tokens, as TINY's vocabulary): the engine wants one.
STORIES = Path(os.environ.get("EQX_MODELS_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
               ) / "stories260K"
# A small Qwen3 with the head size of the real ones (the attention kernel's lanes).
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def check_attention_kernel() -> list[dict]:
    """The Pallas decode attention against the reference, float32 and bfloat16 caches."""
    rows = []
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        for kv_seq, spans in [(256, [(0, 129), (5, 256), (130, 131), (0, 0)]), (4096, [(0, 4096), (700, 2100)])]:
            batch, kv_heads, groups, head_dim = len(spans), 8, 2, 128
            normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
            slots = np.arange(kv_seq)
            valid = jnp.asarray([(slots >= s) & (slots < e) for s, e in spans])
            self_valid = jnp.asarray([b % 3 != 1 for b in range(batch)])
            args = (normal(batch, kv_heads, groups, head_dim), normal(2, batch, kv_heads, kv_seq, head_dim).astype(dtype),
                    normal(2, batch, kv_heads, kv_seq, head_dim).astype(dtype), jnp.int32(1), valid, self_valid,
                    normal(batch, kv_heads, head_dim).astype(dtype), normal(batch, kv_heads, head_dim).astype(dtype),
                    normal(kv_heads, groups))
            with jax.default_matmul_precision("highest"):
                got = np.asarray(jax.jit(lambda *a: attention.decode_attention(*a, 0.088))(*args))
                none = jnp.zeros((0,), jnp.float32)
                want = np.asarray(jax.jit(lambda *a: xla.decode_attention(*a, none, none, 0.088))(*args))
            live = np.asarray(valid.any(axis=1) | self_valid)  # rows with nothing to see are padding
            error = float(np.abs(got - want)[live].max())
            rows.append({"check": "decode_attention", "dtype": jnp.dtype(dtype).name, "kv_seq": kv_seq,
                         "max_abs_error": error, "ok": error < 1e-4})
    return rows


def check_paged_kernel() -> list[dict]:
    """The Pallas decode over the paged pool against the reference (a gather of the
    pages), the engine's shapes: pages of 16, tables of 72 pages, 8 key/value heads."""
    rows = []
    rng = np.random.default_rng(4)
    for dtype in (jnp.float32, jnp.bfloat16):
        batch, pages, width, page_size, kv_heads, groups, head_dim = 64, 2048, 72, 16, 8, 2, 128
        normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
        tables = jnp.asarray(np.stack([rng.permutation(pages)[:width] for _ in range(batch)]), jnp.int32)
        lengths = rng.integers(1, width * page_size, batch)  # a row that sees nothing is padding (zeros)
        valid = jnp.asarray(np.arange(width * page_size)[None] < lengths[:, None])
        args = (normal(batch, kv_heads, groups, head_dim), normal(2, pages, kv_heads, page_size, head_dim).astype(dtype),
                normal(2, pages, kv_heads, page_size, head_dim).astype(dtype), jnp.int32(1), tables, valid,
                jnp.asarray(rng.random(batch) < 0.9), normal(batch, kv_heads, head_dim).astype(dtype),
                normal(batch, kv_heads, head_dim).astype(dtype), normal(kv_heads, groups))
        none = jnp.zeros((0,), jnp.float32)
        with jax.default_matmul_precision("highest"):
            got = np.asarray(jax.jit(lambda *a: paged.paged_decode_attention(*a, 0.088))(*args))
            want = np.asarray(jax.jit(lambda *a: xla.paged_decode_attention(*a, none, none, 0.088))(*args))
        error = float(np.abs(got - want).max())
        rows.append({"check": "paged_decode_attention", "dtype": jnp.dtype(dtype).name, "batch": batch,
                     "pages_per_row": width, "max_abs_error": error, "ok": error < 1e-4})
    return rows


def check_grouped_kernel() -> list[dict]:
    """megablox `gmm` over a layer of the expert stack against XLA's ragged dot,
    Qwen3-30B-A3B's expert shapes, at prefill and decode row counts."""
    rows = []
    rng = np.random.default_rng(1)
    for dtype in (jnp.float32, jnp.bfloat16):
        for count in (2048 * 8, 8):
            stack = jnp.asarray(rng.standard_normal((2, 128, 768, 2048)) * 0.02, dtype)
            x = jnp.asarray(rng.standard_normal((count, 2048)), dtype)
            sizes = np.bincount(rng.integers(0, 128, count - count // 16), minlength=128)  # a 16th past the groups
            group_sizes = jnp.asarray(sizes, jnp.int32)
            # A 16-bit product is exact at any precision: bfloat16 runs at the default
            # (under `highest` Mosaic refuses megablox's bfloat16 dot; the row below).
            with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
                got = np.asarray(jax.jit(experts.grouped_matmul)(x, stack, jnp.int32(1), group_sizes))
                want = np.asarray(jax.jit(xla.grouped_matmul)(x, stack, jnp.int32(1), group_sizes))
            error = float(np.abs(got - want).max())
            limit = 1e-4 if dtype == jnp.float32 else 2e-2
            rows.append({"check": "grouped_matmul", "dtype": jnp.dtype(dtype).name, "rows": count,
                         "max_abs_error": error, "ok": error < limit and not got[int(sizes.sum()):].any()})
    return rows


def check_grouped_kernel_under_highest() -> list[dict]:
    """Whether a bfloat16 grouped product compiles under `highest` (a bfloat16 MoE
    model run there by a user)."""
    stack = jnp.zeros((2, 4, 256, 256), jnp.bfloat16)
    x = jnp.ones((32, 256), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(experts.grouped_matmul)(x, stack, jnp.int32(1), jnp.asarray([8, 8, 8, 0], jnp.int32))
    return [{"check": "grouped_matmul bfloat16 under highest", "ok": not np.asarray(got).any()}]


def check_quantized_kernel() -> list[dict]:
    """The int8 layer product against XLA's dequantize-then-multiply, at Qwen3-4B's
    gate and down shapes, a decode row, a batch and a prompt's rows."""
    rows = []
    rng = np.random.default_rng(3)
    for dtype, activations in [(jnp.bfloat16, "float"), (jnp.float32, "int8")]:
        for out, inner in [(9728, 2560), (2560, 9728)]:
            weight = jnp.asarray(rng.standard_normal((2, out, inner)) * 0.02, dtype)
            stack = quantize_weight(weight, 8, 128, scale_dtype=jnp.bfloat16, activations=activations)
            for count in (1, 64, 512):
                x = jnp.asarray(rng.standard_normal((count, inner)), dtype).astype(jnp.float32)
                # The reference multiplies float32 weights: at `highest`, or the chip rounds them to bfloat16.
                with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
                    got = np.asarray(jax.jit(quantized.quantized_matvecs)(x, (stack,), jnp.int32(1))[0])
                with jax.default_matmul_precision("highest"):
                    want = np.asarray(jax.jit(xla.quantized_matvecs)(x, (stack,), jnp.int32(1))[0])
                error = float(np.abs(got - want).max())
                rows.append({"check": "quantized_matvecs", "dtype": jnp.dtype(dtype).name, "activations": activations,
                             "shape": [out, inner], "rows": count, "max_abs_error": error,
                             "ok": error < 1e-3 * max(1.0, float(np.abs(want).max()))})
    return rows


def check_splash_kernel() -> list[dict]:
    """Splash attention over 2,048-token prompts against the masked reference, on
    the real tokens: causal, a sliding window, packed documents with a soft cap."""
    rows = []
    rng = np.random.default_rng(2)
    batch, kv_heads, groups, seq, head_dim = 2, 8, 4, 2048, 128
    mask = np.ones((batch, seq), np.int32)
    mask[1, :300] = 0
    documents = jnp.asarray(np.repeat(np.arange(4), seq // 4)[None].repeat(batch, 0), jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
        q, k, v = normal(batch, kv_heads, groups, seq, head_dim), normal(batch, kv_heads, seq, head_dim), normal(
            batch, kv_heads, seq, head_dim)
        for name, window, segments, softcap in [("causal", 1 << 30, None, None), ("window 1000", 1000, None, None),
                                                ("packed, soft cap 50", 1 << 30, documents, 50.0)]:
            args = (q, k, v, jnp.asarray(mask), segments, window, 0.088, softcap)
            with jax.default_matmul_precision("highest"):
                got = np.asarray(jax.jit(lambda *a: splash.causal_attention(*a[:5], window, 0.088, softcap))(*args[:5]),
                                 np.float32)
                want = np.asarray(jax.jit(lambda *a: xla.causal_attention(*a[:5], window, 0.088, softcap, None))(
                    *args[:5]), np.float32)
            real = mask.astype(bool)[:, None, None, :, None]
            error = float(np.abs(np.where(real, got - want, 0)).max())
            limit = 1e-4 if dtype == jnp.float32 else 2e-2
            rows.append({"check": "splash_attention", "case": name, "dtype": jnp.dtype(dtype).name,
                         "max_abs_error": error, "ok": error < limit})
    return rows


def check_tokens_against_the_cpu() -> dict:
    """Greedy tokens of one float32 model on the chip and on the host's CPU."""
    config = eqx_models.DecoderConfig(model_type="qwen3", use_qk_norm=True, **TINY)
    model = eqx_models.CausalLM(config, key=jax.random.key(1))
    model = jax.tree.map(lambda a: a * 8 if eqx_is_weight(a) else a, model)  # logits far from ties
    prompts = np.random.default_rng(2).integers(0, TINY["vocab_size"], (4, 100))
    with jax.default_matmul_precision("highest"):
        on_chip = eqx_models.generate(model, prompts, max_new_tokens=60, eos_token_id=[])
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            on_cpu = eqx_models.generate(jax.device_put(model, cpu), prompts, max_new_tokens=60, eos_token_id=[])
    same = float((on_chip == on_cpu).mean())
    return {"check": "greedy tokens, float32, chip vs host CPU", "tokens": int(on_chip.size), "fraction_equal": same,
            "ok": same == 1.0}


def check_engine_steps() -> list[dict]:
    """The serving engine's ragged steps (prompt chunks and decodes in one call)
    against its steps by chunk length, and both against `generate`: greedy tokens
    of a float32 model at `highest`, prompts of different lengths arriving
    together, so chunks and decodes share steps."""
    from eqx_models.serving import Engine, SamplingParams

    config = eqx_models.DecoderConfig(model_type="qwen3", use_qk_norm=True, **TINY)
    model = eqx_models.CausalLM(config, key=jax.random.key(1))
    model = jax.tree.map(lambda a: a * 8 if eqx_is_weight(a) else a, model)
    tokenizer = eqx_models.load_tokenizer(STORIES)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TINY["vocab_size"], length).tolist() for length in (5, 40, 130, 300, 17, 2)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    rows = []
    with jax.default_matmul_precision("highest"):
        want = [eqx_models.generate(model, prompt, max_new_tokens=24, eos_token_id=[])[0].tolist()
                for prompt in prompts]
        for ragged in (True, False):
            engine = Engine(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=128, page_size=16,
                            num_pages=256, ragged_steps=ragged)
            got = [out.token_ids for out in engine.generate(prompts, params)]
            same = float(np.mean([a == b for a, b in zip(got, want)]))
            rows.append({"check": f"engine {'ragged' if ragged else 'by-length'} steps vs generate, greedy, float32",
                         "requests": len(prompts), "fraction_equal": same, "ok": same == 1.0})
    return rows


def eqx_is_weight(a) -> bool:
    return isinstance(a, jax.Array) and a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating)


def check_against_transformers() -> list[dict]:
    """Logits of a `transformers` Qwen3 (random weights, saved and loaded) on the chip."""
    try:
        import torch
        import transformers
    except ImportError as missing:
        return [{"check": "transformers", "skipped": f"not installed here ({missing.name})", "ok": True}]
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(**TINY, attn_implementation="eager")
    reference = transformers.Qwen3ForCausalLM(hf_config).eval()
    ids = np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 64))
    with torch.no_grad():
        want = reference(torch.asarray(ids)).logits.numpy()
        greedy = reference.generate(torch.asarray(ids), max_new_tokens=24, do_sample=False)[:, 64:].numpy()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        for dtype, tolerance in (("float32", 1e-4), ("bfloat16", None)):
            model = eqx_models.from_pretrained(folder, dtype=dtype)
            with jax.default_matmul_precision("highest"):
                logits = np.asarray(model(ids)[0], np.float32)
                tokens = eqx_models.generate(model, ids, max_new_tokens=24, eos_token_id=[])
            error = float(np.abs(logits - want).max())
            # bfloat16: about three significant digits per operation, over a few layers.
            limit = tolerance if tolerance is not None else 0.05 * float(np.abs(want).max())
            row = {"check": "logits vs transformers", "dtype": dtype, "max_abs_error": error, "limit": limit,
                   "max_abs_logit": float(np.abs(want).max()), "ok": error <= limit}
            if dtype == "float32":
                row["greedy_tokens_equal"] = bool((tokens == greedy).all())
                row["ok"] = row["ok"] and row["greedy_tokens_equal"]
            rows.append(row)
    return rows


def main() -> int:
    device = jax.devices()[0]
    on_chip = jax.default_backend() == "tpu"
    def check_tokens() -> list[dict]:
        return [check_tokens_against_the_cpu()]

    checks = [check_attention_kernel, check_paged_kernel, check_grouped_kernel, check_splash_kernel, check_quantized_kernel,
              check_grouped_kernel_under_highest] if on_chip else []
    checks += [check_tokens, check_engine_steps, check_against_transformers]
    rows = []
    for check in checks:  # a check that raises is a failed row; it must not discard the others' rows
        try:
            found = check()
        except Exception as error:
            found = [{"check": getattr(check, "__name__", "check"), "error": f"{type(error).__name__}: "
                      f"{str(error)[:600]}", "ok": False}]
        for row in found:  # as they come: a run stopped by its time limit still logs what it checked
            print(json.dumps(row), flush=True)
        rows.extend(found)
    result = {"benchmark": "tpu_check", "device": device.device_kind, "backend": active_backend().name,
              "jax": jax.__version__, "rows": rows, "ok": all(row["ok"] for row in rows)}
    RESULTS.mkdir(exist_ok=True)
    output = RESULTS / "tpu_check.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'all passed' if result['ok'] else 'FAILED'}; wrote {output}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
