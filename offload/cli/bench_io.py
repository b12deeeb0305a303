"""`offload bench-io --path DIR`: swap read/write throughput over block size x queue depth x threads.

Writes then reads a scratch file at DIR with the same engine the swap store uses (O_DIRECT
where the filesystem allows it), prints a table in GB/s (1e9 bytes/s), the best `io`
section to paste in a config, how much faster the drive serves reads and writes at once than
one after the other (half the scratch file read while the other half is written, at that
setting: `together`), the same with the reads urgent at a few `io.background_depth` values and
the one to use (it goes into the `io` section), and what an optimizer step whose state streams
from this disk would take at the best speeds and that overlap, per billion params, for each
`optimizer.state_precision` (`step_seconds`; `--config` says which one is yours); `--json`
prints the whole result instead.
The scratch file is removed on every exit path, Ctrl-C and SIGTERM included.

Note on the engine: a pool of `threads` workers each doing one pread/pwrite at a time, so
the number of requests in flight is min(threads, queue_depth); combinations with more
threads than queue depth are skipped (they equal threads == queue_depth).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import time
import uuid

import torch

from offload.config.sizes import format_bytes, parse_bytes
from offload.config.state_layout import StateBytes, StatePrecision
from offload.errors import ConfigError
from offload.plan.disk_time import (
    background_depths_to_try,
    disk_seconds,
    largest_overlap,
    measured_overlap,
    pick_background_depth,
)
from offload.plan.optimizer_plan import step_disk_traffic
from offload.storage.aio import AioEngine, probe_o_direct, round_up
from offload.storage.memory import HostBufferPool

log = logging.getLogger(__name__)

NETWORK_FS = {
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "9p",
    "ceph",
    "glusterfs",
    "lustre",
    "afs",
    "virtiofs",
    "fuse.sshfs",
    "fuse.s3fs",
    "fuse.gcsfuse",
    "beegfs",
    "gpfs",
}
MEMORY_FS = {"tmpfs", "ramfs"}
CHUNK_BYTES = 64 << 20  # one request per 64 MiB of the file; the engine splits each into blocks


def parse_size(text: str) -> int:
    """'4M', '512KiB', '2G', '1048576' -> bytes; KB/MB/GB read as powers of 2, as block sizes are
    meant (sizes.parse_bytes)."""
    try:
        return parse_bytes(text, binary=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}; use e.g. 1048576, 512K, 4M, 2G") from error


def _size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding `path` (longest matching mount point), or 'unknown'."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def path_warnings(path: str, direct: bool) -> tuple[str, list[str]]:
    fstype = filesystem_type(path)
    warnings = []
    if fstype in MEMORY_FS:
        warnings.append(
            f"{path} is on {fstype} (memory): the numbers measure RAM, not a disk; point --path at the NVMe you will swap to"
        )
    if fstype in NETWORK_FS or fstype.startswith("fuse"):
        warnings.append(
            f"{path} is on {fstype}, a network/FUSE filesystem: swap there will be slow and may not "
            "honour O_DIRECT; use a local NVMe"
        )
    if not direct:
        warnings.append(f"{path} refuses O_DIRECT: buffered I/O was measured (page cache dropped before reads)")
    return fstype, warnings


class _Terminated(Exception):
    pass


@contextlib.contextmanager
def _sigterm_raises():
    """Turn SIGTERM into an exception so `finally` blocks (scratch file removal) run."""

    def handler(signum, frame):
        raise _Terminated()

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _one_pass(engine: AioEngine, fd: int, buf: torch.Tensor, size: int, op: str, direct: bool) -> float:
    """Move `size` bytes between buf (reused for every chunk) and the file; returns seconds."""
    chunk = buf.numel()
    if not direct and op == "read":
        _drop_cache(fd)
    submit = engine.submit_read if op == "read" else engine.submit_write
    t0 = time.perf_counter()
    handles = []
    for off in range(0, size, chunk):
        n = min(chunk, size - off)
        handles.append(submit(fd, buf, off, nbytes=n, path="bench scratch file"))
    for h in handles:
        h.wait()
    if not direct and op == "write":
        os.fsync(fd)  # buffered writes count only once they are on the disk
    return time.perf_counter() - t0


def _halves(size: int) -> tuple[int, int]:
    """The bytes a pass of both directions reads (the file's first half, whole pages) and
    writes (the rest)."""
    read_bytes = size // 2 // 4096 * 4096
    return read_bytes, size - read_bytes


def _together_pass(
    engine: AioEngine,
    fd: int,
    read_buf: torch.Tensor,
    write_buf: torch.Tensor,
    size: int,
    direct: bool,
    urgent_reads: bool = False,
) -> float:
    """Read the file's first half while writing its second, the requests of both submitted in
    turn to one engine (as the swap store's step reads and write-backs are); `urgent_reads`:
    the reads in the engine's urgent queue, as a step's are; returns seconds."""
    chunk = read_buf.numel()
    half, _ = _halves(size)
    if not direct:
        _drop_cache(fd)
    t0 = time.perf_counter()
    handles = []
    for off in range(0, max(half, size - half), chunk):
        if off < half:
            handles.append(
                engine.submit_read(
                    fd, read_buf, off, nbytes=min(chunk, half - off), path="bench scratch file", urgent=urgent_reads
                )
            )
        if half + off < size:
            handles.append(
                engine.submit_write(fd, write_buf, half + off, nbytes=min(chunk, size - half - off), path="bench scratch file")
            )
    for h in handles:
        h.wait()
    if not direct:
        os.fsync(fd)
    return time.perf_counter() - t0


def _together(
    fd: int, read_buf, write_buf, size: int, direct: bool, repeat: int, rows: list[dict], io: dict, try_depths: bool
) -> dict:
    """Half the file read while the other half is written at the `io` setting, best of
    `repeat`: its seconds, the GB/s of both directions together, and the drive's overlap
    (`offload.plan.disk_time`) against the read and write rates the sweep measured there. Then
    the same with the reads urgent, as a step's are, at each io.background_depth worth trying
    (`background_depths_to_try`; with `try_depths`): the median seconds of each over rounds
    that take the depths in turn (at least 3: a shared disk drifts between passes), and the
    depth to use (`pick_background_depth`)."""
    with AioEngine(io["block_size"], io["queue_depth"], io["threads"]) as engine:
        seconds = min(_together_pass(engine, fd, read_buf, write_buf, size, direct) for _ in range(repeat))
    urgent_reads: dict[int, float] = {}
    if try_depths:
        depths = background_depths_to_try(min(io["threads"], io["queue_depth"]))
        engines: list[AioEngine] = []
        passes: dict[int, list[float]] = {depth: [] for depth in depths}
        try:
            for depth in depths:
                engines.append(AioEngine(io["block_size"], io["queue_depth"], io["threads"], background_depth=depth))
            for _ in range(max(repeat, 3)):
                for depth, engine in zip(depths, engines, strict=True):
                    passes[depth].append(_together_pass(engine, fd, read_buf, write_buf, size, direct, urgent_reads=True))
        finally:
            for engine in engines:
                engine.close()
        urgent_reads = {depth: statistics.median(times) for depth, times in passes.items()}
    read_bytes, written_bytes = _halves(size)
    setting = {key: io[key] for key in ("block_size", "queue_depth", "threads")}
    rates = {r["op"]: r["gbps"] for r in rows if all(r[k] == v for k, v in setting.items())}
    return {
        **setting,
        "read_bytes": read_bytes,
        "written_bytes": written_bytes,
        "seconds": round(seconds, 6),
        "gbps": round(size / seconds / 1e9, 3),
        "overlap": round(measured_overlap(read_bytes, written_bytes, rates["read"], rates["write"], seconds), 3),
        "largest_overlap": round(largest_overlap(read_bytes, written_bytes, rates["read"], rates["write"]), 3),
        "urgent_reads": [{"background_depth": depth, "seconds": round(s, 6)} for depth, s in urgent_reads.items()],
        "background_depth": pick_background_depth(urgent_reads) if urgent_reads else None,
    }


def run_sweep(
    path: str,
    size: int,
    block_sizes: list[int],
    queue_depths: list[int],
    threads_list: list[int],
    *,
    repeat: int = 1,
    progress=None,
    ops=("write", "read"),
    try_background_depths: bool = True,
) -> dict:
    """Measure every (op, block size, queue depth, threads) on a scratch file under `path`;
    with both ops, then half the file read while the other half is written at the best
    setting (`together`: whether the drive serves both directions at once)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--path {path} is not an existing directory; create it first")
    direct = probe_o_direct(path)
    fstype, warnings = path_warnings(path, direct)
    size = round_up(max(size, 4096))
    combos = [(b, q, t) for b in block_sizes for q in queue_depths for t in threads_list if t <= q]
    if not combos:
        raise ValueError("no combination with threads <= queue_depth; widen --queue-depths or --threads")
    scratch = os.path.join(path, f".offload-bench-io-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    rows = []
    pool = HostBufferPool(None, pin=False, name="bench-io buffer")
    fd = -1
    try:
        buf = pool.alloc(min(size, CHUNK_BYTES), torch.uint8)
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
        os.posix_fallocate(fd, 0, size)
        with AioEngine(max(block_sizes), max(queue_depths), max(threads_list)) as warm:
            _one_pass(warm, fd, buf, size, "write", direct)  # turn unwritten extents into written ones
        measure_together = {"read", "write"} <= set(ops)
        total = len(combos) * len(ops) * repeat + (repeat if measure_together else 0)
        done = 0
        for b, q, t in combos:
            with AioEngine(b, q, t) as engine:
                for op in ops:
                    best = 0.0
                    for _ in range(repeat):
                        secs = _one_pass(engine, fd, buf, size, op, direct)
                        best = max(best, size / secs / 1e9)
                        done += 1
                    row = {"op": op, "block_size": b, "queue_depth": q, "threads": t, "gbps": round(best, 3)}
                    rows.append(row)
                    if progress:
                        progress(done, total, row)
        io = _best_io(rows, ops)
        together = None
        if measure_together:
            write_buf = pool.alloc(buf.numel(), torch.uint8)
            write_buf.copy_(buf)
            together = _together(fd, buf, write_buf, size, direct, repeat, rows, io, try_background_depths)
            if progress:
                progress(total, total, {"op": "both", **io, "gbps": together["gbps"]})
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        pool.close()
    best_rows = {op: max((r for r in rows if r["op"] == op), key=lambda r: r["gbps"]) for op in ops}
    if together is not None and together["background_depth"] is not None:
        io["background_depth"] = together["background_depth"]
    return {
        "path": path,
        "filesystem": fstype,
        "o_direct": direct,
        "size": size,
        "repeat": repeat,
        "warnings": warnings,
        "rows": rows,
        "best": best_rows,
        "io": io,
        "together": together,
    }


def _best_io(rows: list[dict], ops) -> dict:
    """One io section: the combination with the best harmonic mean over the ops measured."""
    by: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in rows:
        by.setdefault((r["block_size"], r["queue_depth"], r["threads"]), {})[r["op"]] = r["gbps"]

    def score(v):
        vals = [v.get(op, 0.0) for op in ops]
        return 0.0 if min(vals) <= 0 else len(vals) / sum(1.0 / x for x in vals)

    (b, q, t), _ = max(by.items(), key=lambda kv: score(kv[1]))
    return {"block_size": b, "queue_depth": q, "threads": t}


PARAMS_PER_ADVICE = 10**9  # the advice is per billion params of optimizer state on the disk


def step_seconds(
    read_gbps: float, write_gbps: float, state: StateBytes, *, accumulation_steps: int = 1, overlap: float = 1.0
) -> dict:
    """Disk bytes and seconds of one optimizer step of PARAMS_PER_ADVICE params whose state
    streams from a disk reading `read_gbps` and writing `write_gbps` GB/s, as wide as `state`
    (plan.step_disk_traffic: master and moments read and written, the gradient written during
    backward and read by the step; with the gradient in RAM, the master and moments alone).
    Seconds are `plan.disk_time.disk_seconds` at the drive's `overlap` of reads and writes (1,
    the default: reads then writes, an upper bound for one drive)."""
    advice = {}
    for where, in_ram in (("gradient_on_disk", False), ("gradient_in_ram", True)):
        traffic = step_disk_traffic(
            PARAMS_PER_ADVICE, PARAMS_PER_ADVICE, state, gradient_in_ram=in_ram, accumulation_steps=accumulation_steps
        )
        seconds = disk_seconds(traffic.read, traffic.written, read_gbps, write_gbps, overlap)
        advice[where] = {"read": traffic.read, "written": traffic.written, "seconds": round(seconds, 3)}
    return advice


def step_advice(result: dict, state: StateBytes, accumulation_steps: int = 1) -> dict:
    """`step_seconds` at the sweep's best read and write speeds and the overlap the drive showed
    (1 where it was not measured) for every state precision (the gradient as wide as
    `state`'s), and which precision is the config's."""
    read, write = result["best"].get("read"), result["best"].get("write")
    if not read or not write or read["gbps"] <= 0 or write["gbps"] <= 0:
        return {}
    overlap = (result.get("together") or {}).get("overlap")
    return {
        "params": PARAMS_PER_ADVICE,
        "config_precision": state.precision.value,
        "gradient_bytes": state.gradient_bytes,
        "overlap": overlap,
        "by_precision": {
            precision.value: step_seconds(
                read["gbps"],
                write["gbps"],
                StateBytes(precision, state.gradient_bytes),
                accumulation_steps=accumulation_steps,
                overlap=overlap or 1.0,
            )
            for precision in StatePrecision
        },
    }


def advice_lines(advice: dict, mine: str = "your config") -> list[str]:
    """The step advice in words, one line per precision (the config's marked with `mine`)."""
    if not advice:
        return []
    overlap = advice.get("overlap")
    if overlap is None:
        how = "reads then writes"
    elif overlap >= 1.05:
        how = f"reads and writes together, {overlap:.2f}x as fast as one after the other as this drive served them"
    else:
        how = "reads then writes: this drive served them no faster together"
    lines = [
        f"an optimizer step per {advice['params'] / 1e9:g}B params of optimizer state on this disk, at the best speeds "
        f"above ({how}; {'fp32' if advice['gradient_bytes'] == 4 else '16-bit'} gradient):"
    ]
    for precision, row in advice["by_precision"].items():
        mark = f" ({mine})" if precision == advice["config_precision"] else ""
        on_disk, in_ram = row["gradient_on_disk"], row["gradient_in_ram"]
        lines.append(
            f"  {precision}{mark}: {format_bytes(on_disk['read'] + on_disk['written'])} moved, {on_disk['seconds']:.2f} s; "
            f"with the gradient in RAM (offload.gradient_memory) {format_bytes(in_ram['read'] + in_ram['written'])}, "
            f"{in_ram['seconds']:.2f} s"
        )
    return lines


def format_table(result: dict) -> str:
    lines = [f"{'op':<6} {'block':>9} {'depth':>6} {'threads':>8} {'GB/s':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['op']:<6} {format_bytes(r['block_size']):>9} {r['queue_depth']:>6} {r['threads']:>8} {r['gbps']:>8.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the disk to measure (e.g. the nvme_path)")
    parser.add_argument(
        "--size", type=parse_size, default=parse_size("2G"), help="scratch file size (default 2G: several times any drive cache)"
    )
    parser.add_argument(
        "--block-sizes", type=_size_list, default=_size_list("1M,4M,8M"), help="comma-separated block sizes (default 1M,4M,8M)"
    )
    parser.add_argument(
        "--queue-depths", type=_int_list, default=_int_list("8,16,32"), help="comma-separated queue depths (default 8,16,32)"
    )
    parser.add_argument(
        "--threads",
        type=_int_list,
        default=_int_list("4,8,16"),
        help="comma-separated thread counts (default 4,8,16; only those <= the depth run)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="passes per combination; the best is kept")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--config",
        help="an offload, DeepSpeed JSON or accelerate YAML config: the step advice marks its optimizer.state_precision "
        "and keeps the gradient as it does (default: fp32 moments, bf16 compute, one micro-batch per step)",
    )


def run(args) -> int:
    for b in args.block_sizes:
        if b <= 0 or b % 4096:
            print(f"offload bench-io: block size {b} must be a positive multiple of 4096", file=sys.stderr)
            return 2
    try:
        state, accumulation = _config_state(getattr(args, "config", None))
    except ConfigError as error:
        print(f"offload bench-io: {error}", file=sys.stderr)
        return 2

    def progress(done, total, row):
        if not args.quiet:
            print(
                f"[{done}/{total}] {row['op']:<5} block {format_bytes(row['block_size']):>8} depth {row['queue_depth']:>3} "
                f"threads {row['threads']:>3}: {row['gbps']:.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )

    try:
        with _sigterm_raises():
            result = run_sweep(
                args.path, args.size, args.block_sizes, args.queue_depths, args.threads, repeat=args.repeat, progress=progress
            )
    except (KeyboardInterrupt, _Terminated):
        print("offload bench-io: interrupted; scratch file removed", file=sys.stderr)
        return 130
    except (OSError, ValueError) as e:
        print(f"offload bench-io: {e}", file=sys.stderr)
        return 1
    for w in result["warnings"]:
        log.warning("%s", w)
    result["step_advice"] = step_advice(result, state, accumulation)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['path']} ({result['filesystem']}, O_DIRECT {'on' if result['o_direct'] else 'refused'}), "
        f"{format_bytes(result['size'])} scratch file"
    )
    print(format_table(result))
    for op, r in result["best"].items():
        print(
            f"best {op}: {r['gbps']:.2f} GB/s at block {format_bytes(r['block_size'])}, depth {r['queue_depth']}, threads {r['threads']}"
        )
    together = result["together"]
    if together:
        print(
            f"read and write at once (half the file each, at the io setting below): {together['gbps']:.2f} GB/s together, "
            f"{together['seconds']:.2f} s; {together['overlap']:.2f}x as fast as one after the other "
            f"(1.00: one queue for both; {together['largest_overlap']:.2f}: neither slows the other)"
        )
        timings = ", ".join(f"{row['background_depth']}: {row['seconds']:.2f} s" for row in together["urgent_reads"])
        print(
            f"the same with the reads urgent, as an optimizer step's, by io.background_depth (places kept for the "
            f"writes; medians): {timings}; io.background_depth {together['background_depth']} below"
        )
    for line in advice_lines(result["step_advice"], mine="your config" if getattr(args, "config", None) else "the default"):
        print(line)
    print("io section to paste in the config:")
    print(json.dumps({"io": result["io"]}, indent=2))
    return 0


def _config_state(path: str | None) -> tuple[StateBytes, int]:
    """The optimizer state's widths and the accumulation steps of the config at `path` (the
    defaults' without one)."""
    from offload.config.schema import Config, load_config
    from offload.config.state_layout import state_bytes_for

    config = load_config(path) if path else Config()
    compute_bytes = 4 if config.precision == "fp32" else 2
    return state_bytes_for(config, compute_bytes), config.gradient_accumulation_steps
