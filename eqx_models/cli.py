"""The `eqx-models` command line."""

import argparse
import json
import sys
import time
from pathlib import Path

from . import __version__
from .quantization import PRESETS


def _generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from .generation import stream_generate
    from .hub import from_pretrained
    from .tokenizer import StreamDecoder, load_tokenizer

    started = time.perf_counter()
    print(f"Loading {args.model} ({args.dtype}{', ' + args.quantize if args.quantize else ''}) ...", file=sys.stderr,
          flush=True)
    model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), revision=args.revision,
                            quantize=_quantize_option(args))
    tokenizer = load_tokenizer(args.model, revision=args.revision)
    print(f"Loaded in {time.perf_counter() - started:.1f}s.", file=sys.stderr, flush=True)

    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    eos = tokenizer.eos_token_ids or model.config.eos_token_id
    decoder = StreamDecoder(tokenizer, prompt_ids)

    started = time.perf_counter()
    first_token_at = None
    count = 0
    for tokens in stream_generate(
        model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=eos,
        cache_dtype=args.kv_cache_dtype,
    ):
        if first_token_at is None:
            first_token_at = time.perf_counter()
        count += 1
        sys.stdout.write(decoder.push(tokens.tolist()))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    finished = time.perf_counter()

    prefill_s = first_token_at - started
    decode_s = finished - first_token_at
    decode_rate = (count - 1) / decode_s if count > 1 and decode_s > 0 else float("nan")
    print(
        f"prompt: {len(prompt_ids)} tokens in {prefill_s:.2f}s "
        f"({len(prompt_ids) / prefill_s:.1f} tokens/s, compilation included) | "
        f"decode: {count} tokens, {decode_rate:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    import jax.numpy as jnp

    try:
        from .serving.server import Server, run
    except ImportError as error:  # starlette / uvicorn are the `serve` extra
        raise ValueError(f"serving needs the 'serve' extra: pip install 'eqx_models[serve]' ({error})") from None
    from .hub import from_pretrained
    from .serving import Engine
    from .tokenizer import load_tokenizer

    if args.max_request_bytes < 1:  # before the model loads
        raise ValueError(f"--max-request-bytes must be a positive number of bytes, got {args.max_request_bytes}.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mesh = None
    if args.mesh:
        from .sharding import device_mesh, parse_mesh_shape

        mesh = device_mesh(parse_mesh_shape(args.mesh))
    elif args.sharding:
        raise ValueError("--sharding lays the model out on a mesh: give --mesh too (e.g. --mesh tensor=4).")
    model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), revision=args.revision,
                            quantize=_quantize_option(args), mesh=mesh, sharding=args.sharding)
    tokenizer = load_tokenizer(args.tokenizer or args.model, revision=None if args.tokenizer else args.revision)
    engine = Engine(
        model,
        tokenizer,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        memory_utilization=args.memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
    )
    server = Server(engine, tokenizer, args.served_model_name or args.model, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes)
    run(server, args.host, args.port)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from .config import load_json
    from .hub import resolve_model_dir
    from .models import architecture_for
    from .memory import memory_plan
    from .sharding import parse_mesh_shape

    folder = resolve_model_dir(args.model, revision=args.revision, allow_patterns=["config.json"])
    hf_config = load_json(folder / "config.json")
    config = architecture_for(hf_config).config_from_hf(hf_config)
    plan = memory_plan(
        config, parse_mesh_shape(args.mesh), args.sharding, dtype=jnp.dtype(args.dtype),
        batch_size=args.batch_size, max_length=args.max_length,
    )
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    gb = lambda n: f"{n / 1e9:10.2f} GB"
    mesh = " x ".join(f"{name}={size}" for name, size in plan["mesh"].items())
    print(f"{args.model} ({args.dtype}) on {plan['devices']} devices ({mesh}), sharding {args.sharding or 'default'}")
    print(f"{'':24}{'in all':>13}{'per device':>13}")
    print(f"{'parameters':24}{gb(plan['parameter_bytes'])} {gb(plan['parameter_bytes_per_device'])}")
    if args.batch_size and args.max_length:
        label = f"KV cache {args.batch_size} x {args.max_length}"
        print(f"{label:24}{gb(plan['cache_bytes'])} {gb(plan['cache_bytes_per_device'])}")
    print(f"{'per device in all':24}{'':13} {gb(plan['per_device_bytes'])}")
    return 0


def _finetune(args: argparse.Namespace) -> int:
    import shutil

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from .data import pack, read_documents
    from .hub import TOKENIZER_FILES, from_pretrained, resolve_model_dir, save_pretrained
    from .lora import apply_lora, lora_filter, merge_lora, save_adapters
    from .tokenizer import load_tokenizer
    from .training import make_train_step

    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if args.quantize and not args.lora_rank:
        raise ValueError("--quantize trains LoRA adapters on the frozen quantized base (QLoRA); give --lora-rank, "
                         "or drop --quantize to train every weight.")
    print(f"Loading {args.model} ({args.dtype}{', ' + args.quantize if args.quantize else ''}) ...", file=sys.stderr,
          flush=True)
    model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), revision=args.revision,
                            quantize=_quantize_option(args))
    tokenizer = load_tokenizer(args.model, revision=args.revision)
    limit = model.config.max_position_embeddings
    if args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings ({limit}).")
    data = pack(read_documents(args.data, tokenizer, max_tokens=args.seq_len), args.seq_len,
                pad_token_id=(tokenizer.eos_token_ids or [0])[0])
    rows = data["input_ids"].shape[0]
    print(f"{rows} packed rows of {args.seq_len} tokens from {args.data}", file=sys.stderr, flush=True)

    key = jax.random.key(args.seed)
    trainable = eqx.is_inexact_array  # every weight, unless adapters train alone
    if args.lora_rank:
        model = apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets, key=key)
        trainable = lora_filter(model)
    model = model.with_remat(args.remat)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, min(args.warmup_steps, args.steps),
                                                  args.steps, end_value=args.learning_rate * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adamw(schedule, weight_decay=0.0))
    init, step = make_train_step(optimizer, trainable=trainable, accumulation_steps=args.accumulation_steps)
    opt_state = init(model)
    order = np.random.default_rng(args.seed)
    progress = tqdm(range(args.steps), desc="finetune", unit="step", file=sys.stderr)
    started, tokens = time.perf_counter(), 0
    for _ in progress:
        picked = order.integers(0, rows, args.batch_size)
        model, opt_state, metrics = step(model, opt_state, {k: v[picked] for k, v in data.items()})
        tokens += int(metrics["tokens"])
        progress.set_postfix(loss=f"{float(metrics['loss']):.4f}", tok_s=f"{tokens / (time.perf_counter() - started):.0f}")

    out = Path(args.out)
    if args.lora_rank:
        save_adapters(model, out / "adapter", base_model_name_or_path=str(args.model))
        model = merge_lora(model)
    save_pretrained(model.with_remat("none"), out)
    source = resolve_model_dir(args.model, revision=args.revision, allow_patterns=TOKENIZER_FILES)
    for name in TOKENIZER_FILES:
        if (source / name).exists() and not (out / name).exists():
            shutil.copy(source / name, out / name)
    print(f"Saved to {out} (from_pretrained loads it){'; adapters in ' + str(out / 'adapter') if args.lora_rank else ''}",
          file=sys.stderr)
    return 0


def _quantize_option(args) -> dict | None:
    """`from_pretrained`'s `quantize` for `--quantize`: layers whose width the group
    does not divide stay float, as llama.cpp's quantizer leaves them."""
    if not args.quantize:
        return None
    return dict(PRESETS[args.quantize], keep_indivisible=True)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one to show and
    its text does not already name it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eqx-models", description="Decoder language models in JAX/Equinox.")
    parser.add_argument("--version", action="version", version=f"eqx-models {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="Continue a prompt; prints the continuation to stdout.",
                           formatter_class=_HelpWithDefaults)
    gen.add_argument("model", help="Hugging Face hub id (e.g. Qwen/Qwen3-0.6B) or a local folder.")
    gen.add_argument("--prompt", required=True, help="Text to continue.")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily.")
    gen.add_argument("--top-k", type=int, default=None, help="Sample among the K most likely tokens (default: all).")
    gen.add_argument("--top-p", type=float, default=None,
                     help="Sample among the most likely tokens whose probability reaches P (default: all).")
    gen.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    gen.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Weight dtype (default float32: CPUs without bfloat16 matmuls run it fastest).",
    )
    gen.add_argument("--quantize", choices=list(PRESETS), default=None,
                     help="Quantize the weights while loading: int8/int4 in groups of 32 (llama.cpp's Q8_0/Q4_0 "
                          "shape), int4-affine in groups of 64 with a scale and a bias each (mlx-lm's).")
    gen.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                     help="KV cache dtype (default: the weights'); int8 keeps a scale per token and head, "
                          "about half of bfloat16's bytes.")
    gen.add_argument("--revision", default=None, help="Hub branch, tag or commit.")
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the tokenizer's chat template.")
    gen.set_defaults(run=_generate)

    serve = commands.add_parser("serve", help="Serve the OpenAI completions and chat API over HTTP.",
                             formatter_class=_HelpWithDefaults)
    serve.add_argument("model", help="Hugging Face hub id or a local folder.")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    serve.add_argument("--served-model-name", default=None, help="Name clients use (default: MODEL).")
    serve.add_argument("--tokenizer", default=None, help="Tokenizer folder or hub id (default: MODEL).")
    serve.add_argument("--max-model-len", type=int, default=None, help="Most tokens per sequence (default: the model's).")
    serve.add_argument("--max-num-seqs", type=int, default=32, help="Most sequences decoding at once.")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512, help="Most tokens computed per step.")
    serve.add_argument("--page-size", type=int, default=16, help="Tokens per KV cache page.")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None, help="KV cache pages in the pool.")
    pool.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes (instead of --num-pages).")
    pool.add_argument("--memory-utilization", type=float, default=None,
                      help="On an accelerator, the fraction of its memory to fill: weights, a step's temporaries, "
                           "then as many KV pages as fit (default 0.9 there; the CPU reports no memory: "
                           "--kv-cache-memory).")
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="Weight dtype.")
    serve.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                       help="KV page dtype (default: the weights'); int8 fits about twice bfloat16's tokens.")
    serve.add_argument("--quantize", choices=list(PRESETS), default=None,
                       help="Quantize the weights while loading: int8/int4 in groups of 32 (llama.cpp's Q8_0/Q4_0 "
                            "shape), int4-affine in groups of 64 with a scale and a bias each (mlx-lm's).")
    serve.add_argument("--no-prefix-caching", action="store_true",
                       help="Compute every prompt whole, instead of reusing the cached pages of a prefix it shares "
                            "with an earlier request.")
    serve.add_argument("--seed", type=int, default=0, help="Seeds requests that bring no seed.")
    serve.add_argument("--api-key", default=None,
                       help="Require 'Authorization: Bearer KEY' on the /v1 routes (/health and /metrics stay open).")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20,
                       help="Largest request body in bytes; a larger one is refused with 413.")
    serve.add_argument("--revision", default=None, help="Hub branch, tag or commit.")
    serve.add_argument("--mesh", default=None,
                       help="Serve over this process's devices as a mesh, e.g. tensor=4 (data, fsdp, tensor, expert); "
                            "the sizes multiply to the device count.")
    serve.add_argument("--sharding", choices=["default", "dp", "fsdp", "tp", "ep"], default=None,
                       help="With --mesh: the sharding preset (default: the default rules for the mesh's axes).")
    serve.set_defaults(run=_serve)

    plan = commands.add_parser(
        "plan", formatter_class=_HelpWithDefaults,
        help="Per-device memory of a model on a device mesh (from config.json alone; nothing is loaded)."
    )
    plan.add_argument("model", help="Hugging Face hub id or a local folder (only config.json is read).")
    plan.add_argument("--mesh", required=True, help="Mesh axes and sizes, e.g. tensor=4,expert=2 (data, fsdp, tensor, expert).")
    plan.add_argument("--sharding", choices=["default", "dp", "fsdp", "tp", "ep"], default=None,
                      help="Sharding preset (default: the default rules for the mesh's axes).")
    plan.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="Weight dtype.")
    plan.add_argument("--batch-size", type=int, default=0, help="With --max-length: also plan a KV cache this wide.")
    plan.add_argument("--max-length", type=int, default=0, help="Tokens per row of the planned KV cache.")
    plan.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    plan.add_argument("--revision", default=None, help="Hub branch, tag or commit.")
    plan.set_defaults(run=_plan)

    tune = commands.add_parser("finetune", formatter_class=_HelpWithDefaults,
                               help="Fine-tune on a JSON-lines file (LoRA or full); saves a loadable model.")
    tune.add_argument("model", help="Hugging Face hub id or a local folder.")
    tune.add_argument("--data", required=True,
                      help='JSON lines: {"text": ...} or {"prompt": ..., "completion": ...} (loss on the completion).')
    tune.add_argument("--out", required=True, help="Folder for the result (config.json, safetensors, tokenizer).")
    tune.add_argument("--steps", type=int, default=100, help="Optimizer steps.")
    tune.add_argument("--lora-rank", type=int, default=8, help="0 trains every weight instead of adapters.")
    tune.add_argument("--lora-alpha", type=float, default=None, help="LoRA scaling numerator (default: the rank).")
    tune.add_argument("--lora-targets", default="q_proj|k_proj|v_proj|o_proj", help="Regex of projections to adapt.")
    tune.add_argument("--learning-rate", type=float, default=1e-3, help="Peak learning rate (AdamW).")
    tune.add_argument("--warmup-steps", type=int, default=10, help="Steps of linear warm-up.")
    tune.add_argument("--max-grad-norm", type=float, default=1.0, help="Gradients are clipped to this global norm.")
    tune.add_argument("--batch-size", type=int, default=8, help="Packed rows per step.")
    tune.add_argument("--accumulation-steps", type=int, default=1, help="Micro-batches per step (divides --batch-size).")
    tune.add_argument("--seq-len", type=int, default=256, help="Tokens per packed row.")
    tune.add_argument("--remat", choices=["none", "dots", "full"], default="none", help="Rematerialisation policy.")
    tune.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="Weight dtype.")
    tune.add_argument("--quantize", choices=list(PRESETS), default=None,
                      help="Train LoRA adapters on a base quantized while loading (QLoRA); the saved model is "
                           "the merged sum, quantized again.")
    tune.add_argument("--seed", type=int, default=0, help="Seed of the adapters and the batch order.")
    tune.add_argument("--revision", default=None, help="Hub branch, tag or commit.")
    tune.set_defaults(run=_finetune)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `eqx-models` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"eqx-models: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
