"""Step time of the engine under each placement against plain PyTorch, in one run.

A GPT-2-style model (~124M parameters at the defaults), random init, fixed token batches.
Plain PyTorch: forward, backward, torch.optim.AdamW(fused=True). The engine: the same model
and data under each placement, with the breakdown it measures itself (forward, backward,
step, waits for fetches and for the CPU step). The device is the GPU when there is one, the
CPU otherwise (then "device" memory is host memory too).

    python benchmarks/bench_step.py [--layers 12 --width 768 --batch 4 --seq 256 --steps 5]
    python benchmarks/bench_step.py --clip 1.0 --runs none/cpu@forward,none/cpu@backward

A run is `param/optimizer`, optionally `@overlap` (that run's overlap instead of --overlap).
`--clip N` clips the global gradient norm at N in every run, plain PyTorch included.

`--state-precisions fp32,int8` runs every engine run once per `optimizer.state_precision`, the
precisions of one run back to back (a pair measured minutes apart would compare two machines),
and prints how much faster each compact precision steps than fp32 (fp32 s/step over its s/step,
per round and their median). Issue 34's target: int8 at least 1.5x faster than fp32 with
nvme/nvme, where the optimizer step reads and writes about 12 bytes per parameter instead of 24
(master and moments, each way) besides the weights' traffic:

    python benchmarks/bench_step.py --runs nvme/nvme --state-precisions fp32,int8 --precision bf16 --rounds 3

at 16-bit compute, as the issue's byte targets are (fp32 compute moves 4-byte weights each way,
traffic the moments' precision does not change); the last line gives the whole step's median
against 1.5x.

Plain PyTorch runs before the first engine run and again after each one: each engine run's
ratio is against the mean of the two plain runs around it, so a machine whose speed drifts
over the minutes of the benchmark (a shared 2-core VM drifts by 20%) compares like with like.
`--plain-once` times plain PyTorch only first and last (quicker; ratios against their mean).
`--rounds N` repeats the whole sequence N times and prints each run's ratio per round and
their median: on a noisy machine one round's ratio moves by about 0.15x with nothing changed.

Disk: each engine run's bytes read and written per step (the kernel's count, /proc/self/io, over
the timed steps) per parameter, and their rate. With a run on NVMe the swap path's read and write
bandwidth is measured first, and how much faster it serves reads and writes at once than one
after the other (bench-io's sweep, one setting, 1 GiB; `--disk-check off` skips it): the `% disk`
column is the time those bytes need at those bandwidths and that overlap
(`offload.plan.disk_time`) over the step's time (the fraction of the disk's limit the step
reaches; the check runs again after each round and the best bandwidths seen so far count, as
this machine's shared disk varies 2x from minute to minute), and with
`--state-precisions` the same time gives the disk-bound speed-up over fp32: the most a precision
can gain where the disk, not the compute, sets the step. Runs with swap files also get a line
each of where in the step the disk works: the median step's bytes read and written in its
forward and in its backward and step(), and the seconds of each phase in which not one byte
moved (a thread samples /proc/self/io every 10 ms).
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import offload  # noqa: E402
from offload.plan import disk_time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling benchmarks, when loaded as a module
from bench_state_memory import proc_io  # noqa: E402
from records import Recorder  # noqa: E402

RUNS = "none/cpu,cpu/cpu,nvme/cpu,none/nvme,cpu/nvme,nvme/nvme"
NAME_WIDTH = 58  # the run column; wider when run names carry a state precision


def engine_state_precisions() -> tuple[str, ...]:
    """The `optimizer.state_precision` values this engine accepts: ("fp32",) until the key exists."""
    from offload.config.schema import OptimizerConfig

    if "state_precision" in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        return ("fp32", "bf16", "int8")
    return ("fp32",)


def build_model(layers: int, width: int, seq: int):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=50257,
        n_positions=max(seq, 128),
        n_embd=width,
        n_layer=layers,
        n_head=max(1, width // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def disk_bytes() -> tuple[int, int]:
    """(bytes read, bytes written) to and from storage by this process so far, as the kernel
    counts them (bench_state_memory.proc_io: /proc/self/io; (0, 0) where there is none)."""
    counters = proc_io()
    return counters.get("read_bytes", 0), counters.get("write_bytes", 0)


def phase_disk(samples: list[tuple[float, int, int]], start: float, end: float) -> tuple[int, int, float]:
    """Bytes read, bytes written, and seconds in which not one byte moved, between `start` and
    `end`, from `samples` of (time, bytes read so far, bytes written so far) in time order (a
    DiskSampler's). The bytes are those of the last sample at or before each end; an interval
    between two samples counts as idle when neither counter moved, and counts in the phase its
    later sample falls in."""
    if not samples:
        return 0, 0, 0.0
    times = [sample[0] for sample in samples]
    low, high = bisect.bisect_right(times, start), bisect.bisect_right(times, end)
    first, last = samples[max(0, low - 1)], samples[max(0, high - 1)]
    later = max(low, 1)  # the first interval ending in the phase ends at sample `later`
    idle = sum(
        after[0] - before[0]
        for before, after in zip(samples[later - 1 : high - 1], samples[later:high])
        if before[1:] == after[1:]
    )
    return last[1] - first[1], last[2] - first[2], idle


class DiskSampler:
    """A thread sampling this process's disk counters (disk_bytes) every `interval` seconds while
    it runs: which phase of a step moves the swap files' bytes, and when the disk waits. Owned
    by time_engine: started before the first step, stopped after the last; `samples` is read
    only after stop()."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-disk-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), *disk_bytes()))
            self._stop.wait(self.interval)
        self.samples.append((time.perf_counter(), *disk_bytes()))

    def start(self) -> DiskSampler:
        """Takes the first sample before returning (the thread may start late on a busy machine:
        what the caller does next must fall after a sample), then samples on the thread."""
        self.samples.append((time.perf_counter(), *disk_bytes()))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure_disk(path: str, best: dict[str, float] | None = None) -> dict[str, float]:
    """Sequential read and write GB/s of the swap path and how much faster it serves both at
    once than one after the other (its overlap): bench-io's sweep at one setting (1 MiB blocks,
    depth 16, 8 threads: the best on this machine's disk), best of two passes on a 1 GiB
    scratch file; with `best` (an earlier check), the larger of each. A shared virtual disk
    gave anything from 0.6 to 1.5 GB/s minutes apart: the limit is the best it showed."""
    from offload.cli.bench_io import run_sweep

    result = run_sweep(path, 1 << 30, [1 << 20], [16], [8], repeat=2, try_background_depths=False)
    measured = {
        "read_gbps": result["best"]["read"]["gbps"],
        "write_gbps": result["best"]["write"]["gbps"],
        "overlap": result["together"]["overlap"],
    }
    return {key: max(value, (best or {}).get(key, 0.0)) for key, value in measured.items()}


def disk_seconds(read_bytes: float, written_bytes: float, disk: dict[str, float]) -> float:
    """Seconds the disk needs for these bytes at its measured bandwidths and overlap
    (`offload.plan.disk_time`: reads then writes on a one-queue drive, less on one that serves
    both at once)."""
    return disk_time.disk_seconds(read_bytes, written_bytes, disk["read_gbps"], disk["write_gbps"], disk["overlap"])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_plain(model, batches, device, precision, clip):
    model = copy.deepcopy(model).to(device)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for ids in batches:
        ids = ids.to(device)
        synchronize(device)
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def time_engine(model, batches, param, optimizer, overlap, nvme_path, precision, clip, state_precision=None, io=None):
    """Times the engine on `batches`; `state_precision` None leaves the config's default (fp32);
    `io`: the config's io section (None: its defaults)."""
    optimizer_section = {"lr": 1e-4}
    if state_precision is not None and engine_state_precisions() != ("fp32",):
        optimizer_section["state_precision"] = state_precision  # (an engine without the key has only fp32)
    config = {
        "precision": precision,
        "optimizer": optimizer_section,
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": nvme_path},
        "overlap": overlap,
        "gradient_clipping": clip,
    }
    if io:
        config["io"] = dict(io)
    engine = offload.initialize(copy.deepcopy(model), config)
    times, breakdowns, marks = [], [], []
    # with swap files, where in the step the disk works (forward, then backward and step())
    sampler = DiskSampler().start() if "nvme" in (param, optimizer) and os.path.exists("/proc/self/io") else None
    try:
        for ids in batches:
            synchronize(engine.device.torch_device)
            engine.pop_timings()
            read_before, written_before = disk_bytes()
            started = time.perf_counter()
            out = engine(input_ids=ids, labels=ids)
            if sampler is not None:  # the forward's end, for the disk by phase (a GPU's queue drained)
                synchronize(engine.device.torch_device)
            forward_ended = time.perf_counter()
            engine.backward(out.loss)
            engine.step()
            synchronize(engine.device.torch_device)
            ended = time.perf_counter()
            times.append(ended - started)
            marks.append((started, forward_ended, ended))
            read_after, written_after = disk_bytes()
            breakdown = engine.pop_timings()
            breakdown["disk_read"] = read_after - read_before
            breakdown["disk_written"] = written_after - written_before
            breakdowns.append(breakdown)
        report = engine.memory_report()
        report["speculation"] = dict(engine.speculation_counts)
    finally:
        if sampler is not None:
            sampler.stop()
        engine.close(restore_weights=False)
    if sampler is not None:
        for breakdown, (started, forward_ended, ended) in zip(breakdowns, marks, strict=True):
            for phase, (start, end) in (("fwd", (started, forward_ended)), ("bwd", (forward_ended, ended))):
                read, written, idle = phase_disk(sampler.samples, start, end)
                breakdown[f"{phase}_disk"] = (read, written, idle, end - start)
    return times, breakdowns, report


def one_round(args, runs, model, batches, plain_step, tokens, params, disk) -> list[tuple[str, float, float]]:
    """Times plain PyTorch and every run once (once per state precision with --state-precisions),
    prints the table, and returns (run, s/step, the plain s/step it is compared with, the
    engine's breakdown of that step with the disk bytes averaged over the timed steps) for each
    engine run. `disk`: the swap path's measured bandwidths, or None."""
    plains = [plain_step()]
    rows = []
    jobs = [(run, state) for run in runs for state in (args.state_precisions or [None])]
    with tempfile.TemporaryDirectory(prefix="bench-step-", dir=args.nvme_path or ".") as swap:
        for index, (run, state) in enumerate(jobs):
            placement, _, overlap = run.partition("@")
            param, optimizer = placement.split("/")
            overlap = overlap or args.overlap
            times, breakdowns, report = time_engine(
                model, batches, param, optimizer, overlap, swap, args.precision, args.clip, state, args.io
            )
            timed = range(2, len(times))
            median_index = sorted(timed, key=lambda i: times[i])[(len(times) - 2) // 2]
            breakdown = dict(breakdowns[median_index])
            for key in ("disk_read", "disk_written"):  # bytes move unevenly between steps: their mean
                breakdown[key] = statistics.fmean(breakdowns[i][key] for i in timed)
            name = run_name(param, optimizer, overlap, state)
            if not args.plain_once or index == len(jobs) - 1:
                plains.append(plain_step())
            rows.append((name, times[median_index], breakdown, report))
    if args.plain_once:
        around = [(plains[0] + plains[-1]) / 2] * len(rows)
    else:
        around = [(plains[i] + plains[i + 1]) / 2 for i in range(len(rows))]
    engine_rows = [
        (name, seconds, reference, breakdown) for (name, seconds, breakdown, _), reference in zip(rows, around, strict=True)
    ]
    plain = statistics.mean(plains)
    drift = " ".join(f"{t:.3f}" for t in plains)
    rows.insert(0, (f"plain PyTorch (AdamW fused), mean of {len(plains)}", plain, None, None))
    around.insert(0, plain)

    print(f"plain PyTorch runs, in order (s/step): {drift}")
    header = (
        f"{'run':<{NAME_WIDTH}}{'step s':>8}{'plain':>7}{'ratio':>7}{'tok/s':>8}{'fwd':>7}{'bwd':>7}{'step':>7}"
        f"{'w.fetch':>8}{'w.step':>8}{'dev MB':>8}{'host MB':>8}{'nvme MB':>8}{'disk B/p r+w':>14}{'GB/s':>6}"
        + (f"{'% disk':>7}" if disk else "")
    )
    print(header)
    print("-" * len(header))
    for (name, seconds, breakdown, report), reference in zip(rows, around, strict=True):
        line = f"{name:<{NAME_WIDTH}}{seconds:>8.3f}{reference:>7.3f}{seconds / reference:>7.2f}{tokens / seconds:>8.0f}"
        if breakdown:
            line += "".join(
                f"{breakdown[k]:>7.3f}" if k in ("forward", "backward", "step") else f"{breakdown[k]:>8.3f}"
                for k in ("forward", "backward", "step", "wait_fetch", "wait_step")
            )
            line += "".join(f"{report[tier]['peak'] / 2**20:>8.0f}" for tier in ("device", "host", "nvme"))
            read, written = breakdown["disk_read"], breakdown["disk_written"]
            line += f"{f'{read / params:.2f}+{written / params:.2f}':>14}{(read + written) / seconds / 1e9:>6.2f}"
            if disk:
                line += f"{100 * disk_seconds(read, written, disk) / seconds:>6.0f}%"
            if any(report["speculation"].values()):
                line += "  speculative windows " + " ".join(f"{k} {v}" for k, v in report["speculation"].items())
        print(line, flush=True)
    phased = [(name, breakdown) for name, _, breakdown, _ in rows if breakdown and "fwd_disk" in breakdown]
    if phased:
        print("disk by phase, the median step: MB read / written, and the seconds in which no byte moved, of the phase's")
        for name, breakdown in phased:
            print(f"{name:<{NAME_WIDTH}}" + "   ".join(phase_line(label, breakdown[key]) for label, key in PHASES))
    return engine_rows


# the phases of a step that the disk table splits it into: the forward; the backward and step()
PHASES = (("forward", "fwd_disk"), ("backward+step", "bwd_disk"))


def phase_line(label: str, disk: tuple[int, int, float, float]) -> str:
    """One phase's disk use, as the table prints it."""
    read, written, idle, seconds = disk
    return f"{label} r {read / 1e6:.0f} w {written / 1e6:.0f}, no I/O {idle:.2f} of {seconds:.2f} s"


def parse_io(text: str) -> dict[str, int]:
    """`--io`'s KEY=VALUE,... as the io section it stands for; the config checks the values."""
    from offload.config.schema import IOConfig

    keys = {field.name for field in dataclasses.fields(IOConfig)}
    io = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or key not in keys or not value.strip().isdigit():
            raise ValueError(f"{item!r} is not KEY=VALUE with KEY one of {sorted(keys)} and VALUE a whole number")
        io[key] = int(value)
    return io


def run_name(param: str, optimizer: str, overlap: str, state: str | None) -> str:
    """A run's name in the tables; with a state precision it ends in `state=...`."""
    name = f"offload param={param:<4} optimizer={optimizer:<4} overlap={overlap}"
    return name if state is None else f"{name:<49} state={state}"


def print_state_speedups(ratios: dict[str, list[float]], runs: list[str], args, what: str) -> None:
    """For each run, how much faster each compact state precision is than fp32 in `what` (fp32's
    seconds over its own), per round and the median."""
    print(f"\nstate precision against fp32, same run, back to back, {what}: fp32 s / this s (higher: faster)")
    for run in runs:
        placement, _, overlap = run.partition("@")
        param, optimizer = placement.split("/")
        overlap = overlap or args.overlap
        fp32 = ratios.get(run_name(param, optimizer, overlap, "fp32"), [])
        for state in args.state_precisions:
            if state == "fp32" or not fp32:
                continue
            mine = ratios[run_name(param, optimizer, overlap, state)]
            speedups = [a / b if b > 0 else float("nan") for a, b in zip(fp32, mine)]
            print(
                f"{run_name(param, optimizer, overlap, state):<{NAME_WIDTH}}"
                + "".join(f"{v:>7.2f}x" for v in speedups)
                + f"   median {statistics.median(speedups):.2f}x"
            )


def issue34_verdict(seconds_per_step: dict[str, list[float]], args) -> str:
    """Issue 34's line: int8 state at least 1.5x faster than fp32 with weights and state on NVMe,
    the median over rounds of the whole step, at the 16-bit compute its byte targets assume."""
    target = "target (issue 34): state=int8 at least 1.5x faster than state=fp32 with param nvme / optimizer nvme"
    overlap = args.overlap
    fp32 = seconds_per_step.get(run_name("nvme", "nvme", overlap, "fp32"))
    int8 = seconds_per_step.get(run_name("nvme", "nvme", overlap, "int8"))
    if not fp32 or not int8:
        return f"{target}: not measured (add nvme/nvme to --runs)"
    median = statistics.median(a / b for a, b in zip(fp32, int8))
    verdict = f"{target}: median {median:.2f}x, {'met' if median >= 1.5 else 'not met'}"
    if args.precision != "bf16":
        # the issue's bytes (fp32 <= 28, int8 <= 16 per parameter) assume 16-bit weights; fp32
        # compute moves 4 bytes of weights each way, which do not shrink with the moments
        verdict += " (the issue measures it at --precision bf16: with fp32 compute the weights' traffic doubles)"
    return verdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--overlap", default="auto", choices=["auto", "none", "forward", "backward"], help="default: auto, the engine's"
    )
    parser.add_argument("--runs", default=RUNS, help="param/optimizer[@overlap], comma-separated")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping (global norm) in every run; 0: off")
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one under the working directory)")
    parser.add_argument("--plain-once", action="store_true", help="plain PyTorch first and last only, not around every run")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the whole sequence; prints each run's ratio per round and the median"
    )
    parser.add_argument(
        "--disk-check",
        default="on",
        choices=["on", "off"],
        help="with a run on NVMe, measure the swap path's bandwidth first (about 10 s) for the %% disk column",
    )
    parser.add_argument(
        "--io",
        default="",
        help="the config's io section for every engine run, KEY=VALUE,... (block_size, queue_depth, threads, "
        "background_depth; default: the config's defaults), e.g. threads=8,queue_depth=16,background_depth=2",
    )
    parser.add_argument(
        "--state-precisions",
        default=None,
        help="comma-separated optimizer.state_precision values (fp32, bf16, int8): every run once per value, "
        "back to back, and each compact one's speed-up over fp32 (default: the config's default, fp32)",
    )
    args = parser.parse_args(argv)
    try:
        args.io = parse_io(args.io)
    except ValueError as error:
        parser.error(f"--io: {error}")
    if args.state_precisions:
        args.state_precisions = [p.strip() for p in args.state_precisions.split(",")]
        available = engine_state_precisions()
        unknown = [p for p in args.state_precisions if p not in available]
        if unknown:
            parser.error(f"--state-precisions: {unknown} not accepted by this engine (it has {list(available)})")
        global NAME_WIDTH
        NAME_WIDTH = 68
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.layers, args.width, args.seq)
    count = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50257, (args.batch, args.seq), generator=generator) for _ in range(args.steps + 2)]
    tokens = args.batch * args.seq
    print(
        f"GPT-2 style, {count / 1e6:.0f}M params, batch {args.batch}x{args.seq}, {args.precision}, overlap {args.overlap} (unless @), clip {args.clip or 'off'}, device {device}, torch threads {torch.get_num_threads()}"
        + (f", io {args.io}" if args.io else "")
    )

    def plain_step() -> float:
        return statistics.median(time_plain(model, batches, device, args.precision, args.clip)[2:])

    runs = [run.strip() for run in args.runs.split(",")]
    disk = None
    if args.disk_check == "on" and "nvme" in args.runs and os.path.exists("/proc/self/io"):
        disk = measure_disk(os.path.abspath(args.nvme_path or "."))
        print(
            f"swap path {os.path.abspath(args.nvme_path or '.')}: read {disk['read_gbps']:.2f} GB/s, "
            f"write {disk['write_gbps']:.2f} GB/s, both at once {disk['overlap']:.2f}x as fast as one after the other "
            "(bench-io sweep, 1 MiB blocks, depth 16, 8 threads, 1 GiB, best of 2)"
        )
    recorder = Recorder("bench_step", vars(args))
    workload = f"GPT-2 {count / 1e6:.0f}M b{args.batch}x{args.seq} {args.precision}" + (
        f" clip {args.clip:g}" if args.clip else ""
    )
    references: dict[str, list[float]] = {}
    breakdowns: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {}
    seconds_per_step: dict[str, list[float]] = {}
    optimizer_seconds: dict[str, list[float]] = {}  # the step's optimizer part: its step phase and waits for the CPU step
    bound_seconds: dict[str, list[float]] = {}  # the time the step's disk bytes need at the measured bandwidths
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"\nround {round_index + 1} of {args.rounds}")
        if disk and round_index:
            disk = measure_disk(os.path.abspath(args.nvme_path or "."), disk)
            print(
                f"swap path, best so far: read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s, "
                f"overlap {disk['overlap']:.2f}x"
            )
        for name, seconds, reference, breakdown in one_round(args, runs, model, batches, plain_step, tokens, count, disk):
            references.setdefault(name, []).append(reference)
            breakdowns[name] = breakdown
            ratios.setdefault(name, []).append(seconds / reference)
            seconds_per_step.setdefault(name, []).append(seconds)
            optimizer_seconds.setdefault(name, []).append(breakdown["step"] + breakdown["wait_step"])
            if disk:
                bound_seconds.setdefault(name, []).append(disk_seconds(breakdown["disk_read"], breakdown["disk_written"], disk))
        recorder.record["rows"] = record_rows(workload, count, seconds_per_step, references, ratios, breakdowns, disk)
        recorder.write()
    if args.rounds > 1:
        print(f"\nratio to plain PyTorch in each of {args.rounds} rounds, and their median")
        for name, values in ratios.items():
            print(f"{name:<{NAME_WIDTH}}" + "".join(f"{v:>7.2f}" for v in values) + f"   median {statistics.median(values):.2f}")
    print(
        "ratio: against the plain PyTorch runs just before and after each run (--plain-once: the first and last)\n"
        "targets (issue 14, 2-core CPU as device): param none/optimizer cpu <= 1.10x plain; optimizer nvme <= 1.35x plain"
    )
    if args.state_precisions:
        print_state_speedups(seconds_per_step, runs, args, "whole step")
        print_state_speedups(optimizer_seconds, runs, args, "optimizer part (step + w.step columns)")
        if bound_seconds:
            print_state_speedups(
                bound_seconds,
                [run for run in runs if "nvme" in run],
                args,
                "disk-bound (the disk bytes at the measured bandwidths)",
            )
        if "int8" in args.state_precisions and "fp32" in args.state_precisions:
            verdict = issue34_verdict(seconds_per_step, args)
            print(verdict)
            recorder.note(verdict)
    recorder.finish()
    return 0


def short_name(name: str) -> str:
    """A run's name as the records give it: `none/cpu@forward`, `nvme/nvme@forward state int8`."""
    found = re.match(r"offload param=(\S+)\s+optimizer=(\S+)\s+overlap=(\S+)(?:\s+state=(\S+))?", name)
    if found is None:
        return " ".join(name.split())
    param, optimizer, overlap, state = found.groups()
    return f"{param}/{optimizer}@{overlap}" + (f" state {state}" if state else "")


def record_rows(workload, params, seconds_per_step, references, ratios, breakdowns, disk) -> list[dict]:
    """The record's rows after the rounds so far: each run's median s/step against plain
    PyTorch's (the runs beside it), ahead by the inverse of the median per-round ratio; each
    compact precision's whole step against fp32 state of the same run (median of the rounds'
    fp32 s / its s), as `speed-up`."""
    from records import make_row

    rows = []
    for name, seconds in seconds_per_step.items():
        breakdown = breakdowns[name]
        figures = {
            "seconds_per_round": seconds,
            "plain_per_round": references[name],
            "ratio_per_round": ratios[name],
            "breakdown": breakdown,
            "disk_bytes_per_param": {"read": breakdown["disk_read"] / params, "written": breakdown["disk_written"] / params},
            "disk": disk,
        }
        case = f"{workload} {short_name(name)}"
        rows.append(
            make_row(
                case,
                "s/step",
                statistics.median(seconds),
                peer="plain PyTorch (fused AdamW)",
                peer_value=statistics.median(references[name]),
                ratio=1 / statistics.median(ratios[name]),
                figures=figures,
            )
        )
        if "state=" in name and "state=fp32" not in name:
            base = name.replace(name.split("state=")[1], "fp32")
            if base in seconds_per_step and len(seconds_per_step[base]) == len(seconds):
                per_round = [f / s for f, s in zip(seconds_per_step[base], seconds)]
                speedup = statistics.median(per_round)
                rows.append(
                    make_row(
                        case,
                        "speed-up",
                        speedup,
                        better="higher",
                        peer="fp32 state, same run",
                        ratio=speedup,
                        figures={"per_round": per_round},
                    )
                )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
