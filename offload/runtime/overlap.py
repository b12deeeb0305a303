"""When the CPU step runs (config `overlap`), as small policy objects, and the queue of steps.

A unit's step must follow its last gradient of the window and precede the next read of its
weights; the policies differ in how far they push it into the surrounding compute:

- `none` (StepAfterBackward): `step()` steps every unit of the window and waits.
- `forward` (StepDuringForward): `step()` hands the window to the optimizer worker and returns;
  each unit's next use waits for its own step only (`UnitState.step_done`), so unit k steps
  while the next forward computes the units before it. Exact, global-norm clipping included:
  the norm is known before the first unit steps.
- `backward` (StepDuringBackward): a unit steps as soon as its last gradients of the window
  land, while backward computes the units below it; `step()` steps the rest and waits.
  With clipping or fp16, whose factor needs every gradient first, the step is speculative
  (`speculative`): a unit with a spare state steps into it, keeping its old state; `step()`
  knows the global norm and either commits those steps (no clipping, no overflow: the factor
  they used was the right one) or takes them back and steps every unit again from its old
  state with the true factor (or skips the step), then lets the rest step during the next
  forward as `forward` does. Exact either way.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future

from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.optim.step_hyper import StepHyper
from offload.runtime.stepper import StepMode, UnitStepper


class Stepping:
    """The optimizer worker's queue: steps submitted (from the main thread at `step()`, or from
    the transfer worker during backward), waited for, their failures re-raised. Each step is
    followed on the worker by the settling of its write-back (`UnitStepper.settle_writes`, a
    task of its own): `wait` waits for both, `wait_steps` for the steps only, so that a
    backward or the next `step()` goes on while the last step's state is still being written."""

    def __init__(self, worker: Executor, stepper: UnitStepper) -> None:
        self.worker = worker
        self.stepper = stepper
        # in submission order: (future, whether it is a write-back's settling)
        self._futures: list[tuple[Future, bool]] = []
        self._lock = threading.Lock()

    def submit(self, units: list[UnitState], hypers: Sequence[StepHyper], mode: StepMode = StepMode.STEP) -> None:
        """Steps `units` in this order (each param with its group's `hypers[g]`; `mode` says
        how); each unit's `step_done` is set as it finishes. The caller has called
        `begin_step()` on each (their weights now change)."""
        step = self.worker.submit(self.stepper.run, units, tuple(hypers), mode)
        writes = self.worker.submit(self.stepper.settle_writes)
        with self._lock:
            self._futures += [(step, False), (writes, True)]

    @property
    def pending(self) -> bool:
        with self._lock:
            return bool(self._futures)

    def wait(self) -> None:
        """Waits for every step submitted and its write-back; re-raises the first failure. A
        step is forgotten only once done: after an interrupt (Ctrl-C in `step()`), the next wait
        still waits for it."""
        self._wait(writes_too=True)

    def wait_steps(self) -> None:
        """Waits for every step submitted, not for the write-backs still running (a backward
        needs the steps to have read the gradients it overwrites; a step streams after the
        write-back before it on the same worker, and each slot is reused only once its writes
        are done); re-raises the first failure among those done, in submission order."""
        self._wait(writes_too=False)

    def _wait(self, writes_too: bool) -> None:
        with self._lock:
            waited = [future for future, is_writes in self._futures if writes_too or not is_writes]
        concurrent.futures.wait(waited)
        with self._lock:
            done = [entry for entry in self._futures if entry[0].done()]
            self._futures = [entry for entry in self._futures if not entry[0].done()]
        for future, _ in done:
            future.result()

    def raise_if_failed(self) -> None:
        """Without waiting: a step (or write-back) that already failed is raised in the main thread."""
        with self._lock:
            failed = [entry for entry in self._futures if entry[0].done() and entry[0].exception() is not None]
            for entry in failed:
                self._futures.remove(entry)
        if failed:
            error = failed[0][0].exception()
            raise OffloadError(f"offload: the optimizer step failed: {error}") from error


class OverlapPolicy:
    """Base: steps nothing during backward; `step()` waits for the window's steps."""

    name = "none"
    # whether units step during backward (step() then only finishes the window)
    steps_in_backward = False
    # whether those steps are speculative (clipping or fp16: step() commits or redoes them)
    speculative = False

    def on_grads_final(self, unit: UnitState) -> bool:
        """Main thread, backward: the unit's last gradients of the window were handed off.
        True: step it as soon as they land (on the transfer worker)."""
        return False

    def on_window_end(self, stepping: Stepping) -> bool:
        """`step()`, after the window's steps were submitted: the weights are updated when it
        returns (the state's write-back may go on). Returns whether the window's steps are done
        (step() then makes their new weights current for reads, `Residency.weights_current`)."""
        stepping.wait_steps()
        return True


class StepAfterBackward(OverlapPolicy):
    name = "none"


class StepDuringForward(OverlapPolicy):
    name = "forward"

    def on_window_end(self, stepping: Stepping) -> bool:
        """Returns at once: each unit's next fetch, forward or read waits for its own step."""
        return False


class StepDuringBackward(OverlapPolicy):
    name = "backward"
    steps_in_backward = True

    def __init__(self, speculative: bool = False) -> None:
        self.speculative = speculative

    def on_grads_final(self, unit: UnitState) -> bool:
        return True

    def on_window_end(self, stepping: Stepping) -> bool:
        """Speculative: what step() submits (the units that did not speculate, or all of them
        after a redo) steps during the next forward, each unit's use waiting for its own step."""
        if self.speculative:
            return False
        stepping.wait()
        return True


POLICIES = {policy.name: policy for policy in (StepAfterBackward, StepDuringForward, StepDuringBackward)}


def overlap_policy(name: str, *, factor_needs_norm: bool = False) -> OverlapPolicy:
    """The policy of config `overlap`. `factor_needs_norm`: the gradients' factor is known only
    from every gradient (clipping, or fp16's overflow check): `backward` then speculates."""
    if name == StepDuringBackward.name:
        return StepDuringBackward(speculative=factor_needs_norm)
    return POLICIES[name]()
