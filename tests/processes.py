"""Running multi-process commands (torchrun) in tests without leaving orphans behind."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_process_group(command: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs `command` in its own session; on timeout the whole group (torchrun's agent and its
    workers) is killed and the test fails, instead of orphaned workers waiting on a dead store."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command[0]} did not finish in {timeout:.0f} s; stderr tail:\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
