"""The optimizer worker's queue (`offload.runtime.overlap.Stepping`): each step is followed by
its write-back's settling, a task of its own, so that a backward (which needs the step to have
read the gradients it overwrites) does not wait for the state to be written too; everything
else waits for both, and a failure of either is raised, in the order they were submitted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import OffloadError
from offload.runtime.overlap import JobQueue, StepJob, Stepping
from offload.runtime.stepper import StepMode


class FakeStepper:
    """`run` returns at once; `settle_writes` blocks until `release` is set (or fails)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.write_error: Exception | None = None
        self.ran = 0

    def run(self, units, hypers, mode) -> None:
        self.ran += 1

    def settle_writes(self) -> None:
        self.release.wait(10)
        if self.write_error is not None:
            raise self.write_error


@pytest.fixture
def queue():
    worker = ThreadPoolExecutor(1)
    stepper = FakeStepper()
    yield Stepping(worker, stepper), stepper
    stepper.release.set()
    worker.shutdown(wait=True)


def test_wait_steps_does_not_wait_for_the_write_back_and_wait_does(queue):
    stepping, stepper = queue
    stepping.submit([], [])
    stepping.wait_steps()  # returns while settle_writes still blocks
    assert stepper.ran == 1 and stepping.pending
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (stepping.wait(), done.set()))
    waiter.start()
    assert not done.wait(0.2)  # wait() waits for the write-back
    stepper.release.set()
    waiter.join(10)
    assert done.is_set() and not stepping.pending


def test_a_failed_write_back_is_raised_by_the_next_wait_of_either_kind(queue):
    stepping, stepper = queue
    stepper.write_error = OSError(5, "the write-back failed")
    stepping.submit([], [])
    stepper.release.set()
    stepping.worker.submit(lambda: None).result()  # the write-back task has failed by now
    with pytest.raises(OSError, match="the write-back failed"):
        stepping.wait_steps()
    stepping.wait_steps()  # raised once, then forgotten
    assert not stepping.pending


class GatedStepper(FakeStepper):
    """`run` records the units it stepped and waits for `gate` (so a job can be held running)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()
        self.steps: list = []
        self.release.set()

    def run(self, units, hypers, mode) -> None:
        self.started.set()
        self.gate.wait(10)
        self.steps.append(list(units))


@pytest.fixture
def gated():
    worker = ThreadPoolExecutor(1)
    stepper = GatedStepper()
    yield Stepping(worker, stepper), stepper
    stepper.gate.set()
    worker.shutdown(wait=True)


def test_a_job_the_worker_has_not_started_can_be_withdrawn_and_then_does_nothing(gated):
    """overlap auto's step(): the queued speculative steps come off the queue (the running one
    cannot), and what is submitted next runs after the running one, in its own order."""
    stepping, stepper = gated
    root, block1, block2 = (
        SimpleNamespace(name=name, index=index, steps_on_device=False)
        for index, name in enumerate(("root", "block 1", "block 2"))
    )
    (running,) = stepping.submit([block2], [])
    assert stepper.started.wait(10)
    (queued,) = stepping.submit([block1], [])
    (also_queued,) = stepping.submit([root], [])
    assert not stepping.withdraw(running)
    assert stepping.withdraw(queued) and stepping.withdraw(also_queued)
    stepping.submit([root, block1], [])
    stepper.gate.set()
    stepping.wait()
    assert [[unit.name for unit in units] for units in stepper.steps] == [["block 2"], ["root", "block 1"]]
    assert not stepping.pending


@settings(max_examples=60, deadline=None)
@given(
    positions=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12),
    withdrawn=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_a_job_queue_gives_the_job_the_forward_needs_first(positions, withdrawn):
    """Of the jobs queued, `pop` gives the one whose first unit the next forward needs first (the
    first queued on a tie), skips the withdrawn ones, and marks what it gives started."""
    queue = JobQueue()
    jobs = [StepJob([], (), StepMode.STEP, position) for position in positions]
    for job, out in zip(jobs, withdrawn):
        queue.push(job)
        job.withdrawn = out
    popped = []
    while (job := queue.pop()) is not None:
        assert job.started
        popped.append(job)
    expected = sorted((job for job in jobs if not job.withdrawn), key=lambda job: (job.position, jobs.index(job)))
    assert popped == expected
    assert not any(job.started for job in jobs if job.withdrawn)


@pytest.mark.parametrize("forward_order", [None, [0, 4, 3, 2, 1, 5]])
def test_a_busy_worker_steps_the_landed_unit_the_forward_needs_first(gated, forward_order):
    """Units land in reverse forward order (5, 4, 3, 2) while the worker is held in the first's
    step: it then steps the one the forward needs first (2), not the one queued first (4); with
    another forward order (`order_by`) it follows that one. A withdrawn job does not run."""
    stepping, stepper = gated
    if forward_order is not None:
        stepping.order_by(forward_order)
    units = [SimpleNamespace(name=f"unit {i}", index=i, steps_on_device=False) for i in range(6)]
    jobs = {5: stepping.submit([units[5]], [])}
    assert stepper.started.wait(10)  # the worker is in unit 5's step
    jobs.update({i: stepping.submit([units[i]], []) for i in (4, 3, 2, 1)})
    assert stepping.withdraw(jobs[1][0])
    stepper.gate.set()
    stepping.wait()
    ran = [unit.index for units in stepper.steps for unit in units]
    assert ran == ([5, 2, 3, 4] if forward_order is None else [5, 4, 3, 2])


class Untouchable(list):
    def __iter__(self):
        raise AssertionError("raise_if_failed looked through the futures with no failure noted")


def test_raise_if_failed_looks_through_the_futures_only_after_a_failure(queue):
    """It runs before every unit's forward: with nothing failed it returns at once (it scanned
    every future of the window before, twice per unit, a quarter of the engine's host time per
    unit at 49 units); a failure is noted by the future's callback and raised once."""
    stepping, stepper = queue
    stepper.release.set()
    stepping.submit([], [])
    stepping.worker.submit(lambda: None).result()  # both tasks done
    kept = stepping._futures
    stepping._futures = Untouchable(kept)
    stepping.raise_if_failed()
    stepping._futures = kept
    stepper.write_error = OSError(5, "the write-back failed")
    stepping.submit([], [])
    stepping.worker.submit(lambda: None).result()
    with pytest.raises(OffloadError, match="the write-back failed"):
        stepping.raise_if_failed()
    stepping.raise_if_failed()  # raised once
