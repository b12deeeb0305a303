"""CPU Adam throughput: offload's kernel vs torch.optim.AdamW (and DeepSpeed's CPUAdam), and
the compact moments (bf16, int8: kernels.adam_step_compact) vs bitsandbytes' CPU AdamW8bit.

Two workloads at each size: fp32 (fp32 grad in, fp32 weights updated in place) and the offload
engine's (bf16 grad in, fp32 weights updated, bf16 copy of the weights out), each with the
moments in fp32, bf16 and int8. The bytes per parameter that cannot be avoided (weights read
and written, the gradient read, each moment read and written, the copy written):

    moments   fp32 workload                   bf16 workload
    fp32      8 + 4 + 2 * 8 = 28              8 + 2 + 2 * 8 + 2 = 28
    bf16      8 + 4 + 2 * 4 = 20              8 + 2 + 2 * 4 + 2 = 20
    int8      8 + 4 + 2 * 2 (+1/8) = 16.125   8 + 2 + 2 * 2 (+1/8) + 2 = 16.125

(int8: a code byte per element per moment, read and written, and one exponent byte per 32
elements per moment, read and written.)

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
The compact kernels' limit is `compact_traffic`: their loop's loads and stores (ordinary
stores only) around trivial arithmetic, timed in the same rounds. The fp32, bf16 and int8
offload kernels are timed in the same rounds too, so "bf16 / fp32" and "int8 / fp32" are
medians of per-round ratios.
For reference, STREAM triad (a = b + s*c) is printed with STREAM's 24 B/element and with
the 32 B/element it really moves (a's lines are read for ownership before being written).

bitsandbytes' AdamW8bit (CPU; its blockwise 8-bit moments, fp32 gradient) runs on the fp32
workload after the others, `--bnb-rounds` times (it is far slower), when it is importable;
"int8 / bnb" is offload's int8 median rate over its median.

    python benchmarks/bench_adam.py [--sizes 10e6 100e6] [--repeats 15] [--threads N] [--foreach]
                                    [--streaming-threshold N] [--bnb-rounds 3]
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
from offload.optim import kernels, moments  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import Recorder  # noqa: E402

BYTES_PER_PARAM = 28  # fp32 moments, either workload: see the module docstring
# bytes per parameter of each moment precision (both workloads: see the module docstring)
COMPACT_BYTES_PER_PARAM = {"bf16": 20.0, "int8": 16.0 + 4 / 32}
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


def compact_views(n: int, precision: str) -> tuple:
    numel, dtype = moments.moment_storage(precision, n)
    return tuple(moments.moment_view(precision, torch.zeros(numel, dtype=dtype), n, 0, n) for _ in range(2))


def compact_setup(n: int, bf16: bool, precision: str):
    """offload's compact step (moments in `precision`) on the workload."""
    p = torch.randn(n)
    g = torch.randn(n).to(torch.bfloat16) if bf16 else torch.randn(n)
    out16 = torch.zeros(n, dtype=torch.bfloat16) if bf16 else None
    exp_avg, exp_avg_sq = compact_views(n, precision)
    step = [0]

    def run():
        step[0] += 1
        kernels.adam_step_compact(
            p,
            g,
            exp_avg,
            exp_avg_sq,
            precision=precision,
            position=0,
            rounding_key=moments.rounding_key(0, 0, step[0]),
            step=step[0],
            lr=HP["lr"],
            beta1=HP["betas"][0],
            beta2=HP["betas"][1],
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            param_out16=out16,
        )

    return run


def compact_traffic_setup(n: int, bf16: bool, precision: str):
    """The compact kernel's access pattern without the arithmetic, on scratch arrays."""
    p = torch.randn(n)
    g = torch.zeros(n, dtype=torch.bfloat16) if bf16 else torch.zeros(n)
    out16 = torch.zeros(n, dtype=torch.bfloat16) if bf16 else None
    exp_avg, exp_avg_sq = compact_views(n, precision)
    gtype = _adam_ext.BF16 if bf16 else _adam_ext.F32
    otype = _adam_ext.BF16 if bf16 else _adam_ext.NONE
    moment = _adam_ext.MOMENT_INT8 if precision == "int8" else _adam_ext.MOMENT_BF16
    keep = (p, g, out16, exp_avg, exp_avg_sq)

    def pointer(t) -> int:
        return 0 if t is None else t.data_ptr()

    return lambda: (
        keep
        and _adam_ext.compact_traffic(
            p.data_ptr(),
            g.data_ptr(),
            exp_avg.values.data_ptr(),
            pointer(exp_avg.block_exponents),
            exp_avg_sq.values.data_ptr(),
            pointer(exp_avg_sq.block_exponents),
            pointer(out16),
            n,
            moment,
            gtype,
            otype,
        )
    )


def bnb_setup(n: int):
    """bitsandbytes' AdamW8bit on CPU tensors (fp32 weights and gradient), its state created by
    one untimed step."""
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = bnb.optim.AdamW8bit([p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    return opt.step


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


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--bnb-rounds", type=int, default=3, help="timed rounds of bitsandbytes' AdamW8bit (0: skip it)")
    args = parser.parse_args(argv)
    recorder = Recorder("bench_adam", vars(args))
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
    try:
        import bitsandbytes

        have_bnb = args.bnb_rounds > 0
        print(f"bitsandbytes {bitsandbytes.__version__}: AdamW8bit on the CPU, {args.bnb_rounds} rounds")
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever its backend raises: reported, then skipped
        have_bnb = False
        print(f"bitsandbytes AdamW8bit: not installed (not importable: {type(exc).__name__}: {exc})")
    rates: dict[tuple[int, str], float] = {}  # (size, moments) -> median params/s, fp32 workload
    ratios: dict[tuple[int, str], float] = {}  # (size, moments) -> median per-round speed over fp32 moments
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
            compact = [compact_setup(n, bf16, precision) for precision in COMPACT_BYTES_PER_PARAM]
            compact_limits = [compact_traffic_setup(n, bf16, precision) for precision in COMPACT_BYTES_PER_PARAM]
            # the limits are timed in the same rounds as the workloads: the machine's load changes
            *times, plain, streamed = alternate(fns + compact + compact_limits + traffic_setups(n, bf16), args.repeats)
            compact_times = times[len(fns) : len(fns) + len(compact)]
            compact_limit_times = times[len(fns) + len(compact) :]
            times = times[: len(fns)]
            del fns, compact, compact_limits
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
            where = f"{n / 1e6:g}M {label}, {kernels.get_num_threads()} threads"
            offload_rate = n / statistics.median(times[1])
            for name, t in list(zip(names, times))[:1] + list(zip(names, times))[2:3]:  # torch's, DeepSpeed's
                recorder.add(
                    f"{where}: offload adam_step",
                    "Gparam/s",
                    offload_rate / 1e9,
                    better="higher",
                    peer=name.split("  ", 1)[1],
                    peer_value=n / statistics.median(t) / 1e9,
                    ratio=statistics.median(p / x for p, x in zip(t, times[1])),
                    figures={"of_bandwidth_limit": offload_rate / limit, "limit_gparams": limit / 1e9, "ms": times[1]},
                )
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
            fp32_times = times[1]
            for precision, t, limit_t in zip(COMPACT_BYTES_PER_PARAM, compact_times, compact_limit_times):
                bytes_per_param = COMPACT_BYTES_PER_PARAM[precision]
                med = statistics.median(t)
                rate = n / med
                compact_limit = n / statistics.median(limit_t)
                per_round = statistics.median(f / x for f, x in zip(fp32_times, t))
                vs_fp32 = f"{statistics.median(fp32_times) / med:.2f}x ({per_round:.2f}x)"
                print(
                    f"{f'{label}  offload {precision} moments':40s} {med * 1e3:8.1f} {min(t) * 1e3:8.1f} {rate / 1e9:9.2f} "
                    f"{rate * bytes_per_param / 1e9:6.1f} {vs_fp32 + ' of fp32':>25s} {rate / compact_limit:6.0%}"
                    f"   (limit {compact_limit / 1e9:.2f} G params/s = {compact_limit * bytes_per_param / 1e9:.1f} GB/s "
                    f"at {bytes_per_param:g} B/param)"
                )
                recorder.add(
                    f"{where}: {precision} moments",
                    "speed-up",
                    per_round,
                    better="higher",
                    peer="fp32 moments",
                    ratio=per_round,
                    figures={
                        "gparams": rate / 1e9,
                        "fp32_gparams": n / statistics.median(fp32_times) / 1e9,
                        "of_limit": rate / compact_limit,
                    },
                )
                if not bf16:
                    rates[(n, precision)] = rate
                    ratios[(n, precision)] = per_round
        if have_bnb:
            (bnb_times,) = alternate([bnb_setup(n)], args.bnb_rounds)
            gc.collect()
            bnb_rate = n / statistics.median(bnb_times)
            print(
                f"{'fp32  bitsandbytes AdamW8bit (CPU)':40s} {statistics.median(bnb_times) * 1e3:8.1f} {min(bnb_times) * 1e3:8.1f} "
                f"{bnb_rate / 1e9:9.4f}   ({args.bnb_rounds} rounds)"
            )
            versus_bnb = f"{rates[(n, 'int8')] / bnb_rate:.1f}x"
            recorder.add(
                f"{n / 1e6:g}M fp32, {kernels.get_num_threads()} threads: int8 moments",
                "Gparam/s",
                rates[(n, "int8")] / 1e9,
                better="higher",
                peer="bitsandbytes AdamW8bit (CPU)",
                peer_value=bnb_rate / 1e9,
            )
        else:
            versus_bnb = "not installed"
        print(
            f"ratios at {n / 1e6:g}M, fp32 workload: offload int8 / bnb AdamW8bit {versus_bnb} (medians); "
            f"bf16 / fp32 {ratios[(n, 'bf16')]:.2f}x, int8 / fp32 {ratios[(n, 'int8')]:.2f}x (medians of per-round ratios)"
        )
    recorder.finish()


if __name__ == "__main__":
    main()
