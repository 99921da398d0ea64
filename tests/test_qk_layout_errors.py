"""Inputs in the head-first layout ([B, H, T, ...]) are reported as such, naming the argument at
fault: q and k head-first are a problem with q/k, not with v."""
import pytest
import torch

from qla_compiler.testing import random_inputs

FIX = "the op takes FLA's layout, tokens before heads"


def _args(op):
    return random_inputs(op, B=1, T=10, H=2, HV=4, K=8, V=8, dtype=torch.float32)


def _first(op, **head_first):
    args = _args(op)
    return {**args, **{n: args[n].transpose(1, 2) for n in head_first}}


@pytest.mark.parametrize("spec", ["gdn", "linear_attn"])  # with per-token scalars and gates, and without
def test_q_and_k_head_first_blame_q_and_k(ops, spec):
    op = ops[spec]
    with pytest.raises(ValueError) as e:
        op(**_first(op, q=1, k=1))
    msg = str(e.value)
    assert msg.startswith("q: expected [B, T, H, K] with B = 1, T = 10 like v"), msg
    assert "got shape [1, 2, 10, 8]: q and k are head-first ([B, H, T, K])" in msg and FIX in msg


@pytest.mark.parametrize("name, pattern", [
    ("q", r"^q: expected \[B, T, H, K\] with B = 1, T = 10 like v, g, beta, got shape \[1, 2, 10, 8\]: "
          r"q is head-first"),
    ("k", r"^k: expected shape \[1, 10, 2, 8\] like q, got \[1, 2, 10, 8\]: k is head-first"),
    ("v", r"^v: expected \[B=1, T=10, HV, V\] like q, got \[1, 4, 10, 8\]: v is head-first \(\[B, HV, T, V\]\)"),
    ("g", r"^g: expected shape \[1, 10, 4\], got \[1, 4, 10\]: g is head-first \(\[B, HV, T\]\)"),
])
def test_one_input_head_first_is_named(ops, name, pattern):
    op = ops["gdn"]
    with pytest.raises(ValueError, match=pattern):
        op(**_first(op, **{name: 1}))


def test_every_input_head_first(ops):
    op = ops["gdn"]
    with pytest.raises(ValueError, match=r"^q: expected \[B, T, H, K\], got shape \[1, 2, 10, 8\]: q, k, v, g and "
                                         r"beta are all head-first"):
        op(**_first(op, **{n: 1 for n in op.input_names}))


def test_a_short_v_is_still_v(ops):
    op = ops["gdn"]
    args = random_inputs(op, B=1, T=10, H=2, HV=2, K=8, V=8, dtype=torch.float32)  # H = HV: no swap looks right
    with pytest.raises(ValueError, match=r"^v: expected \[B=1, T=10, HV, V\] like q, got \[1, 5, 2, 8\]$"):
        op(**{**args, "v": args["v"][:, :5]})
