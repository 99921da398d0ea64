"""The key gradients' sum over each group of value heads (kernels/backward._backward), ways of
doing it timed on the GPU: at 16/64 heads and 8 × 4096 tokens torch's reduction of the two bf16
[1, T, HV, K] per-value-head gradients took 0.54 ms of a 13.9 ms training step (session 19),
~2.5 TB/s. Each way's error against a float64 sum is printed beside its time.

    python benchmarks/group_sum.py                 # GPU: 16/64 heads, 32768 tokens, K = 128
"""
import argparse

import torch


def ways(G: int, K: int) -> dict:
    eye = None

    def stacked_identity(x):  # one bf16 GEMM against [I; I; …]: float32 accumulation, ~memory speed
        nonlocal eye
        if eye is None:
            eye = torch.eye(K, device=x.device, dtype=x.dtype).repeat(G, 1)
        return (x.reshape(-1, G * K) @ eye).view(*x.shape[:2], -1, K)

    def slices_fp32(x):
        y = x.unflatten(2, (-1, G))
        acc = y[:, :, :, 0].float()
        for i in range(1, G):
            acc += y[:, :, :, i]
        return acc.to(x.dtype)

    return {
        "sum(3) (today's)": lambda x: x.unflatten(2, (-1, G)).sum(3),
        "sum(3, float32) then bf16": lambda x: x.unflatten(2, (-1, G)).sum(3, dtype=torch.float32).to(x.dtype),
        "slices added in float32": slices_fp32,
        "GEMM against stacked identities": stacked_identity,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16/64", help="H/HV")
    ap.add_argument("--K", type=int, default=128)
    a = ap.parse_args()
    H, HV = map(int, a.heads.split("/"))
    x = torch.randn(1, a.tokens, HV, a.K, device="cuda").to(torch.bfloat16)
    ref = x.double().unflatten(2, (H, HV // H)).sum(3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, f in ways(HV // H, a.K).items():
        for _ in range(3):
            out = f(x)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            f(x)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        err = float((out.double() - ref).norm() / ref.norm())
        gbs = (x.numel() + out.numel()) * 2 / ms / 1e6
        print(f"{name:34s} {ms:.3f} ms  {gbs:6.0f} GB/s  error {err:.2e}")


if __name__ == "__main__":
    main()
