"""Ctrl-C inside `engine.step()` forgets no work in flight: a checkpoint saved in the handler
holds the finished step (or is refused), and resuming from it ends bit-identical to a run that
was never interrupted."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_run.py")


def run(mode: str, tmp_path, swap: str) -> subprocess.CompletedProcess:
    args = [sys.executable, SCRIPT, mode, swap, str(tmp_path / "ckpt"), str(tmp_path / f"{mode}.pt")]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{mode}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    return result


def test_sigint_during_step_then_save_and_resume_is_bit_identical(tmp_path):
    swaps = []
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        swaps.append(str(tmp_path / name))
    run("straight", tmp_path, swaps[0])
    interrupted = run("interrupt", tmp_path, swaps[1])
    assert "interrupted in step(), step in flight: True" in interrupted.stdout, interrupted.stdout
    run("resume", tmp_path, swaps[2])
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resume.pt")
    different = [name for name in straight if not torch.equal(straight[name], resumed[name])]
    assert not different, f"resumed weights differ from the uninterrupted run in {different}"
    for swap in swaps:
        assert not any(files for _, _, files in os.walk(swap)), f"swap files left in {swap}"
