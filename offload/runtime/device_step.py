"""The step of the units that step on the accelerator (overlap `auto`'s split: plan/step_split.py).

A device unit's optimizer state lives in host RAM, as every HOST-tier unit's, and a copy of it
stays on the device between steps (`DeviceState`, one per device unit, made at start): the step
runs there on that copy with the exact arithmetic of the C++ kernel (`moments.adam_step_torch`,
its bits on any device), and its results go back to the host, which stays the state's home
(checkpoints, `engine.optimizer.state_dict()`, the gradient and its norm are there). So the
training is bit for bit what the CPU gives, whichever units the split sends to the device.

One step of a unit, on the device lane's thread (`DeviceStepper.run`):
- its state up, if the device's copy is not current (the first window, after a load, after a
  speculative step taken back, after the CPU stepped the unit: overlap `auto`'s splits move
  units between the lanes, runtime/step_rates.SplitPlanner): master and moments
  (`host_to_device`); `prefetch` does this for every device unit when the window's last
  backward begins;
- its gradient up, once landed in the host's fp32 (or 16-bit) gradient (`host_to_device`);
- the exact Adam in place on the device's copy (`optimizer` stream, after those copies), over the
  unit's ranges in chunks of CHUNK elements (the fp64 emulation of the fused operations needs
  temporaries). With param `none` the new 16-bit weights go straight into the unit's device
  buffer there, and the compute stream waits on that stream's event before the unit runs
  (`unit.device_update_event`); otherwise (param `cpu`, or the CPU standing in, whose home copy
  is the device buffer) they go down into their host home, and the unit counts as stepped once
  they landed (the next fetch reads them there).

A speculative step (`StepMode.SPECULATE`, the gradients' factor not known yet) is the same step:
the host state, untouched, is the old state a redo needs. `commit` then sends the new state down
into it; `take_back` only forgets the device's copy (loaded again before the next step). A step
in place (`StepMode.STEP`) sends its state down once it is done. The copies down run on a thread
of their own (`_write_back`), a unit's as soon as its new state is complete, while the lane steps
the next unit (after a redo or with speculation paused the lane steps a large share of the window
during the next forward: sent down at the window's end, its state would still be going down as
the next backward's gradients land on the same link). They are of the state's home only: nothing
on the device waits for them, and `settle_writes` (`Stepping.wait`: checkpoints, state reads, a
change of split) and the next load or speculative step of the unit wait for them.

A restore (`StepMode.RESTORE`: a speculative step taken back with no step after it) casts the
16-bit weights again from the host master: on the host, as the CPU stepper does, or with param
`none` on the device from the master loaded again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offload.config.placement import ParamTier
from offload.config.state_layout import STEPPED_KINDS
from offload.model.unit_state import UnitState
from offload.optim import moments
from offload.optim.step_hyper import StepHyper
from offload.platform.device import Device
from offload.runtime.stepper import StepMode, UnitStepper, _UnitStep
from offload.storage.buffers import StatePiece
from offload.storage.memory import TierLedger
from offload.storage.tiers import TierStore

# elements per call of the exact step: its float64 temporaries (about 10 of 8 bytes) stay bounded
CHUNK = 1 << 24
# each state kind goes down in this many copies, one after the other: a gradient's landing (the
# same stream, which backward waits for) waits for one of them, not for a unit's whole state
WRITE_BACK_PIECES = 8


@dataclass
class DeviceState:
    """A device unit's optimizer state on the device: master, moments (stored format) and
    gradient buffers of its `optimizer_numel` elements, and its new 16-bit weights."""

    views: dict[str, torch.Tensor]
    # the copy is the unit's state (its host copy's, or newer); False: load it before a step
    current: bool = False
    # the copies up that made it current (the step's stream waits on them, not the host)
    loaded: object | None = None
    # it holds a speculative step's results, not yet in the host state (`commit` sends them)
    speculated: bool = False
    # its gradient's copy up (`upload_grad`, the transfer worker, as the gradient lands), and the
    # window it is of (`DeviceStepper.window`): a copy of another window is not used
    grad_up: object | None = None
    grad_window: int = -1


class DeviceStepper(UnitStepper):
    """Steps device units on the accelerator (module docstring): the CPU stepper's `run` loop,
    with the piece's arithmetic, and the weights' publishing, done on the device."""

    def __init__(self, store: TierStore, device: Device, rank: int, units: list[UnitState], *, ledger: TierLedger) -> None:
        super().__init__(store, device, rank)
        self.ledger = ledger
        self._states = {unit.index: self._allocate(unit) for unit in units}
        self._bytes = sum(t.numel() * t.element_size() for state in self._states.values() for t in state.views.values())
        ledger.allocate("device", self._bytes, "step_state")
        self._lock = threading.Lock()
        # the copies down of each unit's new state (`_send_down`): the writer thread runs them,
        # one unit after the other; each unit's until it is settled (`_settle`), under _lock
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-device-write-back")
        self._writing: dict[int, Future] = {}
        # the gradient window, counted by `begin_window` (main thread, when its last backward
        # begins, after the last window's steps): which gradient copies up are current
        self.window = 0
        if self._states:
            # the buffers may be memory compute freed with kernels still queued that read it
            for stream in (device.host_to_device, device.optimizer):
                stream.waits(device.record_compute_event())

    def _allocate(self, unit: UnitState) -> DeviceState:
        n, codec = unit.optimizer_numel, self.store.codec
        views = {}
        for kind in (*STEPPED_KINDS, "grad32"):
            numel, dtype = codec.storage(kind, n)
            views[kind] = self.device.empty(numel, dtype)
        if not self._writes_device_buffer():  # else the step writes the new weights where they are used
            views["out"] = self.device.empty(n, self.store.compute_dtype)
        for tensor in views.values():
            self.device.allocated(tensor)
        return DeviceState(views)

    @property
    def device_bytes(self) -> int:
        return self._bytes

    # ---- the device's copy of the state ---------------------------------------------------
    def prefetch(self, units: Sequence[UnitState]) -> None:
        """The lane's thread: each device unit's state up where its copy is not current (the
        window's last backward begins: the copies run while it computes)."""
        for unit in units:
            state = self._states.get(unit.index)
            if state is not None and not state.current:
                self._load(unit, state)

    def _load(self, unit: UnitState, state: DeviceState) -> None:
        self._settle(unit.index)  # its last copies down land in the host state first
        stream = self.device.optimizer  # (the lane's own stream: its copies up wait for no fetch)
        for kind in STEPPED_KINDS:
            stream.copy(state.views[kind], unit.resident_state[kind], what=f"state of unit {unit.spec.name}", unit=unit.index)
        state.loaded = stream.record_event()
        state.current, state.speculated = True, False

    def begin_window(self) -> None:
        """Main thread: the window's last backward begins (the last window's steps are done)."""
        self.window += 1

    def upload_grad(self, unit: UnitState) -> None:
        """The transfer worker, as `unit`'s gradients of the window landed: the gradient goes up
        now, ahead of the unit's step (on the copy stream: it runs beside the device's steps)."""
        state = self._states[unit.index]
        to_device = self.device.host_to_device
        to_device.copy(
            state.views["grad32"], unit.resident_state["grad32"], what=f"gradient of unit {unit.spec.name}", unit=unit.index
        )
        state.grad_up, state.grad_window = to_device.record_event(), self.window

    def commit(self, units: Sequence[UnitState]) -> None:
        """The lane's thread, after their steps: the speculative steps of `units` stand, and their
        windows end; their new state goes down into the host state (`_send_down`)."""
        for unit in units:
            state = self._states[unit.index]
            if state.speculated:
                state.speculated = False
                self._send_down(unit)
            unit.end_window()
            if self.events is not None:
                self.events.record("step_commit", unit.index)

    def _send_down(self, unit: UnitState) -> None:
        """The lane's thread: `unit`'s new state is complete on the device (its step done); its
        copies down start now, on the writer thread, after what the lane's stream ran so far."""
        self._settle(unit.index)  # (its last state down is settled before its next step already)
        written = self.device.optimizer.record_event()
        with self._lock:
            self._writing[unit.index] = self._writer.submit(self._write_back, unit, written)

    def _write_back(self, unit: UnitState, written) -> None:
        """The writer thread: `unit`'s new state goes down into its host state, after the
        optimizer stream's `written`, piece by piece, each piece waited for before the next is
        queued (the stream's other copies, gradients landing or new weights going down, go in
        between)."""
        state = self._states[unit.index]
        to_host = self.device.device_to_host
        to_host.waits(written)
        for kind in STEPPED_KINDS:
            source, target = state.views[kind], unit.resident_state[kind]
            step = -(-source.numel() // WRITE_BACK_PIECES)
            for low in range(0, source.numel(), step):
                high = min(source.numel(), low + step)
                what = f"state of unit {unit.spec.name} to the host"
                to_host.copy(target[low:high], source[low:high], what=what, unit=unit.index)
                to_host.record_event().synchronize()

    def take_back(self, units: Sequence[UnitState]) -> None:
        """The lane's thread: the speculative steps of `units` do not stand. The host state never
        changed; the device's copies are forgotten and load again before the next step."""
        for unit in units:
            state = self._states[unit.index]
            state.current = state.speculated = False

    def invalidate(self, units: Sequence[UnitState] | None = None) -> None:
        """The host state was replaced (a checkpoint or optimizer state loaded: every unit), or
        the CPU steps `units` there (main thread: they step on the CPU in this window, not here;
        `Stepping._host_state_changes`): their device copies load again before their next step
        here. A load calls it with the lane settled (`Stepping.wait`)."""
        indices = None if units is None else {unit.index for unit in units}
        for index, state in self._states.items():
            if indices is None or index in indices:
                state.current = state.speculated = False

    # ---- the step (UnitStepper.run calls these) -------------------------------------------

    def _step_piece(self, step: _UnitStep, piece: StatePiece, hypers: Sequence[StepHyper], mode: StepMode) -> None:
        unit = step.unit
        ranges = [(g, max(s, piece.start), min(e, piece.end)) for g, s, e in step.work if max(s, piece.start) < min(e, piece.end)]
        if mode is StepMode.RESTORE:
            self._restore(step, piece, hypers, ranges)
            return
        if not ranges:
            return
        state = self._states[unit.index]
        if not state.current:
            self._load(unit, state)
        else:
            self._settle(unit.index)  # a speculative step's old state is the host's: it must be there
        if state.grad_up is None or state.grad_window != self.window:
            self.upload_grad(unit)
        stream = self.device.optimizer
        stream.waits(state.grad_up)
        state.grad_up = None
        if state.loaded is not None:
            stream.waits(state.loaded)
            state.loaded = None
        into_device = self._writes_device_buffer()
        start = unit.layout.shard_range(self.rank)[0]
        writes = [state.views[kind] for kind in (*STEPPED_KINDS, "out") if kind in state.views]
        if into_device:
            assert unit.device_flat is not None
            writes += [unit.device_flat[start + s : start + e] for _, s, e in ranges]
        launched = stream.launch(
            lambda: self._adam(unit, state, hypers, ranges, into_device),
            what=f"the Adam step of unit {unit.spec.name} on the device (exact)",
            unit=unit.index,
            reads=[state.views["grad32"]],
            writes=writes,
        )
        stepped = stream.record_event()
        stepped.synchronize()  # what it wrote is read next (the checked device's copies check it)
        launched.value()
        step.on_device = True
        state.speculated = mode is StepMode.SPECULATE
        if into_device:
            unit.device_update_event = stepped
        else:
            to_host = self.device.device_to_host
            for _, s, e in ranges:
                what = f"new weights of unit {unit.spec.name} to the host"
                to_host.copy(step.out[s:e], state.views["out"][s:e], what=what, unit=unit.index)
            to_host.record_event().synchronize()  # the next fetch reads them from the host
        if mode is StepMode.STEP:
            self._send_down(unit)  # (after the new weights: the next fetch waits for those)

    def _adam(self, unit: UnitState, state: DeviceState, hypers: Sequence[StepHyper], ranges, into_device: bool) -> None:
        """On the optimizer stream: the exact step over `ranges` of the device's copy, in chunks."""
        codec, views, n = self.store.codec, state.views, unit.optimizer_numel
        key = codec.rounding_key(unit.index, unit.step_count)
        # the new weights: into the unit's device buffer (this rank's shard of it), or `out`
        if into_device:
            assert unit.device_flat is not None
            start = unit.layout.shard_range(self.rank)[0]
            out = unit.device_flat[start : start + n]
        else:
            out = views["out"]
        sixteen_bit = out.dtype != torch.float32
        for group, low, high in ranges:
            for first in range(low, high, CHUNK):
                last = min(high, first + CHUNK)
                moments.adam_step_torch(
                    views["master"][first:last],
                    views["grad32"][first:last],
                    codec.moment_view(views["exp_avg"], n, first, last),
                    codec.moment_view(views["exp_avg_sq"], n, first, last),
                    precision=codec.precision.value,
                    position=first,
                    rounding_key=key,
                    step=unit.step_count,
                    param_out16=out[first:last] if sixteen_bit else None,
                    **hypers[group].adam_arguments(),
                )
                if not sixteen_bit:
                    out[first:last].copy_(views["master"][first:last])

    def _restore(self, step: _UnitStep, piece: StatePiece, hypers: Sequence[StepHyper], ranges) -> None:
        """The 16-bit weights cast again from the host master (unchanged by speculation)."""
        unit = step.unit
        self._settle(unit.index)
        if not self._writes_device_buffer():
            super()._step_piece(step, piece, hypers, StepMode.RESTORE)
            return
        state = self._states[unit.index]
        self._load(unit, state)
        stream = self.device.optimizer
        stream.waits(state.loaded)
        state.loaded = None
        assert unit.device_flat is not None
        start = unit.layout.shard_range(self.rank)[0]
        targets = [unit.device_flat[start + s : start + e] for _, s, e in ranges]

        def cast() -> None:
            for target, (_, s, e) in zip(targets, ranges):
                target.copy_(state.views["master"][s:e])

        launched = stream.launch(
            cast,
            what=f"weights of unit {unit.spec.name} cast again on the device",
            unit=unit.index,
            reads=[state.views["master"]],
            writes=targets,
        )
        restored = stream.record_event()
        restored.synchronize()
        launched.value()
        unit.device_update_event = restored
        step.on_device = True

    def _writes_device_buffer(self) -> bool:
        """Param `none` with the device's memory apart: the step writes the unit's device buffer
        itself (on the CPU stand-in the host home is that buffer, and the copy down fills it)."""
        return self.store.param_tier is ParamTier.DEVICE and self.device.separate_memory

    def _publish(self, step: _UnitStep, last_piece: StatePiece) -> None:
        if step.on_device and self._writes_device_buffer():
            return  # in the device buffer already (the stream's event is the unit's update event)
        super()._publish(step, last_piece)

    def _carry_over(self, piece: StatePiece, ranges: list[tuple[int, int, int]]) -> None:
        """A speculative step here keeps the old state in the host's: there is no spare to fill."""

    # ---- the copies down ------------------------------------------------------------------
    def _settle(self, index: int) -> None:
        """The lane's thread: the unit's new state, if going down, is waited for (its host copy is
        read next, or is the old state a speculative step must leave behind)."""
        with self._lock:
            writing = self._writing.pop(index, None)
        if writing is not None:
            writing.result()

    def settle_writes(self) -> None:
        """Every new state going down is waited for (`Stepping.wait`, with the lane idle); the
        first failure is raised, once every one is done."""
        with self._lock:
            writing, self._writing = list(self._writing.values()), {}
        for future in writing:
            future.exception()
        for future in writing:
            future.result()

    def stop_writing(self) -> None:
        """Shutdown, the lane stopped: the writer thread queues nothing more (before the device's
        streams are waited for)."""
        self._writer.shutdown(wait=True)

    def close(self) -> None:
        """Frees the device's copies (after the device's streams were waited for)."""
        self.stop_writing()
        for state in self._states.values():
            for tensor in state.views.values():
                self.device.releasing(tensor, "a device unit's state on the device")
        self.ledger.release("device", self._bytes, "step_state")
        self._states.clear()
