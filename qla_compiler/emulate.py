"""The compiled kernels emulated on any torch device: each kernel runs its KernelIR statements in
float64 (ir/kernel_interp.py), reading and writing the global tensors its parameters name.

Everything but the TileLang templates is exercised: the partition, the schedule's statements, the
names and shapes of the tensors between kernels, the slots of the per-chunk states, the wiring in
kernels/forward.py and kernels/backward.py. The CPU tests run the GPU path's host code with it;
the GPU tests feed each real kernel the emulator's inputs and compare its outputs.

    >>> step = emulated_step(op, random_inputs(op, T=300, cu_seqlens=[0, 1, 300]))   # doctest: +SKIP
    >>> step["grads"]["k"], step["emulator"].seen["gdn_scan"]["v_new_rows"]           # doctest: +SKIP
"""
from __future__ import annotations

import contextlib

import torch

from .ir.kernel_interp import Sizes, run_kernel
from .layout import packed_cu_seqlens


class KernelEmulator:
    """Stands in for load_kernels: each kernel runs its KernelIR statements in float64
    (ir/kernel_interp.py) on the tensors the host code passes, so everything but the TileLang
    templates is exercised: the partition, the schedule's statements (indices, masks, zero rows,
    their order), the names and shapes of the tensors between kernels, the slots of the per-chunk
    states, the wiring in kernels/forward.py and kernels/backward.py."""

    def __init__(self, op, cu_seqlens: torch.Tensor, scale: float, rounding: torch.dtype | None = None):
        """op: a CompiledOp; cu_seqlens: the whole sequences'; scale: the op's scale; rounding: the
        io dtype whose rounding the buffers get as on the GPU (ir/kernel_interp.Sizes), None for
        exact. `calls` lists (kernel, value width) in launch order; `seen[kernel]` holds copies of
        the tensors the last launch of that kernel read (as they were before it ran: an output may
        be written in an input's memory, Tensor.reuses) and wrote; `programs` and `shapes`, what
        each launch compiled for."""
        self.op, self.cu, self.scale, self.rounding = op, cu_seqlens, scale, rounding
        self.calls, self.programs, self.shapes, self.seen = [], [], [], {}

    def __call__(self, program, shape):
        self.programs.append(program)
        self.shapes.append(shape)
        sizes = Sizes(K=shape.KP, V=shape.VP, BV=shape.BV, HV=shape.HV, G=shape.G, C=program.chunk_size,
                      head_logs=self.op._head_logs(shape.HV), rounding=self.rounding)
        return {k.name: self._kernel(k, shape, sizes) for k in program.kernels.kernels}

    def _kernel(self, kernel, shape, sizes):
        def run(*args):
            assert len(args) == len(kernel.params)
            self.calls.append((kernel.name, shape.V))
            read = {p.name: x.clone() for p, x in zip(kernel.params, args) if p.role == "in"}
            run_kernel(kernel, {p.name: x for p, x in zip(kernel.params, args)}, sizes, shape.scale_value)
            self.seen[kernel.name] = {p.name: read[p.name] if p.role == "in" else x.clone()
                                      for p, x in zip(kernel.params, args)}
        return run


@contextlib.contextmanager
def emulated_kernels(op, cu_seqlens: torch.Tensor, scale: float, block_v: int = 32,
                     rounding: torch.dtype | None = None):
    """Within it, the GPU path's host code (kernels/forward.py, kernels/backward.py) runs with every
    kernel emulated (yields the KernelEmulator), the V-block fixed at `block_v`, the launch rules of
    an H200.

        >>> with emulated_kernels(op, cu, scale) as emu:                       # doctest: +SKIP
        ...     o, final = op._run_kernels(inputs, scale, h0, cu, None)
    """
    from .kernels import forward as fwd

    emu = KernelEmulator(op, cu_seqlens, scale, rounding)
    with fwd.launch_policy(kernels=emu, block_v=block_v, sms=fwd.H200_SMS):  # (no GPU here)
        yield emu


def emulated_step(op, args: dict, seed: int = 1, block_v: int = 32, segments=None,
                  rounding: torch.dtype | None = None) -> dict:
    """One training step of `op` through the GPU path's host code with every kernel emulated: the
    forward (kernels/forward.py) on `args` (as `testing.random_inputs` makes them), then the backward
    (kernels/backward.py) from random cotangents; `segments`: both context-parallel; `rounding`:
    KernelEmulator's. Returns o, final, d_o, d_final, grads (by input), d_h0 and the emulator (whose
    `seen` holds every kernel's tensors)."""
    from .kernels import backward as bwd
    from .kernels import forward as fwd

    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args.get("initial_state"),
                                      args.get("cu_seqlens"), False)
    cu = packed_cu_seqlens(dims.B, dims.T, args.get("cu_seqlens"), "cpu", torch.int32)
    with emulated_kernels(op, cu, scale, block_v, rounding) as emu:
        o, final, kept = fwd.forward(op.program, inputs, op.kinds, dims, scale, args.get("initial_state"),
                                     args.get("cu_seqlens"), op._head_logs(dims.HV), segments, keep=True)
        gen = torch.Generator().manual_seed(seed)
        d_o = torch.randn(o.shape, generator=gen).to(o.dtype)
        d_final = torch.randn(final.shape, generator=gen)
        v = inputs[op.value_name]  # the variant the forward ran, as the custom op passes it
        variant = fwd.program_for(op.program, dims, v.dtype, v.device)
        grads, d_h0 = bwd.backward(variant, kept, op.kinds, dims, scale, d_o, d_final, segments)
    return dict(o=o, final=final, d_o=d_o, d_final=d_final, grads=grads, d_h0=d_h0, emulator=emu, scale=scale)


def reference_step(op, args: dict, step: dict) -> dict:
    """What an emulated_step on `args` is measured against: o, the final state, every input's
    gradient and d h0 through the spec's float64 reference, for the step's own cotangents (its
    d_o and d_final). Keys as emulated_step's: o, final, grads (by input), d_h0 (None without an
    initial state)."""
    ref = {n: (x.detach().double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in args.items()}
    o, final = op.reference(**ref)
    torch.autograd.backward([o, final], [step["d_o"].double(), step["d_final"].double()])
    h0 = ref.get("initial_state")
    return dict(o=o.detach(), final=final.detach(), grads={n: ref[n].grad for n in op.input_names},
                d_h0=h0.grad if torch.is_tensor(h0) else None)


def emulated_kernel_step(op, args: dict, seed: int = 2, rounding: torch.dtype | None = None) -> dict:
    """The GPU path as autograd runs it, every kernel emulated (`rounding`: KernelEmulator's): the
    custom op qla::run_kernels on
    `args` (as `testing.random_inputs` makes them, in any dtypes), then backward() of a random
    weighting of o and the final state; and the same through the spec's float64 reference. Returns
    o, final, grads (by input, initial_state included), o_ref, final_ref, grads_ref and the
    emulator."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in args.items()
              if torch.is_tensor(x) and x.is_floating_point()}
    inputs, dims, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"],
                                      args["cu_seqlens"], False)
    gen = torch.Generator().manual_seed(seed)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, rounding=rounding) as emu:
        o, final = op._run_kernels(inputs, scale, leaves["initial_state"], args["cu_seqlens"], None)
        w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
        ((o.float() * w_o).sum() + (final * w_s).sum()).backward()
    ref = {n: (x.detach().double().requires_grad_() if n in leaves else x) for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    return dict(o=o.detach(), final=final.detach(), grads={n: x.grad for n, x in leaves.items()},
                o_ref=o_ref.detach(), final_ref=s_ref.detach(), grads_ref={n: ref[n].grad for n in leaves}, emulator=emu)
