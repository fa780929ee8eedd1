"""Every notebook runs top to bottom against the local fixtures (no network)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, STORIES, require_fixture

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, monkeypatch):
    # As a newcomer runs them: with the fixtures beside the repository, the
    # notebooks find the model themselves (from notebooks/, where Jupyter runs them).
    chosen = os.environ.get("EQX_MODELS_EXAMPLE_MODEL")
    if chosen is None and not (REPO.parent / "shared" / "fixtures" / "stories260K").exists():
        chosen = str(require_fixture(STORIES))
    if chosen is None:
        monkeypatch.delenv("EQX_MODELS_EXAMPLE_MODEL", raising=False)
    else:
        monkeypatch.setenv("EQX_MODELS_EXAMPLE_MODEL", chosen)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
