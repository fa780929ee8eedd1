"""Throughput and time to first token of `eqx-models serve` at several concurrencies.

A Qwen3-0.6B-shaped model with random float32 weights is created with
`transformers` and served (with the real Qwen tokenizer from the shared fixtures).
For each concurrency `c`, `c` clients each stream one completion at the same time
(random prompt token ids, greedy, EOS ignored so every request runs its full
length); a first round compiles the shapes it meets and is not timed. Reported:
output tokens/s over the round, time to first token (median, worst), and the same
request through `transformers` `generate` alone, measured after the server stops.
Writes `benchmarks/results/serve.json`.

    python benchmarks/serve.py [--concurrency 1 8 32] [--prompt-length 32] [--new-tokens 128]
"""

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = Path(os.environ.get("EQX_MODELS_FIXTURES", ROOT.parent / "shared" / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import QWEN3_0_6B  # noqa: E402  (same model shape as the decode benchmark)

NAME = "qwen3-0.6b-shaped"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: str, port: int, args, log) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "eqx_models.cli", "serve", folder, "--port", str(port),
        "--tokenizer", str(FIXTURES / "qwen-tokenizer"), "--served-model-name", NAME,
        "--max-num-seqs", str(max(args.concurrency)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--page-size", str(args.page_size),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def stream_one(url: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion: time to first text, total time, tokens generated."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage = None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft_s": first, "total_s": time.perf_counter() - start, "completion_tokens": usage["completion_tokens"]}


def round_of(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_one(url, p, new_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    return {
        "concurrency": len(prompts),
        "wall_s": wall,
        "completion_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_median_s": float(np.median(ttft)),
        "ttft_max_s": float(np.max(ttft)),
        "per_request_tokens_per_s": float(np.median([r["completion_tokens"] / r["total_s"] for r in results])),
    }


def transformers_alone(folder: str, prompt: list[int], new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
    wall = time.perf_counter() - start
    generated = out.shape[1] - ids.shape[1]
    return {"wall_s": wall, "completion_tokens": generated, "output_tokens_per_s": generated / wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--output", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, Qwen3Config

    rng = np.random.default_rng(0)
    results = {
        "benchmark": "serve",
        "model": f"Qwen3-0.6B-shaped, {args.layers} layers, random float32 weights",
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "server_flags": {"max_num_seqs": max(args.concurrency), "max_num_batched_tokens": args.max_num_batched_tokens,
                         "max_model_len": args.max_model_len, "page_size": args.page_size},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers})
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(Path(folder) / "server.log", "w+") as log:
            server = start_server(folder, port, args, log)
            try:
                for concurrency in args.concurrency:
                    warm = rng.integers(0, 151643, (concurrency, args.prompt_length)).tolist()
                    round_of(url, warm, args.new_tokens)  # compiles what this round meets
                    # New prompts: the same ones again would come from the prefix cache.
                    prompts = rng.integers(0, 151643, (concurrency, args.prompt_length)).tolist()
                    timed = round_of(url, prompts, args.new_tokens)
                    results["rounds"].append(timed)
                    print(json.dumps(timed), flush=True)
            finally:
                server.terminate()
                server.wait(timeout=120)
        prompt = rng.integers(0, 151643, args.prompt_length).tolist()
        results["transformers_generate_alone"] = transformers_alone(folder, prompt, args.new_tokens)
    base = results["rounds"][0]["output_tokens_per_s"]
    for run in results["rounds"]:
        run["vs_concurrency_1"] = run["output_tokens_per_s"] / base
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
