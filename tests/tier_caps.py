"""Caps for `offload.optimizer: auto` that split a model's optimizer state at chosen units, and
the config that uses them (tests/test_optimizer_auto.py, tests/test_optimizer_device.py).

The caps are computed the way the engine plans (offload.storage.tiers.plan_optimizer): the host cap is
the engine's other host buffers, the NVMe slots, and the state of the units meant for RAM, plus
half of the next unit (so it just does not fit); the device cap likewise for the device."""

from __future__ import annotations

from reference import ENGINE_STAGES_COPIES

from offload.config.schema import OffloadConfig
from offload.model.units import build_units, plan_flat_layout
from offload.plan.budgets import host_bytes_beside_optimizer_state
from offload.plan.optimizer_plan import slot_bytes_for

BUFFER_COUNT = 2
# auto_config leaves offload.sub_group_size unset: the plan sets aside BUFFER_COUNT slots of the
# largest streamed unit, what any piece the engine then picks fits in (plan.slot_bytes_for)
SUB_GROUP_SIZE = OffloadConfig().sub_group_size
assert SUB_GROUP_SIZE is None


def shard_numels(model, world: int = 1) -> list[int]:
    return [plan_flat_layout([p.numel() for p in spec.params], world).shard_numel for spec in build_units(model, [], 0)]


def split_caps(model, param: str, *, device_units: int, host_units: int, world: int = 1) -> tuple[int, int]:
    """(max_device_memory, max_host_memory): the first `device_units` units' state on the device,
    the next `host_units` in RAM, the rest on NVMe (fp32 compute; all params trainable)."""
    shards = shard_numels(model, world)
    others = host_bytes_beside_optimizer_state(
        shards, param_tier=param, compute_bytes=4, prefetch_depth=2, staged_device_copies=ENGINE_STAGES_COPIES
    )
    device = 16 * sum(shards[:device_units]) + 8 * shards[device_units]
    rest = shards[device_units:]
    host = others + slot_bytes_for(max(rest), BUFFER_COUNT, SUB_GROUP_SIZE) + 16 * sum(rest[:host_units]) + 8 * rest[host_units]
    return device, host


def auto_config(swap_dir, param: str, overlap: str, *, device_cap, host_cap) -> dict:
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {
            "param": param,
            "optimizer": "auto",
            "max_device_memory": device_cap,
            "max_host_memory": host_cap,
            "nvme_path": swap_dir,
            "buffer_count": BUFFER_COUNT,
        },
        "overlap": overlap,
    }
