"""The serving engine on one accelerator chip beside plain `generate` in the same
run (issue 38's table).

A Qwen3-shaped model with random bfloat16 weights and the Qwen tokenizer serves
prompts of `--prompt` random tokens for `--new-tokens` output tokens each (EOS
ignored, greedy) through `Engine.generate`, twice `max_num_seqs` requests at each
`--concurrency`; a first round of the same shapes compiles and is not timed.
Beside it, plain `generate` runs the same number of rows at the same batch:
end to end (prompt included, the engine's comparison) and its decode step alone.
Then, at `max_num_seqs` 64 (or the largest concurrency):

- mixed traffic: the running sequences' decode tokens/s while a `--long-prompt`
  token prompt is prefilled, against their rate before it arrived;
- prefix caching: the time to first token of a `--long-prompt`-token prompt that
  shares all but its last 64 tokens with an earlier one, caching on and off.

Each case (a concurrency, mixed traffic, prefix caching) runs in a fresh process:
an engine sizes its page pool from the chip's free memory, and in one process an
earlier engine's pool was still held after it was dropped (about 13 GB; issue 38).
Writes `tpu_serve.json` to `benchmarks/results/` (or `$EQX_TPU_RESULTS`).

    python benchmarks/tpu_serve.py [--shape 0.6b] [--concurrency 1 64 256] [--prompt 128] [--new-tokens 128]
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
import numpy as np
from tpu_decode import RESULTS, SHAPES, random_model, write_result

import eqx_models
from eqx_models.serving import Engine, SamplingParams

FIXTURES = Path(os.environ.get("EQX_MODELS_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
PAGE_SIZE = 16
SHARED_TAIL = 64  # tokens of the prefix-caching prompt not shared with the earlier one


def in_use(device) -> int | None:
    """Bytes the device holds now (None where it does not say)."""
    stats = device.memory_stats() or {}
    return stats.get("bytes_in_use")


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (count, length)).tolist()


def engine_round(engine: Engine, count: int, length: int, new_tokens: int, seed: int) -> dict:
    """`count` requests at once through `Engine.generate`: output tokens/s."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    batch = prompts(count, length, engine.model.config.vocab_size, seed)
    start = time.perf_counter()
    outputs = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(out.token_ids) for out in outputs)
    return {"requests": count, "output_tokens": produced, "seconds": round(elapsed, 3),
            "output_tokens_per_s": round(produced / elapsed, 1)}


def plain_round(model, batch: int, rounds: int, length: int, new_tokens: int) -> dict:
    """`rounds` calls of `generate` at `batch` rows (compiled first): output
    tokens/s end to end, and of the decode step alone (a run of N tokens less a
    run of 1, over N - 1)."""
    ids = np.asarray(prompts(batch, length, model.config.vocab_size, 7))
    run = lambda n: np.asarray(eqx_models.generate(model, ids, max_new_tokens=n, eos_token_id=[]))
    run(new_tokens), run(1)
    start = time.perf_counter()
    for _ in range(rounds):
        run(new_tokens)
    whole = (time.perf_counter() - start) / rounds
    start = time.perf_counter()
    run(1)
    first = time.perf_counter() - start
    step = (whole - first) / (new_tokens - 1)
    return {"batch": batch, "rounds": rounds, "output_tokens_per_s": round(batch * new_tokens / whole, 1),
            "decode_tokens_per_s": round(batch / step, 1), "step_ms": round(step * 1e3, 3)}


def time_per_output_token(engine: Engine, length: int, new_tokens: int) -> dict:
    """One request alone: seconds per output token after its first, and where a
    step's time goes: launching the compiled step, waiting for its outputs (the
    chip's work and the copy back), and the rest (the host's scheduling, inputs and
    outputs)."""
    ids = prompts(1, length, engine.model.config.vocab_size, 11)[0]
    engine.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    spent = {"launch": 0.0, "wait": 0.0}
    forward, fetch = engine._forward, jax.device_get

    def timed(key, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return run

    engine._forward, jax.device_get = timed("launch", forward), timed("wait", fetch)
    first = None
    try:
        while engine.has_work:
            engine.step()
            if first is None and engine.running and engine.running[0].output_ids:
                first, spent["launch"], spent["wait"] = time.perf_counter(), 0.0, 0.0
    finally:
        engine._forward, jax.device_get = forward, fetch
    steps = new_tokens - 1
    total = (time.perf_counter() - first) / steps
    per_step = {key: value / steps for key, value in spent.items()}
    return {"seconds_per_output_token": round(total, 6), "launch_ms": round(per_step["launch"] * 1e3, 3),
            "wait_ms": round(per_step["wait"] * 1e3, 3),
            "host_ms": round((total - per_step["launch"] - per_step["wait"]) * 1e3, 3)}


def mixed_traffic(engine: Engine, running: int, length: int, long_prompt: int) -> dict:
    """`running` sequences decoding; the decode tokens/s they make before and while
    one `long_prompt`-token prompt is prefilled."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=engine.max_model_len - length, temperature=0, ignore_eos=True)
    for ids in prompts(running, length, vocab, 13):
        engine.add_request(ids, params)
    while len(engine.running) < running or any(not s.output_ids for s in engine.running):
        engine.step()

    def decoded_per_s(steps_until) -> float:
        before = sum(len(s.output_ids) for s in engine.running[:running])
        start = time.perf_counter()
        steps = 0
        while not steps_until(steps):
            engine.step()
            steps += 1
        made = sum(len(s.output_ids) for s in engine.running[:running]) - before
        return made / (time.perf_counter() - start)

    decoding = decoded_per_s(lambda steps: steps >= 16)
    done = []
    engine.add_request(prompts(1, long_prompt, vocab, 17)[0], SamplingParams(max_tokens=1, temperature=0),
                       on_update=lambda update: done.append(update.finish_reason is not None))
    during = decoded_per_s(lambda steps: any(done))  # until its prompt is in and its one token out
    for sequence in list(engine.running):
        engine.abort(sequence.id)
    engine.step()
    return {"running": running, "long_prompt": long_prompt, "decode_tokens_per_s_before": round(decoding, 1),
            "decode_tokens_per_s_during_prefill": round(during, 1), "drop": round(1 - during / decoding, 3)}


def prefix_ttft(model, tokenizer, long_prompt: int, caching: bool, **options) -> float:
    """Median seconds to the first token of a prompt sharing all but `SHARED_TAIL`
    tokens with one served before it (three pairs, after one that compiles)."""
    engine = Engine(model, tokenizer, prefix_caching=caching, **options)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for pair in range(4):
        earlier = prompts(1, long_prompt, vocab, 100 + pair)[0]
        later = earlier[:-SHARED_TAIL] + prompts(1, SHARED_TAIL, vocab, 200 + pair)[0]
        engine.generate([earlier], params)
        start = time.perf_counter()
        engine.generate([later], params)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def concurrency_row(model, tokenizer, concurrency: int, args, options: dict) -> dict:
    """The engine at `max_num_seqs=concurrency` beside plain `generate` at that batch."""
    row = {"max_num_seqs": concurrency}
    engine = Engine(model, tokenizer, max_num_seqs=concurrency, **options)
    engine_round(engine, 2 * concurrency, args.prompt, args.new_tokens, seed=1)  # compiles
    row["engine"] = engine_round(engine, 2 * concurrency, args.prompt, args.new_tokens, seed=2)
    row["kv_pages"] = engine.allocator.num_pages
    if concurrency == 1:
        row["alone"] = time_per_output_token(engine, args.prompt, args.new_tokens)
        row["engine_seconds_per_output_token"] = row["alone"]["seconds_per_output_token"]
    del engine
    gc.collect()
    row["device_bytes_in_use_after"] = in_use(jax.devices()[0])  # the pool should be gone by now
    try:
        row["generate"] = plain_round(model, concurrency, 2, args.prompt, args.new_tokens)
    except Exception as error:  # the engine's figures stand without it
        row["generate"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        return row
    row["engine_over_generate"] = round(row["engine"]["output_tokens_per_s"] / row["generate"]["output_tokens_per_s"], 3)
    if concurrency == 1:
        row["alone_over_generate_step"] = round(
            row["engine_seconds_per_output_token"] * 1e3 / row["generate"]["step_ms"], 3)
    return row


def run_case(case: str, args) -> dict:
    """One case in this process: a concurrency (a number), "mixed", "prefix_on" or
    "prefix_off" (one engine a process: each sizes its pool from the chip's memory)."""
    model = random_model(args.shape, args.layers)
    tokenizer = eqx_models.load_tokenizer(args.tokenizer)
    options = serving_options(args)
    if case.isdigit():
        return concurrency_row(model, tokenizer, int(case), args, options)
    if case == "mixed":
        running = min(64, max(args.concurrency))
        # No prefix caching: the measured round must prefill what the warm-up round did.
        engine = Engine(model, tokenizer, max_num_seqs=running + 1, prefix_caching=False, **options)
        mixed_traffic(engine, running, args.prompt, args.long_prompt)  # compiles the shapes it meets
        return mixed_traffic(engine, running, args.prompt, args.long_prompt)
    caching = case == "prefix_on"
    return {"ttft_s": prefix_ttft(model, tokenizer, args.long_prompt, caching, max_num_seqs=4, **options)}


def serving_options(args) -> dict:
    return dict(max_model_len=args.long_prompt + args.new_tokens, page_size=PAGE_SIZE,
                max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.concurrency)))


def in_a_process(case: str) -> dict:
    """`case` run by a fresh process of this script: each engine sizes its page pool
    from the chip's memory, which no earlier case's arrays may hold, and only one
    process holds the chip at a time."""
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--case", case], capture_output=True, text=True)
    sys.stderr.write(done.stderr[-2000:])
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick check)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--tokenizer", type=Path, default=FIXTURES / "qwen-tokenizer")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # set by the parent process
    args = parser.parse_args()

    if args.case is not None:
        try:
            found = run_case(args.case, args)
        except Exception as error:  # a configuration that does not fit is a result too
            found = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(json.dumps(found), flush=True)
        return

    rows = []
    for concurrency in args.concurrency:
        row = {"max_num_seqs": concurrency, **in_a_process(str(concurrency))}
        print(row, flush=True)
        rows.append(row)
    result = {
        "benchmark": "tpu_serve",
        "device": jax.devices()[0].device_kind,  # after the cases: the chip is this process's from here
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.node(),
        "shape": f"Qwen3-{args.shape.upper()}",
        "layers": args.layers or SHAPES[args.shape]["num_hidden_layers"],
        "dtype": "bfloat16",
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "options": serving_options(args),
        "rows": rows,
    }
    result["mixed_traffic"] = in_a_process("mixed")
    print(result["mixed_traffic"], flush=True)
    on, off = in_a_process("prefix_on"), in_a_process("prefix_off")
    result["prefix_caching"] = {"long_prompt": args.long_prompt, "shared": args.long_prompt - SHARED_TAIL,
                                "on": on, "off": off}
    if "ttft_s" in on and "ttft_s" in off:
        result["prefix_caching"]["on_over_off"] = round(on["ttft_s"] / off["ttft_s"], 3)
    print(result["prefix_caching"], flush=True)
    write_result(result, args.output or RESULTS / "tpu_serve.json")


if __name__ == "__main__":
    main()
