"""The scale proof: train a model whose fp32 state does not fit in RAM, with params and
optimizer states on NVMe, and report where the memory and the time go.

    PYTHONPATH=. python benchmarks/scale.py                      # ~3B params, swap under /work/offload-scale
    PYTHONPATH=. python benchmarks/scale.py --params 3e8 --steps 2 --path /mnt/nvme/scratch

What it does, in order:
1. plans a decoder-only transformer of about --params parameters (tied embedding, pre-norm
   blocks of attention + MLP; one unit per block) and checks that the swap path has room for
   the fp32 master, Adam moments, fp32 gradients and 16-bit weights (it prints needed vs free);
2. measures the disk on the same path with the engine's own I/O (`offload bench-io`'s sweep,
   short) and uses the best io settings for the run;
3. builds the model on the meta device (no storage) and hands it to the engine, which
   materialises and initialises it unit by unit straight onto the tiers;
4. runs --steps training steps (batch --batch, sequence --seq, --precision, param nvme, optimizer
   nvme, overlap none so the optimizer step's I/O is measured on its own);
5. prints, and with --results appends to a markdown file: peak RSS (getrusage and psutil),
   peak bytes per tier from memory_report(), disk bytes read/written per phase (the swap
   store's counters, and /proc/self/io as the kernel saw them), the optimizer step's NVMe
   throughput against the measured bandwidth, and the step-time breakdown.

The swap files are removed on every exit path (Ctrl-C and SIGTERM included); a run killed
with SIGKILL leaves `<path>/<run name>/`, which the next run reports (and removes with
--clean-stale).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import time

import psutil
import torch
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import offload  # noqa: E402
from offload.cli.bench_io import run_sweep  # noqa: E402
from offload.model.units import plan_flat_layout  # noqa: E402
from offload.storage.swap_layout import HEADER_SIZE  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import Recorder  # noqa: E402

GB = 1e9
GIB = 1 << 30
RUN_PREFIX = "scale-run-"


# ---- the model -------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention with rotary positions, GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm2 = nn.RMSNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Decoder(nn.Module):
    """Token embedding (tied with the output head), `depth` blocks, final norm."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        head_dim = width // heads
        # computed, not learned: registered on the CPU explicitly so that a model built under
        # torch.device("meta") still has real values (see offload.model.materialize)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        angles = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        # the head shares the embedding (N(0, 1) init): scaled so the initial logits are O(1)
        logits = F.linear(self.norm(x), self.embed.weight) * self.norm.weight.shape[0] ** -0.5
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def block_params(width: int) -> int:
    return 12 * width * width + 2 * width


def plan_shape(target: float, vocab: int, head_dim: int = 128) -> tuple[int, int, int]:
    """(width, depth, heads) for about `target` params: among widths (multiples of head_dim)
    whose nearest depth lands within 10% of the target, the one whose depth is nearest
    width / 100 (Llama-like shapes: 2048 x 22, 3200 x 26, 4096 x 32)."""
    candidates = []
    for heads in range(1, 257):
        width = heads * head_dim
        rest = target - vocab * width - width
        if rest <= 0:
            break
        depth = max(2, round(rest / block_params(width)))
        total = count_params(vocab, width, depth)
        if abs(total - target) <= 0.1 * target:
            candidates.append((abs(math.log(depth / (width / 100))), (width, depth, heads)))
    if not candidates:
        raise SystemExit(f"--params {target:.3g} cannot be planned with vocab {vocab}; lower --vocab or give --width/--depth")
    return min(candidates)[1]


def count_params(vocab: int, width: int, depth: int) -> int:
    return vocab * width + width + depth * block_params(width)


def unit_numels(vocab: int, width: int, depth: int) -> list[int]:
    root = vocab * width + width  # embedding (tied head) + final norm
    return [root] + [block_params(width)] * depth


# ---- measurements ------------------------------------------------------------------------
def swap_bytes_needed(numels: list[int]) -> int:
    """Bytes of swap files: per unit 4 fp32 states + 1 bf16 copy, each with a header, padded."""
    total = 0
    for numel in numels:
        shard = plan_flat_layout([numel]).shard_numel
        for nbytes in (4, 4, 4, 4, 2):
            total += HEADER_SIZE + -(-shard * nbytes // 4096) * 4096
    return total


def proc_io() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":")
                values[key.strip()] = int(value)
    except OSError:
        pass
    return values


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> dict[str, int]:
    """VmHWM (resettable peak), ru_maxrss (lifetime peak), current RSS."""
    hwm = 0
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    return {
        "vm_hwm": hwm,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_now": psutil.Process().memory_info().rss,
    }


class Sampler:
    """Polls psutil RSS in a thread (peak as psutil sees it, independent of VmHWM)."""

    def __init__(self, interval: float = 0.2) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            self._stop.wait(interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


class _Terminated(Exception):
    pass


@contextlib.contextmanager
def sigterm_raises():
    def handler(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stale_runs(path: str) -> list[str]:
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if name.startswith(RUN_PREFIX):
                pid = name[len(RUN_PREFIX) :].split("-")[0]
                if not (pid.isdigit() and psutil.pid_exists(int(pid))):
                    found.append(os.path.join(path, name))
    return found


def fmt_gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def fmt_gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ---- the run -----------------------------------------------------------------------------
def measure_disk(path: str, size: int, quick: bool) -> dict:
    """Sequential read and write bandwidth (bench-io's sweep) and, with the best io settings,
    the aggregate bandwidth of reads and writes in flight together (as in the optimizer step,
    which reads the next unit while writing the previous one)."""
    blocks, depths, threads = ([8 << 20], [32], [8]) if quick else ([1 << 20, 8 << 20], [8, 32], [4, 8])
    started = time.perf_counter()
    result = run_sweep(path, size, blocks, depths, threads)
    io = result["io"]
    mixed = measure_mixed(path, size, io, result["o_direct"])
    return {
        "read_gbps": result["best"]["read"]["gbps"],
        "write_gbps": result["best"]["write"]["gbps"],
        "mixed_gbps": mixed,
        "io": io,
        "o_direct": result["o_direct"],
        "filesystem": result["filesystem"],
        "rows": result["rows"],
        "seconds": time.perf_counter() - started,
        "size": result["size"],
    }


def measure_mixed(path: str, size: int, io: dict, direct: bool) -> float:
    """GB/s of `size` bytes read from one scratch file while `size` bytes are written to another,
    through one engine with the given io settings (reads and writes submitted alternately)."""
    from offload.storage.aio import AioEngine, round_up
    from offload.storage.memory import HostBufferPool

    chunk = 64 << 20
    size = round_up(size, chunk)
    names = [os.path.join(path, f".scale-mixed-{os.getpid()}-{i}.tmp") for i in range(2)]
    pool = HostBufferPool(None, pin=False, name="scale disk check")
    fds = []
    try:
        read_buf = pool.alloc(chunk, torch.uint8)
        write_buf = pool.alloc(chunk, torch.uint8)
        write_buf.copy_(torch.randint(0, 256, (chunk,), dtype=torch.uint8))
        for name in names:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
            fds.append(fd)
            os.posix_fallocate(fd, 0, size)
        with AioEngine(io["block_size"], io["queue_depth"], io["threads"]) as engine:
            for handle in [engine.submit_write(fds[0], write_buf, off) for off in range(0, size, chunk)]:
                handle.wait()  # file 0 holds data, so its reads really read
            if not direct:
                os.fsync(fds[0])
                os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_DONTNEED)
            started = time.perf_counter()
            handles = []
            for off in range(0, size, chunk):
                handles.append(engine.submit_read(fds[0], read_buf, off))
                handles.append(engine.submit_write(fds[1], write_buf, off))
            for handle in handles:
                handle.wait()
            if not direct:
                os.fsync(fds[1])
            return 2 * size / (time.perf_counter() - started) / GB
    finally:
        for fd in fds:
            os.close(fd)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        pool.close()


def run(args) -> dict:
    vocab = args.vocab
    width, depth, heads = (args.width, args.depth, args.width // 128) if args.width else plan_shape(args.params, vocab)
    numel = count_params(vocab, width, depth)
    numels = unit_numels(vocab, width, depth)
    needed = swap_bytes_needed(numels)
    os.makedirs(args.path, exist_ok=True)
    stale = stale_runs(args.path)
    for directory in stale:
        if args.clean_stale:
            shutil.rmtree(directory, ignore_errors=True)
            print(f"removed stale swap directory {directory}")
        else:
            print(f"WARNING: stale swap directory from a killed run: {directory} (remove it, or pass --clean-stale)")
    free = shutil.disk_usage(args.path).free
    ram = psutil.virtual_memory()
    print(
        f"model: {numel / 1e9:.3f}B params (vocab {vocab}, width {width}, {depth} blocks, {heads} heads); "
        f"fp32 weights {fmt_gb(4 * numel)}, fp32 master+Adam+grad {fmt_gb(16 * numel)}, RAM {fmt_gib(ram.total)}"
    )
    print(f"disk: swap needs {fmt_gb(needed)} at {args.path}, {fmt_gb(free)} free")
    if needed + args.bench_size + (1 << 30) > free:
        raise SystemExit(
            f"not enough disk at {args.path}: need {fmt_gb(needed)} (+ {fmt_gb(args.bench_size)} for the "
            f"disk measurement), {fmt_gb(free)} free; free space, pick --path on a larger disk or lower --params"
        )

    disk = None
    if not args.skip_bench:
        print(f"measuring the disk at {args.path} ({fmt_gb(args.bench_size)} scratch file) ...", flush=True)
        disk = measure_disk(args.path, args.bench_size, args.quick_bench)
        print(
            f"disk: read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s, "
            f"reads and writes together {disk['mixed_gbps']:.2f} GB/s "
            f"({disk['filesystem']}, O_DIRECT {'on' if disk['o_direct'] else 'off'}), best io {disk['io']} "
            f"[{disk['seconds']:.0f} s]",
            flush=True,
        )
    io = disk["io"] if disk else {"block_size": args.block_size, "queue_depth": args.queue_depth, "threads": args.io_threads}
    config = {
        "precision": args.precision,
        "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.0},
        "offload": {
            "param": "nvme",
            "optimizer": args.optimizer,
            "nvme_path": args.path,
            "max_host_memory": args.max_host_memory,
            **({"buffer_count": args.buffer_count} if args.buffer_count is not None else {}),
        },
        "prefetch": {"depth": args.prefetch},
        "overlap": "none",
        "io": io,
    }
    run_name = f"{RUN_PREFIX}{os.getpid()}"
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "params": numel,
        "shape": {"vocab": vocab, "width": width, "depth": depth, "heads": heads},
        "batch": args.batch,
        "seq": args.seq,
        "swap_needed": needed,
        "disk_free": free,
        "disk": {k: v for k, v in (disk or {}).items() if k != "rows"},
        "config": config,
    }

    torch.manual_seed(0)
    reset_ok = reset_peak_rss()
    rss_start = psutil.Process().memory_info().rss
    sampler = Sampler()
    engine = None
    try:
        started = time.perf_counter()
        with torch.device("meta"):
            model = Decoder(vocab, width, depth, heads)
        io_before = proc_io()
        engine = offload.initialize(model, config, run_name=run_name)
        swap = engine.store.swap
        init_seconds = time.perf_counter() - started
        io_after = proc_io()
        report["init"] = {
            "seconds": init_seconds,
            "swap_written": swap.bytes_written,
            "proc_write_bytes": io_after.get("write_bytes", 0) - io_before.get("write_bytes", 0),
            "rss": peak_rss_bytes(),
        }
        print(
            f"init: {init_seconds:.1f} s, wrote {fmt_gb(swap.bytes_written)} of swap, "
            f"peak RSS so far {fmt_gib(report['init']['rss']['vm_hwm'])}",
            flush=True,
        )
        generator = torch.Generator().manual_seed(1)
        steps = []
        for step in range(args.steps):
            ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
            record = {"step": step + 1}
            phases = {}
            for phase in ("forward", "backward", "step"):
                before = (swap.bytes_read, swap.bytes_written, proc_io(), time.perf_counter())
                if phase == "forward":
                    loss = engine(ids[:, :-1], ids[:, 1:])
                elif phase == "backward":
                    engine.backward(loss)
                else:
                    engine.step()
                after = (swap.bytes_read, swap.bytes_written, proc_io(), time.perf_counter())
                phases[phase] = {
                    "seconds": after[3] - before[3],
                    "swap_read": after[0] - before[0],
                    "swap_written": after[1] - before[1],
                    "proc_read_bytes": after[2].get("read_bytes", 0) - before[2].get("read_bytes", 0),
                    "proc_write_bytes": after[2].get("write_bytes", 0) - before[2].get("write_bytes", 0),
                }
            record["loss"] = float(loss.detach())
            record["phases"] = phases
            record["engine_timings"] = engine.pop_timings()
            record["step_timings"] = engine.stepper.pop_timings()
            record["rss"] = peak_rss_bytes()
            steps.append(record)
            print(step_line(record, disk), flush=True)
        report["steps"] = steps
        report["memory_report"] = engine.memory_report()
    finally:
        peak_sampled = sampler.stop()
        if engine is not None:
            engine.close(restore_weights=False)  # never gather the whole model
        shutil.rmtree(os.path.join(args.path, run_name), ignore_errors=True)  # a failed initialize leaves it
    report["rss"] = {**peak_rss_bytes(), "psutil_sampled_peak": peak_sampled, "at_start": rss_start, "vm_hwm_reset": reset_ok}
    report["swap_left"] = os.path.exists(os.path.join(args.path, run_name))
    return report


def machine_description() -> str:
    ram = psutil.virtual_memory().total
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    cores = len(os.sched_getaffinity(0))
    return f"{cores} cores ({cpu}), {ram / GIB:.0f} GiB RAM, no GPU (the CPU stands in as the device), torch {torch.__version__}"


def step_line(record: dict, disk: dict | None) -> str:
    p = record["phases"]
    s = p["step"]
    gbps = (s["swap_read"] + s["swap_written"]) / s["seconds"] / GB
    line = (
        f"step {record['step']}: loss {record['loss']:.4f}; forward {p['forward']['seconds']:.1f} s, "
        f"backward {p['backward']['seconds']:.1f} s, step {s['seconds']:.1f} s "
        f"(read {fmt_gb(s['swap_read'])}, wrote {fmt_gb(s['swap_written'])}, {gbps:.2f} GB/s"
    )
    if disk:
        line += f", {100 * step_efficiency(s, disk):.0f}% of the disk"
    return line + f"); peak RSS {fmt_gib(record['rss']['vm_hwm'])}"


def step_efficiency(phase: dict, disk: dict) -> float:
    """The step's NVMe throughput (bytes read + written over its time) against the disk's
    measured bandwidth for reads and writes in flight together (`mixed_gbps`)."""
    return (phase["swap_read"] + phase["swap_written"]) / phase["seconds"] / GB / disk["mixed_gbps"]


def serial_efficiency(phase: dict, disk: dict) -> float:
    """Time the step's bytes need at the sequential read and write bandwidths, one after the
    other, over the time the step took (above 1 when the disk overlaps reads and writes)."""
    ideal = phase["swap_read"] / (disk["read_gbps"] * GB) + phase["swap_written"] / (disk["write_gbps"] * GB)
    return ideal / phase["seconds"]


def markdown(report: dict, args) -> str:
    disk = report["disk"]
    steps = report["steps"]
    later = steps[1:] or steps
    lines = [
        f"## Scale run: {report['params'] / 1e9:.2f}B params, param on NVMe, optimizer {args.optimizer} ({report['date']})",
        "",
        f"Machine: {report['machine']}. Shared with other engineers' jobs while it ran (load average "
        f"{os.getloadavg()[0]:.1f} at the end), so times are upper bounds.",
        "",
        f"Command: `PYTHONPATH=. python benchmarks/scale.py {' '.join(sys.argv[1:])}`",
        "",
        f"Model: decoder-only, vocab {report['shape']['vocab']}, width {report['shape']['width']}, "
        f"{report['shape']['depth']} blocks, {report['shape']['heads']} heads, tied embedding; built on the meta device "
        f"and materialised unit by unit. fp32 weights {fmt_gb(4 * report['params'])}; fp32 master + Adam + fp32 grads "
        f"{fmt_gb(16 * report['params'])}. Batch {report['batch']} x {report['seq']} tokens, {args.precision}, overlap none, "
        f"io {report['config']['io']}, buffer_count {report['config']['offload'].get('buffer_count', 'auto')}, prefetch depth "
        f"{report['config']['prefetch']['depth']}.",
        "",
        f"Disk: swap needed {fmt_gb(report['swap_needed'])}, free before the run {fmt_gb(report['disk_free'])}.",
    ]
    if disk:
        lines.append(
            f"Measured on the same path (engine I/O, {fmt_gb(disk['size'])} scratch, {disk['filesystem']}, "
            f"O_DIRECT {'on' if disk['o_direct'] else 'off'}): read {disk['read_gbps']:.2f} GB/s, write "
            f"{disk['write_gbps']:.2f} GB/s, reads and writes in flight together {disk['mixed_gbps']:.2f} GB/s "
            "(aggregate)."
        )
    rss = report["rss"]
    lines += [
        "",
        f"Peak RSS: {fmt_gib(rss['vm_hwm'])} (VmHWM, reset at start: {rss['vm_hwm_reset']}); ru_maxrss "
        f"{fmt_gib(rss['ru_maxrss'])}; psutil sampled peak {fmt_gib(rss['psutil_sampled_peak'])}; RSS before building "
        f"the model {fmt_gib(rss['at_start'])}.",
        "",
        "Peak bytes per tier (memory_report):",
        "",
        "| tier | peak | by category (peak) |",
        "| --- | --- | --- |",
    ]
    for tier in ("device", "host", "nvme"):
        values = report["memory_report"][tier]
        cats = ", ".join(f"{k} {fmt_gb(v['peak'])}" for k, v in values["by_category"].items())
        lines.append(f"| {tier} | {fmt_gb(values['peak'])} | {cats} |")
    init = report["init"]
    lines += [
        "",
        f"Init (build on meta + materialise + write the initial state): {init['seconds']:.1f} s, "
        f"{fmt_gb(init['swap_written'])} written ({fmt_gb(init['proc_write_bytes'])} by /proc/self/io).",
        "",
        "| step | loss | forward s | backward s | step s | fwd read | bwd read / written | step read / written | "
        "step GB/s | % of disk (mixed) | % (serial model) | /proc/self/io step read / written |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in steps:
        p = r["phases"]
        s = p["step"]
        eff = f"{100 * step_efficiency(s, disk):.0f}% | {100 * serial_efficiency(s, disk):.0f}%" if disk else "- | -"
        lines.append(
            f"| {r['step']} | {r['loss']:.4f} | {p['forward']['seconds']:.1f} | {p['backward']['seconds']:.1f} | "
            f"{s['seconds']:.1f} | {fmt_gb(p['forward']['swap_read'])} | {fmt_gb(p['backward']['swap_read'])} / "
            f"{fmt_gb(p['backward']['swap_written'])} | {fmt_gb(s['swap_read'])} / {fmt_gb(s['swap_written'])} | "
            f"{(s['swap_read'] + s['swap_written']) / s['seconds'] / GB:.2f} | {eff} | "
            f"{fmt_gb(s['proc_read_bytes'])} / {fmt_gb(s['proc_write_bytes'])} |"
        )
    lines += [
        "",
        "Step-time breakdown (engine.pop_timings and the optimizer worker's, seconds):",
        "",
        "| step | forward | backward | step | wait_fetch | wait_step | step: wait_read | wait_write | adam | publish |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in steps:
        e, t = r["engine_timings"], r["step_timings"]
        lines.append(
            f"| {r['step']} | {e['forward']:.1f} | {e['backward']:.1f} | {e['step']:.1f} | {e['wait_fetch']:.1f} | "
            f"{e['wait_step']:.1f} | {t['wait_read']:.1f} | {t['wait_write']:.1f} | {t['adam']:.1f} | {t['publish']:.1f} |"
        )
    if disk:
        mean = sum(step_efficiency(r["phases"]["step"], disk) for r in later) / len(later)
        serial = sum(serial_efficiency(r["phases"]["step"], disk) for r in later) / len(later)
        lines += [
            "",
            f"Optimizer step NVMe traffic at {100 * mean:.0f}% of the measured disk bandwidth for reads and "
            f"writes together (mean of steps {later[0]['step']}..{later[-1]['step']}); by the serial model (its "
            f"read bytes at the read speed, then its written bytes at the write speed) {100 * serial:.0f}%.",
        ]
    lines.append("")
    return "\n".join(lines)


def comparison(report: dict, peer: dict, args) -> str:
    """The two placements of one invocation side by side: seconds per step after the first
    (which also reads never-written state), optimizer-step NVMe bytes, peak RSS."""

    def summary(r: dict) -> tuple[float, float, float]:
        later = r["steps"][1:] or r["steps"]
        seconds = sum(sum(phase["seconds"] for phase in s["phases"].values()) for s in later) / len(later)
        nvme = sum(s["phases"]["step"]["swap_read"] + s["phases"]["step"]["swap_written"] for s in later) / len(later)
        return seconds, nvme, r["rss"]["vm_hwm"]  # VmHWM is reset when each run starts

    ours, theirs = summary(report), summary(peer)
    name = args.optimizer + (f" (max_host_memory {args.max_host_memory})" if args.max_host_memory else "")
    return "\n".join(
        [
            f"## optimizer {name} against optimizer {args.against}, same model, same run",
            "",
            "| optimizer | s/step | step NVMe bytes | peak RSS |",
            "| --- | --- | --- | --- |",
            f"| {name} | {ours[0]:.1f} | {fmt_gb(ours[1])} | {fmt_gib(ours[2])} |",
            f"| {args.against} | {theirs[0]:.1f} | {fmt_gb(theirs[1])} | {fmt_gib(theirs[2])} |",
            "",
            f"{name} is {theirs[0] / ours[0]:.2f}x the speed of {args.against} (s/step ratio).",
            "",
        ]
    )


def step_seconds(report: dict) -> float:
    """Seconds per step after the first (which also reads never-written state)."""
    later = report["steps"][1:] or report["steps"]
    return sum(sum(phase["seconds"] for phase in s["phases"].values()) for s in later) / len(later)


def record_report(args, report: dict, peer: dict | None) -> None:
    """The run's record: seconds per step (against the --against run), the optimizer step's NVMe
    rate against the disk's measured rate for reads and writes together, the peak RSS."""
    shape = report["shape"]
    case = (
        f"{report['params'] / 1e9:.2f}B ({shape['width']} x {shape['depth']}) nvme/{args.optimizer}"
        + (f" (max_host_memory {args.max_host_memory})" if args.max_host_memory else "")
        + f" b{report['batch']}x{report['seq']} {args.precision}"
    )
    recorder = Recorder("scale", vars(args))
    figures = {key: report[key] for key in ("shape", "swap_needed", "disk", "config", "init", "rss") if key in report}
    figures["steps"] = [{"loss": s["loss"], "phases": s["phases"]} for s in report["steps"]]
    against = {"peer": f"nvme/{args.against}, same run", "peer_value": step_seconds(peer)} if peer else {}
    recorder.add(case, "s/step", step_seconds(report), figures=figures, **against)
    disk = report.get("disk") or {}
    later = report["steps"][1:] or report["steps"]
    if disk.get("mixed_gbps"):
        rate = statistics.fmean(
            (s["phases"]["step"]["swap_read"] + s["phases"]["step"]["swap_written"]) / s["phases"]["step"]["seconds"] / GB
            for s in later
        )
        recorder.add(
            case,
            "step NVMe GB/s",
            rate,
            better="higher",
            peer="the path's disk, reads and writes together",
            peer_value=disk["mixed_gbps"],
        )
    recorder.add(case, "peak RSS GiB", report["rss"]["vm_hwm"] / GIB)
    recorder.finish()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=3e9, help="target parameter count (default 3e9)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=0, help="override the planned width (multiple of 128)")
    parser.add_argument("--depth", type=int, default=0, help="with --width: number of blocks")
    parser.add_argument("--path", default="/work/offload-scale", help="swap directory (created if missing)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--buffer-count", type=int, default=None, help="offload.buffer_count (default: unset, the engine shapes the slots)"
    )
    parser.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp16", "fp32"],
        help="compute precision; on a CPU without bf16 matmul units fp32 is far faster (torch's bf16 backward "
        "matmuls fall back to a reference loop there, ~40x the forward)",
    )
    parser.add_argument(
        "--optimizer",
        default="nvme",
        choices=["nvme", "auto", "cpu"],
        help="offload.optimizer (auto: RAM up to --max-host-memory, the rest on NVMe)",
    )
    parser.add_argument("--max-host-memory", default=None, help="offload.max_host_memory for --optimizer auto, e.g. 8GiB")
    parser.add_argument(
        "--against",
        choices=["nvme", "auto", "cpu"],
        help="then train the same model again with this offload.optimizer (the peer) and print both and the ratio",
    )
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--bench-size", type=int, default=2 << 30, help="bytes of the disk measurement's scratch file")
    parser.add_argument("--quick-bench", action="store_true", help="measure one io setting (8M blocks, depth 32, 8 threads)")
    parser.add_argument("--skip-bench", action="store_true", help="no disk measurement; use --block-size etc.")
    parser.add_argument("--block-size", type=int, default=8 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--clean-stale", action="store_true", help="remove swap directories of killed scale runs")
    parser.add_argument(
        "--results", help="also append the report as markdown to this file (the run's record goes to benchmarks/results/)"
    )
    parser.add_argument("--json", help="write the whole report as JSON here")
    args = parser.parse_args(argv)
    if args.width and (args.width % 128 or not args.depth):
        parser.error("--width must be a multiple of 128 and comes with --depth")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    peer_args = argparse.Namespace(**{**vars(args), "optimizer": args.against, "skip_bench": True})
    try:
        with sigterm_raises():
            report = run(args)
            if args.against:
                io = report["config"]["io"]  # the io settings the first run measured
                peer_args.block_size, peer_args.queue_depth, peer_args.io_threads = (
                    io["block_size"],
                    io["queue_depth"],
                    io["threads"],
                )
                peer = run(peer_args)
    except (KeyboardInterrupt, _Terminated):
        print("interrupted; swap files removed", file=sys.stderr)
        return 130
    text = markdown(report, args)
    if args.against:
        text += "\n" + markdown(peer, peer_args) + "\n" + comparison(report, peer, args)
    print()
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    record_report(args, report, peer if args.against else None)
    if report["swap_left"]:
        print(f"WARNING: swap directory left under {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
