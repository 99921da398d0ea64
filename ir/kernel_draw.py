"""Draw a KernelIR as one panel per kernel, in launch order (matplotlib), for notebooks and docs.

Each panel shows the kernel's name, grid and threads (a blue title band for a kernel that is
parallel over chunks, orange for one that loops over them, as in the ChunkIR drawing); the
global tensors it reads (left edge, grey) and writes (right edge, green); its buffers grouped by
where they live (shared memory, register fragments); its warpgroup roles; and its statements,
those inside the loop over chunks framed in red. An arrow between panels is a global tensor one
kernel writes and a later one reads (gdn: g_cum and T_r from gdn_prep to gdn_scan), labelled
with the tensor's name and shape.

    >>> from qla_compiler import compile_spec
    >>> from qla_compiler.ir.kernel_draw import draw, to_svg
    >>> prog = compile_spec("gdn")                             # doctest: +SKIP
    >>> draw(prog.kernels).savefig("gdn_kernels.png")         # doctest: +SKIP
    >>> svg = to_svg(prog.kernels)        # what _repr_html_ embeds   # doctest: +SKIP
"""
from __future__ import annotations

import math
import textwrap

from .display import canvas, svg

COLOURS = {"in": "#e6e6e6", "out": "#cdeac0", "parallel": "#cfe2f3", "loop": "#fbd9b4",
           "shared": "#e4dcf0", "fragment": "#fff2c6", "panel": "#fcfcfc"}
LOOP_COLOUR = "#d62728"
ARROW_COLOUR = "#3a3a3a"
STMT_COLOURS = {"load": "#1f5f99", "store": "#2a6b1f", "gemm": "#9a4a00", "wait": "#7a1f99", "arrive": "#7a1f99",
                "fence": "#7a1f99"}  # by the op's prefix (barriers: purple)
SCOPES = (("shared", "shared memory"), ("fragment", "registers (fragments)"))
FONT = 8.5  # points, sans-serif text; all geometry below is in inches so it never depends on dpi
MONO = 8.0  # points, code (statements, buffers, tensors)
SANS_EM, BOLD_EM, MONO_EM = 0.62, 0.70, 0.61  # advance per character, in em (DejaVu)
LINE = 0.165  # pitch of a line of code
CHIP_H, CHIP_PITCH, PORT = 0.17, 0.22, 0.06  # tensor chips; PORT: how far they stick out
PAD, GAP, INSET = 0.14, 0.14, 0.13
STMT_CHARS = 60


def _w(text: str, size: float = MONO, em: float = MONO_EM) -> float:
    """Width of `text` in inches (DejaVu Sans Mono exactly, DejaVu Sans about)."""
    return len(text) * size * em / 72


def _clip(stmt, n: int = STMT_CHARS) -> str:
    s = " ".join(str(stmt).split())
    return s if len(s) <= n else s[:n - 1] + "…"


def _shape(shape) -> str:
    return "×".join(map(str, shape)) if shape else "()"


def _tensor(t, released: bool = False) -> str:
    return f"{t.dtype}[{', '.join(map(str, t.shape))}]" + (f" in {t.reuses}'s memory" if t.reuses else "") \
        + (", then released" if released else "")


def _wrap(text: str, width: float, size: float) -> list:
    return textwrap.wrap(text, max(16, int(width / (size * SANS_EM / 72)))) or [""]


def _stmt_colour(stmt) -> str:
    return next((c for p, c in STMT_COLOURS.items() if stmt.op.startswith(p)), "#222222")


def crossings(kernel_ir) -> list:
    """(writer index, reader index, Tensor) for every global tensor one kernel writes and a later
    kernel reads, in launch order; a later writer of the same tensor hides the earlier one."""
    ks, found = kernel_ir.kernels, []
    for i, a in enumerate(ks):
        for t in (p for p in a.params if p.role == "out"):
            for j in range(i + 1, len(ks)):
                if any(p.role == "in" and p.name == t.name for p in ks[j].params):
                    found.append((i, j, t))
                if any(p.role == "out" and p.name == t.name for p in ks[j].params):
                    break
    return found


def _panel(k, order: str) -> dict:
    """One kernel's panel in local inches: x from its left edge, y down from its top (negative).
    Returns width, height, texts, boxes and the ports (chip ends) of its global tensors."""
    ins = [t for t in k.params if t.role == "in"]
    outs = [t for t in k.params if t.role != "in"]
    grid = f"grid({', '.join(f'{a}:{e}' for a, e in k.grid)})   {k.threads} threads" \
        + (f", {k.ctas_per_sm} CTAs an SM" if k.ctas_per_sm else "")
    groups = []
    for scope, title in SCOPES:
        bufs = [b for b in k.buffers if b.scope == scope]
        if bufs:
            n, d = max(len(b.name) for b in bufs), max(len(b.dtype) for b in bufs)
            rows = [f"{b.name:<{n}}  {b.dtype:<{d}}  {_shape(b.shape)}" + (f" ×{b.stages}" if b.stages > 1 else "")
                    + (f"  {b.warp_columns} cols a warp" if b.warp_columns else "") for b in bufs]
            need = max(max(_w(r) for r in rows), _w(title, FONT - 0.5, BOLD_EM)) + 2 * 0.1
            groups.append((scope, f"{title} ({len(bufs)})", rows, need))
    looped = bool(k.loop)
    unit = "token" if k.kind == "token_step" else "chunk"
    loop_head = (f"for {unit} in {k.loop}" + ("   (pipelined: STAGES buffers per load)" if unit == "chunk" else "")
                 if looped else "")
    # (a warp-specialised kernel: each role's own statements, one framed loop per role)
    sections = [(f"role {r.name}: threads [{r.first}, {r.first + r.threads}), {r.registers} registers",
                 r.prologue, r.body, r.epilogue) for r in k.warp_roles] or [("", k.prologue, k.body, k.epilogue)]
    if k.padding:  # (a token step's padding entries run these instead)
        sections.append(("a padding entry instead of all above", (), k.padding, ()))
    code = [(s, _clip(s)) for _, pro, body, epi in sections for s in [*pro, *body, *epi]]
    chip = lambda ts: max((_w(f"{t.name}  {_tensor(t, t.name in k.releases)}", MONO - 0.5) for t in ts),
                          default=0) + 0.16
    chip_in, chip_out = chip(ins), chip(outs)
    inner = max(2.6, _w(k.name, FONT + 3, BOLD_EM) + _w(order, FONT - 1, SANS_EM) + 0.3,
                _w(grid, FONT, SANS_EM),
                sum(g[3] for g in groups) + GAP * (len(groups) - 1),
                max((_w(c) for _, c in code), default=0) + (2 * INSET if looped else 0),
                _w(loop_head, FONT - 0.5, BOLD_EM) + 2 * INSET)
    W = max(inner + 2 * PAD, chip_in + chip_out + 0.4)
    inner = W - 2 * PAD
    texts, boxes, ports = [], [], {}

    def text(x, y, s, size=FONT, **kw):
        texts.append((x, y, s, dict(fontsize=size, va="center", **kw)))

    # title band: name, launch order, grid and threads, what the kernel does
    y = -PAD - 0.1
    text(PAD, y, k.name, FONT + 3, fontweight="bold")
    text(W - PAD, y, order, FONT - 1, ha="right", color="#555555")
    y -= 0.27
    text(PAD, y, grid)
    for line in _wrap(k.doc, inner, FONT - 0.5) if k.doc else []:
        y -= 0.165
        text(PAD, y, line, FONT - 0.5, style="italic", color="#444444")
    y -= 0.17
    boxes.append((0, 0, W, -y, dict(fc=COLOURS["loop" if looped else "parallel"], ec="none",
                                    round=False)))

    # global memory: reads on the left edge, writes on the right edge
    y -= 0.17
    text(PAD, y, "in", FONT - 0.5, fontweight="bold", color="#555555")
    text(W / 2, y, "global memory", FONT - 0.5, style="italic", color="#555555", ha="center")
    text(W - PAD, y, "out", FONT - 0.5, fontweight="bold", color="#555555", ha="right")
    y -= 0.06
    for r in range(max(len(ins), len(outs))):
        yc = y - CHIP_PITCH * r - CHIP_PITCH / 2
        for side, ts, w in ((-1, ins, chip_in), (1, outs, chip_out)):
            if r < len(ts):
                t = ts[r]
                x0 = -PORT if side < 0 else W + PORT - w
                boxes.append((x0, yc + CHIP_H / 2, w, CHIP_H,
                              dict(fc=COLOURS["in" if side < 0 else "out"], ec="#777777",
                                   zorder=3.5)))  # over the panel's outline
                text(x0 + 0.08, yc, t.name, MONO - 0.5, family="monospace", fontweight="bold")
                text(x0 + 0.08 + _w(t.name + "  ", MONO - 0.5), yc, _tensor(t, t.name in k.releases), MONO - 0.5,
                     family="monospace", color="#333333")
                ports[("in" if side < 0 else "out", t.name)] = (x0 if side < 0 else x0 + w, yc)
    y -= CHIP_PITCH * max(len(ins), len(outs), 1) + 0.12

    # buffers, one box per place they live, side by side
    if groups:
        widths = [g[3] for g in groups]
        if len(groups) == 2:  # share the width out, neither narrower than it needs
            widths[0] = min(max((inner - GAP) / 2, widths[0]), inner - GAP - widths[1])
            widths[1] = inner - GAP - widths[0]
        else:
            widths = [inner]
        x, tallest = PAD, 0
        for (scope, title, rows, _), w in zip(groups, widths):
            h = 0.24 + LINE * len(rows) + 0.06
            boxes.append((x, y, w, h, dict(fc=COLOURS[scope], ec="#777777")))
            text(x + 0.1, y - 0.12, title, FONT - 0.5, fontweight="bold", color="#333333")
            for i, row in enumerate(rows):
                text(x + 0.1, y - 0.24 - LINE * (i + 0.5), row, MONO, family="monospace")
            x, tallest = x + w + GAP, max(tallest, h)
        y -= tallest + 0.1

    # warpgroup roles, and the barriers between them
    if k.roles:
        y -= 0.08
        text(PAD, y, "warpgroups", FONT - 0.5, fontweight="bold", color="#555555")
        for role in k.roles:
            for i, line in enumerate(_wrap(role, inner - 0.15, FONT - 0.5)):
                y -= 0.16
                text(PAD + (0 if i == 0 else 0.15), y, ("• " if i == 0 else "") + line, FONT - 0.5)
        y -= 0.12
    if k.barriers:
        text(PAD, y, "barriers", FONT - 0.5, fontweight="bold", color="#555555")
        for b in k.barriers:
            y -= LINE
            text(PAD, y, _clip(f"{b.name}[{b.stages}]  {b.arrivals} arrivals  {b.kind}: {' '.join(b.guards)}"),
                 MONO, family="monospace")
        y -= 0.12

    # statements; the loop over chunks framed
    y -= 0.08
    text(PAD, y, "statements", FONT - 0.5, fontweight="bold", color="#555555")
    y -= 0.04

    def lines(stmts, x):
        nonlocal y
        for s in stmts:
            y -= LINE
            text(x, y, _clip(s), MONO, family="monospace", color=_stmt_colour(s))

    for title, pro, body, epi in sections:
        if title:
            y -= 0.2
            text(PAD, y, title, FONT - 0.5, fontweight="bold", color="#333333")
        lines(pro, PAD)
        if looped:
            y -= 0.08
            top = y
            y -= 0.2
            text(PAD + INSET, y, f"for {unit} in " + k.loop if title else loop_head, FONT - 0.5, fontweight="bold",
                 color=LOOP_COLOUR)
            y -= 0.02
            lines(body, PAD + INSET)
            y -= 0.1
            boxes.append((PAD, top, inner, top - y, dict(fc="none", ec=LOOP_COLOUR, lw=1.4)))
            y -= 0.04
        else:
            lines(body, PAD)
        lines(epi, PAD)
    y -= LINE / 2 + PAD
    return dict(W=W, H=-y, texts=texts, boxes=boxes, ports=ports, looped=looped)


def _rounded(points, r: float = 0.07):
    """A polyline with its corners rounded, as (vertices, codes) for matplotlib's Path."""
    from matplotlib.path import Path

    verts, codes = [points[0]], [Path.MOVETO]
    for (ax_, ay), (bx, by), (cx, cy) in zip(points, points[1:], points[2:]):
        d1, d2 = math.hypot(bx - ax_, by - ay), math.hypot(cx - bx, cy - by)
        if min(d1, d2) < 1e-9:
            continue
        q = min(r, d1 / 2, d2 / 2)
        verts += [(bx - (bx - ax_) / d1 * q, by - (by - ay) / d1 * q), (bx, by),
                  (bx + (cx - bx) / d2 * q, by + (cy - by) / d2 * q)]
        codes += [Path.LINETO, Path.CURVE3, Path.CURVE3]
    verts.append(points[-1])
    codes.append(Path.LINETO)
    return Path(verts, codes)


def draw(kernel_ir, ax=None):
    """Draw `kernel_ir` onto `ax` (a new figure sized to the content if None); returns the figure."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    ks, cross = kernel_ir.kernels, crossings(kernel_ir)
    panels = [_panel(k, f"launch {i + 1}/{len(ks)}") for i, k in enumerate(ks)]
    label = {c: (c[2].name, _tensor(c[2])) for c in cross}
    label_w = {c: _w(f"{a}  {b}", MONO - 0.5) + 0.2 for c, (a, b) in label.items()}

    # Each crossing leaves its writer through the gap to the writer's right and enters its reader
    # through the gap to the reader's left, on a vertical lane of its own in each; one that skips
    # kernels runs over the top of the panels. Labels sit on the first leg, left of every lane.
    LANE = 0.13
    lanes = {g: [] for g in range(len(ks))}  # gap g: between panel g and g + 1
    for c in sorted(cross, key=lambda c: -panels[c[0]]["ports"]["out", c[2].name][1]):
        lanes[c[0]].append(("out", c))  # the top row takes the lane furthest right: no crossing
        if c[1] > c[0] + 1:
            lanes[c[1] - 1].append(("in", c))
    over = [c for c in cross if c[1] > c[0] + 1]
    gaps = []
    for g in range(len(ks) - 1):
        room = max((label_w[c] for side, c in lanes[g] if side == "out"), default=0)
        gaps.append(max(0.6, room + 0.15 + LANE * (len(lanes[g]) + 1)))

    host = [f"host: {h}" for h in kernel_ir.host]
    margin = 0.35
    xs = [margin]
    for p, g in zip(panels, gaps):
        xs.append(xs[-1] + p["W"] + g)
    width = xs[-1] + panels[-1]["W"] + margin if panels else 2 * margin
    width = max(width, 6.0)
    host_lines = [ln for h in host for ln in _wrap(h, width - 2 * margin, FONT - 0.5)]
    shift = (width - (xs[-1] + (panels[-1]["W"] if panels else 0) + margin)) / 2
    xs = [x + shift for x in xs]
    legend = [Patch(fc=COLOURS["in"], ec="#777777", label="read from global memory"),
              Patch(fc=COLOURS["out"], ec="#777777", label="written to global memory"),
              *[Patch(fc=COLOURS[scope], ec="#777777", label=label)
                for scope, label in (("shared", "shared-memory buffer"), ("fragment", "register fragment"))
                if any(b.scope == scope for k in ks for b in k.buffers)]]
    if any(not p["looped"] for p in panels):
        legend.append(Patch(fc=COLOURS["parallel"], label="kernel parallel over chunks"))
    if any(p["looped"] for p in panels):  # (a token step's loop walks tokens)
        units = "tokens" if all(k.kind == "token_step" for k in kernel_ir.kernels) else "chunks"
        legend += [Patch(fc=COLOURS["loop"], label=f"kernel looping over {units}"),
                   Line2D([], [], color=LOOP_COLOUR, lw=1.4, label=f"loop over {units}")]
    if cross:
        legend.append(Line2D([], [], color=ARROW_COLOUR, lw=1.1, marker=">", markersize=4,
                             label="tensor passed to a later kernel"))
    ncol = max(1, min(4, int((width - 0.4) / 2.4)))
    top = 0.55 + 0.17 * len(host_lines) + (0.15 + 0.16 * len(over) if over else 0.15)
    bottom = 0.3 + 0.2 * math.ceil(len(legend) / ncol)
    height = max((p["H"] for p in panels), default=0)
    x0, x1, y0, y1 = 0, width, -height - bottom, top
    fig, ax = canvas(ax, x0, x1, y0, y1)

    for x, p in zip(xs, panels):
        ax.add_patch(FancyBboxPatch((x, -p["H"]), p["W"], p["H"],
                                    boxstyle="round,pad=0,rounding_size=0.08",
                                    fc=COLOURS["panel"], ec="#555555", lw=1.0, zorder=1))
        for bx, by, bw, bh, kw in p["boxes"]:
            kw = dict(kw)
            rounded = kw.pop("round", True)
            style = "round,pad=0,rounding_size=0.05" if rounded else "square,pad=0"
            ax.add_patch(FancyBboxPatch((x + bx, by - bh), bw, bh, boxstyle=style,
                                        lw=kw.pop("lw", 0.7), zorder=kw.pop("zorder", 2), **kw))
        for tx, ty, s, kw in p["texts"]:
            ax.text(x + tx, ty, s, zorder=4, **kw)
    # the title band's square corners would poke out of the rounded panel: redraw the outline
    for x, p in zip(xs, panels):
        ax.add_patch(FancyBboxPatch((x, -p["H"]), p["W"], p["H"],
                                    boxstyle="round,pad=0,rounding_size=0.08",
                                    fc="none", ec="#555555", lw=1.0, zorder=3))

    lane_x = {}
    for g, used in lanes.items():
        if g >= len(ks) - 1:
            continue
        right = xs[g + 1] - PORT - 0.12  # lanes from the reader's side leftwards
        for n, key in enumerate(used):
            lane_x[key] = right - LANE * n
    labelled = set()  # one label per writer's port, however many later kernels read it
    for c in cross:
        i, j, t = c
        (ox, oy), (ix, iy) = panels[i]["ports"]["out", t.name], panels[j]["ports"]["in", t.name]
        ox, ix = ox + xs[i], ix + xs[j]
        la = lane_x[("out", c)]
        if j == i + 1:
            pts = [(ox, oy), (la, oy), (la, iy), (ix, iy)]
        else:
            yt = 0.15 + 0.16 * over.index(c)
            lb = lane_x[("in", c)]
            pts = [(ox, oy), (la, oy), (la, yt), (lb, yt), (lb, iy), (ix, iy)]
        ax.add_patch(FancyArrowPatch(path=_rounded(pts), arrowstyle="-|>", mutation_scale=10,
                                     lw=1.1, color=ARROW_COLOUR, zorder=5,
                                     shrinkA=0, shrinkB=0))
        if (i, t.name) in labelled:
            continue
        labelled.add((i, t.name))
        name, shape = label[c]
        lx = ox + 0.1
        ax.text(lx, oy + 0.025, name, fontsize=MONO - 0.5, family="monospace", fontweight="bold",
                va="bottom", zorder=6, gid=f"crossing-{ks[i].name}-{name}")
        ax.text(lx + _w(name + "  ", MONO - 0.5), oy + 0.025, shape, fontsize=MONO - 0.5,
                family="monospace", va="bottom", color="#333333", zorder=6)

    ax.text(width / 2, y1 - 0.3, f"{kernel_ir.name}   C={kernel_ir.chunk_size}   "
            f"{len(ks)} kernel{'' if len(ks) == 1 else 's'}, in launch order",
            ha="center", va="center", fontsize=FONT + 4, fontweight="bold")
    for n, line in enumerate(host_lines):
        ax.text(margin, y1 - 0.6 - 0.17 * n, line, fontsize=FONT - 0.5, va="center",
                color="#444444", style="italic")
    ax.legend(handles=legend, loc="lower center", ncol=ncol, fontsize=FONT, frameon=False,
              bbox_to_anchor=(0.5, 0.0))
    return fig


def to_svg(kernel_ir) -> str:
    """The drawing as an SVG string, text kept as <text> so labels stay searchable."""
    return svg(draw, kernel_ir)
