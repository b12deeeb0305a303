"""offload.plan.disk_time: a drive's seconds for reads and writes, and the overlap it showed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.plan.disk_time import (
    background_depths_to_try,
    disk_seconds,
    largest_overlap,
    measured_overlap,
    pick_background_depth,
)

GB = 1e9
byte_counts = st.floats(min_value=0.0, max_value=1e13)
rates = st.floats(min_value=0.01, max_value=100.0)


def test_cases():
    # 2 GB read at 1 GB/s (2 s), 3 GB written at 1.5 GB/s (2 s)
    assert disk_seconds(2 * GB, 3 * GB, 1.0, 1.5) == pytest.approx(4.0)  # one after the other
    assert disk_seconds(2 * GB, 3 * GB, 1.0, 1.5, overlap=2.0) == pytest.approx(2.0)  # neither slows the other
    assert disk_seconds(2 * GB, 3 * GB, 1.0, 1.5, overlap=1.6) == pytest.approx(2.5)
    assert largest_overlap(2 * GB, 3 * GB, 1.0, 1.5) == pytest.approx(2.0)
    # reads 1 s, writes 3 s: together never under 3 s, so at most 4/3 as fast as serial
    assert largest_overlap(1 * GB, 3 * GB, 1.0, 1.0) == pytest.approx(4 / 3)
    assert disk_seconds(1 * GB, 3 * GB, 1.0, 1.0, overlap=2.0) == pytest.approx(3.0)
    assert largest_overlap(0.0, 3 * GB, 1.0, 1.0) == 1.0 and largest_overlap(0.0, 0.0, 1.0, 1.0) == 1.0
    # this VM's disk with dd: 1 GiB read 1.76 s, 1 GiB written 2.32 s, both together 4.38 s
    gib = 2**30
    read_rate, write_rate = gib / 1.76 / GB, gib / 2.32 / GB
    assert measured_overlap(gib, gib, read_rate, write_rate, 4.38) == 1.0  # slower than serial: one queue
    assert measured_overlap(gib, gib, read_rate, write_rate, 2.0) == pytest.approx(4.08 / 2.32)  # capped


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="overlap must be >= 1"):
        disk_seconds(GB, GB, 1.0, 1.0, overlap=0.5)
    with pytest.raises(ValueError, match="rates must be > 0"):
        disk_seconds(GB, GB, 0.0, 1.0)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        disk_seconds(-1.0, GB, 1.0, 1.0)
    with pytest.raises(ValueError, match="seconds_together must be > 0"):
        measured_overlap(GB, GB, 1.0, 1.0, 0.0)


@given(byte_counts, byte_counts, rates, rates, st.floats(min_value=1.0, max_value=4.0))
def test_between_the_longer_direction_and_the_sum(read, written, read_rate, write_rate, overlap):
    reading, writing = read / (read_rate * GB), written / (write_rate * GB)
    seconds = disk_seconds(read, written, read_rate, write_rate, overlap)
    assert max(reading, writing) * (1 - 1e-12) <= seconds <= (reading + writing) * (1 + 1e-12)
    assert seconds <= disk_seconds(read, written, read_rate, write_rate, 1.0) * (1 + 1e-12)


@given(
    st.floats(min_value=1e6, max_value=1e12),
    st.floats(min_value=1e6, max_value=1e12),
    rates,
    rates,
    st.floats(min_value=0.0, max_value=1.0),
)
def test_measured_overlap_gives_back_the_measured_time(read, written, read_rate, write_rate, where):
    """A pass timed anywhere between the longer direction and the sum: the model at the overlap
    it yields predicts that pass's time again."""
    reading, writing = read / (read_rate * GB), written / (write_rate * GB)
    together = max(reading, writing) + where * min(reading, writing)
    overlap = measured_overlap(read, written, read_rate, write_rate, together)
    assert 1.0 <= overlap <= largest_overlap(read, written, read_rate, write_rate) * (1 + 1e-12)
    assert disk_seconds(read, written, read_rate, write_rate, overlap) == pytest.approx(together, rel=1e-9)


def test_background_depths_to_try():
    assert background_depths_to_try(1) == [0]
    assert background_depths_to_try(2) == [0, 1]
    assert background_depths_to_try(4) == [0, 1, 2]
    assert background_depths_to_try(8) == [0, 1, 2, 4]
    assert background_depths_to_try(16) == [0, 1, 2, 8]
    with pytest.raises(ValueError, match="places must be >= 1"):
        background_depths_to_try(0)


def test_pick_background_depth():
    # a one-queue drive: all about the same, so 0 (urgent reads first cost it nothing)
    assert pick_background_depth({0: 1.45, 1: 1.35, 2: 1.40, 4: 1.41}) == 0
    # a drive that reads and writes at once: the smallest depth near the fastest
    assert pick_background_depth({0: 2.0, 1: 1.3, 2: 1.2, 4: 1.19}) == 1
    assert pick_background_depth({0: 2.0, 1: 1.6, 2: 1.2, 4: 1.19}) == 2
    with pytest.raises(ValueError, match="seconds > 0"):
        pick_background_depth({})
    with pytest.raises(ValueError, match="seconds > 0"):
        pick_background_depth({0: 0.0})


@given(st.dictionaries(st.integers(0, 16), st.floats(min_value=1e-3, max_value=1e3), min_size=1))
def test_picked_depth_is_near_the_fastest_and_no_larger_than_needed(seconds):
    depth = pick_background_depth(seconds)
    fastest = min(seconds.values())
    assert seconds[depth] <= fastest * 1.1
    assert all(seconds[d] > fastest * 1.1 for d in seconds if d < depth)
