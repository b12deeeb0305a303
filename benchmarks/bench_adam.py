"""CPU Adam throughput: offload's kernel vs torch.optim.AdamW (and DeepSpeed's CPUAdam).

Two workloads at each size: fp32 (fp32 grad in, fp32 state updated in place) and the offload
engine's (bf16 grad in, fp32 state updated, bf16 copy of the weights out). Both move 28 bytes
per parameter that cannot be avoided: fp32 reads p,m,v,g (16) and writes p,m,v (12); bf16
reads p,m,v (12) + g (2) and writes p,m,v (12) + the copy (2).

Timing: offload, its torch peer and the bandwidth limit's kernels are timed alternately
(ABCD..., the order reversed every round) on arrays allocated and warmed the same way
(created filled, one untimed call each, so page faults and lazily created optimizer state are
out of the timed calls). Reported: the median and the best of the rounds, and the median over
rounds of the per-round ratio (robust to the load of a shared machine changing). Each timed
call starts after a 5 ms pause, so torch's OpenMP workers, which spin for a while after a
parallel region, do not take CPU from whichever call comes next.

Bandwidth limit, per workload and per round, on scratch arrays of the same sizes:
`adam_traffic` runs the kernel's own loop (same loads, same stores, same thread split) with
the arithmetic replaced by additions, once with ordinary stores and once in the streaming
mode (non-temporal stores of the 16-bit copy); the faster of the two medians is the limit,
and "of BW" is Adam's median rate over it.
For reference, STREAM triad (a = b + s*c) is printed with STREAM's 24 B/element and with
the 32 B/element it really moves (a's lines are read for ownership before being written).

    python benchmarks/bench_adam.py [--sizes 10e6 100e6] [--repeats 15] [--threads N] [--foreach]
                                    [--streaming-threshold N]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from offload import _adam_ext  # noqa: E402
from offload.optim import kernels  # noqa: E402

BYTES_PER_PARAM = 28  # see the module docstring
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


PAUSE_S = 0.005  # before each timed call: torch's OpenMP workers stop spinning, the next call starts idle


def timed(fn) -> float:
    time.sleep(PAUSE_S)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: list, rounds: int) -> list[list[float]]:
    """Times each of fns once per round, order reversed every other round; one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            times[i].append(timed(fns[i]))
    return times


def offload_setup(n: int, bf16: bool):
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16) if bf16 else torch.randn(n)
    out16 = torch.zeros(n, dtype=torch.bfloat16) if bf16 else None
    step = [0]

    def run():
        step[0] += 1
        kernels.adam_step(
            p,
            g,
            m,
            v,
            step=step[0],
            lr=HP["lr"],
            beta1=HP["betas"][0],
            beta2=HP["betas"][1],
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            param_out16=out16,
        )

    return run


def torch_setup(n: int, bf16: bool, **flags):
    p = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([p], **HP, **flags)
    if not bf16:
        p.grad = torch.randn(n)
        return opt.step
    # torch's fastest way to the same result: cast the bf16 gradient, fused step, cast back.
    g16, out16 = torch.randn(n).to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    p.grad = torch.zeros(n)

    def run():
        p.grad.copy_(g16)
        opt.step()
        out16.copy_(p.detach())

    return run


def deepspeed_setup(n: int):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"], adamw_mode=True)
    return opt.step


def traffic_setups(n: int, bf16: bool) -> list:
    """The kernel's access pattern without the arithmetic, on scratch arrays of the workload's
    sizes: [ordinary stores, streaming mode]."""
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.zeros(n, dtype=torch.bfloat16) if bf16 else torch.zeros(n)
    out16 = torch.zeros(n, dtype=torch.bfloat16) if bf16 else None
    gtype = _adam_ext.BF16 if bf16 else _adam_ext.F32
    otype = _adam_ext.BF16 if bf16 else _adam_ext.NONE
    optr = out16.data_ptr() if bf16 else 0
    keep = (p, m, v, g, out16)

    def mode(stream):
        return lambda: (
            keep and _adam_ext.adam_traffic(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), optr, n, gtype, otype, stream)
        )

    return [mode(False), mode(True)]


def stream_triad_gbs(n: int, rounds: int) -> float:
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    (times,) = alternate([lambda: _adam_ext.stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, 3.0)], rounds)
    return n / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    parser.add_argument("--repeats", type=int, default=15, help="rounds of alternating timings (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="offload kernel threads (default: all CPUs)")
    parser.add_argument("--foreach", action="store_true", help="also time torch AdamW(foreach=True)")
    parser.add_argument(
        "--streaming-threshold",
        type=float,
        default=None,
        help="adam_step calls from this many elements use non-temporal stores (default: the "
        "kernel's; 1e18 turns them off, to compare)",
    )
    args = parser.parse_args()
    if args.threads:
        kernels.set_num_threads(args.threads)
    if args.streaming_threshold is not None:
        kernels.set_streaming_threshold(int(args.streaming_threshold))
    print(
        f"offload kernel ISA: {kernels.active_isa()}, threads: {kernels.get_num_threads()}, streaming from "
        f"{kernels.streaming_threshold() / 1e6:.1f}M elements; torch {torch.__version__}, "
        f"torch threads: {torch.get_num_threads()}; {args.repeats} alternating rounds, median (best)"
    )
    try:
        import deepspeed.ops.adam  # noqa: F401

        have_deepspeed = True
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever its op builder raises: reported, then skipped
        have_deepspeed = False
        print(f"DeepSpeedCPUAdam: skipped (not importable: {type(exc).__name__}: {exc})")
    for size in args.sizes:
        n = int(size)
        triad = stream_triad_gbs(n, args.repeats)
        gc.collect()
        print(
            f"\n== {n / 1e6:.0f}M parameters ==  STREAM triad (reference): {triad * 24 / 1e9:.1f} GB/s at STREAM's "
            f"24 B/elem, {triad * 32 / 1e9:.1f} GB/s counting write-allocate (32 B/elem)"
        )
        print(
            f"{'workload':40s} {'ms med':>8s} {'(best)':>8s} {'Gparam/s':>9s} {'GB/s':>6s} "
            f"{'vs peer: med (per-round)':>25s} {'of BW':>6s}"
        )
        for bf16 in (False, True):
            label = "bf16 grad->bf16 out" if bf16 else "fp32"
            peer_name = "torch cast+fused+cast" if bf16 else "torch AdamW(fused=True)"
            fns = [torch_setup(n, bf16, fused=True), offload_setup(n, bf16)]
            names = [f"{label}  {peer_name}", f"{label}  offload adam_step"]
            if not bf16 and have_deepspeed:
                fns.append(deepspeed_setup(n))
                names.append(f"{label}  DeepSpeedCPUAdam")
            # the limit is timed in the same rounds as the workloads: the machine's load changes
            *times, plain, streamed = alternate(fns + traffic_setups(n, bf16), args.repeats)
            del fns
            gc.collect()
            if not bf16 and args.foreach:
                (foreach,) = alternate([torch_setup(n, False, foreach=True)], max(2, args.repeats // 2))
                times.append(foreach)
                names.append(f"{label}  torch AdamW(foreach=True)")
                gc.collect()
            limit = n / min(statistics.median(plain), statistics.median(streamed))
            print(
                f"{label} bandwidth limit (kernel's access pattern, no arithmetic, median of rounds): ordinary "
                f"stores {n / statistics.median(plain) / 1e9:.2f}, streaming {n / statistics.median(streamed) / 1e9:.2f}"
                f" G params/s -> limit {limit / 1e9:.2f} G params/s = {limit * BYTES_PER_PARAM / 1e9:.1f} GB/s at "
                f"{BYTES_PER_PARAM} B/param"
            )
            peer = times[0]
            for i, (name, t) in enumerate(zip(names, times)):
                med = statistics.median(t)
                rate = n / med
                if i == 0:
                    ratio = "peer"
                else:
                    per_round = statistics.median(p / x for p, x in zip(peer, t))
                    ratio = f"{statistics.median(peer) / med:.2f}x ({per_round:.2f}x)"
                print(
                    f"{name:40s} {med * 1e3:8.1f} {min(t) * 1e3:8.1f} {rate / 1e9:9.2f} "
                    f"{rate * BYTES_PER_PARAM / 1e9:6.1f} {ratio:>25s} {rate / limit:6.0%}"
                )


if __name__ == "__main__":
    main()
