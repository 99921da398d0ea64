"""What a pass changed (ir/chunk_diff.py): a function of the two chunk programs that accounts for
every node, names each rewrite's identity, and draws the program with what the pass touched."""
import subprocess
import sys

import pytest

import qla_compiler
from conftest import SPECS, svg_texts
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_diff import chunk_diff
from qla_compiler.passes.pipeline import identity
from qla_compiler.passes.rewrite_cse import CSE


def _definition(ir, name, names=None):
    n = ir.node(name)
    return n.op, tuple((names or {}).get(a, a) for a in n.args), n.attrs, n.shape


@pytest.mark.parametrize("spec", SPECS)
def test_every_pass_diff_accounts_for_every_node(spec):
    prog = qla_compiler.compile_spec(spec)
    diffs = prog.diffs()
    assert [n for n, _ in diffs] == [n for n, ir in prog.stages[3:] if isinstance(ir, ChunkIR)]
    for name, d in diffs:
        before, after = d.before, d.after
        assert d.why == identity(name) and str(d).startswith(f"by: {d.why}\n")
        gone = {c.before.name for c in d.changes if c.kind in ("removed", "renamed", "merged")}
        new = {c.after.name for c in d.changes if c.kind in ("added", "renamed")}
        assert set(after.graph) == (set(before.graph) - gone) | new, name
        names = {c.before.name: c.after.name for c in d.changes if c.kind in ("renamed", "merged")}
        for x in set(before.graph) & set(after.graph):  # in both: rewritten iff its definition changed
            changed = _definition(before, x, names) != _definition(after, x)
            assert changed == (x in d.rewritten), (name, x)


def test_gate_out_of_inverse_on_gdn():
    d = qla_compiler.compile_spec("gdn").diff("gate_out_of_inverse")
    assert (d.removed, d.added, d.rewritten) == (("sKKt_R", "A"), ("A_r", "T_r"), ("T",))
    assert d.touched() == {"A_r": "added", "T_r": "added", "T": "rewritten"}
    lines = str(d).splitlines()
    assert lines[0] == "by: (I + StrictLower(X ⊙ R))⁻¹ = R ⊙ T_r,  T_r = (I + StrictLower(X))⁻¹"
    assert lines[1:-1] == ["- sKKt_R:C×C = mul sKKt R", "- A:C×C      = tril[strict=True] sKKt_R",
                           "+ A_r:C×C    = tril[strict=True] sKKt", "+ T_r:C×C    = inv_unit_lower A_r",
                           "~ T:C×C      = mul T_r R    (was inv_unit_lower A)"]
    assert lines[-1].startswith("2 removed, 2 added, 1 rewritten: ")


def test_no_change():
    ir = qla_compiler.compile_spec("gdn").chunk
    d = chunk_diff(ir, ir.copy())
    assert not d and d.changes == () and str(d) == f"no change ({len(ir.graph)} nodes)"
    with pytest.raises(ValueError, match="not a pass from a chunk program"):
        qla_compiler.compile_spec("gdn").diff("partition")
    with pytest.raises(ValueError, match="no pass named 'nosuch'"):
        qla_compiler.compile_spec("gdn").diff("nosuch")


def _program(duplicate: bool) -> ChunkIR:
    ir = ChunkIR("demo", 64)
    g = ir.add("g", "input", name="g", kind="gate")
    a = ir.add("a", "cumsum", g)
    b = ir.add("b", "cumsum", g) if duplicate else a
    ir.outputs["o"] = ir.add("o", "add", a, b)
    return ir


def test_cse_merges_and_the_users_are_not_rewritten():
    before = _program(duplicate=True)
    d = chunk_diff(before, CSE.run(before), why=CSE.identity)
    assert [(c.kind, c.before.name, c.after.name) for c in d.changes] == [("merged", "b", "a")]
    assert d.rewritten == () and d.touched() == {"a": "merged"}
    assert str(d).splitlines()[1:] == ["= b:C merged into a", "1 merged: 4 → 3 nodes"]


def test_rename_and_a_new_output():
    before = _program(duplicate=False)
    after = before.copy()
    after.rename("a", "a_cum")
    d = chunk_diff(before, after)
    assert [(c.kind, c.before.name, c.after.name) for c in d.changes] == [("renamed", "a", "a_cum")]
    assert str(d).splitlines() == ["= a_cum:C (was a)", "1 renamed: 3 → 3 nodes"]
    after.outputs["o"] = after.add("o2", "neg", "o")
    d = chunk_diff(before, after)
    assert d.added == ("o2",) and d.outputs == (("o", "o", "o2"),) and "  out o: o → o2" in str(d)


def test_drawing_outlines_what_the_pass_touched():
    pytest.importorskip("matplotlib")
    from qla_compiler.ir.chunk_draw import to_svg

    d = qla_compiler.compile_spec("gdn").diff("gate_out_of_inverse")
    texts = svg_texts(to_svg(d))
    assert {"removed by the pass: sKKt_R, A", "added by the pass", "rewritten by the pass"} <= texts
    assert {"A_r", "T_r", "T"} <= texts and "sKKt_R" not in texts
    html = d._repr_html_()
    assert html.startswith("<pre>by: (I + StrictLower") and "<svg" in html
    assert "rewritten by the pass" not in svg_texts(to_svg(d.after))  # a program alone: no legend for it


def test_the_diff_is_an_ir_module_importing_no_pass():
    code = ("import sys, qla_compiler.ir.chunk_diff; "
            "assert not [m for m in sys.modules if m.startswith('qla_compiler.passes')], sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
