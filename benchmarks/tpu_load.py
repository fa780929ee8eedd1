"""Loading a Qwen3 checkpoint onto one accelerator chip, then decoding (issue 37).

Writes a Qwen3-shaped checkpoint with random bfloat16 weights as Hugging Face lays
it out (safetensors shards, an index, config.json; the Qwen tokenizer fixture where
it is found), times `from_pretrained` on it (`--quantize int8`: quantized while
loading, as a checkpoint larger than the chip must be), and measures decode at batch
1 against the HBM floor as `tpu_decode.py` does. Qwen3-8B in bfloat16 (16.4 GB) does
not fit a v5e's 15.75 GiB; in int8 it must.

    python benchmarks/tpu_load.py --shape 8b --quantize int8      # results/tpu_load_8b_int8.json
    python benchmarks/tpu_load.py --shape 0.6b --write-only DIR   # a checkpoint for first_generate.py
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

import eqx_models
from eqx_models.safetensors_file import write_safetensors

from tpu_decode import RESULTS, SPEC_BANDWIDTH, measure, with_floor, write_result

TOKENIZER = Path(os.environ.get("EQX_MODELS_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"),
                 "qwen-tokenizer")
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=False),
}
SHARD_BYTES = 2 << 30


def hf_config(shape: str, layers: int | None) -> dict:
    sizes = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", **sizes)


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face's names and shapes of a Qwen3 checkpoint."""
    hidden, inner, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes += [
            (prefix + "self_attn.q_proj.weight", (q, hidden)), (prefix + "self_attn.k_proj.weight", (kv, hidden)),
            (prefix + "self_attn.v_proj.weight", (kv, hidden)), (prefix + "self_attn.o_proj.weight", (hidden, q)),
            (prefix + "self_attn.q_norm.weight", (head,)), (prefix + "self_attn.k_norm.weight", (head,)),
            (prefix + "mlp.gate_proj.weight", (inner, hidden)), (prefix + "mlp.up_proj.weight", (inner, hidden)),
            (prefix + "mlp.down_proj.weight", (hidden, inner)),
            (prefix + "input_layernorm.weight", (hidden,)), (prefix + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def write_checkpoint(folder: Path, config: dict) -> None:
    """Random weights (0.02 times a normal; norms 1) in shards of about 2 GiB."""
    folder.mkdir(parents=True, exist_ok=True)
    # One pool of random values, repeated to fill each tensor: drawing 8 billion
    # normals would take minutes, and the speed measured does not depend on them.
    pool = (np.random.default_rng(0).standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    shards, current, size = [], [], 0
    for name, shape in tensor_shapes(config):
        array = np.ones(shape, ml_dtypes.bfloat16) if len(shape) == 1 else np.resize(pool, shape)
        current.append((name, array))
        size += array.nbytes
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, shard, {"format": "pt"})
        weight_map.update({name: file for name, _ in shard})
    total = sum(array.nbytes for shard in shards for _, array in shard)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if TOKENIZER.is_dir():
        for file in TOKENIZER.glob("tokenizer*.json"):
            shutil.copy(file, folder / file.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    parser.add_argument("--quantize", choices=["int8"], default=None)
    parser.add_argument("--folder", type=Path, default=None, help="where the checkpoint goes (a temporary folder)")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoint to --folder and stop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    config = hf_config(args.shape, args.layers)
    folder = args.folder or Path("/tmp") / f"eqx-random-qwen3-{args.shape}"
    start = time.perf_counter()
    if not (folder / "config.json").exists():
        write_checkpoint(folder, config)
    write_s = time.perf_counter() - start
    print(f"checkpoint in {folder} ({write_s:.1f} s)", flush=True)
    if args.write_only:
        return

    start = time.perf_counter()
    model = eqx_models.from_pretrained(folder, dtype="bfloat16", quantize=args.quantize)
    jax.block_until_ready(model)
    load_s = time.perf_counter() - start
    device = jax.devices()[0]
    row = {"load_s": round(load_s, 2), "checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
    try:
        row.update(measure(model, 1, 128, 128, args.repeats))
    except Exception as error:  # a model that loads but cannot decode is a result too
        row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    bandwidth = SPEC_BANDWIDTH.get(device.device_kind)
    print(json.dumps(with_floor(row, bandwidth)), flush=True)
    result = {"benchmark": "tpu_load", "device": device.device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "shape": f"Qwen3-{args.shape.upper()}", "layers": config["num_hidden_layers"],
              "quantize": args.quantize, "spec_bandwidth_bytes_per_s": bandwidth, "rows": [row]}
    name = "_".join(["tpu_load", args.shape] + ([args.quantize] if args.quantize else []))
    write_result(result, args.output or RESULTS / f"{name}.json")


if __name__ == "__main__":
    main()
