"""The ChunkIR interpreter: runs a chunk program over whole batches in torch (any dtype, any device).

Two phases, as the kernels do it: every node that does not depend on the state is evaluated once
for all chunks at the same time; the scan nodes are then evaluated chunk after chunk, carrying the
state.

    >>> o, S = run_chunks(chunk_ir, blocks, lengths, {"scale": 0.125}, {}, S0)    # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .chunk import ChunkIR
from .chunk_ops import OPS, Context


def run_chunks(ir: ChunkIR, blocks: dict, lengths: torch.Tensor, params: dict, head_consts: dict,
               initial_state: torch.Tensor):
    """Evaluate `ir` over chunked inputs.

    blocks: input name -> [N, HV, NC, C, ...] (tokens past a chunk's length are zero padding).
    lengths: [N, NC] tokens in each chunk (0 for chunks past the end of a short sequence).
    params: runtime scalars (e.g. scale) as floats; head_consts: name -> [HV] log-decay per head.
    initial_state: [N, HV, K, V]. Returns o [N, HV, NC, C, V] and the final state [N, HV, K, V].
    """
    N, HV, NC = next(iter(blocks.values())).shape[:3]
    dtype, device = initial_state.dtype, initial_state.device
    lens = lengths.view(N, 1, NC)
    consts = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, HV, 1) for k, v in head_consts.items()}
    prm = {k: torch.as_tensor(v, dtype=dtype, device=device).view(1, 1, 1) for k, v in params.items()}
    scan = ir.scan_nodes()
    order = ir.order()

    # phase 1: everything not downstream of the state, batched over [N, HV, NC]
    ctx = Context(blocks, lens, prm, consts, initial_state.unsqueeze(2), ir.chunk_size, 3)
    vals = {}
    for n in order:
        if n.name not in scan:
            vals[n.name] = _apply(ctx, n, vals, ir)

    # phase 2: the scan, chunk by chunk, batched over [N, HV, 1]
    state = initial_state.unsqueeze(2)
    o_role = ir.outputs["o"]
    outs = []
    for c in range(NC):
        sl = {k: _chunk(v, c) for k, v in vals.items()}
        cctx = Context({k: _chunk(b, c) for k, b in blocks.items()}, _chunk(lens, c), prm,
                       consts, state, ir.chunk_size, 3)
        for n in order:
            if n.name in scan:
                sl[n.name] = _apply(cctx, n, sl, ir)
        state = sl[ir.outputs["state"]]
        outs.append(sl[o_role])
    return torch.cat(outs, dim=2), state.squeeze(2)


def _apply(ctx, n, vals, ir):
    args = [vals[a] for a in n.args]
    shapes = [ir.node(a).shape for a in n.args]
    return OPS[n.op].eval(ctx, args, n.attr, shapes)


def _chunk(x, c):
    """Chunk c of a value batched over [N, HV, NC] (values constant over chunks have NC = 1)."""
    return x if x.shape[2] == 1 else x[:, :, c:c + 1]
