"""The peer of issue 37's decode table, measured on the same chip in the same session:
jax-llm-examples' Llama 3 code (github.com/jax-ml/jax-llm-examples, `llama3/`) at
the Qwen3-0.6B shape (untied head, no QK norm), random bfloat16 weights, bfloat16
cache, its own Pallas kernels (ragged decode attention, splash for the prompt).

Its code is not part of this repository. Point `PEER_LLAMA3` at a checkout's
`llama3/` folder (on the TPU machine: an ignored folder carried with the checkout,
for instance `git -C <mirror> archive HEAD llama3 | tar -x -C .peer`). The modules
it imports only to read and write checkpoints (tensorstore through JAX's array
serialization, etils) are stood in for where they are not installed: random
weights are made in memory.

Decode is timed as `tpu_decode.py` times the steps alone: the peer's jitted
`decode_step` launched back to back after a 128-token prefill into a cache of 256
slots, the host reading no token until the end. Writes `tpu_peer.json` to
`benchmarks/results/` (or `$EQX_TPU_RESULTS`).

    PEER_LLAMA3=.peer/llama3 python benchmarks/tpu_peer.py [--batch-sizes 1 8 64 256]
"""

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpu_decode import RESULTS, SHAPES, SPEC_BANDWIDTH, write_result



def _stand_in(name: str, **attributes) -> None:
    """An empty module for one the peer imports for checkpoints only, where it does not import."""
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def import_peer():
    folder = os.environ.get("PEER_LLAMA3")
    if not folder or not (Path(folder) / "llama3_jax").is_dir():
        raise SystemExit("Set PEER_LLAMA3 to a jax-llm-examples checkout's llama3/ folder (see this script's help).")
    _stand_in("etils")
    _stand_in("etils.epath", Path=pathlib.Path)
    _stand_in("jax.experimental.array_serialization.pytree_serialization")
    sys.path.insert(0, folder)
    from llama3_jax import model

    return model


def peer_config(peer, layers: int | None, max_seq_len: int, kernels: bool):
    shape = SHAPES["0.6b"]
    mesh = jax.make_mesh((1, 1, 1), ("x", "y", "z"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    return peer.Config(
        embed=shape["hidden_size"], ffw_size=shape["intermediate_size"], q_heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"], num_layers=layers or shape["num_hidden_layers"],
        head_dim=shape["head_dim"], vocab_size=shape["vocab_size"], max_seq_len=max_seq_len, causal=True,
        use_prefill_attn_kernel=kernels, use_decode_attn_kernel=kernels, dtype=jnp.bfloat16, mesh=mesh,
        rope_theta=1e6, quant_layer=False, quant_cache=False,
    )


def measure(peer, cfg, weights, batch: int, prompt: int, new_tokens: int) -> dict:
    ids = np.random.default_rng(batch).integers(1, cfg.vocab_size, (batch, prompt))
    with jax.sharding.set_mesh(cfg.mesh):
        def prefilled():
            cache = peer.KVCache.init(jax.random.key(1), cfg, batch)
            tokens, _, cache = peer.prefill(jnp.asarray(ids), weights, cache, cfg)
            return tokens[:, cache.iter - 1: cache.iter], cache

        start = time.perf_counter()
        tokens, cache = prefilled()
        jax.block_until_ready(tokens)
        first_s = time.perf_counter() - start
        tokens, cache = peer.decode_step(tokens, weights, cache, cfg)  # compiles
        jax.block_until_ready(tokens)
        best = float("inf")
        for _ in range(3):
            tokens, cache = prefilled()
            jax.block_until_ready(tokens)
            start = time.perf_counter()
            for _ in range(new_tokens - 1):
                tokens, cache = peer.decode_step(tokens, weights, cache, cfg)
            jax.block_until_ready(tokens)
            best = min(best, (time.perf_counter() - start) / (new_tokens - 1))
    return {"batch": batch, "step_ms_device": round(best * 1e3, 3), "tokens_per_s_device": round(batch / best, 1),
            "first_prefill_s": round(first_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    parser.add_argument("--output", type=Path, default=RESULTS / "tpu_peer.json")
    args = parser.parse_args()

    peer = import_peer()
    on_chip = jax.default_backend() == "tpu"
    cfg = peer_config(peer, args.layers, args.prompt + args.new_tokens, kernels=on_chip)
    with jax.sharding.set_mesh(cfg.mesh):
        weights = peer.Weights.init(jax.random.key(0), cfg)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weights))
    device = jax.devices()[0]
    bandwidth = SPEC_BANDWIDTH.get(device.device_kind)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * 2
    rows = []
    for batch in args.batch_sizes:
        try:
            row = measure(peer, cfg, weights, batch, args.prompt, args.new_tokens)
            row["floor_bytes"] = int(weight_bytes + kv_per_token * batch * (args.prompt + args.new_tokens / 2))
            if bandwidth:
                row["fraction_of_floor_device"] = round(row["floor_bytes"] / bandwidth / (row["step_ms_device"] / 1e3), 3)
        except Exception as error:  # a batch that does not fit is a result too
            row = {"batch": batch, "error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"benchmark": "tpu_peer", "peer": "jax-llm-examples llama3 (Qwen3-0.6B shape, untied head, no QK norm)",
              "device": device.device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
              "layers": cfg.num_layers, "dtype": "bfloat16", "prompt": args.prompt, "new_tokens": args.new_tokens,
              "weight_bytes": weight_bytes, "spec_bandwidth_bytes_per_s": bandwidth, "rows": rows}
    write_result(result, args.output)


if __name__ == "__main__":
    main()
