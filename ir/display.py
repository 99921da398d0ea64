"""How IRs show themselves in notebooks: the text form, then a drawing when matplotlib is there.

The drawings live in their own modules (chunk_draw, kernel_draw) and import matplotlib only when
asked, so importing or compiling never needs it.
"""
from __future__ import annotations

import html
import importlib
import io


def svg(draw, ir) -> str:
    """draw(ir) -> Figure, as an SVG string with text kept as <text> (labels stay searchable)."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        buf = io.StringIO()
        draw(ir).savefig(buf, format="svg")
    return buf.getvalue()


def canvas(ax, x0, x1, y0, y1):
    """An axes spanning [x0, x1] × [y0, y1] in inches, one unit an inch (a new figure if ax is None)."""
    if ax is None:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure list

        ax = Figure(figsize=(x1 - x0, y1 - y0)).add_axes((0, 0, 1, 1))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax.figure, ax


def rich_html(ir, drawing_module: str) -> str:
    """<pre>text</pre> followed by the drawing of `qla_compiler.ir.<drawing_module>`, if it can draw."""
    try:
        drawing = importlib.import_module(f"{__package__}.{drawing_module}").to_svg(ir)
    except ImportError:
        drawing = ""
    return f"<pre>{html.escape(str(ir))}</pre>{drawing}"
