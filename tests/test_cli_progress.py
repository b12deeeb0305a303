"""`offload --version`; the progress bar labels its bytes per tier and keeps log lines off the bar."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import offload
from offload.cli import main as cli_main
from offload.progress import TrainingProgress, memory_postfix


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"offload {offload.__version__} (torch ") and "Python" in out


def test_version_from_the_console_module():
    result = subprocess.run(
        [sys.executable, "-m", "offload.cli", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stdout.startswith("offload ")


def test_memory_postfix_names_each_tier():
    breakdown = {"device_bytes": 0, "host_bytes": 28_100 * 1024, "nvme_bytes": 47 * 1024 * 1024}
    assert memory_postfix(breakdown) == {"dev": "0 B", "host": "27.4 MiB", "nvme": "47.0 MiB"}


class FakeEngine:
    def pop_timings(self):
        return {"forward": 0.1, "backward": 0.2, "step": 0.05}

    def memory_report(self):
        return {tier: {"current": n, "peak": n} for tier, n in (("device", 0), ("host", 2 << 20), ("nvme", 3 << 20))}


def test_log_lines_are_written_above_the_bar_while_it_is_open():
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    old_level = root.level
    root.addHandler(console)
    root.setLevel(logging.INFO)
    try:
        progress = TrainingProgress(FakeEngine(), total=2, log_every=1, bar=True)
        # tqdm's handler writes with tqdm.write, which clears the bar, prints the line, redraws the bar
        assert console not in root.handlers
        assert any(type(h).__name__ == "_TqdmLoggingHandler" for h in root.handlers)
        progress.update(loss=1.5, tokens=100)
        assert progress._bar.postfix.endswith("dev=0 B, host=2.00 MiB, nvme=3.00 MiB")
        progress.close()
        assert console in root.handlers  # restored when the bar closes
    finally:
        root.removeHandler(console)
        root.setLevel(old_level)


def test_a_disabled_bar_leaves_logging_alone():
    root = logging.getLogger()
    before = list(root.handlers)
    with TrainingProgress(FakeEngine(), total=1, disable=True) as progress:
        assert root.handlers == before
        progress.update(tokens=1)
    assert root.handlers == before
