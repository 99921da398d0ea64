"""A backward's gradients written in the memory of the per-token partials their kernel consumes
(passes/reuse_memory.py, Tensor.reuses): which outputs take which inputs' memory, the verifier's
refusals where that would read overwritten rows, and the emulated training step, whose gradients
are those of a step that allocates every output, bit for bit."""
import dataclasses

import pytest
import torch

import qla_compiler
from qla_compiler import emulate
from qla_compiler.emulate import KernelEmulator, emulated_step
from qla_compiler.ir.kernel import KernelIR
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "gla", "kda"]
REUSED = {"gdn": {"d_q": "d_q_QKt_rows", "d_k": "d_k_QKt_rows", "d_v": "d_v_new_rows"}}
REUSED["delta_net"] = REUSED["gdn"]


@pytest.mark.parametrize("spec", SPECS)
def test_which_outputs_take_an_inputs_memory(spec):
    """The delta rule's backward out kernel writes d q, d k and d v in place of the partials it
    reads (the prep's q·Kᵀ partials, the scan's d v_new); no other kernel and no forward program
    reuses anything (a forward's per-token tensors may be kept for its backward)."""
    prog = qla_compiler.compile_spec(spec)
    back = prog.backward_program.kernels
    got = {p.name: p.reuses for k in back.kernels for p in k.params if p.reuses}
    assert got == REUSED.get(spec, {})
    if got:
        assert [k.name for k in back.kernels if any(p.reuses for p in k.params)] == [f"{spec}_backward_out"]
        assert "d_q: io[1, T, HV, K]" in str(back) and "(in d_q_QKt_rows's memory)" in str(back)
        assert prog.backward_program.stages[-1][0] == "reuse_memory"
    for forward in (prog.kernels, prog.training_program.kernels):
        assert not any(p.reuses for k in forward.kernels for p in k.params)


def _out_kernel(spec="gdn"):
    kir = qla_compiler.compile_spec(spec).backward_program.kernels
    return kir, kir.kernels.index(next(k for k in kir.kernels if k.name.endswith("_backward_out")))


def _with(kir, i, kernel):
    return dataclasses.replace(kir, kernels=[kernel if j == i else k for j, k in enumerate(kir.kernels)])


def _marked(kernel, out: str, given: str):
    return dataclasses.replace(kernel, params=[dataclasses.replace(p, reuses=given if p.name == out else p.reuses)
                                               for p in kernel.params])


def test_the_verifier_refuses_a_store_before_the_rows_are_read():
    """Moving d q's store before the load of d_q_QKt_rows (a schedule bug) would overwrite the rows
    the CTA is about to read: Kernel.verify names it."""
    kir, i = _out_kernel()
    k = kir.kernels[i]
    store = next(s for s in k.body + k.epilogue if s.dst == "d_q")
    moved = dataclasses.replace(k, prologue=[store] + [s for s in k.prologue if s is not store],
                                body=[s for s in k.body if s is not store],
                                epilogue=[s for s in k.epilogue if s is not store])
    with pytest.raises(ValueError, match="d_q is stored before d_q_QKt_rows's rows are read"):
        moved.verify()
    moved_clear = _marked(moved, "d_q", "")
    moved_clear.verify()  # (the same order without the claim is fine)


def test_the_verifier_refuses_what_the_program_still_needs():
    """The caller's tensors (the forward's v_new, kept for another step of autograd) and a partial
    a later kernel reads are not the kernel's to overwrite; nor is a scan's input (under context
    parallelism a scan runs more than once a call)."""
    kir, i = _out_kernel()
    k = kir.kernels[i]
    forwards = _with(kir, i, _marked(k, "d_v", "v_new_rows"))
    forwards.kernels[i].verify()  # (alike, loaded once, before the store: the kernel allows it)
    with pytest.raises(ValueError, match="no earlier kernel makes v_new_rows"):
        forwards.verify()
    later = dataclasses.replace(k, name="a_later_kernel", params=[dataclasses.replace(p, reuses="") for p in k.params])
    with pytest.raises(ValueError, match="a_later_kernel reads it later"):
        KernelIR(kir.name, kir.chunk_size, kir.kernels + [later], kir.host, kir.consts, kir.head_dims).verify()
    scan = kir.kernels[kir.scan]
    out = next(p for p in scan.params if p.role == "out" and p.shape[:2] == ("1", "T"))
    given = next(p for p in scan.params if p.role == "in" and p.shape == out.shape and p.dtype == out.dtype)
    with pytest.raises(ValueError, match="only a parallel kernel"):
        _marked(scan, out.name, given.name).verify()


class _Recording(KernelEmulator):
    """The emulator, keeping the storage each launch got for each parameter."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ptrs = {}

    def _kernel(self, kernel, shape, sizes):
        run = super()._kernel(kernel, shape, sizes)

        def record(*args):
            self.ptrs[kernel.name] = {p.name: x.data_ptr() for p, x in zip(kernel.params, args)}
            run(*args)
        return record


def _step(op, args, monkeypatch, poison=None):
    monkeypatch.setattr(emulate, "KernelEmulator", _Recording)
    with fwd.launch_policy(poison=poison):
        step = emulated_step(op, args, rounding=torch.bfloat16)
    return step, step["emulator"].ptrs


@pytest.mark.parametrize("spec", ["gdn", "delta_net"])
@pytest.mark.parametrize("K,V", [(64, 64), (100, 60)])
def test_a_step_gives_the_gradients_of_one_that_allocates_every_output(spec, K, V, monkeypatch):
    """The emulated training step (bf16 rounding, a 1-token sequence, partial chunks, grouped value
    heads) with the reuse gives the gradients of the same step under a poison policy (every output
    allocated and filled with NaN first: no reuse), bit for bit, and its out kernel did get a
    partial's storage for each gradient: at K = V = 64, where the gradients and the partials are
    allocated alike; at K = 100, V = 60 the partials are the tiles' width and the gradients the
    op's, so each is allocated on its own."""
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=300, H=2, HV=4, K=K, V=V, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    (reused, ptrs), (fresh, fresh_ptrs) = _step(op, args, monkeypatch), _step(op, args, monkeypatch, float("nan"))
    for name in op.input_names:
        assert torch.equal(reused["grads"][name], fresh["grads"][name]), name
    assert torch.equal(reused["d_h0"], fresh["d_h0"])
    out = ptrs[f"{spec}_backward_out"]
    shared = {g for g, partial in REUSED[spec].items() if out[g] == out[partial]}
    assert shared == (set(REUSED[spec]) if (K, V) == (64, 64) else set())
    assert not any(fresh_ptrs[f"{spec}_backward_out"][g] == fresh_ptrs[f"{spec}_backward_out"][p]
                   for g, p in REUSED[spec].items())
