"""The token step (op.recurrent, passes/token_step.py): against the spec's float64 recurrence for
every shipped spec and on the inputs real data has, the state pools' semantics (slots, padding
entries, in place, speculative decoding), clear errors, and the generated kernel compiling for
sm_90a. On the CPU it runs the KernelIR interpreter in the kernel's place, through the same host
code the GPU runs (kernels/token_step.py)."""
import shutil

import pytest
import torch

import qla_compiler
from qla_compiler.cli import main
from qla_compiler.kernels.runtime import lower_to_cuda
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.testing import random_inputs, rel_err

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "gla", "kda"]
TOL = 1e-10  # float64 inputs: the interpreter and the recurrence differ only by rounding order


def _inputs(op, cu, seed=0, **kw):
    args = random_inputs(op, T=cu[-1], H=2, HV=4, K=16, V=8, cu_seqlens=cu, initial_state=True, seed=seed, **kw)
    return args


@pytest.mark.parametrize("spec", SPECS)
def test_each_spec_matches_its_recurrence(ops, spec):
    """Packed sequences of 1, 5, 0 and 3 tokens, grouped value heads, an initial state."""
    op = ops[spec]
    args = _inputs(op, [0, 1, 6, 6, 9])
    o, final = op.recurrent(**args)
    o_ref, final_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= TOL and rel_err(final, final_ref) <= TOL
    assert torch.equal(final[2], args["initial_state"][2])  # an empty sequence keeps its state


@pytest.mark.parametrize("case", ["strong decay", "g = 0", "reset", "beta 0 and 1", "identical keys", "bf16"])
def test_real_data_inputs(ops, case):
    op = ops["gdn"]
    args = _inputs(op, [0, 7, 40], seed=3)
    if case == "strong decay":
        args["g"].fill_(-16.0)
    elif case == "g = 0":
        args["g"].zero_()
    elif case == "reset":
        args["g"][0, 20] = float("-inf")
    elif case == "beta 0 and 1":
        args["beta"][0, ::2] = 0.0
        args["beta"][0, 1::2] = 1.0
    elif case == "identical keys":
        args["k"][:] = args["k"][0, 0]
    tol = TOL
    if case == "bf16":
        args = {n: (x.to(torch.bfloat16) if n in ("q", "k", "v") else x) for n, x in args.items()}
        tol = 2e-2  # o is stored in bf16
    o, final = op.recurrent(**args)
    o_ref, final_ref = op.reference(**args)
    assert not torch.isnan(o).any() and not torch.isnan(final).any()
    assert rel_err(o, o_ref) <= tol and rel_err(final, final_ref) <= max(tol, 1e-6)


def _decode_batch(op, N=5, slots=9, seed=1):
    """One token per sequence, a pool of `slots` states."""
    args = random_inputs(op, T=N, H=2, HV=4, K=16, V=8, cu_seqlens=list(range(N + 1)), seed=seed)
    del args["output_final_state"]
    pool = torch.randn(slots, 4, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return args, pool


def test_pool_in_place_touches_only_the_named_slots(ops):
    """Sequences read and write slots 7, 2, (padding), 0, 5; the other slots stay bitwise the
    same, and the padding entry reads and writes nothing (its o is zero: the kernel's, o is
    allocated with NaN in it here)."""
    from qla_compiler.kernels.forward import launch_policy

    op = ops["gdn"]
    args, pool = _decode_batch(op)
    before = pool.clone()
    idx = torch.tensor([7, 2, -1, 0, 5])
    with launch_policy(poison=float("nan")):
        o, returned = op.recurrent(**args, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
                                   output_final_state=True)
    assert returned is pool
    for n, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(o[0, n], torch.zeros_like(o[0, n]))
            continue
        one = {k: (v[:, n:n + 1] if k in op.input_names else v) for k, v in args.items() if k != "cu_seqlens"}
        o_ref, s_ref = op.reference(**one, initial_state=before[slot:slot + 1], output_final_state=True)
        assert rel_err(o[:, n:n + 1], o_ref) <= TOL and rel_err(pool[slot], s_ref[0]) <= TOL
    untouched = [s for s in range(len(pool)) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_pool_read_without_writing_back(ops):
    """Without inplace_final_state the pool is only read; the final states come back per sequence."""
    op = ops["gdn"]
    args, pool = _decode_batch(op)
    before = pool.clone()
    idx = torch.tensor([3, 3, 8, -4, 1])
    o, final = op.recurrent(**args, initial_state=pool, ssm_state_indices=idx, output_final_state=True)
    assert torch.equal(pool, before) and final.shape == (5, 4, 16, 8)
    o_ref, s_ref = op.reference(**args, initial_state=pool[idx.clamp(min=0)], output_final_state=True)
    real = idx >= 0
    assert rel_err(o[0, real], o_ref[0, real]) <= TOL and rel_err(final[real], s_ref[real]) <= TOL
    assert torch.equal(final[~real], torch.zeros_like(final[~real]))


def test_bf16_pool(ops):
    op = ops["gdn"]
    args, pool = _decode_batch(op)
    pool = pool.to(torch.bfloat16)
    idx = torch.tensor([0, 1, 2, 3, 4])
    start = pool[:5].clone()
    o, _ = op.recurrent(**args, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    o_ref, s_ref = op.reference(**args, initial_state=start.double(), output_final_state=True)
    assert pool.dtype == torch.bfloat16
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(pool[:5], s_ref) <= 1e-2  # the pool's own rounding


def test_speculative_decoding_matches_a_token_loop(ops):
    """ssm_state_indices [N, T_max]: the step starts from slot [n, accepted − 1] and keeps the
    state after each token t in slot [n, t]; checked against the recurrence run one token at a time."""
    op = ops["gdn"]
    cu = [0, 3, 4, 7]
    args = random_inputs(op, T=7, H=2, HV=4, K=16, V=8, cu_seqlens=cu, seed=5)
    del args["output_final_state"]
    pool = torch.randn(12, 4, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    before = pool.clone()
    idx = torch.tensor([[1, 2, 3], [4, 5, -1], [6, 7, 8]])
    accepted = torch.tensor([2, 1, 1])
    o, _ = op.recurrent(**args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=accepted,
                        inplace_final_state=True)
    expect = before.clone()
    for n in range(3):
        state = before[int(idx[n, accepted[n] - 1])][None]
        for t in range(cu[n + 1] - cu[n]):
            tok = cu[n] + t
            one = {k: (v[:, tok:tok + 1] if k in op.input_names else v) for k, v in args.items() if k != "cu_seqlens"}
            o_ref, state = op.reference(**one, initial_state=state, output_final_state=True)
            assert rel_err(o[:, tok:tok + 1], o_ref) <= TOL
            if idx[n, t] >= 0:
                expect[int(idx[n, t])] = state[0]
    assert rel_err(pool, expect) <= TOL
    assert torch.equal(pool[[0, 9, 10, 11]], before[[0, 9, 10, 11]])


@pytest.mark.parametrize("call, message", [
    (dict(ssm_state_indices=torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])), "ssm_state_indices: expected an int32/int64"),
    (dict(ssm_state_indices=torch.tensor([0, 1])), "ssm_state_indices: expected 5 rows"),
    (dict(inplace_final_state=True), "inplace_final_state: needs ssm_state_indices"),
    (dict(ssm_state_indices=torch.zeros(5, 2, dtype=torch.long)), "inplace_final_state: speculative decoding"),
    (dict(num_accepted_tokens=torch.ones(5, dtype=torch.long)), "num_accepted_tokens: only with"),
    (dict(ssm_state_indices=torch.tensor([0, 1, 9, 2, 3])), "ssm_state_indices: slot 9 is past the pool's 9 slots"),
])
def test_bad_pool_arguments_are_named(ops, call, message):
    op = ops["gdn"]
    args, pool = _decode_batch(op)
    with pytest.raises(ValueError, match=message):
        op.recurrent(**args, initial_state=pool, **call)


def test_missing_pool_and_a_pool_with_gradients_are_refused(ops):
    op = ops["gdn"]
    args, pool = _decode_batch(op)
    with pytest.raises(ValueError, match="initial_state: ssm_state_indices names slots"):
        op.recurrent(**args, ssm_state_indices=torch.arange(5))
    with pytest.raises(ValueError, match="initial_state: expected 5 states \\(one per sequence\\) without ssm_state_indices"):
        op.recurrent(**args, initial_state=pool)
    args["q"].requires_grad_()
    with pytest.raises(ValueError, match="a state pool .* takes no gradients"):
        op.recurrent(**args, initial_state=pool, ssm_state_indices=torch.arange(5), inplace_final_state=True)


def test_fla_fused_recurrent_conventions(ops):
    """What FLA's own test_fused_recurrent passes its op (tests/ops/test_gdn.py): q, k in float32
    beside bf16 values and β, use_qk_l2norm_in_kernel, and every input requiring gradients. The
    keys are normalised in float32 and rounded to the values' dtype (what FLA's reference does to
    them); the call runs the chunk op and is differentiable: the gradients are autograd's through
    the float64 reference on the same rounded keys. (Before, mixed dtypes and inputs that need
    gradients were both refused, so FLA's test could not run against this op.)"""
    op = ops["gdn"]
    args = _inputs(op, [0, 1, 6, 6, 40], seed=5)
    leaves = {n: (x.float() if n in ("q", "k") else x.to(torch.bfloat16) if n in ("v", "beta") else x.float())
              for n, x in args.items() if torch.is_tensor(x)}
    call = {n: x.clone().requires_grad_() for n, x in leaves.items() if n != "cu_seqlens"}
    cu = args["cu_seqlens"]
    o, final = op.recurrent(**call, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32 and o.requires_grad
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ((o.double() * d_o).sum() + (final.double() * d_final).sum()).backward()

    ref = {n: x.clone().requires_grad_() for n, x in leaves.items() if n != "cu_seqlens"}
    keys = {n: (ref[n] * torch.rsqrt((ref[n] * ref[n]).sum(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double()
            for n in ("q", "k")}
    o_ref, final_ref = op.reference(**{n: (keys[n] if n in keys else x.double()) for n, x in ref.items()},
                                    cu_seqlens=cu, output_final_state=True)
    ((o_ref * d_o).sum() + (final_ref * d_final).sum()).backward()
    errs = {"o": rel_err(o.detach(), o_ref.detach()), "final": rel_err(final.detach(), final_ref.detach())}
    errs.update({f"d {n}": rel_err(call[n].grad, ref[n].grad) for n in call})
    assert max(errs.values()) <= 1e-2, errs


def test_fla_names_take_keywords():
    from qla_compiler.ops import fused_recurrent_gated_delta_rule, fused_recurrent_simple_gla

    op = qla_compiler.compile("gdn")
    args, _ = _decode_batch(op)
    o, final = fused_recurrent_gated_delta_rule(**args, output_final_state=True)
    assert rel_err(o, op.reference(**args)[0]) <= TOL and final.shape == (5, 4, 16, 8)
    gla = qla_compiler.compile("simple_gla")
    args, _ = _decode_batch(gla)
    assert rel_err(fused_recurrent_simple_gla(**args)[0], gla.reference(**args)[0]) <= TOL


def test_emit_token_step_kernel(capsys):
    assert main(["gdn", "--emit", "kernel", "--token-step"]) == 0
    out = capsys.readouterr().out
    assert "kernel gdn_token_step" in out and "for token in tokens of the sequence:" in out
    # where each state goes is loaded with the inputs, before the arithmetic, and the stores read it
    assert "write_at = load_slot write_slot" in out and "write_at_next = load_slot write_slot ahead=1" in out
    assert "final_at = load_slot final_slot" in out
    assert "state_out = store_state state slot=write_at" in out and "slot=final_at" in out
    assert main(["gdn", "--emit", "kernel", "--token-step", "--backward"]) == 1
    assert "--backward and --token-step: choose one" in capsys.readouterr().err


def test_the_token_step_takes_values_of_any_width(capsys):
    """V is only the token step's grid (blocks of 8 or 16 columns), so it takes GLA's and RetNet's
    V = 512 whole, where the chunk kernels run such a V on blocks of 256 columns; K stays within
    the tiles (a state column lives in one warp's registers)."""
    from qla_compiler.kernels.token_step import check_dims

    check_dims(256, 512)
    check_dims(128, 1000)
    with pytest.raises(ValueError, match="K \\(the key head dim\\) = 512 is not supported"):
        check_dims(512, 128)
    with pytest.raises(ValueError, match="V \\(the value head dim\\) = 8 is not supported"):
        check_dims(128, 8)
    assert main(["gla", "--emit", "kernel", "--token-step", "--shape", "H=4,HV=4,K=256,V=512"]) == 0
    assert "kernel gla_token_step" in capsys.readouterr().out
    assert main(["gla", "--emit", "kernel", "--shape", "H=4,HV=4,K=256,V=512"]) == 1
    assert "V = 512 is not supported by the sm90 kernels" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("spec, K, V, state", [("gdn", 128, 128, "float32"), ("gdn", 128, 128, "bfloat16"),
                                                ("gdn", 100, 100, "bfloat16"), ("gdn", 256, 256, "float32"),
                                                ("kda", 128, 128, "float32"), ("gla", 256, 512, "float32")])
def test_token_step_compiles_for_sm90a_without_spills(spec, K, V, state, tmp_path):
    """(KDA's per-key gate too: its chunk program has no sm90 kernels yet, its token step does.)"""
    from test_lowering import _ptxas_spills

    from qla_compiler.kernels.token_step import V_BLOCKS, shape_class
    from qla_compiler.checks import Dims

    program = qla_compiler.compile_spec(spec).token_step_program
    # both V-blocks; the gates and scalars in float32, both in bf16, and g in float32 beside β in bf16
    f32, bf16 = torch.float32, torch.bfloat16
    for bv, gates, scalars in [(8, f32, f32), (16, f32, f32), (16, bf16, bf16), (8, f32, bf16)]:
        assert bv in V_BLOCKS
        shape = shape_class(Dims(1, 1, 16, 64, K, V, 1), torch.bfloat16, getattr(torch, state), 0.1, 132, BV=bv,
                            read_in=dict(gates=gates, scalars=scalars))
        assert isinstance(shape, ShapeClass) and shape.state == state
        src = "\n".join(lower_to_cuda(program, shape).values())
        assert f"__launch_bounds__({4 * shape.BV}" in src
        spills = _ptxas_spills(src, tmp_path)
        assert len(spills) == 1 and spills[0] == ("0", "0"), (shape.BV, spills)


@pytest.mark.parametrize("spec, K", [("gdn", 128), ("gdn", 100), ("kda", 128), ("retnet", 64)])
def test_a_token_waits_on_no_block_barrier(spec, K):
    """Each warp holds whole columns of the state block (Buffer.warp_columns, in the KernelIR) and
    the token's inputs load into registers, so the sums over K are shuffles inside a warp and a
    token waits on no block barrier, at either V-block. (TileLang's own layout spread K over both
    warps at BV = 16, and each sum went through shared memory: 24 barriers a token.) The inputs
    and the slots the states go to are loaded a token ahead: the first token's beside the state's
    loads, in the prologue."""
    import re

    from qla_compiler.checks import Dims
    from qla_compiler.kernels.token_step import V_BLOCKS, shape_class
    from qla_compiler.passes.token_step import WARP_COLUMNS

    program = qla_compiler.compile_spec(spec).token_step_program
    (kernel,) = program.kernels.kernels
    blocks = [b for b in kernel.buffers if b.shape == ("K", "BV")]
    assert blocks and all(b.warp_columns == WARP_COLUMNS for b in blocks)
    assert all(b.scope == "fragment" for b in kernel.buffers)
    # the first token's inputs loaded with the state, each later one's a token ahead
    loads = [s for s in kernel.prologue if s.op in ("load_token", "load_slot")]
    assert loads and kernel.prologue.index(next(s for s in kernel.prologue if s.op == "load_state")) == len(loads)
    assert {s.srcs for s in kernel.body if s.op in ("load_token", "load_slot") and s.attr.get("ahead") == 1} \
        == {s.srcs for s in loads if s.srcs != ("final_slot",)}
    for bv in V_BLOCKS:
        shape = shape_class(Dims(1, 1, 2, 8, K, K, 1), torch.bfloat16, torch.float32, 0.1, 132, BV=bv)
        src = "\n".join(lower_to_cuda(program, shape).values())
        assert "__syncthreads" not in src and "bar.sync" not in src, bv
        # the first token's loads, then the state's, both before the loop over tokens
        kernel_src = src[src.index("__global__ void __launch_bounds__"):]
        first_load, state_load, loop = (kernel_src.index(x) for x in ("= k[", "state_pool + ", "for (int t = 0"))
        assert first_load < state_load < loop, (bv, first_load, state_load, loop)
        # and where the states go, before the loop: no slot read between a token's arithmetic and its store
        assert kernel_src.index("final_slot[") < loop and kernel_src.index("write_slot[") < loop, bv
        sums = re.findall(r"AllReduce<tl::SumOp, (\d+),", src)
        assert sums and set(sums) == {"32"}, (bv, sums)  # (a butterfly of 32 lanes or fewer: shuffles)
        assert f"__launch_bounds__({32 * bv // WARP_COLUMNS}" in src


def test_l2norm_in_kernel_as_the_chunk_op_does_it(ops):
    """FLA's x·rsqrt(Σx² + 1e-6), as the chunk op and the reference normalise: keys of norm 1e-3
    tell it from x / max(‖x‖, ε)."""
    op = ops["gdn"]
    args = _inputs(op, [0, 3, 9])
    args["q"], args["k"] = args["q"] * 1e-3, args["k"] * 1e-3
    o, final = op.recurrent(**args, use_qk_l2norm_in_kernel=True)
    o_ref, final_ref = op.reference(**args, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(final, final_ref) <= TOL


def test_a_pool_view_is_read_as_it_is(ops):
    """A pool only read (not in place) may be a strided view: the kernel gets a dense copy."""
    op = ops["gdn"]
    args, pool = _decode_batch(op)
    view = torch.randn(8, 16, 4, 9, dtype=torch.float64).permute(3, 2, 1, 0)  # [9, 4, 16, 8], strided
    assert not view.is_contiguous()
    idx = torch.tensor([3, 0, 8, 1, 5])
    o, final = op.recurrent(**args, initial_state=view, ssm_state_indices=idx, output_final_state=True)
    o_ref, s_ref = op.reference(**args, initial_state=view[idx].contiguous(), output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(final, s_ref) <= TOL


# session 30's sweep on the H200 (132 SMs; benchmarks/token_step_bv.py, NOTES.md): the fastest of
# V-blocks 8, 16 and 32 on each row, GDN at K = V = 128, one call's GPU time
MEASURED_FASTEST = {"16/64:1x1": 16, "16/64:32x1": 16, "16/64:256x1": 16, "2/8:1x1": 8, "2/8:32x1": 16,
                    "2/8:256x1": 16, "16/64:256x2": 16, "16/64:256x4": 8, "16/64:256x8": 8, "16/64:256x16": 8}


def test_the_launch_rule_picks_the_measured_fastest_v_block():
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels.token_step import block_v

    for row, fastest in MEASURED_FASTEST.items():
        H, HV, lens = parse_row(row)
        assert block_v(128, HV, len(lens), sum(lens), 132) == fastest, row


def test_a_state_store_takes_its_slot_from_a_loaded_slot():
    """The token step's stores read where each state goes from an int32 [1] fragment that a
    load_slot filled beside the token's inputs; the verifier refuses a store whose slot names
    anything else (a pool tensor read at the store would put a memory latency after the
    arithmetic) and a load_slot from a tensor that is not an int32 [N] or [N, L] input."""
    import dataclasses

    from qla_compiler.ir.kernel import Stmt

    (kernel,) = qla_compiler.compile_spec("gdn").token_step_program.kernels.kernels
    kernel.verify()
    bad_store = [Stmt("store_state", "state_out", ("state",), (("slot", "final_slot"),))]
    with pytest.raises(ValueError, match="takes its slot from no int32"):
        dataclasses.replace(kernel, epilogue=bad_store).verify()
    bad_load = [Stmt("load_slot", "final_at", ("cu_seqlens",)), *kernel.prologue[1:]]
    with pytest.raises(ValueError, match="loads a slot from no int32"):
        dataclasses.replace(kernel, prologue=bad_load).verify()
