"""benchmarks/bench_gpu.py runs end to end (tiny model, the CPU as the device): every line of its
table is filled, the floor and the ratio to it are printed. Timings are not checked here."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_gpu.py")


def run_bench(tmp_path, runs: str, *extra: str) -> subprocess.CompletedProcess:
    args = ["--size", "tiny", "--runs", runs, "--batch", "2", "--seq", "32", "--steps", "1", "--nvme-path", str(tmp_path)]
    result = subprocess.run([sys.executable, SCRIPT, *args, *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_bench_gpu_smoke(tmp_path):
    result = run_bench(tmp_path, "plain,none/cpu,nvme/nvme,none/cpu@backward", "--clip", "1.0")
    lines = result.stdout.splitlines()
    assert any(line.startswith("plain ") for line in lines), result.stdout
    offload_lines = [line for line in lines if line.startswith(("none/cpu", "nvme/nvme"))]
    assert len(offload_lines) == 3 and all(
        "forward=" in line and "nan" not in line.split("forward=")[0] for line in offload_lines
    ), result.stdout
    assert "CPU Adam" in result.stdout


def test_bench_gpu_with_checkpointing(tmp_path):
    """The 7B run's --checkpointing (every layer, through transformers' own switch) in plain
    PyTorch and the engine."""
    result = run_bench(tmp_path, "plain,cpu/cpu", "--checkpointing")
    lines = result.stdout.splitlines()
    assert any(line.startswith("plain ") for line in lines) and any(line.startswith("cpu/cpu") for line in lines)
