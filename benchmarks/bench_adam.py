"""CPU Adam throughput: offload's kernel vs torch.optim.AdamW (and DeepSpeed's CPUAdam).

Prints, for 10M and 100M parameters: params/s, GB/s (28 bytes moved per parameter in both
workloads), the ratio to the peer, and the fraction of this machine's memory bandwidth,
measured in the same run by STREAM-style kernels in offload's C++ extension (portable C++,
auto-vectorized, on the same thread pool): triad a = b + s*c (24 B/element, STREAM's
count) and in-place scale-add a = a + s*b (12 B/element); the larger is the limit.

    python benchmarks/bench_adam.py [--sizes 10e6 100e6] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from offload import _adam_ext  # noqa: E402
from offload.optim import kernels  # noqa: E402

BYTES_PER_PARAM = 28  # fp32: p,m,v,g read + p,m,v written; bf16 workload: p,m,v + 2 in, p,m,v + 2 out
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth_gbs(n: int, repeats: int) -> tuple[float, float]:
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    t_triad = best_time(lambda: _adam_ext.stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, 3.0), repeats)
    t_add = best_time(lambda: _adam_ext.stream_scale_add(a.data_ptr(), b.data_ptr(), n, 1e-9), repeats)
    return 24 * n / t_triad / 1e9, 12 * n / t_add / 1e9


def offload_fp32(n, repeats):
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    step = [0]

    def run():
        step[0] += 1
        kernels.adam_step(p, g, m, v, step=step[0], lr=HP["lr"], beta1=0.9, beta2=0.999, eps=HP["eps"],
                          weight_decay=HP["weight_decay"])

    return best_time(run, repeats)


def offload_bf16(n, repeats):
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g16, out16 = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def run():
        step[0] += 1
        kernels.adam_step(p, g16, m, v, step=step[0], lr=HP["lr"], beta1=0.9, beta2=0.999, eps=HP["eps"],
                          weight_decay=HP["weight_decay"], param_out16=out16)

    return best_time(run, repeats)


def torch_fp32(n, repeats, **flags):
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], **HP, **flags)
    return best_time(opt.step, repeats)


def torch_bf16_equivalent(n, repeats):
    # torch's fastest way to the same result: cast the bf16 gradient, fused step, cast back.
    p = torch.nn.Parameter(torch.randn(n))
    g16, out16 = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    p.grad = torch.empty(n)
    opt = torch.optim.AdamW([p], **HP, fused=True)

    def run():
        p.grad.copy_(g16)
        opt.step()
        out16.copy_(p.detach())

    return best_time(run, repeats)


def deepspeed_fp32(n, repeats):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"],
                           adamw_mode=True)
    return best_time(opt.step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"offload kernel ISA: {kernels.active_isa()}, threads: {kernels.get_num_threads()}; "
          f"torch {torch.__version__}, torch threads: {torch.get_num_threads()}")
    try:
        import deepspeed.ops.adam  # noqa: F401

        have_deepspeed = True
    except Exception as exc:  # ImportError, or its op builder failing
        have_deepspeed = False
        print(f"DeepSpeedCPUAdam: skipped (not importable: {type(exc).__name__}: {exc})")
    for size in args.sizes:
        n = int(size)
        repeats = args.repeats if n <= 20_000_000 else max(2, args.repeats // 2)
        triad, scale_add = bandwidth_gbs(n, repeats)
        limit = max(triad, scale_add)
        print(f"\n== {n / 1e6:.0f}M parameters ==  bandwidth (C++ STREAM-style, this run): triad {triad:.1f} GB/s, "
              f"in-place scale-add {scale_add:.1f} GB/s -> limit {limit:.1f} GB/s = "
              f"{limit * 1e9 / BYTES_PER_PARAM / 1e9:.2f} G params/s at {BYTES_PER_PARAM} B/param")
        rows = []
        t_fused = torch_fp32(n, repeats, fused=True)
        gc.collect()
        rows.append(("fp32  torch AdamW(fused=True)", t_fused, None))
        rows.append(("fp32  torch AdamW(foreach=True)", torch_fp32(n, repeats, foreach=True), t_fused))
        gc.collect()
        rows.append(("fp32  offload adam_step", offload_fp32(n, repeats), t_fused))
        gc.collect()
        if have_deepspeed:
            rows.append(("fp32  DeepSpeedCPUAdam", deepspeed_fp32(n, repeats), t_fused))
            gc.collect()
        t_torch16 = torch_bf16_equivalent(n, repeats)
        gc.collect()
        rows.append(("bf16 grad->bf16 out  torch cast+fused+cast", t_torch16, None))
        rows.append(("bf16 grad->bf16 out  offload adam_step", offload_bf16(n, repeats), t_torch16))
        gc.collect()
        print(f"{'workload':44s} {'ms':>8s} {'Gparam/s':>9s} {'GB/s':>7s} {'vs peer':>8s} {'of BW':>6s}")
        for name, seconds, peer in rows:
            rate = n / seconds
            gbs = rate * BYTES_PER_PARAM / 1e9
            ratio = f"{peer / seconds:.2f}x" if peer else "peer"
            print(f"{name:44s} {seconds * 1e3:8.1f} {rate / 1e9:9.2f} {gbs:7.1f} {ratio:>8s} {gbs / limit:6.0%}")


if __name__ == "__main__":
    main()
