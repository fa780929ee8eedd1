"""Decode and prefill of the compressed-cache and recurrent-state families against
`transformers`, measured in the same run: a DeepSeek-V2-Lite-shaped model (Multi-head
Latent Attention) and a Qwen3-Next-shaped one (Gated DeltaNet + gated attention).

Random float32 weights, made by `transformers`, saved and loaded by both libraries.
Each model keeps its release's per-layer shapes, vocabulary and attention; the
depth (and Qwen3-Next's expert count) is cut so two float32 copies fit in this
machine's memory: DeepSeek-V2-Lite 3 of 27 layers (one dense, two MoE, all 64
experts); Qwen3-Next 8 of 48 layers (two blocks of 3 DeltaNet + 1 attention) and 32
of its 512 experts, with its 10 routed per token (the decode reads of an MoE follow
the experts a token uses, see `moe_decode.py`). The libraries take turns; the
floor is the bytes a decode step must read over the read bandwidth measured in the
same turns. Writes `benchmarks/results/zoo_decode.json`.

    python benchmarks/zoo_decode.py [--models deepseek_v2_lite qwen3_next] [--prompt-length 128] [--new-tokens 32]
"""

import argparse
import json
import os
import platform
import subprocess
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

SHAPES = {
    "deepseek_v2_lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, tie_word_embeddings=False, topk_method="greedy",
        rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                          original_max_position_embeddings=4096),
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, num_experts=32, num_experts_per_tok=10, norm_topk_prob=True,
        full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, partial_rotary_factor=0.25,
        max_position_embeddings=262144, rope_theta=10000000, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}


def decode_read_bytes(model) -> int:
    """Bytes one decode step must read at least: every weight but the unused
    experts' (each MoE layer reads `num_experts_per_tok` experts) and the embedding
    table (one row)."""
    config = model.config
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        name = jax.tree_util.keystr(path)
        if not hasattr(leaf, "nbytes") or "embed_tokens" in name:
            continue
        share = config.num_experts_per_tok / config.num_experts if ".experts." in name else 1.0
        total += leaf.nbytes * share
    return int(total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=RESULTS / "zoo_decode.json")
    args = parser.parse_args()

    if len(args.models) > 1:
        # One process per model: freed arrays and torch's allocator do not give two
        # models' memory back to the system in time for the next.
        merged = None
        with tempfile.TemporaryDirectory() as scratch:
            for name in args.models:
                part = Path(scratch) / f"{name}.json"
                command = [sys.executable, __file__, "--models", name, "--prompt-length", str(args.prompt_length),
                           "--new-tokens", str(args.new_tokens), "--output", str(part)]
                subprocess.run(command, check=True)
                run = json.loads(part.read_text())
                merged = run if merged is None else {**merged, "runs": merged["runs"] + run["runs"]}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(merged, indent=2) + "\n")
        print(f"wrote {args.output}")
        return

    from transformers import AutoConfig, AutoModelForCausalLM

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    results = {
        "benchmark": "zoo_decode", "dtype": "float32", "batch": 1, "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens, "threads": threads, "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__, "torch": torch.__version__, "runs": [],
    }
    probes = bandwidth_probes()
    for name in args.models:
        shape = dict(SHAPES[name])
        model_type = shape.pop("model_type")
        config = AutoConfig.for_model(model_type, **shape)
        prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], (1, args.prompt_length))
        with tempfile.TemporaryDirectory() as folder:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            model = eqx_models.from_pretrained(folder, dtype=jnp.float32, map_weights=False)
        # Same weights, same greedy tokens: checked before timing.
        ours_tokens = eqx_models.generate(model, prompt, max_new_tokens=8, eos_token_id=[])[0].tolist()
        with torch.inference_mode():
            theirs = reference.generate(torch.tensor(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        timed, bandwidth = measure(
            {"eqx_models": prepare_ours(model, prompt, args.new_tokens),
             "transformers": (*prepare_transformers(reference, prompt), {})},
            1, args.prompt_length, args.new_tokens, probes,
        )
        read = decode_read_bytes(model)
        run = {
            "model": name, "shape": SHAPES[name], "weight_bytes": sum(l.nbytes for l in jax.tree.leaves(model)),
            "decode_read_bytes": read, "read_bandwidth_gb_s": bandwidth,
            "floor_tokens_per_s": bandwidth * 1e9 / read,
            "greedy_tokens_equal": ours_tokens == theirs[0, args.prompt_length:].tolist(),
            **timed,
        }
        run["decode_speedup_vs_transformers"] = (
            run["eqx_models"]["decode_tokens_per_s"] / run["transformers"]["decode_tokens_per_s"]
        )
        results["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
        del model, reference
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
