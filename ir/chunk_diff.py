"""What a pass changed in a ChunkIR: the nodes removed, added, rewritten and renamed, from two programs.

Nodes are matched by name (a rewrite's replacement takes the name of the node it replaces,
`ChunkIR.take_place`, `tidy_names`), then by definition: a node that disappears while another
with the same op, attributes and (matched) arguments appears was renamed, or merged into one that
was already there (CSE). A node whose name stayed but whose op, attributes or arguments changed
was rewritten; one whose arguments were only renamed or merged was not. `why` is the identity
the pass states (passes/rewrite.py), printed with the changes it justifies.

    >>> before, after = ChunkIR("demo", 64), ChunkIR("demo", 64)
    >>> for ir in (before, after):
    ...     ir.outputs["o"] = ir.add("g_cum", "cumsum", ir.add("g", "input", name="g", kind="gate"))
    >>> before.outputs["o"] = before.add("Gamma", "exp", "g_cum")
    >>> log2e = after.add("log2e", "const", value=1.4426950408889634, shape=())
    >>> after.outputs["o"] = after.add("Gamma", "exp2", after.add("g2", "mul", "g_cum", log2e))
    >>> d = chunk_diff(before, after, why="e^x = 2^(x·log₂e)")
    >>> d.added, d.rewritten, d.touched()
    (('log2e', 'g2'), ('Gamma',), {'log2e': 'added', 'g2': 'added', 'Gamma': 'rewritten'})
    >>> print(d)
    by: e^x = 2^(x·log₂e)
    + log2e:() = const 1.44269504
    + g2:C     = mul g_cum log2e
    ~ Gamma:C  = exp2 g2    (was exp g_cum)
    2 added, 1 rewritten: 3 → 5 nodes
"""
from __future__ import annotations

from dataclasses import dataclass

from .chunk import ChunkIR, Node, _rhs, _shape
from .display import rich_html

KINDS = ("removed", "added", "rewritten", "renamed", "merged")
MARKS = {"removed": "-", "added": "+", "rewritten": "~", "renamed": "=", "merged": "="}


@dataclass(frozen=True)
class Change:
    """One node a pass removed, added, rewrote, renamed or merged into another."""

    kind: str  # one of KINDS
    before: Node | None  # the node in the program before the pass (None: added)
    after: Node | None  # the node in the program after it (None: removed); merged: the one kept

    @property
    def name(self) -> str:
        """The node's name in the program it is in after the pass (before it, if removed)."""
        return (self.after or self.before).name


@dataclass(frozen=True, repr=False)
class ChunkDiff:
    """What turned `before` into `after` (chunk_diff makes one); prints as the changes under `why`,
    draws as `after` with what changed outlined (in a notebook: the text, then the drawing)."""

    before: ChunkIR
    after: ChunkIR
    changes: tuple  # of Change, in the order of `after` (removed nodes in the order of `before`, first)
    outputs: tuple = ()  # (role, node before, node after) for each output that now names another node
    why: str = ""  # the identity that justifies the changes

    def _names(self, *kinds) -> tuple:
        return tuple(c.name if c.kind != "merged" else c.before.name for c in self.changes if c.kind in kinds)

    @property
    def removed(self) -> tuple:
        return self._names("removed")

    @property
    def added(self) -> tuple:
        return self._names("added")

    @property
    def rewritten(self) -> tuple:
        return self._names("rewritten")

    def touched(self) -> dict:
        """Node of `after` -> how the pass touched it (added, rewritten, renamed, merged: the node
        another one was merged into)."""
        return {c.after.name: c.kind for c in self.changes if c.after is not None}

    def __repr__(self) -> str:
        return f"<ChunkDiff {self.after.name}: {str(self).splitlines()[-1]}>"

    def __bool__(self) -> bool:
        return bool(self.changes or self.outputs)

    def __str__(self) -> str:
        lines = [f"by: {self.why}"] if self.why else []
        if self.changes:
            shown = [c.before if c.kind in ("removed", "merged") else c.after for c in self.changes]
            heads = [f"{n.name}:{_shape(n.shape)}" for n in shown]
            width = max(len(h) for h in heads)
            for c, head in zip(self.changes, heads):
                lines.append(f"{MARKS[c.kind]} {head:<{width}} {_describe(c)}".rstrip())
        lines += [f"  out {role}: {old} → {new}" for role, old, new in self.outputs]
        counts = [f"{len(self._names(k))} {k}" for k in KINDS if self._names(k)]
        n0, n1 = len(self.before.graph), len(self.after.graph)
        lines.append(f"{', '.join(counts)}: {n0} → {n1} nodes" if counts else f"no change ({n1} nodes)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return rich_html(self, "chunk_draw")


def _describe(c: Change) -> str:
    if c.kind == "removed":
        return f"= {_rhs(c.before)}"
    if c.kind == "added":
        return f"= {_rhs(c.after)}"
    if c.kind == "rewritten":
        return f"= {_rhs(c.after)}    (was {_rhs(c.before)})"
    if c.kind == "renamed":
        return f"(was {c.before.name})"
    return f"merged into {c.after.name}"


def _definition(n: Node, names: dict) -> tuple:
    return n.op, tuple(names.get(a, a) for a in n.args), n.attrs, n.shape


def chunk_diff(before: ChunkIR, after: ChunkIR, why: str = "") -> ChunkDiff:
    """What turned `before` into `after` (see the module's docstring); a pure function of the two."""
    defs_after = {}
    for n in after.order():
        defs_after.setdefault(_definition(n, {}), []).append(n.name)
    names, changes, claimed = {}, [], set()  # names: before's name -> after's, for matched nodes
    for n in before.order():
        d = _definition(n, names)
        if n.name in after.graph:
            names[n.name] = n.name
            if _definition(after.node(n.name), {}) != d:
                changes.append(Change("rewritten", n, after.node(n.name)))
            continue
        same = [m for m in defs_after.get(d, ()) if m not in claimed]
        new = [m for m in same if m not in before.graph]
        if new:  # a node of the same definition appeared: the pass renamed this one
            names[n.name] = new[0]
            claimed.add(new[0])
            changes.append(Change("renamed", n, after.node(new[0])))
        elif same:  # the node it computes was already there
            names[n.name] = same[0]
            changes.append(Change("merged", n, after.node(same[0])))
        else:
            changes.append(Change("removed", n, None))
    changes += [Change("added", None, n) for n in after.order()
                if n.name not in before.graph and n.name not in claimed]
    position = {n.name: i for i, n in enumerate(after.order())}
    changes.sort(key=lambda c: (c.kind != "removed", position.get(c.after.name, -1) if c.after else -1))
    ends_before, ends_after = _ends(before), _ends(after)
    outputs = tuple((role, old, ends_after.get(role)) for role, old in ends_before.items()
                    if names.get(old, old) != ends_after.get(role))
    return ChunkDiff(before, after, tuple(changes), outputs, why)


def _ends(ir: ChunkIR) -> dict:
    """The program's results by role and its next state (labelled as the printer labels it)."""
    return {**ir.outputs, **({"state": ir.next_state} if ir.next_state else {})}
