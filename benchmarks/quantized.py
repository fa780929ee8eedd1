"""Decode and prefill of eqx_models at float32, bfloat16, int8 and int4 beside
llama.cpp at F32, BF16, Q8_0 and Q4_0 on the same weights, in one run.

The checkpoint is a Hugging Face float32 folder (e.g. a Qwen3-0.6B-shaped random
model); the GGUF files are llama.cpp's conversions of that same folder, made by
`../shared/anchors/llamacpp/setup.sh` (which also builds llama-bench; about ten
minutes, never in CI):

    CKPT=<checkpoint> bash ../shared/anchors/llamacpp/setup.sh <work>
    python benchmarks/quantized.py --checkpoint <checkpoint> --llama-bin <work>/llama.cpp/build/bin \\
        --gguf-dir <work>/gguf

On a CPU with AMX, llama.cpp's native build may crash in its AMX matmul on quantized
prompts (seen on a 2-core Xeon VM: SIGSEGV in `ggml_backend_amx_mul_mat`); build a
second tree without it and point `--llama-bin` there:

    cmake -B build-noamx -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF \
        -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build-noamx -j2 --target llama-bench llama-batched-bench

Both keep a 16-bit KV cache (ours bfloat16, `--cache-dtype`; llama.cpp its default
F16). For each precision the two systems take turns, twice: ours decodes 32 tokens
after a 128-token prompt, four times, and reports the mean tokens per second of the
four runs (batch 1; see decode_generations), and prefills 512 tokens (best of
three); llama-bench runs `-p 0 -n 32 -d 128` (32 tokens decoded after 128 in the
cache, three times, the mean of the three) and `-p 512 -n 0`, both with 2 threads.
For `--batch-precisions` (int8) both also decode 8 sequences at once: ours 8 rows
after 128-token prompts, llama.cpp's `llama-batched-bench -npp 128 -ntg 32 -npl 8` (its S_TG). First, in
fresh processes, the peak memory of `from_pretrained(..., quantize="int8")` and
`"int4"` against the float32 file's bytes. int4 is compared with the GGUF
where every matrix is Q4_0 (`llama-quantize --pure`), as ours quantizes the
embedding table too. The floor is each model's bytes over the read bandwidth
measured between the decode runs. `int8-gguf` / `int4-gguf` load the Q8_0 /
Q4_0 GGUF files themselves (both systems then read one file). `int8-rows` holds
the int8 weights in rows instead of the kernel's tiles (`layout="rows"`), to
show what the tiles layout gives. Writes
`benchmarks/results/quantized.json` (or `--output`).
"""

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from decode import RESULTS, bandwidth_probes, interleaved, prepare_ours

import eqx_models
from eqx_models.generation import Sampling, _prefill
from eqx_models.quantization import QuantizedWeight, quantized_bytes, with_layout

is_quantized = lambda node: isinstance(node, QuantizedWeight)

# Ours, and the GGUF llama.cpp reads for the same width.
PRECISIONS = {
    "float32": dict(dtype="float32", gguf="f32"),
    "bfloat16": dict(dtype="bfloat16", gguf="bf16"),
    "int8": dict(quantize="int8", gguf="q8_0"),
    # The same int8 weights held as rows (`layout="rows"`), not the kernel's tiles.
    "int8-rows": dict(quantize="int8", layout="rows", gguf="q8_0"),
    "int4": dict(quantize="int4", gguf="q4_0-pure"),
    # Affine int4 (group 64, scale and bias) beside llama.cpp's affine Q4_1 (group 32).
    "int4-affine": dict(quantize="int4-affine", gguf="q4_1-pure"),
    # The GGUF file itself, read by eqx_models (its blocks kept packed): both systems on one file.
    "int8-gguf": dict(gguf="q8_0", read_gguf=True),
    "int4-gguf": dict(gguf="q4_0-pure", read_gguf=True),
}


def llama_bench(binary: Path, gguf: Path, threads: int, args: list[str]) -> float:
    """Tokens per second llama-bench reports (its mean over repetitions)."""
    command = [str(binary / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "3", "-o", "json", *args]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_batched(binary: Path, gguf: Path, threads: int, batch: int, prompt: int, new_tokens: int) -> float:
    """Decode tokens per second over `batch` parallel sequences (llama-batched-bench's
    S_TG: all sequences' generated tokens over the generation time)."""
    command = [str(binary / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-npp", str(prompt),
               "-ntg", str(new_tokens), "-npl", str(batch), "-c", str(batch * (prompt + new_tokens)),
               "--output-format", "jsonl"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(next(row for row in rows if row.get("pl") == batch)["speed_tg"])


def ours_batched(model, batch: int, new_tokens: int, cache_dtype: str | None) -> float:
    """Our decode tokens per second (all rows) for `batch` rows after a 128-token prompt."""
    prompt = np.random.default_rng(1).integers(0, 1000, (batch, 128), dtype=np.int32)
    prefill, step, _ = prepare_ours(model, prompt, new_tokens, cache_dtype)
    prefill()
    step()
    times = []
    for _ in range(new_tokens - 2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return batch / float(np.median(times))


# Runs in a child process: the growth of peak resident memory while loading with
# quantize= (imports and the backend's start excluded).
LOAD_MEMORY = r"""
import json, sys
import jax, jax.numpy as jnp, eqx_models
jnp.zeros(1).block_until_ready()
def status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
before = status_bytes("VmRSS")
model = jax.block_until_ready(eqx_models.from_pretrained(sys.argv[1], quantize=sys.argv[2]))
print(json.dumps({"peak_growth": status_bytes("VmHWM") - before}))
"""


def load_memory(checkpoint: Path, preset: str) -> dict:
    """Peak memory of `from_pretrained(checkpoint, quantize=preset)` in a fresh process,
    against the checkpoint's float32 weight bytes."""
    out = subprocess.run([sys.executable, "-c", LOAD_MEMORY, str(checkpoint), preset], capture_output=True,
                         text=True, check=True)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]
    float_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    return {"peak_rss_growth_bytes": growth, "float32_file_bytes": float_bytes, "ratio": growth / float_bytes}


def decode_generations(prefill, step, probes: dict, new_tokens: int, generations: int = 4,
                       probe_calls: int = 8, settle_s: float = 0.5) -> tuple[list[np.ndarray], float]:
    """Our decode timed as llama-bench times its own (`-n 32 -d 128 -r 3`): each of
    `generations` runs is a prefill (not timed) and then `new_tokens` steps one after
    another, and the figure is the mean over runs of new_tokens / their total time.
    Between runs, after a pause for torch's spinning OpenMP workers, each bandwidth
    probe reads its 1 GiB `probe_calls` times: the floor is measured in the same
    minutes as the decode it bounds, from the best of 32 reads per probe (as many as
    when the steps and probes took turns four at a time). Returns each run's step
    times and the best probe's GB/s."""
    runs, probe_times = [], {name: [] for name in probes}
    for _ in range(generations):
        time.sleep(settle_s)
        prefill()
        times = []
        for _ in range(new_tokens):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        runs.append(np.array(times))
        for name, reads in interleaved(probes, rounds=1, calls_per_round=probe_calls, settle_s=settle_s).items():
            probe_times[name].extend(reads)
    return runs, max((1 << 30) / min(times) for times in probe_times.values()) / 1e9


def ours(source: Path, options: dict, prompt: np.ndarray, new_tokens: int, probes: dict, batch: int = 0,
         cache_dtype: str | None = None) -> dict:
    model = eqx_models.from_pretrained(source, **{k: v for k, v in options.items()
                                                   if k not in ("gguf", "read_gguf", "layout")})
    if "layout" in options:
        model = with_layout(model, options["layout"])
    held = {w.layout for w in jax.tree.leaves(model, is_leaf=is_quantized) if is_quantized(w)}
    batched = ours_batched(model, batch, new_tokens, cache_dtype) if batch > 1 else None
    prefill, step, figures = prepare_ours(model, prompt, new_tokens, cache_dtype)
    prefill()
    step()
    generations, bandwidth = decode_generations(prefill, step, probes, new_tokens)
    long_prompt = jnp.asarray(np.resize(prompt, (1, 512)))
    mask, key = jnp.ones(long_prompt.shape, jnp.int32), jax.random.key(0)
    run = lambda: jax.block_until_ready(_prefill(model, long_prompt, mask, key, 513, Sampling(), (), cache_dtype)[1])
    run()
    prefill_times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        prefill_times.append(time.perf_counter() - start)
    nbytes = quantized_bytes(model)
    tokens_per_s = float(np.mean([new_tokens / sum(times) for times in generations]))
    result = {
        "decode_tokens_per_s": tokens_per_s,
        "decode_ms_per_step": 1e3 / tokens_per_s,
        "decode_median_step_ms": 1e3 * float(np.median(np.concatenate(generations))),
        "prefill_512_tokens_per_s": 512 / min(prefill_times),
        "weight_bytes": nbytes,
        "read_bandwidth_gb_s": bandwidth,
        "floor_tokens_per_s": bandwidth * 1e9 / nbytes,
        "decode_temp_bytes": figures["decode_temp_bytes"],
        "layouts": sorted(held),
    }
    if batched is not None:
        result[f"batch_{batch}_decode_tokens_per_s"] = batched
    del model, prefill, step
    gc.collect()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--gguf-dir", type=Path, required=True)
    parser.add_argument("--prefix", default="qwen3-0.6b-", help="GGUF file names: <prefix><type>.gguf")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="also decode this many rows (0: skip)")
    parser.add_argument("--batch-precisions", nargs="+", default=["int8", "int8-rows"])
    parser.add_argument("--cache-dtype", default="bfloat16",
                        help="our KV cache (llama.cpp keeps its default F16 cache): a 16-bit cache on both sides")
    parser.add_argument("--output", type=Path, default=RESULTS / "quantized.json")
    args = parser.parse_args()

    prompt = np.random.default_rng(0).integers(0, 1000, (1, 128), dtype=np.int32)
    memory = {preset: load_memory(args.checkpoint, preset) for preset in ("int8", "int4")}
    print("quantize while loading, peak RSS growth / float32 bytes:",
          {k: round(v["ratio"], 3) for k, v in memory.items()}, flush=True)
    probes = bandwidth_probes()
    runs = {p: {"eqx_models": [], "llama.cpp": []} for p in args.precisions}
    for _ in range(args.rounds):
        for precision in args.precisions:
            options = PRECISIONS[precision]
            gguf = args.gguf_dir / f"{args.prefix}{options['gguf']}.gguf"
            source = gguf if options.get("read_gguf") else args.checkpoint
            batch = args.batch if precision in args.batch_precisions else 0
            runs[precision]["eqx_models"].append(ours(source, options, prompt, args.new_tokens, probes, batch,
                                                      args.cache_dtype))
            runs[precision]["llama.cpp"].append({
                "gguf": gguf.name,
                "decode_tokens_per_s": llama_bench(args.llama_bin, gguf, args.threads,
                                                   ["-p", "0", "-n", str(args.new_tokens), "-d", "128"]),
                "prefill_512_tokens_per_s": llama_bench(args.llama_bin, gguf, args.threads, ["-p", "512", "-n", "0"]),
            })
            if batch:
                runs[precision]["llama.cpp"][-1][f"batch_{batch}_decode_tokens_per_s"] = llama_batched(
                    args.llama_bin, gguf, args.threads, batch, 128, args.new_tokens)
            print(precision, runs[precision]["eqx_models"][-1]["decode_tokens_per_s"],
                  runs[precision]["llama.cpp"][-1]["decode_tokens_per_s"], flush=True)

    summary = {}
    for precision, both in runs.items():
        best = lambda rows, key: max(row[key] for row in rows)
        ours_decode, llama_decode = best(both["eqx_models"], "decode_tokens_per_s"), best(both["llama.cpp"],
                                                                                           "decode_tokens_per_s")
        summary[precision] = {
            "eqx_models_decode_tokens_per_s": ours_decode,
            "llama_cpp_decode_tokens_per_s": llama_decode,
            "decode_ratio": ours_decode / llama_decode,
            "eqx_models_fraction_of_floor": max(r["decode_tokens_per_s"] / r["floor_tokens_per_s"]
                                                for r in both["eqx_models"]),
            "eqx_models_prefill_512_tokens_per_s": best(both["eqx_models"], "prefill_512_tokens_per_s"),
            "llama_cpp_prefill_512_tokens_per_s": best(both["llama.cpp"], "prefill_512_tokens_per_s"),
        }
        key = f"batch_{args.batch}_decode_tokens_per_s"
        if precision in args.batch_precisions and args.batch > 1:
            summary[precision][f"eqx_models_{key}"] = best(both["eqx_models"], key)
            summary[precision][f"llama_cpp_{key}"] = best(both["llama.cpp"], key)
            summary[precision][f"batch_{args.batch}_decode_ratio"] = (
                summary[precision][f"eqx_models_{key}"] / summary[precision][f"llama_cpp_{key}"])
    version = subprocess.run([str(args.llama_bin / "llama-bench"), "--version"], capture_output=True, text=True)
    out = {
        "benchmark": "quantized",
        "checkpoint": str(args.checkpoint),
        "setup": dict(batch=1, prompt=128, new_tokens=args.new_tokens, prefill=512, threads=args.threads,
                      rounds=args.rounds, note="best round of each system; the two take turns per precision",
                      kv_cache={"eqx_models": args.cache_dtype, "llama.cpp": "f16 (its default)"}),
        "machine": dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                        jax=jax.__version__, eqx_models=eqx_models.__version__,
                        llama_cpp=(version.stdout + version.stderr).strip()),
        "summary": summary,
        "quantize_while_loading_memory": memory,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
