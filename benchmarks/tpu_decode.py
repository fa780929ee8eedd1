"""Decode speed on one accelerator chip against the HBM floor (issue 37's table).

A Qwen3-shaped model with random bfloat16 weights (`--shape 0.6b` or `4b`) decodes
`--new-tokens` tokens after a `--prompt`-token prompt at each batch size (the cache
`generate` sizes: 256 slots for 128 + 128), through the public `generate` (the
per-token figure is the difference between a run of N tokens and a run of 1
over N - 1, so prefill and compile are left out), and the jitted steps alone,
launched back to back as `generate` launches them (`decode_steps_per_call` at a
time), without the host reading the tokens. The floor of a step is the bytes it must read — every weight once (the
tied embedding once, as the head) and the live part of the KV cache, at the mean
cache length of the run — at the chip's spec bandwidth (819 GB/s on a v5e). For
each step the compiled program's own figures are kept too: XLA's count of bytes
accessed and its temporary memory. Writes `tpu_decode[_<shape>][_context_<tokens>][_int8]
[_int8_cache].json` to `benchmarks/results/` (or `$EQX_TPU_RESULTS`).

    python benchmarks/tpu_decode.py [--shape 0.6b] [--batch-sizes 1 8 64 256] [--prompt 128] [--new-tokens 128]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqx_models
from eqx_models.backends import active_backend
from eqx_models.generation import (
    MIN_PROMPT_BUCKET, Sampling, _cache_length, _decode_advancer, _jitted_step, _next_power_of_two, _prefill,
    _split_model,
)

# The TPU machine's copy of the checkout is read-only where tracked: tpu_session.sh points here at $OUT.
RESULTS = Path(os.environ.get("EQX_TPU_RESULTS") or Path(__file__).resolve().parent / "results")
SPEC_BANDWIDTH = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}

SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}


def random_model(shape: str, layers: int | None = None, dtype=jnp.bfloat16, quantize: str | None = None
                 ) -> eqx_models.CausalLM:
    sizes = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    config = eqx_models.DecoderConfig(model_type="qwen3", max_position_embeddings=40960, rope_theta=1e6,
                                      rms_norm_eps=1e-6, use_qk_norm=True, **sizes)
    def build(key):  # cast and quantize inside the jit: a float32 Qwen3-4B would not fit the chip
        model = eqx_models.CausalLM(config, key=key)
        model = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, model)
        if quantize == "int8":  # products with the dequantized weights (no rounding of the activations)
            model = eqx_models.quantize(model, 8, group_size=128, activations="float", scale_dtype=jnp.bfloat16)
        return model

    return jax.jit(build)(jax.random.key(0))


def array_bytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree) if isinstance(a, jax.Array))


def kv_bytes_per_token(config, dtype) -> int:
    """Keys and values of one position of one row, all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(model, batch: int, prompt: int, new_tokens: int, repeats: int, cache_dtype: str | None = None) -> dict:
    config = model.config
    ids = np.random.default_rng(batch).integers(0, config.vocab_size, (batch, prompt))
    run = lambda n: np.asarray(eqx_models.generate(model, ids, max_new_tokens=n, eos_token_id=[],
                                                   cache_dtype=cache_dtype))
    run(new_tokens)  # compiles prefill and step
    run(1)  # and the cache of a one-token run, where it differs
    whole = timed(lambda: run(new_tokens), repeats)
    first = timed(lambda: run(1), repeats)
    step_generate = (whole - first) / (new_tokens - 1)

    # The step alone, back to back: what the device takes, the host never waiting on a token.
    max_length = _cache_length(max(MIN_PROMPT_BUCKET, _next_power_of_two(prompt)), new_tokens)  # as generate does
    sampling = Sampling(0.0, None, None)
    state, _ = _prefill(model, jnp.asarray(ids), jnp.ones((batch, prompt), jnp.int32), jax.random.key(0),
                        max_length, sampling, (), cache_dtype)
    chunk = active_backend().decode_steps_per_call()
    advance = _decode_advancer(model, sampling, (), 0, chunk)
    state, tokens = advance(state, chunk)  # compiles
    tokens.block_until_ready()
    calls = max(1, (new_tokens - 1) // chunk - 1)
    start = time.perf_counter()
    for _ in range(calls):
        state, tokens = advance(state, chunk)
    tokens.block_until_ready()
    step_device = (time.perf_counter() - start) / (calls * chunk)

    arrays, treedef, static = _split_model(model)
    compiled = _jitted_step(treedef, static, sampling, (), 0).lower(arrays, state).compile()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost

    weights = array_bytes(model)
    # The cache's bytes per slot (an int8 cache's scales included), over the live slots.
    kv = model.cache_bytes(batch, max_length, cache_dtype) / max_length * (prompt + new_tokens / 2)
    return {
        "batch": batch,
        "steps_per_call": chunk,
        "step_ms_generate": round(step_generate * 1e3, 3),
        "step_ms_device": round(step_device * 1e3, 3),
        "tokens_per_s_generate": round(batch / step_generate, 1),
        "tokens_per_s_device": round(batch / step_device, 1),
        "floor_bytes": int(weights + kv),
        "weight_bytes": int(weights),
        "kv_bytes_mean": int(kv),
        "xla_bytes_accessed": int(cost.get("bytes accessed", -1)),
        "temp_bytes": int(getattr(memory, "temp_size_in_bytes", -1)),
        "prefill_and_first_token_ms": round(first * 1e3, 2),
    }


def with_floor(row: dict, bandwidth: float | None) -> dict:
    """`row` with its floor in ms and each step time's fraction of it (where the chip's bandwidth is known)."""
    if bandwidth and "floor_bytes" in row:
        floor = row["floor_bytes"] / bandwidth
        row["floor_ms"] = round(floor * 1e3, 3)
        row["fraction_of_floor_generate"] = round(floor / (row["step_ms_generate"] / 1e3), 3)
        row["fraction_of_floor_device"] = round(floor / (row["step_ms_device"] / 1e3), 3)
    return row


def write_result(result: dict, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights (eqx_models.quantize)")
    parser.add_argument("--cache-dtype", choices=["int8"], default=None, help="the KV cache's dtype (the model's)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    device = jax.devices()[0]
    bandwidth = SPEC_BANDWIDTH.get(device.device_kind)
    model = random_model(args.shape, args.layers, quantize=args.quantize)
    rows = []
    for batch in args.batch_sizes:
        try:
            row = measure(model, batch, args.prompt, args.new_tokens, args.repeats, args.cache_dtype)
        except Exception as error:  # a batch that does not fit is a result too
            row = {"batch": batch, "error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(json.dumps(with_floor(row, bandwidth)), flush=True)
        rows.append(row)
    result = {
        "benchmark": "tpu_decode",
        "device": device.device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.node(),
        "shape": f"Qwen3-{args.shape.upper()}",
        "layers": model.config.num_hidden_layers,
        "dtype": "bfloat16",
        "quantize": args.quantize,
        "cache_dtype": args.cache_dtype or "bfloat16",
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "spec_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }
    parts = ["tpu_decode"] + ([args.shape] if args.shape != "0.6b" else [])
    if (args.prompt, args.new_tokens) != (128, 128):
        parts.append(f"context_{args.prompt + args.new_tokens}")
    parts += ([args.quantize] if args.quantize else []) + ([f"{args.cache_dtype}_cache"] if args.cache_dtype else [])
    write_result(result, args.output or RESULTS / f"{'_'.join(parts)}.json")


if __name__ == "__main__":
    main()
