"""The CLI imports TileLang (and torch) only for the stages that need them: `--help` none of the
compiler, `--emit recurrence|chunk|backward|affine` neither, the kernels' stages torch but not
TileLang (only lowering to CUDA does). Timings: benchmarks/NOTES.md, "CLI start-up"."""
import subprocess
import sys

import pytest

HEAVY = ("tilelang", "tvm", "torch")


def _imported_by(argv: list) -> set:
    code = (
        "import contextlib, io, sys\n"
        "from qla_compiler.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        rc = main({argv!r})\n"
        "    except SystemExit as e:\n"
        "        rc = e.code\n"
        "assert rc == 0, rc\n"
        "print(' '.join(sorted(m for m in sys.modules if '.' not in m)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(r.stdout.split())


def test_help_imports_none_of_the_compiler():
    mods = _imported_by(["--help"])
    assert not mods & {*HEAVY, "sympy", "networkx"}, mods & {*HEAVY, "sympy", "networkx"}


@pytest.mark.parametrize("emit", ["recurrence", "chunk", "backward", "affine"])
def test_ir_stages_import_neither_tilelang_nor_torch(emit):
    mods = _imported_by(["gdn", "--emit", emit])
    assert not mods & set(HEAVY), mods & set(HEAVY)


def test_kernel_stages_do_not_import_tilelang():
    mods = _imported_by(["gdn", "--emit", "tilelang"])
    assert "torch" in mods and not mods & {"tilelang", "tvm"}, mods & {"tilelang", "tvm"}
