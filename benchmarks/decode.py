"""Decode and prefill speed of eqx_models vs `transformers`, measured in the same run.

A Qwen3-0.6B-shaped model with random float32 weights is created with
`transformers`, saved, and loaded by both libraries. For batch sizes 1 and 8 it
times a 128-token prefill and 32 single-token decode steps (cache in place), the
libraries taking turns every four steps, and the decode step's compile time. At
batch 1 a bfloat16 copy of our model takes turns too, and its logits are compared
with float32. The floor is the weight bytes divided by the best read bandwidth that
memory-bound probes over 1 GiB reach with all cores, taking turns with the decode
steps. Writes `benchmarks/results/decode.json`.

    python benchmarks/decode.py [--layers 28] [--batch-sizes 1 8] [--new-tokens 32] [--no-bfloat16]
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import eqx_models
from eqx_models.generation import DecodeState, Sampling, _decode_step, _decode_stepper, _prefill

RESULTS = Path(__file__).resolve().parent / "results"

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def bandwidth_probes(nbytes: int = 1 << 30) -> dict[str, object]:
    """Memory-bound kernels that each read a 1 GiB float32 buffer once: torch's
    sum and matrix-vector product, and our own matrix-vector kernel (on some CPUs
    it streams faster than torch's; a floor below what a plain read reaches would
    flatter decode). The values are random: pages that all hold the same bytes may
    be merged by the host (seen here: a buffer of ones read at 68-83 GB/s, random
    values at 40-50)."""
    from eqx_models.backends.cpu import kernels_available
    from eqx_models.ops import stacked_matvec

    data = torch.rand(nbytes // 4, generator=torch.Generator().manual_seed(0))
    matrix, vector = data.view(4096, -1), torch.ones(nbytes // 4 // 4096)
    probes = {"torch_sum": data.sum, "torch_mv": lambda: torch.mv(matrix, vector)}
    if kernels_available():
        stack, x = jnp.asarray(data.numpy()).reshape(1, -1, 1024), jnp.ones((1, 1024))
        product = jax.jit(stacked_matvec)
        probes["eqx_matvec"] = lambda: product(x, stack, jnp.int32(0)).block_until_ready()
    return probes


def single_thread_bandwidth_gb_s(probes: dict, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """torch's probes on one thread (ours use every core), best of `repeats`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    best = float("inf")
    for name in ("torch_sum", "torch_mv"):
        for _ in range(repeats):
            start = time.perf_counter()
            probes[name]()
            best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return nbytes / best / 1e9


def prepare_ours(model, prompt: np.ndarray, new_tokens: int, cache_dtype: str | None = None):
    """Compiles prefill and decode; returns (prefill, step, figures) for interleaved timing.
    `cache_dtype` is the KV cache's (default: the model's)."""
    batch, length = prompt.shape
    ids, mask = jnp.asarray(prompt), jnp.ones(prompt.shape, jnp.int32)
    max_length = length + new_tokens + 1
    sampling = Sampling()
    key = jax.random.key(0)

    start = time.perf_counter()
    _prefill.lower(model, ids, mask, key, max_length, sampling, (), cache_dtype).compile()
    prefill_compile = time.perf_counter() - start
    state, token = _prefill(model, ids, mask, key, max_length, sampling, (), cache_dtype)
    dummy = DecodeState(model.init_cache(batch, max_length, cache_dtype), token, jnp.zeros(batch, bool), key)
    start = time.perf_counter()
    compiled = _decode_step.lower(model, dummy, sampling, (), 0).compile()
    decode_compile = time.perf_counter() - start
    memory = compiled.compiled.memory_analysis()
    del dummy
    current = {}

    def prefill():
        current["state"], token = _prefill(model, ids, mask, key, max_length, sampling, (), cache_dtype)
        jax.block_until_ready(token)

    decode = _decode_stepper(model, sampling)  # the step `generate` runs

    def step():
        current["state"], token = decode(current["state"])
        jax.block_until_ready(token)

    figures = {
        "prefill_compile_s": prefill_compile,
        "decode_compile_s": decode_compile,
        "decode_temp_bytes": int(memory.temp_size_in_bytes),
        "decode_alias_bytes": int(memory.alias_size_in_bytes),
        "cache_bytes": int(sum(leaf.nbytes for leaf in (state.cache.keys, state.cache.values, state.cache.key_scales,
                                                        state.cache.value_scales) if leaf is not None)),
    }
    return prefill, step, figures


def prepare_transformers(model, prompt: np.ndarray):
    from transformers import DynamicCache

    ids = torch.tensor(prompt)
    current = {}

    @torch.inference_mode()
    def prefill():
        current["cache"] = DynamicCache(config=model.config)  # a hybrid model's layers need it
        out = model(ids, past_key_values=current["cache"], use_cache=True, logits_to_keep=1)
        current["token"] = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step():
        out = model(current["token"], past_key_values=current["cache"], use_cache=True)
        current["token"] = out.logits[:, -1].argmax(-1, keepdim=True)

    return prefill, step


def interleaved(functions: dict, rounds: int, calls_per_round: int, settle_s: float = 0.5) -> dict[str, list[float]]:
    """Times each function `calls_per_round` times per round, the libraries taking turns.

    The machine's speed drifts by tens of percent over minutes; taking turns keeps
    the drift out of the ratios. Between turns the process sleeps `settle_s`: torch's
    OpenMP workers spin for a while after a parallel region (and XLA's pool briefly
    too), which would take a core from whoever runs next.
    """
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            time.sleep(settle_s)
            for _ in range(calls_per_round):
                start = time.perf_counter()
                function()
                times[name].append(time.perf_counter() - start)
    return times


def measure(contenders: dict, batch: int, length: int, new_tokens: int, probes: dict,
            nbytes: int = 1 << 30) -> tuple[dict[str, dict], float]:
    """Prefill and decode figures for each contender `name -> (prefill, step, figures)`,
    and the read bandwidth (GB/s, all cores) the probes reached in the same turns as
    the decode steps: the machine's bandwidth drifts, so the floor is measured
    alongside what it bounds."""
    for prefill, step, _ in contenders.values():
        prefill()  # warm-up: compile, allocate
        prefill()
        step()
    for probe in probes.values():
        probe()
    prefills = interleaved({name: c[0] for name, c in contenders.items()}, rounds=3, calls_per_round=1)
    for prefill, step, _ in contenders.values():
        prefill()
        step()  # the first step after a prefill may still touch cold pages
    steps = interleaved({**{name: c[1] for name, c in contenders.items()}, **probes},
                        rounds=new_tokens // 4, calls_per_round=4)
    bandwidth = max(nbytes / min(steps[name]) for name in probes) / 1e9
    results = {}
    for name, (_, _, figures) in contenders.items():
        best_prefill = min(prefills[name])
        step = float(np.median(steps[name]))
        results[name] = {
            "prefill_s": best_prefill,
            "prefill_tokens_per_s": batch * length / best_prefill,
            "decode_ms_per_step": 1e3 * step,
            "decode_tokens_per_s": batch / step,
            "decode_steps_timed": len(steps[name]),
            **figures,
        }
    return results, bandwidth


def bfloat16_logit_diff(model32, model16, prompt: np.ndarray) -> dict[str, float]:
    ids = jnp.asarray(prompt[:1])
    logits32, _ = eqx.filter_jit(lambda m, i: m(i))(model32, ids)
    logits16, _ = eqx.filter_jit(lambda m, i: m(i))(model16, ids)
    return {
        "max_abs_logit_diff_vs_float32": float(jnp.abs(logits16.astype(jnp.float32) - logits32).max()),
        "max_abs_logit_float32": float(jnp.abs(logits32).max()),
        "greedy_agreement_vs_float32": float(jnp.mean(jnp.argmax(logits16, -1) == jnp.argmax(logits32, -1))),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=RESULTS / "decode.json")
    parser.add_argument("--bfloat16", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a bfloat16 copy of the model at batch 1 (default: on)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers})
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        model = eqx_models.from_pretrained(folder, dtype=jnp.float32)

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model))
    probes = bandwidth_probes()
    results = {
        "benchmark": "decode",
        "model": f"Qwen3-0.6B-shaped, {args.layers} layers, random float32 weights",
        "weight_bytes": weight_bytes,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "read_bandwidth_gb_s_one_thread": single_thread_bandwidth_gb_s(probes),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "runs": [],
    }
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        prompt = rng.integers(0, config.vocab_size, (batch, args.prompt_length))
        contenders = {
            "eqx_models": prepare_ours(model, prompt, args.new_tokens),
            "transformers": (*prepare_transformers(reference, prompt), {}),
        }
        if batch == 1 and args.bfloat16:
            model16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
            contenders["eqx_models_bfloat16"] = prepare_ours(model16, prompt, args.new_tokens)
        timed, bandwidth = measure(contenders, batch, args.prompt_length, args.new_tokens, probes)
        ours, theirs = timed["eqx_models"], timed["transformers"]
        floor_ms = 1e3 * weight_bytes / (bandwidth * 1e9)
        run = {
            "batch": batch,
            "read_bandwidth_gb_s": bandwidth,
            "floor_ms_per_step_batch1": floor_ms,
            "decode_speed_vs_floor": floor_ms / ours["decode_ms_per_step"] if batch == 1 else None,
            "eqx_models": ours,
            "transformers": theirs,
            "decode_speedup_vs_transformers": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
        }
        if "eqx_models_bfloat16" in timed:
            run["eqx_models_bfloat16"] = {
                **timed["eqx_models_bfloat16"],
                "decode_speedup_vs_own_float32": timed["eqx_models_bfloat16"]["decode_tokens_per_s"] / ours["decode_tokens_per_s"],
                **bfloat16_logit_diff(model, model16, prompt),
            }
            del model16, contenders
        results["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
