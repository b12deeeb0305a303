"""`offload.optimizer: auto`: the optimizer state split over host RAM and NVMe by a RAM cap,
training exactly like torch AdamW (fp32), with memory_report() saying which unit went where."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_worker import launch, make_config, rank_swap_dirs, train_deep_tinynet_reporting_tiers
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, reference_run
from tier_caps import BUFFER_COUNT, auto_config, split_caps

import offload

HOST_UNITS = 2  # the cap below leaves room for the state of this many units beside the slots


def host_cap(model, param: str, world: int = 1) -> int:
    """RAM for the first HOST_UNITS units' state beside the NVMe slots and the engine's other host
    buffers, plus less than one more unit."""
    return split_caps(model, param, device_units=0, host_units=HOST_UNITS, world=world)[1]


def split_config(swap_dir, param, overlap, cap):
    # no optimizer state on the device, CUDA or not: this file is the host / NVMe split
    # (tests/test_optimizer_device.py has the device tier)
    return auto_config(swap_dir, param, overlap, device_cap=0, host_cap=cap)


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_a_host_cap_splits_the_state_and_training_is_exact(swap_dir, param, overlap):
    torch.manual_seed(0)
    model = TinyNet(depth=8)
    data = batches(6)
    reference, reference_losses = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), split_config(swap_dir, param, overlap, host_cap(model, param)))
    try:
        units = engine.memory_report()["optimizer_units"]
        tiers = [units[unit.spec.name]["tier"] for unit in engine.units]
        assert tiers == ["cpu"] * HOST_UNITS + ["nvme"] * (len(tiers) - HOST_UNITS)  # RAM first, in step order
        assert "RAM full" in units[engine.units[-1].spec.name]["why"]
        losses = engine_run(engine, data)
        report = engine.memory_report()
        assert report["host"]["by_category"]["optimizer_state"]["current"] == 16 * sum(
            u.shard_numel for u in engine.units[:HOST_UNITS]
        )
        assert report["nvme"]["current"] > 0
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
        assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    finally:
        engine.close()


def test_auto_keeps_everything_in_ram_when_it_fits(swap_dir):
    engine = offload.initialize(TinyNet(), {"precision": "fp32", "offload": {"nvme_path": swap_dir, "max_device_memory": 0}})
    try:
        assert {entry["tier"] for entry in engine.memory_report()["optimizer_units"].values()} == {"cpu"}
        assert engine.memory_report()["nvme"]["current"] == 0
    finally:
        engine.close()


def test_a_cap_too_small_even_for_the_slots_is_a_clear_error(swap_dir):
    with pytest.raises(offload.errors.ConfigError, match="offload.optimizer auto.*max_host_memory"):
        offload.initialize(TinyNet(), {"offload": {"optimizer": "auto", "max_host_memory": "1KiB", "nvme_path": swap_dir}})


def test_a_checkpoint_saved_split_loads_into_cpu_and_back(tmp_path, swap_dir):
    torch.manual_seed(0)
    model = TinyNet(depth=8)
    data = batches(8)
    straight = offload.initialize(
        copy.deepcopy(model),
        split_config(swap_dir, "cpu", "forward", None) | {"offload": {"optimizer": "cpu", "nvme_path": swap_dir}},
    )
    engine_run(straight, data)
    expected = straight.consolidated_state_dict()
    straight.close()
    split = offload.initialize(copy.deepcopy(model), split_config(swap_dir, "cpu", "forward", host_cap(model, "cpu")))
    engine_run(split, data[:4])
    split.save_checkpoint(tmp_path / "ckpt")
    split.close()
    resumed = offload.initialize(
        copy.deepcopy(model),
        split_config(swap_dir, "cpu", "forward", None) | {"offload": {"optimizer": "cpu", "nvme_path": swap_dir}},
    )
    resumed.load_checkpoint(tmp_path / "ckpt")
    engine_run(resumed, data[4:])
    got = resumed.consolidated_state_dict()
    resumed.close()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_two_ranks_with_a_split_state_train_like_one_process(tmp_path, overlap):
    torch.manual_seed(0)
    model = TinyNet(depth=8)
    swaps = rank_swap_dirs(tmp_path, 2)
    config = make_config(swaps, "cpu", "auto", overlap)
    config["offload"].update(max_host_memory=host_cap(model, "cpu", world=2), buffer_count=BUFFER_COUNT)
    results = launch(train_deep_tinynet_reporting_tiers, 2, config, timeout_s=30, deadline_s=150)
    for result in results:
        assert result["ok"], result.get("traceback") or result
        assert "cpu" in result["value"]["tiers"] and "nvme" in result["value"]["tiers"]
    reference, _ = reference_run(model, batches(6))
    assert max_weight_difference(results[0]["value"]["weights"], reference) <= 1e-5
