"""Compile time of the decode step vs depth, scanned and unrolled layers.

Builds Qwen3-0.6B-wide models (random weights) with 2 to 28 layers and times
`lower().compile()` of the donated decode step, with `scan_layers=True` and
`False`. Writes `benchmarks/results/compile_depth.json`.

    python benchmarks/compile_depth.py [--depths 2 7 14 28]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import eqx_models
from eqx_models.generation import DecodeState, Sampling, _decode_step

RESULTS = Path(__file__).resolve().parent / "results"


def compile_seconds(model: eqx_models.CausalLM, batch: int = 1, max_length: int = 256) -> float:
    state = DecodeState(model.init_cache(batch, max_length), jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool), jax.random.key(0))
    start = time.perf_counter()
    _decode_step.lower(model, state, Sampling(), (), 0).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 7, 14, 28])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many compiles")
    parser.add_argument("--output", type=Path, default=RESULTS / "compile_depth.json")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import QWEN3_0_6B

    runs = []
    for depth in args.depths:
        run = {"layers": depth, "scan_s": float("inf"), "unrolled_s": float("inf")}
        for repeat in range(args.repeats):
            # A vocabulary one token larger per repeat: a new shape, so JAX's
            # in-memory cache cannot serve the compile; the best time is kept
            # because the shared machine adds noise, never speed.
            fields = {**QWEN3_0_6B, "num_hidden_layers": depth, "vocab_size": QWEN3_0_6B["vocab_size"] + repeat}
            config = eqx_models.DecoderConfig(model_type="qwen3", use_qk_norm=True, **fields)
            model = eqx_models.CausalLM(config, key=jax.random.key(depth))
            for scan in (True, False):
                name = "scan_s" if scan else "unrolled_s"
                run[name] = min(run[name], compile_seconds(model.with_scan_layers(scan)))
            del model
        runs.append(run)
        print(json.dumps(run), flush=True)
    shallow, deep = runs[0], runs[-1]
    results = {
        "benchmark": "compile_depth",
        "model": "Qwen3-0.6B width, decode step (batch 1, 256 cache slots)",
        "runs": runs,
        "scan_ratio_deepest_vs_shallowest": deep["scan_s"] / shallow["scan_s"],
        "unrolled_ratio_deepest_vs_shallowest": deep["unrolled_s"] / shallow["unrolled_s"],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
