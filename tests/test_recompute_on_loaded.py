"""partition.RECOMPUTE_ON_LOADED (on by default; QLA_RECOMPUTE_ON_LOADED=0 turns it off): a matmul
counts as built on an inverse only through values the program computes, so a backward's products
of loaded blocks (GDN's d P = dO·v_newᵀ and the q·Kᵀ partials of d q and d k) are recomputed by
its out kernel instead of crossing memory from its prep; not for a per-key gate (GLA, KDA). The
switch is read at import: a child process runs with it off, and its emulated training steps are
checked against autograd through the float64 reference (the default's are, by the rest of the
suite). QLA_RECOMPUTE_PER_KEY=1 applies it to per-key gates too, to time it there: another child.
"""
import pytest
import torch

from qla_compiler.emulate import reference_step
from qla_compiler.testing import rel_err
from child_process import run_child

SPECS = ["gdn", "delta_net", "kda"]
CHILD = """
import sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_step
from qla_compiler.testing import random_inputs
out = {{}}
for spec in {specs!r}:
    op = qla_compiler.compile(spec, target="sm90")
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16, seed=4)
    step = emulated_step(op, args)
    part = op.program.backward_program.stage("partition")
    out[spec] = dict(args=args, d_o=step["d_o"], d_final=step["d_final"], grads=step["grads"], d_h0=step["d_h0"],
                     crossing=part.crossing, out=part.out)
torch.save(out, sys.argv[1])
"""


PER_KEY = ["kda"]  # (GLA has no backward prep: nothing crosses memory to recompute)


def _child(tmp_path_factory, specs: list, **env) -> dict:
    path = tmp_path_factory.mktemp("recompute") / "out.pt"
    run_child(CHILD.format(specs=specs), path, env=env)
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    return _child(tmp_path_factory, SPECS, QLA_RECOMPUTE_ON_LOADED="0")


@pytest.fixture(scope="module")
def per_key(tmp_path_factory):
    return _child(tmp_path_factory, PER_KEY, QLA_RECOMPUTE_PER_KEY="1")


def test_gdns_backward_prep_keeps_only_what_the_scan_reads(ops, recomputed):
    """On (this process), the prep makes only what the scan loads (W and d v_new's intra-chunk
    term), and the out kernel forms the rest from the blocks it loads anyway; off, the prep hands
    the out kernel d P and the q·Kᵀ partials through memory. KDA's kernels are the same both ways."""
    now = ops["gdn"].program.backward_program.stage("partition")
    assert set(now.crossing) == {"W", "d_v_new.o_intra"}
    assert {"d_P", "d_q.QKt", "d_k.QKt"} <= set(now.out)
    assert set(recomputed["gdn"]["crossing"]) == {"W", "d_v_new.o_intra", "d_P", "d_q.QKt", "d_k.QKt"}
    kda = ops["kda"].program.backward_program.stage("partition")
    assert (kda.crossing, kda.out) == (recomputed["kda"]["crossing"], recomputed["kda"]["out"])


def test_per_key_gates_recompute_only_under_their_switch(ops, per_key):
    """With QLA_RECOMPUTE_PER_KEY=1, KDA's backward prep hands its out kernels only what the scan
    reads, as GDN's does by default; by default also d P and the P-sums of d q and d k."""
    for spec in PER_KEY:
        now = ops[spec].program.backward_program.stage("partition")
        assert set(per_key[spec]["crossing"]) < set(now.crossing), spec


@pytest.mark.parametrize("spec", SPECS)
def test_the_recomputed_backward_matches_autograd(ops, recomputed, spec):
    _check_against_autograd(recomputed[spec], ops[spec])


@pytest.mark.parametrize("spec", PER_KEY)
def test_per_key_gates_recomputed_match_autograd(ops, per_key, spec):
    _check_against_autograd(per_key[spec], ops[spec])


def _check_against_autograd(got: dict, op) -> None:
    ref = reference_step(op, got["args"], got)
    for name in op.input_names:  # (bf16 inputs and tensors between kernels: ~3e-3; a wrong wiring is O(1))
        assert rel_err(got["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(got["d_h0"], ref["d_h0"]) <= 1e-2
