"""qla-compile --print-after-all: per pass what it changed, under the identity that justified it;
=full adds the whole IR after every pass."""
import re

from qla_compiler.cli import main
from qla_compiler.passes.pipeline import identity, pass_names
from qla_compiler.passes.rewrites import CHUNK_PASSES


def _sections(out: str) -> dict:
    parts = re.split(r"^// ----- after (\S+) -----$", out, flags=re.M)
    return {name: body.strip("\n") for name, body in zip(parts[1::2], parts[2::2])}


def test_each_rewrite_prints_its_changes_and_identity(capsys):
    assert main(["gdn", "--print-after-all"]) == 0
    out = capsys.readouterr().out
    sections = _sections(out)
    assert list(sections) == pass_names()
    assert sections["chunk"].startswith("chunk_program gdn  C=64")  # the program the diffs start from
    for p in CHUNK_PASSES:
        assert sections[p.name].startswith(f"by: {identity(p.name)}\n"), p.name
        assert "chunk_program" not in sections[p.name], p.name  # a diff, not the listing
    goi = sections["gate_out_of_inverse"].splitlines()
    assert "+ T_r:C×C    = inv_unit_lower A_r" in goi and "~ T:C×C      = mul T_r R    (was inv_unit_lower A)" in goi
    assert re.search(r"^no change \(\d+ nodes\)$", sections["verify_exponents"], re.M)
    assert sections["partition"].startswith("partition gdn")
    assert sections["schedule"].splitlines()[1:4] == [
        ln for ln in sections["schedule"].splitlines() if ln.startswith("kernel gdn_")]
    assert "(--print-after-all=full or --emit kernel: the kernels in full)" in sections["schedule"]
    assert len(out.splitlines()) < 200  # (the full listings were 500 lines)


def test_full_adds_the_whole_ir_after_each_pass(capsys):
    assert main(["gdn", "--emit", "chunk", "--print-after-all=full"]) == 0
    out = capsys.readouterr().out
    sections = _sections(out)
    for p in CHUNK_PASSES:
        body = sections[p.name]
        assert body.startswith(f"by: {identity(p.name)}\n") and "\nchunk_program gdn  C=64" in body, p.name
    assert "kernel gdn_scan" in sections["schedule"] and "  in  k: io[1, T, H, K]" in sections["schedule"]
    assert out.rstrip().endswith("} out o=o state=S_next")  # then what --emit asked for


def test_the_mode_may_follow_as_its_own_argument(capsys):
    assert main(["--print-after-all", "full", "linear_attn", "--stop-after", "chunk"]) == 0
    assert list(_sections(capsys.readouterr().out)) == ["frontend", "classify", "chunk"]
