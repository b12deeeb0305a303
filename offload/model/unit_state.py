"""Where each unit's training state lives, and the host buffers that carry it between tiers.

Per unit, this rank holds one shard of: the fp32 master weights, `exp_avg`, `exp_avg_sq`, the
fp32 gradient (on the optimizer tier: host buffers, or swap files streamed through slots) and
the 16-bit weights between uses (on the param tier: the device itself for `none`, a host buffer
for `cpu`, a swap file for `nvme`). The four fp32 states cover only the first
`optimizer_numel` elements of the shard, where the parameters that require grad are
(units.FlatLayout): frozen parameters have their 16-bit weights and nothing else.

The buffers that carry the state between tiers are storage.buffers'.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from offload.config.placement import OptimizerTier
from offload.model.units import FlatLayout, UnitSpec


class PendingCopy(Protocol):
    """A device stream's event, as a unit keeps it (offload.platform.device: a torch.cuda.Event,
    a CompletedEvent, or the checked device's)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


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
    device_update_event: PendingCopy | None = None
    needs_gather: bool = False
    # overlap `auto`'s split (plan/step_split): the unit steps on the accelerator, its state in
    # RAM with a copy on the device (runtime/device_step), not with the C++ Adam
    steps_on_device: bool = False

    def __post_init__(self) -> None:
        self.step_done.set()
        if self.optimizer_numel < 0:
            self.optimizer_numel = self.layout.shard_numel
        if not self.param_groups:
            self.param_groups = (0,) * len(self.spec.params)

    @property
    def can_speculate(self) -> bool:
        """Whether a step before the global norm is known can be taken back: into the spare
        state, or on the device, whose copy of the state is the spare."""
        return bool(self.spare_state) or self.steps_on_device

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
