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
    summary = bench.main([*argv, "--rounding-seeds", "0", "--perturbed-seeds", "0", "--out", str(tmp_path)])
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
    summary = bench.main(
        [*argv, "--runs", "offload int8", "--rounding-seeds", "2", "--perturbed-seeds", "0", "--out", str(tmp_path)]
    )
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


def test_perturbed_adamw_is_adamw_with_unbiased_noise_on_the_stored_moments(bench):
    """Scale 0: torch's AdamW bit for bit. Otherwise the step's update is AdamW's and the stored
    moments are AdamW's times (1 + scale * N(0, 1)): mean 1, spread `scale`."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(200_000, generator=generator)
    grads = [torch.randn(200_000, generator=generator) for _ in range(3)]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}

    def trained(make, steps):
        param = torch.nn.Parameter(start.clone())
        optimizer = make([param])
        for grad in grads[:steps]:
            param.grad = grad.clone()
            optimizer.step()
        return param.detach(), optimizer.state[param]

    plain, plain_state = trained(lambda params: torch.optim.AdamW(params, **hyper), 3)
    still, still_state = trained(lambda params: bench.PerturbedAdamW(params, seed=1, scale=0.0, **hyper), 3)
    assert torch.equal(plain, still)
    assert torch.equal(plain_state["exp_avg"], still_state["exp_avg"])
    assert torch.equal(plain_state["exp_avg_sq"], still_state["exp_avg_sq"])

    one, one_state = trained(lambda params: torch.optim.AdamW(params, **hyper), 1)
    moved, moved_state = trained(lambda params: bench.PerturbedAdamW(params, seed=1, **hyper), 1)
    assert torch.equal(one, moved)  # the step itself used the exact moments
    for kind in ("exp_avg", "exp_avg_sq"):
        factor = (moved_state[kind] / one_state[kind])[one_state[kind] != 0].double()
        assert abs(factor.mean().item() - 1.0) < 1e-4, kind
        assert factor.std().item() == pytest.approx(bench.PERTURBATION, rel=0.02), kind


def test_perturbed_seeds_compare_stream_means_with_perturbed_adamw(bench, tmp_path, capsys):
    """--perturbed-seeds K with --rounding-seeds: each compact precision's mean over its streams
    against the mean of K perturbed AdamW runs, with a standard error, and a target on the means."""
    if "bf16" not in bench.engine_state_precisions():
        pytest.skip("the engine has no compact state")
    argv = ["--small", "--steps", str(STEPS), "--eval-every", "3", "--eval-batches", "2", "--noise-seeds", "0"]
    summary = bench.main(
        [*argv, "--runs", "offload bf16", "--rounding-seeds", "1", "--perturbed-seeds", "2", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    row = summary["perturbed"]["offload bf16"]
    assert row["runs"] == 2 and row["perturbed_runs"] == 2
    with open(summary["csv"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    for what, column in (("train", "train_loss"), ("validation", "validation_loss")):
        finals = {}
        for name in (bench.perturbed_name(1), bench.perturbed_name(2), "offload bf16", "offload bf16 r1"):
            values = [float(r[column]) for r in rows if r["run"] == name and r[column]]
            finals[name] = (
                sum(values[-bench.FINAL_WINDOW :]) / len(values[-bench.FINAL_WINDOW :]) if what == "train" else values[-1]
            )
        perturbed_mean = (finals[bench.perturbed_name(1)] + finals[bench.perturbed_name(2)]) / 2
        mine = (finals["offload bf16"] + finals["offload bf16 r1"]) / 2
        assert row[what]["perturbed_mean"] == pytest.approx(perturbed_mean, rel=1e-5)
        assert row[what]["difference_pct"] == pytest.approx(100 * (mine - perturbed_mean) / perturbed_mean, abs=1e-3)
        assert row[what]["standard_error_pct"] > 0
    target = f"offload bf16 (mean of 2 streams) within 0.5% of {bench.REFERENCE} (mean of 2 perturbed runs)"
    assert target in summary["targets"] and f"target: {target} (two-sided): " in out
    assert f"offload bf16, mean of 2 rounding streams, vs the mean of 2 perturbed {bench.REFERENCE} runs" in out


def test_perturbation_sizes_each_get_their_runs_and_comparison(bench, tmp_path, capsys):
    """--perturbation-log2 -9 -5: K perturbed runs of each size, named apart, each compared with
    the compact runs; the targets stay judged against the bf16-sized (-9) runs."""
    if "bf16" not in bench.engine_state_precisions():
        pytest.skip("the engine has no compact state")
    argv = ["--small", "--steps", str(STEPS), "--eval-every", "3", "--eval-batches", "2", "--noise-seeds", "0"]
    summary = bench.main(
        [*argv, "--runs", "offload bf16", "--rounding-seeds", "0", "--perturbed-seeds", "2", "--perturbation-log2", "-9", "-5"]
        + ["--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    with open(summary["csv"], newline="") as handle:
        runs = {r["run"] for r in csv.DictReader(handle)}
    names = {bench.perturbed_name(s, e) for s in (1, 2) for e in (-9, -5)}
    assert names <= runs and len(names) == 4
    assert bench.perturbed_name(1, -5) == f"{bench.REFERENCE} perturbed 2^-5 1"
    assert set(summary["perturbed_by_size"]) == {-9, -5}
    assert summary["perturbed"] == summary["perturbed_by_size"][-9]
    coarse = summary["perturbed_by_size"][-5]["offload bf16"]["train"]["perturbed_mean"]
    fine = summary["perturbed_by_size"][-9]["offload bf16"]["train"]["perturbed_mean"]
    assert coarse != fine  # other runs, not the same ones twice
    assert f"vs the mean of 2 perturbed {bench.REFERENCE} (noise 2^-5) runs" in out
    assert f"vs the mean of 2 perturbed {bench.REFERENCE} runs" in out
    assert [t for t in summary["targets"] if "perturbed runs" in t] == [
        f"offload bf16 (mean of 1 streams) within 0.5% of {bench.REFERENCE} (mean of 2 perturbed runs)"
    ]


def test_perturbed_adamw_noise_has_the_asked_size(bench):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4096))
    optimizer = bench.PerturbedAdamW([param], seed=3, scale=2.0**-5, lr=1e-3)
    param.grad = torch.randn(4096)
    exact = torch.optim.AdamW([torch.nn.Parameter(param.detach().clone())], lr=1e-3)
    exact.param_groups[0]["params"][0].grad = param.grad.clone()
    optimizer.step()
    exact.step()
    moved = optimizer.state[param]["exp_avg"]
    plain = exact.state[exact.param_groups[0]["params"][0]]["exp_avg"]
    factor = (moved / plain)[plain != 0].double()
    assert factor.std().item() == pytest.approx(2.0**-5, rel=0.05)


def test_a_perturbation_size_given_twice_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--small", "--perturbed-seeds", "2", "--perturbation-log2", "-9", "-9"])
    assert "--perturbation-log2 names a size twice" in capsys.readouterr().err


def test_bnb_is_judged_against_the_int8_streams_spread(bench):
    """With int8 rounding streams, bnb AdamW8bit's run is compared with their mean against the
    standard error of one run drawn with their spread (sd * sqrt(1 + 1/K)): within two of them is
    within noise, beyond is not; without streams or without bnb there is no such comparison."""

    def curve(name: str, loss: float) -> object:
        return bench.Curve(name, 0, [loss] * bench.FINAL_WINDOW, [(1, loss + 0.01)], 0.0)

    int8 = [curve("offload int8", 2.00), curve("offload int8 r1", 2.02), curve("offload int8 r2", 2.04)]
    sd = 0.02  # of 2.00, 2.02, 2.04
    error = sd * math.sqrt(1 + 1 / 3)
    for bnb_loss, within in ((2.02 + 1.9 * error, True), (2.02 + 2.1 * error, False), (2.02 - 2.1 * error, False)):
        curves = [curve(bench.REFERENCE, 2.0), int8[0], curve("bnb AdamW8bit", bnb_loss)]
        row = bench.bnb_against_streams(curves, int8[1:])
        assert row["runs"] == 3 and row["within_noise"] is within, bnb_loss
        assert row["train"]["difference_pct"] == pytest.approx(100 * (2.02 - bnb_loss) / bnb_loss)
        assert row["train"]["standard_error_pct"] == pytest.approx(100 * error / bnb_loss)
    assert bench.bnb_against_streams([curve(bench.REFERENCE, 2.0), int8[0]], int8[1:]) == {}
    assert bench.bnb_against_streams([curve(bench.REFERENCE, 2.0), int8[0], curve("bnb AdamW8bit", 2.0)], []) == {}


def test_runs_are_plotted_in_groups_of_their_kind(bench):
    """Rounding streams join their main run, noise and perturbed runs join the others of their kind
    (each size apart), and every other run is its own curve."""
    group = bench.plot_group
    assert group("offload int8 r3") == group("offload int8") == "offload int8"
    assert group("offload bf16 r12") == "offload bf16"
    assert group(bench.perturbed_name(4)) == group(bench.perturbed_name(1)) == f"{bench.REFERENCE} perturbed"
    assert group(bench.perturbed_name(2, -5)) == f"{bench.REFERENCE} perturbed 2^-5"
    assert group(bench.noise_name("rounding", 2)) == f"{bench.REFERENCE} ulp"
    assert group(bench.noise_name("order", 7)) == f"{bench.REFERENCE} seed"
    for alone in (bench.REFERENCE, "offload fp32", "bnb AdamW8bit"):
        assert group(alone) == alone


def test_the_default_run_judges_every_target_on_means(bench, tmp_path, capsys):
    """Without seed options the benchmark trains eight rounding streams of each compact
    precision and eight perturbed AdamW runs, so every target is judged on means: the compact
    precisions against perturbed AdamW and, with bnb installed, int8 against bnb on its streams'
    spread (not on the one-ulp band)."""
    if "int8" not in bench.engine_state_precisions():
        pytest.skip("the engine has no compact state")
    argv = ["--small", "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--noise-seeds", "0"]
    summary = bench.main([*argv, "--out", str(tmp_path)])
    assert summary["rounding_streams"]["offload int8"]["runs"] == 8
    assert summary["perturbed"]["offload bf16"]["perturbed_runs"] == 8
    targets = set(summary["targets"])
    assert f"offload int8 (mean of 8 streams) within 1.0% of {bench.REFERENCE} (mean of 8 perturbed runs)" in targets
    if bench.bitsandbytes_adamw8bit() is not None:
        assert "offload int8 (mean of 8 streams) within noise of bnb AdamW8bit" in targets
        assert "offload int8 within noise of bnb AdamW8bit" not in targets
        assert "offload int8, mean of 8 rounding streams, vs bnb AdamW8bit's run" in capsys.readouterr().out
