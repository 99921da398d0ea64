"""The GPU backward's host side (kernels/backward.py) on the CPU, with every kernel of the forward
and of the backward program emulated in float64 (qla_compiler/emulate.py): the backward's
partition and schedule, the tensors the forward keeps for it, the reverse scan, the sums over
value-head groups. Gradients against torch autograd through the spec's float64 recurrence."""
import os
import subprocess
import sys

import pytest
import torch

from qla_compiler.emulate import emulated_kernel_step, emulated_kernels, emulated_step, reference_step
from qla_compiler.errors import PassError
from qla_compiler.passes.lower_tilelang import tile_width
from qla_compiler.testing import OpLog, random_inputs, rel_err


@pytest.mark.parametrize("cp", [None, 3])
@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_backward_wiring_matches_autograd_of_the_reference(ops, spec, cp):
    """cp: both scans context-parallel; the backward's reverse scan chains its segments last to
    first, on the widened [0 | dO] and the like, as the forward's does on [0 | v]."""
    op = ops[spec]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args, segments=cp)
    grads = step["grads"]

    ref = reference_step(op, args, step)
    # each backward kernel once, in order; with cp the reverse scan twice (on the widened values
    # first, walking the segments' windows)
    names = [n for k in op.program.backward_program.kernels.kernels
             for n in ([f"{k.name}_windows", k.name] if cp and k.loop else [k.name])]
    if cp:
        assert [w for n, w in step["emulator"].calls[-len(names):] if "_scan" in n] == [128, 64]
    assert [n for n, _ in step["emulator"].calls[-len(names):]] == names
    # the tensors between kernels are bf16 (W, U, the states, v_new, dv_new): ~2e-3 here; a wiring
    # mistake is O(1)
    for name in op.input_names:
        assert grads[name].shape == args[name].shape, name
        assert rel_err(grads[name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2


def test_kernel_step_carries_gradients_through_autograd(ops):
    """qla::run_kernels (the GPU path as a custom op with autograd) with emulated kernels, inside a torch
    autograd graph: the gradients of a loss reach every input in its own dtype."""
    op = ops["gdn"]
    args = random_inputs(op, T=150, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 70, 150], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_kernel_step(op, args)
    for n, g in step["grads"].items():
        assert g is not None and g.dtype == args[n].dtype, n
        assert rel_err(g, step["grads_ref"][n]) <= 2e-2, n


def test_kernel_step_refuses_an_input_written_in_place_before_backward(ops):
    """What the backward kernels read is saved through save_for_backward: writing an input in place
    between the forward and backward() raises instead of giving silently wrong gradients."""
    op = ops["gdn"]
    args = random_inputs(op, T=70, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 70], initial_state=True,
                         dtype=torch.bfloat16)
    k = args["k"].detach().clone().requires_grad_()
    inputs, dims, scale = op._prepare((), {**{n: args[n] for n in op.input_names}, "k": k}, None,
                                      args["initial_state"], args["cu_seqlens"], False)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale):
        o, final = op._run_kernels(inputs, scale, args["initial_state"], args["cu_seqlens"], None)
        with torch.no_grad():
            k.mul_(2.0)
        with pytest.raises(RuntimeError, match="inplace"):
            (o.float().sum() + final.sum()).backward()


def test_kernel_step_makes_no_cotangent_for_what_it_keeps(ops):
    """What the training forward keeps for its backward (the states entering each chunk, v_new, T,
    the gates' sums) is not differentiable, and backward() fills no zeros for it: at 16/64 heads and
    8 × 4096 tokens those fills were 1.9 GB, 0.58 ms of a 13.9 ms training step (session 19)."""
    op = ops["gdn"]
    args = random_inputs(op, T=70, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 70], initial_state=True,
                         dtype=torch.bfloat16)
    leaves = {n: args[n].detach().clone().requires_grad_() for n in (*op.input_names, "initial_state")}
    inputs, dims, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"],
                                      args["cu_seqlens"], False)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale):
        o, final, kept = torch.ops.qla.run_kernels(op.key, [inputs[n] for n in op.input_names],
                                                   leaves["initial_state"], args["cu_seqlens"], scale, None, True, False)
        assert kept and o.requires_grad and not any(x.requires_grad for x in kept)
        with OpLog() as made:
            torch.autograd.backward([o, final], [torch.ones_like(o), torch.ones_like(final)])
    assert made.ops and not [f for f in made.ops if "zero" in f or "fill" in f], made.ops


@pytest.mark.parametrize("backend", ["kernels", "interpreter"])
def test_a_loss_on_the_final_state_alone(ops, backend):
    """o's cotangent is absent (nothing materialises it): the backward takes it as zero."""
    op = ops["gdn"]
    dtype = torch.bfloat16 if backend == "kernels" else torch.float32
    args = random_inputs(op, T=90, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 20, 90], initial_state=True, dtype=dtype)
    leaves = {n: args[n].detach().clone().requires_grad_() for n in (*op.input_names, "initial_state")}
    inputs, dims, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"],
                                      args["cu_seqlens"], False)
    if backend == "kernels":
        with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale):
            _, final = op._run_kernels(inputs, scale, leaves["initial_state"], args["cu_seqlens"], None)
            final.sum().backward()
    else:
        _, final = op._interpret(inputs, scale, leaves["initial_state"], args["cu_seqlens"])
        final.sum().backward()
    ref = {n: (x.detach().double().requires_grad_() if n in leaves else x) for n, x in args.items()}
    op.reference(**ref)[1].sum().backward()
    assert not leaves["q"].grad.any()  # the final state does not read q
    for n in leaves.keys() - {"q"}:
        assert rel_err(leaves[n].grad, ref[n].grad) <= 2e-2, n


@pytest.mark.parametrize("K, V", [(100, 60), (48, 128), (16, 16)])
def test_head_dims_between_tiles_run_padded_and_match_autograd(ops, K, V):
    """K and V that are not tile widths: the op's tensors keep their own dims (o, the final state,
    every gradient), what only kernels exchange is allocated at the tiles' widths with zero padding
    (Tensor.padded), and the result is the reference's."""
    op = ops["gdn"]
    args = random_inputs(op, T=300, H=2, HV=4, K=K, V=V, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args, block_v=16)
    ref = reference_step(op, args, step)
    assert step["o"].shape == ref["o"].shape and step["final"].shape == ref["final"].shape
    assert rel_err(step["o"], ref["o"]) <= 1e-2 and rel_err(step["final"], ref["final"]) <= 1e-2
    for name in op.input_names:
        assert step["grads"][name].shape == args[name].shape, name
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2
    seen = step["emulator"].seen
    tiles = (tile_width(K), tile_width(V))
    kernels = op.program.kernels.kernels
    padded = {p.name for k in kernels for p in k.params if p.padded}
    assert padded >= {"W_rows", "S0_chunks", "v_new_rows"}
    forward = step["emulator"].programs[0].kernels  # the training forward the call ran (fused or not)
    writer = next(k.name for k in forward.kernels if any(p.name == "S0_chunks" and p.role == "out" for p in k.params))
    S0 = seen[writer]["S0_chunks"]  # the per-chunk states, padding zero
    assert S0.shape[-2:] == tiles and not S0[..., K:, :].any() and not S0[..., :, V:].any()


@pytest.mark.parametrize("K, V, blocks", [(256, 256, [64] * 4), (128, 200, [128, 72])])
def test_backward_on_column_blocks_of_v_matches_autograd(ops, K, V, blocks):
    """Where the backward's kernels do not fit in shared memory at V's tile (K = V = 256: d g's
    needs 354 KB), it runs on column blocks of V (Program.backward_columns), each a problem of
    its own columns: the other inputs' gradients are the blocks' sums, v's and the initial
    state's their columns. A block placed at the wrong columns, or a sum missing a block, is
    O(1) off."""
    op = ops["gdn"]
    args = random_inputs(op, T=130, H=1, HV=2, K=K, V=V, cu_seqlens=[0, 1, 66, 130], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args)
    ref = reference_step(op, args, step)
    for name in op.input_names:
        assert step["grads"][name].shape == args[name].shape, name
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, name
        # a key's gradient leaves in the io dtype, summed over the blocks' float32 partials
        assert step["grads"][name].dtype == args[name].dtype, name
    assert step["d_h0"].shape == args["initial_state"].shape
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2
    calls = step["emulator"].calls
    assert [w for n, w in calls if n.endswith("backward_scan")] == blocks
    walks = {k.name for k in step["emulator"].programs[0].kernels.kernels if k.walks_chunks}
    assert walks and {w for n, w in calls if n in walks} == {V}  # the forward takes V whole


def test_backward_columns_only_where_the_kernels_do_not_fit(ops):
    """At K = V = 128 the backward takes V whole; at K = V = 256 its d g and d β kernels are over
    the shared-memory budget (KernelIR.over_budget, printed), and on 64 columns none is."""
    prog = ops["gdn"].program
    assert prog.backward_columns() == (128, prog)
    wide = prog.scheduled_for((256, 256))
    over = wide.backward_program.kernels.over_budget
    assert "gdn_backward_out_d_g" in over and "over the shared-memory budget" in str(wide.backward_program.kernels)
    width, each = wide.backward_columns()
    assert width == 64 and not each.backward_program.kernels.over_budget
    assert all(k.shared_peak for k in each.backward_program.kernels.kernels if not k.loop)


def _key_gradient_dtypes(program) -> dict:
    kir = program.backward_program
    keys = {r for r, x in kir.chunk.gradient_of.items() if kir.chunk.node(x).attr.get("kind") == "key"}
    return {p.name: p.dtype for k in kir.kernels.kernels for p in k.params if p.role == "out" and p.name in keys}


K_BLOCK_CASES = [(256, 128, [128, 128], None), (200, 96, [128, 72], None), (256, 128, [128, 128], 2)]
# the K-block path runs where an out kernel does not fit whole on any of V's column blocks, and no
# kernel runs on blocks of K's columns (QLA_KEY_BLOCKS=0): the switch is read at import, so a child
K_BLOCK_CHILD = """
import sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_step
from qla_compiler.passes.lower_tilelang import tile_width
from qla_compiler.testing import random_inputs
op = qla_compiler.compile("gla", target="sm90")
out = {{}}
for K, V, keys, segments in {cases!r}:
    args = random_inputs(op, T=130, H=1, HV=2, K=K, V=V, cu_seqlens=[0, 1, 66, 130], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args, segments=segments)
    blocks = op.program.scheduled_for((tile_width(K), tile_width(V))).backward_blocks()
    out[K, V, segments] = dict(args=args, d_o=step["d_o"], d_final=step["d_final"], grads=step["grads"],
                               d_h0=step["d_h0"], calls=[n for n, _ in step["emulator"].calls],
                               keys=blocks[0], values=blocks[1], partial=blocks[2].partial,
                               outs=[k.name for k in blocks[2].backward_program.kernels.kernels if k.kind == "out"],
                               d_v=[p.dtype for k in blocks[2].backward_program.kernels.kernels for p in k.params
                                    if p.role == "out" and p.name == "d_v"])
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def on_blocks_of_k(tmp_path_factory):
    """GLA's training steps of K_BLOCK_CASES as a process with QLA_KEY_BLOCKS=0 runs them."""
    path = tmp_path_factory.mktemp("k_blocks") / "out.pt"
    subprocess.run([sys.executable, "-c", K_BLOCK_CHILD.format(cases=K_BLOCK_CASES), str(path)], check=True,
                   env={**os.environ, "QLA_KEY_BLOCKS": "0"}, timeout=900)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("K, V, keys, segments", K_BLOCK_CASES)
def test_backward_on_blocks_of_k_matches_autograd(ops, on_blocks_of_k, K, V, keys, segments):
    """Without kernels on blocks of K's columns (QLA_KEY_BLOCKS=0), GLA's backward at K = 256 does
    not fit even on V's column blocks (its d g kernel 216 KB at V = 64), but GLA splits over keys
    (passes/key_blocks.py): it runs on blocks of K, each a problem of its own keys, and (with the
    saved states in float32 since session 41, 64 KB more) each block on V's column blocks of 64.
    The keys' and the gates' gradients and the initial state's are the key blocks' side by side,
    v's the sum of their float32 partials, the keys' the sums over V's blocks. A block placed at the
    wrong columns, or a sum missing a block, is O(1) off. Also with both scans context-parallel."""
    op, got = ops["gla"], on_blocks_of_k[K, V, segments]
    args = got["args"]
    ref = reference_step(op, args, got)
    for name in op.input_names:
        assert got["grads"][name].shape == args[name].shape and got["grads"][name].dtype == args[name].dtype, name
        assert rel_err(got["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(got["d_h0"], ref["d_h0"]) <= 1e-2
    # each block of keys runs the block program's out kernels once on each of V's column blocks
    blocks = len(keys) * -(-V // got["values"])
    assert got["outs"] and all(got["calls"].count(n) == blocks for n in got["outs"]), (got["outs"], got["calls"])
    assert (got["keys"], got["values"]) == (128, 64) and set(got["partial"]) == {"key", "value"}
    assert got["d_v"] == ["float32"]


def test_with_key_blocks_glas_backward_takes_k_whole(ops):
    """By default GLA's out kernels at K = 256 fit on blocks of K's columns, so its backward takes K
    whole, and V on column blocks of 128 (its d v kernel at V = 256: 192 KB live at once, 256 KB
    as placed: KernelIR.over_budget). The gradients meet autograd through the float64 recurrence."""
    op = ops["gla"]
    wide = op.program.scheduled_for((256, 256))
    assert "gla_backward_out_d_v" in wide.backward_program.kernels.over_budget
    keys, values, each = wide.backward_blocks()
    assert (keys, values, each.partial) == (256, 128, ("key",))
    assert any(k.key_block for k in each.backward_program.kernels.kernels)
    args = random_inputs(op, T=130, H=1, HV=2, K=256, V=256, cu_seqlens=[0, 1, 66, 130], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args)
    ref = reference_step(op, args, step)
    for name in op.input_names:
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2
    assert [w for n, w in step["emulator"].calls if n == "gla_backward_out_d_v"] == [128, 128]


def test_glas_saved_states_cross_memory_in_float32_for_its_gates_gradient(ops):
    """GLA's d g sums, for each key, S0 ⊙ d S over V (the per-key Γ term): with keys that do not
    decay, both states grow over the whole sequence and the sum is a small difference of large
    products. So the training forward stores the states entering its chunks in float32
    (Program.saved_state_dtype, schedule_build.state_dtype) and the backward reads them so; the
    other specs keep the io dtype. Emulated with the GPU's bf16 rounding, half the keys at g = 0
    over 1000 tokens: d g 1.5e-4 against 1.7e-3 with S0 in bf16 (session 41; on the H100 at 2500
    tokens and K = 128, 1.7e-3 against FLA's 5.9e-4 failed tests/test_gpu_per_key.py)."""
    assert {s: ops[s].program.saved_state_dtype() for s in ("gla", "kda", "gdn", "simple_gla")} == \
        {"gla": "float32", "kda": "io", "gdn": "io", "simple_gla": "io"}
    op = ops["gla"]
    stored = {p.name: p.dtype for k in op.program.training_program.kernels.kernels for p in k.params if p.role == "out"}
    read = {p.name: p.dtype for k in op.program.backward_program.kernels.kernels for p in k.params if p.role == "in"}
    assert stored["S0_chunks"] == read["S0_chunks"] == "float32"
    assert op.program.kernels is not op.program.training_program.kernels  # (inference keeps bf16 states)
    args = random_inputs(op, T=1201, H=1, HV=1, K=64, V=64, cu_seqlens=[0, 1000, 1001, 1201], initial_state=True,
                         dtype=torch.bfloat16, seed=4)
    args["g"] = torch.cat([torch.full_like(args["g"][..., :32], -5.0), torch.zeros_like(args["g"][..., 32:])], -1)
    step = emulated_step(op, args, rounding=torch.bfloat16)
    ref = reference_step(op, args, step)
    assert step["emulator"].seen["gla_backward_out_d_q_d_k_d_g"]["S0_chunks"].dtype == torch.float32
    assert rel_err(step["grads"]["g"], ref["grads"]["g"]) <= 5e-4


@pytest.mark.parametrize("spec, K, V", [("gla", 256, 512), ("gdn", 64, 320)])
def test_values_wider_than_a_tile_run_on_column_blocks(ops, spec, K, V):
    """GLA's and RetNet's standard heads have V = 512, past the kernels' widest tile (256). The
    recurrence never mixes V's columns, so such a call runs as blocks of V, a call each (256 and
    the rest): o, the final state and every gradient (autograd sums q's, k's and g's over the
    blocks) meet the float64 reference, and no kernel runs wider than 256. (GLA at K = 256 also
    takes its backward on blocks of K.)"""
    op = ops[spec]
    args = random_inputs(op, T=70, H=1, HV=2, K=K, V=V, cu_seqlens=[0, 1, 70], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_kernel_step(op, args)
    assert rel_err(step["o"], step["o_ref"]) <= 1e-2 and rel_err(step["final"], step["final_ref"]) <= 1e-2
    for name, g in step["grads"].items():
        assert g.shape == args[name].shape and rel_err(g, step["grads_ref"][name]) <= 1e-2, name
    widths = [w for _, w in step["emulator"].calls]
    assert max(widths) == 256 and V - 256 in widths


@pytest.mark.parametrize("spec", ["gla", "retnet"])
def test_keys_wider_than_a_tile_run_on_blocks_of_k(ops, spec):
    """FLA's GLA tests go to K = 320 and 512, past the kernels' widest tile. Where the program
    splits over keys (passes/key_blocks.py), such a call runs as blocks of K, a call each: o is the
    blocks' sum (rounded once, from float32), the final state their rows, and autograd places the
    keys' gradients and sums v's. All meet the float64 reference, and no kernel runs a K over 256.
    (The delta rule does not split: GDN at K = 320 is refused by the head-dim check.)"""
    op = ops[spec]
    args = random_inputs(op, T=70, H=1, HV=2, K=320, V=64, cu_seqlens=[0, 1, 70], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_kernel_step(op, args)
    assert rel_err(step["o"], step["o_ref"]) <= 1e-2 and rel_err(step["final"], step["final_ref"]) <= 1e-2
    for name, g in step["grads"].items():
        assert g.shape == args[name].shape and rel_err(g, step["grads_ref"][name]) <= 1e-2, name
    keys = {s.K for s in step["emulator"].shapes}
    assert max(keys) == 256 and 64 in keys


def test_a_delta_rule_backward_that_does_not_fit_says_why(ops):
    """KDA at K = V = 192: its backward scan needs 232 KB, and the delta rule's inverse sums over K,
    so blocks of K are no way out: the error says both."""
    with pytest.raises(PassError, match="232 KB.*nor on blocks of K: T = inv_unit_lower\\(A\\), where A sums over K"):
        ops["kda"].program.scheduled_for((192, 192)).backward_blocks()


def test_column_blocks_write_key_gradients_in_float32(ops):
    """A backward on V's column blocks writes its key gradients (d q, d k per value head) in float32:
    the host adds the blocks' partials, and rounding each to bf16 first cost d q 15 % more error than
    FLA's at K = 256, V = 128 (H200, session 16). On V whole they leave in the io dtype."""
    prog = ops["gdn"].program
    whole = _key_gradient_dtypes(prog)
    assert set(whole.values()) == {"io"} and len(whole) == 2
    each = prog.scheduled_for((256, 256)).backward_columns()[1]
    assert each.partial == ("key",)
    assert set(_key_gradient_dtypes(each).values()) == {"float32"} and len(_key_gradient_dtypes(each)) == 2


@pytest.mark.parametrize("spec", ["gdn", "gla"])
def test_a_training_call_after_the_first_walks_no_chunk_program(ops, spec, monkeypatch):
    """The runtime runs no pass: after a first call, a training step on the kernel path (every
    kernel emulated; through the custom op and autograd) and the check the op makes before it
    (Program.backward_unsupported) never walk a chunk program's graph. That check walked the VJP
    twice a call: on the H200 most of a 16/64 × 2048 training step's 4.2 ms of host time
    against 0.87 ms of GPU time (session 27)."""
    from qla_compiler.ir.chunk import ChunkIR

    op = ops[spec]
    args = random_inputs(op, T=70, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 1, 70], initial_state=True,
                         dtype=torch.bfloat16)
    assert op.program.backward_unsupported() is None
    emulated_kernel_step(op, args)

    def walked(self):
        raise AssertionError(f"{self.name}: a chunk program's graph walked by a call")

    monkeypatch.setattr(ChunkIR, "order", walked)
    assert op.program.backward_unsupported() is None
    step = emulated_kernel_step(op, args)
    assert all(g is not None for g in step["grads"].values())
