"""Draw a ChunkIR as a layered dataflow graph (matplotlib), for notebooks and docs.

Leaves (inputs, params, head constants) are grey, the work that is parallel over chunks blue,
the sequential scan orange and the outputs green; the dashed red arrow is the scan's
loop-carried edge, from the state leaving the chunk back to the state entering the next one.
Given what a pass changed (a ChunkDiff, ir/chunk_diff.py), it draws the program after the pass
with the nodes the pass added or rewrote outlined, and names the ones it removed.

    >>> from qla_compiler import compile_spec
    >>> from qla_compiler.ir.chunk_draw import draw, to_svg
    >>> prog = compile_spec("gdn")                          # doctest: +SKIP
    >>> draw(prog.chunk).savefig("gdn_chunk.png")          # doctest: +SKIP
    >>> svg = to_svg(prog.chunk)         # what _repr_html_ embeds   # doctest: +SKIP
    >>> draw(prog.diff("exp2"))          # exp2's new and rewritten nodes outlined   # doctest: +SKIP
"""
from __future__ import annotations

from .display import canvas, svg


LEAF_OPS = {"input", "param", "head_log", "const", "valid", "positions"}
COLOURS = {"leaf": "#e6e6e6", "parallel": "#cfe2f3", "scan": "#fbd9b4", "output": "#cdeac0"}
LOOP_COLOUR = "#d62728"
# the outline of a node a pass touched (ChunkDiff.touched), apart from every fill and the loop edge
TOUCHED = {"added": ("#6a3d9a", "added by the pass"), "rewritten": ("#e7298a", "rewritten by the pass"),
           "renamed": ("#e7298a", "renamed by the pass"), "merged": ("#e7298a", "another node merged into it")}
FONT = 8.5  # points; all geometry below is in inches so the drawing never depends on dpi
ROW = 0.85  # vertical distance between layers
BOX_H = 0.42


def _shape(shape) -> str:
    return "×".join(shape) if shape else "()"


def _role(chunk_ir, name, scan) -> str:
    if name in chunk_ir.outputs.values() or name == chunk_ir.next_state:
        return "output"
    if name in scan:  # includes state_in itself: it only exists inside the scan
        return "scan"
    return "leaf" if chunk_ir.node(name).op in LEAF_OPS else "parallel"


def _layout(chunk_ir, col, lane):
    """Positions (inches) of nodes, and each edge's route through the layers it crosses.

    Longest-path layering from the leaves, then leaves pulled down to just above their first
    use (otherwise every input sits on the top row and its edges cut across the whole drawing).
    An edge that skips layers gets a narrow virtual node in each layer it crosses, ordered like
    the real ones, so it runs between boxes instead of under them. A few barycenter sweeps then
    order each layer to cut crossings."""
    g, names, layer = chunk_ir.graph, [n.name for n in chunk_ir.order()], {}
    for n in names:
        layer[n] = 1 + max((layer[p] for p in g.predecessors(n)), default=-1)
    for n in names:
        if g.in_degree(n) == 0 and g.out_degree(n):
            layer[n] = min(layer[u] for u in g.successors(n)) - 1
    preds, succs, routes = {n: [] for n in names}, {n: [] for n in names}, {}
    for a, b in g.edges:
        route = [a, *[(a, b, k) for k in range(layer[a] + 1, layer[b])], b]
        for v in route[1:-1]:
            layer[v], preds[v], succs[v] = v[2], [], []
        for u, v in zip(route, route[1:]):
            succs[u].append(v)
            preds[v].append(u)
        routes[a, b] = route
    rows = [[] for _ in range(max(layer.values()) + 1)]
    for n in layer:
        rows[layer[n]].append(n)
    # The loop-carried arrow runs down the right margin: keep its two ends on the right edge.
    ends = {chunk_ir.state_in, chunk_ir.next_state}
    pos = {n: i for r in rows for i, n in enumerate(r)}
    for sweep in range(12):
        down = sweep % 2 == 0
        for r in (rows[1:] if down else rows[-2::-1]):
            nbrs = {n: (preds if down else succs)[n] for n in r}
            r.sort(key=lambda n: (n in ends, sum(pos[m] for m in nbrs[n]) / len(nbrs[n])
                                  if nbrs[n] else pos[n]))
            pos.update({n: i for i, n in enumerate(r)})
    # x: pull every node towards the mean of its neighbours, then push apart to keep the order
    # and spacing (average of a left-packed and a right-packed pass); this is what straightens
    # the long edges, which plain packing would bend into S-curves.
    w = {n: col if isinstance(n, str) else lane for n in layer}
    x = {n: sum(w[m] for m in r[:i]) + w[n] / 2 - sum(w[m] for m in r) / 2
         for r in rows for i, n in enumerate(r)}
    for sweep in range(24):
        for r in (rows if sweep % 2 == 0 else rows[::-1]):
            nbrs = [preds[n] + succs[n] for n in r]
            want = [sum(x[m] for m in ns) / len(ns) if ns else x[n] for n, ns in zip(r, nbrs)]
            gap = [(w[a] + w[b]) / 2 for a, b in zip(r, r[1:])]
            left, right = want[:], want[:]
            for i in range(1, len(r)):
                left[i] = max(want[i], left[i - 1] + gap[i - 1])
            for i in range(len(r) - 2, -1, -1):
                right[i] = min(want[i], right[i + 1] - gap[i])
            x.update({n: (lo + hi) / 2 for n, lo, hi in zip(r, left, right)})
    return {n: (x[n], -layer[n] * ROW) for n in layer}, routes


def draw(chunk_ir, ax=None):
    """Draw `chunk_ir` onto `ax` (a new figure sized to the graph if None); returns the figure.
    `chunk_ir` may be a ChunkDiff: its program after the pass, with what the pass touched marked."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    from matplotlib.path import Path

    touched, removed = {}, ()
    if hasattr(chunk_ir, "touched"):  # a ChunkDiff
        touched, removed, chunk_ir = chunk_ir.touched(), chunk_ir.removed, chunk_ir.after
    g, scan = chunk_ir.graph, chunk_ir.scan_nodes()
    labels = {n.name: f"{n.name}\n{n.op} {_shape(n.shape)}" for n in chunk_ir.order()}
    chars = max(len(s) for lab in labels.values() for s in lab.split("\n"))
    box_w = chars * FONT * 0.62 / 72 + 0.2  # ~0.6 em per character of DejaVu Sans
    xy, routes = _layout(chunk_ir, col=box_w + 0.3, lane=0.22)
    xs, ys = [p[0] for p in xy.values()], [p[1] for p in xy.values()]
    margin, loop_room, top, bottom = 0.3, 1.3, 0.6 + 0.3 * bool(removed), 0.75  # title above, legend below
    x0, x1 = min(xs) - box_w / 2 - margin, max(xs) + box_w / 2 + loop_room
    y0, y1 = min(ys) - BOX_H / 2 - bottom, BOX_H / 2 + top
    fig, ax = canvas(ax, x0, x1, y0, y1)

    for n in labels:
        (x, y), role = xy[n], _role(chunk_ir, n, scan)
        edge, width = ("#2a6b1f", 1.6) if role == "output" else ("#555555", 0.8)
        if n in touched:
            edge, width = TOUCHED[touched[n]][0], 2.8
        ax.add_patch(FancyBboxPatch((x - box_w / 2, y - BOX_H / 2), box_w, BOX_H,
                                    boxstyle="round,pad=0,rounding_size=0.06", fc=COLOURS[role],
                                    ec=edge, lw=width, zorder=3))
        ax.text(x, y, labels[n], ha="center", va="center", fontsize=FONT, zorder=4,
                linespacing=1.15, fontweight="bold" if role == "output" else "normal")

    # Spread the edges meeting a box along its top/bottom side (sorted by where they come from)
    # so that arrowheads into a node with several inputs do not land on one point.
    port = {}
    for n in labels:
        for side, edges, near in ((-1, g.out_edges(n), 1), (1, g.in_edges(n), -2)):
            edges = sorted(edges, key=lambda e: xy[routes[e][near]][0])
            step = min(0.22, 0.7 * box_w / max(len(edges), 1))
            for i, e in enumerate(edges):
                port[e, side] = (xy[n][0] + (i - (len(edges) - 1) / 2) * step,
                                 xy[n][1] + side * BOX_H / 2)
    for (a, b), route in routes.items():
        pts = [port[(a, b), -1], *[xy[v] for v in route[1:-1]], port[(a, b), 1]]
        # Catmull-Rom through the lanes, leaving and entering the boxes vertically: one smooth
        # curve per edge rather than a wiggle per layer crossed.
        tan = [(0.0, pts[1][1] - pts[0][1])]
        tan += [((q[0] - p[0]) / 2, (q[1] - p[1]) / 2) for p, q in zip(pts, pts[2:])]
        tan += [(0.0, pts[-1][1] - pts[-2][1])]
        verts, codes = [pts[0]], [Path.MOVETO]
        for i, ((px, py), (qx, qy)) in enumerate(zip(pts, pts[1:])):
            (tpx, tpy), (tqx, tqy) = tan[i], tan[i + 1]
            verts += [(px + tpx / 3, py + tpy / 3), (qx - tqx / 3, qy - tqy / 3), (qx, qy)]
            codes += [Path.CURVE4] * 3
        ax.add_patch(FancyArrowPatch(path=Path(verts, codes), arrowstyle="-|>", mutation_scale=9,
                                     lw=0.8, color="#b05a00" if b in scan else "#4d4d4d", zorder=2))

    s_in, s_out = chunk_ir.state_in, chunk_ir.next_state
    if s_in and s_out:
        # Out to the right margin, up, and back in: both ends are the rightmost boxes of their
        # layers and the margin is beyond every box and lane, so the loop edge crosses nothing
        # and cannot be mistaken for one more dataflow edge.
        (xa, ya), (xb, yb) = xy[s_out], xy[s_in]
        xr, r = max(xs) + box_w / 2 + 0.3, min(0.25, (yb - ya) / 2)
        path = Path([(xa + box_w / 2, ya), (xr - r, ya), (xr, ya), (xr, ya + r), (xr, yb - r),
                     (xr, yb), (xr - r, yb), (xb + box_w / 2, yb)],
                    [Path.MOVETO, Path.LINETO, Path.CURVE3, Path.CURVE3, Path.LINETO,
                     Path.CURVE3, Path.CURVE3, Path.LINETO])
        ax.add_patch(FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=14, lw=1.8,
                                     ls="--", color=LOOP_COLOUR, zorder=5))
        ax.text(xr + 0.06, (ya + yb) / 2, "next chunk", color=LOOP_COLOUR, fontsize=FONT + 0.5,
                ha="left", va="center", fontweight="bold", zorder=6)

    ax.text((x0 + x1) / 2, y1 - 0.3, f"{chunk_ir.name}   C={chunk_ir.chunk_size}",
            ha="center", va="center", fontsize=FONT + 4, fontweight="bold")
    if removed:
        ax.text((x0 + x1) / 2, y1 - 0.62, f"removed by the pass: {', '.join(removed)}", ha="center",
                va="center", fontsize=FONT + 0.5, color="#444444")
    handles = [Patch(fc=COLOURS[r], ec="#555555", label=lab) for r, lab in (
        ("leaf", "input / param / constant"), ("parallel", "parallel over chunks"),
        ("scan", "scan (sequential)"), ("output", "output"))]
    handles.append(Line2D([], [], color=LOOP_COLOUR, ls="--", lw=1.8, label="loop-carried state"))
    for colour, label in dict.fromkeys(TOUCHED[k] for k in TOUCHED if k in touched.values()):
        handles.append(Patch(fc="white", ec=colour, lw=2.8, label=label))
    ax.legend(handles=handles, loc="lower center", ncol=3 if x1 - x0 < 8 else 5, fontsize=FONT,
              frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def to_svg(chunk_ir) -> str:
    """The drawing (of a ChunkIR or a ChunkDiff) as an SVG string, text kept as <text> so labels
    stay searchable."""
    return svg(draw, chunk_ir)
