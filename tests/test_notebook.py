"""notebooks/gdn_walkthrough.ipynb runs top to bottom, and is committed without outputs (never stale)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "gdn_walkthrough.ipynb"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A `python3` kernelspec that runs this interpreter (the venv's ipykernel), found first via
    JUPYTER_PATH; runtime and IPython dirs in tmp so a fresh or read-only home does not matter."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (qla test)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return spec_dir


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for i, c in enumerate(code):
        assert c.outputs == [], f"code cell {i} has stored outputs: clear them before committing"
        assert c.execution_count is None, f"code cell {i} has an execution count"


def test_notebook_runs_top_to_bottom(kernel_env):
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    rich = "\n".join(str(v) for o in outputs for v in o.get("data", {}).values())
    # the story the notebook tells actually came out
    assert "recurrence(step=exp(g)" in text  # the spec's source
    assert text.count("relative error vs the reference") >= 7  # one line per chunk stage
    assert "node 'Gamma_inv'" in text  # the verifier's refusal
    assert "D X D⁻¹ form                 finite: False" in text
    assert "chunk_program gdn" in rich and "T_r" in rich
    # 4. each rewrite by what it changed, under its identity, drawn with what it touched outlined
    assert "by: (I + StrictLower(X ⊙ R))⁻¹ = R ⊙ T_r" in rich and "+ T_r:C×C" in rich
    assert "~ T:C×C      = mul T_r R    (was inv_unit_lower A)" in rich
    assert "removed by the pass: sKKt_R, A" in rich and "added by the pass" in rich
    assert "by: e^x = 2^(x·log₂e)" in rich and "no change" in text  # (fold_constant_gates, on GDN)
    assert "tensors crossing into the scan" in rich
    # 7. gradients: the backward program, drawn, and one gradient error per input, all tiny
    assert "chunk_program gdn_backward" in rich and "d_S_next" in rich
    assert "reverse scan: True, carrying d_S_next" in text
    header = "gradient: relative error vs autograd through the reference"
    assert header in text
    table = text.split(header, 1)[1]
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        row = re.search(rf"^{name} +\(.*?\) +(\S+)$", table, re.M)
        assert row, f"no gradient error printed for {name}"
        assert float(row.group(1)) <= 1e-10, (name, row.group(1))
    # 8. kernels: the partition, the KernelIR, the generated TileLang (not lowered to CUDA)
    assert "kernel gdn_prep (parallel over chunks)" in text and "through memory: g_cum W U" in text
    assert all(f"kernel gdn_{k}" in rich for k in ("prep", "scan", "out")) and "fragment state" in rich
    assert "Shape class: H=2 HV=8 K=128 V=128 BV=16" in text and "v_new_decayed_s" in text
    assert "def gdn_scan(" in text and "T.alloc_fragment((K, BV)" in text
    assert "chunk_program gdn_affine" in rich and "out M=" in rich  # context parallelism
    assert all(f"context_parallel={s}:" in text for s in (1, 2, 4, 8))
    # the gate's shortcut: mild gates walk whole segments, strong decay one chunk (two after a short one)
    assert "value head: [[0, 0, 0, 0], [0, 0, 0, 0]]" in text and "value head: [[2, 2, 1, 0], [2, 2, 1, 0]]" in text
    assert "kernel gdn_fused_windows" in text and "past the first skip_chunks[sequence, value head]" in text
    # 10. the backward as kernels: a reverse scan, and emulated gradients close to autograd's
    assert "kernel gdn_backward_scan" in text and "last to first" in text
    table = text.split("backward, emulated kernels: relative error vs autograd through the reference", 1)[1]
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        row = re.search(rf"^  d_{name} +(\S+)$", table, re.M)
        assert row and float(row.group(1)) <= 1e-2, (name, row)
