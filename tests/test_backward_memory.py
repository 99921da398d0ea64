"""A backward's memory: outputs written in the memory of the per-token partials their kernel
consumes (passes/reuse_memory.py, Tensor.reuses), and tensors released after their last reader
(passes/release_memory.py, Kernel.releases). Which outputs take which inputs' memory, the
verifier's refusals where that would read overwritten rows or drop a tensor still read, the
emulated training step, whose gradients are those of a step that allocates every output, bit for
bit, and which tensors no one holds any more when the out kernels run."""
import dataclasses
import weakref

import pytest
import torch

import qla_compiler
from qla_compiler import emulate
from qla_compiler.emulate import KernelEmulator, emulated_step
from qla_compiler.ir.kernel import KernelIR
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "gla", "kda"]
# kernel -> {output: the input whose memory it takes}
SCAN_REUSES = {"d_v_new_rows": "d_v_new_o_intra_rows"}
# (GDN's d q and d k have no partials of their own to take: the out kernel forms the q·Kᵀ terms
# itself, partition.RECOMPUTE_ON_LOADED; KDA's, a per-key gate's, cross memory as d P)
REUSED = {"gdn": {"gdn_backward_scan": SCAN_REUSES, "gdn_backward_out": {"d_v": "d_v_new_rows"}},
          "kda": {"kda_backward_scan": SCAN_REUSES}}
REUSED["delta_net"] = {k.replace("gdn", "delta_net"): r for k, r in REUSED["gdn"].items()}


@pytest.mark.parametrize("spec", SPECS)
def test_which_outputs_take_an_inputs_memory(spec):
    """The delta rule's backward scan writes d v_new where it read d v_new's intra-chunk part, and
    its out kernel d v in place of the scan's d v_new; no other kernel and no forward program
    reuses anything (a forward's per-token tensors may be kept for its backward)."""
    prog = qla_compiler.compile_spec(spec)
    back = prog.backward_program.kernels
    got = {k.name: {p.name: p.reuses for p in k.params if p.reuses} for k in back.kernels}
    assert {k: r for k, r in got.items() if r} == REUSED.get(spec, {})
    if spec == "gdn":
        assert "d_v: io[1, T, HV, V]" in str(back) and "(in d_v_new_rows's memory)" in str(back)
    assert [n for n, _ in prog.backward_program.stages[-2:]] == ["reuse_memory", "release_memory"]
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
    """Moving d v's store before the load of d_v_new_rows (a schedule bug) would overwrite the rows
    the CTA is about to read: Kernel.verify names it."""
    kir, i = _out_kernel()
    k = kir.kernels[i]
    store = next(s for s in k.body + k.epilogue if s.dst == "d_v")
    moved = dataclasses.replace(k, prologue=[store] + [s for s in k.prologue if s is not store],
                                body=[s for s in k.body if s is not store],
                                epilogue=[s for s in k.epilogue if s is not store])
    with pytest.raises(ValueError, match="d_v is stored before d_v_new_rows's rows are read"):
        moved.verify()
    moved_clear = _marked(moved, "d_v", "")
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
    store = next(s for s in scan.body if s.dst == "d_v_new_rows")
    after = dataclasses.replace(scan, body=[s for s in scan.body if s is not store], epilogue=[store, *scan.epilogue])
    with pytest.raises(ValueError, match="stores d_v_new_rows outside its loop over chunks"):
        after.verify()  # (a scan's rows are each chunk's: loaded and stored in one iteration)


class _Recording(KernelEmulator):
    """The emulator, keeping the storage each launch got for each parameter (`ptrs`: kernel -> one
    {parameter: data pointer} a launch), and which tensors of the launches before each launch are
    still held by anyone (`alive`: kernel -> (kernel, parameter) of each, at its last launch)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ptrs, self.alive, self._refs = {}, {}, []

    def _kernel(self, kernel, shape, sizes):
        run = super()._kernel(kernel, shape, sizes)

        def record(*args):
            self.ptrs.setdefault(kernel.name, []).append({p.name: x.data_ptr() for p, x in zip(kernel.params, args)})
            self.alive[kernel.name] = {n for n, r in self._refs if r() is not None}
            self._refs += [((kernel.name, p.name), weakref.ref(x)) for p, x in zip(kernel.params, args)]
            run(*args)
        return record


def _step(op, args, monkeypatch, poison=None, segments=None):
    monkeypatch.setattr(emulate, "KernelEmulator", _Recording)
    with fwd.launch_policy(poison=poison):
        step = emulated_step(op, args, rounding=torch.bfloat16, segments=segments)
    return step, step["emulator"]


def _shared(launches: list, reuses: dict) -> set:
    """The outputs that got their input's storage at every launch of a kernel."""
    return {o for o, i in reuses.items() if all(ptrs[o] == ptrs[i] for ptrs in launches)}


@pytest.mark.parametrize("spec", ["gdn", "delta_net"])
@pytest.mark.parametrize("K,V,segments", [(64, 64, None), (100, 60, None), (64, 64, 3)])
def test_a_step_gives_the_gradients_of_one_that_allocates_every_output(spec, K, V, segments, monkeypatch):
    """The emulated training step (bf16 rounding, a 1-token sequence, partial chunks, grouped value
    heads) with the reuse gives the gradients of the same step under a poison policy (every output
    allocated and filled with NaN first: no reuse), bit for bit, and its kernels did get a
    partial's storage for each output that reuses one:
    - the out kernel at K = V = 64, where the gradients and the partials are allocated alike; at
      K = 100, V = 60 the partials are the tiles' width and the gradients the op's, so each is
      allocated on its own;
    - the scan, whose d v_new and its intra-chunk part are both the tiles' width, at both, but not
      context-parallel (`segments`), where each pass of the scan reads its inputs anew."""
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=300, H=2, HV=4, K=K, V=V, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    (reused, emu), (fresh, fresh_emu) = (_step(op, args, monkeypatch, segments=segments),
                                         _step(op, args, monkeypatch, float("nan"), segments))
    for name in op.input_names:
        assert torch.equal(reused["grads"][name], fresh["grads"][name]), name
    assert torch.equal(reused["d_h0"], fresh["d_h0"])
    expected = {f"{spec}_backward_out": (K, V) == (64, 64), f"{spec}_backward_scan": not segments}
    for kernel, reuses in REUSED[spec].items():
        assert _shared(emu.ptrs[kernel], reuses) == (set(reuses) if expected[kernel] else set()), kernel
        assert not _shared(fresh_emu.ptrs[kernel], reuses), kernel


@pytest.mark.parametrize("spec, K, V", [("kda", 16, 48), ("gdn", 64, 64)])
def test_the_emulator_records_an_input_as_its_kernel_read_it(spec, K, V, monkeypatch):
    """`KernelEmulator.seen` holds each input as its kernel read it, also where an output took the
    input's memory: tests/test_gpu_kernels.py feeds each GPU kernel what the emulator's read. A
    copy made after the launch handed KDA's scan its own d v_new as d v_new's intra-chunk part
    (its d S 7–18 % off the emulator's on the H100, session 49), and GDN's out kernel its d v as
    d v_new."""
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=278, H=1, HV=2, K=K, V=V, cu_seqlens=[0, 1, 201, 278], initial_state=True,
                         dtype=torch.bfloat16)
    _, emu = _step(op, args, monkeypatch)
    kernels = op.program.backward_program.kernels.kernels
    shared = [(k.name, p.name, p.reuses) for k in kernels for p in k.params
              if p.reuses and _shared(emu.ptrs[k.name], {p.name: p.reuses})]
    assert shared, "no output took an input's memory"
    for kernel, out, taken in shared:
        writer = next(k.name for k in kernels if any(p.name == taken and p.role == "out" for p in k.params))
        assert torch.equal(emu.seen[kernel][taken], emu.seen[writer][taken]), (kernel, taken)
        assert not torch.equal(emu.seen[kernel][taken], emu.seen[kernel][out]), (kernel, out)


@pytest.mark.parametrize("spec", ["gdn", "kda"])
def test_tensors_are_released_after_their_last_reader(spec, monkeypatch):
    """What the backward's scan alone reads (the prep's W and d v_new's intra-chunk part) is
    released once it has run (passes/release_memory.py, Kernel.releases): no one holds those
    tensors when the out kernels launch, except where an output took the memory (d v_new); the
    scan's outputs and the inputs the out kernels read are held until then."""
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=130, H=1, HV=2, K=32, V=32, cu_seqlens=[0, 1, 130], initial_state=True,
                         dtype=torch.bfloat16)
    _, emu = _step(op, args, monkeypatch)
    back = op.program.backward_program.kernels
    scan = back.kernels[back.scan]
    assert scan.releases == ("W_rows", "d_v_new_o_intra_rows")
    alive = {n for k, n in emu.alive[back.kernels[back.scan + 1].name] if k == scan.name}
    assert "W_rows" not in alive and {"d_S_next_chunks", "d_v_new_rows", "q", "d_o"} <= alive


def test_the_verifier_refuses_a_release_of_what_is_still_needed():
    """A release is checked like a reuse (KernelIR.live_after): not of what a later kernel reads, not
    of a result (the caller reads it), not of the caller's tensors, and only of the kernel's inputs."""
    kir, i = _out_kernel()

    def releasing(j, *names, reader=None):
        """kir with kernel j releasing `names`, and a kernel after the out kernel reading `reader`."""
        kernels = list(kir.kernels)
        if reader:
            p = next(p for p in kir.kernels[i].params if p.name == reader)
            kernels.append(dataclasses.replace(kir.kernels[i], name=f"reads_{reader}",
                                               params=[dataclasses.replace(p, role="in", reuses="", result="")]))
        kernels[j] = dataclasses.replace(kernels[j], releases=names)
        return dataclasses.replace(kir, kernels=kernels)

    releasing(i, "d_S_next_chunks").verify()  # (the scan's, read by this kernel alone)
    with pytest.raises(ValueError, match="reads_d_v_new_rows reads it later"):
        releasing(i, "d_v_new_rows", reader="d_v_new_rows").verify()
    with pytest.raises(ValueError, match="d_q is a result"):
        releasing(len(kir.kernels), "d_q", reader="d_q").verify()
    with pytest.raises(ValueError, match="no earlier kernel makes S0_chunks"):
        releasing(i, "S0_chunks").verify()
    with pytest.raises(ValueError, match="it is no input of the kernel"):
        releasing(kir.scan, "d_v_new_rows").verify()
