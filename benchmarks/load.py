"""Peak memory and wall time of `from_pretrained`, eqx_models vs `transformers`.

Saves a Qwen3-0.6B-shaped float32 checkpoint with random weights (about 2.4 GB),
then loads it in a fresh process per library and repeat, recording the wall time
and the growth of peak resident memory over the process's size after imports,
during loading and after every weight has been read once.
Writes `benchmarks/results/load.json`.

    python benchmarks/load.py [--layers 28] [--repeats 4]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Runs in a child process: imports first, then one load, measured.
CHILD = r"""
import json, sys, time
library, folder = sys.argv[1], sys.argv[2]
if library == "eqx_models":
    import jax, jax.numpy as jnp, eqx_models
    jnp.zeros(1).block_until_ready()  # start the backend before measuring
    load = lambda: jax.block_until_ready(eqx_models.from_pretrained(folder, dtype=jnp.float32))
    touch = lambda m: float(sum(jnp.sum(leaf) for leaf in jax.tree.leaves(m)))
else:
    import torch
    from transformers import AutoModelForCausalLM
    load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    touch = lambda m: float(sum(p.sum() for p in m.parameters()))
def status_bytes(field):
    # VmHWM belongs to this process's address space; ru_maxrss would carry the
    # parent's high-water mark over the fork.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
before = status_bytes("VmRSS")
start = time.perf_counter()
model = load()
seconds = time.perf_counter() - start
peak = status_bytes("VmHWM")
# transformers maps the file and reads pages on first use: touch every weight
# once to see the resident size a model in use has.
touch(model)
touched = status_bytes("VmHWM")
print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss": peak, "peak_growth": peak - before,
                  "peak_growth_after_touching_weights": touched - before}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import QWEN3_0_6B

    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers})
    results = {"benchmark": "load", "layers": args.layers, "runs": []}
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        results["weight_bytes"] = sum(p.numel() * 4 for p in model.parameters())
        model.save_pretrained(folder)
        del model
        # The file was just written: let its pages reach the disk before the first
        # load, which would otherwise compete with the write-back.
        os.sync()
        for repeat in range(args.repeats):
            # Who goes first alternates, so neither always meets the colder cache.
            order = ("eqx_models", "transformers") if repeat % 2 == 0 else ("transformers", "eqx_models")
            for library in order:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, library, folder], capture_output=True, text=True, check=True
                )
                run = {"library": library, "repeat": repeat, **json.loads(out.stdout.strip().splitlines()[-1])}
                run["peak_growth_over_weights"] = run["peak_growth"] / results["weight_bytes"]
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
