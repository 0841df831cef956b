"""examples/quickstart.ipynb runs end to end (nbclient, as CI runs it) on this interpreter and shows what it
promises: the mesh, the schedule table and its plot, a live loss plot whose loss falls, the measured bubble and a
planner answer."""

import json
import math
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT

NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def execute(path: Path, tmp_path: Path, monkeypatch):
    """Run the notebook in a kernel of this interpreter (a private kernelspec, so no other Python's is picked)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    spec = tmp_path / "jupyter" / "kernels" / "ptd_jax_test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "ptd_jax test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="ptd_jax_test", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    return nb


def outputs(nb, kind):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and kind == "text":
                yield out["text"]
            elif out["output_type"] in ("display_data", "execute_result") and kind in out.get("data", {}):
                yield out["data"][kind]


@pytest.mark.slow  # about 50 s: the whole notebook in a kernel
def test_quickstart_notebook_runs_and_shows_what_it_promises(tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, tmp_path, monkeypatch)
    text = "".join(outputs(nb, "text"))
    (result,) = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("NOTEBOOK_RESULT ")]
    assert result["python"] == sys.executable and result["devices"] == 4
    assert "tick kind" in text and "mesh axes {'data': 1, 'pipe': 2, 'tensor': 2}" in text
    assert len(result["logged_losses"]) == 10
    assert result["final_lm_loss"] < result["first_lm_loss"] - 1.0  # byte-level: ln 257 = 5.55 at the start
    assert "pipeline: measured bubble" in text and 0 < result["simulated_bubble"] < 1
    assert isinstance(result["measured_bubble"], float) and math.isfinite(result["measured_bubble"])
    assert 50 < result["predicted_tflops_per_gpu"] < 312 and "why the best wins" in text
    assert len(list(outputs(nb, "image/png"))) >= 2  # the schedule plot and the live loss plot
