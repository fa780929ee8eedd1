"""How fast XLA streams a decode step's layer weights on the chip, by storage layout.

A small-batch decode step is the layer products reading every weight once; at
batch 1 on a v5e they ran at 540-660 GB/s, short of the 0.90 of the 819 GB/s floor
issue 37 asks. This measures, for the Qwen3-0.6B and 4B layer shapes stacked as a
scanned model stacks them, one pass of the layers' products (q, k, v, o, gate, up,
down in their data order, nothing else) for each storage:

- `rows`: as Hugging Face and this library store them, `[layers, out, in]`;
- `columns`: `[layers, in, out]` (the product contracts the leading axis);
- `joined`: q/k/v as one `[layers, q + k + v, in]` and gate/up as one
  `[layers, 2 * intermediate, in]` (three products a layer instead of seven);
- `joined columns`: both.

and a sum over the same bytes (what the chip reads when nothing but reading is
asked). Writes `tpu_matvec.json` to `benchmarks/results/` (or `$EQX_TPU_RESULTS`).

    python benchmarks/tpu_matvec.py [--shape 0.6b 4b] [--batch-sizes 1 8]
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpu_decode import RESULTS, SHAPES, SPEC_BANDWIDTH, write_result



LAYERS: dict[str, int] = {}  # --layers: fewer than the shape's (a quick check)


def widths(shape: str) -> dict:
    s = SHAPES[shape]
    return dict(layers=LAYERS.get(shape, s["num_hidden_layers"]), hidden=s["hidden_size"], inner=s["intermediate_size"],
                q=s["num_attention_heads"] * s["head_dim"], kv=s["num_key_value_heads"] * s["head_dim"])


def weights(shape: str, joined: bool, columns: bool) -> dict:
    w = widths(shape)
    key = iter(jax.random.split(jax.random.key(0), 8))

    def stack(out, inner):
        size = (w["layers"], inner, out) if columns else (w["layers"], out, inner)
        return jax.random.normal(next(key), size, jnp.bfloat16) * 0.02

    products = {"o": stack(w["hidden"], w["q"]), "down": stack(w["hidden"], w["inner"])}
    if joined:
        products |= {"qkv": stack(w["q"] + 2 * w["kv"], w["hidden"]), "gate_up": stack(2 * w["inner"], w["hidden"])}
    else:
        products |= {"q": stack(w["q"], w["hidden"]), "k": stack(w["kv"], w["hidden"]),
                     "v": stack(w["kv"], w["hidden"]), "gate": stack(w["inner"], w["hidden"]),
                     "up": stack(w["inner"], w["hidden"])}
    return products


def layer_pass(shape: str, joined: bool, columns: bool):
    """The layers' products over a scan, in a decode step's data order."""
    w = widths(shape)
    spec = "bi,io->bo" if columns else "bi,oi->bo"
    product = lambda x, m: jnp.einsum(spec, x, m, preferred_element_type=jnp.float32).astype(x.dtype)

    def one_layer(x, layer):
        if joined:
            qkv = product(x, layer["qkv"])
            q, k, v = jnp.split(qkv, [w["q"], w["q"] + w["kv"]], axis=-1)
            gate, up = jnp.split(product(x, layer["gate_up"]), 2, axis=-1)
        else:
            q, k, v = product(x, layer["q"]), product(x, layer["k"]), product(x, layer["v"])
            gate, up = product(x, layer["gate"]), product(x, layer["up"])
        # k and v feed the next layer only through a scalar: their products cannot be dropped.
        attended = q * (1 + jnp.mean(k, -1, keepdims=True) * jnp.mean(v, -1, keepdims=True))
        x = x + product(attended, layer["o"])
        return x + product(jax.nn.silu(gate) * up, layer["down"]), None

    return jax.jit(lambda x, stacks: jax.lax.scan(one_layer, x, stacks)[0])


def timed(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["0.6b", "4b"], choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shapes (a quick check)")
    parser.add_argument("--output", type=Path, default=RESULTS / "tpu_matvec.json")
    args = parser.parse_args()
    if args.layers:
        LAYERS.update({shape: args.layers for shape in args.shape})

    device = jax.devices()[0]
    bandwidth = SPEC_BANDWIDTH.get(device.device_kind)
    rows = []
    for shape in args.shape:
        for joined, columns in [(False, False), (False, True), (True, False), (True, True)]:
            stacks = weights(shape, joined, columns)
            nbytes = sum(a.size * a.dtype.itemsize for a in stacks.values())
            run = layer_pass(shape, joined, columns)
            for batch in args.batch_sizes:
                x = jnp.ones((batch, widths(shape)["hidden"]), jnp.bfloat16)
                seconds = timed(run, x, stacks)
                row = {"shape": shape, "storage": ("joined " if joined else "") + ("columns" if columns else "rows"),
                       "batch": batch, "weight_bytes": nbytes, "ms": round(seconds * 1e3, 4),
                       "gb_per_s": round(nbytes / seconds / 1e9, 1)}
                if bandwidth:
                    row["fraction_of_spec"] = round(nbytes / seconds / bandwidth, 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
            if not joined and not columns:  # the chip reading the same bytes and nothing else
                total = jax.jit(lambda s: sum(jnp.sum(a, dtype=jnp.float32) for a in s.values()))
                seconds = timed(total, stacks)
                row = {"shape": shape, "storage": "sum of the weights", "weight_bytes": nbytes,
                       "ms": round(seconds * 1e3, 4), "gb_per_s": round(nbytes / seconds / 1e9, 1)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            del stacks
    result = {"benchmark": "tpu_matvec", "device": device.device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "dtype": "bfloat16", "spec_bandwidth_bytes_per_s": bandwidth, "rows": rows}
    write_result(result, args.output)


if __name__ == "__main__":
    main()
