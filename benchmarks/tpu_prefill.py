"""Prefill speed on one accelerator chip against its peak (issue 37's prefill row):
a Qwen3-shaped model (`--shape 4b`, from `tpu_decode.py`'s shapes) with random
bfloat16 weights runs `model.prefill` over `--tokens` tokens (2,048) into a new
cache, keeping the last position's logits as `generate` does.

The FLOPs counted are 2 per weight per token for every weight but the embedding
table (a lookup), the head once per row (one position's logits), and attention's
two products over the causal half of the square. Their rate over the chip's
peak bfloat16 FLOP/s (197 TFLOP/s on a v5e) is the fraction of peak. Writes
`benchmarks/results/tpu_prefill.json`.

    python benchmarks/tpu_prefill.py [--shape 4b] [--tokens 2048] [--batch 1]
"""

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpu_decode import RESULTS, SHAPES, random_model, timed, write_result

PEAK_BF16_FLOPS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12}


def prefill_flops(model, batch: int, tokens: int) -> float:
    config = model.config
    parameters = sum(a.size for a in jax.tree.leaves(model) if isinstance(a, jax.Array))
    embedding = model.model.embed_tokens.weight.size
    head = config.vocab_size * config.hidden_size
    body = parameters - embedding - (0 if config.tie_word_embeddings else head)
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * tokens * tokens / 2
    return batch * (2 * body * tokens + 2 * head + attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS / "tpu_prefill.json")
    args = parser.parse_args()

    device = jax.devices()[0]
    model = random_model(args.shape, args.layers)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.tokens)))
    prefill = lambda: model.prefill(ids, args.tokens, logits_to_keep=1)[0].block_until_ready()
    start = time.perf_counter()
    prefill()  # compiles
    first_call = time.perf_counter() - start
    seconds = timed(prefill, args.repeats)
    flops = prefill_flops(model, args.batch, args.tokens)
    peak = PEAK_BF16_FLOPS.get(device.device_kind)
    row = {"batch": args.batch, "tokens": args.tokens, "prefill_ms": round(seconds * 1e3, 3),
           "tokens_per_s": round(args.batch * args.tokens / seconds, 1), "flops": flops,
           "first_call_s": round(first_call, 1)}
    if peak:
        row["fraction_of_peak"] = round(flops / seconds / peak, 3)
    print(json.dumps(row), flush=True)
    result = {"benchmark": "tpu_prefill", "device": device.device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "host": platform.node(), "shape": f"Qwen3-{args.shape.upper()}",
              "layers": model.config.num_hidden_layers, "dtype": "bfloat16", "peak_flops": peak, "rows": [row]}
    write_result(result, args.output)


if __name__ == "__main__":
    main()
