"""How long a disk takes to read some bytes and write others: plain functions, no torch.

A drive is described by three measurements (`offload bench-io` makes them): its read rate, its
write rate, and how much faster it moves a read and a write submitted together than one after
the other (`overlap`). An NVMe drive serves both directions at once, within limits; some
virtual and network disks serve them from one queue, so a read waits for the writes ahead of
it. An optimizer step whose state lives on the disk reads and writes in the same seconds, so
which of the two a drive does changes the step's time by up to 2x.

The model: reads alone take R / r seconds, writes alone W / w; one after the other, their sum;
together, the sum divided by the drive's overlap, never less than the longer of the two:

    seconds = max(R / r, W / w, (R / r + W / w) / overlap)

overlap 1 is a one-queue drive (the sum); an overlap at its largest is a drive whose reads and
writes never slow each other (the longer of the two).
"""

from __future__ import annotations


def _directions(read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float) -> tuple[float, float]:
    if read_bytes < 0 or written_bytes < 0:
        raise ValueError(f"bytes must be >= 0 (read {read_bytes}, written {written_bytes})")
    if read_gbps <= 0 or write_gbps <= 0:
        raise ValueError(f"rates must be > 0 (read {read_gbps} GB/s, write {write_gbps} GB/s)")
    return read_bytes / (read_gbps * 1e9), written_bytes / (write_gbps * 1e9)


def largest_overlap(read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float) -> float:
    """The overlap of a drive whose reads and writes of these sizes never slow each other: the
    serial time over the longer direction's (1 where one direction has no bytes)."""
    reading, writing = _directions(read_bytes, written_bytes, read_gbps, write_gbps)
    longer = max(reading, writing)
    return 1.0 if longer == 0 else (reading + writing) / longer


def measured_overlap(
    read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float, seconds_together: float
) -> float:
    """The overlap a drive showed: the seconds its reads and writes take one after the other
    (at the rates measured for each alone) over the seconds they took submitted together,
    within [1, largest_overlap] (a pass slower than serial counts as a one-queue drive, one
    faster than the longer direction alone as a drive that never slows either)."""
    if seconds_together <= 0:
        raise ValueError(f"seconds_together must be > 0, got {seconds_together}")
    reading, writing = _directions(read_bytes, written_bytes, read_gbps, write_gbps)
    overlap = (reading + writing) / seconds_together
    return min(max(overlap, 1.0), largest_overlap(read_bytes, written_bytes, read_gbps, write_gbps))


def disk_seconds(read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float, overlap: float = 1.0) -> float:
    """Seconds the drive needs to read `read_bytes` and write `written_bytes` (the module's
    model); overlap 1, the default, is reads then writes."""
    if overlap < 1.0:
        raise ValueError(f"overlap must be >= 1 (1: reads then writes), got {overlap}")
    reading, writing = _directions(read_bytes, written_bytes, read_gbps, write_gbps)
    return max(reading, writing, (reading + writing) / overlap)


# ---- the I/O engine's io.background_depth on a drive -----------------------------------------
def background_depths_to_try(places: int) -> list[int]:
    """The io.background_depth values `offload bench-io` times for an engine with `places`
    pieces in flight (min(threads, queue_depth)): 0, 1, 2 and half the places, each below
    `places` (a depth must leave urgent I/O a place)."""
    if places < 1:
        raise ValueError(f"places must be >= 1, got {places}")
    return sorted({depth for depth in (0, 1, 2, places // 2) if depth < places})


def pick_background_depth(seconds_by_depth: dict[int, float], tolerance: float = 0.10) -> int:
    """The io.background_depth to use, from the seconds a drive took to read (urgent) and write
    (not) at once at each depth: the smallest within `tolerance` of the fastest. A drive that
    serves one direction at a time is as fast at 0 (urgent reads first cost it nothing), so it
    keeps 0; one that reads and writes at once is faster with places kept for the writes. The
    tolerance (10%) is above what a shared virtual disk moves between two passes a second
    apart, so that noise does not pick a depth; a duplex drive's gain is larger (the pipeline
    replay predicts 1.4-1.8x faster NVMe steps at 1.3B and 7B)."""
    if not seconds_by_depth or any(s <= 0 for s in seconds_by_depth.values()):
        raise ValueError(f"seconds_by_depth must map depths to seconds > 0, got {seconds_by_depth}")
    fastest = min(seconds_by_depth.values())
    return min(depth for depth, seconds in seconds_by_depth.items() if seconds <= fastest * (1 + tolerance))
