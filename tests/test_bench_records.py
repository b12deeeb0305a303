"""The benchmarks the project reports write a record of each run (benchmarks/records.py), at their
smallest settings here: bench_step, bench_adam, bench_io, bench_state_memory and bench_quality
(bench_gpu, bench_pipeline and gpu_session.sh have theirs checked in their own tests). Each record
follows the schema, is complete, and compares offload with the peer the benchmark measures."""

from __future__ import annotations

import os
import sys

import pytest
from bench_script import BENCHMARKS, loaded

pytestmark = pytest.mark.host_only


def newest(benchmark: str) -> dict:
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import records

    found = [record for name, record in records.load_all(os.environ["OFFLOAD_RESULTS_DIR"]) if record["benchmark"] == benchmark]
    assert found, f"no {benchmark} record"
    record = max(found, key=lambda r: r["date"])
    assert record["complete"] and record["source"] == "run"
    return record


def rows_by(record: dict) -> dict:
    return {(row["case"].split(": ")[-1] if ": " in row["case"] else row["case"], row["metric"]): row for row in record["rows"]}


def test_bench_step(tmp_path):
    for bench in loaded("bench_step"):
        argv = ["--layers", "1", "--width", "64", "--batch", "1", "--seq", "16", "--steps", "1", "--disk-check", "off"]
        assert (
            bench.main(
                [*argv, "--runs", "none/cpu", "--state-precisions", "fp32,int8", "--plain-once", "--nvme-path", str(tmp_path)]
            )
            == 0
        )
    record = newest("bench_step")
    cases = {(" ".join(row["case"].split()[4:]), row["metric"]) for row in record["rows"]}
    assert cases == {
        ("none/cpu@auto state fp32", "s/step"),
        ("none/cpu@auto state int8", "s/step"),
        ("none/cpu@auto state int8", "speed-up"),
    }
    for row in record["rows"]:
        if row["metric"] == "s/step":
            assert row["peer"] == "plain PyTorch (fused AdamW)" and row["peer_value"] > 0
            assert row["ratio"] == pytest.approx(1 / row["figures"]["ratio_per_round"][0])
        else:
            seconds = {r["case"].split()[-1]: r["value"] for r in record["rows"] if r["metric"] == "s/step"}
            assert row["value"] == pytest.approx(seconds["fp32"] / seconds["int8"]) and row["peer"] == "fp32 state, same run"


def test_bench_adam():
    for bench in loaded("bench_adam"):
        bench.main(["--sizes", "65536", "--repeats", "2", "--bnb-rounds", "0", "--threads", "1"])
    rows = rows_by(newest("bench_adam"))
    kernel = rows[("offload adam_step", "Gparam/s")]
    assert kernel["peer"] == "torch cast+fused+cast" and kernel["value"] > 0 and kernel["peer_value"] > 0  # the last workload's
    for precision in ("bf16", "int8"):
        compact = rows[(f"{precision} moments", "speed-up")]
        assert compact["peer"] == "fp32 moments" and compact["ratio"] == compact["value"] > 0


def test_bench_io(tmp_path):
    for bench in loaded("bench_io"):
        assert bench.main(["--path", str(tmp_path), "--size", "8M", "--repeat", "1"]) == 0
    record = newest("bench_io")
    metrics = {row["case"].split(": ")[1]: row for row in record["rows"]}
    assert set(metrics) == {
        "write, offload engine best",
        "read, offload engine best",
        "write, offload swap store (CRC-32C)",
        "read, offload swap store (CRC-32C)",
    }
    assert metrics["read, offload engine best"]["value"] > 0 and record["settings"]["size"] == 8 << 20


def test_bench_state_memory(tmp_path):
    for bench in loaded("bench_state_memory"):
        argv = ["--layers", "1", "--width", "64", "--intermediate", "128", "--vocab", "256", "--parts", "host"]
        bench.main([*argv, "--precisions", "fp32,int8", "--nvme-path", str(tmp_path)])
    rows = {row["case"].split()[-1]: row for row in newest("bench_state_memory")["rows"]}
    assert rows["fp32"]["peer"] is None and rows["int8"]["peer"] == "fp32 state"
    assert rows["int8"]["peer_value"] == rows["fp32"]["value"] > rows["int8"]["value"]


def test_bench_quality(tmp_path):
    for bench in loaded("bench_quality"):
        argv = ["--small", "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--noise-seeds", "0"]
        summary = bench.main(
            [*argv, "--rounding-seeds", "0", "--perturbed-seeds", "0", "--runs", "offload fp32", "--out", str(tmp_path)]
        )
    rows = rows_by(newest("bench_quality"))
    fp32 = rows[("offload fp32", "final train loss")]
    assert fp32["peer"] == "torch AdamW" and fp32["peer_value"] == summary["runs"]["torch AdamW"]["train"]
    assert fp32["value"] == summary["runs"]["offload fp32"]["train"]
