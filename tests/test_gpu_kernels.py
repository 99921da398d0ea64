"""Every generated kernel alone on the GPU — the forward's and the backward's — fed the inputs the
float64 kernel emulator (qla_compiler/emulate.py) gave the same kernel, against the emulator's
outputs: when the whole op disagrees with the reference, these say which kernel is wrong."""
import contextlib

import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_kernels, emulated_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.kernels.runtime import load_kernels
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.testing import random_inputs, rel_err

pytestmark = pytest.mark.gpu
SPECS = ["gdn", "delta_net", "simple_gla", "linear_attn"]
# (spec, H, HV, K, V); the head dims of the last ones run in wider tiles (Tensor.padded): for the
# delta rule, whose prep also solves the triangular system in them, and for the per-key gates (at
# K = 16, KDA's backward prep read β before another thread had stored it: 47% off in W, session 33;
# test_lowering's test_threads_writes_are_ordered_before_a_fix_up_that_a_whole_chunk_skips)
CASES = [(spec, *c) for spec in SPECS for c in ((2, 8, 128, 128), (2, 2, 128, 128), (1, 2, 64, 64))] + \
    [(spec, *c) for spec in ("gdn", "delta_net", "kda", "gla") for c in ((2, 4, 100, 60), (1, 2, 16, 48))]


def _emulated(op, H, HV, K, V, BV, direction):
    """Run the `direction`'s program with emulated kernels on the CPU: what each kernel read and
    wrote. The training forward and the backward from one training step; the inference forward
    alone, unfused (its kernels need not be the training forward's: a prep may split in one only)."""
    cu = [0, 1, 201, 278]
    args = random_inputs(op, T=cu[-1], H=H, HV=HV, K=K, V=V, cu_seqlens=cu, initial_state=True,
                         dtype=torch.bfloat16)
    if direction != "forward":
        # training: the unfused training forward, whose kernels it compares (a call of these heads
        # runs the fused one by default, session 45; its kernels: test_gpu_fused_training.py)
        with fwd.launch_policy(fused_training=False) if direction == "training" else contextlib.nullcontext():
            step = emulated_step(op, args, block_v=BV)
        return step["emulator"].seen, step["scale"]
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, BV) as emu:
        fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"], args["cu_seqlens"],
                    op._head_logs(dims.HV), fused=False)
    return emu.seen, scale


def _written(name, ref, seen):
    """The part of an output tensor the kernel must write: real token rows; used chunk slots."""
    if ref.dim() == 4 and name.endswith("_chunks"):
        return ref[:int(seen["chunk_offsets"][-1])] if "chunk_offsets" in seen else ref
    return ref


@pytest.mark.parametrize("spec, H, HV, K, V", CASES)
@pytest.mark.parametrize("direction, warpgroups", [("forward", 1), ("forward", 2), ("training", 1),
                                                   ("training", 2), ("backward", 1)])
def test_kernel_matches_emulator(spec, direction, warpgroups, H, HV, K, V):
    """`warpgroups`: the forward scan's consumer warpgroups (the backward scan always has one)."""
    BV = 32  # (every class's V tile holds it; two scan warpgroups need it)
    op = qla_compiler.compile(spec)
    seen, scale = _emulated(op, H, HV, K, V, BV, direction)
    program = {"forward": op.program, "training": op.program.training_program,
               "backward": op.program.backward_program}[direction]
    _each_kernel_matches(program, ShapeClass(H=H, HV=HV, K=K, V=V, BV=BV, scale=scale, scan_warpgroups=warpgroups),
                         seen)


def _each_kernel_matches(program, shape: ShapeClass, seen: dict) -> None:
    """Each kernel of `program` fed what the emulator gave it, its outputs NaN-filled first, against
    the emulator's outputs."""
    kernels = load_kernels(program, shape)
    for k in program.kernels.kernels:
        got = {n: x.cuda() for n, x in seen[k.name].items()}
        for p in k.params:
            if p.role == "out":
                got[p.name] = torch.full_like(got[p.name], float("nan"))
        kernels[k.name](*[got[p.name] for p in k.params])
        for p in k.params:
            if p.role == "out":
                ref = _written(p.name, seen[k.name][p.name], seen[k.name])
                out = _written(p.name, got[p.name], seen[k.name])
                assert not torch.isnan(out).any(), f"{k.name}: {p.name} not fully written (BV={shape.BV})"
                assert rel_err(out.cpu(), ref) <= 1e-2, f"{k.name}: {p.name} (BV={shape.BV})"


@pytest.mark.parametrize("BV", [16, 32, 64])
def test_glas_backward_kernels_match_the_emulator_at_every_v_block(BV):
    """GLA's backward at K = V = 128 on the V-blocks its calls take: 16 (a few sequences), 32 (a
    call cut into segments runs them as sequences) and 64 (the widened first walk). Its backward
    scan stores d S in float32 straight from its fragment (schedule_build.state_dtype); the cases
    above run GLA only at padded head dims, and session 39's context-parallel GLA case failed on
    the H100 where the non-CP ones at BV = 16 passed."""
    op = qla_compiler.compile("gla")
    seen, scale = _emulated(op, 2, 2, 128, 128, BV, "backward")
    _each_kernel_matches(op.program.backward_program, ShapeClass(H=2, HV=2, K=128, V=128, BV=BV, scale=scale), seen)
