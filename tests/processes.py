"""Running multi-process commands (torchrun) in tests without leaving orphans behind."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

import pytest


def run_process_group(command: list[str], *, timeout: float, env=None, **kwargs) -> subprocess.CompletedProcess:
    """Runs `command` in its own session; on timeout the whole group (torchrun's agent and its
    workers) is killed and the test fails, instead of orphaned workers waiting on a dead store.
    The group's TMPDIR is a directory removed afterwards (torchrun leaves a log directory there)."""
    with tempfile.TemporaryDirectory(prefix="process-group-") as scratch:
        env = dict(os.environ if env is None else env, TMPDIR=scratch)
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env, **kwargs
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command[0]} did not finish in {timeout:.0f} s; stderr tail:\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
