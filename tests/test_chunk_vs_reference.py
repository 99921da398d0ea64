"""The chunk program, run by the ChunkIR interpreter, against the spec's own recurrence (float64)."""
import pytest
import torch

from conftest import SPECS
from qla_compiler.testing import random_inputs, rel_err

TOL = 1e-10

CASES = {
    # name: keyword arguments for random_inputs
    "T not a multiple of the chunk": dict(T=150),
    "one token": dict(T=1),
    "packed varlen with 1-token sequences": dict(T=200, cu_seqlens=[0, 1, 65, 66, 130, 131, 200]),
    "many short sequences": dict(T=40, cu_seqlens=list(range(0, 41, 5))),
    "grouped value heads": dict(T=90, H=2, HV=6),
    "initial state": dict(T=100, initial_state=True, cu_seqlens=[0, 37, 100]),
    "dense batch": dict(B=3, T=70, initial_state=True),
    "strong decay": dict(T=150, gate=-16.0, initial_state=True),
    "no decay (g = 0)": dict(T=150, gate=0.0, initial_state=True),
    "beta near 0": dict(T=100, beta=1e-4),
    "beta near 1": dict(T=100, beta=1.0 - 1e-4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", SPECS)
def test_chunk_program_matches_recurrence(ops, spec, case):
    op = ops[spec]
    kw = {"H": 1, "HV": 2, "K": 8, "V": 6, "seed": hash(case) % 1000, **CASES[case]}
    args = random_inputs(op, **kw)
    o, state = op(**args)
    o_ref, state_ref = op.reference(**args)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(state, state_ref) <= TOL


@pytest.mark.parametrize("spec", SPECS)
def test_without_initial_state_and_final_state(ops, spec):
    op = ops[spec]
    args = random_inputs(op, T=70, H=1, HV=1, K=8, V=8, seed=5)
    args["output_final_state"] = False
    o, state = op(**args)
    assert state is None
    assert rel_err(o, op.reference(**args)[0]) <= TOL


def test_output_dtypes_follow_fla(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=20, H=1, HV=2, K=8, V=8, dtype=torch.bfloat16, initial_state=True)
    o, state = op(**args)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel_err(o, op.reference(**args)[0]) < 1e-2


def test_qk_l2norm_in_kernel_matches_normalising_first(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=30, H=1, HV=1, K=8, V=8)
    args["q"], args["k"] = args["q"] * 3.0, args["k"] * 0.5
    o, _ = op(**args, use_qk_l2norm_in_kernel=True)
    norm = {n: args[n] / (args[n].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for n in ("q", "k")}
    o_ref, _ = op.reference(**{**args, **norm})
    assert rel_err(o, o_ref) <= TOL


def _saved_bytes(op, args) -> int:
    """Bytes autograd keeps for the backward of op.reference on `args` (every float input a leaf)."""
    leaves = {n: (x.double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
              for n, x in args.items()}
    total = [0]

    def pack(x):
        total[0] += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o, final = op.reference(**leaves)
    assert o.requires_grad and final.requires_grad
    return total[0]


def test_the_reference_keeps_what_its_tokens_need_not_the_padded_batch(ops):
    """A 1-token and a 2-token sequence beside a 300-token one cost the reference's autograd their
    own steps, not 300 each: a step runs only on the sequences still going (session 45: eight
    sequences of 1–500 tokens at K = V = 128 held 24 GiB padded, and ran out of GPU memory)."""
    op = ops["gdn"]
    alone = random_inputs(op, T=303, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 303], initial_state=True)
    mixed = random_inputs(op, T=303, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 1, 301, 303], initial_state=True)
    assert _saved_bytes(op, mixed) <= 1.1 * _saved_bytes(op, alone)
