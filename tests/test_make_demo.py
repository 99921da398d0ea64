"""`make demo` prints the summary and the chunk program, then says where the kernels and the
TileLang module were written and how to print them (the README's first command)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_make_demo(tmp_path):
    bindir = Path(sys.executable).parent
    if shutil.which("make") is None or not (bindir / "qla-compile").exists():
        pytest.skip("needs make and the qla-compile script beside this interpreter")
    # -o: take the set-up as done (this interpreter has the package); OUT: not the checkout's qla-out
    r = subprocess.run(["make", "-s", "-o", ".venv/.installed", "demo", f"BIN={bindir}", f"OUT={tmp_path}"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True)
    out = r.stdout
    assert out.startswith("recurrence gdn"), out[:200]
    summary, chunk = out.index("chunk program (C=64) after"), out.index("chunk_program gdn  C=64 {")
    kernels, module = tmp_path / "gdn.kernel.txt", tmp_path / "gdn.tilelang.py"
    wrote = out.index(f"wrote {kernels}")
    assert summary < chunk < wrote < out.index(f"wrote {module}")
    assert f"cat {kernels}" in out and f"cat {module}" in out and "--emit kernel" in out
    assert kernels.read_text().startswith("kernel_program gdn") and "@T.prim_func" in module.read_text()
    assert len(out.splitlines()) < 100  # the summary stays on the screen (it was 451 lines)
