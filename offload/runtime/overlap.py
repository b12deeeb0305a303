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
- `auto` (StepDuringBoth, the default): both. Units step speculatively during backward while the
  optimizer worker keeps up; `step()` withdraws from the queue those it has not reached and
  steps them with the rest of the window in the next forward's order, returning at once.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future

from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.optim.step_hyper import StepHyper
from offload.runtime.device_step import DeviceStepper
from offload.runtime.stepper import StepMode, UnitStepper


class StepJob:
    """One `Stepping.submit`: units the optimizer worker steps in one run of the stepper, in
    this order. It is queued until the worker starts it; until then the main thread may
    withdraw it (`Stepping.withdraw`), and the worker then skips it. `started` and `withdrawn`
    change under the queue's lock. `position`: where the next forward needs its first unit
    (`JobQueue` runs the job needed first)."""

    def __init__(self, units: list[UnitState], hypers: tuple[StepHyper, ...], mode: StepMode, position: int = 0) -> None:
        self.units = units
        self.hypers = hypers
        self.mode = mode
        self.position = position
        self.started = False
        self.withdrawn = False


class JobQueue:
    """The jobs one worker has been given and not started, and which it runs next: of those
    queued, the one whose first unit the next forward needs first (the lowest `position`; on a
    tie, the first queued). Each job is queued with one task on its worker, and each task runs
    the job `pop` gives then, so a worker that falls behind the gradients landing during backward
    steps the unit that landed last before those that landed before it: the forward needs it
    first (the blocks land in reverse forward order). What it leaves for after backward are the
    units the forward needs last, which step while it computes the units before them. (First
    come, first served, the backlog would be the units the forward needs first, and it would
    wait for each.) Plain logic: the caller holds the lock that guards `started`/`withdrawn`."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, StepJob]] = []
        self._count = 0

    def push(self, job: StepJob) -> None:
        heapq.heappush(self._heap, (job.position, self._count, job))
        self._count += 1

    def pop(self) -> StepJob | None:
        """The job to run now (marked started), skipping withdrawn ones; None when none is left
        (another task ran this task's job first)."""
        while self._heap:
            job = heapq.heappop(self._heap)[2]
            if not job.withdrawn:
                job.started = True
                return job
        return None


class Stepping:
    """The optimizer worker's queue: steps submitted (from the main thread at `step()`, or from
    the transfer worker during backward), waited for, their failures re-raised. Each step is
    followed on the worker by the settling of its write-back (`UnitStepper.settle_writes`, a
    task of its own): `wait` waits for both, `wait_steps` for the steps only, so that a
    backward or the next `step()` goes on while the last step's state is still being written.

    A job the worker has not started yet can be withdrawn (`withdraw`): its tasks then do
    nothing. Reordering is withdrawing and submitting again: the overlap `auto` schedule queues
    each unit as its gradients are final and, when backward ends, withdraws those the worker has
    not reached, to submit them again in the next forward's order. Each worker runs its queued
    jobs in the order the next forward needs them (`JobQueue`, `order_by`), not as submitted.

    With `device_lane` (overlap `auto`'s split: a worker of its own and a `DeviceStepper`), the
    units that step on the device (`UnitState.steps_on_device`) go there, the others to the
    optimizer worker: the two step at once. The lane's copies down are waited for by `wait`,
    on the caller's thread (`DeviceStepper.settle_writes`), not after each of its runs."""

    def __init__(self, worker: Executor, stepper: UnitStepper, device_lane: tuple[Executor, DeviceStepper] | None = None) -> None:
        self.worker = worker
        self.stepper = stepper
        self.device_lane = device_lane
        # each worker's jobs not started yet (under _lock), and each unit's position in the next
        # forward's order (`order_by`; by default its index: the root, then the blocks)
        self._queues: dict[int, JobQueue] = {id(worker): JobQueue()}
        if device_lane is not None:
            self._queues[id(device_lane[0])] = JobQueue()
        self._positions: dict[int, int] = {}
        # in submission order: (future, whether it is a write-back's settling)
        self._futures: list[tuple[Future, bool]] = []
        self._lock = threading.Lock()
        # some future in `_futures` may have failed (set by its done callback): `raise_if_failed`,
        # called before each unit runs, then looks through them, else it returns at once
        self._failed = False

    def submit(self, units: list[UnitState], hypers: Sequence[StepHyper], mode: StepMode = StepMode.STEP) -> list[StepJob]:
        """Steps `units` in this order (each param with its group's `hypers[g]`; `mode` says
        how); each unit's `step_done` is set as it finishes. The caller has called
        `begin_step()` on each (their weights now change). Returns the jobs (one per worker the
        units went to: the device lane's first), for `withdraw`."""
        on_device = [unit for unit in units if unit.steps_on_device]
        jobs = []
        if on_device:
            assert self.device_lane is not None, "a unit steps on the device, but the engine has no device lane"
            worker, stepper = self.device_lane
            job = self._queue(worker, stepper, on_device, hypers, mode)
            jobs.append(job)
        on_host = [unit for unit in units if not unit.steps_on_device]
        if on_host and mode is StepMode.STEP:
            self._host_state_changes(on_host)
        if on_host or not on_device:
            job = self._queue(self.worker, self.stepper, on_host, hypers, mode)
            self._track(self.worker.submit(self._settle, job), writes=True)
            jobs.append(job)
        return jobs

    def order_by(self, order: Sequence[int]) -> None:
        """The next forward's order of the units (indices), which the workers' queues follow."""
        with self._lock:
            self._positions = {unit: position for position, unit in enumerate(order)}

    def _queue(
        self, worker: Executor, stepper: UnitStepper, units: list[UnitState], hypers: Sequence[StepHyper], mode: StepMode
    ) -> StepJob:
        """Queues a job of `units` on `worker`, and the task that runs its queue's next job."""
        with self._lock:
            first = units[0].index if units else -1
            job = StepJob(units, tuple(hypers), mode, self._positions.get(first, first))
            queue = self._queues[id(worker)]
            queue.push(job)
        self._track(worker.submit(self._run_next, queue, stepper), writes=False)
        return job

    def _track(self, future: Future, *, writes: bool) -> None:
        with self._lock:
            self._futures.append((future, writes))
        future.add_done_callback(self._note_failure)

    def _note_failure(self, future: Future) -> None:
        """Whoever completes `future`: a failure is noted, for `raise_if_failed` to look for."""
        if not future.cancelled() and future.exception() is not None:
            self._failed = True

    def withdraw(self, job: StepJob) -> bool:
        """Takes `job` back if the worker has not started it (True): it will not run. Its units'
        `step_done` stay as they are: the caller sets them, or submits the units again."""
        with self._lock:
            if job.started:
                return False
            job.withdrawn = True
            return True

    def _run_next(self, queue: JobQueue, stepper: UnitStepper) -> None:
        """The worker's task: the job of its queue the next forward needs first, if one is left
        (each job has one such task; a withdrawn job's, or one whose job an earlier task ran,
        finds another's or none)."""
        with self._lock:
            job = queue.pop()
        if job is not None:
            stepper.run(job.units, job.hypers, job.mode)

    def _settle(self, job: StepJob) -> None:
        if not job.withdrawn:  # set before the job's run task, which came first on this worker
            self.stepper.settle_writes()

    def commit(self, units: list[UnitState]) -> None:
        """Speculative steps that stand: each unit's results become its state and its window
        ends, on the worker that stepped it, after that step (a task queued behind it there: the
        caller need not wait for the steps still running)."""
        on_host = [unit for unit in units if not unit.steps_on_device]
        if on_host:
            self._host_state_changes(on_host)
            self._track(self.worker.submit(self._commit_on_host, on_host), writes=False)
        self._on_lane("commit", [unit for unit in units if unit.steps_on_device])

    def _commit_on_host(self, units: list[UnitState]) -> None:
        for unit in units:
            unit.commit_spare()
            unit.end_window()
            if self.stepper.events is not None:
                self.stepper.events.record("step_commit", unit.index)

    # ---- the device lane's copy of the state (runtime/device_step) ---------------------------
    def prefetch_on_device(self, units: list[UnitState]) -> None:
        """The device units' state up where the device's copy is not current, in this order."""
        self._on_lane("prefetch", [unit for unit in units if unit.steps_on_device])

    def upload_grad_on_device(self, unit: UnitState) -> None:
        """The transfer worker, a device unit's gradient landed: it goes up now."""
        if unit.steps_on_device and self.device_lane is not None:
            self.device_lane[1].upload_grad(unit)

    def begin_window_on_device(self) -> None:
        if self.device_lane is not None:
            self.device_lane[1].begin_window()

    def take_back_on_device(self, units: list[UnitState]) -> None:
        """Speculative steps on the device that do not stand: the device's copies are forgotten."""
        self._on_lane("take_back", [unit for unit in units if unit.steps_on_device])

    def invalidate_device_copies(self) -> None:
        """The host state was replaced (a load): the device's copies load again (called settled)."""
        if self.device_lane is not None:
            self.device_lane[1].invalidate()

    def _host_state_changes(self, units: list[UnitState]) -> None:
        """The CPU steps (or commits) `units` in their home in RAM: a device copy of their state,
        left from when they stepped on the device (overlap `auto`'s splits move units between the
        lanes), no longer mirrors it and loads again if they step there again. A unit that only
        speculated on the CPU and was taken back keeps its copy: its home did not change."""
        if self.device_lane is not None:
            self.device_lane[1].invalidate(units)

    def _on_lane(self, action: str, units: list[UnitState]) -> None:
        if units and self.device_lane is not None:
            worker, stepper = self.device_lane
            self._track(worker.submit(getattr(stepper, action), units), writes=False)

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
        if writes_too and self.device_lane is not None:
            self.device_lane[1].settle_writes()

    def raise_if_failed(self) -> None:
        """Without waiting: a step (or write-back) that already failed is raised in the main thread.
        (Before each unit's forward: nothing to look through unless a failure was noted.)"""
        if not self._failed:
            return
        with self._lock:
            self._failed = False
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
    # whether step() takes back the steps queued during backward that the optimizer worker has
    # not started, to submit them again in the next forward's order (overlap `auto`), and a
    # forward or backward before step() takes the window's speculative steps back instead of
    # being refused (as with `forward`, nothing of the window is stepped then)
    defers_to_forward = False

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


class StepDuringBoth(OverlapPolicy):
    """Overlap `auto`, the default: the best exact schedule. Units step during backward as their
    gradients are final, speculatively (into their spare state, whatever the clipping: a clip by
    user code, a `zero_grad()` or a failed backward can then always take them back), while the
    optimizer worker keeps up; when backward ends, `step()` takes back from the queue the units
    the worker has not reached and steps them, with the rest of the window, in the next
    forward's order during that forward, returning at once. The forward needs the units whose
    gradients were final last first, so the worker steps during both halves of the compute."""

    name = "auto"
    steps_in_backward = True
    speculative = True
    defers_to_forward = True

    def on_grads_final(self, unit: UnitState) -> bool:
        return True

    def on_window_end(self, stepping: Stepping) -> bool:
        """Returns at once: each unit's next fetch, forward or read waits for its own step."""
        return False


POLICIES = {policy.name: policy for policy in (StepAfterBackward, StepDuringForward, StepDuringBackward, StepDuringBoth)}


def overlap_policy(name: str, *, factor_needs_norm: bool = False) -> OverlapPolicy:
    """The policy of config `overlap`. `factor_needs_norm`: the gradients' factor is known only
    from every gradient (clipping, or fp16's overflow check): `backward` then speculates (`auto`
    always does)."""
    if name == StepDuringBackward.name:
        return StepDuringBackward(speculative=factor_needs_norm)
    return POLICIES[name]()
