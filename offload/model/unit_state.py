"""Where each unit's training state lives, and the host buffers that carry it between tiers.

Per unit, this rank holds one shard of: the fp32 master weights, `exp_avg`, `exp_avg_sq`, the
fp32 gradient (on the optimizer tier: host buffers, or swap files streamed through slots) and
the 16-bit weights between uses (on the param tier: the device itself for `none`, a host buffer
for `cpu`, a swap file for `nvme`). The four fp32 states cover only the first
`optimizer_numel` elements of the shard, where the parameters that require grad are
(units.FlatLayout): frozen parameters have their 16-bit weights and nothing else.

Buffers and who uses them:
- resident host buffers (`optimizer: cpu`; `param: cpu`, or `none` on CUDA): allocated once from the pool.
  The transfer worker writes gradients into `grad32`; the optimizer worker reads and writes
  the rest; the engine makes sure the two never run on one unit at once (a step starts only
  after every gradient of its window has landed).
- spare state (overlap `backward` with clipping or fp16, units with resident host state, as many
  as RAM allows: plan.plan_speculation): the optimizer worker writes a speculative step's master
  and moments into it, reading the resident ones; the main thread swaps the two
  (`commit_spare`) in step(), after waiting for every step, when the step stands.
- `OptimizerSlot`s (`optimizer: nvme`): `SlotShape.count` sets of (master, exp_avg,
  exp_avg_sq, grad32) buffers sized for one piece: a unit's state is streamed in pieces of at
  most `SlotShape.piece` elements (`plan.shape_slots`, `plan.piece_bounds`), so a 70B model's
  856M-element blocks do not cost 41 GB of slots. Only the optimizer worker uses them; a slot is
  reused for piece i + count after piece i's writes have completed. A streamed unit's new 16-bit weights
  are written into their home (`param: cpu`, `none`), or into a staging buffer (`param: nvme`).
- `staging` ring (`param: nvme`): host buffers the transfer worker reads 16-bit shards into
  before copying them to the device; one is reused once its device copy has completed.
- fresh 16-bit weights (`param: nvme`, `FreshWeights`): the staging buffer a step wrote a
  unit's new weights into, offered by the optimizer worker while their write-back is in flight.
  A fetch (transfer worker) borrows it instead of reading back the file being written; the
  optimizer worker withdraws it once the write is settled, waiting until no borrow is out, and
  only then gives the buffer back to the ring.
- `grad_slot` (`optimizer: nvme`): the transfer worker's buffer for read-add-write of the fp32
  gradient, one piece at a time; used by one task at a time (the transfer worker is one thread).
  Made only when some NVMe unit keeps its gradient on NVMe: a unit with `gradient_in_ram` has
  it in `resident_state["grad32"]` (the transfer worker adds into it, the step reads it, as for
  resident state) and no gradient swap files.
- prefetched pieces (`optimizer: nvme`): during the window's last backward the optimizer worker
  reads the master and moments of the step's first pieces into the slots ahead of it
  (`TierStore.prefetch_optimizer_states`); the next stream uses them, anyone else using the
  slots waits them out first.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from offload.config.placement import OptimizerTier, ParamTier
from offload.model.units import FlatLayout, UnitSpec
from offload.plan.optimizer_plan import PAGE, shape_slots
from offload.platform.device import StreamEvent

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq", "grad32")
# what a step writes anew (the gradient is only read): a speculative step's spare state, and
# what is read ahead of a step during backward
STEPPED_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(repr=False)
class UnitState:
    """One unit at run time: its layout, its device buffer and where its shard's state lives."""

    spec: UnitSpec
    layout: FlatLayout
    # elements at the start of this rank's shard that carry optimizer state (master, moments,
    # fp32 gradient): the trainable params' part of the shard. -1: the whole shard
    optimizer_numel: int = -1
    # per param (as spec.params), the index of its parameter group (engine.optimizer.param_groups)
    param_groups: tuple[int, ...] = ()
    # 16-bit (compute dtype) full flat buffer on the device; the params are views of it. Its
    # storage is freed (resized to 0) between uses unless the param tier is `none`.
    device_flat: torch.Tensor | None = None
    # the four fp32 state tensors by kind when they are not streamed: host buffers (optimizer
    # tier HOST) or device tensors (tier DEVICE); empty for NVMe-resident state
    resident_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # overlap 'backward' with clipping or fp16, a unit chosen by plan.plan_speculation: a second
    # master / exp_avg / exp_avg_sq (host buffers) that the speculative step writes into while
    # `resident_state` keeps the old values for an exact redo; `commit_spare` swaps the two once
    # step() knows the global norm needs no clipping. Empty: the unit steps after the norm.
    spare_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # the 16-bit home copy (param: cpu, or none on CUDA)
    param16: torch.Tensor | None = None
    # params (indices into spec.params) that received a gradient in this accumulation window
    grads_in_window: set[int] = field(default_factory=set)
    # params whose gradient has arrived in the current backward but not yet been flushed
    grads_pending: set[int] = field(default_factory=set)
    window_started: bool = False
    # squared L2 norm of this shard's accumulated gradient (loss-scaled), set at the boundary
    grad_sq_norm: float | None = None
    # set by the optimizer worker when this unit's step (and its 16-bit write-back) is done;
    # waited on by anything that reads the unit's weights (fetch, forward, checkpoint)
    step_done: threading.Event = field(default_factory=threading.Event)
    # residency bookkeeping, main thread only
    holders: int = 0
    backward_holds: int = 0
    fetch_future: object | None = None
    # device buffer the fetch fills when it is not `device_flat` itself (a shard, world > 1)
    fetch_target: torch.Tensor | None = None
    resident: bool = False
    # which weights a device copy holds: `weights_version` counts the steps scheduled for this
    # unit (`begin_step`); a fetch records the version it copies (`fetch_version`) and the
    # device copy keeps it (`resident_version`). A copy whose version is not the current one
    # is stale and is fetched again before any use.
    weights_version: int = 0
    fetch_version: int = -1
    resident_version: int = -1
    # optimizer steps this unit has taken (Adam's bias correction counts them)
    step_count: int = 0
    # where this unit's optimizer state lives (chosen per unit under `offload.optimizer: auto`)
    optimizer_tier: OptimizerTier = OptimizerTier.HOST
    # optimizer state on NVMe, and the fp32 gradient kept in RAM instead of its swap files
    # (`resident_state["grad32"]`; TierStore._plan_gradients): the step reads and writes only the
    # master and moments through the slots
    gradient_in_ram: bool = False
    # [start, end) of each piece the optimizer state is streamed in (TierStore sets it: pieces of
    # `SlotShape.piece` elements when streamed from NVMe, else the whole state at once)
    state_pieces: list[tuple[int, int]] = field(default_factory=list)
    # param tier `none`: the copy-stream event after which `device_flat` holds the new weights,
    # and whether the shards of the other ranks still have to be gathered
    device_update_event: StreamEvent | None = None
    needs_gather: bool = False

    def __post_init__(self) -> None:
        self.step_done.set()
        if self.optimizer_numel < 0:
            self.optimizer_numel = self.layout.shard_numel
        if not self.param_groups:
            self.param_groups = (0,) * len(self.spec.params)

    @property
    def swap_kinds(self) -> tuple[str, ...]:
        """The state kinds this unit keeps in swap files, piece by piece: every kind when its
        optimizer state streams from NVMe, less the gradient when that is kept in RAM; none
        when the state is resident."""
        if not self.optimizer_tier.streamed:
            return ()
        return tuple(kind for kind in STATE_KINDS if not (kind == "grad32" and self.gradient_in_ram))

    def begin_step(self) -> None:
        """A step of this unit is scheduled: its weights change, and readers wait for `step_done`."""
        self.step_done.clear()
        self.weights_version += 1

    def end_window(self) -> None:
        """The gradient window is over (stepped, or discarded): no gradient is pending a step."""
        self.grads_in_window.clear()
        self.window_started = False
        self.grad_sq_norm = None

    def commit_spare(self) -> None:
        """The speculative step stands: its results (in `spare_state`) become the unit's state,
        and the old state's buffers the spare that the next speculative step overwrites."""
        for kind, spare in self.spare_state.items():
            self.spare_state[kind] = self.resident_state[kind]
            self.resident_state[kind] = spare

    def __repr__(self) -> str:
        # no tensors: a freed device buffer (0-byte storage) must never be printed
        return f"UnitState({self.spec.name}, holders={self.holders}, resident={self.resident}, optimizer={self.optimizer_tier.value})"

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def swap_name(self, kind: str, piece: int | None = None) -> str:
        """The swap tensor's name: the 16-bit weights (`param16`), or piece `piece` of an fp32 state kind."""
        if piece is None:
            return f"unit{self.index}.{kind}"
        return f"unit{self.index}.{kind}.p{piece}"


class BufferRing:
    """A fixed set of equal host buffers handed out one at a time (blocking when all are in use)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._free: queue.Queue = queue.Queue()
        for buffer in buffers:
            self._free.put(buffer)
        self.buffers = list(buffers)

    def take(self) -> torch.Tensor:
        return self._free.get()

    def give(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


@dataclass
class _Fresh:
    buffer: torch.Tensor
    version: int
    borrows: int = 0
    # being withdrawn: lent no more, kept (so that borrows can end) until none is out
    withdrawn: bool = False


class FreshWeights:
    """Units' new 16-bit weights still in the staging buffers their steps wrote them to (see the
    module docstring). `offer` and `withdraw`: the optimizer worker; `borrow` and `give_back`:
    any reader (the transfer worker's fetches, a weights reader). One condition guards it all."""

    def __init__(self) -> None:
        self._by_unit: dict[int, _Fresh] = {}
        self._changed = threading.Condition()
        self.borrowed = 0  # borrows so far (how many reads of the swap file they saved)

    def offer(self, unit: UnitState, buffer: torch.Tensor) -> None:
        """`buffer` holds `unit`'s weights of its current version (its step just wrote them)."""
        with self._changed:
            self._by_unit[unit.index] = _Fresh(buffer, unit.weights_version)

    def borrow(self, unit: UnitState) -> torch.Tensor | None:
        """The unit's current weights if a staging buffer still holds them (give it back with
        `give_back`), else None (read the file)."""
        with self._changed:
            fresh = self._by_unit.get(unit.index)
            if fresh is None or fresh.withdrawn or fresh.version != unit.weights_version:
                return None
            fresh.borrows += 1
            self.borrowed += 1
            return fresh.buffer

    def give_back(self, buffer: torch.Tensor) -> bool:
        """Ends a borrow of `buffer`; False when `buffer` is not a borrowed one."""
        with self._changed:
            for fresh in self._by_unit.values():
                if fresh.borrows and fresh.buffer.data_ptr() == buffer.data_ptr():
                    fresh.borrows -= 1
                    self._changed.notify_all()
                    return True
        return False

    def withdraw(self, buffer: torch.Tensor) -> None:
        """`buffer` is about to be reused: no one may borrow it from now on, and this returns
        once every borrow of it has ended (each is one host or device copy)."""
        with self._changed:
            for index in [i for i, fresh in self._by_unit.items() if fresh.buffer.data_ptr() == buffer.data_ptr()]:
                self._end(index)

    def _end(self, index: int) -> None:
        """(Condition held.) Lends the unit's copy no more, waits for its borrows, forgets it."""
        fresh = self._by_unit[index]
        fresh.withdrawn = True
        while fresh.borrows:
            self._changed.wait()
        del self._by_unit[index]

    def clear(self, unit: UnitState) -> None:
        """The unit's weights were replaced by other means (a checkpoint load): no fresh copy."""
        with self._changed:
            if unit.index in self._by_unit:
                self._end(unit.index)


@dataclass
class OptimizerSlot:
    """Host buffers for one piece of an NVMe-resident unit's state while it steps (see the module
    docstring)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad32: torch.Tensor
    pending_writes: list = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad32": self.grad32}

    def views(self, numel: int) -> dict[str, torch.Tensor]:
        """The first `numel` elements of each buffer, by kind: a piece read into the slot."""
        return {kind: buffer[:numel] for kind, buffer in self.tensors().items()}

    def wait_writes(self) -> None:
        """Waits for every write queued on the slot, even after one failed (the slot is reused
        only when none is in flight); raises the first failure."""
        pending, self.pending_writes = self.pending_writes, []
        first: BaseException | None = None
        for position, handle in enumerate(pending):
            try:
                handle.wait()
            except Exception as error:  # noqa: BLE001 (the first is raised once all are done)
                first = first or error
            except BaseException:
                # an interrupt: the writes not yet waited for stay queued, to be waited again
                self.pending_writes = pending[position:] + self.pending_writes
                raise
        if first is not None:
            raise first


@dataclass(frozen=True)
class StatePiece:
    """One piece of a unit's optimizer state as `TierStore` streams it: the fp32 values of the
    state's elements [start, start + n) by kind, wherever they are now."""

    unit: UnitState
    # its place in `unit.state_pieces` (the swap files it belongs to)
    index: int
    start: int
    views: dict[str, torch.Tensor]
    # the slot the piece was read into (NVMe-resident state); None when resident (host or device)
    slot: OptimizerSlot | None
    # the unit's last piece: after it, the unit's state has been seen whole
    last: bool

    @property
    def end(self) -> int:
        return self.start + self.views["master"].numel()


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
) -> dict[str, int]:
    """Bytes of host memory each use needs for this placement (plain arithmetic, tested directly).

    shard_numels: this rank's shard length of every unit. optimizer_tier: one tier for every
    unit, or one per unit. compute_bytes: bytes per 16-bit (or fp32) compute element.
    staged_device_copies: gradients pass through a host staging ring (CUDA); on the CPU the
    device buffers are host memory already. optimizer_numels: the part of each shard with
    optimizer state (its trainable params; frozen ones have none); the whole shard by default.
    buffer_count, sub_group_size: the config's `offload.buffer_count` and
    `offload.sub_group_size` (None: unset, chosen by `plan.shape_slots`).
    """
    param_tier = ParamTier(param_tier)
    if isinstance(optimizer_tier, list):
        tiers = [OptimizerTier(tier) for tier in optimizer_tier]
    else:
        tiers = [OptimizerTier(optimizer_tier)] * len(shard_numels)
    largest = max(shard_numels, default=0)
    total = sum(shard_numels)
    states = shard_numels if optimizer_numels is None else optimizer_numels
    resident = sum(n for n, tier in zip(states, tiers) if tier is OptimizerTier.HOST)
    streamed = [(n, state) for n, state, tier in zip(shard_numels, states, tiers) if tier.streamed]
    need = {}
    if resident:
        need["optimizer_state"] = 16 * resident  # master, exp_avg, exp_avg_sq, grad32
    if streamed:
        shape = shape_slots([state for _, state in streamed], buffer_count=buffer_count, sub_group_size=sub_group_size)
        # per slot: the four fp32 states of the largest piece
        need["optimizer_slots"] = shape.count * 16 * shape.piece
        need["grad_slot"] = 4 * shape.piece
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
