"""The ChunkIR drawing: an SVG with every node, the loop-carried edge, embedded in _repr_html_."""
import pytest

import qla_compiler
from conftest import SPECS, svg_texts
from qla_compiler.ir.chunk_draw import draw, to_svg

pytest.importorskip("matplotlib")



@pytest.fixture(scope="module")
def chunks():
    return {name: qla_compiler.compile_spec(name).chunk for name in SPECS}


@pytest.mark.parametrize("spec", SPECS)
def test_svg_has_every_node_and_the_loop_edge(chunks, spec):
    chunk = chunks[spec]
    svg = to_svg(chunk)
    texts = svg_texts(svg)
    for n in chunk.order():
        assert n.name in texts, n.name
        assert any(t.startswith(f"{n.op} ") for t in texts), n.op
    assert "next chunk" in texts
    assert any(t.startswith(chunk.name) and f"C={chunk.chunk_size}" in t for t in texts)


@pytest.mark.parametrize("spec", SPECS)
def test_repr_html_embeds_the_drawing(chunks, spec):
    html = chunks[spec]._repr_html_()
    assert html.startswith("<pre>")
    assert "<svg" in html


def test_draw_onto_given_axes(chunks):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert draw(chunks["gdn"], ax=ax) is fig
    assert len(ax.patches) >= len(chunks["gdn"].graph)


@pytest.mark.parametrize("module, stage", [("chunk_draw", "chunk"), ("kernel_draw", "kernels")])
def test_to_svg_leaves_rc_params_alone(module, stage):
    import importlib

    import matplotlib

    before = matplotlib.rcParams["svg.fonttype"]
    importlib.import_module(f"qla_compiler.ir.{module}").to_svg(getattr(qla_compiler.compile_spec("retnet"), stage))
    assert matplotlib.rcParams["svg.fonttype"] == before


@pytest.mark.parametrize("module", ["chunk_draw", "kernel_draw"])
def test_ir_does_not_need_matplotlib(module):
    import subprocess
    import sys

    code = (f"import sys, qla_compiler, qla_compiler.ir.{module}; p = qla_compiler.compile_spec('gdn'); "
            "str(p.chunk); str(p.kernels); assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
