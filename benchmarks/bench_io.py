"""Swap I/O throughput on one path: offload vs fio vs aiofiles vs numpy, in one run.

    .venv/bin/python benchmarks/bench_io.py --path /path/on/nvme [--size 2G] [--repeat 2]

Columns (GB/s = 1e9 bytes/s, sequential, best of --repeat passes):
- offload engine: csrc/aio, O_DIRECT, threads = queue depth, for each (block, depth).
- offload swap store: SwapStore.write_from / read_into (CRC-32C + header, O_DIRECT) at the
  best engine configuration, 128 MiB tensors, all in flight.
- fio: O_DIRECT, io_uring (libaio if io_uring is refused), the same block and depth. Install
  with `apt-get install fio` (Debian/Ubuntu) or `dnf install fio`; when it is absent the
  column is skipped with a note.
- aiofiles: plain-Python async baseline, 8 MiB chunks, buffered, fsync at the end of the
  write, page cache dropped (fsync + posix_fadvise DONTNEED) before the read.
- numpy tofile / fromfile: buffered, same page-cache rules.
Ratios are offload's best over fio's best per op (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from offload.cli.bench_io import filesystem_type, parse_size  # noqa: E402
from offload.config.sizes import format_bytes as human  # noqa: E402
from offload.storage.aio import AioEngine, probe_o_direct  # noqa: E402
from offload.storage.memory import HostBufferPool  # noqa: E402
from offload.storage.swap import SwapStore  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import Recorder  # noqa: E402

CONFIGS = [(1 << 20, 8), (1 << 20, 32), (8 << 20, 8), (8 << 20, 32)]  # (block size, queue depth)
CHUNK = 64 << 20


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def best_of(repeat: int, fn) -> float:
    return max(fn() for _ in range(repeat))


def offload_engine(path: str, buf: torch.Tensor, size: int, bs: int, qd: int, repeat: int) -> dict:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        with AioEngine(bs, qd, qd) as eng:

            def one(op):
                submit = eng.submit_read if op == "read" else eng.submit_write
                t0 = time.perf_counter()
                hs = [submit(fd, buf[off : off + CHUNK], off) for off in range(0, size, CHUNK)]
                for h in hs:
                    h.wait()
                return size / (time.perf_counter() - t0) / 1e9

            one("write")  # lay the file out (unwritten extents -> written)
            return {"write": best_of(repeat, lambda: one("write")), "read": best_of(repeat, lambda: one("read"))}
    finally:
        os.close(fd)


def offload_swap(root: str, buf: torch.Tensor, size: int, bs: int, qd: int, repeat: int) -> dict:
    tensor_bytes = 128 << 20
    names = [f"t{i}" for i in range(size // tensor_bytes)]
    store = SwapStore(root, block_size=bs, queue_depth=qd, threads=qd)
    try:
        store.reserve({n: (tensor_bytes, torch.uint8) for n in names})
        views = {n: buf[i * tensor_bytes : (i + 1) * tensor_bytes] for i, n in enumerate(names)}

        def one(op):
            t0 = time.perf_counter()
            fn = store.read_into if op == "read" else store.write_from
            hs = [fn(n, views[n]) for n in names]
            for h in hs:
                h.wait()
            return len(names) * tensor_bytes / (time.perf_counter() - t0) / 1e9

        one("write")
        return {"write": best_of(repeat, lambda: one("write")), "read": best_of(repeat, lambda: one("read"))}
    finally:
        store.close()


def fio_run(path: str, size: int, bs: int, qd: int, repeat: int) -> dict | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    out = {}
    for op in ("write", "read"):
        best = 0.0
        for _ in range(repeat):
            for engine in ("io_uring", "libaio"):
                cmd = [
                    fio,
                    "--name=bench",
                    f"--filename={path}",
                    f"--size={size}",
                    f"--rw={op}",
                    f"--bs={bs}",
                    f"--iodepth={qd}",
                    f"--ioengine={engine}",
                    "--direct=1",
                    "--numjobs=1",
                    "--output-format=json",
                ]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode == 0:
                    job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
                    best = max(best, job[op]["bw_bytes"] / 1e9)
                    out.setdefault("engine", engine)
                    break
            else:
                raise RuntimeError(f"fio failed: {p.stderr.strip()[-300:]}")
        out[op] = best
    return out


def aiofiles_run(path: str, buf: torch.Tensor, size: int, repeat: int) -> dict | None:
    try:
        import aiofiles
    except ImportError:
        return None
    chunk = 8 << 20
    mv = memoryview(buf.numpy())

    async def write():
        t0 = time.perf_counter()
        async with aiofiles.open(path, "wb") as f:
            for off in range(0, size, chunk):
                await f.write(mv[off : off + chunk])
            await f.flush()
            os.fsync(f.fileno())
        return size / (time.perf_counter() - t0) / 1e9

    async def read():
        drop_cache(path)
        t0 = time.perf_counter()
        n = 0
        async with aiofiles.open(path, "rb") as f:
            while True:
                data = await f.read(chunk)
                if not data:
                    break
                n += len(data)
        return n / (time.perf_counter() - t0) / 1e9

    return {"write": best_of(repeat, lambda: asyncio.run(write())), "read": best_of(repeat, lambda: asyncio.run(read()))}


def numpy_run(path: str, buf: torch.Tensor, size: int, repeat: int) -> dict:
    arr = buf.numpy()[:size]

    def write():
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        return size / (time.perf_counter() - t0) / 1e9

    def read():
        drop_cache(path)
        t0 = time.perf_counter()
        out = np.fromfile(path, dtype=np.uint8)
        assert out.size == size
        return size / (time.perf_counter() - t0) / 1e9

    return {"write": best_of(repeat, write), "read": best_of(repeat, read)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, help="directory on the disk to measure")
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"), help="file size (default 2G)")
    ap.add_argument("--repeat", type=int, default=2, help="passes per measurement, best kept (default 2)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.path)
    size = max(CHUNK, args.size // CHUNK * CHUNK)
    direct = probe_o_direct(root)
    print(
        f"path {root} ({filesystem_type(root)}, O_DIRECT {'on' if direct else 'REFUSED'}), file {human(size)}, "
        f"best of {args.repeat}; GB/s = 1e9 B/s",
        flush=True,
    )
    scratch = os.path.join(root, f".offload-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    pool = HostBufferPool(None, pin=False)
    buf = pool.alloc(size, torch.uint8)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    rows = []
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        print(
            "note: fio not found; its column is skipped. Install it: apt-get install fio (Debian/Ubuntu), "
            "dnf install fio (Fedora/RHEL), brew install fio (macOS)."
        )
    try:
        for bs, qd in CONFIGS:
            ours = offload_engine(scratch, buf, size, bs, qd, args.repeat)
            # fio reuses the file offload just laid out, so neither side pays for first-write extent conversion
            theirs = fio_run(scratch, size, bs, qd, args.repeat) if have_fio else None
            if os.path.exists(scratch):
                os.unlink(scratch)
            rows.append({"block_size": bs, "queue_depth": qd, "offload": ours, "fio": theirs})
            f = lambda d, op: f"{d[op]:6.2f}" if d else "     -"  # noqa: E731
            print(
                f"block {human(bs):>8} depth {qd:>2} (threads {qd:>2}):  offload write {f(ours, 'write')} "
                f"read {f(ours, 'read')}   fio write {f(theirs, 'write')} read {f(theirs, 'read')}"
                f"{'  (' + theirs['engine'] + ')' if theirs else ''}",
                flush=True,
            )
        best_cfg = max(rows, key=lambda r: 2 / (1 / r["offload"]["read"] + 1 / r["offload"]["write"]))
        swap = offload_swap(root, buf, size, best_cfg["block_size"], best_cfg["queue_depth"], args.repeat)
        aio_py = aiofiles_run(scratch, buf, size, args.repeat)
        npy = numpy_run(scratch, buf, size, args.repeat)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
        pool.close()

    def best(key, op):
        vals = [r[key][op] for r in rows if r[key]]
        return max(vals) if vals else None

    print()
    print(f"{'method':<44} {'write GB/s':>10} {'read GB/s':>10}")
    table = [
        ("offload engine, best (O_DIRECT)", best("offload", "write"), best("offload", "read")),
        (
            f"offload swap store, CRC-32C ({human(best_cfg['block_size'])} x {best_cfg['queue_depth']})",
            swap["write"],
            swap["read"],
        ),
        ("fio, best (O_DIRECT)", best("fio", "write"), best("fio", "read")),
        ("aiofiles, 8M chunks (buffered, cache dropped)", *(aio_py[o] if aio_py else None for o in ("write", "read"))),
        ("numpy tofile/fromfile (buffered, cache dropped)", npy["write"], npy["read"]),
    ]
    for name, w, r in table:
        fmt = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
        print(f"{name:<44} {fmt(w)} {fmt(r)}")
    if have_fio:
        for op in ("write", "read"):
            print(
                f"ratio offload/fio {op}: engine {best('offload', op) / best('fio', op):.2f}x, "
                f"swap store {swap[op] / best('fio', op):.2f}x  (target >= 0.90)"
            )
    recorder = Recorder("bench_io", vars(args))
    where = f"{human(size)} file on {filesystem_type(root)}, O_DIRECT {'on' if direct else 'refused'}"
    fio = {op: best("fio", op) for op in ("write", "read")}
    for op in ("write", "read"):
        peer = {"peer": "fio, best (O_DIRECT)", "peer_value": fio[op]} if fio[op] else {}
        figures = {"aiofiles": aio_py and aio_py[op], "numpy": npy[op], "rows": rows}
        recorder.add(f"{where}: {op}, offload engine best", "GB/s", best("offload", op), better="higher", figures=figures, **peer)
        recorder.add(
            f"{where}: {op}, offload swap store (CRC-32C)",
            "GB/s",
            swap[op],
            better="higher",
            figures={"config": best_cfg},
            **peer,
        )
    recorder.finish()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"path": root, "size": size, "rows": rows, "swap_store": swap, "aiofiles": aio_py, "numpy": npy}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
