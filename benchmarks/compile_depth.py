"""Compile time of the decode step vs depth, scanned and unrolled layers.

Describes Qwen3-0.6B-wide models with 2 to 28 layers by shape only
(`eqx.filter_eval_shape`, nothing allocated) and times tracing, lowering and
compiling the decode step, with `scan_layers=True` and `False`. Abstract inputs
keep the measurement about the compiler: with gigabytes of freshly allocated
weights beside it the same compile took up to twice as long on this machine.
Writes `benchmarks/results/compile_depth.json`.

    python benchmarks/compile_depth.py [--depths 2 7 14 28]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_models
from eqx_models.generation import DecodeState, Sampling, _decode_step

RESULTS = Path(__file__).resolve().parent / "results"


def compile_seconds(model: eqx_models.CausalLM, batch: int = 1, max_length: int = 256) -> float:
    """Seconds to trace, lower and compile the decode step for `model` given by shapes."""
    state = eqx.filter_eval_shape(
        lambda m: DecodeState(m.init_cache(batch, max_length), jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool), jax.random.key(0)),
        model,
    )
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    model_shapes, model_static = eqx.partition(model, is_shape, is_leaf=is_shape)
    state_shapes, state_static = eqx.partition(state, is_shape, is_leaf=is_shape)
    step = jax.jit(
        lambda m, s: _decode_step(eqx.combine(m, model_static), eqx.combine(s, state_static), Sampling(), (), 0)
    )
    start = time.perf_counter()
    step.lower(model_shapes, state_shapes).compile()
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
            model = eqx.filter_eval_shape(lambda: eqx_models.CausalLM(config, key=jax.random.key(depth)))
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
