"""offload.plan.disk_time: a drive's seconds for reads and writes, and the overlap it showed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.plan.disk_time import disk_seconds, largest_overlap, measured_overlap

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
