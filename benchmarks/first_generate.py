"""The README's main command on a fresh machine: `eqx-models generate` on the
stories260K fixture, timed from the shell with no kernels built yet (a fresh
`EQX_MODELS_CACHE`), then again with them built.

The target (issue 36): the first answer within 30 s, the kernel build saying what
it does. Records the wall time of each run, the kernel libraries the first run
built, and its stderr's compile line.

    python benchmarks/first_generate.py                      # writes results/first_generate.json
    python benchmarks/first_generate.py --out results/first_generate_tpu.json   # on the TPU machine
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = Path(os.environ.get("EQX_MODELS_FIXTURES", HERE.parent.parent / "shared" / "fixtures"))
COMMAND = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "48"]
TARGET_S = 30.0


def timed_generate(model: Path, cache: Path) -> dict:
    """One `eqx-models generate` in a new process: wall seconds, stdout, stderr."""
    env = dict(os.environ, EQX_MODELS_CACHE=str(cache))
    launcher = "import sys; from eqx_models.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", launcher, COMMAND[0], str(model), *COMMAND[1:]]
    started = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"generate failed:\n{run.stderr[-3000:]}")
    return {"wall_s": round(seconds, 2), "stdout": run.stdout.strip(), "stderr": run.stderr.strip().splitlines()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=FIXTURES / "stories260K")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "first_generate.json")
    args = parser.parse_args()
    import jax

    with tempfile.TemporaryDirectory() as cache:
        first = timed_generate(args.model, Path(cache))
        built = sorted(p.name.split("-")[0].removeprefix("libeqx_models_") for p in Path(cache).rglob("*.so"))
        again = timed_generate(args.model, Path(cache))
    result = {
        "command": "eqx-models " + " ".join([COMMAND[0], str(args.model.name), *COMMAND[1:]]),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "machine": _cpu_name(),
        "target_s": TARGET_S,
        "first_run": {**first, "kernels_built": built},
        "kernels_already_built": again,
        "first_run_within_target": first["wall_s"] <= TARGET_S,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"first run {first['wall_s']} s (kernels built: {', '.join(built) or 'none'}), "
          f"with them built {again['wall_s']} s; target {TARGET_S} s -> {args.out}")


if __name__ == "__main__":
    main()
