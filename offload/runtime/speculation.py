"""A window's speculative steps: taken during its last backward, before the gradients' factor is
known, and committed or taken back once `step()` knows it (runtime/window.py decides which).

Overlap 'backward' with clipping or fp16, and overlap `auto` always, step a unit as its gradients
are final into its spare state (or, for a unit that steps on the device, into the device's copy
of its state: runtime/device_step.py), leaving its old state for an exact redo. `Speculation`
keeps which units did so in the window and their optimizer worker's jobs, and does the rest:

- `submit` (transfer worker): the unit's step begins and is queued;
- `withdraw_queued` (overlap `auto`, at `step()`): the jobs the worker has not started are taken
  off its queue (those units step with the rest of the window in the next forward's order);
- `commit`: the steps stand (overlap `auto` queues the commits behind the steps still running,
  on their workers, without waiting); `take_back`: they do not (step counts undone, the weights
  cast again from the untouched masters when no step follows);
- `take_back_before_step` (overlap `auto`: a forward or another backward before `step()`, which
  then goes on as with overlap 'forward'), `abandon` (a failed backward or `step()`), and
  `take_back_undecided` (a checkpoint load in the middle of a window).

The transfer worker adds units (`submit`) during the window's last backward; everything else
runs on the main thread once the window's hand-offs landed (nothing is added any more).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from offload.model.unit_state import UnitState
from offload.optim.step_hyper import StepHyper
from offload.runtime.events import EventLog
from offload.runtime.gradients import GradientOffload
from offload.runtime.overlap import OverlapPolicy, StepJob, Stepping
from offload.runtime.stepper import StepMode
from offload.runtime.weights_out import WeightsReader

logger = logging.getLogger(__name__)

# the most windows overlap `auto` steps without speculation after a redo (`Speculation.begin_window`)
MAX_PAUSE = 16


class Speculation:
    """The speculative steps of the current window (module docstring)."""

    def __init__(
        self,
        policy: OverlapPolicy,
        stepping: Stepping,
        gradients: GradientOffload,
        weights: WeightsReader,
        begin_steps: Callable[[list[UnitState]], None],
        events: Callable[[], EventLog],
    ) -> None:
        self.policy = policy
        self.stepping = stepping
        self.gradients = gradients
        self.weights = weights
        self.begin_steps = begin_steps
        self.events = events
        # units stepped speculatively in this window, appended by the transfer worker
        self.units: dict[int, UnitState] = {}
        # the optimizer worker's job of each of them (overlap `auto` withdraws those not started)
        self.jobs: dict[int, StepJob] = {}
        # speculative windows step() committed, stepped again (clipping acted, or the
        # hyperparameters changed), skipped (fp16 overflow) or refused (non-finite gradients)
        self.counts = {"committed": 0, "redone": 0, "skipped": 0, "refused": 0}
        # overlap `auto`: whether the window's last backward steps speculatively, and after a redo
        # how many windows do not (`begin_window`), that count doubling while redos follow
        self.this_window = True
        self._pause = 0
        self._next_pause = 1

    @property
    def pending(self) -> bool:
        return bool(self.units or self.jobs)

    def submit(self, unit: UnitState, hypers: Sequence[StepHyper]) -> None:
        """Transfer worker: `unit`'s gradients are final; it steps now into its spare state (or on
        the device), unless it did already in this window."""
        if unit.index in self.units:
            return
        self.begin_steps([unit])
        self.units[unit.index] = unit
        self.stepping.upload_grad_on_device(unit)
        (job,) = self.stepping.submit([unit], hypers, StepMode.SPECULATE)
        self.jobs[unit.index] = job

    def begin_window(self) -> None:
        """Main thread, a window's last backward begins: whether its units speculate. Overlap
        `auto` pauses after a redo (clipping that keeps acting wastes every speculative step, and a
        device unit's redo loads its state again): 1 window, then 2, 4 ... up to MAX_PAUSE while
        redos follow, none once a window commits. The window then steps as with overlap 'forward'."""
        self.this_window = True
        if self.policy.defers_to_forward and self._pause:
            self._pause -= 1
            self.this_window = False

    def take(self) -> list[UnitState]:
        """The window's speculated units, forgotten here (the caller decides them)."""
        units, self.units, self.jobs = list(self.units.values()), {}, {}
        return units

    def withdraw_queued(self) -> None:
        """overlap `auto`: the speculative steps the optimizer worker has not started are taken
        off its queue; their units have not stepped (`step_done` set again) and step once the
        norm is known, in the next forward's order."""
        if not self.policy.defers_to_forward:
            return
        jobs, self.jobs = self.jobs, {}
        for index, job in jobs.items():
            if self.stepping.withdraw(job):
                unit = self.units.pop(index)
                unit.step_done.set()
                self.events().record("step_withdrawn", index)

    def commit(self, units: list[UnitState]) -> None:
        """The steps stand (the factor they used is the true one): each unit's spare state
        becomes its state, and its window ends. Overlap `auto` does not wait for the steps still
        running: the commits are queued behind them, on the workers that run them."""
        self.weights.invalidate()
        if self.policy.defers_to_forward:
            self.stepping.commit(units)
            return
        for unit in units:
            unit.commit_spare()
            unit.end_window()
            self.events().record("step_commit", unit.index)

    def take_back(self, units: list[UnitState], *, restore: bool) -> None:
        """The steps do not stand: their states are left in the spare buffers (or on the device)
        and their step counts undone. `restore`: no step follows (skipped, refused, or the window
        abandoned), so the 16-bit weights they published are cast again from the untouched
        masters (and waited for); otherwise the units stay in the window and step again from
        their old state."""
        if not units:
            return
        self.stepping.wait_steps()  # (overlap `auto`: step() did not wait for the steps running)
        self.weights.invalidate()
        for unit in units:
            unit.step_count -= 1
            self.events().record("step_take_back", unit.index)
        self.stepping.take_back_on_device(units)
        if restore:
            self.begin_steps(units)
            self.stepping.submit(units, (), StepMode.RESTORE)
            self.stepping.wait()

    def take_back_before_step(self, why: str) -> None:
        """overlap `auto`: the window ended, but a forward or another backward comes before
        step(): its speculative steps are taken back (the weights are the old ones again), and
        the window goes on as with overlap 'forward' (another backward adds to its gradients)."""
        if not self.pending:
            return
        self.gradients.wait_all()
        self.withdraw_queued()
        self.stepping.wait_steps()
        units = self.take()
        logger.info("offload: %s: the %d units stepped speculatively during backward are taken back", why, len(units))
        self.take_back(units, restore=True)

    def take_back_undecided(self, why: str) -> None:
        """The speculative steps of a window step() will not decide (the work in flight is
        settled already), taken back."""
        units = self.take()
        if units:
            logger.warning("offload: %s; the %d units stepped speculatively are taken back", why, len(units))
            self.take_back(units, restore=True)

    def abandon(self, why: str, settle: Callable[[], list[BaseException]]) -> None:
        """A window's speculative steps that will not be decided by step() (its backward, or
        step() itself, failed): the work in flight is settled (`settle`) and they are taken back,
        leaving the units as a run without speculation would (not stepped). Errors of the
        settled work are logged: the failure being raised is the one to report."""
        if not self.policy.speculative:
            return
        # first every hand-off in flight: the transfer worker may still submit speculative steps
        try:
            self.gradients.wait_all()
        except Exception:  # noqa: BLE001 (settle() below meets it again and logs it)
            pass
        self.withdraw_queued()
        for failure in settle():
            logger.warning("offload: %s; discarding failed work in flight: %s", why, failure)
        self.take_back_undecided(why)

    def decide(self, units: list[UnitState], *, stands: bool, why: str, step: int) -> set[int]:
        """step() knows the factor: the speculated `units` are committed if they `stand`, else
        taken back to step again; returns the indices committed."""
        if not units:
            return set()
        if stands:
            self.commit(units)
            self.counts["committed"] += 1
            self._next_pause = 1
            return {unit.index for unit in units}
        self.take_back(units, restore=False)
        self.counts["redone"] += 1
        self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, MAX_PAUSE)
        logger.info(
            "offload: step %d %s: the %d units stepped during backward step again from their old state "
            "(%d of %d speculative windows redone so far)",
            step,
            why,
            len(units),
            self.counts["redone"],
            sum(self.counts.values()),
        )
        return set()
