"""benchmarks/bench_quality.py runs end to end at its smallest setting (a 40k-parameter Llama, a
few steps): the summary, the printed table, the CSV and the plot keep their shape, and the
engine's fp32 state trains exactly like torch.optim.AdamW (the benchmark's sanity check)."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from bench_script import loaded

STEPS = 6


@pytest.fixture(scope="module")
def bench():
    yield from loaded("bench_quality")


def test_smallest_setting_reports_every_run(bench, tmp_path, capsys):
    argv = ["--small", "--steps", str(STEPS), "--eval-every", "3", "--eval-batches", "2", "--noise-seeds", "1"]
    summary = bench.main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out

    expected = {bench.REFERENCE, *(f"offload {p}" for p in bench.engine_state_precisions())}
    if bench.bitsandbytes_adamw8bit() is not None:
        expected.add("bnb AdamW8bit")
    assert set(summary["runs"]) == expected
    for name, row in summary["runs"].items():
        assert math.isfinite(row["train"]) and math.isfinite(row["validation"]), name
        assert f"\n{name:<22}{row['train']:>9.4f}" in out  # its line in the table
    assert summary["runs"][bench.REFERENCE]["train_vs_reference_pct"] == 0.0
    # fp32 state is torch's AdamW to fp32 rounding: the curves coincide step by step
    assert summary["offload_fp32_max_step_difference"] < 1e-4
    # the noise band: the reference, a run of it from an init moved by one ulp, and offload fp32
    assert set(summary["noise"]) == {"train", "validation"}
    assert len(summary["noise"]["train"]["values"]) == 3 and summary["noise"]["train"]["spread_pct"] >= 0
    if {"offload int8", "bnb AdamW8bit"} <= expected:
        assert "offload int8 within noise of bnb AdamW8bit" in summary["targets"]
        assert set(summary["int8_vs_bnb_beyond_noise"].values()) <= {"lower", "within", "higher"}
    for target in summary["targets"]:
        assert f"target: {target} (two-sided): " in out
    for name, row in summary["runs"].items():
        assert set(row["against_noise"]) == {"train", "validation"}, name
        assert set(row["against_noise"].values()) <= {"lower", "within", "higher"}, name

    with open(summary["csv"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["run", "seed", "step", "train_loss", "validation_loss"]
    for name in [*expected, bench.noise_name("rounding", 1)]:
        mine = [r for r in rows if r["run"] == name]
        assert [int(r["step"]) for r in mine] == list(range(STEPS + 1)), name
        assert [r["step"] for r in mine if r["validation_loss"]] == ["0", "3", "6"], name
    assert f"curves: {summary['csv']}" in out
    if summary["png"] is not None:
        with open(summary["png"], "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {summary['png']}" in out


def test_learning_rate_warms_up_then_decays_to_a_tenth(bench):
    rates = [bench.lr_at(step, 100, 1.0) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(0.1, abs=0.01)


def test_the_noise_runs_init_differs_by_one_ulp_everywhere(bench):
    model = bench.build_model(bench.SMALL)
    moved = bench.nudged_by_one_ulp(model, 1)
    for (name, a), b in zip(model.named_parameters(), moved.parameters()):
        distance = (b.detach().view(torch.int32).long() - a.detach().view(torch.int32).long()).abs()
        assert distance.max() == 1 and distance.min() == 1, name  # (no weight is 0 at this init, where 1 ulp is a sign flip)


def test_rounding_seeds_give_the_spread_over_rounding_streams(bench, tmp_path, capsys):
    """--rounding-seeds K: each compact run again with optimizer.rounding_seed 1..K, and the
    spread of its final losses against the reference over the K + 1 streams."""
    if "int8" not in bench.engine_state_precisions():
        pytest.skip("the engine has no compact state")
    argv = ["--small", "--steps", str(STEPS), "--eval-every", "3", "--eval-batches", "2", "--noise-seeds", "0"]
    summary = bench.main([*argv, "--runs", "offload int8", "--rounding-seeds", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    spread = summary["rounding_streams"]["offload int8"]
    assert spread["runs"] == 3 and set(summary["rounding_streams"]) == {"offload int8"}
    for what in ("train", "validation"):
        values = spread[what]["values"]
        assert len(set(values)) == 3, (what, values)  # three streams, three trajectories
        assert spread[what]["min"] == min(values) and spread[what]["max"] == max(values)
    assert "offload int8 over 3 rounding streams" in out
    with open(summary["csv"], newline="") as handle:
        names = {row["run"] for row in csv.DictReader(handle)}
    assert {"offload int8 r1", "offload int8 r2"} <= names
