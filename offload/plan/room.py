"""The engine's plan from this machine's room: each unit's optimizer tier under the config (its
`auto` planned by offload.plan.optimizer_plan from the accelerator's, the RAM's and the disk's
room measured at start), the RAM a rank may use, and which disk a rank's swap goes on. Made once,
at start (offload.runtime.build); the tier store allocates what it says."""

from __future__ import annotations

import logging
import os
import shutil

import psutil
import torch

from offload.config.placement import OptimizerTier, ParamTier
from offload.config.schema import Config
from offload.config.sizes import format_bytes, parse_size
from offload.config.state_layout import FP32_STATE, StateBytes
from offload.errors import ConfigError
from offload.model.unit_state import UnitState
from offload.plan.budgets import host_bytes_beside_optimizer_state
from offload.plan.optimizer_plan import (
    Capacity,
    OptimizerPlan,
    PlanError,
    device_room,
    engine_device_bytes,
    host_cap_bytes,
    plan_optimizer_tiers,
)

logger = logging.getLogger(__name__)


def plan_optimizer(
    config: Config,
    units: list[UnitState],
    *,
    compute_dtype: torch.dtype,
    staged_device_copies: bool,
    local_rank: int,
    device_memory: tuple[int, int] | None = None,
    state: StateBytes = FP32_STATE,
) -> OptimizerPlan:
    """Each unit's optimizer tier: the config's `device` / `cpu` / `nvme` for every unit, or under
    `auto` the plan of offload.plan.optimizer_plan from this machine's room: the accelerator's
    (`max_device_memory`, or `device_memory` = its (free, total) bytes measured at start, less
    the engine's own weights and gradients and an activation share; none when the CPU stands in
    for it), RAM (`max_host_memory`, or what is available less HOST_MARGIN, shared by the ranks
    of this node) less the engine's other host buffers, and the free disk under this rank's
    `nvme_path`. Units are planned in index order (the root, then the blocks: the order an
    ordinary forward runs them, so the order they step). `state`: the bytes of each kind of
    optimizer state, as the tiers will allocate them (`config.state_layout.state_bytes_for`)."""
    choice = config.offload.optimizer
    if choice != "auto":
        tier = OptimizerTier(choice)
        return OptimizerPlan(tiers=[tier] * len(units), reasons=[f"{tier.value}: offload.optimizer"] * len(units))
    compute_bytes = torch.empty(0, dtype=compute_dtype).element_size()
    shard_numels = [unit.shard_numel for unit in units]
    # what each unit's optimizer state covers (its trainable params: frozen ones have none)
    optimizer_numels = [unit.optimizer_numel for unit in units]
    others = host_bytes_beside_optimizer_state(
        shard_numels,
        param_tier=config.offload.param,
        compute_bytes=compute_bytes,
        prefetch_depth=config.prefetch.depth,
        staged_device_copies=staged_device_copies,
    )
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cap = host_cap(config)
    path = nvme_path_for_rank(config.offload.nvme_path, local_rank)
    nvme_free = shutil.disk_usage(path).free // ranks_here if os.path.isdir(path) else 0
    engine_bytes = engine_device_bytes(
        [unit.layout.padded_numel for unit in units],
        params_offloaded=ParamTier(config.offload.param).offloaded,
        compute_bytes=compute_bytes,
        prefetch_depth=config.prefetch.depth,
    )
    device = device_room(cap=parse_size(config.offload.max_device_memory), memory=device_memory, engine_bytes=engine_bytes)
    if ParamTier(config.offload.param) is ParamTier.NVME:  # the 16-bit weights' swap files come first
        nvme_free = max(0, nvme_free - compute_bytes * sum(shard_numels))
    capacity = Capacity(device=device, host=max(0, cap - others), nvme=nvme_free)
    try:
        plan = plan_optimizer_tiers(
            optimizer_numels,
            list(range(len(units))),
            capacity,
            buffer_count=config.offload.buffer_count,
            sub_group_size=config.offload.sub_group_size,
            state=state,
        )
    except PlanError as error:
        raise ConfigError(f"offload.optimizer auto: {error}", key="offload.optimizer") from None
    logger.info(
        "offload: optimizer auto (%s; device memory for it %s, RAM %s, disk %s): %s",
        state.describe(),
        format_bytes(capacity.device),
        format_bytes(capacity.host),
        format_bytes(nvme_free),
        plan.summary(),
    )
    for unit, reason in zip(units, plan.reasons):
        logger.debug("offload: optimizer state of unit %s on %s", unit.spec.name, reason)
    return plan


def host_cap(config: Config) -> int:
    """The RAM this rank's engine may use: `max_host_memory`, or what is available at start less
    HOST_MARGIN, shared by the ranks of this node."""
    return host_cap_bytes(
        parse_size(config.offload.max_host_memory),
        psutil.virtual_memory().available,
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )


def nvme_path_for_rank(nvme_path: str | list[str], local_rank: int) -> str:
    """A list of paths spreads ranks over disks, round robin by local rank."""
    if isinstance(nvme_path, list):
        return nvme_path[local_rank % len(nvme_path)]
    return nvme_path
