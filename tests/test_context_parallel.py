"""Context parallelism: the affine state map derived from the chunk program (passes/affine.py), and
the segment-parallel schedule (qla_compiler/context_parallel.py), here with the interpreter as the
scan backend, against the spec's reference (float64, exact)."""
import pytest
import torch

import qla_compiler
from conftest import SPECS
from qla_compiler.errors import PassError
from qla_compiler.ir.chunk_interp import run_all_chunks
from qla_compiler.context_parallel import segment_bounds
from qla_compiler.passes.affine import derive_affine
from qla_compiler.testing import random_inputs, rel_err


@pytest.mark.parametrize("segments", [1, 2, 3, 8])
@pytest.mark.parametrize("spec", SPECS)
def test_context_parallel_matches_reference(ops, spec, segments):
    op = ops[spec]
    args = random_inputs(op, T=400, H=1, HV=2, K=8, V=6, cu_seqlens=[0, 1, 300, 330, 400],
                         initial_state=True, seed=segments)
    o, S = op(**args, context_parallel=segments)
    o_ref, S_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


@pytest.mark.parametrize("spec", ["gdn", "simple_gla", "gla", "kda"])
def test_context_parallel_under_strong_decay(ops, spec):
    args = random_inputs(ops[spec], T=330, H=2, HV=4, K=8, V=8, gate=-16.0, initial_state=True)
    o, S = ops[spec](**args, context_parallel=3)
    o_ref, S_ref = ops[spec].reference(**args)
    assert torch.isfinite(o).all() and rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


def test_gdn_affine_map_is_math_md(ops):
    """M = Γ_C (I − Kᵀ T_r diag(β) K) for a full GDN chunk (MATH.md), H = the state from zero."""
    torch.manual_seed(0)
    C, K, V = 64, 8, 5
    k = torch.nn.functional.normalize(torch.randn(C, K, dtype=torch.float64), dim=-1)
    v = torch.randn(C, V, dtype=torch.float64)
    g = -torch.rand(C, dtype=torch.float64) * 0.1
    beta = torch.rand(C, dtype=torch.float64)
    aff = derive_affine(qla_compiler.compile_spec("gdn").chunk)
    blocks = {"k": k.view(1, 1, 1, C, K), "v": v.view(1, 1, 1, C, V), "g": g.view(1, 1, 1, C),
              "beta": beta.view(1, 1, 1, C)}
    out = run_all_chunks(aff, blocks, torch.tensor([[C]]), {}, {}, torch.zeros(1, 1, 1, K, V, dtype=torch.float64))
    T_r = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + torch.tril(beta[:, None] * (k @ k.T), -1))
    M = torch.exp(g.sum()) * (torch.eye(K, dtype=torch.float64) - k.T @ T_r @ torch.diag(beta) @ k)
    assert rel_err(out["M"][0, 0, 0], M) <= 1e-12
    # affine: S_next(S0) = M S0 + H for the chunk program itself
    S0 = torch.randn(K, V, dtype=torch.float64)
    chunk = qla_compiler.compile_spec("gdn").chunk.copy()
    chunk.outputs = {"S_next": chunk.next_state}
    fwd = run_all_chunks(chunk, {**blocks, "q": torch.zeros(1, 1, 1, C, K, dtype=torch.float64)},
                         torch.tensor([[C]]), {"scale": 1.0}, {}, S0.view(1, 1, 1, K, V))
    S_next = fwd["S_next"][0, 0, 0]
    assert rel_err(S_next, out["M"][0, 0, 0] @ S0 + out["H"][0, 0, 0]) <= 1e-12


def test_affine_programs_are_state_free_and_print(ops):
    for spec in SPECS:
        aff = ops[spec].program.affine
        assert aff.state_in is None and set(aff.outputs) == {"M", "H"}
        assert str(aff).startswith(f"chunk_program {spec}_affine")
    lin = ops["linear_attn"].program.affine  # S_next = S0 + Kᵀ V: M is the identity itself
    assert lin.node(lin.outputs["M"]).op == "eye"


def test_not_affine_is_refused(ops):
    bad = ops["linear_attn"].program.chunk.copy()
    s0 = bad.state_in
    sq = bad.add("S_sq", "matmul", s0, s0, ta=True)  # Sᵀ S: quadratic in the state
    bad.next_state = bad.add("S_bad", "matmul", s0, sq)
    with pytest.raises(PassError, match="not affine in the state"):
        derive_affine(bad)


def test_segment_bounds_cut_whole_chunks():
    cu = torch.tensor([0, 1, 300, 330])
    got = segment_bounds(cu, 3, 64).tolist()
    # 1 token: one segment and two empty ones; 299 tokens = 5 chunks: 2 + 2 + 1; 30 tokens: 1 chunk
    assert got == [0, 1, 1, 1, 129, 257, 300, 330, 330, 330]


def test_widened_scan_gives_the_affine_map(ops):
    """Scanning [0 | v] from [I | 0] ends in [M | H]: the same M as the derived affine program."""
    op = ops["gdn"]
    args = random_inputs(op, T=64, H=1, HV=1, K=4, V=3, seed=7)
    k, v, g, beta = (args[n] for n in ("k", "v", "g", "beta"))
    eye = torch.eye(4, dtype=torch.float64).view(1, 1, 4, 4)
    start = torch.cat([eye, torch.zeros(1, 1, 4, 3, dtype=torch.float64)], -1)
    wide = torch.cat([torch.zeros(1, 64, 1, 4, dtype=torch.float64), v], -1)
    _, maps = op(args["q"], k, wide, g, beta, initial_state=start, output_final_state=True)
    aff = run_all_chunks(op.program.affine, {"k": k.view(1, 1, 1, 64, 4), "v": v.view(1, 1, 1, 64, 3),
                                             "g": g.view(1, 1, 1, 64), "beta": beta.view(1, 1, 1, 64)},
                         torch.tensor([[64]]), {}, {}, torch.zeros(1, 1, 1, 4, 3, dtype=torch.float64))
    assert rel_err(maps[0, 0, :, :4], aff["M"][0, 0, 0]) <= 1e-12
    assert rel_err(maps[0, 0, :, 4:], aff["H"][0, 0, 0]) <= 1e-12


def test_gradients_through_context_parallel(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=200, H=1, HV=2, K=4, V=4, cu_seqlens=[0, 130, 200], initial_state=True)
    leaves = {n: args[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    grads = []
    for cp in (None, 2):
        o, S = op(**{**args, **leaves}, context_parallel=cp)
        grads.append(torch.autograd.grad((o.sum() + S.square().sum()), list(leaves.values())))
    for a, b in zip(*grads):
        assert rel_err(b, a) <= 1e-10


def test_context_parallel_is_checked(ops):
    args = random_inputs(ops["gdn"], T=10, K=4, V=4)
    for bad in (-1, 0, True, 2.0):
        with pytest.raises(ValueError, match='context_parallel: expected None, "auto" or a positive number of segments'):
            ops["gdn"](**args, context_parallel=bad)


def test_auto_is_the_gpu_planners_and_exact_on_the_interpreter(ops):
    """context_parallel="auto" lets the GPU kernels' planner choose (kernels/cp_plan.py); the
    interpreter runs the whole sequences, exactly."""
    op = ops["gdn"]
    args = random_inputs(op, T=200, H=1, HV=2, K=4, V=4, cu_seqlens=[0, 130, 200], initial_state=True)
    o, S = op(**args, context_parallel="auto")
    o_ref, S_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


def test_one_segment_is_no_cut(ops, monkeypatch):
    """context_parallel=1 is no cut, on the interpreter the same call as the default: nothing is
    cut or walked by segments (it once ran the segments' machinery for one segment, a scan and a
    window search for nothing)."""
    from qla_compiler import op as op_module

    def refuse(*a, **k):
        raise AssertionError("run_segments called for one segment")
    monkeypatch.setattr(op_module, "run_segments", refuse)
    op = ops["gdn"]
    args = random_inputs(op, T=90, H=1, HV=2, K=4, V=4, cu_seqlens=[0, 70, 90], initial_state=True)
    o1, S1 = op(**args, context_parallel=1)
    o, S = op(**args)
    assert torch.equal(o1, o) and torch.equal(S1, S)
