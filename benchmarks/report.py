"""Turns `benchmarks/results/*.json` into the tables and plot of `docs/benchmarks.md`.

    python benchmarks/report.py            # prints markdown tables, writes docs/benchmarks.png
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def decode_table(decode: dict) -> str:
    rows = [
        "| batch | weights | eqx_models ms/step | transformers ms/step | eqx_models tok/s | transformers tok/s | vs transformers | decode temp MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in decode["runs"]:
        ours, theirs = run["eqx_models"], run["transformers"]
        rows.append(
            f"| {run['batch']} | float32 | {ours['decode_ms_per_step']:.0f} | {theirs['decode_ms_per_step']:.0f} | "
            f"{ours['decode_tokens_per_s']:.1f} | {theirs['decode_tokens_per_s']:.1f} | "
            f"{run['decode_speedup_vs_transformers']:.2f}x | {ours['decode_temp_bytes'] / 1e6:.1f} |"
        )
        if "eqx_models_bfloat16" in run:
            b16 = run["eqx_models_bfloat16"]
            rows.append(
                f"| {run['batch']} | bfloat16 | {b16['decode_ms_per_step']:.0f} | {theirs['decode_ms_per_step']:.0f} (float32) | "
                f"{b16['decode_tokens_per_s']:.1f} | {theirs['decode_tokens_per_s']:.1f} | "
                f"{b16['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x "
                f"({b16['decode_speedup_vs_own_float32']:.2f}x our float32) | {b16['decode_temp_bytes'] / 1e6:.1f} |"
            )
    return "\n".join(rows)


def bfloat16_note(decode: dict) -> str:
    for run in decode["runs"]:
        if "eqx_models_bfloat16" in run:
            b16 = run["eqx_models_bfloat16"]
            return (
                f"bfloat16 vs float32 logits on the prompt: max |diff| {b16['max_abs_logit_diff_vs_float32']:.3f} "
                f"(largest |logit| {b16['max_abs_logit_float32']:.2f}), same argmax at "
                f"{100 * b16['greedy_agreement_vs_float32']:.0f}% of positions."
            )
    return ""


def context_table(runs: list[tuple[str, dict]]) -> str:
    rows = [
        "| prompt tokens | eqx_models decode ms/step | (weights + KV) / bandwidth ms | transformers ms/step | eqx_models prefill tok/s | transformers prefill tok/s | decode temp MB | KV MB per layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, result in runs:
        run = result["runs"][0]
        ours = run["eqx_models"]
        bandwidth = run["read_bandwidth_gb_s"] * 1e9
        predicted = 1e3 * (result["weight_bytes"] + ours["cache_bytes"]) / bandwidth
        layers = int(result["model"].split(", ")[1].split()[0])
        rows.append(
            f"| {result['prompt_length']} | {ours['decode_ms_per_step']:.0f} | {predicted:.0f} | "
            f"{run['transformers']['decode_ms_per_step']:.0f} | {ours['prefill_tokens_per_s']:.0f} | "
            f"{run['transformers']['prefill_tokens_per_s']:.0f} | {ours['decode_temp_bytes'] / 1e6:.1f} | "
            f"{ours['cache_bytes'] / layers / 1e6:.1f} |"
        )
    return "\n".join(rows)


def plot(decode: dict | None, depth: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if decode:
        batches = [r["batch"] for r in decode["runs"]]
        for library in ("eqx_models", "transformers"):
            axes[0].plot(batches, [r[library]["decode_tokens_per_s"] for r in decode["runs"]], "o-", label=library)
        axes[0].set(xlabel="batch size", ylabel="decode tokens/s", title="Decode, Qwen3-0.6B shape, float32")
        axes[0].legend()
    if depth:
        layers = [r["layers"] for r in depth["runs"]]
        axes[1].plot(layers, [r["scan_s"] for r in depth["runs"]], "o-", label="scan")
        axes[1].plot(layers, [r["unrolled_s"] for r in depth["runs"]], "o-", label="unrolled")
        axes[1].set(xlabel="layers", ylabel="compile seconds", title="Decode-step compile time vs depth")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def quantized_table(quantized: dict) -> str:
    rows = ["| width | eqx_models decode tok/s | llama.cpp decode tok/s | ratio | eqx_models of its floor "
            "| eqx_models prefill 512 tok/s | llama.cpp prefill 512 tok/s |", "|---|---|---|---|---|---|---|"]
    for width, entry in quantized["summary"].items():
        gguf = quantized["runs"][width]["llama.cpp"][0]["gguf"]
        rows.append(
            f"| {width} | {entry['eqx_models_decode_tokens_per_s']:.1f} | {entry['llama_cpp_decode_tokens_per_s']:.1f} "
            f"({gguf}) | {entry['decode_ratio']:.2f}x | {entry['eqx_models_fraction_of_floor']:.2f} | "
            f"{entry['eqx_models_prefill_512_tokens_per_s']:.0f} | {entry['llama_cpp_prefill_512_tokens_per_s']:.0f} |"
        )
    batched = [(width, entry, key[len("eqx_models_"):]) for width, entry in quantized["summary"].items()
               for key in entry if key.startswith("eqx_models_batch_")]
    if batched:
        rows += ["", "| width | rows | eqx_models decode tok/s (all rows) | llama.cpp (llama-batched-bench) | ratio |",
                 "|---|---|---|---|---|"]
        for width, entry, key in batched:
            rows.append(f"| {width} | {key.split('_')[1]} | {entry['eqx_models_' + key]:.1f} | "
                        f"{entry['llama_cpp_' + key]:.1f} | {entry['eqx_models_' + key] / entry['llama_cpp_' + key]:.2f}x |")
    memory = quantized.get("quantize_while_loading_memory")
    if memory:
        rows += ["", "| from_pretrained(quantize=) | peak RSS growth | of the float32 file |", "|---|---|---|"]
        rows += [f"| {preset} | {m['peak_rss_growth_bytes'] / 2**30:.2f} GiB | {m['ratio']:.2f}x |"
                 for preset, m in memory.items()]
    return "\n".join(rows)


def plot_quantized(quantized: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = {"float32": 32, "bfloat16": 16, "int8": 8, "int4": 4}
    widths = [w for w in quantized["summary"] if w in bits]
    fig, ax = plt.subplots(figsize=(5, 4))
    for system, key in (("eqx_models", "eqx_models_decode_tokens_per_s"), ("llama.cpp", "llama_cpp_decode_tokens_per_s")):
        ax.plot([bits[w] for w in widths], [quantized["summary"][w][key] for w in widths], "o-", label=system)
    ax.set(xscale="log", xlabel="bits per weight", ylabel="decode tokens/s (batch 1)",
           title="Qwen3-0.6B shape, 2 threads, same run")
    ax.set_xticks([4, 8, 16, 32], ["4", "8", "16", "32"])
    ax.minorticks_off()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def serving_tables(serving: dict) -> str:
    """Throughput and TTFT per server and concurrency; prefix caching; structured outputs."""
    lines = []
    for precision, systems in serving.get("throughput", {}).items():
        names = [n for n in ("eqx_models", "llama.cpp", "vllm") if n in systems]
        lines += [f"\n{precision}\n", "| concurrency | " + " | ".join(f"{n} output tok/s" for n in names) + " | "
                  + " | ".join(f"{n} TTFT median / p95 ms" for n in names) + " |", "|---" * (1 + 2 * len(names)) + "|"]
        for i, concurrency in enumerate(r["concurrency"] for r in systems[names[0]]):
            rounds = [systems[n][i] for n in names]
            lines.append(f"| {concurrency} | " + " | ".join(f"{r['output_tokens_per_s']:.1f}" for r in rounds) + " | "
                         + " | ".join(f"{r['ttft_median_ms']:.0f} / {r['ttft_p95_ms']:.0f}" for r in rounds) + " |")
    prefix = serving.get("prefix_caching")
    if prefix:
        lines += ["\n| server | TTFT, cache on s | TTFT, cache off s | on / off |", "|---|---|---|---|"]
        for name, run in prefix.items():
            lines.append(f"| {name} | {run['on']['ttft_median_s']:.2f} | {run['off']['ttft_median_s']:.2f} | "
                         f"{run['on_over_off']:.2f} |")
    structured = serving.get("structured_outputs")
    if structured:
        import statistics

        lines.append(f"\nDecode step, {structured['rows']} rows: free {statistics.median(structured['free_step_ms']):.1f} ms, "
                     f"JSON schema {statistics.median(structured['json_schema_step_ms']):.1f} ms "
                     f"({100 * structured['step_overhead']:+.1f}%); masks "
                     f"{statistics.median(structured['mask_ms_per_step']):.2f} ms per step "
                     f"({100 * structured['mask_share_of_step']:.1f}% of it)")
    return "\n".join(lines)


def plot_serving(serving: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = serving["throughput"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for precision, systems in throughput.items():
        for name, rounds in systems.items():
            if not (isinstance(rounds, list) and rounds and isinstance(rounds[0], dict)):
                continue
            style = "o-" if precision == "bfloat16" else "s--"
            label = f"{name} {precision if name != 'llama.cpp' or precision == 'bfloat16' else 'Q8_0'}"
            concurrency = [r["concurrency"] for r in rounds]
            axes[0].plot(concurrency, [r["output_tokens_per_s"] for r in rounds], style, label=label)
            axes[1].plot(concurrency, [r["ttft_median_ms"] / 1e3 for r in rounds], style, label=label)
    axes[0].set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput (guidellm)")
    axes[1].set(xscale="log", xlabel="concurrent requests", ylabel="median time to first token, s", title="TTFT")
    for ax in axes:
        ax.set_xticks([1, 4, 16], ["1", "4", "16"])
        ax.minorticks_off()
    axes[0].legend(fontsize=8)
    fig.suptitle("Qwen3-0.6B shape, 128-token prompts, 32 new tokens, 2 threads, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def tpu_decode_table(tpu: dict) -> str:
    """Decode on the accelerator against the HBM floor (`tpu_decode.json`), the docs' accelerators table."""
    rows = ["| batch | tok/s | ms/step | floor ms/step | of the floor |", "|---|---|---|---|---|"]
    for run in tpu["rows"]:
        if "error" in run:
            rows.append(f"| {run['batch']} | {run['error'][:60]} | | | |")
            continue
        rows.append(f"| {run['batch']} | {run['tokens_per_s_generate']:,.0f} | {run['step_ms_generate']:.2f} | "
                    f"{run['floor_ms']:.2f} | {run['fraction_of_floor_generate']:.2f} |")
    return "\n".join(rows)


def plot_tpu_decode(tpu: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for run in tpu["rows"] if "error" not in run]
    batches = [str(run["batch"]) for run in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(batches, [run["tokens_per_s_generate"] for run in runs], color="tab:blue")
    axes[0].set(xlabel="batch", ylabel="decode tokens/s", title="Throughput")
    axes[1].bar(batches, [run["fraction_of_floor_generate"] for run in runs], color="tab:green")
    axes[1].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    axes[1].set(xlabel="batch", ylabel="HBM floor / step time", ylim=(0, 1.05),
                title="Fraction of the floor (bytes read at 819 GB/s)")
    fig.suptitle(f"{tpu['shape']}, {tpu['dtype']}, {tpu['device']}: prompt {tpu['prompt']}, "
                 f"{tpu['new_tokens']} new tokens through generate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def quality_table(quality: dict) -> str:
    """Perplexity, KL and agreement of each width, ours beside llama.cpp's, per model."""
    number = lambda value, digits: "" if value is None else f"{value:.{digits}f}"
    blocks = []
    for model, entry in quality["models"].items():
        rows = [f"{model}: {entry['text_tokens']} tokens, chunks of {quality['ctx']}, second halves scored", "",
                "| weights | read by | perplexity | mean KL vs float32 | same top token % | greedy agreement / 200 % "
                "| greedy leaves float32 at |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for name, r in entry["eqx_models"].items():
            first = r["greedy_first_divergence"]
            rows.append(f"| {name} | eqx_models | {r['perplexity']:.5g} | {number(r['mean_kl_vs_float32'], 6)} | "
                        f"{r['same_top_token_pct']:.1f} | {r['greedy_agreement_200_pct']:.1f} | "
                        f"{'never' if first is None else first} |")
        for name, r in entry["llama_cpp"].items():
            if "not_run" in r:
                rows.append(f"| {name} | llama.cpp | not run: {r['not_run']} | | | | |")
                continue
            rows.append(f"| {name} | llama.cpp | {r['perplexity']:.5g} | {number(r.get('mean_kl_vs_float32'), 6)} | "
                        f"{number(r.get('same_top_token_pct'), 1)} | | |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)


def kv_cache_table(kv: dict) -> str:
    """Decode at a long context by cache dtype, ours beside llama.cpp's cache of the same width."""
    rows = ["| KV cache | cache bytes at the context | eqx_models decode tok/s | llama.cpp decode tok/s | ratio |",
            "|---|---:|---:|---:|---:|"]
    names = {"bfloat16": "bfloat16 (llama.cpp F16)", "int8": "int8 (llama.cpp Q8_0)"}
    for cache, name in names.items():
        entry = kv["summary"][cache]
        rows.append(f"| {name} | {entry['live_cache_bytes'] / 1e6:.0f} MB | "
                    f"{entry['eqx_models_decode_tokens_per_s']:.1f} | {entry['llama_cpp_decode_tokens_per_s']:.1f} | "
                    f"{entry['decode_ratio']:.2f}x |")
    return "\n".join(rows)


def main():
    decode, depth, load_result = load("decode"), load("compile_depth"), load("load")
    if decode:
        for run in decode["runs"]:
            print(f"Batch {run['batch']}: read bandwidth {run['read_bandwidth_gb_s']:.1f} GB/s in the same turns; "
                  f"floor {run['floor_ms_per_step_batch1']:.0f} ms/token at batch 1 "
                  f"({decode['weight_bytes'] / 1e9:.2f} GB of weights)")
        print(f"One thread: {decode['read_bandwidth_gb_s_one_thread']:.1f} GB/s\n")
        print(decode_table(decode) + "\n")
        print(bfloat16_note(decode) + "\n")
    contexts = [(n, load(n)) for n in ("decode", "prefill_512", "decode_context_1024", "decode_context_4096")]
    contexts = [(n, r) for n, r in contexts if r]
    if contexts:
        print(context_table(contexts) + "\n")
    if depth:
        print("| layers | scan compile s | unrolled compile s |\n|---|---|---|")
        for run in depth["runs"]:
            print(f"| {run['layers']} | {run['scan_s']:.2f} | {run['unrolled_s']:.2f} |")
        print()
    if load_result:
        weights = load_result["weight_bytes"]
        print("| file written by | library | load s | then reading every weight s | peak RSS growth / weights "
              "| after reading / weights | decode ms/step (b1, one process each: noisy) |\n|---|---|---|---|---|---|---|")
        for run in load_result["runs"]:
            step_ms = run.get("decode_ms_per_step_batch1")
            print(
                f"| {run.get('file_written_by', 'transformers')} | {run['library']} | {run['seconds']:.2f} | "
                f"{run.get('touch_seconds', float('nan')):.2f} | {run['peak_growth'] / weights:.2f} | "
                f"{run['peak_growth_after_touching_weights'] / weights:.2f} | "
                f"{'' if step_ms is None else f'{step_ms:.0f}'} |"
            )
        fresh = [r["seconds"] for r in load_result.get("fresh_memory_runs", [])]
        if fresh:
            print(f"\nFaulting in {weights / 1e9:.2f} GB of new memory (both cores), same turns: "
                  + ", ".join(f"{s:.2f}" for s in fresh) + " s")
        print()
    mapped = load("mapped_decode")
    if mapped:
        ms = mapped["ms_per_step"]
        print(f"Decode b1 on the same checkpoint, mapped vs read, taking turns: {ms['mapped']:.1f} vs {ms['read']:.1f} ms/step\n")
    moe = load("moe_decode")
    if moe:
        print("\n| experts | active expert MB/token | eqx_models decode ms/step | transformers decode ms/step | eqx_models prefill tok/s | transformers prefill tok/s |\n|---|---|---|---|---|---|")
        for run in moe["runs"]:
            ours, theirs = run["eqx_models"], run["transformers"]
            print(
                f"| {run['num_experts']} | {run['active_expert_bytes_per_token'] / 1e6:.0f} | {ours['decode_ms_per_step']:.1f} | "
                f"{theirs['decode_ms_per_step']:.1f} | {ours['prefill_tokens_per_s']:.0f} | {theirs['prefill_tokens_per_s']:.0f} |"
            )
    serve = load("serve")
    if serve:
        print("\n| concurrency | output tok/s | vs concurrency 1 | TTFT median s | TTFT max s | per-request tok/s |\n|---|---|---|---|---|---|")
        for run in serve["rounds"]:
            print(
                f"| {run['concurrency']} | {run['output_tokens_per_s']:.1f} | {run['vs_concurrency_1']:.2f}x | "
                f"{run['ttft_median_s']:.2f} | {run['ttft_max_s']:.2f} | {run['per_request_tokens_per_s']:.2f} |"
            )
        alone = serve["transformers_generate_alone"]
        print(f"\ntransformers generate, the same request alone: {alone['output_tokens_per_s']:.1f} tok/s")
    sharded = load("sharding")
    if sharded:
        print("\n| model | layout | decode ms/step | tok/s | max logit diff vs 1 device | greedy equal "
              "| all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute |\n" + "|---" * 11 + "|")
        for model, entry in sharded["models"].items():
            for name, run in entry.items():
                if not isinstance(run, dict) or "ms_per_step" not in run:
                    continue
                counts = run["collectives_per_decode_step"]
                layout = "1 device" if name == "single_device" else " x ".join(f"{a}={n}" for a, n in run["mesh"].items())
                diff = run.get("max_logit_diff_vs_single_device")
                print(
                    f"| {model} | {layout} | {run['ms_per_step']:.0f} | {run['tokens_per_s']:.1f} | "
                    f"{'-' if diff is None else f'{diff:.1e}'} | {run.get('greedy_tokens_equal', '-')} | "
                    + " | ".join(str(counts[op]) for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                                            "collective-permute")) + " |"
                )
    quality = load("quality")
    if quality:
        print("\n" + quality_table(quality))
    kv = load("kv_cache")
    if kv:
        print("\n" + kv_cache_table(kv))
    quantized = load("quantized")
    if quantized:
        print("\n" + quantized_table(quantized))
        plot_quantized(quantized, ROOT / "docs" / "quantized.png")
    serving = load("serving")
    if serving:
        print("\n" + serving_tables(serving))
        if serving.get("throughput"):
            plot_serving(serving, ROOT / "docs" / "serving.png")
    tpu = load("tpu_decode")
    if tpu:
        print("\n" + tpu_decode_table(tpu))
        plot_tpu_decode(tpu, ROOT / "docs" / "tpu_decode.png")
    plot(decode, depth, ROOT / "docs" / "benchmarks.png")


if __name__ == "__main__":
    main()
