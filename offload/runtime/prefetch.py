"""Execution-order trace: record the order in which units run, then look ahead along it.

Plain logic, no torch state. The engine calls `visit` as each unit starts and asks `upcoming`
which units to fetch ahead. The first pass of each phase records; later passes compare with
the record. A pass that deviates (a branch taken differently, a unit called a different number
of times) stops predicting for the rest of that pass (the engine fetches on demand) and its
order replaces the record at the end, so a valid model never gets a tracing error.
"""

from __future__ import annotations


class ExecutionOrder:
    """The recorded order of one phase (forward, or backward) and the position in the current pass."""

    def __init__(self) -> None:
        self.recorded: list[int] | None = None
        self.current: list[int] = []
        self.deviated = False

    def begin(self) -> None:
        self.current = []
        self.deviated = False

    def visit(self, unit: int) -> None:
        position = len(self.current)
        self.current.append(unit)
        if self.recorded is not None and not self.deviated:
            if position >= len(self.recorded) or self.recorded[position] != unit:
                self.deviated = True

    def upcoming(self, depth: int) -> list[int]:
        """The next `depth` units expected after the last visited one (none while unknown)."""
        if self.recorded is None or self.deviated or depth <= 0:
            return []
        position = len(self.current)
        return self.recorded[position : position + depth]

    def abandon(self) -> None:
        """Drops the current pass (its forward failed): it neither counts nor records."""
        self.current = []
        self.deviated = False

    def end(self) -> bool:
        """Closes the pass; returns True when its order became the new record."""
        finished = self.current
        self.current = []
        if self.recorded is not None and not self.deviated and len(finished) == len(self.recorded):
            return False
        if not finished:
            return False
        self.recorded = finished
        return True


def unique_in_order(units: list[int]) -> list[int]:
    """Each unit once, at its first position: the order in which the CPU steps units."""
    seen: set[int] = set()
    ordered = []
    for unit in units:
        if unit not in seen:
            seen.add(unit)
            ordered.append(unit)
    return ordered


def step_order(forward_order: list[int] | None, unit_count: int) -> list[int]:
    """Units in the order the next forward needs them; units it never ran go last."""
    ordered = unique_in_order(list(forward_order or []))
    present = set(ordered)
    return ordered + [unit for unit in range(unit_count) if unit not in present]
