"""MoE decode cost follows the experts a token uses, not how many there are.

Two Qwen3-MoE-shaped models that differ only in `num_experts` (8 and 64) with the
same `num_experts_per_tok` (8): decode steps should cost about the same, since
each token reads the weights of 8 experts either way. `transformers` runs the same
checkpoints in the same run. Writes `benchmarks/results/moe_decode.json`.

    python benchmarks/moe_decode.py [--layers 8] [--experts 8 64] [--new-tokens 16]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

import eqx_models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import RESULTS, bandwidth_probes, measure, prepare_ours, prepare_transformers  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=256,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--output", type=Path, default=RESULTS / "moe_decode.json")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    results = {"benchmark": "moe_decode", "shape": {**SHAPE, "num_hidden_layers": args.layers}, "runs": []}
    prompt = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, args.prompt_length))
    probes = bandwidth_probes()
    for experts in args.experts:
        config = AutoConfig.for_model("qwen3_moe", **SHAPE, num_hidden_layers=args.layers, num_experts=experts)
        with tempfile.TemporaryDirectory() as folder:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            model = eqx_models.from_pretrained(folder, dtype=jnp.float32)
        expert_bytes = sum(
            leaf.nbytes for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0] if "experts" in jax.tree_util.keystr(path)
        )
        timed, _ = measure(
            {
                "eqx_models": prepare_ours(model, prompt, args.new_tokens),
                "transformers": (*prepare_transformers(reference, prompt), {}),
            },
            1,
            args.prompt_length,
            args.new_tokens,
            probes,
        )
        run = {
            "num_experts": experts,
            "expert_weight_bytes": expert_bytes,
            "active_expert_bytes_per_token": expert_bytes * SHAPE["num_experts_per_tok"] // experts,
            **timed,
        }
        results["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
        del model, reference
    first, last = results["runs"][0], results["runs"][-1]
    for name in ("eqx_models", "transformers"):
        results[f"{name}_decode_ratio_{last['num_experts']}_vs_{first['num_experts']}_experts"] = (
            last[name]["decode_ms_per_step"] / first[name]["decode_ms_per_step"]
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print({k: v for k, v in results.items() if "ratio" in k}, f"wrote {args.output}")


if __name__ == "__main__":
    main()
