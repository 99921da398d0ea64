"""The KernelIR drawing: an SVG with every kernel, buffer and tensor passed between kernels,
embedded in _repr_html_."""
import pytest

import qla_compiler
from conftest import KERNEL_SPECS as SPECS, svg_texts
from qla_compiler.ir.kernel_draw import crossings, draw, to_svg

pytest.importorskip("matplotlib")

# global tensors a kernel writes and a later one reads, per spec
CROSSING = {"gdn": {"g_cum", "W_rows", "U_rows", "S0_chunks", "v_new_rows"},
            "delta_net": {"W_rows", "U_rows", "S0_chunks", "v_new_rows"},
            "simple_gla": {"g_cum", "S0_chunks"}, "retnet": {"S0_chunks"}, "linear_attn": {"S0_chunks"},
            # a per-key gate's cumulative gates cross in float32 (schedule_build.log_space)
            "gla": {"g_cum_log2_rows", "S0_chunks"},
            # (and KDA's q ⋆ k, formed beside k ⋆ k in the prep: partition.SHARE_DECAYS)
            "kda": {"g_cum_log2_rows", "W_rows", "U_rows", "P_rows", "S0_chunks", "v_new_rows"}}


@pytest.fixture(scope="module")
def kernels():
    return {name: qla_compiler.compile_spec(name).kernels for name in SPECS}


@pytest.mark.parametrize("spec", SPECS)
def test_svg_has_every_kernel_buffer_and_crossing(kernels, spec):
    kir = kernels[spec]
    svg = to_svg(kir)
    texts = svg_texts(svg)
    words = {t.split()[0] for t in texts if t}
    for k in kir.kernels:
        assert k.name in texts, k.name
        assert any(t.startswith("grid(") and f"{k.threads} threads" in t for t in texts)
        for b in k.buffers:
            assert b.name in words, (k.name, b.name)
        for p in k.params:
            assert p.name in texts, (k.name, p.name)  # its chip (name, then dtype[shape])
    assert any("for chunk in" in t for t in texts)
    assert {t.name for _, _, t in crossings(kir)} == CROSSING[spec]
    for i, _, t in crossings(kir):
        assert f'id="crossing-{kir.kernels[i].name}-{t.name}"' in svg
        shape = f"{t.dtype}[{', '.join(t.shape)}]"
        assert shape in texts


@pytest.mark.parametrize("spec", SPECS)
def test_repr_html_embeds_the_drawing(kernels, spec):
    out = kernels[spec]._repr_html_()
    assert out.startswith("<pre>")  # the text form first
    assert out.index("</pre>") < out.index("<svg")


def test_statements_are_one_line_and_clipped(kernels):
    texts = svg_texts(to_svg(kernels["gdn"]))
    stmts = [" ".join(str(s).split()) for k in kernels["gdn"].kernels
             for s in (*k.prologue, *k.body, *k.epilogue)]
    assert any(len(s) > 60 for s in stmts)  # gdn's scan has statements longer than a line
    for s in stmts:
        shown = s if len(s) <= 60 else s[:59] + "…"
        assert shown in texts, shown


def test_crossing_that_skips_a_kernel():
    """A tensor from the first kernel to the third runs past the second."""
    kir = qla_compiler.compile_spec("gdn").kernels
    assert [(i, j, t.name) for i, j, t in crossings(kir)] == [
        (0, 1, "g_cum"), (0, 2, "g_cum"), (0, 1, "W_rows"), (0, 1, "U_rows"),
        (1, 2, "S0_chunks"), (1, 2, "v_new_rows")]
    svg = to_svg(kir)
    for gid in ("gdn_prep-g_cum", "gdn_prep-W_rows", "gdn_scan-S0_chunks"):
        assert f'id="crossing-{gid}"' in svg
    assert svg.count('id="crossing-gdn_prep-g_cum"') == 1  # one label per port


def test_figure_grows_with_the_content(kernels):
    one, two = draw(kernels["linear_attn"]), draw(kernels["gdn"])
    w1, h1 = one.get_size_inches()
    w2, h2 = two.get_size_inches()
    assert w2 > w1 and h2 > h1


def test_draw_onto_given_axes(kernels):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert draw(kernels["gdn"], ax=ax) is fig
    assert len(ax.patches) >= sum(len(k.params) for k in kernels["gdn"].kernels)


# rc settings and the lazy matplotlib import are shared with chunk_draw: tests/test_draw.py


def test_the_token_step_draws_its_token_loop_and_its_padding_entries():
    """The decode kernel's loop is over tokens (no pipelined chunk loads), and what a padding
    entry runs instead (its o's zeros) is drawn too."""
    kir = qla_compiler.compile_spec("gdn").token_step_program.kernels
    (k,) = kir.kernels
    texts = svg_texts(to_svg(kir))
    assert "for token in tokens of the sequence" in texts and not any("for chunk" in t for t in texts)
    assert "a padding entry instead of all above" in texts
    assert all(str(s) in texts for s in k.padding)
