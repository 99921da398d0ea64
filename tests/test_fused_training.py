"""The fused training forward (Program.fused_training_program; the launch policy's fused_training,
QLA_FUSED_TRAINING=1) on the CPU: a training step whose forward is the prep and the one fused,
warp-specialised kernel, its output role storing the entering states and v_new the chain hands it,
then the backward as after the separate kernels. Every kernel runs in the emulator (the fused one
through the role interpreter, which checks every wait and arrival); gradients against autograd
through the spec's float64 recurrence, and against the same step through the separate kernels."""
import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.errors import PassError
from qla_compiler.kernels import forward as fwd
from qla_compiler.passes.lower_tilelang import ShapeClass, lower
from qla_compiler.passes.pipeline import _check_stores
from qla_compiler.precompile import _program, shape_classes
from qla_compiler.testing import random_inputs, rel_err

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"]
DELTA = ("gdn", "delta_net")  # (fold_wy: their chains form v_new from T, the separate kernels from W and U)


def _step(op, args, fused_training: bool, block_v: int = 32):
    with fwd.launch_policy(fused=True, fused_training=fused_training):
        return emulated_step(op, args, block_v=block_v)


@pytest.fixture(scope="module")
def steps():
    """Per spec: the op, its inputs (a 1-token sequence, partial last chunks, an initial state),
    the step with the fused training forward and the step with the separate kernels."""
    out = {}
    for spec in SPECS:
        op = qla_compiler.compile(spec, target="sm90")
        args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                             dtype=torch.bfloat16)
        out[spec] = (op, args, _step(op, args, True), _step(op, args, False))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_a_training_step_through_the_fused_kernel_matches_autograd(steps, spec):
    """The forward is the prep (where the spec has one) and the fused kernel, no scan or out
    kernel; the backward's kernels follow unchanged. o, the final state, every gradient and d h0
    as the reference's to bf16 (the stored states and v_new are bf16, as the separate kernels
    store them), and as the separate kernels' step gives them."""
    op, args, step, separate = steps[spec]
    names = [n for n, _ in step["emulator"].calls]
    forward = names[:names.index(next(n for n in names if "backward" in n))]
    assert forward == ([] if spec in ("retnet", "linear_attn") else [f"{spec}_prep"]) + [f"{spec}_fused"]
    backward = [k.name for k in op.program.backward_program.kernels.kernels]
    assert names[len(forward):] == backward == [n for n, _ in separate["emulator"].calls if "backward" in n]
    ref = reference_step(op, args, step)
    assert rel_err(step["o"], ref["o"]) <= 1e-2 and rel_err(step["final"], ref["final"]) <= 1e-2
    # a state or v_new stored for the wrong chunk, slot or rows is O(1) off in d q, d k or d g
    for name in op.input_names:
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, name
        assert rel_err(step["grads"][name], separate["grads"][name]) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2


@pytest.mark.parametrize("spec", SPECS)
def test_the_fused_kernel_stores_what_the_scan_stores(steps, spec):
    """The entering state of every chunk (at its slot, chunk_offsets[n] + c) and the undecayed
    v_new rows (the partial last chunk's valid rows only: the rows after it are the next
    sequence's). Where the chain is the scan's own (no fold_wy) they are the separate scan's bit
    for bit; the delta rule's come from T instead of bf16 W and U, and agree to bf16."""
    op, _, step, separate = steps[spec]
    fused = step["emulator"].seen[f"{spec}_fused"]
    scan = separate["emulator"].seen[f"{spec}_scan"]
    stored = [n for n in ("S0_chunks", "v_new_rows") if n in scan]
    assert stored == (["S0_chunks", "v_new_rows"] if spec in DELTA else ["S0_chunks"])
    for name in stored:
        if spec in DELTA:
            assert rel_err(fused[name].double(), scan[name].double()) <= 1e-2, name
        else:
            assert torch.equal(fused[name], scan[name]), name


def test_the_wide_kernel_trains_too():
    """At V-block 128 (the chain cut into a state role and a value role) the output role stores
    the hand-overs it reads, as the narrow kernel's does."""
    op = qla_compiler.compile("gdn", target="sm90")
    args = random_inputs(op, T=200, H=1, HV=2, K=128, V=128, cu_seqlens=[0, 1, 130, 200], initial_state=True,
                         dtype=torch.bfloat16, seed=4)
    step = _step(op, args, True, block_v=128)
    kernel = step["emulator"].programs[0].kernels.kernels[-1]
    assert [r.name for r in kernel.warp_roles] == ["state", "value", "output", "loads"]
    assert step["emulator"].shapes[0].BV == 128
    ref = reference_step(op, args, step)
    assert rel_err(step["o"], ref["o"]) <= 1e-2 and rel_err(step["final"], ref["final"]) <= 1e-2
    for name in op.input_names:
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2


def test_the_output_role_stores_each_hand_over_after_waiting_for_it():
    """The KernelIR says where the stores are (the output role, right after the wait on the ring
    copy they read), the prep stores T_r beside T, and the lowering emits the chunk's state slot."""
    prog = qla_compiler.compile_spec("gdn").fused_training_program
    prep, fused = prog.kernels.kernels
    assert {p.name for p in prep.params if p.role == "out"} == {"g_cum", "T_r_rows", "T_rows"}
    assert "stored for another program, fused or not: S0 v_new" in str(prog.stage("partition"))
    output = next(r for r in fused.warp_roles if r.name == "output")
    body = [(s.op, s.dst) for s in output.body]
    for wait, store in ((("wait", "state_s_full"), ("store_chunk_state", "S0_chunks")),
                        (("wait", "v_new_s_full"), ("store", "v_new_rows"))):
        assert body.index(store) == body.index(wait) + 1
    src = lower(prog.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=64))
    text = src[src.index("def gdn_fused"):]
    assert "i_slot = chunk_offsets[i_n] + i_c" in text and "S0_chunks[i_slot, i_hv, 0:K, v0:v0 + BV]" in text
    # inference is unchanged: nothing stored but o and the final state
    inference = qla_compiler.compile_spec("gdn").fused_program.kernels.kernels[-1]
    assert [p.name for p in inference.params if p.role == "out"] == ["o", "final_state"]


def test_a_fused_training_forward_that_misses_a_tensor_the_backward_loads_is_refused():
    """The inference kernels store neither T_r nor the states: as a training forward they are
    refused, naming the first tensor the backward would not find."""
    program = qla_compiler.compile_spec("gdn")
    missing = r"the backward loads T_r_rows \(io, from gdn_prep\); the fused forward does not store it"
    with pytest.raises(PassError, match=missing):
        _check_stores(program.training_program.kernels, program.fused_program.kernels,
                      program.backward_program.kernels)


def test_per_key_gates_train_through_their_separate_kernels():
    """GLA's backward reads its entering states in float32 (its gate's gradient), which the fused
    kernel does not hand over (the schedule refuses it, from the state's `stored` attribute); KDA's
    fused kernel does not fit in shared memory at K = V = 128. Both train through their separate
    kernels whatever the policy."""
    from qla_compiler.errors import NotFusable

    for spec, why in (("gla", "the entering states are kept in float32"),
                      ("kda", r"need \d+ KB of shared memory at V-block 32, over the \d+ KB budget")):
        program = qla_compiler.compile_spec(spec)
        with pytest.raises(NotFusable, match=why):
            program.fused_training_program
        assert fwd.fused_or_not(program, training=True) is program.training_program


def test_precompile_follows_the_policy_for_training():
    """qla-compile --precompile and warmup(training=True) compile what a training call runs: by
    default (fused_training on) the fused training forward at the fused kernel's V-block; with it
    off, the separate training kernels."""
    kw = dict(n_seqs=8, training=True, sms=132, context_parallel=1, state=None)
    with fwd.launch_policy(fused_training=False):
        off = [c for c in shape_classes("gdn", 16, 64, 128, **kw) if c.part == "training"]
    assert [(c.fused, c.shape.BV) for c in off] == [("", 64)]
    (on,) = [c for c in shape_classes("gdn", 16, 64, 128, **kw) if c.part == "training"]
    assert (on.fused, on.shape.BV) == ("wide", 128)
    assert [k.name for k in _program(on).kernels.kernels] == ["gdn_prep", "gdn_fused"]


def test_cli_emits_the_fused_training_forward(capsys, tmp_path):
    from qla_compiler.cli import main

    assert main(["gdn", "--emit", "kernel", "--fused", "--training", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernel gdn_fused" in out and "S0_chunks = store_chunk_state state_s" in out and "kernel gdn_scan" not in out
    assert (tmp_path / "gdn.training.fused.kernel.txt").exists()


@pytest.mark.parametrize("case", ["strong decay", "no decay", "identical keys"])
def test_real_data_inputs_round_as_the_separate_kernels_do(case):
    """Every buffer rounded to bf16 as on the GPU (KernelEmulator's rounding): on strong decay
    (g = −16), no decay (g = 0, the states grow over the sequence) and runs of identical keys with
    β near 1 (repeated tokens), the fused training forward's o, final state and gradients are no
    further from the float64 reference than the separate kernels' (1.5× + 1e-4), and ≤ 2e-2."""
    op = qla_compiler.compile("gdn", target="sm90")
    gate = {"strong decay": -16.0, "no decay": 0.0}.get(case)
    args = random_inputs(op, T=260, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 1, 130, 260], initial_state=True,
                         dtype=torch.bfloat16, gate=gate, beta=0.99 if case == "identical keys" else None, seed=6)
    if case == "identical keys":  # runs of 8 copies of one key
        args["k"] = args["k"][:, ::8].repeat_interleave(8, dim=1)[:, :260].contiguous()
    got = {}
    for fused in (True, False):
        with fwd.launch_policy(fused=True, fused_training=fused):
            got[fused] = emulated_step(op, args, rounding=torch.bfloat16)
    expected = reference_step(op, args, got[True])
    pairs = [(key, key, expected[key]) for key in ("o", "final", "d_h0")]
    for what, key, ref in pairs + [(n, n, expected["grads"][n]) for n in op.input_names]:
        ours, sep = [(s[key] if key in s else s["grads"][key]) for s in (got[True], got[False])]
        err, err_sep = rel_err(ours, ref), rel_err(sep, ref)
        assert err <= 2e-2 and err <= 1.5 * err_sep + 1e-4, (what, err, err_sep)


@pytest.mark.parametrize("case", ["empty sequences", "dense B=2", "float16", "K = 100, V = 60"])
def test_layouts_train_as_through_the_separate_kernels(case):
    """Empty sequences (no chunk: nothing stored for them), a dense batch, float16 io and head dims
    in wider tiles: the fused training forward's step gives the separate kernels' o and gradients
    to the io dtype's rounding (one is not the other's rounding: the delta rule's v_new comes from
    T, not W and U)."""
    op = qla_compiler.compile("gdn", target="sm90")
    kw = {"empty sequences": dict(T=200, cu_seqlens=[0, 0, 1, 1, 200, 200]), "dense B=2": dict(B=2, T=150),
          "float16": dict(T=200, cu_seqlens=[0, 70, 200], dtype=torch.float16),
          "K = 100, V = 60": dict(T=200, cu_seqlens=[0, 70, 200], K=100, V=60)}[case]
    kw = {"K": 64, "V": 64, "dtype": torch.bfloat16, **kw}
    args = random_inputs(op, H=1, HV=2, initial_state=True, **kw)
    block_v = 16 if kw["K"] == 100 else 32
    fused, separate = (_step(op, args, f, block_v=block_v) for f in (True, False))
    assert "gdn_fused" in [n for n, _ in fused["emulator"].calls]
    assert rel_err(fused["o"], separate["o"]) <= 1e-2 and rel_err(fused["d_h0"], separate["d_h0"]) <= 1e-2
    for name in op.input_names:
        assert rel_err(fused["grads"][name], separate["grads"][name]) <= 1e-2, name
