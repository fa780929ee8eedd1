"""bfloat16 prompts on AMX tiles: the products and a whole prefill, beside XLA's
matmul and torch's (oneDNN) bfloat16 matmul, in one run.

Two parts, each on a CPU with AMX (elsewhere the tiles are off and the script says so):

1. Products. The Qwen3-0.6B projection shapes, as one layer loop over 28 stacked
   bfloat16 weights (`jax.lax.scan`, the layer read in place): ours through
   `stacked_matvecs` (the tiles from 5 rows on), XLA's `dot` of the layer's slice,
   and `torch.nn.functional.linear` in bfloat16 over the same 28 weights (torch
   2.13's CPU build, oneDNN, 2 threads). Rows 1, 4, 8, 16, 32, 128, 512; best of 5.
2. Prefill. A Qwen3-0.6B-shaped bfloat16 model (`--checkpoint`, float32 folder,
   cast when loading) takes 128- and 512-token prompts through `_prefill`, with
   the tiles and without (`EQX_MODELS_AMX=0`, a fresh process each, taking turns
   twice); best of 3 per process.

    python benchmarks/bf16_prompts.py --checkpoint <checkpoint>

Writes `benchmarks/results/bf16_prompts.json` (or `--output`).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from decode import RESULTS

LAYERS = 28
SHAPES = {"q/k/v": (4096, 1024), "gate/up": (6144, 1024), "down": (1024, 3072)}  # out, in
ROWS = (1, 4, 8, 16, 32, 128, 512)


def best_seconds(run, repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def products() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from eqx_models.ops import stacked_matvecs

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    rows_out = []
    for name, (out, width) in SHAPES.items():
        host = (rng.standard_normal((LAYERS, out, width), np.float32) * 0.03)
        stack = jnp.asarray(host, jnp.bfloat16)
        torch_stack = torch.from_numpy(host).to(torch.bfloat16)
        del host

        def loop(product):
            def run(x, stack):
                def layer(carry, i):
                    return carry, product(x, stack, i)[0, 0]
                return jax.lax.scan(layer, 0.0, jnp.arange(LAYERS))[1]
            return jax.jit(run)

        ours = loop(lambda x, s, i: stacked_matvecs(x, (s,), i)[0])
        xla = loop(lambda x, s, i: jnp.einsum("mk,nk->mn", x, jax.lax.dynamic_index_in_dim(s, i, keepdims=False),
                                              preferred_element_type=jnp.float32))
        for rows in ROWS:
            x = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
            torch_x = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
            flops = 2 * rows * out * width * LAYERS

            def torch_loop():
                with torch.no_grad():
                    for i in range(LAYERS):
                        torch.nn.functional.linear(torch_x, torch_stack[i])

            figures = {"ours": best_seconds(lambda: ours(x, stack).block_until_ready()),
                       "xla": best_seconds(lambda: xla(x, stack).block_until_ready()),
                       "torch": best_seconds(torch_loop)}
            row = {"shape": name, "out": out, "in": width, "rows": rows}
            for who, seconds in figures.items():
                row[f"{who}_ms"] = 1e3 * seconds
                row[f"{who}_gflop_s"] = flops / seconds / 1e9
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    return rows_out


def prefill(checkpoint: str, lengths: list[int]) -> dict:
    """Run in a child process: best-of-3 prefill seconds per prompt length."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqx_models
    from eqx_models.generation import Sampling, _prefill
    from eqx_models.backends.cpu import bf16_tiles_available

    model = eqx_models.from_pretrained(checkpoint, dtype=jnp.bfloat16)
    out = {"tiles": bf16_tiles_available()}
    for length in lengths:
        ids = jnp.asarray(np.random.default_rng(length).integers(0, 150000, (1, length)), jnp.int32)
        args = (model, ids, jnp.ones_like(ids), jax.random.key(0), length + 32, Sampling(), (), jnp.bfloat16)
        seconds = best_seconds(lambda: jax.block_until_ready(_prefill(*args)), repeats=3)
        out[str(length)] = {"seconds": seconds, "tokens_per_s": length / seconds}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "bf16_prompts.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(prefill(str(args.checkpoint), args.lengths)))
        return

    from eqx_models.backends.cpu import bf16_tiles_available

    if not bf16_tiles_available():
        sys.exit("This CPU (or this process) has no AMX bfloat16 tiles: nothing to compare.")
    product_rows = products()
    runs = {"tiles": [], "xla": []}
    for _ in range(args.rounds):
        for name, flag in (("tiles", "1"), ("xla", "0")):
            command = [sys.executable, __file__, "--child", "--checkpoint", str(args.checkpoint),
                       "--lengths", *map(str, args.lengths)]
            done = subprocess.run(command, env=dict(os.environ, EQX_MODELS_AMX=flag), capture_output=True,
                                  text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    summary = {str(n): {name: max(r[str(n)]["tokens_per_s"] for r in runs[name]) for name in runs}
               for n in args.lengths}
    out = {
        "benchmark": "bf16_prompts",
        "checkpoint": str(args.checkpoint),
        "setup": {"layers": LAYERS, "shapes": SHAPES, "threads": 2, "note": "products best of 5; prefill best "
                  "of 3 per process, best process of each kind, the two kinds taking turns"},
        "machine": dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count()),
        "products": product_rows,
        "prefill_tokens_per_s": summary,
        "prefill_runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
