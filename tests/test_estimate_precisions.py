"""`offload estimate` and optimizer.state_precision: the report counts the config's state (or
`--state-precision`'s), its disk traffic per step, and without a chosen precision a table of
what each one takes for the recommended placement (plan.precisions)."""

from __future__ import annotations

import json
import re

import pytest

from offload.cli import main as cli_main
from offload.config.schema import load_config
from offload.config.state_layout import FP32_STATE, StateBytes, StatePrecision
from offload.errors import ConfigError
from offload.plan import estimate as est
from offload.plan.machine import Machine
from offload.plan.model_shapes import shape_from_param_count
from offload.plan.optimizer_plan import step_disk_traffic
from offload.plan.precisions import compare_state_precisions, shown_placement, state_for

GiB = 1 << 30
INT8 = StateBytes(StatePrecision.INT8, 2)


@pytest.fixture(scope="module")
def shape():
    return shape_from_param_count(10**9, layers=8)


def rows_of(report: dict) -> dict:
    return {(r["param"], r["optimizer"]): r for r in report["placements"]}


def test_state_for_follows_the_config_rules():
    assert state_for("fp32", precision="fp32") == FP32_STATE
    assert state_for("int8", precision="bf16") == INT8
    assert state_for("bf16", precision="bf16", accumulation_steps=2) == StateBytes(StatePrecision.BF16, 4)
    assert state_for("bf16", precision="fp16", gradient_precision="fp32") == StateBytes(StatePrecision.BF16, 4)
    with pytest.raises(ConfigError, match="fp32, bf16, int8") as error:
        state_for("int4", precision="bf16")
    assert error.value.key == "optimizer.state_precision"


def test_every_tier_counts_the_states_bytes(shape):
    """The optimizer state on each tier is as wide as the state: on the device and in RAM the
    four kinds per unit, on NVMe their swap files; what does not hold optimizer state is the same."""
    shards = shape.shard_numels()
    for param, optimizer in (("none", "cpu"), ("cpu", "nvme")):
        fp32 = est.estimate_tiers(shape, param, optimizer, device="cpu")
        int8 = est.estimate_tiers(shape, param, optimizer, device="cpu", state=INT8)
        assert int8.state == INT8 and fp32.state == FP32_STATE
        assert int8.total("host") < fp32.total("host")
        assert int8.host.get("param16") == fp32.host.get("param16")
        if optimizer == "nvme":
            assert int8.total("nvme") < fp32.total("nvme")
    tiers = ["device"] * 2 + ["cpu"] * (len(shards) - 2)
    auto = est.estimate_tiers(shape, "none", "auto", device="cpu", optimizer_tiers=tiers, state=INT8)
    assert auto.device["optimizer_state"] == sum(INT8.total_bytes(n) for n in shards[:2])


def test_disk_traffic_per_step_is_the_nvme_units_state(shape):
    machine = Machine(gpu_bytes=None, ram_bytes=64 * GiB, disk_bytes=10**13, device="cpu")
    report = est.estimate_report(shape, machine, gradient_memory=0, accumulation_steps=2)
    rows = rows_of(report)
    assert rows[("none", "cpu")]["disk_per_step"] == {"read": 0, "written": 0}
    piece = report["settings"]["nvme_slots"]["piece"]
    expected = sum((step_disk_traffic(n, piece, accumulation_steps=2) for n in shape.shard_numels()), start=est.DiskTraffic())
    assert rows[("none", "nvme")]["disk_per_step"] == {"read": expected.read, "written": expected.written}
    assert report["settings"]["state"] == {"state_precision": "fp32", "gradient_bytes": 4, "bytes_per_param": 16.0}


def test_weights_on_nvme_count_their_own_disk_traffic(shape):
    """param nvme: each unit's 16-bit shard written once per step and read by its backward fetch,
    by its forward fetch too unless overlap forward lends the step's buffer; no weights traffic
    with the weights on the device or in RAM. The per-precision table adds it to every row and
    says so."""
    machine = Machine(gpu_bytes=None, ram_bytes=64 * GiB, disk_bytes=10**13, device="cpu")
    once = sum(-(-n * 2 // 4096) * 4096 for n in shape.shard_numels())
    for overlap, reads in (("forward", once), ("none", 2 * once), ("backward", 2 * once)):
        rows = rows_of(est.estimate_report(shape, machine, precision="bf16", overlap=overlap))
        for (param, _), row in rows.items():
            expected = {"read": reads, "written": once} if param == "nvme" else {"read": 0, "written": 0}
            assert row["weights_disk_per_step"] == expected, (param, overlap)
    assert est.weights_disk_traffic(shape.shard_numels(), 2, "forward") == est.DiskTraffic(once, once)


def test_cli_counts_the_weights_disk_traffic_of_param_nvme(capsys, tmp_path):
    """The issue's 70B machine: the recommended placement keeps the weights on nvme; its line and
    the per-precision table's disk column count their traffic, in every precision alike."""
    args = ["estimate", "70B", "--gpu-memory", "24GB", "--ram", "128GiB", "--disk", "2TB", "--checkpointing"]
    assert cli_main([*args, "--nvme-path", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["recommended"]["param"], report["recommended"]["optimizer"]) == ("nvme", "auto")
    weights = rows_of(report)[("nvme", "auto")]["weights_disk_per_step"]
    # 2 bytes of 70B params each way, and a little more read: overlap auto steps some units (those
    # whose state the RAM left over holds twice) during backward, and their forward fetch reads
    written = weights["written"]
    assert written > 130 * 10**9 and written <= weights["read"] < 1.05 * written
    for row in report["state_precisions"]["rows"]:
        assert row["weights_disk_per_step"]["written"] == written
        assert written <= row["weights_disk_per_step"]["read"] < 1.05 * written
    assert cli_main([*args, "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"disk traffic of the 16-bit weights per step: up to 13\d GiB read \+ 130 GiB written", out), out
    assert "(disk per step: the optimizer state's, and the 16-bit weights' on nvme)" in out


def test_each_precision_side_by_side(shape):
    """compare_state_precisions: fp32, bf16, int8 for the recommended placement; the row of the
    report's own precision is the report's; each precision takes less than the one before."""
    machine = Machine(gpu_bytes=24 * GiB, ram_bytes=16 * GiB, disk_bytes=10**12, device="cuda")
    settings = dict(state=StateBytes(StatePrecision.FP32, 2), gradient_memory=0)
    report = est.estimate_report(shape, machine, **settings)
    table = compare_state_precisions(shape, machine, report, **settings)
    placement = (table["param"], table["optimizer"])
    assert table["why"] == "recommended" and placement == shown_placement(report)[0]
    assert [row["state_precision"] for row in table["rows"]] == ["fp32", "bf16", "int8"]
    fp32, bf16, int8 = table["rows"]
    own = rows_of(report)[placement]
    assert (fp32["host"], fp32["nvme"], fp32["disk_per_step"]) == (
        own["host"]["total"],
        own["nvme"]["total"],
        own["disk_per_step"],
    )
    assert (
        fp32["bytes_per_param"] == 14 and bf16["bytes_per_param"] == 10 and int8["bytes_per_param"] == pytest.approx(8.06, 0.01)
    )
    for bigger, smaller in ((fp32, bf16), (bf16, int8)):
        assert sum(smaller[t] for t in ("device", "host", "nvme")) < sum(bigger[t] for t in ("device", "host", "nvme"))
        assert smaller["disk_per_step"]["read"] <= bigger["disk_per_step"]["read"]
    assert all(row["recommended"] is not None for row in table["rows"])


def test_with_nothing_fitting_the_table_shows_the_fastest_with_fewest_problems(shape):
    machine = Machine(gpu_bytes=1 * GiB, ram_bytes=1 * GiB, disk_bytes=10**12, device="cuda")
    report = est.estimate_report(shape, machine)
    assert report["recommended"] is None
    placement, why = shown_placement(report)
    fewest = min(len(r["problems"]) for r in report["placements"] if r["device"]["total"] is not None)
    first = next(r for r in report["placements"] if r["device"]["total"] is not None and len(r["problems"]) == fewest)
    assert placement == (first["param"], first["optimizer"]) and why.startswith("nothing fits")


def test_recommended_config_carries_the_state_precision(shape):
    machine = Machine(gpu_bytes=80 * GiB, ram_bytes=256 * GiB, disk_bytes=10**12, device="cuda")
    report = est.estimate_report(shape, machine, state=INT8)
    config = load_config(report["recommended"]["config"])
    assert config.optimizer.state_precision == "int8"
    assert "optimizer" not in est.estimate_report(shape, machine)["recommended"]["config"]


def test_cli_table_of_precisions_unless_one_is_chosen(capsys, tmp_path):
    args = ["estimate", "7B", "--gpu-memory", "24GB", "--ram", "128GiB", "--disk", "2TB", "--nvme-path", str(tmp_path)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "optimizer state: fp32 moments, fp32 master, 16-bit gradient: 14 bytes per param" in out
    assert "what each optimizer.state_precision takes for" in out
    table = out[out.index("what each optimizer.state_precision") :]
    assert [line.split()[0] for line in table.splitlines()[2:] if line.split()[0] in ("fp32", "bf16", "int8")] == [
        "fp32",
        "bf16",
        "int8",
    ]
    assert "fp32 *" in table
    # a chosen precision: no table, its bytes counted, and the recommended config says it
    assert cli_main([*args, "--state-precision", "int8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "state_precisions" not in report
    assert report["settings"]["state"]["state_precision"] == "int8"
    assert report["recommended"]["config"]["optimizer"] == {"state_precision": "int8"}
    # the config's precision is the default one, and its accumulation widens the gradient
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"optimizer": {"state_precision": "bf16"}, "gradient_accumulation_steps": 4}))
    assert cli_main([*args, "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["state"] == {"state_precision": "bf16", "gradient_bytes": 4, "bytes_per_param": 12.0}
    assert [row["gradient_bytes"] for row in report["state_precisions"]["rows"]] == [4, 4, 4]
