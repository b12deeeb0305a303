"""The optimizer step, unit by unit, on the optimizer worker thread.

With states on the host, each unit steps in place (the C++ Adam); with states on the device
(tier DEVICE), in place there (offload.optim.device_adam, on the device's optimizer stream).
With states on NVMe the step is a pipeline over the slots of `TierStore`, one piece of a unit's
state (at most `offload.sub_group_size` elements) at a time: while piece i steps in slot i % k,
piece i+1 is being read into the next slot and piece i-1 written from the previous one; a slot
is refilled only after its writes completed. As each unit's last piece finishes, its 16-bit
weights go to their home tier and its `step_done` event is set: the next forward's fetch of
that unit waits on exactly that. The store says where they are written (`param16_target`) and
sends them home (`publish_param16`); with param `nvme` they are written from a staging buffer,
and that write-back (a `Param16WriteBack`, held here) is waited for before the next unit takes
one (one write behind).

A run has a `StepMode`: the step in place; a speculative step (overlap 'backward' with
clipping or fp16), which reads a unit's resident master and moments and writes the new ones into
its spare state, leaving the old ones for an exact redo; or a restore, which casts the 16-bit
weights again from the untouched master when a speculative step is taken back without a redo.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from offload.config.placement import OptimizerTier, ParamTier
from offload.config.state_layout import MOMENT_KINDS
from offload.model.unit_state import UnitState
from offload.model.units import FlatLayout
from offload.optim import kernels, moments
from offload.optim.device_adam import device_adam_step
from offload.optim.step_hyper import StepHyper
from offload.platform.device import Device
from offload.storage.buffers import StatePiece
from offload.storage.state_codec import block_aligned_gaps
from offload.storage.tiers import TierStore

if TYPE_CHECKING:
    from offload.runtime.events import EventLog
    from offload.storage.param16 import Param16WriteBack

logger = logging.getLogger(__name__)


class StepMode(enum.Enum):
    """What a run of the optimizer worker does to each unit it is given."""

    # Adam in place; the unit's gradient window ends with it
    STEP = "step"
    # Adam from the resident state into the unit's spare state (overlap 'backward' with clipping
    # or fp16): the old state stays for an exact redo; step() commits it or takes it back
    SPECULATE = "speculate"
    # a speculative step taken back without a redo (a non-finite norm or an fp16 overflow): the
    # 16-bit weights are cast again from the untouched master; the step count is not advanced
    RESTORE = "restore"


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


def unstepped_ranges(ranges: list[tuple[int, int, int]], low: int, high: int) -> list[tuple[int, int]]:
    """The parts of [low, high) that no (group, start, end) of `ranges` covers (sorted, disjoint)."""
    gaps = []
    position = low
    for _, start, end in sorted(ranges, key=lambda r: r[1]):
        if start > position:
            gaps.append((position, start))
        position = max(position, end)
    if position < high:
        gaps.append((position, high))
    return gaps


STEP_TIMING_KEYS = ("wait_read", "wait_write", "adam", "publish")


class UnitStepper:
    def __init__(self, store: TierStore, device: Device, rank: int, *, prefetch_next_step: bool = False) -> None:
        self.store = store
        self.device = device
        self.rank = rank
        # whether a step (StepMode.STEP) ends by reading the next step's first NVMe state pieces
        # into the slots as their write-back completes (TierStore.stream_optimizer_states'
        # prefetch_next): where each step streams the window's units in one order (overlap
        # 'none' and 'forward'), so that the next step finds them read
        self.prefetch_next_step = prefetch_next_step
        # optimizer-worker seconds since the last pop_timings(): waiting for state reads, for a
        # slot's writes before reusing it, in the Adam kernel, and sending 16-bit weights home
        self.timings: dict[str, float] = dict.fromkeys(STEP_TIMING_KEYS, 0.0)
        # the schedule's EventLog, when the engine gives it one (tests that pin the order)
        self.events: EventLog | None = None
        # param nvme: the last unit's 16-bit write-back still in flight, from its staging buffer
        # (filled by _publish, settled before the next unit takes a staging buffer, or at the
        # run's end)
        self._pending_publish: Param16WriteBack | None = None

    def settle_writes(self) -> None:
        """After `run`: the write-back of the state it streamed, waited for (the optimizer worker,
        as its own task, so that a backward waiting for the step's gradient reads does not also
        wait for its writes: `Stepping.wait_steps`)."""
        self.store.settle_stream()

    def pop_timings(self) -> dict[str, float]:
        timings, self.timings = self.timings, dict.fromkeys(STEP_TIMING_KEYS, 0.0)
        return timings

    def run(self, units: list[UnitState], hypers: Sequence[StepHyper], mode: StepMode = StepMode.STEP) -> None:
        """Steps `units` in this order (`mode` says how), each param with its group's
        `hypers[g]`, piece by piece of their optimizer state
        (`TierStore.stream_optimizer_states`); each unit's `step_done` is set as soon as its last
        piece is done."""
        self._settle_publish()  # a write left pending by an interrupted run
        current: _UnitStep | None = None
        stream = None
        try:
            stream = self.store.stream_optimizer_states(
                units,
                include_grad=True,
                timings=self.timings,
                prefetch_next=self.prefetch_next_step and mode is StepMode.STEP,
                leave_writes=True,
            )
            for piece in stream:
                unit = piece.unit
                if piece.start == 0:
                    current = self._begin(unit, mode)
                if current is not None:
                    with record_function(f"offload::{mode.value}[{unit.index}]"):
                        self._step_piece(current, piece, hypers, mode)
                elif mode is StepMode.SPECULATE:
                    self._carry_over(piece, [])
                if piece.slot is not None:
                    self.store.store_optimizer_state(piece)
                if not piece.last:
                    continue
                if current is not None:
                    step, current = current, None
                    self._publish(step, piece)
                if mode is StepMode.STEP:
                    # only now: until the step is done, the unit's window is still open (a save
                    # that did not wait for it would be refused, not written with the old values).
                    # A speculative step leaves it open until step() commits or redoes it.
                    unit.end_window()
                unit.step_done.set()
                if self.events is not None:
                    self.events.record("step_done", unit.index)
            self._settle_publish()
        finally:
            if stream is not None:
                # a stream left part way (a failed step) ends here, on this thread: it holds the
                # store's slots lock, which only this thread can release
                stream.close()
            if current is not None and self.store.param_tier is ParamTier.NVME:
                self.store.give_back_staging(current.out)  # taken, never published
            self._settle_publish(quiet=True)
            for unit in units:
                unit.step_done.set()

    def _begin(self, unit: UnitState, mode: StepMode) -> _UnitStep | None:
        """A unit's first piece: counts its step and picks where its new weights go; None when
        this rank has nothing of it to step."""
        stepped = sorted(unit.grads_in_window)
        if not stepped:
            return None
        if mode is not StepMode.RESTORE:
            # every rank counts the unit's step, whether or not its shard holds any of the params
            unit.step_count += 1
        work = group_ranges(unit.layout, self.rank, stepped, unit.param_groups)
        if not work:
            # this rank's shard is only padding (with `param: none` every rank still joins the
            # gather of the other ranks' new shards: the engine marked the unit before the step)
            return None
        if self.store.param_tier is ParamTier.NVME:
            # the previous unit's write-back first: the step holds one staging buffer at a time,
            # so the fetches keep the rest of the ring (prefetch.depth + 1)
            self._settle_publish()
        out = self._param16_target(unit)
        published = unit.device_update_event
        if published is not None:
            # param none: the copy of this unit's last new weights to the device may still read
            # `out` (a speculative step redone or taken back before the unit's next use): the
            # kernel must not write it before that copy read it (found by the checked device)
            published.synchronize()
        if self.store.param_tier is ParamTier.NVME and not set(unit.layout.params_in_shard(self.rank)) <= set(stepped):
            # some params are not stepped (frozen, or no gradient this window): the staging buffer
            # must start from this unit's 16-bit values, which are written back whole
            try:
                self.store.read_param16_into(unit, out)
            except BaseException:
                self.store.give_back_staging(out)
                raise
        return _UnitStep(unit, work, out)

    def _step_piece(self, step: _UnitStep, piece: StatePiece, hypers: Sequence[StepHyper], mode: StepMode) -> None:
        """Adam (or, to restore, the cast) over the stepped ranges of `step.work` that fall in `piece`."""
        ranges = []
        for group, start, end in step.work:
            low, high = max(start, piece.start), min(end, piece.end)
            if low < high:
                ranges.append((group, low, high))
        started = time.perf_counter()
        if mode is StepMode.SPECULATE:
            self._carry_over(piece, ranges)
        if not ranges:
            return
        if mode is StepMode.RESTORE:
            master = piece.views["master"]
            for _, start, end in ranges:
                step.out[start:end].copy_(master[start - piece.start : end - piece.start])
        elif step.unit.optimizer_tier is OptimizerTier.DEVICE:
            self._step_on_device(step.unit, piece, hypers, ranges, step.out)
        else:
            self._step_on_host(step.unit, piece, hypers, ranges, step.out, mode is StepMode.SPECULATE)
        self.timings["adam"] += time.perf_counter() - started

    def _carry_over(self, piece: StatePiece, ranges: list[tuple[int, int, int]]) -> None:
        """A speculative step leaves the whole spare state current: what it does not step (params
        without a gradient this window, padding) is copied over from the resident state, in its
        stored form (a compact moment's codes and block exponents as they are)."""
        unit, codec = piece.unit, self.store.codec
        spare = unit.spare_state
        gaps = unstepped_ranges(ranges, piece.start, piece.end)
        for start, end in gaps:
            spare["master"][start:end].copy_(piece.views["master"][start - piece.start : end - piece.start])
        if not codec.compact:
            for start, end in gaps:
                for kind in MOMENT_KINDS:
                    spare[kind][start:end].copy_(piece.views[kind][start - piece.start : end - piece.start])
            return
        numel = piece.end - piece.start
        for start, end in block_aligned_gaps(gaps, codec.precision, piece.end):
            for kind in MOMENT_KINDS:
                source = codec.moment_view(piece.views[kind], numel, start - piece.start, end - piece.start)
                target = codec.moment_view(spare[kind], unit.optimizer_numel, start, end)
                target.values.copy_(source.values)
                if target.block_exponents is not None and source.block_exponents is not None:
                    target.block_exponents.copy_(source.block_exponents)

    def _step_on_host(
        self,
        unit: UnitState,
        piece: StatePiece,
        hypers: Sequence[StepHyper],
        ranges: list[tuple[int, int, int]],
        out: torch.Tensor,
        speculative: bool,
    ) -> None:
        """The C++ Adam over host states, writing the new 16-bit weights into `out` in the same
        pass. `ranges` are (group, start, end) in the shard, within the piece. `speculative`: the
        new master and moments go to the unit's spare state; the resident ones are only read."""
        views, base = piece.views, piece.start
        sixteen_bit = out.dtype != torch.float32
        if self.store.codec.compact:
            self._step_compact(unit, piece, hypers, ranges, out if sixteen_bit else None, speculative, kernels.adam_step_compact)
            if not sixteen_bit:
                master = unit.spare_state["master"] if speculative else views["master"]
                offset = 0 if speculative else base
                for _, start, end in ranges:
                    out[start:end].copy_(master[start - offset : end - offset])
            return
        for group, start, end in ranges:
            state_out = None
            if speculative:
                spare = unit.spare_state
                state_out = (spare["master"][start:end], spare["exp_avg"][start:end], spare["exp_avg_sq"][start:end])
            kernels.adam_step(
                views["master"][start - base : end - base],
                views["grad32"][start - base : end - base],
                views["exp_avg"][start - base : end - base],
                views["exp_avg_sq"][start - base : end - base],
                step=unit.step_count,
                param_out16=out[start:end] if sixteen_bit else None,
                state_out=state_out,
                **hypers[group].adam_arguments(),
            )
            if not sixteen_bit:
                out[start:end].copy_(state_out[0] if state_out else views["master"][start - base : end - base])

    def _step_compact(
        self,
        unit: UnitState,
        piece: StatePiece,
        hypers: Sequence[StepHyper],
        ranges: list[tuple[int, int, int]],
        out16: torch.Tensor | None,
        speculative: bool,
        adam_step,
    ) -> None:
        """Adam over compact moments (bf16 or int8 blocks: docs/compact_state.md) with `adam_step`:
        the C++ kernel on host states, its torch twin (moments.adam_step_torch) on the device;
        both give the same bits. The rounding's random bits are keyed on the unit, this rank and
        the unit's step count, and each element's place in the shard."""
        codec = self.store.codec
        views, base, numel = piece.views, piece.start, piece.end - piece.start
        key = codec.rounding_key(unit.index, unit.step_count)
        for group, start, end in ranges:
            state_out = None
            if speculative:
                spare = unit.spare_state
                state_out = (
                    spare["master"][start:end],
                    codec.moment_view(spare["exp_avg"], unit.optimizer_numel, start, end),
                    codec.moment_view(spare["exp_avg_sq"], unit.optimizer_numel, start, end),
                )
            adam_step(
                views["master"][start - base : end - base],
                views["grad32"][start - base : end - base],
                codec.moment_view(views["exp_avg"], numel, start - base, end - base),
                codec.moment_view(views["exp_avg_sq"], numel, start - base, end - base),
                precision=codec.precision.value,
                position=start,
                rounding_key=key,
                step=unit.step_count,
                param_out16=None if out16 is None else out16[start:end],
                state_out=state_out,
                **hypers[group].adam_arguments(),
            )

    def _step_on_device(
        self,
        unit: UnitState,
        piece: StatePiece,
        hypers: Sequence[StepHyper],
        ranges: list[tuple[int, int, int]],
        out: torch.Tensor,
    ) -> None:
        """Adam over device-resident states (one piece: the whole state) on the device's
        optimizer stream; the new weights are cast and copied into `out` (their host home or
        staging buffer, or the CPU device's buffer), and the stream is waited on before the
        unit counts as stepped."""
        views = piece.views
        stream = self.device.optimizer

        def step() -> None:
            if self.store.codec.compact:
                self._step_compact(unit, piece, hypers, ranges, None, False, moments.adam_step_torch)
                for _, start, end in ranges:
                    out[start:end].copy_(views["master"][start:end])
                return
            for group, start, end in ranges:
                device_adam_step(
                    views["master"][start:end],
                    views["grad32"][start:end].float(),
                    views["exp_avg"][start:end],
                    views["exp_avg_sq"][start:end],
                    step=unit.step_count,
                    **hypers[group].adam_arguments(),
                )
                out[start:end].copy_(views["master"][start:end])

        launched = stream.launch(
            step,
            what=f"the Adam step of unit {unit.spec.name} on the device",
            unit=unit.index,
            reads=[views["grad32"]],
            writes=[views["master"], views["exp_avg"], views["exp_avg_sq"], out],
        )
        stream.record_event().synchronize()
        launched.value()

    def _param16_target(self, unit: UnitState) -> torch.Tensor:
        """Where the kernel writes the new 16-bit weights (with param nvme, a staging buffer of
        the store's, given back once its write-back completed)."""
        if self.store.param_tier is ParamTier.DEVICE and not self.device.separate_memory:
            # the CPU device's buffer is host memory: the kernel writes the weights in place
            assert unit.device_flat is not None  # made for every unit at start (engine.py)
            start, end = unit.layout.shard_range(self.rank)
            return unit.device_flat[start:end]
        # param cpu: the home copy; none on CUDA: the pinned source of the device copy; nvme: a
        # staging buffer
        return self.store.param16_target(unit)

    def _publish(self, step: _UnitStep, last_piece: StatePiece) -> None:
        """Sends the unit's new 16-bit shard to the param's home tier. With the master on the
        device (tier DEVICE, `last_piece` is then the whole state) and param `none`, the device
        buffer is cast from it there instead of copied back up from the host copy."""
        started = time.perf_counter()
        unit, out = step.unit, step.out
        tier = self.store.param_tier
        if tier is ParamTier.NVME:
            # The unit counts as stepped without waiting for this write: a fetch until then
            # borrows `out` itself, a later one reads the file, which the swap store orders after
            # the write. The staging buffer goes back once the write completed and no borrow is
            # out, which the next unit's step (or the end of the run) waits for.
            assert self._pending_publish is None  # settled before this unit took `out` (_begin)
            self._pending_publish = self.store.publish_param16(unit, out)
        elif tier is ParamTier.DEVICE:
            self._publish_to_device(
                unit, out, last_piece.views["master"] if unit.optimizer_tier is OptimizerTier.DEVICE else None
            )
        self.timings["publish"] += time.perf_counter() - started

    def _publish_to_device(self, unit: UnitState, out: torch.Tensor, device_master: torch.Tensor | None) -> None:
        assert unit.device_flat is not None  # made for every unit at start (engine.py)
        start, end = unit.layout.shard_range(self.rank)
        if out.data_ptr() == unit.device_flat[start:end].data_ptr():
            return
        to_device = self.device.host_to_device
        what = f"new weights of unit {unit.spec.name}"
        if device_master is not None:
            # the frozen tail past the master never changes on the device
            to_device.copy(unit.device_flat[start : start + device_master.numel()], device_master, what=what, unit=unit.index)
        else:
            to_device.copy(unit.device_flat[start:end], out, what=what, unit=unit.index)
        unit.device_update_event = to_device.record_event()

    def _settle_publish(self, quiet: bool = False) -> None:
        """The last write-back still pending, settled (waited for, its staging buffer given back,
        also when it failed). An interrupt leaves it pending (the buffer may still be read by the
        write), to be settled again. `quiet`: a failure is logged, not raised (an error already
        propagating is the one to report)."""
        pending, self._pending_publish = self._pending_publish, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception:
            if not quiet:
                raise
            logger.warning("offload: a 16-bit weights write-back failed while the step failed", exc_info=True)
        except BaseException:
            self._pending_publish = pending  # once settled, a wait returns at once
            raise


@dataclass
class _UnitStep:
    """A unit's step between its first and last piece (optimizer worker only)."""

    unit: UnitState
    # (group, start, end) ranges of this rank's shard to step (group_ranges)
    work: list[tuple[int, int, int]]
    # where the new 16-bit (fp32 with fp32 compute) weights of the whole shard are written; with
    # param nvme a staging buffer, given back once its write-back completed
    out: torch.Tensor
    # the device computed it (runtime/device_step: the new weights may be on the device already)
    on_device: bool = False
