"""Decode speed on mapped weights vs weights read into memory, in one process.

Saves a Qwen3-0.6B-shaped float32 checkpoint with `eqx_models.save_pretrained`
(page-aligned, so `from_pretrained` maps it), loads it twice, mapped
(`map_weights=True`, file pages, 2 MiB entries where the kernel's page cache holds
folios that large) and read (`map_weights=False`, buffers numpy allocates), reads
every weight of both once, then times batch-1 decode steps (prompt 128) with the
two taking turns.
Writes `benchmarks/results/mapped_decode.json`.

    python benchmarks/mapped_decode.py [--layers 28] [--rounds 8]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqx_models

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode import QWEN3_0_6B, prepare_ours  # noqa: E402

STEPS_PER_TURN = 8


def file_huge_page_bytes() -> int:
    """Bytes of file pages this process maps with 2 MiB entries (Linux)."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("FilePmdMapped")), 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "mapped_decode.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers})
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, 128)).astype(np.int32)
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(Path(root, "hf"))
        eqx_models.save_pretrained(eqx_models.from_pretrained(Path(root, "hf"), dtype=jnp.float32), Path(root, "ours"))
        models = {
            "mapped": eqx_models.from_pretrained(Path(root, "ours")),
            "read": eqx_models.from_pretrained(Path(root, "ours"), map_weights=False),
        }
        for model in models.values():  # first use faults the mapped pages in; time that apart
            float(sum(jnp.sum(leaf) for leaf in jax.tree.leaves(model)))
        huge_mapped = file_huge_page_bytes()
        contenders = {name: prepare_ours(model, prompt, new_tokens=STEPS_PER_TURN)[:2] for name, model in models.items()}
        times = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, (prefill, step) in contenders.items():
                prefill()
                time.sleep(0.5)
                for _ in range(STEPS_PER_TURN):
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)
    results = {
        "benchmark": "mapped_decode",
        "layers": args.layers,
        "weight_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(models["read"])),
        "file_bytes_mapped_with_huge_pages": huge_mapped,
        "ms_per_step": {name: 1e3 * float(np.median(t)) for name, t in times.items()},
        "all_ms": {name: [1e3 * x for x in t] for name, t in times.items()},
    }
    print(json.dumps(results["ms_per_step"]), f"{huge_mapped / 1e9:.2f} GB of file pages mapped huge")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
