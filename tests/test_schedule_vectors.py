"""Per-token vectors in registers (passes/schedule_vectors.py, QLA_VECTOR_REGISTERS=1): the 2-D
passes read their vectors from fragments copied right before, and the kernels so scheduled compute
what the spec's float64 reference does (the emulator runs the copies and the rewritten passes)."""
import qla_compiler
from qla_compiler.passes.schedule_vectors import vectors_in_registers
from child_process import run_child


def _vector_reads(kernel):
    """(statement, vector, index) of every read of a shared per-token vector by a 2-D element-wise
    statement over a 2-D fragment (one it reads or writes)."""
    shared = {b.name for b in kernel.buffers if b.scope == "shared" and len(b.shape) == 1}
    blocks = {b.name for b in kernel.buffers if b.scope == "fragment" and len(b.shape) == 2}
    found = []

    def walk(st, e):
        if isinstance(e, tuple) and e and e[0] == "buf":
            if e[1] in shared and len(e) == 3 and e[2] in ("i", "j"):
                found.append((st.dst, e[1], e[2]))
        elif isinstance(e, tuple):
            for x in e[1:]:
                walk(st, x)
    for st in kernel.body:
        if st.op == "ewise" and tuple(st.attr["index"]) == ("i", "j") and ({st.dst} | st.reads()) & blocks:
            walk(st, st.attr["expr"])
    return found


def test_the_2d_passes_read_their_vectors_from_fragments_copied_right_before():
    for spec in ("gdn", "kda", "gla"):
        for kernel in qla_compiler.compile_spec(spec, target="sm90").kernels.kernels:
            if kernel.loop or kernel.warp_roles or not _vector_reads(kernel):
                continue
            after = vectors_in_registers(kernel)
            after.verify()
            assert not _vector_reads(after), (spec, kernel.name)
            frags = {b.name: b for b in after.buffers if b not in kernel.buffers}
            assert frags and all(b.scope == "fragment" and len(b.shape) == 1 for b in frags.values())
            body = after.body
            for at, st in enumerate(body):  # each fragment: written once, right before its one reader
                if st.dst in frags:
                    reader = next(s for s in body[at + 1:] if s.dst not in frags)
                    assert st.dst in str(reader.attr["expr"]), (spec, kernel.name, st)
                    assert sum(s.dst == st.dst for s in body) == 1


CHILD = """
import sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_kernel_step
from qla_compiler.testing import random_inputs
out = {}
for spec in ("gdn", "kda", "gla"):
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=150, H=2, HV=2, K=32, V=32, cu_seqlens=[0, 1, 70, 150], initial_state=True, seed=5,
                         dtype=torch.bfloat16)
    args["output_final_state"] = True
    step = emulated_kernel_step(op, args)
    copies = sum(b.scope == "fragment" and len(b.shape) == 1 for p in (op.program, op.program.backward_program)
                 for k in p.kernels.kernels for b in k.buffers if not k.loop)
    out[spec] = {"copies": copies, "o": step["o"], "final": step["final"], "grads": step["grads"],
                 "o_ref": step["o_ref"], "grads_ref": step["grads_ref"]}
torch.save(out, sys.argv[1])
"""


def test_kernels_with_vectors_in_registers_compute_what_they_did(tmp_path):
    """GDN's, KDA's and GLA's forward and backward kernels, emulated (float64 inside, bf16 in and
    out), with the switch on and off (child processes: it is read at import): the copies change no
    value, so o, the final state and every gradient are bit for bit the same, and near the float64
    reference."""
    import torch

    from qla_compiler.testing import rel_err
    runs = {}
    for on in ("0", "1"):
        path = tmp_path / f"run{on}.pt"
        run_child(CHILD, path, env={"QLA_VECTOR_REGISTERS": on})
        runs[on] = torch.load(path)
    for spec, on in runs["1"].items():
        off = runs["0"][spec]
        assert on["copies"] > off["copies"], spec  # (vector fragments the switch adds)
        assert torch.equal(on["o"], off["o"]) and torch.equal(on["final"], off["final"]), spec
        for n, g in on["grads"].items():
            assert torch.equal(g, off["grads"][n]), (spec, n)
            assert rel_err(g, on["grads_ref"][n]) <= 2e-2, (spec, n)
        assert rel_err(on["o"], on["o_ref"]) <= 1e-2, spec
