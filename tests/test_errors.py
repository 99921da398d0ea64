"""Malformed specs and bad inputs fail with messages that say what and where."""
import re

import pytest
import torch

import qla_compiler
from qla_compiler import SpecError, UnsupportedStructure
from qla_compiler.testing import random_inputs

HEADER = "from qla_compiler.spec import I, exp, gate, key, recurrence, scalar, state, value\n"


def write_spec(tmp_path, body: str):
    p = tmp_path / "bad_spec.py"
    p.write_text(HEADER + body)
    return p


@pytest.mark.parametrize("body, line, pattern", [
    # unknown symbol
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=S + k * w.T, output=S.T * q)\n",
     5, r"unknown symbol: name 'w' is not defined"),
    # shape mismatch: v·kᵀ is V×K, the state is K×V
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=S + v * k.T, output=S.T * q)\n",
     5, r"step: shape mismatch in sum: .*\[V×K\]"),
    # a product whose inner dimensions differ
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=S * k * v.T, output=S.T * q)\n",
     5, r"shape mismatch in product: \[K×V\] · \[K×1\]"),
    # the step is quadratic in S
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\n"
     "recurrence(step=S * S.T * S + k * v.T, output=S.T * q)\n",
     5, r"step is not linear in the state S: the term S·Sᵀ·S contains S 3 times"),
    # the output does not involve the state
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=S + k * v.T, output=v)\n",
     5, r"output is not linear in the state S: the term v does not involve S"),
    # the output is quadratic in S
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\n"
     "recurrence(step=S + k * v.T, output=S.T * S * S.T * q)\n",
     5, r"output is not linear in the state S"),
    # the step has the wrong shape
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=k * k.T, output=S.T * q)\n",
     5, r"step has shape \[K×K\], expected \[K×V\]"),
    # a Python error inside the spec
    ("q = key('q')\nx = 1 / 0\n", 3, r"ZeroDivisionError"),
    ("q = key('q')\nq2 = key('q')\n", 3, r"input 'q' is declared twice"),
    ("q = key('q')\nscale = value('scale')\n", 3, r"input name 'scale' is reserved"),
    ("q = key('q')\no = value('o')\n", 3, r"input name 'o' is reserved"),
    # tensors the schedule gives the kernels: a second parameter of that name crashed the lowering
    ("q = key('q')\nk = key('chunk_offsets')\n", 3, r"input name 'chunk_offsets' is reserved"),
    ("q = key('q')\nr = scalar('read_slot')\n", 3, r"input name 'read_slot' is reserved"),
    ("q = key('q')\nv = value('S0_chunks')\n", 3, r"input name 'S0_chunks' is reserved"),
])
def test_malformed_spec_names_file_and_line(tmp_path, body, line, pattern):
    p = write_spec(tmp_path, body)
    with pytest.raises(SpecError) as e:
        qla_compiler.compile(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("body, pattern", [
    # a transition with a k·qᵀ factor
    ("q, k = key('q'), key('k')\nv = value('v')\nb = scalar('b')\nS = state()\n"
     "recurrence(step=(I - b * k * q.T) * S + k * v.T, output=S.T * q)\n", r"only k·kᵀ of one key input"),
    # the state multiplied from the right
    ("q, k = key('q'), key('k')\nv = value('v')\nS = state()\nrecurrence(step=S + S * v * v.T + k * v.T, "
     "output=S.T * q)\n", r"not multiplied from the left"),
    # a coefficient that is not a monomial in scalar inputs
    ("q, k = key('q'), key('k')\nv = value('v')\nb = scalar('b')\nS = state()\n"
     "recurrence(step=S + (b + 1) * k * v.T, output=S.T * q)\n", r"write coefficient b = b \+ 1 must be a number"),
    ("q, k = key('q'), key('k')\nv = value('v')\nb = scalar('b')\nS = state()\n"
     "recurrence(step=S + k * v.T, output=(1 / b) * S.T * q)\n", r"is not c·Sᵀ·q"),
    # a decay that is neither exp(gate) nor a head constant
    ("q, k = key('q'), key('k')\nv = value('v')\nb = scalar('b')\nS = state()\n"
     "recurrence(step=b * S + k * v.T, output=S.T * q)\n", r"decay factor of A_t is b"),
])
def test_unsupported_structure_says_what_was_found(tmp_path, body, pattern):
    p = write_spec(tmp_path, body)
    with pytest.raises(UnsupportedStructure) as e:
        qla_compiler.compile(p)
    assert re.search(pattern, str(e.value)), str(e.value)
    assert str(e.value).startswith(f"{p}:"), str(e.value)


def test_missing_spec_file():
    with pytest.raises(SpecError, match="cannot read the spec"):
        qla_compiler.compile("specs/does_not_exist.py")


def test_unknown_target():
    with pytest.raises(ValueError, match="target: expected one of"):
        qla_compiler.compile("gdn", target="sm70")


def _args(op, **kw):
    return random_inputs(op, B=1, T=10, H=2, HV=4, K=8, V=8, dtype=torch.float32, **kw)


def _bad(args, **changes):
    return {**args, **changes}


@pytest.mark.parametrize("change, pattern", [
    (lambda a: _bad(a, q=a["q"][0]), r"^q: expected \[B, T, H, K\], got shape \[10, 2, 8\]"),
    (lambda a: _bad(a, k=a["k"][:, :, :, :4]), r"^k: expected shape \[1, 10, 2, 8\] like q"),
    (lambda a: _bad(a, v=a["v"][:, :, :3]), r"^v: its 3 value heads must be a multiple of the 2 query/key heads"),
    (lambda a: _bad(a, g=a["g"][:, :5]), r"^g: expected shape \[1, 10, 4\]"),
    (lambda a: _bad(a, beta=a["beta"][..., None]), r"^beta: expected \[B=1, T=10, HV=4\]"),
    (lambda a: _bad(a, v=a["v"].double()), r"^v: dtype torch.float64 differs from q's torch.float32"),
    (lambda a: _bad(a, q=a["q"].to(torch.int32)), r"^q: expected a floating dtype"),
    (lambda a: _bad(a, g=a["g"].to("meta")), r"^g: on meta, but q is on cpu"),
    (lambda a: _bad(a, initial_state=torch.zeros(1, 4, 8, 7)),
     r"^initial_state: expected shape \[1, 4, 8, 8\]"),
    (lambda a: _bad(a, cu_seqlens=torch.tensor([0, 6, 5, 10])),
     r"^cu_seqlens: must not decrease, but cu_seqlens\[1\] = 6 and cu_seqlens\[2\] = 5"),
    (lambda a: _bad(a, cu_seqlens=torch.tensor([0, 5, 9])), r"^cu_seqlens: must end at T = 10"),
    (lambda a: _bad(a, cu_seqlens=torch.tensor([1, 5, 10])), r"^cu_seqlens: must start at 0"),
    (lambda a: _bad(a, cu_seqlens=torch.tensor([0.0, 10.0])), r"^cu_seqlens: expected a 1-D int32 or int64"),
    (lambda a: _bad(a, scale="big"), r"^scale: expected a finite float or None, got 'big'"),
    (lambda a: _bad(a, scale=float("nan")), r"^scale: expected a finite float or None, got nan"),
    (lambda a: _bad(a, scale=True), r"^scale: expected a finite float or None, got True"),
    (lambda a: _bad(a, q=a["q"][:, :0], k=a["k"][:, :0], v=a["v"][:, :0], g=a["g"][:, :0],
                    beta=a["beta"][:, :0]), r"^q: has no elements \(T = 0"),
    (lambda a: _bad(a, v=a["v"][:, :, :0]), r"^v: has no elements \(HV = 0"),
    (lambda a: _bad(a, g=a["g"].abs() + 0.5), r"^g: a log-space gate must be ≤ 0 \(a decay\)"),
    (lambda a: _bad(a, gate=a["g"]), r"unknown argument 'gate'"),
    (lambda a: {k: v for k, v in a.items() if k != "beta"}, r"missing input\(s\) beta"),
])
def test_bad_inputs_name_the_argument(ops, change, pattern):
    op = ops["gdn"]
    args = change(_args(op))
    with pytest.raises(ValueError, match=pattern):
        op(**args)


def test_cu_seqlens_needs_batch_of_one(ops):
    op = ops["gdn"]
    args = random_inputs(op, B=2, T=10, H=1, HV=1, K=8, V=8)
    with pytest.raises(ValueError, match=r"^cu_seqlens: packed sequences need B = 1, got B = 2"):
        op(**args, cu_seqlens=torch.tensor([0, 10]))


def test_a_call_like_one_that_passed_still_reads_its_values(ops):
    """check_inputs skips the shape checks for arguments shaped like a call that passed (issue
    19's host time), never the values, nor an argument of another type that compares equal."""
    op = ops["gdn"]
    args = dict(_args(op), cu_seqlens=torch.tensor([0, 4, 10]), scale=1)
    op(**args)
    for bad, pattern in [(dict(g=args["g"].abs() + 0.5), r"^g: a log-space gate must be ≤ 0"),
                         (dict(cu_seqlens=torch.tensor([0, 4, 9])), r"^cu_seqlens: must end at T = 10"),
                         (dict(scale=True), r"^scale: expected a finite float or None, got True")]:
        with pytest.raises(ValueError, match=pattern):
            op(**{**args, **bad})
    op(**args)  # (and the signature that passed still passes)


def test_a_launch_past_cudas_grid_limits_is_refused():
    """CUDA launches at most 65535 CTAs along grid y and z: a scan's sequences (z) and the chunk
    slots of a kernel on key blocks (y) past that are refused, naming what to split; chunk slots
    on x, or in the one-axis launch of the value heads first, are not limited so."""
    import dataclasses

    from qla_compiler.kernels.forward import GRID_YZ_MAX, check_grid
    from qla_compiler.passes.lower_tilelang import one_launch_axis

    gdn = qla_compiler.compile_spec("gdn")
    scan = next(k for k in gdn.kernels.kernels if k.loop)
    check_grid(scan, {"CH": 10 ** 6, "T": 64 * 10 ** 6}, n_seqs=GRID_YZ_MAX)
    with pytest.raises(ValueError, match=r"cu_seqlens: 65536 sequences, but gdn_scan launches a CTA per sequence "
                                         r"on grid axis z, which CUDA caps at 65535: split the call"):
        check_grid(scan, {"CH": 65536, "T": 65536}, n_seqs=GRID_YZ_MAX + 1)
    out = next(k for k in gdn.backward_program.kernels.kernels if k.name == "gdn_backward_out")
    check_grid(out, {"CH": 10 ** 6, "T": 64 * 10 ** 6}, n_seqs=1)  # (slots on x)
    heads_first = dataclasses.replace(out, grid=out.grid[::-1])
    assert one_launch_axis(heads_first)
    check_grid(heads_first, {"CH": 10 ** 6, "T": 64 * 10 ** 6}, n_seqs=1)
    keyed = next(k for k in qla_compiler.compile_spec("gla").backward_program.kernels.kernels if k.key_block)
    assert keyed.grid[1][0] == "chunk_slot" and not one_launch_axis(keyed)
    with pytest.raises(ValueError, match=r"q, k, v: the call's 4194368 tokens make 65537 chunks, but .* grid axis y"):
        check_grid(keyed, {"CH": 65537, "T": 4194368}, n_seqs=1)


def test_decoding_more_sequences_than_one_launch_holds_is_refused(ops):
    """The token step's grid has a CTA column per sequence on z: 65536 one-token sequences are
    refused before any kernel runs, not left to the driver."""
    op = ops["gdn"]
    n = 65536
    args = random_inputs(op, T=n, H=1, HV=1, K=16, V=8, cu_seqlens=list(range(n + 1)), initial_state=True, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens: 65536 sequences, but .* on grid axis z"):
        op.recurrent(**args)
