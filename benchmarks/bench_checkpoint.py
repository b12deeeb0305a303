"""Checkpoint save / load time and GB/s with the optimizer state on NVMe, against the disk's own
sequential write and read speed (dd, same bytes, same directory) measured in the same run.

The state: --params parameters in units of --unit-params, with fp32 master, exp_avg and
exp_avg_sq on the nvme tier (12 bytes per parameter in the checkpoint). The default, 167M
parameters, is a 500M-element (2.0 GB) fp32 state; --params 500e6 is the state of a 500M
parameter model (6 GB). Page caches are dropped for the files read (posix_fadvise DONTNEED)
so loads read the disk. Also reported: how much the process's resident memory grows during a
save and a load (the state is streamed unit by unit, never gathered).

The load is all or nothing (offload/checkpoint/verify.py): a first pass reads and checks every
element before the second applies it. It is timed against the load before that change in the
same run: the same checks of the index and the small files, and the state read once, each chunk
checked as it is applied (the verified load with its first pass over the data left out).

    PYTHONPATH=. python benchmarks/bench_checkpoint.py --path /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import torch
from torch import nn

import offload
from offload.checkpoint import verify as checkpoint_verify


class Units(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ParameterList([nn.Parameter(torch.empty(numel).uniform_(-1, 1))]) for _ in range(count))
        self.head = nn.Parameter(torch.zeros(8))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples resident memory every 10 ms while in the block."""

    def __enter__(self):
        self.start = rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.growth = self.peak - self.start


def drop_cache(path: str) -> None:
    for root, _, files in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]:
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - started


def python_write(path: str, block: int, blocks: int) -> float:
    """Seconds to write `blocks` x `block` bytes of random values to `path` with Python os.write
    (as the checkpoint and shard writers write tensors) and fsync them; the file is left."""
    buffer = memoryview(torch.randn(block // 4).numpy()).cast("B")
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(blocks):
            os.write(fd, buffer)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def disk_speed(work: str, nbytes: int) -> dict:
    """Seconds to write `nbytes` sequentially (dd from /dev/zero; Python os.write of a random
    16 MiB buffer, as the checkpoint writer does), each flushed, and to read them back cold."""
    probe = os.path.join(work, "dd.bin")
    block = 16 << 20
    blocks = -(-nbytes // block)
    dd_write_s = dd(["if=/dev/zero", f"of={probe}", f"bs={block}", f"count={blocks}", "conv=fsync"])
    os.remove(probe)
    write_s = python_write(probe, block, blocks)
    drop_cache(probe)
    read_s = dd([f"if={probe}", "of=/dev/null", f"bs={block}"])
    os.remove(probe)
    return {"bytes": blocks * block, "dd_write_s": dd_write_s, "write_s": write_s, "read_s": read_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--path", default=".", help="directory on the disk to measure (swap, checkpoint and dd files go in a temp dir there)"
    )
    parser.add_argument(
        "--params", type=float, default=500e6 / 3, help="parameters whose fp32 state (master + 2 moments) is saved"
    )
    parser.add_argument("--unit-params", type=float, default=8e6, help="parameters per unit")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.path)
    try:
        swap = os.path.join(work, "swap")
        os.mkdir(swap)
        unit = int(args.unit_params)
        count = max(1, round(args.params / unit))
        torch.manual_seed(0)
        model = Units(count, unit)
        params = sum(p.numel() for p in model.parameters())
        config = {"precision": "bf16", "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": swap}}
        started = time.perf_counter()
        engine = offload.initialize(model, config)
        init_s = time.perf_counter() - started
        del model
        drop_cache(swap)

        root = os.path.join(work, "ckpt")
        disk_before = disk_speed(work, params * 12)
        with PeakRss() as save_rss:
            started = time.perf_counter()
            path = engine.save_checkpoint(root)
            save_s = time.perf_counter() - started
        state_file = os.path.join(path, "rank0.safetensors")
        nbytes = os.path.getsize(state_file)
        drop_cache(path)
        drop_cache(swap)
        with PeakRss() as load_rss:
            started = time.perf_counter()
            engine.load_checkpoint(root)
            load_s = time.perf_counter() - started
        drop_cache(path)
        drop_cache(swap)
        # the load before all-or-nothing: no first pass over the data (a benchmark's stand-in only)
        with mock.patch.object(checkpoint_verify, "_scan_values", lambda *args: None), PeakRss() as single_rss:
            started = time.perf_counter()
            engine.load_checkpoint(root)
            single_load_s = time.perf_counter() - started
        engine.close(restore_weights=False)
        shutil.rmtree(root)

        # the disk itself, measured before and after the checkpoint (the disk may be shared)
        disk_after = disk_speed(work, nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = 1e9
    rows = []
    for when, disk in (("before", disk_before), ("after", disk_after)):
        rows += [
            (f"dd write, /dev/zero, fsync ({when})", disk["bytes"], disk["dd_write_s"]),
            (f"python write, random data, fsync ({when})", disk["bytes"], disk["write_s"]),
            (f"dd read, cold ({when})", disk["bytes"], disk["read_s"]),
        ]
    rows += [
        ("save_checkpoint (swap -> ckpt)", nbytes, save_s),
        ("load_checkpoint (ckpt -> swap), verified", nbytes, load_s),
        ("load, one pass (before all-or-nothing)", nbytes, single_load_s),
    ]
    print(
        f"state: {params / 1e6:.0f}M params x 3 fp32 tensors (master, exp_avg, exp_avg_sq) = {params * 3 / 1e6:.0f}M elements, "
        f"checkpoint state file {nbytes / gb:.2f} GB; {count} units; placement param=nvme optimizer=nvme; path {os.path.abspath(args.path)}"
    )
    print(f"engine start (reserve + write swap files): {init_s:.1f} s")
    print(f"{'operation':42s} {'GB':>6s} {'seconds':>8s} {'GB/s':>6s}")
    for name, size, seconds in rows:
        print(f"{name:42s} {size / gb:6.2f} {seconds:8.2f} {size / gb / seconds:6.2f}")
    write_rate = max(d["bytes"] / min(d["dd_write_s"], d["write_s"]) for d in (disk_before, disk_after)) / gb
    read_rate = max(d["bytes"] / d["read_s"] for d in (disk_before, disk_after)) / gb
    print(
        f"save: {nbytes / gb / save_s / write_rate:.0%} of the disk's best sequential write ({write_rate:.2f} GB/s); "
        f"load: {nbytes / gb / load_s / read_rate:.0%} of its best sequential read ({read_rate:.2f} GB/s) "
        "(a save also reads the state from swap, a load also writes it to swap: same disk)"
    )
    print(
        f"resident memory growth: save {save_rss.growth / 2**20:.0f} MiB, verified load {load_rss.growth / 2**20:.0f} MiB, "
        f"one-pass load {single_rss.growth / 2**20:.0f} MiB (state {nbytes / 2**20:.0f} MiB; the engine's NVMe slot "
        "buffers are touched for the first time by the save)"
    )
    print(
        f"verified load against the one-pass load: {load_s / single_load_s:.2f}x the time, "
        f"{(load_rss.growth - single_rss.growth) / 2**20:+.0f} MiB of peak resident memory"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "params": params,
                    "state_bytes": nbytes,
                    "save_s": save_s,
                    "load_s": load_s,
                    "single_pass_load_s": single_load_s,
                    "single_pass_load_rss_growth": single_rss.growth,
                    "disk_before": disk_before,
                    "disk_after": disk_after,
                    "save_rss_growth": save_rss.growth,
                    "load_rss_growth": load_rss.growth,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
