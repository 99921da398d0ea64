"""ChunkIR: the program that processes one chunk of C tokens, as a dataflow graph of block ops.

A networkx DiGraph whose nodes are named values (`R`, `T_r`, `v_new`, ...), each with an op from
`chunk_ops.OPS`, ordered arguments and a block shape. `state_in` is the state entering the chunk
and `next_state` the state leaving it: that pair is the scan's loop-carried edge (for a
backward program, `reverse`, the scan runs from the last chunk to the first). `outputs` are the
program's results by role (the forward's o; a backward's gradients). Nodes that
do not depend on `state_in` are parallel over chunks; the rest form the sequential scan.

    >>> from qla_compiler import compile_spec
    >>> print(compile_spec("specs/gdn.py").chunk)          # doctest: +SKIP
    chunk_program gdn  C=64  { in q:C×K k:C×K v:C×V g:C beta:C ; state S0:K×V ; param scale
      # parallel over chunks
      g_cum:C = cumsum g
      ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from .chunk_ops import EXPONENTIALS, OPS
from .display import rich_html


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    args: tuple[str, ...]
    shape: tuple[str, ...]
    attrs: tuple = ()  # sorted (key, value) pairs: hashable, so CSE can compare nodes

    @property
    def attr(self) -> dict:
        return dict(self.attrs)

    def key(self):
        """What makes two nodes compute the same value (for CSE)."""
        return (self.op, self.args, self.attrs)


@dataclass
class ChunkIR:
    name: str
    chunk_size: int
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    outputs: dict = field(default_factory=dict)  # role -> node: the results ("o", C×V; a backward's gradients)
    history: tuple = ()  # names of the passes that produced this program
    reverse: bool = False  # the scan runs from the last chunk to the first (a backward program)
    # a backward program's output roles that are an input's gradient -> that input (of the forward)
    gradient_of: dict = field(default_factory=dict)
    next_state: str | None = None  # the node of the state leaving the chunk (K×V)
    # a backward program's inputs that are an output's cotangent (kind cotangent_value) -> that
    # output's role in the forward: what the runtime binds the incoming d o to
    cotangent_of: dict = field(default_factory=dict)

    # ---- building -------------------------------------------------------------------------
    def add(self, name: str, op: str, /, *args: str, **attrs) -> str:
        """Add a node and return its (unique) name."""
        opdef = OPS[op]
        if opdef.arity >= 0 and len(args) != opdef.arity:
            raise ValueError(f"{op} takes {opdef.arity} arguments, got {len(args)}")
        shapes = [self.node(a).shape for a in args]
        shape = tuple(opdef.shape(shapes, attrs))
        name = self._fresh(name)
        self.graph.add_node(name, node=Node(name, op, tuple(args), shape, tuple(sorted(attrs.items()))))
        for pos, a in enumerate(args):
            self.graph.add_edge(a, name, pos=pos)
        return name

    def set_attrs(self, name: str, **attrs) -> None:
        """Give the node `name` these attributes (its others kept)."""
        n = self.node(name)
        self.graph.nodes[name]["node"] = Node(n.name, n.op, n.args, n.shape, tuple(sorted({**n.attr, **attrs}.items())))

    def _fresh(self, name: str) -> str:
        if name not in self.graph:
            return name
        i = 2
        while f"{name}_{i}" in self.graph:
            i += 1
        return f"{name}_{i}"

    def copy(self) -> "ChunkIR":
        return ChunkIR(self.name, self.chunk_size, self.graph.copy(), dict(self.outputs), self.history,
                       self.reverse, dict(self.gradient_of), self.next_state, dict(self.cotangent_of))

    # ---- reading --------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        return self.graph.nodes[name]["node"]

    def order(self) -> list[Node]:
        """Topological order, ties broken by insertion: a stable print."""
        index = {n: i for i, n in enumerate(self.graph.nodes)}
        return [self.node(n) for n in nx.lexicographical_topological_sort(self.graph, key=index.get)]

    def users(self, name: str) -> list[Node]:
        return [self.node(u) for u in self.graph.successors(name)]

    def of_op(self, op: str) -> list[Node]:
        return [n for n in self.order() if n.op == op]

    @property
    def state_in(self) -> str | None:
        return next((n.name for n in self.order() if n.op == "state_in"), None)

    def closure(self, roots, stop=(), within=None) -> set[str]:
        """`roots` and every node they need, not looking past the nodes in `stop` (which are kept)
        nor outside `within` (when given)."""
        seen, todo = set(), list(roots)
        while todo:
            x = todo.pop()
            if x in seen or (within is not None and x not in within):
                continue
            seen.add(x)
            if x not in stop:
                todo.extend(self.node(x).args)
        return seen

    def scan_nodes(self) -> set[str]:
        """Nodes that depend on the state entering the chunk: they run in the sequential scan."""
        s = self.state_in
        return set(nx.descendants(self.graph, s)) | {s} if s else set()

    def chain_nodes(self) -> set[str]:
        """The state chain: the scan's nodes the next state depends on (the loop-carried path from
        the state entering the chunk to the state leaving it)."""
        if self.next_state is None:
            return set()
        return (nx.ancestors(self.graph, self.next_state) | {self.next_state}) & self.scan_nodes()

    def inputs(self) -> list[Node]:
        return [n for n in self.order() if n.op == "input"]

    # ---- editing (used by passes, on a copy) -------------------------------------------------
    def replace_uses(self, old: str, new: str, exclude=()) -> None:
        """Point every user of `old` (and any output, or the next state) at `new`, except the users
        in `exclude`."""
        for u in list(self.graph.successors(old)):
            if u in exclude:
                continue
            n = self.node(u)
            args = tuple(new if a == old else a for a in n.args)
            self.graph.nodes[u]["node"] = Node(n.name, n.op, args, n.shape, n.attrs)
            self.graph.remove_edge(old, u)
            for pos, a in enumerate(args):
                if a == new:
                    self.graph.add_edge(new, u, pos=pos)
        self._renamed(old, new)

    def _renamed(self, old: str, new: str) -> None:
        self.outputs = {r: (new if v == old else v) for r, v in self.outputs.items()}
        if self.next_state == old:
            self.next_state = new

    def rename(self, old: str, new: str) -> None:
        """Give a node a new (unused) name, updating its users, the outputs and the next state."""
        if new in self.graph:
            raise ValueError(f"cannot rename {old} to {new}: the name is taken")
        users = list(self.graph.successors(old))
        nx.relabel_nodes(self.graph, {old: new}, copy=False)
        n = self.node(new)
        self.graph.nodes[new]["node"] = Node(new, n.op, n.args, n.shape, n.attrs)
        for u in users:
            un = self.node(u)
            self.graph.nodes[u]["node"] = Node(u, un.op, tuple(new if a == old else a for a in un.args),
                                               un.shape, un.attrs)
        self._renamed(old, new)

    def take_place(self, old: str, created: list[str]) -> None:
        """Once `old` has no users (replace_uses(old, created[-1])): drop it, give created[-1] its
        name, and put the created nodes where it was in insertion order. That order breaks ties in
        `order()`, which the print and the kernels' statements follow, so the rest of the program
        keeps its order (a node added or renamed otherwise goes last)."""
        if list(self.graph.successors(old)):
            raise ValueError(f"take_place: {old} still has users")
        order = list(self.graph)
        at = order.index(old)
        self.graph.remove_node(old)
        self.rename(created[-1], old)
        placed = [*created[:-1], old]
        order = [n for n in order if n not in placed and n not in created]
        order[at:at] = placed
        graph = nx.DiGraph()
        graph.add_nodes_from((n, self.graph.nodes[n]) for n in order)
        graph.add_edges_from(self.graph.edges(data=True))
        self.graph = graph

    def tidy_names(self) -> None:
        """A rewrite names a replacement `x'`; once the old `x` is gone it takes the name back."""
        for name in [n for n in self.graph if n.endswith("'")]:
            base = name.rstrip("'")
            if base not in self.graph:
                self.rename(name, base)

    def remove_dead(self) -> int:
        """Drop nodes no output (nor the next state) depends on; returns how many."""
        live = set(self.outputs.values()) | ({self.next_state} if self.next_state else set())
        for o in list(live):
            live |= nx.ancestors(self.graph, o)
        dead = [n for n in self.graph if n not in live]
        self.graph.remove_nodes_from(dead)
        return len(dead)

    def verify(self) -> None:
        """Structural invariants: acyclic, args exist in order, shapes recomputable."""
        if not nx.is_directed_acyclic_graph(self.graph):
            raise ValueError(f"{self.name}: the chunk program has a cycle")
        for n in self.order():
            for a in n.args:
                if a not in self.graph:
                    raise ValueError(f"{n.name}: argument {a} does not exist")
            shape = tuple(OPS[n.op].shape([self.node(a).shape for a in n.args], n.attr))
            if shape != n.shape:
                raise ValueError(f"{n.name}: recorded shape {n.shape}, op gives {shape}")
        for role, o in self.outputs.items():
            if o not in self.graph:
                raise ValueError(f"output {role} = {o} does not exist")
        if self.next_state is not None and self.next_state not in self.graph:
            raise ValueError(f"the next state {self.next_state} does not exist")
        for role, x in self.gradient_of.items():
            if role not in self.outputs:
                raise ValueError(f"gradient_of names {role} (of {x}), which is no output of the program")
        for x, role in self.cotangent_of.items():
            if x not in self.graph or self.node(x).attr.get("kind") != "cotangent_value":
                raise ValueError(f"cotangent_of names {x} (of {role}), which is no cotangent input of the program")

    # ---- display ----------------------------------------------------------------------------
    def __str__(self) -> str:
        nodes = self.order()
        scan = self.scan_nodes()
        leaves = [n for n in nodes if n.op in ("input", "state_in", "param", "head_log")]
        ins = " ".join(f"{n.name}:{_shape(n.shape)}" for n in leaves if n.op == "input")
        extra = [f"state {n.name}:{_shape(n.shape)}" for n in leaves if n.op == "state_in"]
        extra += [f"param {n.name}" for n in leaves if n.op == "param"]
        extra += [f"head-const {n.name}" for n in leaves if n.op == "head_log"]
        head = f"chunk_program {self.name}  C={self.chunk_size} {{ in {ins}" + "".join(
            f" ; {e}" for e in extra)
        lines = [head]
        body = [n for n in nodes if n not in leaves]
        scan_title = f"scan over chunks{', last to first' if self.reverse else ''} (carries the state)"
        for title, group in (("parallel over chunks", [n for n in body if n.name not in scan]),
                             (scan_title, [n for n in body if n.name in scan])):
            if group:
                lines.append(f"  # {title}")
                width = max(len(f"{n.name}:{_shape(n.shape)}") for n in group)
                lines += [f"  {f'{n.name}:{_shape(n.shape)}':<{width}} = {_rhs(n)}" for n in group]
        outs = " ".join([f"{r}={v}" + (f" (∂/∂{self.gradient_of[r]})" if r in self.gradient_of else "")
                         for r, v in self.outputs.items()] + ([f"state={self.next_state}"] if self.next_state else []))
        lines.append(f"}} out {outs}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return rich_html(self, "chunk_draw")

    def counts(self) -> dict:
        """What the program does, for comparing before/after rewrites."""
        nodes = self.order()
        return {
            "nodes": len(nodes),
            "exponentials": sum(n.op in EXPONENTIALS for n in nodes),
            "CxC matmuls": sum(n.op == "matmul" and n.shape == ("C", "C") for n in nodes),
            "matmuls": sum(n.op == "matmul" for n in nodes),
            "triangular inverses": sum(n.op == "inv_unit_lower" for n in nodes),
        }


def _shape(shape) -> str:
    return "×".join(shape) if shape else "()"


def _rhs(n: Node) -> str:
    if n.op == "const":
        return f"const {n.attr['value']:.9g}"
    attrs = ",".join(f"{k}={v}" for k, v in n.attrs)
    return f"{n.op}{f'[{attrs}]' if attrs else ''} {' '.join(n.args)}".rstrip()
