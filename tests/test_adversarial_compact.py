"""Compact optimizer state under adversarial use (issue 51, findings 5 to 8): the single-step
bound on int8 moments, extreme magnitudes, loads whose bits must not depend on the tier or on
what the engine did before, and load logs that say what a conversion really did.

The formats and kernels themselves are tests/test_compact_kernels.py; the engine's ordinary
compact routes tests/test_compact_state.py."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import TinyNet, batches, engine_run

import offload
from offload import checkpoint

COMPACT = ["bf16", "int8"]


def make_config(swap_dir, precision: str, *, optimizer: str = "cpu") -> dict:
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "state_precision": precision},
        # pieces of 1024 elements: a block unit of TinyNet streams from NVMe in five
        "offload": {"param": "none", "optimizer": optimizer, "nvme_path": str(swap_dir), "sub_group_size": 1024},
    }


def saved_moments(path) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's moments as a checkpoint holds them (their decoded fp32 values)."""
    with checkpoint.CheckpointReader(path) as reader:
        names = sorted({name for name, kind in reader.stored if kind != "master"})
        return {(name, kind): reader.read_param(name, kind) for name in names for kind in ("exp_avg", "exp_avg_sq")}


# ---- finding 6: a load's rounding depends only on the loaded state ------------------------------


@pytest.mark.parametrize("precision", COMPACT)
def test_a_load_rounds_to_the_same_bits_on_every_tier_and_after_training(swap_dir, tmp_path, precision):
    """fp32 moments loaded into bf16 or int8 round stochastically, with the key of the loaded
    step: the same bits whether the state lives in RAM (one piece per unit) or streams from NVMe
    (five pieces), and whether the engine is fresh or trained other steps first (its own step
    count then differs from the checkpoint's). Before the fix every piece but a unit's last took
    the engine's old step count for its key."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(6)
    source = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        engine_run(source, data[:3])
        source.save_checkpoint(tmp_path / "fp32")
    finally:
        source.close()
    loaded = {}
    for optimizer, trained in (("cpu", 0), ("nvme", 0), ("nvme", 2), ("cpu", 2)):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, precision, optimizer=optimizer))
        try:
            engine_run(engine, data[3 : 3 + trained])
            engine.load_checkpoint(tmp_path / "fp32")
            engine.save_checkpoint(tmp_path / f"{optimizer}-{trained}")
        finally:
            engine.close()
        loaded[(optimizer, trained)] = saved_moments(tmp_path / f"{optimizer}-{trained}")
    reference = loaded[("cpu", 0)]
    for case, state in loaded.items():
        assert state.keys() == reference.keys()
        for key, values in state.items():
            assert torch.equal(values, reference[key]), (case, key)


def test_a_state_dict_load_rounds_with_its_own_step_not_the_engines(swap_dir):
    """engine.optimizer.load_state_dict of fp32 moments into int8: the same bits in a fresh
    engine and in one that trained two steps first (before the fix the re-encoding took each
    engine's own step count, 0 or 2, for its rounding key)."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(5)
    source = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        engine_run(source, data[:3])
        state = copy.deepcopy(source.optimizer.state_dict())
    finally:
        source.close()
    loaded = []
    for trained in (0, 2):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8"))
        try:
            engine_run(engine, data[3 : 3 + trained])
            engine.optimizer.load_state_dict(state)
            loaded.append(engine.optimizer.state_dict()["state"])
        finally:
            engine.close()
    assert loaded[0].keys() == loaded[1].keys() == state["state"].keys()
    for index, entry in loaded[0].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[kind], loaded[1][index][kind]), (index, kind)
