"""The per-unit schedule's vocabulary, a leaf of the runtime: the log of transitions (`EventLog`),
the phases of a micro-step (`Phase`) and who owns a forward's hold (`EntryKind`)."""

from __future__ import annotations

import enum
import threading
import time


class EventLog:
    """The order of transitions, for tests that pin it (FSDP2's expected-events style) and for
    benchmarks/bench_pipeline.py, which reads their times: off unless `enabled`. Appended from
    the main thread and the two workers."""

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[str, int]] = []
        self.times: list[float] = []  # time.perf_counter() of each event
        self._lock = threading.Lock()

    def record(self, name: str, unit: int) -> None:
        if self.enabled:
            with self._lock:
                self.events.append((name, unit))
                self.times.append(time.perf_counter())

    def take(self) -> list[tuple[str, int]]:
        return [event for event, _ in self.take_timed()]

    def take_timed(self) -> list[tuple[tuple[str, int], float]]:
        """The events so far with their times, and forgets them."""
        with self._lock:
            events, self.events = self.events, []
            times, self.times = self.times, []
        return list(zip(events, times))


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class EntryKind(enum.Enum):
    """Who owns the hold a unit's forward takes."""

    # the model's forward: given back at the unit's post-forward
    FORWARD = "forward"
    # a forward re-run inside backward (activation checkpointing): a backward hold, given back
    # when the unit's gradients are final or at the end of backward, whether or not the
    # recompute ran to its end
    RECOMPUTE = "recompute"
