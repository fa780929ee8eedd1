"""Mixture-of-experts speed on one accelerator chip against its limits (issue 37's
MoE rows): a Qwen3-30B-A3B-shaped model cut to `--layers` layers (6), random
bfloat16 weights.

- forward over `--tokens` tokens (2,048) through `model(ids)`: the fraction of the
  chip's peak bfloat16 FLOP/s (197 TFLOP/s on a v5e) on the active FLOPs (2 per
  active weight per token: attention, router, the `top_k` experts, the head; plus
  attention's scores and weighted sum over the causal half);
- decode at each `--batch-sizes` through `generate` (as `tpu_decode.py` measures
  it): the fraction of the floor of the bytes a step must read, with the experts'
  bytes counted for the experts the batch touches (expected distinct experts per
  layer when each token picks `top_k` of `num_experts` uniformly, which random
  weights approach).

`--experts blocks` measures the loop over blocks of assignments the grouped
product replaced, `--row-tile` / `--weight-tiles` other tiles of the grouped
kernel. Writes `tpu_moe[_<variant>].json` to `benchmarks/results/` (or
`$EQX_TPU_RESULTS`).

    python benchmarks/tpu_moe.py [--layers 6] [--tokens 2048] [--batch-sizes 1 64]
"""

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqx_models
from eqx_models.backends.tpu import Tpu
from eqx_models.backends.tpu import experts as tpu_experts
from tpu_decode import RESULTS, SPEC_BANDWIDTH, array_bytes, kv_bytes_per_token, measure, timed, write_result

PEAK_BF16_FLOPS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12}

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)


def random_moe(layers: int) -> eqx_models.CausalLM:
    config = eqx_models.DecoderConfig(model_type="qwen3_moe", max_position_embeddings=40960, rope_theta=1e6,
                                      rms_norm_eps=1e-6, use_qk_norm=True,
                                      **dict(QWEN3_30B_A3B, num_hidden_layers=layers))
    def build(key):  # cast inside the jit: the float32 model would not fit the chip
        model = eqx_models.CausalLM(config, key=key)
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, model)

    return jax.jit(build)(jax.random.key(0))


def expert_bytes(model) -> int:
    return array_bytes(model.model.layers.mlp.experts)


def active_flops(model, tokens: int) -> float:
    """2 FLOPs per active weight per token, plus causal attention's two products."""
    config = model.config
    experts = expert_bytes(model) // 2  # bfloat16: parameters
    active_experts = experts * config.num_experts_per_tok / config.num_experts
    others = array_bytes(model) // 2 - experts - model.model.embed_tokens.weight.size  # the lookup is no product
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * tokens * tokens / 2
    return 2 * tokens * (others + active_experts) + attention


def touched_experts(batch: int, top_k: int, num_experts: int) -> float:
    """Expected distinct experts per layer for `batch` tokens each choosing `top_k` uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def forward_row(model, tokens: int, repeats: int, peak: float | None) -> dict:
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (1, tokens)))
    forward = jax.jit(lambda m, i: m(i)[0])  # every position's logits: the head counts in the FLOPs
    forward(model, ids).block_until_ready()  # compiles
    seconds = timed(lambda: forward(model, ids).block_until_ready(), repeats)
    flops = active_flops(model, tokens)
    row = {"tokens": tokens, "forward_ms": round(seconds * 1e3, 3), "tokens_per_s": round(tokens / seconds, 1),
           "active_flops": flops}
    if peak:
        row["fraction_of_peak"] = round(flops / seconds / peak, 3)
    return row


def decode_row(model, batch: int, prompt: int, new_tokens: int, repeats: int, bandwidth: float | None) -> dict:
    config = model.config
    row = measure(model, batch, prompt, new_tokens, repeats)
    touched = touched_experts(batch, config.num_experts_per_tok, config.num_experts) / config.num_experts
    kv = kv_bytes_per_token(config, jnp.bfloat16) * batch * (prompt + new_tokens / 2)
    embedding = model.model.embed_tokens.weight  # only the batch's rows are read
    floor_bytes = (array_bytes(model) - expert_bytes(model) * (1 - touched) - array_bytes(embedding)
                   + batch * config.hidden_size * embedding.dtype.itemsize + kv)
    row.update(floor_bytes=int(floor_bytes), experts_touched_per_layer=round(touched * config.num_experts, 1))
    if bandwidth:
        floor = floor_bytes / bandwidth
        row.update(floor_ms=round(floor * 1e3, 3),
                   fraction_of_floor_generate=round(floor / (row["step_ms_generate"] / 1e3), 3),
                   fraction_of_floor_device=round(floor / (row["step_ms_device"] / 1e3), 3))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", choices=["grouped", "blocks"], default="grouped",
                        help="the TPU backend's grouped product, or the loop over blocks it replaced (to compare)")
    parser.add_argument("--row-tile", type=int, default=None, help="the grouped kernel's largest row tile")
    parser.add_argument("--weight-tiles", type=int, nargs="+", default=None, help="its weight tile widths")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.experts == "blocks":
        Tpu.groups_experts = lambda self, stack: False
    if args.row_tile:
        tpu_experts.MAX_ROW_TILE = args.row_tile
    if args.weight_tiles:
        tpu_experts.WEIGHT_TILES = tuple(args.weight_tiles)
    variant = "".join([f"_{args.experts}" if args.experts != "grouped" else "",
                       f"_rows{args.row_tile}" if args.row_tile else "",
                       "_tiles" + "-".join(map(str, args.weight_tiles)) if args.weight_tiles else ""])
    output = args.output or RESULTS / f"tpu_moe{variant}.json"

    device = jax.devices()[0]
    model = random_moe(args.layers)
    start = time.perf_counter()
    forward = forward_row(model, args.tokens, args.repeats, PEAK_BF16_FLOPS.get(device.device_kind))
    forward["first_call_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(forward), flush=True)
    decode = []
    for batch in args.batch_sizes:
        try:
            row = decode_row(model, batch, args.prompt, args.new_tokens, args.repeats,
                             SPEC_BANDWIDTH.get(device.device_kind))
        except Exception as error:  # a batch that does not fit is a result too
            row = {"batch": batch, "error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(json.dumps(row), flush=True)
        decode.append(row)
    result = {"benchmark": "tpu_moe", "device": device.device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "host": platform.node(), "shape": "Qwen3-30B-A3B", "layers": args.layers,
              "dtype": "bfloat16", "experts": args.experts,
              "row_tile": tpu_experts.MAX_ROW_TILE, "weight_tiles": list(tpu_experts.WEIGHT_TILES),
              "forward": forward, "decode": decode}
    write_result(result, output)


if __name__ == "__main__":
    main()
