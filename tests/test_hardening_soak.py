"""Issue 16: a short fault-injection soak (benchmarks/soak_faults.py has the long one).

Random SIGKILL and SIGINT from outside, injected EIO and ENOSPC inside, restarts from
checkpoints and in-process recoveries: the final weights equal an undisturbed run's bit for
bit and no swap is left on disk."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


@pytest.mark.slow
def test_soak_with_kills_interrupts_and_io_errors_ends_bit_identical_with_no_swap_left(tmp_path):
    import signal

    from soak_faults import soak

    # the first child is interrupted after its 8th step and killed after its 14th; the second
    # interrupted after its 5th; after that none is signalled. The signals follow the children's
    # progress, not the clock, so none is lost to a child that got through first. EIO and ENOSPC
    # are injected at random steps throughout. 20 steps with a checkpoint every 5: each signal
    # lands between two checkpoints, as with 40 steps and every 10, in half the steps (the
    # undisturbed reference run included); seed 7 injects 6 I/O errors and recovers 8 times.
    plan = [[(8, signal.SIGINT), (14, signal.SIGKILL)], [(5, signal.SIGINT)]]
    counts = soak(steps=20, every=5, seed=7, workdir=str(tmp_path), p_io=0.15, step_sleep=0.1, plan=plan, child_timeout=300)
    assert counts["bit_identical"], counts
    assert counts["swap_left_after_soak"] == [] and counts["swap_left_after_reference"] == [], counts
    assert counts["sigkill_sent"] == 1 and counts["sigint_sent"] == 2 and counts["killed"] == 1, counts
    assert counts["eio_injected"] + counts["enospc_injected"] >= 2, counts
    assert counts["recovered_in_process"] >= 2, counts
