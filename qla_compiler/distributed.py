"""Context parallelism across ranks (torch.distributed): one packed batch split by tokens over the
ranks of a process group, sequences crossing rank boundaries, exact, with initial and final states.

Each rank holds a contiguous, equal slice of the packed tokens. Per chunk, and so per slice of a
sequence, the state update is affine, S_end = M S_start + H (MATH.md; qla_compiler/context_parallel.py
uses the same identity inside one GPU). So a rank whose first sequence began on an earlier rank
needs only one matrix pair from each earlier rank:

    1. every rank: the map (M, H) of its first piece, when that piece continues a sequence (scanned
       with zero values from the identity it ends in M, with its values from zero in H); and, when its last piece
       runs on into the next rank and started here, that piece's end state E (M = 0, H = E);
    2. all-gather the pairs; rank r composes those of ranks 0..r−1 into its start state;
    3. every rank runs its slice from its start states; each sequence's final state comes from
       the rank where it ends (an all-reduce gives every rank all of them).

The collectives are torch.distributed.nn's, which autograd differentiates: the backward carries dS
from the last rank to the first through the same maps. As with any collective under autograd, every
rank must run the backward, and use the returned final states in its loss or not on all ranks
alike (the final states' all-reduce is differentiated by an all-reduce). Any backend of the op runs the slices (the
generated kernels on the GPU, the interpreter elsewhere); NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 is set before the group is used, as the H200 nodes need).

    >>> ctx = build_cp_context(cu_seqlens_global, group)           # doctest: +SKIP
    >>> o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
    ...                                   cp_context=ctx)          # doctest: +SKIP
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@dataclass(frozen=True)
class CPContext:
    """This rank's share of a packed batch (build_cp_context): the tokens [start, end) of the
    global packed sequences, as `pieces` (the global sequence of each, in order) whose lengths are
    `local_cu`'s; `continues`: the first piece began on an earlier rank; `carries_on`: the last
    piece ends on a later rank."""
    group: object
    rank: int
    world: int
    cu_seqlens: torch.Tensor  # the global cu_seqlens, int64, on the host
    start: int
    end: int
    local_cu: torch.Tensor  # int64 [pieces + 1], on the host
    pieces: tuple
    continues: bool
    carries_on: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start


def build_cp_context(cu_seqlens, group=None) -> CPContext:
    """The context of this rank (of `group`, default the world) for a packed batch whose global
    cu_seqlens are given: each rank holds total/world consecutive tokens. Read on the host once per
    batch (the call itself then synchronises nothing for it)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("cp_context: torch.distributed is not initialised (init_process_group first)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens: expected the global cu_seqlens, an integer tensor [N + 1]")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    total = int(cu[-1])
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens: must start at 0 and must not decrease")
    if total % world:
        raise ValueError(f"cu_seqlens: {total} tokens do not split evenly over {world} ranks")
    per = total // world
    start, end = rank * per, (rank + 1) * per
    pieces, bounds = [], []
    for i in range(cu.numel() - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        empty_here = a == b and (start <= a < end or (a == total and rank == world - 1))
        if (a < end and b > start) or empty_here:
            pieces.append(i)
            bounds.append((max(a, start) - start, min(b, end) - start))
    local = torch.tensor([0] + [hi for _, hi in bounds], dtype=torch.int64)
    continues = bool(pieces) and int(cu[pieces[0]]) < start
    carries_on = bool(pieces) and int(cu[pieces[-1] + 1]) > end
    return CPContext(group, rank, world, cu, start, end, local, tuple(pieces), continues, carries_on)


def run_cp(op, inputs: dict, dims, scale: float, initial_state, ctx: CPContext, output_final_state: bool):
    """The op on this rank's slice (`inputs` [1, tokens, ...], already prepared): (o, final
    [N, HV, K, V] or None), as the op on the whole batch gives them."""
    if dims.B != 1 or dims.T != ctx.tokens:
        raise ValueError(f"cp_context: this rank holds {ctx.tokens} tokens of the packed batch; the inputs "
                         f"must be [1, {ctx.tokens}, ...], got B={dims.B}, T={dims.T}")
    v = inputs[op.value_name]
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    N = ctx.cu_seqlens.numel() - 1
    HV, K, V = dims.HV, dims.K, dims.V
    device = v.device
    h0 = (torch.zeros(N, HV, K, V, dtype=work, device=device) if initial_state is None
          else initial_state.to(work))
    local_cu = ctx.local_cu.to(device)

    def run(piece_inputs, cu, start_states):
        return op(**piece_inputs, scale=scale, initial_state=start_states, cu_seqlens=cu, output_final_state=True)

    def tokens(a, b, values=None):
        out = {n: x[:, a:b] for n, x in inputs.items()}
        if values is not None:
            out[op.value_name] = values
        return out

    # 1. this rank's transfer pair: the crossing sequence's state at this rank's end is A·S + B
    # with S its state at this rank's start
    A = torch.zeros(HV, K, K, dtype=work, device=device)
    B = torch.zeros(HV, K, V, dtype=work, device=device)
    lens = (ctx.local_cu[1:] - ctx.local_cu[:-1]).tolist()
    if ctx.continues:  # M from zero values and the identity state, H from the values and a zero state
        # (two scans of widths K and V rather than one of K + V, which at K = V = 128 would run the
        # kernels of 256-wide tiles, the backward on column blocks)
        one = torch.tensor([0, lens[0]], device=device)
        x = inputs[op.value_name][:, :lens[0]]
        eye = torch.eye(K, dtype=work, device=device).expand(1, HV, K, K)
        _, M = run(tokens(0, lens[0], x.new_zeros(*x.shape[:-1], K)), one, eye)
        _, H = run(tokens(0, lens[0]), one, torch.zeros(1, HV, K, V, dtype=work, device=device))
        M, H = M[0].to(work), H[0].to(work)
    if ctx.carries_on:
        if ctx.continues and len(ctx.pieces) == 1:  # the whole slice inside one sequence
            A, B = M, H
        else:
            a = int(ctx.local_cu[-2])
            _, end_state = run(tokens(a, ctx.tokens), torch.tensor([0, ctx.tokens - a], device=device),
                               h0[ctx.pieces[-1]][None])
            B = end_state[0].to(work)
    # 2. every rank's pair, in one collective; this rank's start state from those before it. Every
    # rank's result depends on the gathered pairs (through a zero where it does not continue), so that
    # every rank's backward runs the collective's backward, in the same order (a rank that skipped
    # it would pair its next collective with another rank's)
    # (tie: the same for the collectives' inputs, which on some ranks are constants otherwise; an
    # empty slice's sum is an exact 0 whatever the values, inf or NaN included)
    tie = inputs[op.value_name][..., :0].sum().to(work)
    pairs = _collective("all_gather", torch.cat([A, B], -1) + tie, ctx.group)
    state = sum(p[..., :0].sum() for p in pairs) + torch.zeros(HV, K, V, dtype=work, device=device)
    for r in range(ctx.rank if ctx.continues else 0):
        state = pairs[r][..., :K] @ state + pairs[r][..., K:]
    starts = h0[list(ctx.pieces)] if ctx.pieces else h0[:0]
    if ctx.pieces:
        starts = torch.cat([(state if ctx.continues else starts[0] + state)[None], starts[1:]])
    # 3. the slice from its start states; each sequence's final state from the rank it ends on
    o, finals = run(inputs, local_cu, starts)
    if not output_final_state:
        return o, None
    ends_here = torch.tensor([int(ctx.cu_seqlens[i + 1]) <= ctx.end for i in ctx.pieces], dtype=torch.bool)
    mine = torch.zeros(N, HV, K, V, dtype=work, device=device)
    if ctx.pieces:
        index = torch.tensor(ctx.pieces, device=device)[ends_here.to(device)]
        mine = mine.index_add(0, index, finals.to(work)[ends_here.to(device)])
    return o, _collective("all_reduce", mine + tie, ctx.group)


def _collective(name: str, x: torch.Tensor, group):
    """torch.distributed.nn's differentiable collective (deprecated in torch 2.13 in favour of
    private functional collectives; its warning is silenced here, once per call)."""
    import torch.distributed.nn.functional as dnn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(dnn, name)(x, group=group)


__all__ = ["CPContext", "build_cp_context", "run_cp"]
