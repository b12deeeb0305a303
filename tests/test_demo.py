"""The main job (`make demo`) runs end to end at a small size and leaves no swap files."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_and_samples(tmp_path):
    swap = tmp_path / "swap"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "demo.py"),
            "--steps",
            "4",
            # 2 sequences of 128 bytes per step instead of the demo's 16: the same code, a
            # third of the CPU time (bf16 matmuls on the CPU are slow)
            "--batch",
            "2",
            "--sample-bytes",
            "8",
            "--text-bytes",
            "200000",
            "--nvme-path",
            str(swap),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final loss" in result.stdout and "---- sample ----" in result.stdout
    assert [f for _, _, files in os.walk(swap) for f in files] == []
