"""Peak memory and wall time of `from_pretrained`, eqx_models vs `transformers`.

Saves a Qwen3-0.6B-shaped float32 checkpoint with random weights (about 2.4 GB)
twice: once with `transformers` (tensors at whatever offsets follow each other, as
on the hub) and once with `eqx_models.save_pretrained` (page-aligned tensors, which
our loader maps instead of reading). Each library loads each file in a fresh
process per repeat, recording the wall time, the growth of peak resident memory
over the process's size after imports, the time and memory of then reading every
weight once, and, for eqx_models, the decode step's speed on the loaded weights.

In the same turns a process faults in as many new bytes as the weights with every
core: the floor for any loader that copies the weights into its own memory (on a
VM that hands freed memory back to its host, that is most of the cost). Every
process starts after a pause (`--settle-s`), so memory the previous one freed has
gone back to the host and no process inherits another's warm pages.
Writes `benchmarks/results/load.json`.

    python benchmarks/load.py [--layers 28] [--repeats 4] [--settle-s 30]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# Runs in a child process: imports first, then one load, measured.
CHILD = r"""
import json, sys, time
library, folder, benchmarks = sys.argv[1], sys.argv[2], sys.argv[3]
figures = {}
if library == "eqx_models":
    import jax, jax.numpy as jnp, numpy as np, eqx_models
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
# A mapped file is read on first use: read every weight once to see what that
# costs and the resident size of a model in use.
start = time.perf_counter()
touch(model)
touch_seconds = time.perf_counter() - start
touched = status_bytes("VmHWM")
if library == "eqx_models":
    sys.path.insert(0, benchmarks)
    from decode import prepare_ours
    prefill, step, _ = prepare_ours(model, np.zeros((1, 128), np.int32), new_tokens=40)
    prefill()
    times = []
    for _ in range(32):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    figures["decode_ms_per_step_batch1"] = 1e3 * sorted(times)[len(times) // 2]
print(json.dumps({"seconds": seconds, "touch_seconds": touch_seconds, "rss_before": before, "peak_rss": peak,
                  "peak_growth": peak - before, "peak_growth_after_touching_weights": touched - before, **figures}))
"""

# Faults in `nbytes` of new memory, one thread per core, and times it.
FRESH_MEMORY = r"""
import json, os, sys, threading, time
import numpy as np
nbytes = int(sys.argv[1])
start = time.perf_counter()
memory = np.empty(nbytes, np.uint8)
parts = np.array_split(memory, len(os.sched_getaffinity(0)))
def fault(part):
    part[::4096] = 1
threads = [threading.Thread(target=fault, args=(p,)) for p in parts]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def child(settle_s: float, *argv: str) -> dict:
    time.sleep(settle_s)
    out = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"child {argv[1:]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=30.0, help="pause before each process")
    parser.add_argument("--output", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args()

    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    import eqx_models

    sys.path.insert(0, str(HERE))
    from decode import QWEN3_0_6B

    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers})
    results = {"benchmark": "load", "layers": args.layers, "settle_s": args.settle_s, "runs": [], "fresh_memory_runs": []}
    with tempfile.TemporaryDirectory() as root:
        folders = {"transformers": Path(root, "transformers"), "eqx_models": Path(root, "eqx_models")}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        results["weight_bytes"] = sum(p.numel() * 4 for p in model.parameters())
        model.save_pretrained(folders["transformers"])
        del model
        eqx_models.save_pretrained(
            eqx_models.from_pretrained(folders["transformers"], dtype=jnp.float32), folders["eqx_models"]
        )
        # The files were just written: let their pages reach the disk before the
        # first load, which would otherwise compete with the write-back.
        os.sync()
        for repeat in range(args.repeats):
            # Who goes first alternates, so neither always meets the colder cache.
            order = ("eqx_models", "transformers") if repeat % 2 == 0 else ("transformers", "eqx_models")
            fresh = {"repeat": repeat, **child(args.settle_s, FRESH_MEMORY, str(results["weight_bytes"]))}
            results["fresh_memory_runs"].append(fresh)
            print(json.dumps(fresh), flush=True)
            for written_by, folder in folders.items():
                for library in order:
                    run = {"library": library, "file_written_by": written_by, "repeat": repeat,
                           **child(args.settle_s, CHILD, library, str(folder), str(HERE))}
                    run["peak_growth_over_weights"] = run["peak_growth"] / results["weight_bytes"]
                    results["runs"].append(run)
                    print(json.dumps(run), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
