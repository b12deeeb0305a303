"""benchmarks/bench_gpu.py runs end to end (tiny model, the CPU as the device): every line of its
table is filled, the floor and the ratio to it are printed, and its record holds each run against
its peers. Timings are not checked here.

One run of the script as a user runs it (a process for the limits and for each run, the table
from their JSON); the other kinds of run go through the same main() with `--in-process` (each
run's child() called in this process: a process per run imports torch and transformers again,
seconds each on two cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from bench_script import BENCHMARKS, loaded

SCRIPT = os.path.join(BENCHMARKS, "bench_gpu.py")
COMMON = ["--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "1", "--limits-elements", str(1 << 20)]


@pytest.fixture(scope="module")
def bench_gpu():
    yield from loaded("bench_gpu")


def run_bench(tmp_path, runs: str, *extra: str) -> subprocess.CompletedProcess:
    args = [*COMMON, "--runs", runs, "--nvme-path", str(tmp_path)]
    result = subprocess.run([sys.executable, SCRIPT, *args, *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def run_here(bench_gpu, capsys, tmp_path, runs: str, *extra: str) -> list[str]:
    assert bench_gpu.main([*COMMON, "--runs", runs, "--nvme-path", str(tmp_path), "--in-process", *extra]) == 0
    return capsys.readouterr().out.splitlines()


def last_record() -> dict:
    folder = os.environ["OFFLOAD_RESULTS_DIR"]
    names = sorted(n for n in os.listdir(folder) if "bench_gpu" in n)
    with open(os.path.join(folder, names[-1])) as handle:
        return json.load(handle)


def offload_lines_filled(lines: list[str], prefixes: tuple[str, ...]) -> bool:
    found = [line for line in lines if line.startswith(prefixes)]
    return len(found) == len(prefixes) and all("forward=" in line and "nan" not in line.split("forward=")[0] for line in found)


def test_bench_gpu_smoke(tmp_path):
    """The script itself: limits, plain PyTorch and a speculative (overlap backward, clipped)
    offload run, each in its own process; the record has the run against plain PyTorch."""
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
    record = last_record()
    assert record["complete"] and record["settings"]["runs"] == "plain,none/cpu@backward"
    rows = {(row["case"].split()[-1], row["peer"]): row for row in record["rows"]}
    assert rows[("none/cpu@backward", "plain PyTorch")]["peer_value"] == rows[("plain", None)]["value"]
    assert len(rows[("none/cpu@backward", "plain PyTorch")]["figures"]["losses"]) == 3  # each step's, warm-ups too


def test_bench_gpu_placements_and_peers_absent(bench_gpu, capsys, tmp_path):
    """The other placements (weights on the device, weights and state on NVMe) under the
    engine's own schedule; DeepSpeed's runs, absent here, are skipped with the reason, in the
    table and the record."""
    lines = run_here(bench_gpu, capsys, tmp_path, "plain,none/cpu,nvme/nvme,ds2,superoffload,zenflow", "--clip", "1.0")
    assert any(line.startswith("plain ") for line in lines), lines
    assert offload_lines_filled(lines, ("none/cpu ", "nvme/nvme")), lines
    for run in ("ds2", "superoffload", "zenflow"):
        assert any(line.startswith(run) and "deepspeed not installed" in line for line in lines), lines
    record = last_record()
    assert [row["case"].split()[-1] for row in record["rows"][:3]] == ["plain", "none/cpu@default", "nvme/nvme@default"]
    assert record["rows"][1]["figures"]["overlap"] == "auto"  # what the engine chose (its default)
    assert record["notes"].count("deepspeed not installed") == 3


def test_bench_gpu_with_checkpointing(bench_gpu, capsys, tmp_path):
    """The 7B run's --checkpointing (every layer, through transformers' own switch) in plain
    PyTorch and the engine."""
    lines = run_here(bench_gpu, capsys, tmp_path, "plain,cpu/cpu", "--checkpointing")
    assert any(line.startswith("plain ") for line in lines) and offload_lines_filled(lines, ("cpu/cpu",)), lines
    assert "checkpointing on" in lines[0]


def test_recommended_is_what_offload_estimate_recommends(bench_gpu, capsys, tmp_path):
    """`--recommend` prints estimate's placement for this model and machine; `--runs recommended`
    runs it."""
    assert bench_gpu.main([*COMMON, "--nvme-path", str(tmp_path), "--recommend"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["param"] in ("none", "cpu", "nvme") and chosen["optimizer"] in ("cpu", "nvme", "auto", "device")
    lines = run_here(bench_gpu, capsys, tmp_path, "recommended")
    placement = f"{chosen['param']}/{chosen['optimizer']}"
    assert f"offload estimate recommends {placement} here" in lines[0], lines
    assert any(line.startswith(placement) and "forward=" in line for line in lines), lines


def test_time_boxes_stop_or_skip_runs_and_keep_the_others(bench_gpu, capsys, tmp_path):
    """A run past its time box is stopped (its process group killed) and recorded as failed; past
    the deadline no run starts; the record says so and is complete."""
    stopped = bench_gpu.spawn(bench_gpu.parse_args([*COMMON, "--nvme-path", str(tmp_path)]), "plain", timeout=0.5)
    assert stopped == {"failed": "stopped at its time box, 0.5 s"}
    lines = run_here(bench_gpu, capsys, tmp_path, "plain,none/cpu", "--deadline", str(time.time() + 30), "--min-run", "60")
    assert sum("no time left" in line for line in lines) == 1 + 2 + 2, lines  # the limits, each run's line and row
    record = last_record()
    assert record["complete"] and record["rows"] == [] and record["notes"].count("no time left") == 2


def test_deepspeed_configs_are_the_peers_the_issue_names(bench_gpu):
    """ZeRO-Offload is ZeRO-2 with the optimizer on the CPU; SuperOffload ZeRO-3 with
    super_offload; ZenFlow ZeRO-2 offload with a zenflow section; every run clips as asked."""
    for run in bench_gpu.DEEPSPEED_RUNS:
        config = bench_gpu.deepspeed_config(run, 8, 1.0)
        assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": True}
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert bench_gpu.deepspeed_config("ds2", 8, 1.0)["zero_optimization"]["stage"] == 2
    super_offload = bench_gpu.deepspeed_config("superoffload", 8, 1.0)["zero_optimization"]
    assert super_offload["stage"] == 3 and super_offload["offload_optimizer"]["super_offload"] is True
    zenflow = bench_gpu.deepspeed_config("zenflow", 8, 1.0)["zero_optimization"]
    assert zenflow["stage"] == 2 and zenflow["zenflow"]["overlap_step"] is True
    assert bench_gpu.offload_config("none", "cpu", "default", 1.0, "/s").keys() == {
        "precision",
        "optimizer",
        "offload",
        "gradient_clipping",
    }
    assert bench_gpu.offload_config("none", "cpu", "backward", 1.0, "/s")["overlap"] == "backward"
