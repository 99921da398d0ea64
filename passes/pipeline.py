"""The pass manager: the ordered pipeline from a spec file to the chunk program (and on to kernels).

    frontend   spec file      → RecurrenceIR
    classify   RecurrenceIR   → RecurrenceIR (+ structure)
    chunk      RecurrenceIR   → ChunkIR        (MATH.md's six steps, direct form)
    ...        ChunkIR        → ChunkIR        (the rewrites in passes/rewrites.py, in order)
    partition  ChunkIR        → Partition      (which node runs in which kernel)
    schedule   Partition      → KernelIR       (buffers placed, statements ordered)

The lowering to TileLang (passes/lower_tilelang.py) needs a shape class, so it runs when an op is
first called with concrete shapes (or for `qla-compile --emit tilelang` with a default class). A
chunk program the lowering has no rules for (passes/lowerable.py) stops the pipeline before
`partition`; `Program.no_kernels` says why, and the CPU backend still runs it. A backward program
without rules is refused where its kernels are asked for (`Program.backward_unsupported`).

Every pass is named; the driver verifies the IR after each one, can print it (`print_after`),
stop early (`stop_after`), and in check mode runs the interpreter against the reference after
every ChunkIR pass, naming the first pass that breaks agreement (the errors it measured per pass
are kept: `Program.checked`). `Program.diff(name)` is what a ChunkIR pass changed (ir/chunk_diff.py),
with the identity it states (`identity`). `Program.affine` (the state
update as an affine map, for context parallelism, passes/affine.py) is derived from the final
chunk program on first use; `Program.backward` (the VJP, passes/autodiff.py) from the program
before the kernel-shaping rewrites, which then run on the VJP too (`Program.differentiated`).
A kernel-shaping rewrite may pay only at some shape classes (`Rewrite.pays`): `Program.for_shape`
is the program a class runs, without the ones that do not (the runtime asks it once per call).

    >>> from qla_compiler.compiler import resolve_spec
    >>> prog = run_pipeline(resolve_spec("gdn"), stop_after="chunk")
    >>> [name for name, _ in prog.stages]
    ['frontend', 'classify', 'chunk']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from qla_compiler.errors import NotFusable, PassError, SpecError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_diff import ChunkDiff, chunk_diff
from qla_compiler.ir.kernel import KernelIR
from qla_compiler.ir.recurrence import RecurrenceIR

from .affine import derive_affine
from .autodiff import derive_backward
from .chunk import derive_chunks
from .classify import classify
from .frontend import load_spec
from .key_blocks import key_blocks
from .lowerable import unsupported
from .partition import SCAN_PRODUCTS, SCAN_PRODUCTS_ON_INVERSE, partition
from .release_memory import release_memory
from .reuse_memory import reuse_memory
from .rewrite_decay_side import DECAY_VALUE_SIDE, DECAY_VALUE_SIDE_ON_CHAIN
from .rewrite_scale_after_product import SCALE_AFTER_PRODUCT_ON_CHAIN
from .rewrite_scale_on_left import SCALE_ON_LEFT_COLUMNS
from .rewrite_wy import FOLD_WY
from .rewrites import CHUNK_PASSES
from .schedule import HEAD_DIMS, schedule
from .schedule_build import columns_mixed, state_dtype
from .token_step import token_step
from .verify_exponents import verify_exponents
from .walk_skip import skipping_scan

TARGETS = ("sm90", "cpu")
# the rewrites that shape kernels, by name (Program.differentiated, _shaped, for_shape, without)
_SHAPING = {p.name: p for p in CHUNK_PASSES if getattr(p, "shapes_kernels", False)}


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable
    doc: str


@dataclass
class Program:
    """Everything the pipeline produced, stage by stage."""

    path: str
    target: str
    chunk_size: int
    recurrence: RecurrenceIR | None = None
    chunk: ChunkIR | None = None
    kernels: KernelIR | None = None
    stages: list = field(default_factory=list)  # (pass name, IR after it)
    # the head-dim tiles (K, V) its kernels are scheduled for (schedule's head_dims; for_shape)
    head_dims: tuple = HEAD_DIMS
    _derived: dict = field(default_factory=dict, repr=False)
    checked: dict = field(default_factory=dict)  # check mode: pass -> relative errors (o, final state)
    # why the chunk program has no kernels (passes/lowerable.py): the pipeline stopped before partition
    no_kernels: str | None = None
    # the input kinds whose gradients its backward leaves as partial sums the host adds up: "key"
    # on a column block of V (backward_columns), "value" on a block of K's columns (backward_blocks);
    # its out kernel writes them in float32 (schedule's `partial`)
    partial: tuple = ()

    def stage(self, name: str):
        return next(ir for n, ir in self.stages if n == name)

    def diff(self, name: str) -> ChunkDiff:
        """What the pass `name` changed in the chunk program, with the identity it states.

            >>> import qla_compiler
            >>> qla_compiler.compile_spec("gdn").diff("gate_out_of_inverse").added
            ('A_r', 'T_r')
        """
        names = [n for n, _ in self.stages]
        if name not in names:
            raise ValueError(f"diff: no pass named {name!r} ran; passes: {', '.join(names)}")
        i = names.index(name)
        before, after = (self.stages[i - 1][1] if i else None), self.stages[i][1]
        if not (isinstance(before, ChunkIR) and isinstance(after, ChunkIR)):
            raise ValueError(f"diff: {name!r} is not a pass from a chunk program to a chunk program")
        return chunk_diff(before, after, why=identity(name))

    def diffs(self) -> list:
        """(pass, ChunkDiff) for every pass that took a chunk program to another, in order."""
        return [(n, self.diff(n)) for (_, a), (n, b) in zip(self.stages, self.stages[1:])
                if isinstance(a, ChunkIR) and isinstance(b, ChunkIR)]

    @property
    def backward(self) -> ChunkIR:
        """The chunk program's VJP (passes/autodiff.py), derived on first use: of the program as it
        was before the kernel-shaping rewrites (`differentiated`), which then run on the VJP too."""
        return self._derive("autodiff", lambda _: self._shaped(derive_backward(self.differentiated)))

    @property
    def differentiated(self) -> ChunkIR:
        """The chunk program the backward is the VJP of: the one just before the first rewrite that
        shapes kernels (passes/rewrite.py), or the final one. Both compute the same values."""
        names = [n for n, _ in self.stages]
        first = next((n for n in names if n in _SHAPING), None)
        return self.stages[names.index(first) - 1][1] if first else self.chunk

    def _shaped(self, ir: ChunkIR) -> ChunkIR:
        """`ir` through the kernel-shaping rewrites this program ran, each checked as the pipeline's
        (a failure names the rewrite)."""
        for name in (n for n, _ in self.stages if n in _SHAPING):
            ir = _run_pass(_SHAPING[name], ir, "on the backward program: ")
        return ir

    def for_shape(self, shape) -> "Program":
        """The program a shape class runs: this one without the kernel-shaping rewrites that do not
        pay at that shape (`Rewrite.pays`; e.g. the decay on the value side only where the V-block
        is narrow). Derived once per set of rewrites left out; the program itself when none is.

            >>> import qla_compiler
            >>> from qla_compiler.passes.lower_tilelang import ShapeClass
            >>> prog = qla_compiler.compile_spec("gdn")
            >>> "decay_value_side" in [n for n, _ in prog.for_shape(ShapeClass(2, 8, 128, 128, BV=64)).stages]
            False
        """
        skip = tuple(n for n, _ in self.stages if n in _SHAPING and not _SHAPING[n].pays(shape))
        prog = self.without(*skip) if skip else self
        tiles = (max(HEAD_DIMS[0], shape.KP), max(HEAD_DIMS[1], shape.VP))
        return prog if tiles == prog.head_dims or prog.kernels is None else prog.scheduled_for(tiles)

    def scheduled_for(self, head_dims: tuple, partial: tuple = ()) -> "Program":
        """This program with its kernels scheduled for head-dim tiles up to `head_dims` (K, V):
        shared memory and registers budgeted at those sizes (more threads, fewer stages, outputs
        split). Its training and backward programs are scheduled the same way; `partial`: its
        backward runs on one block of V's or K's columns (backward_blocks), Program.partial."""
        partial = tuple(sorted(partial))
        key = ("head_dims", tuple(head_dims), partial)
        if key not in self._derived:
            before = [s for s in self.stages if s[0] not in ("partition", "schedule")]
            prog = Program(self.path, self.target, self.chunk_size, self.recurrence, self.chunk,
                           stages=list(before), head_dims=tuple(head_dims), partial=partial)
            self._derived[key] = prog._scheduled(self.chunk, before, "", into=prog)
        return self._derived[key]

    def without(self, *names: str) -> "Program":
        """This program with the named kernel-shaping rewrites left out: the passes after the first
        of them run again from the chunk program before it. The backward and training programs
        derive from the result as from any program."""
        if not names:
            return self
        unknown = [n for n in names if n not in _SHAPING]
        if unknown:
            raise ValueError(f"without: {unknown[0]!r} is not a kernel-shaping rewrite "
                             f"(those are: {', '.join(_SHAPING) or 'none'})")
        key = ("without", frozenset(names))
        if key not in self._derived:
            done = [n for n, _ in self.stages]
            at = min((done.index(n) for n in names if n in done), default=len(done))
            prog = Program(self.path, self.target, self.chunk_size, self.recurrence,
                           stages=list(self.stages[:at]))
            ir = self.stages[at - 1][1]
            for p in passes(self.chunk_size):
                if p.name in done[:at] or p.name in names or p.name not in done:
                    continue
                ir = _run_pass(p, ir)
                prog._keep(p.name, ir)
            self._derived[key] = prog
        return self._derived[key]

    def _keep(self, name: str, ir) -> None:
        self.stages.append((name, ir))
        if isinstance(ir, RecurrenceIR):
            self.recurrence = ir
        elif isinstance(ir, KernelIR):
            self.kernels = ir
        elif isinstance(ir, ChunkIR):
            self.chunk = ir

    @property
    def training_program(self) -> "Program":
        """The forward's kernels as a training step runs them: the prep also stores its triangular
        inverses (T_r for the delta rule), which the backward then loads instead of solving them
        again (the inverse is most of a prep's work); the scan stores the state entering every
        chunk in the dtype the backward reads it in (saved_state_dtype). The program itself when
        neither applies.

            >>> import qla_compiler
            >>> prog = qla_compiler.compile_spec("gla").training_program
            >>> prog.chunk.node(prog.chunk.state_in).attr["stored"]
            'float32'
        """
        if "training_program" not in self._derived:
            keep = tuple(n.name for n in self.chunk.of_op("inv_unit_lower"))
            chunk = self._storing_states(self.chunk)
            before = [s for s in self.stages if s[0] not in ("partition", "schedule")]
            self._derived["training_program"] = self._scheduled(chunk, before, "training program: ", keep=keep) \
                if keep or chunk is not self.chunk else self
        return self._derived["training_program"]

    def _storing_states(self, chunk: ChunkIR) -> ChunkIR:
        """`chunk` with its entering state marked to be stored in the dtype the backward reads it
        in (its `stored` attribute, which schedule_build.state_dtype reads), where that is not the
        io dtype; else `chunk` itself."""
        if self.saved_state_dtype() == "io":
            return chunk
        chunk = chunk.copy()
        chunk.set_attrs(chunk.state_in, stored=self.saved_state_dtype())
        return chunk

    def saved_state_dtype(self) -> str:
        """The dtype the backward reads the forward's entering states in (schedule_build.state_dtype
        of the backward's saved state): float32 where its per-key Γ term sums them times d S over
        V, so the training forward stores them so; the io dtype elsewhere, and where the program
        has no backward (no kernels for it).

            >>> import qla_compiler
            >>> [qla_compiler.compile_spec(s).saved_state_dtype() for s in ("gla", "gdn")]
            ['float32', 'io']
        """
        if "saved_state_dtype" not in self._derived:
            dtype = "io"
            if self.no_kernels is None and self.target == "sm90" and self.chunk.state_in is not None \
                    and self.backward_unsupported() is None:
                back = self.backward
                dtype = state_dtype(back, self.chunk.state_in) if self.chunk.state_in in back.graph else "io"
            self._derived["saved_state_dtype"] = dtype
        return self._derived["saved_state_dtype"]

    def stored(self) -> tuple:
        """The values the training forward's kernels leave in memory per token (what a backward
        may load instead of recomputing)."""
        part = self.training_program.stage("partition")
        return tuple(x for x in part.crossing + part.carried if x != self.chunk.state_in)

    @property
    def token_step_program(self) -> "Program":
        """The recurrence as one token-step kernel (passes/token_step.py), for decoding: a Program
        whose kernels the runtime compiles like the others (kernels/token_step.py runs it)."""
        if "token_step_program" not in self._derived:
            kir = self._derive("token_step", lambda _: token_step(self.recurrence))
            self._derived["token_step_program"] = Program(self.path, self.target, 1, self.recurrence, None, kir,
                                                          stages=[("token_step", kir)], head_dims=self.head_dims)
        return self._derived["token_step_program"]

    @property
    def windows_program(self) -> "Program":
        """This program's scan kernel alone, each walk leaving out the chunks an int32 [N, HV]
        tensor says (passes/walk_skip.py): context parallelism's first step scans only each
        segment's window where the gates allow (qla_compiler/context_parallel.py).

            >>> import qla_compiler
            >>> [k.name for k in qla_compiler.compile_spec("gdn").fused_program.windows_program.kernels.kernels]
            ['gdn_fused_windows']
        """
        if "windows_program" not in self._derived:
            self._need_kernels("windows program: ")
            kir = _run_pass(Pass("walk_skip", skipping_scan, "the scan, its walks from a chunk given per walk"),
                            self.kernels)
            self._derived["windows_program"] = Program(
                self.path, self.target, self.chunk_size, self.recurrence, self.chunk, kir,
                stages=[*self.stages, ("walk_skip", kir)], head_dims=self.head_dims, partial=self.partial)
        return self._derived["windows_program"]

    @property
    def backward_program(self) -> "Program":
        """The backward chunk program taken through partition and schedule: a Program of its own
        whose kernels the runtime compiles like the forward's (kernels/backward.py runs them).
        The backward recomputes the forward from its inputs and the states entering each chunk;
        what the training forward stored (self.stored()) its kernels load instead."""
        return self._backward_scheduled(scan_roles=False)

    @property
    def backward_roles_program(self) -> "Program":
        """backward_program with its scan warp-specialised (schedule_fused.scan_with_roles): the
        d S chain in registers on a role of its own, a loads role and a stores role; the same
        prep and out kernels. The runtime takes it where the launch policy's backward_scan_roles
        says (kernels/backward.backward_program_of).

            >>> import qla_compiler
            >>> [k.name for k in qla_compiler.compile_spec("gdn").backward_roles_program.kernels.kernels]
            ['gdn_backward_prep', 'gdn_backward_scan_roles', 'gdn_backward_out']
        """
        return self._backward_scheduled(scan_roles=True)

    @property
    def backward_wide_roles_program(self) -> "Program":
        """backward_roles_program at V-block 128 (schedule_fused.WIDE_BLOCK_V), for calls whose grid
        fills the GPU at that width: its d S chain on a state role and a value role, so a CTA per
        (value head, sequence) loads each chunk's K-wide blocks once. GDN's d v_new is stored as
        the negation of the d WS block the chain hands on (schedule_fused._negation_held): its out
        kernel is the plain program's. Its value role forms the products of the chunk's input
        blocks the chain reads (partition's scan_products: d v_new's intra-chunk term), so its
        prep forms W alone.

            >>> import qla_compiler
            >>> wide = qla_compiler.compile_spec("gdn").backward_wide_roles_program.kernels
            >>> wide.block_v_max, [r.name for r in wide.kernels[1].warp_roles]
            (128, ['state', 'value', 'stores', 'loads'])
        """
        return self._backward_scheduled(scan_roles=True, wide=True)

    def _backward_scheduled(self, scan_roles: bool, wide: bool = False) -> "Program":
        key = f"backward{'_wide' if wide else ''}{'_roles' if scan_roles else ''}_program"
        what = ("scan with roles, wide" if wide else "scan with roles") if scan_roles else ""
        where = f"backward program{f' ({what})' if what else ''}: "
        if key not in self._derived:
            self._need_kernels(where)
            if (why := self.backward_unsupported()) is not None:
                raise PassError("partition", f"backward program: {why}")
            back = self.backward
            before = [("autodiff", back)]
            # wide: the chain's decay on the value side (a C×V pass in registers, where the keys'
            # would be a C×K block in shared memory the budget has no room for); with the scan
            # forming W on the kept inverse, W's scaling on T's columns (no scaled C×K copy)
            inverse_products = wide and SCAN_PRODUCTS and SCAN_PRODUCTS_ON_INVERSE

            def shaped(back, rewrites):
                for rewrite in rewrites:
                    after = _run_pass(rewrite, back, where)
                    if set(after.graph.nodes) != set(back.graph.nodes):
                        before.append((rewrite.name, after))
                        back = after
                return back

            back = shaped(back, (DECAY_VALUE_SIDE_ON_CHAIN,) if wide else ())
            carried = self.training_program.stage("partition").carried
            # a state-free product (W = T·diag(βΓ)K) the backward recomputes from what it loads
            # anyway, one matmul per chunk, rather than have every training step keep it (found
            # before a rewrite changes the form of a stored value, v_new = U − W·S₀, not its value)
            provided = [x for x in self.stored() if _same_value(self.chunk, back, x)
                        and (x in carried or self.chunk.node(x).op != "matmul")]
            back = shaped(back, (SCALE_ON_LEFT_COLUMNS,) if inverse_products else ())
            try:
                prog = self._scheduled(back, before, where, partial=self.partial, provided=provided,
                                       scan_products=wide and SCAN_PRODUCTS, kept_inverse=inverse_products,
                                       scan_roles=scan_roles, wide=wide)
            except NotFusable as e:  # kept: the runtime asks on every call (kernels/backward.backward_program_of)
                self._derived[key] = e
                raise
            _check_saved_dtypes(self.training_program.kernels, prog.kernels)
            # (the backward's alone: a forward's per-token tensors may be kept for the backward)
            for p in (REUSE_MEMORY, RELEASE_MEMORY):
                prog._keep(p.name, _run_pass(p, prog.kernels, where))
            self._derived[key] = prog
        if isinstance(self._derived[key], NotFusable):  # (a fresh traceback: not one grown by every call)
            raise self._derived[key].with_traceback(None)
        return self._derived[key]

    def backward_columns(self) -> tuple:
        """(width, program): the column blocks of V a backward at this program's head-dim tiles runs
        in, and the program whose backward kernels run each block. V's whole tile and this program
        where the backward's kernels fit in shared memory; else the widest narrower tile (down to
        64) at which they do, the program scheduled for it. Exact because the forward never mixes
        V's columns (checked: schedule_build.columns_mixed), so a block's gradients are those of
        the problem of its columns alone: the host sums the other inputs' over the blocks and
        places the values' and the state's (kernels/backward.py). At K = V = 256 GDN's d g kernel
        needs 354 KB at once, 177 KB on 64 columns.

            >>> import qla_compiler
            >>> prog = qla_compiler.compile_spec("gdn").scheduled_for((256, 256))
            >>> width, each = prog.backward_columns()
            >>> width, each.head_dims
            (64, (256, 64))
        """
        if "backward_columns" not in self._derived:
            (K, width), prog = self.head_dims, self
            mixed = columns_mixed(self.chunk)
            while prog.backward_program.kernels.over_budget and width > 64 and not mixed:
                width //= 2
                prog = self.scheduled_for((K, width), partial=(*self.partial, "key"))
            over = prog.backward_program.kernels.over_budget
            if over:
                why = f"{mixed} mixes V's columns" if mixed else f"not even on column blocks of {width}"
                raise PassError("schedule", f"backward program: {', '.join(over)} exceed the shared-memory budget "
                                            f"at head-dim tiles K = {K}, V = {self.head_dims[1]} ({why})")
            self._derived["backward_columns"] = (width, prog)
        return self._derived["backward_columns"]

    def backward_blocks(self) -> tuple:
        """(keys, values, program): the widths of the blocks of K's and of V's columns a backward at
        this program's head-dim tiles runs on, and the program whose backward kernels run each block.
        V's column blocks where they fit (backward_columns); else, where the program splits over
        keys (passes/key_blocks.py: no delta rule, no K×K matrix), blocks of K halved down to 64,
        each a problem of its own keys (with V's column blocks inside, if it still needs them): the
        host places the keys' gradients and the state's, and sums the others' (kernels/backward.py).
        GLA's backward at K = 256 needed 216 KB for its d g kernel even on 64 of V's columns; with its
        out kernels on blocks of K's columns (schedule.KEY_BLOCKS, the default) it fits on 128 of V's
        columns with K whole, and blocks of K are where that is off (QLA_KEY_BLOCKS=0).

            >>> import qla_compiler
            >>> keys, values, each = qla_compiler.compile_spec("gla").scheduled_for((256, 256)).backward_blocks()
            >>> keys, values, each.head_dims, each.partial
            (256, 128, (256, 128), ('key',))
        """
        if "backward_blocks" not in self._derived:
            K = self.head_dims[0]
            try:
                width, prog = self.backward_columns()
                blocks = (K, width, prog)
            except PassError as e:
                how, why = key_blocks(self.backward)
                if how is None or K <= 64:
                    said = str(e).removeprefix(f"pass '{e.pass_name}': ")
                    raise PassError(e.pass_name, f"{said}; nor on blocks of K: "
                                                 f"{why or f'K = {K} is already the narrowest block'}") from None
                half = self.scheduled_for((K // 2, self.head_dims[1]), partial=(*self.partial, "value"))
                blocks = half.backward_blocks()
            self._derived["backward_blocks"] = blocks
        return self._derived["backward_blocks"]

    def backward_unsupported(self) -> str | None:
        """Why the backward program has no lowering rules (passes/lowerable.py), or None when it
        has (or the forward has none either: `no_kernels` says why). (Its kernels may still not
        fit in shared memory: backward_columns says so.)

            >>> import qla_compiler
            >>> qla_compiler.compile_spec("gla").backward_unsupported() is None
            True
        """
        if self.no_kernels is not None or self.target != "sm90":
            return None
        # (asked by every training call: once per program, not a walk of the VJP's graph a call,
        # which took ~3 ms of a 16/64 × 2048 training step's host time on the H200, session 27)
        if "backward_unsupported" not in self._derived:
            why = unsupported(self.backward)
            self._derived["backward_unsupported"] = None if why is None else f"{self.recurrence.path}: {why}"
        return self._derived["backward_unsupported"]

    def _need_kernels(self, where: str) -> None:
        """Refuse to schedule a program the pipeline found no kernels for (passes/lowerable.py)."""
        if self.no_kernels is not None:
            raise PassError("partition", f"{where}{self.no_kernels}")

    @property
    def fused_program(self) -> "Program":
        """The forward with its scan and out kernel fused into one warp-specialised kernel
        (passes/schedule_fused.py): the per-chunk states and v_new stay on the SM. For inference
        (the training forward keeps what the backward loads). With `fold_wy` first, where it
        applies (the delta rule): v_new = T·(diag(β)V − diag(βΓ)K·S₀) in the chain, so W and U are
        formed on the fly and never cross memory, and the prep solves T_r alone and stores
        T = T_r ⊙ R (FlashQLA's split; partition); then scale_after_product_on_chain, so
        kS = diag(βΓ)·(K·S₀) scales the V-block-wide product.

            >>> import qla_compiler
            >>> [k.name for k in qla_compiler.compile_spec("gdn").fused_program.kernels.kernels]
            ['gdn_prep', 'gdn_fused']
        """
        return self._fused(wide=False)

    @property
    def fused_wide_program(self) -> "Program":
        """The fused forward at V-block 128 (schedule_fused.WIDE_BLOCK_V), for calls whose grid
        fills the GPU at that width: its chain cut into a state role and a value role, so four roles
        in all; the same chunk program as fused_program.

            >>> import qla_compiler
            >>> fused = qla_compiler.compile_spec("gdn").fused_wide_program.kernels
            >>> fused.block_v_max, [r.name for r in fused.kernels[-1].warp_roles]
            (128, ['state', 'value', 'output', 'loads'])
        """
        return self._fused(wide=True)

    @property
    def fused_training_program(self) -> "Program":
        """The training forward as the fused forward's two kernels (fused_program's): the prep
        stores the triangular inverses beside T, and the fused kernel's output role stores the
        values the training program's scan carries (the entering states, v_new) as the chain hands
        them over, so the backward loads what it loads after training_program. NotFusable where
        the entering states are kept in float32 (GLA: saved_state_dtype) or the kernel does not fit.

            >>> import qla_compiler
            >>> fused = qla_compiler.compile_spec("gdn").fused_training_program.kernels.kernels[-1]
            >>> [p.name for p in fused.params if p.role == "out"]
            ['o', 'S0_chunks', 'v_new_rows', 'final_state']
        """
        return self._fused(wide=False, training=True)

    @property
    def fused_wide_training_program(self) -> "Program":
        """fused_training_program at V-block 128 (fused_wide_program's kernel, storing as that one does)."""
        return self._fused(wide=True, training=True)

    def _fused(self, wide: bool, training: bool = False) -> "Program":
        key = f"fused{'_wide' if wide else ''}{'_training' if training else ''}_program"
        if key not in self._derived:
            before = [s for s in self.stages if s[0] not in ("partition", "schedule")]
            try:
                keep = ()
                if training:
                    keep = tuple(n.name for n in self.chunk.of_op("inv_unit_lower")) \
                        + self.training_program.stage("partition").carried
                chunk = self.chunk
                # the decay on the value side (where this variant left it on the keys: in the fused
                # kernel the chain runs every pass itself, so a C×BV pass beats a C×K one at any
                # V-block), fold_wy, then the scalings it leaves on the chain's products moved onto them
                for rewrite in (DECAY_VALUE_SIDE, FOLD_WY, SCALE_AFTER_PRODUCT_ON_CHAIN):
                    after = _run_pass(rewrite, chunk, "fused forward: ")
                    if set(after.graph.nodes) != set(chunk.graph.nodes):
                        before.append((rewrite.name, after))
                        chunk = after
                if training:  # (schedule_fused refuses entering states kept in float32: GLA's)
                    chunk = self._storing_states(chunk)
                prog = self._scheduled(chunk, before, f"fused {'training ' if training else ''}forward: ", fused=True,
                                       wide=wide, keep=keep)
                if training:
                    _check_stores(self.training_program.kernels, prog.kernels, self.backward_program.kernels)
                self._derived[key] = prog
            except PassError as e:  # kept: the runtime asks on every call (kernels/forward.fused_or_not)
                self._derived[key] = e
        got = self._derived[key]
        if isinstance(got, PassError):
            raise got.with_traceback(None)
        return got

    def _scheduled(self, chunk: ChunkIR, before: list, where: str, into: "Program | None" = None,
                   fused: bool = False, wide: bool = False, partial: tuple = (), scan_roles: bool = False,
                   **split) -> "Program":
        """`chunk` through partition (`split`: the values it keeps in memory, or is given) and
        schedule (for this program's head-dim tiles; `fused`, `wide`, `partial`, `scan_roles`:
        schedule's):
        a Program whose stages are `before` and those two (`into`, if given). A failure names the
        pass."""
        self._need_kernels(where)
        prog = into or Program(self.path, self.target, self.chunk_size, self.recurrence, chunk, stages=list(before),
                               head_dims=self.head_dims)
        ir = chunk
        for p in (Pass("partition", lambda c: partition(c, **split), "split into kernels"),
                  Pass("schedule", lambda part: schedule(part, head_dims=self.head_dims, fused=fused, wide=wide,
                                                                partial=partial, scan_roles=scan_roles),
                       "place buffers, order statements")):
            ir = _run_pass(p, ir, where)
            prog._keep(p.name, ir)
        return prog

    @property
    def affine(self) -> ChunkIR:
        """The chunk program's state update as S ↦ M S + H (passes/affine.py), derived on first use."""
        return self._derive("affine", derive_affine)

    def _derive(self, name: str, fn) -> ChunkIR:
        if name not in self._derived:
            try:
                self._derived[name] = fn(self.chunk)
            except (SpecError, PassError):
                raise
            except Exception as e:  # noqa: BLE001 - a crash inside a derivation names it
                raise PassError(name, f"{type(e).__name__}: {e}") from e
        return self._derived[name]


REUSE_MEMORY = Pass("reuse_memory", reuse_memory, "outputs in the memory of inputs dead after their kernel")
RELEASE_MEMORY = Pass("release_memory", release_memory, "tensors released after their last reader")


def _check_saved_dtypes(forward: KernelIR, backward: KernelIR) -> None:
    """Refuse a backward whose kernels read a tensor the training forward stores in another dtype
    (the entering states: saved_state_dtype decides both sides)."""
    stored = {p.name: p.dtype for k in forward.kernels for p in k.params if p.role == "out"}
    for k in backward.kernels:
        for p in k.params:
            if p.role == "in" and stored.get(p.name, p.dtype) != p.dtype:
                raise PassError("schedule", f"backward program: {k.name} reads {p.name} as {p.dtype}, "
                                            f"the training forward stores it as {stored[p.name]}")


def _check_stores(training: KernelIR, fused: KernelIR, backward: KernelIR) -> None:
    """Refuse a fused training forward that does not store, in the same dtype, every tensor the
    backward loads from the training forward's memory (it runs in that one's place)."""
    stored = {p.name: p.dtype for k in fused.kernels for p in k.params if p.role == "out"}
    made = {p.name for k in backward.kernels for p in k.params if p.role == "out"}
    loads = {p.name: p.dtype for k in backward.kernels for p in k.params if p.role == "in" and p.name not in made}
    for k in training.kernels:
        for p in k.params:
            if p.role == "out" and p.name in loads and stored.get(p.name) != p.dtype:
                got = f"stores it as {stored[p.name]}" if p.name in stored else "does not store it"
                raise PassError("schedule", f"fused training forward: the backward loads {p.name} ({p.dtype}, "
                                            f"from {k.name}); the fused forward {got}")


def _same_value(fwd: ChunkIR, bwd: ChunkIR, name: str) -> bool:
    """Whether `bwd` computes `name` as `fwd` does (autodiff copies the forward under its names,
    the entering state as the saved one; CSE may have merged or dropped some)."""
    if name not in bwd.graph:
        return False
    for x in fwd.closure([name]):
        a = fwd.node(x)
        b = bwd.node(x) if x in bwd.graph else None
        if b is None:
            return False
        if a.op == "state_in":
            if (b.op, b.attr.get("kind")) != ("input", "saved_state"):
                return False
        elif (a.op, a.args, a.attrs) != (b.op, b.args, b.attrs):
            return False
    return True


def _run_pass(p, ir, where: str = ""):
    """One pass, its result verified (a ChunkIR's structure and exponents); a failure names the
    pass (`where` says on what, when not the forward program)."""
    try:
        ir = p.run(ir)
        if isinstance(ir, ChunkIR):
            ir.verify()
            try:
                verify_exponents(ir)
            except PassError as e:  # name the pass that introduced the bad exponential
                raise PassError(p.name, str(e)) from e
        return ir
    except SpecError:
        raise
    except PassError as e:
        if not where:
            raise
        raise type(e)(p.name, f"{where}{e}") from e  # the kind kept (errors.NotFusable)
    except Exception as e:  # noqa: BLE001 - a crash inside a pass names the pass
        raise PassError(p.name, f"{where}{type(e).__name__}: {e}") from e


def passes(chunk_size: int) -> list[Pass]:
    front = [
        Pass("frontend", load_spec, "spec file → RecurrenceIR"),
        Pass("classify", classify, "recognise A_t and B_t"),
        Pass("chunk", lambda ir: derive_chunks(ir, chunk_size), "derive the chunk program"),
    ]
    back = [
        Pass("partition", partition, "split the chunk program into kernels"),
        Pass("schedule", schedule, "place buffers, order statements"),
    ]
    return front + list(CHUNK_PASSES) + back


def pass_names() -> list[str]:
    return [p.name for p in passes(64)]


def identity(name: str) -> str:
    """The identity a pass states (a rewrite's, passes/rewrite.py), or else what it does.

        >>> identity("exp2")
        'e^x = 2^(x·log₂e): γ₂ = γ·log₂e once, then exp2 everywhere'
    """
    return next(p.doc for p in passes(64) if p.name == name)


def run_pipeline(path, target: str = "sm90", chunk_size: int = 64, stop_after: str | None = None,
                 print_after: Callable | None = None, checker: Callable | None = None) -> Program:
    """The passes in order. `checker(recurrence)`, if given, makes the check run after every chunk
    pass: `.check(pass name, ChunkIR)` returns its errors, kept in Program.checked
    (qla_compiler/check_mode.py: compile_spec(check=True) passes it)."""
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {target!r}")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {chunk_size}")
    names = pass_names()
    if stop_after is not None and stop_after not in names:
        raise ValueError(f"stop_after: no pass named {stop_after!r}; passes: {', '.join(names)}")
    prog = Program(str(path), target, chunk_size)
    ir = path
    check = None
    for p in passes(chunk_size):
        if p.name == "partition" and (why := unsupported(ir)) is not None:
            prog.no_kernels = f"{prog.recurrence.path}: {why}"
            if stop_after in ("partition", "schedule"):
                raise PassError(p.name, prog.no_kernels)
            break
        ir = _run_pass(p, ir)
        prog._keep(p.name, ir)
        if isinstance(ir, ChunkIR) and checker is not None:
            check = check or checker(prog.recurrence)
            prog.checked[p.name] = check.check(p.name, ir)
        if print_after is not None:
            print_after(p.name, ir)
        if p.name == stop_after:
            break
    return prog
