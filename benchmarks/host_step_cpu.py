"""A training step's host time with every kernel a no-op, on the CPU: the Python and torch work of
the kernels' path (binding, checks, launch plans, the custom ops' autograd, the backward's host
code) without a GPU, to compare two versions of the host code on the development machine.

    OMP_NUM_THREADS=1 python benchmarks/host_step_cpu.py                 # GDN at 16/64 heads
    OMP_NUM_THREADS=1 python benchmarks/host_step_cpu.py --spec kda --heads 16/16
    OMP_NUM_THREADS=1 python benchmarks/host_step_cpu.py --heads 2/8 --cp 8   # context-parallel

With --cp the window search and the chain of segment maps (on the GPU one kernel each) are
stand-ins that allocate their outputs and compute nothing, like the kernels.

The inputs are CPU bf16 tensors of 64 tokens (the host work does not depend on the length), the
group sums of key gradients are views (on the GPU a launch, here real work). The node's Python ran
~3× slower than this machine's in session 29 (a 16/64 × 2048 training step: ~1.7 ms of host time
there, 0.51 ms here).
"""
import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="gdn")
    ap.add_argument("--heads", default="16/64", help="H/HV")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--cp", type=int, default=None, metavar="SEGMENTS", help="cut the sequence into SEGMENTS")
    a = ap.parse_args(argv)
    import torch

    from qla_compiler import ops
    from qla_compiler.kernels import backward, forward
    from qla_compiler.testing import random_inputs

    torch.set_num_threads(1)
    op = ops._op(a.spec)
    H, HV = map(int, a.heads.split("/"))
    T = 64 * (a.cp or 1)  # (a chunk a segment)
    args = random_inputs(op, T=T, H=H, HV=HV, K=128, V=128, cu_seqlens=[0, T], initial_state=True,
                         dtype=torch.bfloat16)
    cu = args["cu_seqlens"].to(torch.int32)

    def no_op_kernels(program, shape):
        return {k.name: (lambda *tensors: None) for k in program.kernels.kernels}

    def step():
        leaves = {n: x.detach().requires_grad_() for n, x in args.items() if torch.is_tensor(x) and x.is_floating_point()}
        inputs, _, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"], cu,
                                       False)
        o, final = op._run_kernels(inputs, scale, leaves["initial_state"], cu, a.cp)
        torch.autograd.backward([o, final], [torch.ones_like(o), torch.ones_like(final)])

    backward.group_sum = lambda x, G, cache=True: x[:, :, ::G]
    def no_op_search(program, tensors, HV, C):
        return lambda layout, reverse: torch.zeros(layout.cu.numel() - 1, HV, dtype=torch.int32)

    def no_op_chain(h0):
        return lambda maps, h0, S, reverse=False: h0.new_empty(h0.shape[0] * S, *h0.shape[1:])

    with forward.launch_policy(kernels=no_op_kernels, sms=forward.H200_SMS, window_search=no_op_search,
                               segment_chain=no_op_chain):
        for _ in range(5):  # plans, layouts: made once
            step()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(a.calls):
                step()
            best = min(best, (time.perf_counter() - t) / a.calls)
    print(f"{a.spec} {a.heads}{f' cut in {a.cp}' if a.cp else ''}: a training step's host time, every kernel a no-op: "
          f"{best * 1e3:.3f} ms "
          f"(best of 5 × {a.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
