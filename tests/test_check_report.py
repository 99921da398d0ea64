"""qla-compile --check reports each pass's relative error against the reference, and the worst."""
import re

import qla_compiler
from qla_compiler.cli import main
from qla_compiler.check_mode import TOLERANCE
from qla_compiler.passes.pipeline import pass_names


def test_check_mode_keeps_every_chunk_pass_error():
    prog = qla_compiler.compile_spec("gdn", check=True)
    names = pass_names()
    assert list(prog.checked) == names[names.index("chunk"):names.index("partition")]
    assert all(len(e) == 2 and 0 <= min(e) and max(e) <= TOLERANCE for e in prog.checked.values())
    assert qla_compiler.compile_spec("gdn").checked == {}  # not measured unless asked


def test_check_prints_a_line_per_pass_and_the_worst(capsys):
    assert main(["gdn", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.index("chunk program (C=64)") < out.index("check: the ChunkIR interpreter against the reference")
    rows = re.findall(r"^  after (\S+) +o (\S+) +final state (\S+)$", out, re.M)
    prog = qla_compiler.compile_spec("gdn", check=True)
    assert [r[0] for r in rows] == list(prog.checked)
    worst = max(float(x) for r in rows for x in r[1:])
    m = re.search(r"^  worst: (\S+) \((o|final state) after (\S+)\); every pass within 1e-10$", out, re.M)
    assert m and float(m.group(1)) == worst and m.group(3) in prog.checked


def test_with_emit_the_report_goes_to_stderr(capsys):
    assert main(["linear_attn", "--emit", "chunk", "--check"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("chunk_program linear_attn") and "check:" not in cap.out
    assert "worst:" in cap.err


def test_nothing_to_check_before_the_chunk_program(capsys):
    assert main(["gdn", "--check", "--stop-after", "classify"]) == 0
    assert "check: nothing to check (the pipeline stopped before the chunk program)" in capsys.readouterr().out
