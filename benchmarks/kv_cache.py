"""Decode at a long context with a bfloat16 and an int8 KV cache, eqx_models beside
llama.cpp (F16 and Q8_0 caches) on the same weights, in one run.

The model is a Qwen3-0.6B-shaped checkpoint (float32 folder) with int8 weights
(ours quantized while loading; llama.cpp's Q8_0 GGUF of the same folder, see
`benchmarks/quantized.py` for how both are made). A 4096-token prompt is put in
the cache, then 16 tokens are decoded one at a time (batch 1, median step). At
that context the cache is a large share of what a step reads: 28 layers x 8 KV
heads x 4096 tokens x 128 channels, keys and values, is 470 MB in bfloat16 and
242 MB in int8 (a float32 scale per token and head beside the integers), against
642 MB of int8 weights.

    python benchmarks/kv_cache.py --checkpoint <checkpoint> --llama-bin <llama.cpp/build/bin> \\
        --gguf <qwen3-0.6b-q8_0.gguf>

llama-bench runs `-d 4096 -p 0 -n 16 -fa 1` with `-ctk/-ctv f16` and `q8_0` (its
quantized value cache needs flash attention; both runs use it). The two systems
take turns per cache type, twice. Writes `benchmarks/results/kv_cache.json`.
"""

import argparse
import gc
import json
import os
import platform
import subprocess
from pathlib import Path

import jax
import numpy as np
from decode import RESULTS, bandwidth_probes, interleaved, prepare_ours
from quantized import llama_bench

import eqx_models
from eqx_models.quantization import quantized_bytes

CACHES = {"bfloat16": "f16", "int8": "q8_0"}  # ours -> llama.cpp's cache type of the same width


def ours(checkpoint: Path, cache_dtype: str, prompt: np.ndarray, new_tokens: int, probes: dict) -> dict:
    model = eqx_models.from_pretrained(checkpoint, quantize="int8")
    prefill, step, figures = prepare_ours(model, prompt, new_tokens, cache_dtype)
    prefill()
    step()
    steps = interleaved({"step": step, **probes}, rounds=new_tokens // 4, calls_per_round=4)
    bandwidth = max((1 << 30) / min(steps[name]) for name in probes) / 1e9
    config = model.config
    per_token = config.num_hidden_layers * config.num_key_value_heads * 2  # rows: layers x heads x (key, value)
    row_bytes = {"bfloat16": 2 * config.head_dim, "int8": config.head_dim + 4}[cache_dtype]
    live_cache_bytes = per_token * row_bytes * prompt.shape[1]
    weight_bytes = quantized_bytes(model)
    step_s = float(np.median(steps["step"]))
    del model, prefill, step
    gc.collect()
    return {
        "decode_tokens_per_s": 1 / step_s,
        "decode_ms_per_step": 1e3 * step_s,
        "weight_bytes": weight_bytes,
        "live_cache_bytes": live_cache_bytes,
        "read_bandwidth_gb_s": bandwidth,
        "floor_tokens_per_s": bandwidth * 1e9 / (weight_bytes + live_cache_bytes),
        **figures,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True, help="the checkpoint's Q8_0 GGUF")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "kv_cache.json")
    args = parser.parse_args()

    prompt = np.random.default_rng(0).integers(0, 1000, (1, args.context), dtype=np.int32)
    probes = bandwidth_probes()
    runs = {cache: {"eqx_models": [], "llama.cpp": []} for cache in CACHES}
    for _ in range(args.rounds):
        for cache, llama_type in CACHES.items():
            runs[cache]["eqx_models"].append(ours(args.checkpoint, cache, prompt, args.new_tokens, probes))
            jax.clear_caches()
            bench = ["-p", "0", "-n", str(args.new_tokens), "-d", str(args.context), "-fa", "1",
                     "-ctk", llama_type, "-ctv", llama_type, "-r", "1"]
            runs[cache]["llama.cpp"].append({
                "cache_type": llama_type,
                "decode_tokens_per_s": llama_bench(args.llama_bin, args.gguf, args.threads, bench),
            })
            print(cache, runs[cache]["eqx_models"][-1]["decode_tokens_per_s"],
                  runs[cache]["llama.cpp"][-1]["decode_tokens_per_s"], flush=True)

    best = lambda rows, key: max(row[key] for row in rows)
    summary = {}
    for cache, both in runs.items():
        ours_decode, llama_decode = best(both["eqx_models"], "decode_tokens_per_s"), best(both["llama.cpp"],
                                                                                           "decode_tokens_per_s")
        summary[cache] = {
            "eqx_models_decode_tokens_per_s": ours_decode,
            "llama_cpp_decode_tokens_per_s": llama_decode,
            "decode_ratio": ours_decode / llama_decode,
            "live_cache_bytes": both["eqx_models"][0]["live_cache_bytes"],
            "eqx_models_fraction_of_floor": max(r["decode_tokens_per_s"] / r["floor_tokens_per_s"]
                                                for r in both["eqx_models"]),
        }
    summary["int8_cache_bytes_vs_bfloat16"] = summary["int8"]["live_cache_bytes"] / summary["bfloat16"][
        "live_cache_bytes"]
    summary["eqx_models_int8_speedup_vs_bfloat16_cache"] = (summary["int8"]["eqx_models_decode_tokens_per_s"]
                                                            / summary["bfloat16"]["eqx_models_decode_tokens_per_s"])
    summary["llama_cpp_q8_0_speedup_vs_f16_cache"] = (summary["int8"]["llama_cpp_decode_tokens_per_s"]
                                                      / summary["bfloat16"]["llama_cpp_decode_tokens_per_s"])
    version = subprocess.run([str(args.llama_bin / "llama-bench"), "--version"], capture_output=True, text=True)
    out = {
        "benchmark": "kv_cache",
        "checkpoint": str(args.checkpoint),
        "setup": dict(batch=1, context=args.context, new_tokens=args.new_tokens, weights="int8 / Q8_0",
                      threads=args.threads, rounds=args.rounds,
                      note="best round of each system; the two take turns per cache type"),
        "machine": dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                        jax=jax.__version__, eqx_models=eqx_models.__version__,
                        llama_cpp=(version.stdout + version.stderr).strip()),
        "summary": summary,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
