"""What quantization costs in quality: eqx_models' int8 / int4 (symmetric and affine)
beside llama.cpp's Q8_0 / Q4_0 / Q4_1 / Q4_K_M of the same model, on the same text,
by the same measures.

Two models: stories260K (a real trained model, `../shared/fixtures`) and a
Qwen3-0.6B-shaped model with random unit-scale weights and the real Qwen
vocabulary (its perplexity means nothing; its KL and agreement do). The text is
2,000 tokens sampled from stories260K in float32 (seed 0, temperature 1), so a
rerun scores the same text.

Measures, as llama.cpp's `llama-perplexity` takes them: the text in chunks of
`--ctx` tokens (the first replaced by BOS where the tokenizer adds one), each
chunk's second half scored (token j+1 from the logits at j, j from ctx/2):
perplexity, mean KL divergence of the next-token distribution from float32's,
and how often the most likely token is float32's. With an int8 KV cache (ours) or
a Q8_0 one (llama.cpp's) each chunk goes through that cache, every token reading
keys and values as it stores them. Ours also: greedy agreement
over 200 tokens (teacher-forced on float32's greedy continuation of the first
prompt) and where free-running greedy decoding first leaves float32's.

llama.cpp runs `llama-perplexity --kl-divergence-base` on its F32 file, then
`--kl-divergence` on each quantized file. GGUF files are made here with
llama.cpp's converter and `llama-quantize` (from a tree built as
`../shared/anchors/llamacpp/` describes; never in CI):

    python benchmarks/quality.py --llama-cpp <llama.cpp tree with build/bin>

Writes `benchmarks/results/quality.json`.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import eqx_models
from eqx_models.quantization import quantize

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures"
RESULTS = REPO / "benchmarks" / "results"
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
OURS = {  # name -> how the variant is made from the float32 folder or the GGUF files
    "float32": dict(),
    "int8 (group 32)": dict(quantize=dict(bits=8, group_size=32)),
    "int4 (group 32)": dict(quantize=dict(bits=4, group_size=32)),
    "int4 (group 64)": dict(quantize=dict(bits=4, group_size=64)),
    "int4 affine (group 64)": dict(quantize=dict(bits=4, group_size=64, mode="affine")),
    "int4 affine (group 32)": dict(quantize=dict(bits=4, group_size=32, mode="affine")),
    "Q8_0 GGUF read by eqx_models": dict(gguf="q8_0"),
    "Q4_0 GGUF (every matrix) read by eqx_models": dict(gguf="q4_0-pure"),
    "Q4_1 GGUF (every matrix) read by eqx_models": dict(gguf="q4_1-pure"),
    "Q4_K_M GGUF read by eqx_models (dequantized, bfloat16)": dict(gguf="q4_k_m"),
    "float32 weights, int8 KV cache": dict(cache="int8"),
}
# llama.cpp's label -> (its GGUF, extra llama-perplexity arguments). Its quantized
# value cache needs flash attention.
LLAMA_CPP = {
    "Q8_0": ("q8_0", []),
    "Q4_0 (every matrix)": ("q4_0-pure", []),
    "Q4_1 (every matrix)": ("q4_1-pure", []),
    "Q4_K_M": ("q4_k_m", []),
    "F32 weights, Q8_0 KV cache": ("f32", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]),
}


def sampled_text(tokens: int = 2000) -> str:
    """The scored text: stories260K's own float32 samples, reproducible."""
    folder = FIXTURES / "stories260K"
    model = eqx_models.from_pretrained(folder, dtype=jnp.float32)
    tokenizer = eqx_models.load_tokenizer(folder)
    pieces = []
    for seed in range(tokens // 400):
        new = eqx_models.generate(model, [1], max_new_tokens=400, temperature=1.0, seed=seed)[0]
        pieces.append(tokenizer.decode(new.tolist()).strip())
    return "\n".join(pieces)


def qwen_checkpoint(folder: Path) -> Path:
    """The Qwen3-0.6B-shaped float32 folder: matrices N(0, 1/in), norms 1, the
    tied embedding N(0, 0.1) (logits of a few units), the real tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_0_6B), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "qwen-tokenizer" / name, folder)
    return folder


def gguf_files(checkpoint: Path, tree: Path, out: Path, name: str) -> dict[str, Path]:
    files = {"f32": out / f"{name}-f32.gguf"}
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
                    "--outfile", str(files["f32"])], check=True, capture_output=True)
    quantizer = tree / "build" / "bin" / "llama-quantize"
    for kind, extra in (("q8_0", []), ("q4_0-pure", ["--pure"]), ("q4_1-pure", ["--pure"]), ("q4_k_m", [])):
        files[kind] = out / f"{name}-{kind}.gguf"
        qtype = kind.split("-")[0].upper()
        subprocess.run([str(quantizer), *extra, str(files["f32"]), str(files[kind]), qtype, "2"], check=True,
                       capture_output=True)
    return files


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[np.ndarray]:
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = np.asarray(ids[start : start + ctx], np.int32)
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


@eqx.filter_jit
def _through_cache(model, ids, cache_dtype: str):
    """Logits of `ids` fed one token at a time through a new cache of `cache_dtype`:
    every token then attends to keys and values as that cache stores them, its own
    included (as llama.cpp, which writes a batch's keys to its cache before attending)."""
    cache = model.init_cache(1, ids.shape[0], dtype=cache_dtype)

    def step(cache, token):
        logits, cache = model(token.reshape(1, 1), cache)
        return cache, logits[0, 0]

    return jax.lax.scan(step, cache, ids)[1]


def log_probs(model, chunk: np.ndarray, cache_dtype: str | None = None) -> np.ndarray:
    if cache_dtype is None:
        logits = model(jnp.asarray(chunk[None]))[0][0]
    else:
        logits = _through_cache(model, jnp.asarray(chunk), cache_dtype)
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def measure_ours(variants: dict, token_chunks: list[np.ndarray], prompt: list[int]) -> dict:
    """Perplexity, KL from float32, same top token, greedy agreement, per variant."""
    sums = {name: dict(nll=0.0, kl=0.0, same_top=0, count=0) for name in variants}
    cache_of = lambda name: OURS[name].get("cache")
    for chunk in token_chunks:
        first = len(chunk) // 2
        targets = chunk[first + 1 :]
        base = log_probs(variants["float32"], chunk)[first:-1]
        for name, model in variants.items():
            lp = base if name == "float32" else log_probs(model, chunk, cache_of(name))[first:-1]
            s = sums[name]
            s["nll"] -= float(lp[np.arange(len(targets)), targets].sum())
            s["kl"] += float((np.exp(base) * (base - lp)).sum())
            s["same_top"] += int((lp.argmax(-1) == base.argmax(-1)).sum())
            s["count"] += len(targets)
    greedy = eqx_models.generate(variants["float32"], prompt, max_new_tokens=200)[0]
    sequence = np.asarray(prompt + greedy.tolist(), np.int32)
    out = {}
    for name, model in variants.items():
        s = sums[name]
        predicted = log_probs(model, sequence, cache_of(name)).argmax(-1)[len(prompt) - 1 : -1]
        free = eqx_models.generate(model, prompt, max_new_tokens=200, cache_dtype=cache_of(name))[0]
        leaves = np.nonzero(free != greedy)[0]
        out[name] = dict(
            perplexity=float(np.exp(s["nll"] / s["count"])),
            mean_kl_vs_float32=s["kl"] / s["count"],
            same_top_token_pct=100 * s["same_top"] / s["count"],
            greedy_agreement_200_pct=float(100 * (predicted == greedy).mean()),
            greedy_first_divergence=int(leaves[0]) if len(leaves) else None,
            scored_tokens=s["count"],
        )
    return out


def measure_llama_cpp(binary: Path, files: dict[str, Path], text_file: Path, ctx: int, work: Path) -> dict:
    """llama-perplexity's PPL, mean KLD and "same top" for each quantized file."""
    tool = str(binary / "llama-perplexity")
    base = work / "base.kld"
    # No weight repacking: on an AVX-512 CPU llama.cpp's repacked Q8_0 path crashed (SIGSEGV) on
    # stories260K's 64-wide matrices; the quantized values and their products are the same.
    common = ["-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", "2", "--no-repack"]
    refusal = r"cache type \S+ with block size \d+ does not divide \S+"

    def perplexity(args: list[str], wanted: str) -> str:
        # llama.cpp logs from a thread of its own, and its last lines are now and then
        # lost at exit (the final estimate or the error missing): run again then.
        for _ in range(5):
            run = subprocess.run([tool, *args], capture_output=True, text=True)
            text = run.stdout + run.stderr
            if re.search(wanted, text) or (run.returncode != 0 and re.search(refusal, text)):
                return text
        raise RuntimeError(f"llama-perplexity {' '.join(args)} failed ({run.returncode}):\n{text[-3000:]}")

    text = perplexity(["-m", str(files["f32"]), *common, "--kl-divergence-base", str(base)], r"Final estimate")
    out = {"F32": dict(perplexity=float(re.search(r"Final estimate: PPL = ([0-9.]+)", text).group(1)))}
    for label, (kind, extra) in LLAMA_CPP.items():
        text = perplexity(["-m", str(files[kind]), *common, *extra, "--kl-divergence-base", str(base),
                           "--kl-divergence"], r"Same top p:")
        refused = re.search(refusal, text)
        if refused:  # Q8_0 cache blocks of 32 on stories260K's 8-wide heads
            out[label] = dict(not_run=refused.group(0))
            continue
        number = lambda pattern: float(re.search(pattern, text).group(1))
        out[label] = dict(
            perplexity=number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
            mean_kl_vs_float32=number(r"Mean\s+KLD:\s*([0-9.eE+-]+)"),
            same_top_token_pct=number(r"Same top p:\s*([0-9.]+)"),
        )
    return out


def load_variants(folder: Path, files: dict[str, Path]) -> dict:
    base = eqx_models.from_pretrained(folder, dtype=jnp.float32)
    variants = {}
    for name, how in OURS.items():
        if "gguf" in how:
            variants[name] = eqx_models.from_pretrained(files[how["gguf"]])
        elif "quantize" in how:
            variants[name] = quantize(base, keep_indivisible=True, **how["quantize"])
        else:  # float32 weights (with the cache `how` names)
            variants[name] = base
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with build/bin")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--output", type=Path, default=RESULTS / "quality.json")
    args = parser.parse_args()

    text = sampled_text()
    results = {"benchmark": "quality", "ctx": args.ctx, "text_characters": len(text), "models": {}}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        text_file = work / "text.txt"
        text_file.write_text(text)
        for name, folder in (("stories260K", FIXTURES / "stories260K"),
                             ("Qwen3-0.6B-shaped, random unit-scale weights", None)):
            folder = folder or qwen_checkpoint(work / "qwen3")
            files = gguf_files(folder, args.llama_cpp, work, folder.name)
            tokenizer = eqx_models.load_tokenizer(files["f32"])  # llama.cpp's tokens, rebuilt
            ids = tokenizer.encode(text)
            token_chunks = chunks(ids, args.ctx, tokenizer.bos_token_id if ids[0] == tokenizer.bos_token_id else None)
            prompt = tokenizer.encode("Once upon a time")
            variants = load_variants(folder, files)
            results["models"][name] = dict(
                text_tokens=len(ids),
                eqx_models=measure_ours(variants, token_chunks, prompt),
                llama_cpp=measure_llama_cpp(args.llama_cpp / "build" / "bin", files, text_file, args.ctx, work),
            )
            del variants
            jax.clear_caches()
            print(json.dumps(results["models"][name], indent=2), flush=True)
    version = subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-perplexity"), "--version"],
                             capture_output=True, text=True)
    results["llama_cpp_version"] = (version.stdout + version.stderr).strip().splitlines()[-1:]
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
