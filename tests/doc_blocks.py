"""Runs the code blocks of a docs page that are marked runnable, in order.

A block is runnable when the line just before its opening fence is `<!-- run -->`
(invisible on the rendered page). Python blocks of a page share one namespace,
like the cells of a notebook; bash blocks go to one bash process per page, so a
variable set or a server started in one block is there in the next. Any failing
command fails the page.

    python tests/doc_blocks.py docs/quickstart.md   # from any working directory

Prints a header line per block (`=== block N: LANGUAGE, line L ===`) before its
output; exits 1 naming the block that failed. Kept free of heavy imports, so a
page may set environment variables (XLA_FLAGS, say) before it imports jax.
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path

MARKER = "<!-- run -->"
LANGUAGES = ("python", "bash")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")


@dataclasses.dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence


class DocBlockError(ValueError):
    """A page whose run markers cannot be read as meant."""


def runnable_blocks(path: Path) -> list[Block]:
    """The marked blocks of the page at `path`, in order."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("<!--") and "run" in line and line != MARKER:
            raise DocBlockError(f"{path}:{i + 1}: {line!r} looks like a run marker; write exactly {MARKER!r}.")
        if line != MARKER:
            i += 1
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(2) not in LANGUAGES:
            raise DocBlockError(f"{path}:{i + 1}: {MARKER} must sit right above a ```python or ```bash fence.")
        ticks, start = fence.group(1), i + 2
        end = next((j for j in range(start, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise DocBlockError(f"{path}:{i + 2}: the marked block is never closed.")
        blocks.append(Block(fence.group(2), "\n".join(lines[start:end]) + "\n", i + 2))
        i = end + 1
    return blocks


class BashSession:
    """One bash process that runs blocks one after another, keeping its state."""

    DONE = "__eqx_models_doc_block_done__"

    def __init__(self):
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1, start_new_session=True,
        )

    def run(self, code: str) -> bool:
        """Runs `code` with `set -eo pipefail`; False when it failed (bash has exited)."""
        self.process.stdin.write(f"set -eo pipefail\n{code}\necho {self.DONE}\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.endswith(self.DONE + "\n"):  # after output with no final newline (curl's)
                rest = line[: -len(self.DONE) - 1]
                sys.stdout.write(rest + "\n" if rest else "")
                return True
            sys.stdout.write(line)
            sys.stdout.flush()
        return False

    def close(self):
        """Ends bash and anything a block left running (a server in the background)."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def run_page(path: Path) -> int:
    blocks = runnable_blocks(path)
    namespace = {"__name__": "__main__"}
    bash = BashSession() if any(b.language == "bash" for b in blocks) else None
    try:
        for number, block in enumerate(blocks, 1):
            print(f"=== block {number}: {block.language}, line {block.line} ===", flush=True)
            if block.language == "python":
                try:
                    exec(compile(block.code, f"{path}:{block.line}", "exec"), namespace)
                except BaseException:
                    traceback.print_exc()
                    ok = False
                else:
                    ok = True
                sys.stdout.flush()
            else:
                ok = bash.run(block.code)
            if not ok:
                print(f"FAILED: block {number} ({block.language}) at {path}:{block.line}", file=sys.stderr)
                return 1
    finally:
        if bash is not None:
            bash.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_page(Path(sys.argv[1]).resolve()))
