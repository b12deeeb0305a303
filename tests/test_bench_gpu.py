"""benchmarks/bench_gpu.py runs end to end (tiny model, the CPU as the device): every line of its
table is filled, the floor and the ratio to it are printed. Timings are not checked here.

One run of the script as a user runs it (a process for the limits and for each run, the table
from their JSON); the other kinds of run and --checkpointing go through the same main() and
table in this process, each run's child() called here instead of in a process of its own: a
process per run imports torch and transformers again, seconds each on two cores."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "bench_gpu.py")
COMMON = ["--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "1"]


def run_bench(tmp_path, runs: str, *extra: str) -> subprocess.CompletedProcess:
    args = [*COMMON, "--runs", runs, "--nvme-path", str(tmp_path)]
    result = subprocess.run([sys.executable, SCRIPT, *args, *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.fixture
def bench_gpu(monkeypatch):
    """The bench_gpu module, its spawn() running each child in this process (the limits, which
    the subprocess run measures, are a fixed CPU Adam rate here)."""
    import json

    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_gpu as module

    def spawn_here(args, run: str) -> dict:
        if run == "limits":
            return {"adam_params_per_s": 1e9, "gpu_peak": 0, "rss_peak": 0, "device": "cpu"}
        out = os.path.join(args.nvme_path, f"{run.replace('/', '-')}.json")
        module.child(argparse.Namespace(**{**vars(args), "child": run, "out": out}))
        with open(out) as handle:
            return json.load(handle)

    monkeypatch.setattr(module, "spawn", spawn_here)
    return module


def run_here(bench_gpu, capsys, tmp_path, runs: str, *extra: str) -> list[str]:
    assert bench_gpu.main([*COMMON, "--runs", runs, "--nvme-path", str(tmp_path), *extra]) == 0
    return capsys.readouterr().out.splitlines()


def offload_lines_filled(lines: list[str], prefixes: tuple[str, ...]) -> bool:
    found = [line for line in lines if line.startswith(prefixes)]
    return len(found) == len(prefixes) and all("forward=" in line and "nan" not in line.split("forward=")[0] for line in found)


def test_bench_gpu_smoke(tmp_path):
    """The script itself: limits, plain PyTorch and a speculative (overlap backward, clipped)
    offload run, each in its own process."""
    result = run_bench(tmp_path, "plain,none/cpu@backward", "--clip", "1.0")
    lines = result.stdout.splitlines()
    assert any(line.startswith("plain ") for line in lines), result.stdout
    assert offload_lines_filled(lines, ("none/cpu@backward",)), result.stdout
    assert "CPU Adam" in result.stdout
    # each run's line as it ends, before the table: a lease cut short keeps the runs that finished
    progress = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[limits", "[1/2", "[2/2"], result.stdout
    assert "none/cpu@backward: " in progress[2] and " s/step" in progress[2], progress
    assert os.listdir(tmp_path) == []  # each run's swap directory is removed


def test_bench_gpu_placements(bench_gpu, capsys, tmp_path):
    """The other placements of the smoke run (weights on the device, weights and state on NVMe)."""
    lines = run_here(bench_gpu, capsys, tmp_path, "plain,none/cpu,nvme/nvme", "--clip", "1.0")
    assert any(line.startswith("plain ") for line in lines), lines
    assert offload_lines_filled(lines, ("none/cpu ", "nvme/nvme")), lines


def test_bench_gpu_with_checkpointing(bench_gpu, capsys, tmp_path):
    """The 7B run's --checkpointing (every layer, through transformers' own switch) in plain
    PyTorch and the engine."""
    lines = run_here(bench_gpu, capsys, tmp_path, "plain,cpu/cpu", "--checkpointing")
    assert any(line.startswith("plain ") for line in lines) and offload_lines_filled(lines, ("cpu/cpu",)), lines
    assert "checkpointing on" in lines[0]
