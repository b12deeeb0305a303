"""Host memory budgets: what the engine's host buffers take beside the optimizer state, as
plain arithmetic (no torch), shared by the engine's plan and `offload estimate`."""

from __future__ import annotations

from offload.config.placement import OptimizerTier, ParamTier
from offload.config.state_layout import FP32_STATE, StateBytes
from offload.plan.optimizer_plan import PAGE, shape_slots


def pool_page_slack(unit_count: int, slot_count: int, prefetch_depth: int) -> int:
    """What the host pool holds beside the budget (`host_budget_bytes`) for rounding each buffer
    up to a page: a page for each of at most 8 buffers per unit, 4 per optimizer slot, and the
    staging buffers."""
    return PAGE * (8 * unit_count + 4 * slot_count + prefetch_depth + 8)


def host_budget_bytes(
    shard_numels: list[int],
    *,
    param_tier: ParamTier | str,
    optimizer_tier: OptimizerTier | str | list[OptimizerTier],
    compute_bytes: int,
    buffer_count: int | None,
    prefetch_depth: int,
    staged_device_copies: bool,
    optimizer_numels: list[int] | None = None,
    sub_group_size: int | None = None,
    state: StateBytes = FP32_STATE,
) -> dict[str, int]:
    """Bytes of host memory each use needs for this placement (plain arithmetic, tested directly).

    shard_numels: this rank's shard length of every unit. optimizer_tier: one tier for every
    unit, or one per unit. compute_bytes: bytes per 16-bit (or fp32) compute element.
    staged_device_copies: gradients pass through a host staging ring (CUDA); on the CPU the
    device buffers are host memory already. optimizer_numels: the part of each shard with
    optimizer state (its trainable params; frozen ones have none); the whole shard by default.
    buffer_count, sub_group_size: the config's `offload.buffer_count` and
    `offload.sub_group_size` (None: unset, chosen by `plan.shape_slots`). state: the bytes of
    each kind of optimizer state (`config.state_layout.state_bytes_for`; default fp32 moments and
    gradient, 16 bytes per element).
    """
    param_tier = ParamTier(param_tier)
    if isinstance(optimizer_tier, list):
        tiers = [OptimizerTier(tier) for tier in optimizer_tier]
    else:
        tiers = [OptimizerTier(optimizer_tier)] * len(shard_numels)
    largest = max(shard_numels, default=0)
    total = sum(shard_numels)
    states = shard_numels if optimizer_numels is None else optimizer_numels
    resident = [n for n, tier in zip(states, tiers) if tier is OptimizerTier.HOST and n]
    streamed = [n for n, tier in zip(states, tiers) if tier.streamed]
    need = {}
    if resident:
        # master, exp_avg, exp_avg_sq, grad32 of each unit (an int8 moment's exponents per unit)
        need["optimizer_state"] = sum(state.total_bytes(n) for n in resident)
    if streamed:
        shape = shape_slots(streamed, buffer_count=buffer_count, sub_group_size=sub_group_size)
        # per slot: the four kinds of state of the largest piece; the transfer worker's gradient piece
        need["optimizer_slots"] = shape.count * state.total_bytes(shape.piece)
        need["grad_slot"] = state.gradient_bytes * shape.piece
    if param_tier.host_copy or (param_tier is ParamTier.DEVICE and staged_device_copies):
        # the weights' home (cpu), or the pinned source of their copy to the device (none, CUDA);
        # with `none` on the CPU the step writes the device buffer, host memory, in place
        need["param16"] = compute_bytes * total
    elif param_tier is ParamTier.NVME:
        need["param_staging"] = (prefetch_depth + 2) * largest * compute_bytes
    if staged_device_copies:
        need["grad_staging"] = 2 * largest * compute_bytes
    return need


def host_bytes_beside_optimizer_state(
    shard_numels: list[int],
    *,
    param_tier: ParamTier | str,
    compute_bytes: int,
    prefetch_depth: int,
    staged_device_copies: bool,
) -> int:
    """The engine's host bytes that do not depend on where the optimizer state goes (16-bit
    homes, staging rings): what `offload.optimizer: auto` takes off the RAM it may use before
    planning the state (the plan adds the NVMe slots itself when some unit streams)."""
    budget = host_budget_bytes(
        shard_numels,
        param_tier=param_tier,
        optimizer_tier=OptimizerTier.NVME,
        compute_bytes=compute_bytes,
        buffer_count=1,
        prefetch_depth=prefetch_depth,
        staged_device_copies=staged_device_copies,
    )
    return sum(nbytes for use, nbytes in budget.items() if use not in ("optimizer_slots", "grad_slot"))
