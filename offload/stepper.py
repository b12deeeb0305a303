"""The optimizer step, unit by unit, on the optimizer worker thread.

With states on the host, each unit steps in place (the C++ Adam); with states on the device
(tier DEVICE), in place there (offload.optim.device_adam, on the device's optimizer stream). With states on NVMe the step is a pipeline
over the slots of `TierStore`: while unit i steps in slot i % k, unit i+1's states are being
read into the next slot and unit i-1's written from the previous one; a slot is refilled only
after its writes completed. As each unit finishes, its 16-bit weights go to their home tier and
its `step_done` event is set: the next forward's fetch of that unit waits on exactly that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.profiler import record_function

from offload.device import Device
from offload.optim import kernels
from offload.optim.device_adam import device_adam_step
from offload.placement import OptimizerTier, ParamTier
from offload.state import OptimizerSlot, UnitState
from offload.tiers import TierStore
from offload.units import FlatLayout

if TYPE_CHECKING:
    from offload.schedule import EventLog


class AdamArguments(TypedDict):
    """The keyword arguments both Adam kernels take besides the tensors and the step number."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    grad_scale: float


@dataclass(frozen=True)
class StepHyper:
    """Everything one optimizer step of one parameter group needs besides the tensors (a step
    takes one per group: `hypers[g]` for the params of group g, `UnitState.param_groups`)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    # the stored gradients are multiplied by this (1/loss scale times the clipping factor)
    grad_multiplier: float

    def adam_arguments(self) -> AdamArguments:
        """The keyword arguments of both Adam kernels (kernels.adam_step, device_adam_step)."""
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw_mode": self.adamw_mode,
            "bias_correction": self.bias_correction,
            "grad_scale": self.grad_multiplier,
        }


def group_ranges(layout: FlatLayout, rank: int, stepped: list[int], groups: Sequence[int]) -> list[tuple[int, int, int]]:
    """(group, start, end) ranges of shard `rank` to step: the params `stepped`, each range
    within one parameter group (`groups[i]` is param i's), merged where adjacent."""
    by_group: dict[int, list[int]] = {}
    for index in stepped:
        by_group.setdefault(groups[index], []).append(index)
    return [
        (group, start, end)
        for group, indices in sorted(by_group.items())
        for start, end in layout.param_ranges_in_shard(rank, indices)
    ]


STEP_TIMING_KEYS = ("wait_read", "wait_write", "adam", "publish")


class UnitStepper:
    def __init__(self, store: TierStore, device: Device, rank: int) -> None:
        self.store = store
        self.device = device
        self.rank = rank
        # optimizer-worker seconds since the last pop_timings(): waiting for state reads, for a
        # slot's writes before reusing it, in the Adam kernel, and sending 16-bit weights home
        self.timings: dict[str, float] = dict.fromkeys(STEP_TIMING_KEYS, 0.0)
        # the schedule's EventLog, when the engine gives it one (tests that pin the order)
        self.events: EventLog | None = None

    def pop_timings(self) -> dict[str, float]:
        timings, self.timings = self.timings, dict.fromkeys(STEP_TIMING_KEYS, 0.0)
        return timings

    def run(self, units: list[UnitState], hypers: Sequence[StepHyper]) -> None:
        """Steps `units` in this order, each param with its group's `hypers[g]`; each unit's
        `step_done` is set as soon as it is done."""
        try:
            for unit, views, slot in self.store.stream_optimizer_states(units, include_grad=True, timings=self.timings):
                self._step(unit, views, hypers, slot=slot)
                if slot is not None:
                    self.store.store_optimizer_state(unit, slot)
                # only now: until the step is done, the unit's window is still open (a save that
                # did not wait for it would be refused, not written with the old values)
                unit.end_window()
                unit.step_done.set()
                if self.events is not None:
                    self.events.record("step_done", unit.index)
        finally:
            for unit in units:
                unit.step_done.set()

    def _step(
        self, unit: UnitState, views: dict[str, torch.Tensor], hypers: Sequence[StepHyper], slot: OptimizerSlot | None
    ) -> None:
        with record_function(f"offload::step[{unit.index}]"):
            self._step_unit(unit, views, hypers, slot)

    def _step_unit(
        self, unit: UnitState, views: dict[str, torch.Tensor], hypers: Sequence[StepHyper], slot: OptimizerSlot | None
    ) -> None:
        stepped = sorted(unit.grads_in_window)
        if not stepped:
            return
        # every rank counts the unit's step, whether or not its shard holds any of the params
        unit.step_count += 1
        work = group_ranges(unit.layout, self.rank, stepped, unit.param_groups)
        if not work:
            # this rank's shard is only padding (with `param: none` every rank still joins the
            # gather of the other ranks' new shards: the engine marked the unit before the step)
            return
        out, staging = self._param16_target(unit, slot)
        if self.store.param_tier is ParamTier.NVME and not set(unit.layout.params_in_shard(self.rank)) <= set(stepped):
            # some params are not stepped (frozen, or no gradient this window): the buffer is shared
            # by all units, so it must start from this unit's 16-bit values, which are written back whole
            self.store.require_swap().read_into(unit.swap_name("param16"), out).wait()
        sixteen_bit = out.dtype != torch.float32
        started = time.perf_counter()
        try:
            if unit.optimizer_tier is OptimizerTier.DEVICE:
                self._step_on_device(unit, views, hypers, work, out)
            else:
                self._step_on_host(unit, views, hypers, work, out, sixteen_bit)
            published = time.perf_counter()
            self.timings["adam"] += published - started
            self._publish(unit, out, slot, views["master"] if unit.optimizer_tier is OptimizerTier.DEVICE else None)
            self.timings["publish"] += time.perf_counter() - published
        finally:
            if staging:
                self.store.give_back_staging(out)

    def _step_on_host(
        self,
        unit: UnitState,
        views: dict[str, torch.Tensor],
        hypers: Sequence[StepHyper],
        work: list[tuple[int, int, int]],
        out: torch.Tensor,
        sixteen_bit: bool,
    ) -> None:
        """The C++ Adam over host states, writing the new 16-bit weights into `out` in the same pass."""
        for group, start, end in work:
            kernels.adam_step(
                views["master"][start:end],
                views["grad32"][start:end],
                views["exp_avg"][start:end],
                views["exp_avg_sq"][start:end],
                step=unit.step_count,
                param_out16=out[start:end] if sixteen_bit else None,
                **hypers[group].adam_arguments(),
            )
            if not sixteen_bit:
                out[start:end].copy_(views["master"][start:end])

    def _step_on_device(
        self,
        unit: UnitState,
        views: dict[str, torch.Tensor],
        hypers: Sequence[StepHyper],
        work: list[tuple[int, int, int]],
        out: torch.Tensor,
    ) -> None:
        """Adam over device-resident states on the device's optimizer stream; the new weights
        are cast and copied into `out` (their host home or staging buffer, or the CPU device's
        buffer), and the stream is waited on before the unit counts as stepped."""
        stream = self.device.optimizer
        with stream.context():
            for group, start, end in work:
                device_adam_step(
                    views["master"][start:end],
                    views["grad32"][start:end],
                    views["exp_avg"][start:end],
                    views["exp_avg_sq"][start:end],
                    step=unit.step_count,
                    **hypers[group].adam_arguments(),
                )
                out[start:end].copy_(views["master"][start:end])
        stream.record_event().synchronize()

    def _param16_target(self, unit: UnitState, slot: OptimizerSlot | None) -> tuple[torch.Tensor, bool]:
        """Where the kernel writes the new 16-bit weights: (buffer, is it a staging buffer)."""
        n = unit.shard_numel
        if self.store.param_tier is ParamTier.DEVICE and not self.device.is_cuda:
            # the CPU device's buffer is host memory: the kernel writes the weights in place
            assert unit.device_flat is not None  # made for every unit at start (engine.py)
            start, end = unit.layout.shard_range(self.rank)
            return unit.device_flat[start:end], False
        if self.store.param_tier is not ParamTier.NVME:
            # param cpu: the home copy; none on CUDA: the pinned source of the device copy
            assert unit.param16 is not None, f"unit {unit.spec.name} has no 16-bit host copy"
            return unit.param16, False
        if slot is not None:
            return slot.param16[:n], False
        return self.store.param_staging.take()[:n], True

    def _publish(
        self, unit: UnitState, out: torch.Tensor, slot: OptimizerSlot | None, device_master: torch.Tensor | None = None
    ) -> None:
        """Sends the new 16-bit shard to the param's home tier. `device_master`: the unit's fp32
        master when it lives on the device (tier DEVICE): with param `none` the device buffer is
        cast from it there, instead of copied back up from the host copy `out`."""
        tier = self.store.param_tier
        if tier is ParamTier.HOST:
            return
        if tier is ParamTier.NVME:
            handle = self.store.require_swap().write_from(unit.swap_name("param16"), out)
            if slot is None:
                handle.wait()  # `out` is a staging buffer, given back right after
            else:
                # The unit counts as stepped without waiting for this write: the swap store
                # orders the next fetch's read of the same file after it, and the slot (with
                # `out` in it) is reused only after its pending writes complete.
                slot.pending_writes.append(handle)
            return
        assert unit.device_flat is not None  # made for every unit at start (engine.py)
        start, end = unit.layout.shard_range(self.rank)
        if out.data_ptr() == unit.device_flat[start:end].data_ptr():
            return
        with self.device.host_to_device.context():
            if device_master is not None:
                # the frozen tail past the master never changes on the device
                unit.device_flat[start : start + device_master.numel()].copy_(device_master)
            else:
                unit.device_flat[start:end].copy_(out, non_blocking=True)
        unit.device_update_event = self.device.host_to_device.record_event()
