"""Peak memory of a training step's gradient per rematerialisation policy, from XLA.

Compiles (never runs) `eqx.filter_grad(causal_lm_loss)` for a Qwen3-0.6B-shaped model,
from shapes alone, with each policy (`none`, `dots`, `full`) and reads the compiled
`memory_analysis()`: temp bytes (activations kept for the backward pass and scratch),
argument and output bytes. Deterministic for a given jax version. Writes
`benchmarks/results/remat_memory.json`.

    python benchmarks/remat_memory.py [--batch 4] [--seq 512] [--layers 28]
"""

import argparse
import json
import platform
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_models import causal_lm_loss
from eqx_models.models import architecture_for
from eqx_models.nn.causal_lm import CausalLM

RESULTS = Path(__file__).resolve().parent / "results"
QWEN3_0_6B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--output", type=Path, default=RESULTS / "remat_memory.json")
    args = parser.parse_args()
    hf = dict(QWEN3_0_6B, num_hidden_layers=args.layers)
    config = architecture_for(hf).config_from_hf(hf)
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    ids = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    results = {
        "benchmark": "remat_memory",
        "model": f"Qwen3-0.6B-shaped, {args.layers} layers, float32",
        "batch": args.batch, "seq": args.seq,
        "machine": {"platform": platform.platform(), "jax": jax.__version__},
        "policies": {},
    }
    for policy in ("none", "dots", "full"):
        params, static = eqx.partition(skeleton.with_remat(policy), lambda x: isinstance(x, jax.ShapeDtypeStruct))
        grad = jax.jit(lambda p, i: eqx.filter_grad(causal_lm_loss)(eqx.combine(p, static), i, i))
        memory = grad.lower(params, ids).compile().memory_analysis()
        results["policies"][policy] = {
            "temp_bytes": memory.temp_size_in_bytes,
            "argument_bytes": memory.argument_size_in_bytes,
            "output_bytes": memory.output_size_in_bytes,
        }
        print(policy, json.dumps(results["policies"][policy]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
