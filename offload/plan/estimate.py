"""How many bytes each tier needs for a model under each placement, and which placement to use.

Plain functions over sizes, following the engine's own accounting (what `engine.memory_report()`
records), so an estimate can be checked against a real run:

- device: the 16-bit weights of every unit when `offload.param` is `none`; otherwise the root
  unit (held for the whole forward and backward) plus `prefetch.depth + 1` of the largest other
  units (the one running and those fetched ahead), plus, with several ranks, the shard buffers
  that fetches fill before the all-gather. On top of that, the 16-bit gradient of the unit whose
  backward just finished and of the one before it, on their way to the host (`GRADS_IN_FLIGHT`
  of the largest unit: the engine makes backward wait rather than hold more, so this is the
  most the device holds however far the transfers lag behind; an idle host keeps one).
- host: `offload.plan.budgets.host_budget_bytes` (fp32 master, Adam moments and gradient of
  each element of this rank's shard when the optimizer lives on `cpu`; streaming slots when it
  lives on `nvme`: slots of one piece per state kind, as many and as large as `plan.shape_slots`
  makes them, and the gradient piece; the 16-bit home copy or its staging ring), each buffer
  rounded up to 4 KiB.
- nvme: one swap file per state kind and piece of a streamed unit (`plan.piece_bounds`), and one
  per unit for the weights on `nvme` (each a 4 KiB header + data rounded up to 4 KiB); 2 bytes
  per shard element (or 4 in fp32) for the weights on `nvme`.

Each kind of optimizer state is as wide as a `StateBytes` says (`state=`; default fp32 moments
and gradient: 16 bytes per element; `state_layout.state_bytes_for` gives a config's), so every
figure follows `optimizer.state_precision` and `optimizer.gradient_precision`;
`compare_state_precisions` puts them side by side. `step_disk_bytes` is what the optimizer
state moves over the disk per step, `weights_disk_traffic` what the weights on `nvme` move.

Activations are not in the engine's ledger: `activation_bytes` is a separate, rough figure (it
depends on the model's code, attention kernel, sequence length and checkpointing).

A model's shape (`ModelShape`) comes from `offload.plan.model_shapes`; the machine it is
checked against (`Machine`, `detect_machine`) from `offload.plan.machine`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from offload.config import sizes
from offload.config.placement import OptimizerTier
from offload.config.sizes import MIN_SUB_GROUP_SIZE, format_bytes, round_up
from offload.config.state_layout import FP32_STATE, STATE_KINDS, StateBytes, StatePrecision
from offload.errors import ConfigError
from offload.plan.budgets import host_budget_bytes, host_bytes_beside_optimizer_state, pool_page_slack
from offload.plan.machine import DEVICE_KINDS, Machine
from offload.plan.model_shapes import ModelShape, check_unit_count
from offload.plan.optimizer_plan import (
    GRADS_IN_FLIGHT,
    PAGE,
    Capacity,
    DiskTraffic,
    LeftoverRam,
    PlanError,
    device_room,
    engine_device_bytes,
    factor_needs_norm,
    host_cap_bytes,
    piece_count,
    plan_leftover_ram,
    plan_optimizer_tiers,
    shape_slots,
    step_disk_traffic,
    swap_bytes_for_state,
    swap_file_bytes,
    weights_disk_traffic,
)

COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Placements (offload.param, offload.optimizer), fastest first. The order is the cost per step:
# weights on the device move nothing; the optimizer on cpu moves 2 B/param of gradients down and
# 2 B/param of weights up over PCIe; weights on cpu add 2 x 2 B/param (forward and backward
# fetches); weights on nvme read 2 x 2 B/param from disk; the optimizer on nvme reads and writes
# its state from disk every step (32 B/param with fp32 moments and gradient, about 16 with int8
# moments and a 16-bit gradient: `step_disk_bytes`), the most expensive traffic of all.
# `auto` (the optimizer state in RAM while it lasts, then on NVMe, planned for the machine as the
# engine plans it) sits between all in RAM and all on NVMe.
PLACEMENTS = (
    ("none", "cpu"),
    ("cpu", "cpu"),
    ("nvme", "cpu"),
    ("none", "auto"),
    ("cpu", "auto"),
    ("nvme", "auto"),
    ("none", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)
FIXED_PLACEMENTS = tuple(placement for placement in PLACEMENTS if placement[1] != "auto")
# Fraction of the accelerator's memory the estimate lets the engine and activations use (the rest
# is the CUDA context, the caching allocator's fragmentation and the framework's workspaces).
DEVICE_HEADROOM = 0.90
# Beside the estimated activations, what a plan leaves on the GPU for the allocator's cache and
# the temporaries the estimate does not model.
ACTIVATION_SLACK = 0.05


# ---- bytes per tier ----------------------------------------------------------------------
@dataclass
class TierEstimate:
    """Peak bytes per tier for one placement, per rank, by category (the ledger's categories)."""

    param: str
    optimizer: str
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)
    # optimizer `auto`: the split the engine would make on the machine (OptimizerPlan.summary)
    plan: str | None = None
    # what the engine measures the RAM left over against (`leftover_ram`): its host budget
    # (state.host_budget_bytes) and the page slack of its pool, before anything left over is taken
    engine_host_request: int = 0
    # each unit's optimizer tier, and the piece its streamed state is read and written in
    optimizer_tiers: list[str] = field(default_factory=list)
    piece: int = 0
    # the bytes of each kind of optimizer state it was counted with
    state: StateBytes = FP32_STATE

    def total(self, tier: str) -> int:
        return sum(getattr(self, tier).values())

    def as_dict(self) -> dict:
        return {
            "param": self.param,
            "optimizer": self.optimizer,
            "plan": self.plan,
            **{
                tier: {"total": self.total(tier), "by_category": dict(getattr(self, tier))} for tier in ("device", "host", "nvme")
            },
        }


def _page(nbytes: int) -> int:
    return max(PAGE, round_up(nbytes, PAGE))


def _check_sub_group_size(sub_group_size: int | None) -> None:
    if (
        sub_group_size is not None and sub_group_size < MIN_SUB_GROUP_SIZE
    ):  # as offload.config.schema validates offload.sub_group_size
        raise ConfigError(
            f"sub_group_size must be >= {MIN_SUB_GROUP_SIZE} elements, got {sub_group_size}", key="offload.sub_group_size"
        )


def estimate_tiers(
    shape: ModelShape,
    param: str,
    optimizer: str,
    *,
    precision: str = "bf16",
    world_size: int = 1,
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    device: str = "cuda",
    optimizer_tiers: list[str] | None = None,
    sub_group_size: int | None = None,
    state: StateBytes = FP32_STATE,
) -> TierEstimate:
    """Peak bytes of one rank on each tier for this placement (see the module docstring).

    device: the kind the engine runs on, `cuda` or `cpu`. On CUDA the engine stages copies
    through host buffers (the gradient staging ring; for `param: none` the pinned 16-bit source
    of the weights); on the CPU stand-in the device buffers are host memory already. The same
    switch as the engine's: `host_budget_bytes(..., staged_device_copies=device == "cuda")`.
    optimizer_tiers: each unit's optimizer tier (`device` / `cpu` / `nvme`), for `auto` (see `plan_auto`).
    sub_group_size: `offload.sub_group_size`, the largest piece a streamed unit's state is read,
    stepped and written in (the size of the host slots and of each swap file of that state).
    state: the bytes of each kind of optimizer state (`state_layout.state_bytes_for`)."""
    if device not in DEVICE_KINDS:
        raise ConfigError(f"device {device!r} is not one of {', '.join(DEVICE_KINDS)}", key="device")
    staged_device_copies = device == "cuda"
    if precision not in COMPUTE_BYTES:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(COMPUTE_BYTES)}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    _check_sub_group_size(sub_group_size)
    cb = COMPUTE_BYTES[precision]
    padded = shape.padded_numels(world_size)
    shards = shape.shard_numels(world_size)
    largest_shard = max(shards)
    result = TierEstimate(param, optimizer)
    if optimizer == "auto" and optimizer_tiers is None:
        raise ConfigError(
            "optimizer 'auto' is planned per machine: pass optimizer_tiers (see plan_auto)", key="offload.optimizer"
        )
    tiers = optimizer_tiers or [optimizer] * len(shards)
    device_shards = [n for n, tier in zip(shards, tiers) if tier == "device"]
    host_shards = [n for n, tier in zip(shards, tiers) if tier == "cpu"]
    nvme_shards = [n for n, tier in zip(shards, tiers) if tier == "nvme"]
    # the slots' count and piece, as the engine shapes them (plan.shape_slots)
    slots = shape_slots(nvme_shards, buffer_count=buffer_count, sub_group_size=sub_group_size)

    # device
    # a gradient on its way off the device: the full unit at world 1, this rank's shard after the
    # reduce-scatter otherwise (the ledger counts what is held until the host copy is done)
    grad_of = padded if world_size == 1 else shards
    if param == "none":
        result.device["param"] = cb * sum(padded)
        result.device["grad"] = cb * GRADS_IN_FLIGHT * max(grad_of)
    else:
        root, others = padded[0], sorted(padded[1:], reverse=True)
        largest_other = others[0] if others else 0
        largest_other_grad = max(grad_of[1:], default=0)
        # two moments compete for the peak: backward through the blocks (root held, the running
        # block and `depth` fetched ahead, the gradients of the blocks before it in flight), and
        # the end of backward (root and the first block, the root's gradient and the first
        # block's in flight)
        blocks = (root + sum(others[: prefetch_depth + 1]), GRADS_IN_FLIGHT * largest_other_grad)
        end = (root + largest_other, grad_of[0] + (GRADS_IN_FLIGHT - 1) * largest_other_grad)
        params_resident, grads = max(blocks, end, key=sum)
        result.device["param"] = cb * params_resident
        result.device["grad"] = cb * grads
        if world_size > 1:
            result.device["param_shard"] = cb * largest_shard * min(len(padded), prefetch_depth + 1)

    if device_shards:  # master, moments and gradient of the units stepped on the device
        result.device["optimizer_state"] = sum(state.total_bytes(n) for n in device_shards)

    # host: the engine's budget (state.host_budget_bytes), every buffer rounded up to a page as
    # the host pool allocates it (one buffer per state kind and unit, per slot, per staging buffer)
    budget = host_budget_bytes(
        shards,
        param_tier=param,
        optimizer_tier=[OptimizerTier(tier) for tier in tiers],
        compute_bytes=cb,
        buffer_count=buffer_count,
        prefetch_depth=prefetch_depth,
        staged_device_copies=staged_device_copies,
        sub_group_size=sub_group_size,
        state=state,
    )
    result.engine_host_request = sum(budget.values()) + pool_page_slack(len(shards), slots.count, prefetch_depth)
    result.optimizer_tiers = list(tiers)
    result.piece = slots.piece
    result.state = state
    if "optimizer_state" in budget:
        result.host["optimizer_state"] = sum(_page(state.kind_bytes(kind, n)) for n in host_shards for kind in STATE_KINDS)
    if "optimizer_slots" in budget:
        # per slot one buffer of a piece per state kind (master, exp_avg, exp_avg_sq, grad32)
        result.host["optimizer_slots"] = slots.count * sum(_page(state.kind_bytes(kind, slots.piece)) for kind in STATE_KINDS)
        result.host["grad_slot"] = _page(state.kind_bytes("grad32", slots.piece))
    if "param16" in budget:
        result.host["param16"] = sum(_page(cb * n) for n in shards)
    if "param_staging" in budget:
        result.host["param_staging"] = (prefetch_depth + 2) * _page(cb * largest_shard)
    if "grad_staging" in budget:
        result.host["grad_staging"] = 2 * _page(cb * largest_shard)

    # nvme: swap files
    swap = sum(swap_bytes_for_state(n, slots.piece, state) for n in nvme_shards)  # four kinds, a file per piece
    if param == "nvme":
        swap += sum(swap_file_bytes(cb * n) for n in shards)
    if swap:
        result.nvme["swap"] = swap
    return result


@dataclass(frozen=True)
class LeftoverUse:
    """What the engine takes, beside a placement's needs (`estimate_tiers`), from the RAM that
    placement leaves within the host cap (plan.plan_leftover_ram). It only ever takes what is left
    over, so it never makes a placement not fit; `offload.speculation_memory` and
    `offload.gradient_memory` cap it (0 turns it off)."""

    # spare states of the units that step speculatively during backward (overlap 'backward' with
    # clipping or fp16), of the units whose state is in RAM
    spare_state: int
    speculating_units: int
    resident_units: int
    # gradients kept in RAM, of the units whose optimizer state streams from NVMe
    gradient: int
    gradient_units: int
    streamed_units: int
    # the transfer worker's gradient slot, not made when every such gradient is in RAM
    grad_slot_freed: int
    # the swap files of the gradients kept in RAM, not made
    nvme_saved: int

    @property
    def host(self) -> int:
        """Host bytes on top of the placement's."""
        return self.spare_state + self.gradient - self.grad_slot_freed


def leftover_plan(
    shape: ModelShape,
    estimate: TierEstimate,
    machine: Machine,
    *,
    world_size: int = 1,
    speculate: bool = False,
    max_host_memory: int | None = None,
    speculation_memory: int | None = None,
    gradient_memory: int | None = None,
) -> LeftoverRam:
    """Per unit, what the engine would take from the RAM `estimate`'s placement leaves on
    `machine`, as it decides at start (tiers.TierStore, plan.plan_leftover_ram): the host cap
    (`max_host_memory`, or the RAM available less HOST_MARGIN, shared by the node's ranks) less
    the placement's host budget, spent on state as wide as `estimate.state`. `speculate`:
    overlap 'auto', or 'backward' with clipping or fp16 (`speculates`)."""
    cap = host_cap_bytes(max_host_memory, machine.ram_bytes, machine.ranks_per_node)
    return plan_leftover_ram(
        shape.shard_numels(world_size),
        [OptimizerTier(tier) for tier in estimate.optimizer_tiers],
        room=cap - estimate.engine_host_request,
        speculate=speculate,
        speculation_cap=speculation_memory,
        gradient_cap=gradient_memory,
        state=estimate.state,
    )


def leftover_ram(
    shape: ModelShape,
    estimate: TierEstimate,
    machine: Machine,
    *,
    world_size: int = 1,
    speculate: bool = False,
    max_host_memory: int | None = None,
    speculation_memory: int | None = None,
    gradient_memory: int | None = None,
) -> LeftoverUse:
    """What the engine would take from the RAM `estimate`'s placement leaves on `machine`
    (`leftover_plan`, whose arguments these are), in bytes and units."""
    plan = leftover_plan(
        shape,
        estimate,
        machine,
        world_size=world_size,
        speculate=speculate,
        max_host_memory=max_host_memory,
        speculation_memory=speculation_memory,
        gradient_memory=gradient_memory,
    )
    return leftover_use(shape, estimate, plan, world_size=world_size)


def leftover_use(shape: ModelShape, estimate: TierEstimate, plan: LeftoverRam, *, world_size: int = 1) -> LeftoverUse:
    """`plan` (`leftover_plan`) in bytes and units beside `estimate`'s placement."""
    shards = shape.shard_numels(world_size)
    tiers = [OptimizerTier(tier) for tier in estimate.optimizer_tiers]
    streamed = [index for index, tier in enumerate(tiers) if tier.streamed]
    in_ram = [index for index in streamed if plan.gradients_in_ram[index]]
    every_gradient_in_ram = bool(streamed) and len(in_ram) == len(streamed)
    return LeftoverUse(
        spare_state=plan.spare_bytes,
        speculating_units=sum(plan.speculating),
        resident_units=sum(tier is OptimizerTier.HOST for tier in tiers),
        gradient=plan.gradient_bytes,
        gradient_units=len(in_ram),
        streamed_units=len(streamed),
        grad_slot_freed=estimate.host.get("grad_slot", 0) if every_gradient_in_ram else 0,
        # the gradient's swap files, piece by piece
        nvme_saved=sum(
            swap_bytes_for_state(shards[index], estimate.piece, estimate.state, kinds=("grad32",)) for index in in_ram
        ),
    )


def step_disk_bytes(
    shape: ModelShape,
    estimate: TierEstimate,
    gradients_in_ram: list[bool] | None = None,
    *,
    world_size: int = 1,
    accumulation_steps: int = 1,
) -> DiskTraffic:
    """What the optimizer state of `estimate`'s NVMe units reads from and writes to the disk in
    one optimizer step (plan.step_disk_traffic per unit, in `estimate.piece` pieces, as wide as
    `estimate.state`); `gradients_in_ram`: per unit, whether its gradient stays in RAM
    (`leftover_plan`; none by default); `accumulation_steps`: micro-batches per step (a
    gradient on NVMe is read and written again for each one after the first). The 16-bit
    weights' own traffic with param `nvme` is not counted."""
    shards = shape.shard_numels(world_size)
    in_ram = gradients_in_ram or [False] * len(shards)
    total = DiskTraffic()
    for numel, tier, kept in zip(shards, estimate.optimizer_tiers, in_ram):
        if OptimizerTier(tier).streamed:
            total += step_disk_traffic(
                numel, estimate.piece, estimate.state, gradient_in_ram=kept, accumulation_steps=accumulation_steps
            )
    return total


def swap_file_count(
    shape: ModelShape,
    estimate: TierEstimate,
    gradients_in_ram: list[bool] | None = None,
    *,
    world_size: int = 1,
) -> int:
    """The swap files the engine makes for `estimate`'s placement on one rank, each held open for
    the run (storage.swap): one per state kind and piece of each NVMe unit's optimizer state (no
    gradient file where `gradients_in_ram` keeps the unit's gradient in RAM), and with param
    `nvme` one per unit for its 16-bit weights."""
    shards = shape.shard_numels(world_size)
    in_ram = gradients_in_ram or [False] * len(shards)
    files = 0
    for numel, tier, kept in zip(shards, estimate.optimizer_tiers, in_ram):
        if OptimizerTier(tier).streamed:
            files += piece_count(numel, estimate.piece) * (len(STATE_KINDS) - (1 if kept else 0))
    if estimate.param == "nvme":
        files += len(shards)
    return files


def speculates(overlap: str, gradient_clipping: float, precision: str) -> bool:
    """Whether the engine steps speculatively during backward (overlap.overlap_policy)."""
    return overlap == "auto" or (overlap == "backward" and factor_needs_norm(gradient_clipping, precision))


def plan_auto(
    shape: ModelShape,
    param: str,
    machine: Machine,
    *,
    precision: str,
    world_size: int,
    prefetch_depth: int,
    buffer_count: int | None,
    activations: int | None = None,
    sub_group_size: int | None = None,
    max_device_memory: int | None = None,
    max_host_memory: int | None = None,
    state: StateBytes = FP32_STATE,
) -> tuple[list[str] | None, str]:
    """`offload.optimizer: auto` on `machine`, as the engine plans it (plan.room.plan_optimizer): per
    unit `device`, `cpu` or `nvme`, and the plan in words; (None, why) when nothing fits. The
    device's room is what the engine would measure at start on an idle GPU (DEVICE_HEADROOM of
    it free) less this placement's weights and gradients and the activations (`activations`
    plus ACTIVATION_SLACK of the GPU when the estimate knows them, else the engine's default
    share: set `offload.max_device_memory` to the room this plan shows to get the same split).
    `max_device_memory`, `max_host_memory`: the config's caps (bytes), as the engine applies them.
    `state`: the bytes of each kind of optimizer state (`state_layout.state_bytes_for`)."""
    _check_sub_group_size(sub_group_size)
    cb = COMPUTE_BYTES[precision]
    shards = shape.shard_numels(world_size)
    others = host_bytes_beside_optimizer_state(
        shards,
        param_tier=param,
        compute_bytes=cb,
        prefetch_depth=prefetch_depth,
        staged_device_copies=machine.device == "cuda",
    )
    ranks = machine.ranks_per_node
    device = device_room(cap=max_device_memory, memory=None, engine_bytes=0)  # the CPU stands in
    if machine.gpu_bytes is not None:
        engine_bytes = engine_device_bytes(
            shape.padded_numels(world_size),
            params_offloaded=param != "none",
            compute_bytes=cb,
            prefetch_depth=prefetch_depth,
        )
        memory = (int(machine.gpu_bytes * DEVICE_HEADROOM), machine.gpu_bytes)
        reserve = None if activations is None else activations + int(machine.gpu_bytes * ACTIVATION_SLACK)
        device = device_room(cap=max_device_memory, memory=memory, engine_bytes=engine_bytes, reserve=reserve)
    capacity = Capacity(
        device=device,
        host=max(0, host_cap_bytes(max_host_memory, machine.ram_bytes, ranks) - others),
        # with param nvme, the 16-bit weights' swap files take their share of the disk first
        nvme=max(0, machine.disk_bytes // ranks - (sum(cb * n for n in shards) if param == "nvme" else 0)),
    )
    try:
        plan = plan_optimizer_tiers(
            shards, list(range(len(shards))), capacity, buffer_count=buffer_count, sub_group_size=sub_group_size, state=state
        )
    except PlanError as error:
        return None, str(error)
    return [tier.value for tier in plan.tiers], plan.summary()


def activation_bytes(
    shape: ModelShape, *, micro_batch: int = 1, seq_len: int = 2048, precision: str = "bf16", checkpointing: bool = False
) -> int | None:
    """A rough figure for the activations of one micro-batch on the device (None when the
    architecture is unknown). Not in the engine's ledger; real use depends on the attention kernel
    and the model's code. Per layer and token: about 34 x hidden bytes kept for backward in 16-bit
    (Korthikanti et al. 2022, without the attention-score term that fused kernels avoid), or one
    hidden state with activation checkpointing plus one layer recomputed; plus the logits in fp32."""
    if not shape.hidden_size:
        return None
    cb = COMPUTE_BYTES.get(precision, 2)
    tokens = micro_batch * seq_len
    per_layer = 34 * shape.hidden_size * tokens * cb // 2
    if checkpointing:
        layers = shape.hidden_size * tokens * cb * shape.num_layers + per_layer
    else:
        layers = per_layer * shape.num_layers
    logits = tokens * shape.vocab_size * (cb + 4 + 4)  # logits, their fp32 upcast and its gradient
    return layers + logits


# ---- the decision -------------------------------------------------------------------------
def fit_problems(estimate: TierEstimate, machine: Machine, activations: int = 0) -> list[str]:
    """Why this placement does not fit the machine (an empty list when it fits)."""
    problems = []
    ranks = machine.ranks_per_node
    device = estimate.total("device") + (activations or 0)
    host = estimate.total("host") * ranks
    nvme = estimate.total("nvme") * ranks
    if machine.gpu_bytes is not None:
        usable = int(machine.gpu_bytes * DEVICE_HEADROOM)
        if device > usable:
            problems.append(
                f"device needs {format_bytes(device)} per GPU, {format_bytes(usable)} usable "
                f"({DEVICE_HEADROOM:.0%} of {format_bytes(machine.gpu_bytes)})"
            )
    else:
        host += device * ranks  # the CPU stands in for the accelerator: same RAM
    if host > machine.ram_bytes:
        problems.append(
            f"host needs {format_bytes(host)} of RAM for {ranks} rank(s), {format_bytes(machine.ram_bytes)} available"
        )
    if nvme > machine.disk_bytes:
        problems.append(f"nvme needs {format_bytes(nvme)} at {machine.nvme_path}, {format_bytes(machine.disk_bytes)} free")
    return problems


def recommend(
    fits: dict[tuple[str, str], bool], device_only_auto: frozenset[str] | set[str] = frozenset()
) -> tuple[str, str] | None:
    """The fastest placement that fits (PLACEMENTS is ordered fastest first), or None.
    `device_only_auto`: the params whose `auto` plan keeps every unit on the device or in RAM with
    some on the device; that plan beats the same param's all-in-RAM placement (those units step
    on the GPU, the rest as before), so it is ranked just before it."""
    order = []
    for placement in PLACEMENTS:
        param, optimizer = placement
        if optimizer == "cpu" and param in device_only_auto:
            order.append((param, "auto"))
        if not (optimizer == "auto" and param in device_only_auto):
            order.append(placement)
    for placement in order:
        if fits.get(placement):
            return placement
    return None


def recommended_config(
    placement: tuple[str, str],
    *,
    precision: str = "bf16",
    nvme_path: str = "./offload-swap",
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    sub_group_size: int | None = None,
    state_precision: str = "fp32",
) -> dict:
    """An offload config (every key valid for `offload.load_config`) for this placement (and the
    state precision the estimate counted, when it is not the default fp32)."""
    param, optimizer = placement
    offload: dict[str, str | int] = {"param": param, "optimizer": optimizer}
    if "nvme" in placement or optimizer == "auto":
        offload["nvme_path"] = nvme_path
        if buffer_count is not None:
            offload["buffer_count"] = buffer_count
    if optimizer in ("nvme", "auto") and sub_group_size is not None:  # the piece the estimate sized the slots with
        offload["sub_group_size"] = sub_group_size
    config: dict = {"precision": precision, "offload": offload}
    if param != "none":
        config["prefetch"] = {"depth": prefetch_depth}
    if state_precision != StatePrecision.FP32.value:
        config["optimizer"] = {"state_precision": state_precision}
    return config


# the chunk a checkpoint load's first pass streams the state through (checkpoint.format.CHUNK_BYTES;
# tests/test_checkpoint_tamper.py checks they agree)
LOAD_CHUNK_BYTES = 16 << 20


def checkpoint_costs(num_params: int, world_size: int) -> dict:
    """What a checkpoint of `num_params` parameters takes: its bytes on disk (fp32 master and both
    moments: 12 per parameter, over all ranks), and what a load needs beside the engine's own
    memory: one chunk of RAM per rank for the first pass that checks everything, no disk, and
    the state read twice (checked, then applied)."""
    state = 12 * num_params
    return {
        "bytes": state,
        "load_extra_ram_per_rank": LOAD_CHUNK_BYTES,
        "load_extra_disk": 0,
        "load_bytes_read": 2 * state,
        "overwrite_extra_disk": state,
    }


def estimate_report(
    shape: ModelShape,
    machine: Machine,
    *,
    precision: str = "bf16",
    world_size: int = 1,
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    micro_batch: int = 1,
    seq_len: int = 2048,
    checkpointing: bool = False,
    sub_group_size: int | None = None,
    max_device_memory: int | None = None,
    max_host_memory: int | None = None,
    overlap: str = "auto",
    gradient_clipping: float = 0.0,
    speculation_memory: int | None = None,
    gradient_memory: int | None = None,
    state: StateBytes = FP32_STATE,
    accumulation_steps: int = 1,
) -> dict:
    """Every placement's bytes per tier, whether it fits `machine`, what the engine would take
    beside them from the RAM left over (`leftover_ram`), what its optimizer state moves over the
    disk per step (`step_disk_bytes`), and the recommended config (a JSON-able dict; the CLI
    prints it as a table or as JSON). The engine's device kind is `machine.device`.
    `max_device_memory`, `max_host_memory`: the config's caps for `auto` and for what is left
    over; `overlap`, `gradient_clipping`, `speculation_memory`, `gradient_memory`,
    `accumulation_steps`: the config's; `state`: the bytes of each kind of optimizer state
    (`state_layout.state_bytes_for` of the config). More than MAX_UNITS units are refused."""
    check_unit_count(shape)
    activations = activation_bytes(
        shape, micro_batch=micro_batch, seq_len=seq_len, precision=precision, checkpointing=checkpointing
    )
    rows: list[dict] = []
    fits: dict[tuple[str, str], bool] = {}
    device_only_auto: set[str] = set()  # params whose auto plan uses the device and no NVMe
    assert machine.device is not None  # Machine.__post_init__ turns None into cuda or cpu
    for placement in PLACEMENTS:
        tiers, plan = None, None
        if placement[1] == "auto":
            tiers, plan = plan_auto(
                shape,
                placement[0],
                machine,
                precision=precision,
                world_size=world_size,
                prefetch_depth=prefetch_depth,
                buffer_count=buffer_count,
                activations=activations,
                sub_group_size=sub_group_size,
                max_device_memory=max_device_memory,
                max_host_memory=max_host_memory,
                state=state,
            )
            if tiers is None:
                rows.append(
                    {
                        "param": placement[0],
                        "optimizer": "auto",
                        "plan": None,
                        "fits": False,
                        "problems": [plan],
                        **{tier: {"total": None, "by_category": {}} for tier in ("device", "host", "nvme")},
                    }
                )
                fits[placement] = False
                continue
        estimate = estimate_tiers(
            shape,
            *placement,
            precision=precision,
            world_size=world_size,
            prefetch_depth=prefetch_depth,
            buffer_count=buffer_count,
            device=machine.device,
            optimizer_tiers=tiers,
            sub_group_size=sub_group_size,
            state=state,
        )
        estimate.plan = plan
        problems = fit_problems(estimate, machine, activations or 0)
        fits[placement] = not problems
        taken = leftover_plan(
            shape,
            estimate,
            machine,
            world_size=world_size,
            speculate=speculates(overlap, gradient_clipping, precision),
            max_host_memory=max_host_memory,
            speculation_memory=speculation_memory,
            gradient_memory=gradient_memory,
        )
        leftover = leftover_use(shape, estimate, taken, world_size=world_size)
        traffic = step_disk_bytes(
            shape, estimate, taken.gradients_in_ram, world_size=world_size, accumulation_steps=accumulation_steps
        )
        weights = DiskTraffic()
        if placement[0] == "nvme":
            weights = weights_disk_traffic(shape.shard_numels(world_size), COMPUTE_BYTES[precision], overlap, taken.speculating)
        rows.append(
            {
                **estimate.as_dict(),
                "fits": not problems,
                "problems": problems,
                "leftover_ram": {**asdict(leftover), "host": leftover.host},
                "disk_per_step": {"read": traffic.read, "written": traffic.written},
                "weights_disk_per_step": {"read": weights.read, "written": weights.written},
                "swap_files": swap_file_count(shape, estimate, taken.gradients_in_ram, world_size=world_size),
            }
        )
        if tiers is not None and "device" in tiers and "nvme" not in tiers:
            device_only_auto.add(placement[0])
    choice = recommend(fits, device_only_auto)
    padded = shape.padded_numels(world_size)
    return {
        "model": {
            "name": shape.name,
            "params": shape.num_params,
            "units": len(padded),
            "largest_unit_params": max(sum(u) for u in shape.unit_tensors()),
            "root_unit_params": sum(shape.unit_tensors()[0]),
        },
        "settings": {
            "precision": precision,
            "device": machine.device,
            "world_size": world_size,
            "ranks_per_node": machine.ranks_per_node,
            "prefetch_depth": prefetch_depth,
            "buffer_count": buffer_count,
            "sub_group_size": sub_group_size,
            # the slots with every unit's optimizer state on NVMe (the keys above: None is unset)
            "nvme_slots": asdict(
                shape_slots(shape.shard_numels(world_size), buffer_count=buffer_count, sub_group_size=sub_group_size)
            ),
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "checkpointing": checkpointing,
            "overlap": overlap,
            "gradient_clipping": gradient_clipping,
            "speculation_memory": speculation_memory,
            "gradient_memory": gradient_memory,
            "gradient_accumulation_steps": accumulation_steps,
            "state": state_settings(state),
        },
        "machine": {
            "gpu_bytes": machine.gpu_bytes,
            "ram_bytes": machine.ram_bytes,
            "disk_bytes": machine.disk_bytes,
            "nvme_path": machine.nvme_path,
        },
        "activations_bytes": activations,
        "checkpoint": checkpoint_costs(shape.num_params, world_size),
        "activations_note": "rough; not counted by the engine's ledger, added to the device tier when checking fit",
        "placements": rows,
        "recommended": None
        if choice is None
        else {
            "param": choice[0],
            "optimizer": choice[1],
            "config": recommended_config(
                choice,
                precision=precision,
                nvme_path=machine.nvme_path,
                prefetch_depth=prefetch_depth,
                buffer_count=buffer_count,
                sub_group_size=sub_group_size,
                state_precision=state.precision.value,
            ),
        },
    }


def state_settings(state: StateBytes) -> dict:
    """How a report states the optimizer state it counted: the moments' precision, the gradient's
    bytes per element, and the bytes per param of all four kinds (large states)."""
    return {
        "state_precision": state.precision.value,
        "gradient_bytes": state.gradient_bytes,
        "bytes_per_param": round(state.per_element, 3),
    }


# ---- sizes as text -----------------------------------------------------------------------
def parse_bytes(text: str, *, binary: bool = False) -> int:
    """'24GB' (10^9; 2^30 with `binary`), '24GiB' or '24G' (2^30), '512M', '1e9' -> bytes
    (sizes.parse_bytes), or a ConfigError.

    `binary=True` reads KB/MB/GB/TB as GPU and RAM makers mean them (a "24GB" GPU has 24 GiB);
    disks are sold in decimal units, so sizes of disks are read with `binary=False`."""
    try:
        return sizes.parse_bytes(text, binary=binary)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def size_note(option: str, text: str, nbytes: int, *, binary: bool) -> str | None:
    """How a size given as text was read, when its unit is ambiguous (KB/MB/GB/TB), else None."""
    if sizes.unit_of(text) not in sizes.DECIMAL_TO_BINARY:
        return None
    how = "binary units, as GPU and RAM makers mean them" if binary else "decimal units, as disk makers mean them"
    return f"{option} {text} read as {nbytes:,} bytes = {format_bytes(nbytes)} ({how})"


def parse_count(text: str) -> int:
    """'7B', '7e9', '13b', '350M', '1.5T' -> a parameter count."""
    match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*([kmbtKMBT]?)\s*", str(text))
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
    if not match or not math.isfinite(value := float(match.group(1)) * scale[match.group(2).lower()]):  # 1e400: inf
        raise ConfigError(f"{text!r} is not a parameter count; write it like 7B, 7e9 or 350M")
    return int(value)
