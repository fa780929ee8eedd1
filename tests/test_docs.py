"""The documentation: its runnable examples run, the site builds strictly, the
API reference covers every public name, and the public docstrings say what
their arguments and results are."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import eqx_models
from conftest import REPO, STORIES, require_fixture
from doc_blocks import MARKER, DocBlockError, runnable_blocks

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
RUNNER = REPO / "tests" / "doc_blocks.py"
# Pages whose examples are meant to run; a marker lost in an edit shows up here.
PAGES_WITH_EXAMPLES = {
    "quickstart.md", "concepts.md", "generation.md", "loading.md", "serving.md",
    "sharding.md", "finetuning.md", "troubleshooting.md", "quantization.md",
}


def example_env() -> dict[str, str]:
    """The notebooks' switch: hub ids by default, the local fixture here (offline)."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "EQX_MODELS_EXAMPLE_MODEL": os.environ.get("EQX_MODELS_EXAMPLE_MODEL", str(require_fixture(STORIES))),
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
    }


def run_examples(page: Path, workdir: Path) -> dict[int, str]:
    """Runs the page's marked blocks in `workdir`; returns each block's output by number."""
    result = subprocess.run(
        [sys.executable, str(RUNNER), str(page)], cwd=workdir, env=example_env(),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    outputs, current = {}, None
    for line in result.stdout.splitlines(keepends=True):
        header = re.match(r"=== block (\d+): \w+, line \d+ ===", line)
        if header:
            current = int(header.group(1))
            outputs[current] = ""
        elif current is not None:
            outputs[current] += line
    return outputs


def test_the_pages_meant_to_carry_examples_do():
    with_examples = {p.relative_to(DOCS).as_posix() for p in PAGES if runnable_blocks(p)}
    assert with_examples == PAGES_WITH_EXAMPLES


def test_marker_parsing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"text\n{MARKER}\n```python\nx = 1\n```\n\n```python\nnot run\n```\n{MARKER}\n```bash\necho hi\n```\n")
    assert [(b.language, b.code, b.line) for b in runnable_blocks(page)] == [
        ("python", "x = 1\n", 3), ("bash", "echo hi\n", 11)]
    page.write_text("<!-- run: -->\n```python\nx = 1\n```\n")
    with pytest.raises(DocBlockError, match="looks like a run marker"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n\n```python\nx = 1\n```\n")
    with pytest.raises(DocBlockError, match="right above"):
        runnable_blocks(page)


def test_a_failing_block_fails_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```bash\nX=1\n```\n{MARKER}\n```bash\necho $X\nfalse\necho never\n```\n")
    result = subprocess.run([sys.executable, str(RUNNER), str(page)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "1\n" in result.stdout and "never" not in result.stdout  # state carried over, then stopped
    assert "FAILED: block 2 (bash)" in result.stderr
    page.write_text(f"{MARKER}\n```python\nraise SystemExit('no')\n```\n")
    result = subprocess.run([sys.executable, str(RUNNER), str(page)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "FAILED: block 1 (python)" in result.stderr


@pytest.mark.parametrize("name", sorted(PAGES_WITH_EXAMPLES - {"quickstart.md"}))
def test_page_examples_run(name, tmp_path):
    run_examples(DOCS / name, tmp_path)


def test_quickstart_gives_text_a_server_answer_and_a_finetuned_model(tmp_path):
    """A new user following only the quickstart, offline with the fixture path."""
    page = DOCS / "quickstart.md"
    text = page.read_text()
    readme = (REPO / "README.md").read_text()
    setup = re.search(r"```bash\n(python3 -m venv .*)\n", text).group(1)
    assert setup in readme  # the install the quickstart shows is the README's (CI runs it first)

    outputs = run_examples(page, tmp_path)
    blocks = runnable_blocks(page)
    by_kind = lambda needle: [outputs[i + 1] for i, b in enumerate(blocks) if needle in b.code]
    (cli_text,) = by_kind("eqx-models generate \"$MODEL\" --prompt")
    assert len(cli_text.split()) > 8  # the continuation (the prompt is not repeated)
    (python_text,) = by_kind("eqx_models.generate(")
    assert len(python_text.split()) > 8
    (served,) = by_kind("/v1/completions")
    reply = json.loads(served.strip().splitlines()[-1])
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"].strip()
    assert reply["usage"]["completion_tokens"] == 24
    assert (tmp_path / "tuned" / "config.json").exists()
    assert list((tmp_path / "tuned").glob("*.safetensors"))
    (after,) = by_kind("eqx-models generate tuned")
    assert "baked" in after  # what the training text has Pip do; the base model does not say it


def public_functions():
    """(qualified name, function) for every public function and method of `__all__`."""
    for name in eqx_models.__all__:
        obj = getattr(eqx_models, name)
        if not inspect.isclass(obj):
            yield name, obj
            continue
        for attr, value in vars(obj).items():
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            if inspect.isfunction(value) and (not attr.startswith("_") or attr == "__call__"):
                yield f"{name}.{attr}", value


def documented_names(docstring: str, section: str) -> set[str]:
    """The names a Google-style `section:` of `docstring` describes (`name: ...`,
    `name (type): ...`, or `a, b: ...` for several)."""
    lines = docstring.splitlines()
    if f"{section}:" not in lines:
        return set()
    names, indent = set(), None
    for line in lines[lines.index(f"{section}:") + 1:]:
        if not line.strip():
            continue
        if not line[0].isspace():
            break  # the next section
        level = len(line) - len(line.lstrip())
        indent = indent or level
        entry = re.match(r"\s*([\w*][\w*, ]*?)(?: \([^)]*\))?:", line) if level == indent else None
        if entry:
            names |= {n.strip().lstrip("*") for n in entry.group(1).split(",")}
    return names


def test_every_public_name_is_in_the_api_reference():
    reference = (DOCS / "api.md").read_text()
    listed = set(re.findall(r"^::: eqx_models\.(\w+)$", reference, re.M))
    assert set(eqx_models.__all__) <= listed, sorted(set(eqx_models.__all__) - listed)


@pytest.mark.parametrize("qualname, function", list(public_functions()), ids=lambda x: x if isinstance(x, str) else "")
def test_public_functions_document_arguments_and_returns(qualname, function):
    doc = inspect.getdoc(function)
    assert doc, f"{qualname} has no docstring"
    parameters = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
    if parameters:
        missing = set(parameters) - documented_names(doc, "Args")
        assert not missing, f"{qualname}: Args does not describe {sorted(missing)}"
    returns = inspect.signature(function).return_annotation
    if returns not in (None, inspect.Signature.empty) or function.__name__ == "__call__":
        assert re.search(r"^(Returns|Yields):", doc, re.M), f"{qualname}: no Returns section"


@pytest.mark.parametrize("name", [n for n in eqx_models.__all__ if inspect.isclass(getattr(eqx_models, n))])
def test_public_classes_document_their_fields(name):
    cls = getattr(eqx_models, name)
    doc = inspect.getdoc(cls)
    assert doc, f"{name} has no docstring"
    if issubclass(cls, Exception):
        return
    fields = [p for p in inspect.signature(cls).parameters if p not in ("self", "key")]
    missing = set(fields) - documented_names(doc, "Args") - documented_names(doc, "Attributes")
    assert not missing, f"{name}: the docstring does not describe {sorted(missing)}"


def test_site_builds_strictly_with_api_and_notebooks(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=example_env(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    api = (site / "api" / "index.html").read_text()
    for name in eqx_models.__all__:
        assert f'id="eqx_models.{name}"' in api, name
    quickstart_notebook = (site / "notebooks" / "01_quickstart" / "index.html").read_text()
    assert "max |full - cached|:" in quickstart_notebook  # an output, not only the source
    finetune_notebook = (site / "notebooks" / "02_finetune" / "index.html").read_text()
    assert "Reloaded:" in finetune_notebook and "data:image/png;base64" in finetune_notebook


def test_models_table_and_readme_row_are_the_registrys():
    """The docs' models table and the README's models row are generated from the
    registry (`python -m eqx_models.models`); an edit to either copy alone fails here."""
    from eqx_models.models import families, models_sentence, models_table

    assert models_table() in (DOCS / "models" / "index.md").read_text()
    readme_row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| Models |"))
    assert models_sentence() in readme_row
    home_row = next(line for line in (DOCS / "index.md").read_text().splitlines() if line.startswith("| **Models** |"))
    assert models_sentence() in home_row
    pages = {p.stem for p in (DOCS / "models").glob("*.md")} - {"index"}
    assert pages == {name for name, _ in families()}, "one page per family, docs/models/<module>.md"


def test_a_newcomer_finds_the_install_lines_for_serving_and_accelerators():
    """The README's first block installed nothing for `serve` and did not say so;
    no page named the TPU or GPU; troubleshooting named `huggingface-cli`, which
    current huggingface_hub no longer installs."""
    readme = (REPO / "README.md").read_text()
    first_screen = readme[: readme.index("**Run the tests**")]
    assert 'pip install -e ".[serve]"' in first_screen and "docs/accelerators.md" in first_screen
    accelerators = (DOCS / "accelerators.md").read_text()
    assert '"jax[tpu]"' in accelerators and '"jax[cuda13]"' in accelerators and "bfloat16" in accelerators
    assert "accelerators.md" in (REPO / "mkdocs.yml").read_text()
    for page in [REPO / "README.md", *PAGES]:
        assert "huggingface-cli" not in page.read_text(), page
