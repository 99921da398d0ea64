"""The compiled kernels emulated on any torch device: each kernel evaluates its partition's ChunkIR
nodes in float64, reading and writing the global tensors under the names its KernelIR parameters
give them.

Everything but the TileLang code is exercised: the partition (each kernel's nodes are computable
from what it loads), the names and shapes of the tensors between kernels, the slots of the
per-chunk states, the wiring in kernels/forward.py and kernels/backward.py. The CPU tests run the
GPU path's host code with it; the GPU tests feed each real kernel the emulator's inputs and
compare its outputs.

    >>> step = emulated_step(op, random_inputs(op, T=300, cu_seqlens=[0, 1, 300]))   # doctest: +SKIP
    >>> step["grads"]["k"], step["emulator"].seen["gdn_scan"]["v_new_rows"]           # doctest: +SKIP
"""
from __future__ import annotations

import contextlib

import torch

from .ir.chunk_ops import OPS, Context
from .kernels.forward import chunk_offsets
from .layout import expand_heads, from_chunks, gather, packed_cu_seqlens, scatter, to_chunks, token_index
from .passes.schedule import global_name


def _n_chunks(lengths: torch.Tensor, C: int) -> int:
    """Chunks of the longest sequence (at least one)."""
    return max(1, int(-(-lengths.max() // C)))


def _chunks(x, cu, HV, C):
    """A packed global tensor [1, T, heads, ...] as blocks [N, HV, NC, C, ...] (zero padded)."""
    starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    NC = _n_chunks(lengths, C)
    x = x.double()
    x = expand_heads(x, HV) if x.dim() == 4 else x
    return to_chunks(gather(x, starts, lengths, NC * C), C), lengths, NC


def _unchunk(y, cu, out):
    """Write blocks [N, HV, NC, C, ...] back into the packed tensor `out` [1, T, HV, ...] (real tokens only)."""
    starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    flat = scatter(from_chunks(y), starts, lengths, 1, out.shape[1])
    idx, mask = token_index(starts, lengths, y.shape[2] * y.shape[3])
    rows = idx[mask]
    out[0, rows] = flat[0, rows].to(out.dtype)


def _op_view(param, x: torch.Tensor, shape, out: bool = False) -> torch.Tensor:
    """A kernel tensor at the op's head dims: a padded one (Tensor.padded, allocated at the tiles'
    widths) is sliced to them; one the kernel writes has its padding zeroed first, as the kernels
    leave it (the real kernels then read what the emulator wrote)."""
    if not param.padded:
        return x
    if out:
        x.zero_()
    sizes = {"K": shape.K, "V": shape.V}
    return x[tuple(slice(0, sizes[d]) if d in sizes else slice(None) for d in param.shape)]


def _per_slot(S: torch.Tensor, slots: torch.Tensor, NC: int) -> torch.Tensor:
    """States stored per chunk slot [CH, HV, K, V] as blocks [N, HV, NC, K, V] (slots past a
    sequence's chunks repeat the last slot: they are never used for real tokens)."""
    idx = (slots[:-1, None] + torch.arange(NC, device=S.device)).clamp(max=S.shape[0] - 1)
    return S.double()[idx].movedim(2, 1)


class KernelEmulator:
    """Stands in for load_kernels: each kernel evaluates its partition's nodes with the ChunkIR ops
    in float64, reading and writing the global tensors under the names its KernelIR parameters
    give them. So everything but the TileLang code is exercised: the partition (each kernel's
    nodes are computable from what it loads), the names and shapes of the tensors between
    kernels, the slots of the per-chunk states, the wiring in kernels/forward.py and
    kernels/backward.py."""

    def __init__(self, op, cu_seqlens: torch.Tensor, scale: float):
        """op: a CompiledOp; cu_seqlens: the whole sequences' (the parallel kernels see only the
        chunk map); scale: the op's scale. `calls` lists (kernel, value width) in launch order;
        `seen[kernel]` holds copies of the tensors the last launch of that kernel read and wrote."""
        self.op, self.cu, self.scale = op, cu_seqlens, scale
        self.calls, self.shapes, self.seen = [], [], {}

    def __call__(self, program, shape):
        self.shapes.append(shape)
        part = program.stage("partition")
        return {k.name: self._kernel(part, k, shape) for k in program.kernels.kernels}

    def _kernel(self, part, kernel, shape):
        def run(*args):
            assert len(args) == len(kernel.params)
            named = {p.name: _op_view(p, x, shape, out=p.role == "out") for p, x in zip(kernel.params, args)}
            self.calls.append((kernel.name, shape.V))
            (self._scan if kernel.loop else self._parallel)(part, kernel, kernel.kind, named, shape)
            self.seen[kernel.name] = {p.name: x.clone() for p, x in zip(kernel.params, args)}
        return run

    def _context(self, part, kernel, nodes, named, cu, HV, state):
        ir, C = part.chunk, part.chunk.chunk_size
        vals, blocks, lengths, NC = {}, {}, None, None
        reads = {p.name for p in kernel.params if p.role == "in"}
        per_chunk = []
        for name in nodes:
            n = ir.node(name)
            src = global_name(ir, name)
            if src not in reads or n.op == "state_in":
                continue
            if n.op == "input" and n.attr["kind"] == "saved_state":
                per_chunk.append((name, src))
                continue
            b, lengths, NC = _chunks(named[src], cu, HV, C)
            (blocks if n.op == "input" else vals)[name] = b
        if lengths is None:
            lengths = (cu[1:] - cu[:-1]).long()
            NC = _n_chunks(lengths, C)
        for name, src in per_chunk:  # the forward's state entering every chunk
            blocks[name] = _per_slot(named[src], chunk_offsets(cu, C), NC)
        dev = lengths.device
        lens = (lengths[:, None] - C * torch.arange(NC, device=dev)).clamp(0, C)
        consts = {k: torch.tensor(v, dtype=torch.float64, device=dev).view(1, HV, 1)
                  for k, v in self.op._head_logs(HV).items()}
        prm = {"scale": torch.tensor(self.scale, dtype=torch.float64, device=dev).view(1, 1, 1)}
        return Context(blocks, lens.view(len(lengths), 1, NC), prm, consts, state, C, 3), vals, NC

    @staticmethod
    def _eval(ir, ctx, nodes, vals):
        for n in ir.order():
            if n.name in nodes and n.name not in vals:
                vals[n.name] = OPS[n.op].eval(ctx, [vals[a] for a in n.args], n.attr, [ir.node(a).shape for a in n.args])
        return vals

    def _parallel(self, part, kernel, kind, named, shape):
        ir = part.chunk
        assert (named["chunk_map"][:, 1] >= 0).all()
        nodes = kernel.nodes
        cu = self.cu
        N, HV = cu.numel() - 1, shape.HV
        state = torch.zeros(1, 1, 1, 1, 1, dtype=torch.float64, device=cu.device)  # prep does not read it
        if global_name(ir, ir.state_in) in named:  # the state entering every chunk, from its slot
            NC = _n_chunks(cu[1:] - cu[:-1], ir.chunk_size)
            state = _per_slot(named[global_name(ir, ir.state_in)], chunk_offsets(cu, ir.chunk_size), NC)
        ctx, vals, NC = self._context(part, kernel, nodes, named, cu, HV, state)
        vals = self._eval(ir, ctx, nodes, vals)
        if kind == "prep":
            outs = [(x, global_name(ir, x)) for x in part.crossing]
        else:
            outs = [(ir.outputs[role], role) for role in kernel.outputs]
        for x, dst in outs:
            y = vals[x].expand(N, HV, NC, *vals[x].shape[3:])
            _unchunk(y, cu, named[dst])

    def _scan(self, part, kernel, kind, named, shape):
        ir = part.chunk
        cu, h0 = named["cu_seqlens"], named["initial_state"].double()
        assert h0.shape[-1] == shape.V
        ctx, vals, NC = self._context(part, kernel, kernel.nodes, named, cu, shape.HV, h0.unsqueeze(2))
        slots = named["chunk_offsets"]
        assert torch.equal(slots, chunk_offsets(cu, ir.chunk_size))
        state, carried = h0.unsqueeze(2), {x: [None] * NC for x in part.carried}
        for c in (reversed(range(NC)) if ir.reverse else range(NC)):
            sl = {k: v[:, :, c:c + 1] for k, v in vals.items()}
            cctx = Context({k: b[:, :, c:c + 1] for k, b in ctx.inputs.items()}, ctx.lengths[:, :, c:c + 1],
                           ctx.params, ctx.head_consts, state, ir.chunk_size, 3)
            sl = self._eval(ir, cctx, kernel.nodes, sl)
            for x in part.carried:
                carried[x][c] = sl[x]
            state = sl[ir.outputs["state"]]
        named["final_state"].copy_(state.squeeze(2))
        lengths = cu[1:] - cu[:-1]
        for x in part.carried:
            y = torch.cat(carried[x], 2)
            out = named[global_name(ir, x)]
            if x == ir.state_in:
                for n in range(cu.numel() - 1):
                    used = int(-(-lengths[n] // ir.chunk_size))
                    out[slots[n]:slots[n] + used] = y[n, :, :used].movedim(1, 0).to(out.dtype)
            else:
                _unchunk(y, cu, out)


@contextlib.contextmanager
def emulated_kernels(op, cu_seqlens: torch.Tensor, scale: float, block_v: int = 32):
    """Within it, the GPU path's host code (kernels/forward.py, kernels/backward.py) runs with every
    kernel emulated (yields the KernelEmulator), the V-block fixed at `block_v`, the launch rules of
    an H200.

        >>> with emulated_kernels(op, cu, scale) as emu:                       # doctest: +SKIP
        ...     o, final = op._run_kernels(inputs, scale, h0, cu, None)
    """
    from unittest import mock

    from .kernels import forward as fwd

    emu = KernelEmulator(op, cu_seqlens, scale)
    with mock.patch.object(fwd, "load_kernels", emu), \
            mock.patch.object(fwd, "choose_block_v", lambda V, HV, N, device: block_v), \
            mock.patch.object(fwd, "sm_count", lambda device: fwd.H200_SMS):  # (no GPU here)
        yield emu


def emulated_step(op, args: dict, seed: int = 1, block_v: int = 32, segments=None) -> dict:
    """One training step of `op` through the GPU path's host code with every kernel emulated: the
    forward (kernels/forward.py) on `args` (as `testing.random_inputs` makes them), then the backward
    (kernels/backward.py) from random cotangents; `segments`: both context-parallel. Returns o,
    final, d_o, d_final, grads (by input), d_h0 and the emulator (whose `seen` holds every kernel's
    tensors)."""
    from .kernels import backward as bwd
    from .kernels import forward as fwd

    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args.get("initial_state"),
                                      args.get("cu_seqlens"), False)
    cu = packed_cu_seqlens(dims.B, dims.T, args.get("cu_seqlens"), "cpu", torch.int32)
    with emulated_kernels(op, cu, scale, block_v) as emu:
        o, final, kept = fwd.forward(op.program, inputs, op.kinds, dims, scale, args.get("initial_state"),
                                     args.get("cu_seqlens"), op._head_logs(dims.HV), segments, keep=True)
        gen = torch.Generator().manual_seed(seed)
        d_o = torch.randn(o.shape, generator=gen).to(o.dtype)
        d_final = torch.randn(final.shape, generator=gen)
        grads, d_h0 = bwd.backward(op.program, kept, op.kinds, dims, scale, d_o, d_final, segments)
    return dict(o=o, final=final, d_o=d_o, d_final=d_final, grads=grads, d_h0=d_h0, emulator=emu, scale=scale)


def emulated_kernel_step(op, args: dict, seed: int = 2) -> dict:
    """The GPU path as autograd runs it, every kernel emulated: the custom op qla::run_kernels on
    `args` (as `testing.random_inputs` makes them, in any dtypes), then backward() of a random
    weighting of o and the final state; and the same through the spec's float64 reference. Returns
    o, final, grads (by input, initial_state included) and o_ref, final_ref, grads_ref."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in args.items()
              if torch.is_tensor(x) and x.is_floating_point()}
    inputs, dims, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"],
                                      args["cu_seqlens"], False)
    gen = torch.Generator().manual_seed(seed)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale):
        o, final = op._run_kernels(inputs, scale, leaves["initial_state"], args["cu_seqlens"], None)
        w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
        ((o.float() * w_o).sum() + (final * w_s).sum()).backward()
    ref = {n: (x.detach().double().requires_grad_() if n in leaves else x) for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    return dict(o=o.detach(), final=final.detach(), grads={n: x.grad for n, x in leaves.items()},
                o_ref=o_ref.detach(), final_ref=s_ref.detach(), grads_ref={n: ref[n].grad for n in leaves})
