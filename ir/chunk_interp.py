"""The ChunkIR interpreter: runs a chunk program over whole batches in torch (any dtype, any device).

Two phases, as the kernels do it: every node that does not depend on the state is evaluated once
for all chunks at the same time; the scan nodes are then evaluated chunk after chunk, carrying the
state (from the last chunk to the first for a backward program, `ir.reverse`).

    >>> o, S = run_chunks(chunk_ir, blocks, lengths, {"scale": 0.125}, {}, S0)    # doctest: +SKIP
    >>> o, S, entering = run_chunks(..., save_states=True)                      # doctest: +SKIP
    >>> grads, dS0 = run_backward(backward_ir, blocks, lengths, params, consts,
    ...                           entering, d_o, d_S)                             # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .chunk import ChunkIR
from .chunk_ops import OPS, Context


def run_chunks(ir: ChunkIR, blocks: dict, lengths: torch.Tensor, params: dict, head_consts: dict,
               initial_state: torch.Tensor, save_states: bool = False):
    """Evaluate `ir` over chunked inputs.

    blocks: input name -> [N, HV, NC, C, ...] (tokens past a chunk's length are zero padding).
    lengths: [N, NC] tokens in each chunk (0 for chunks past the end of a short sequence).
    params: runtime scalars (e.g. scale) as floats; head_consts: name -> [HV] log-decay per head.
    initial_state: [N, HV, K, V]. Returns o [N, HV, NC, C, V] and the final state [N, HV, K, V];
    with save_states also the state entering each chunk, [N, HV, NC, K, V] (what the backward needs).
    """
    outs, final, states = _scan(ir, blocks, lengths, params, head_consts, initial_state, save_states)
    (o,) = outs.values()  # a forward's one result
    return (o, final, states) if save_states else (o, final)


def run_backward(ir: ChunkIR, blocks: dict, lengths: torch.Tensor, params: dict, head_consts: dict,
                 states: torch.Tensor, d_o: torch.Tensor, d_final: torch.Tensor):
    """Evaluate a backward program (passes/autodiff.py) over chunked inputs, last chunk first.

    blocks, lengths, params, head_consts: as for the forward; states: the states entering each
    chunk [N, HV, NC, K, V] (run_chunks(..., save_states=True)); d_o: [N, HV, NC, C, V], the
    cotangent of o; d_final: [N, HV, K, V], the final state's. Returns (input name -> gradient
    block [N, HV, NC, C, ...] for the inputs with one, d_initial_state [N, HV, K, V]).
    """
    blocks = dict(blocks)
    for n in ir.inputs():
        kind = n.attr["kind"]
        if kind in ("saved_state", "cotangent_value"):
            blocks[n.attr["name"]] = states if kind == "saved_state" else d_o
    outs, d_initial, _ = _scan(ir, blocks, lengths, params, head_consts, d_final, False)
    return {ir.gradient_of[role]: g for role, g in outs.items() if role in ir.gradient_of}, d_initial


def _scan(ir: ChunkIR, blocks, lengths, params, head_consts, initial_state, save_states):
    """Every per-chunk output (role -> [N, HV, NC, ...]), the last state, the entering states."""
    N, HV, NC = next(iter(blocks.values())).shape[:3]
    dtype, device = initial_state.dtype, initial_state.device
    lens = lengths.view(N, 1, NC)
    consts = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, HV, 1) for k, v in head_consts.items()}
    prm = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, 1, 1) for k, v in params.items()}
    scan = ir.scan_nodes()
    order = ir.order()
    roles = dict(ir.outputs)

    # phase 1: everything not downstream of the state, batched over [N, HV, NC]
    ctx = Context(blocks, lens, prm, consts, initial_state.unsqueeze(2), ir.chunk_size, 3)
    vals = {}
    for n in order:
        if n.name not in scan:
            vals[n.name] = _apply(ctx, n, vals, ir)

    # phase 2: the scan, chunk by chunk, batched over [N, HV, 1]
    state = initial_state.unsqueeze(2)
    per_chunk = {r: [] for r, v in roles.items() if v in scan}
    entering = []
    for c in (reversed(range(NC)) if ir.reverse else range(NC)):
        if save_states:
            entering.append(state)
        sl = {k: _chunk(v, c) for k, v in vals.items()}
        cctx = Context({k: _chunk(b, c) for k, b in blocks.items()}, _chunk(lens, c), prm,
                       consts, state, ir.chunk_size, 3)
        for n in order:
            if n.name in scan:
                sl[n.name] = _apply(cctx, n, sl, ir)
        state = sl[ir.next_state]
        for r in per_chunk:
            per_chunk[r].append(sl[roles[r]])
    step = -1 if ir.reverse else 1
    outs = {r: (torch.cat(per_chunk[r][::step], dim=2) if r in per_chunk
                else vals[v].expand(N, HV, NC, *vals[v].shape[3:])) for r, v in roles.items()}
    states = torch.cat(entering[::step], dim=2) if save_states else None
    return outs, state.squeeze(2), states


def run_all_chunks(ir: ChunkIR, blocks: dict, lengths: torch.Tensor, params: dict, head_consts: dict,
                   states: torch.Tensor) -> dict:
    """Every node for every chunk at once, given the state entering each chunk [N, HV, NC, K, V]
    (for a state-free program, e.g. passes/affine.py's, any tensor of that shape). Returns output
    role -> [N, HV, NC, ...]. With the entering states known there is nothing sequential left."""
    N, HV, NC = states.shape[:3]
    dtype, device = states.dtype, states.device
    consts = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, HV, 1) for k, v in head_consts.items()}
    prm = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, 1, 1) for k, v in params.items()}
    ctx = Context(blocks, lengths.view(N, 1, NC), prm, consts, states, ir.chunk_size, 3)
    vals = {}
    for n in ir.order():
        vals[n.name] = _apply(ctx, n, vals, ir)
    return {r: vals[v].expand(N, HV, NC, *vals[v].shape[3:]) for r, v in ir.outputs.items()}


def _apply(ctx, n, vals, ir):
    args = [vals[a] for a in n.args]
    shapes = [ir.node(a).shape for a in n.args]
    return OPS[n.op].eval(ctx, args, n.attr, shapes)


def _chunk(x, c):
    """Chunk c of a value batched over [N, HV, NC] (values constant over chunks have NC = 1)."""
    return x if x.shape[2] == 1 else x[:, :, c:c + 1]
