"""examples/notebook.ipynb runs top to bottom in a fresh kernel, and is committed without outputs."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "notebook.ipynb")


def _read():
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_saved_without_outputs():
    nb = _read()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [], f"code cell {i} has saved outputs"
        assert cell.get("execution_count") is None, f"code cell {i} has an execution_count"


def test_notebook_runs():
    nb = _read()
    # Runs in the notebook's directory (it imports gpt.py from there); a failing cell raises
    # CellExecutionError, which names the cell and carries its traceback.
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}})
    client.execute()
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "error"
    ]
    assert not errors, errors
    # the plot rendered inline
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    ), "no figure was displayed"
