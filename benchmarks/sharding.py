"""Decode on 8 CPU devices under each sharding preset, next to one device, and the
collectives XLA inserted into the decode step.

A Qwen3-shaped dense model and a Qwen3-MoE-shaped one (random float32 weights,
created with `transformers`) are loaded with `from_pretrained(..., mesh=mesh)` for
each preset mesh, and a batch of 8 prompts is prefilled and decoded step by step.
For each run: ms per decode step, tokens/s, the largest logit difference from the
single-device model, whether the greedy tokens match, and the count of all-reduce /
all-gather / reduce-scatter / all-to-all / collective-permute ops in the compiled
decode step (deterministic; 8 "devices" on a 2-core machine share the same cores,
so the times show overhead, not scaling). Writes `benchmarks/results/sharding.json`.

    python benchmarks/sharding.py [--new-tokens 16] [--layers 4]
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from eqx_models import from_pretrained  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DENSE = dict(
    vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
)
MOE = dict(DENSE, intermediate_size=3072, moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4,
           norm_topk_prob=True)
MESHES = {
    "dp8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "tp2_dp4": {"data": 4, "tensor": 2},
    "tp4_fsdp2": {"fsdp": 2, "tensor": 4},
    "ep4_dp2": {"data": 2, "expert": 4},
}


@eqx.filter_jit
def prefill(model, ids, cache):
    logits, cache = model(ids, cache, logits_to_keep=1)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), logits[:, -1], cache


@eqx.filter_jit(donate="all-except-first")
def decode(model, token, cache):
    logits, cache = model(token[:, None], cache)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), logits[:, -1], cache


def collectives(model, token, cache) -> dict[str, int]:
    """Collective ops in the compiled decode step (the scan body counts once)."""
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(lambda params, token, cache: eqx.combine(params, static)(token[:, None], cache))
    text = step.lower(params, token, cache).compile().as_text()
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text)) for op in COLLECTIVES}


def run(model, ids: np.ndarray, new_tokens: int) -> dict:
    cache = model.init_cache(ids.shape[0], ids.shape[1] + new_tokens + 1)
    token, first_logits, cache = prefill(model, ids, cache)
    counts = collectives(model, token, cache)
    token, _, cache = decode(model, token, cache)  # compile
    tokens, logits = [np.asarray(token)], []
    started = time.perf_counter()
    for _ in range(new_tokens):
        token, step_logits, cache = decode(model, token, cache)
        tokens.append(np.asarray(token))
        logits.append(step_logits)
    elapsed = time.perf_counter() - started
    return {
        "ms_per_step": 1e3 * elapsed / new_tokens,
        "tokens_per_s": ids.shape[0] * new_tokens / elapsed,
        "collectives_per_decode_step": counts,
        "tokens": np.stack(tokens, 1),
        "logits": np.concatenate([np.asarray(first_logits)[:, None], np.stack([np.asarray(l) for l in logits], 1)], 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "sharding.json")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    assert jax.device_count() == 8, jax.devices()
    ids = np.random.default_rng(0).integers(0, DENSE["vocab_size"], (8, 32)).astype(np.int32)
    results = {
        "benchmark": "sharding",
        "devices": "8 XLA CPU devices (--xla_force_host_platform_device_count=8) on one machine",
        "batch": ids.shape[0], "prompt_length": ids.shape[1], "new_tokens": args.new_tokens,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        for name, model_type, shape in (("qwen3", "qwen3", DENSE), ("qwen3_moe", "qwen3_moe", MOE)):
            path = Path(folder) / name
            config = AutoConfig.for_model(model_type, **shape, num_hidden_layers=args.layers)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
            single = run(from_pretrained(path, dtype=jnp.float32), ids, args.new_tokens)
            entry = {"layers": args.layers, "config": shape, "single_device": {
                k: v for k, v in single.items() if k not in ("tokens", "logits")}}
            for preset, mesh_shape in MESHES.items():
                if "expert" in mesh_shape and "num_experts" not in shape:
                    continue
                mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
                sharded = run(from_pretrained(path, dtype=jnp.float32, mesh=mesh), ids, args.new_tokens)
                entry[preset] = {
                    "mesh": mesh_shape,
                    **{k: v for k, v in sharded.items() if k not in ("tokens", "logits")},
                    "max_logit_diff_vs_single_device": float(np.max(np.abs(sharded["logits"] - single["logits"]))),
                    "greedy_tokens_equal": bool((sharded["tokens"] == single["tokens"]).all()),
                }
                print(name, preset, json.dumps(entry[preset]), flush=True)
            results["models"][name] = entry
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
