"""The process an engine belongs to, and the thread driving it.

Its worker threads, copy streams, I/O engine and swap store exist only in the process that built
it: a child forked from it (a DataLoader worker, a multiprocessing task under the 'fork' start
method) has a copy of the engine's memory but none of its threads, so a call there would wait
forever on a future or a condition nobody will set. `OwningProcess.check` makes every such call
fail at once instead, naming the cause; the parent is unaffected, and a child that does not
touch the engine (or the model) works as before.

Within the process, one engine is driven by one thread at a time (`DrivingThread`): its schedule,
holds, fetches and counters are kept by whichever thread calls it, without locks. A loop may move
from thread to thread between calls; a call made while another thread is inside one is refused
at its entry, before it changes anything."""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from offload.errors import ConcurrentUseError, ForkedProcessError

_P = ParamSpec("_P")
_R = TypeVar("_R")


class OwningProcess:
    """The process (pid) an engine was built in."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def check(self, what: str) -> None:
        """Raises ForkedProcessError when called from any other process."""
        here = os.getpid()
        if here != self.pid:
            raise ForkedProcessError(
                f"offload: {what} in process {here}, a child forked from process {self.pid}, which built the engine: "
                "its worker threads, copy streams and swap files exist only there, so nothing of it can run here. "
                "Build the engine in the child, or start the workers with the 'spawn' method "
                "(multiprocessing.get_context('spawn'), DataLoader(..., multiprocessing_context='spawn')); "
                "a worker that only loads data, touching neither the engine nor the model, needs neither"
            )


class Driving(enum.Enum):
    """Where the thread inside an engine call is, seen from the thread asking."""

    HERE = "here"
    ELSEWHERE = "elsewhere"
    NOBODY = "nobody"


class DrivingThread:
    """The thread inside a call of the engine now, if any. `enter` at each call's start and
    `leave` at its end (`entered`, or `driven` on a method); a call the same thread makes inside
    another counts once more. A second thread's `enter` meanwhile raises ConcurrentUseError
    naming both threads and the call in progress: two threads training one engine used to fail
    deep inside it (a bare AssertionError in the residency, a C++ abort), after changing things.

    Cost on the hot path: one dict lookup per call, and one `setdefault` at the outermost call.
    The owner is taken with `dict.setdefault`, atomic under the GIL, and only the owner changes
    `_depth` or gives the slot back; an interrupt between two of these steps leaves the slot to
    the interrupted thread, whose next call takes it up again (depth 0 means not entered yet)."""

    def __init__(self, process: OwningProcess) -> None:
        self.process = process
        # "owner": (thread ident, thread name, the call it is inside), while a thread is inside
        self._slot: dict[str, tuple[int, str, str]] = {}
        self._depth = 0

    def enter(self, what: str) -> None:
        me = threading.get_ident()
        owner = self._slot.get("owner")
        if owner is None:
            owner = self._slot.setdefault("owner", (me, threading.current_thread().name, what))
        if owner[0] != me:
            # a forked child finds the slot as the parent's thread held it: that error is the true one
            self.process.check(what)
            raise self.refusal(what, owner)
        self._depth += 1

    @staticmethod
    def refusal(what: str, owner: tuple[int, str, str]) -> ConcurrentUseError:
        return ConcurrentUseError(
            f"offload: {what} on thread {threading.current_thread().name!r} while thread {owner[1]!r} is inside "
            f"{owner[2]}: one engine is driven by one thread at a time (its schedule, fetches and counters are kept "
            "without locks). Train from one thread; if several must call it, make them take turns over whole steps "
            "(a lock held from the forward to step()), and read weights from another thread with "
            "engine.consolidated_state_dict() between that thread's calls"
        )

    def check_free(self, what: str) -> None:
        """Raises ConcurrentUseError if another thread is inside a call (without entering)."""
        owner = self._slot.get("owner")
        if owner is not None and owner[0] != threading.get_ident():
            self.process.check(what)
            raise self.refusal(what, owner)

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            del self._slot["owner"]

    def held_here(self) -> bool:
        """Whether this thread is inside a call of the engine."""
        return self.where() is Driving.HERE

    def where(self) -> Driving:
        owner = self._slot.get("owner")
        if owner is None:
            return Driving.NOBODY
        return Driving.HERE if owner[0] == threading.get_ident() else Driving.ELSEWHERE

    @contextlib.contextmanager
    def entered(self, what: str) -> Iterator[None]:
        self.enter(what)
        try:
            yield
        finally:
            self.leave()


class Driven(Protocol):
    driver: DrivingThread


_S = TypeVar("_S", bound=Driven)


def driven(what: str) -> Callable[[Callable[Concatenate[_S, _P], _R]], Callable[Concatenate[_S, _P], _R]]:
    """A method of an object with a `driver` that is an entry point of the engine (`what` names it
    in the error): the whole call runs inside `driver.enter` / `driver.leave`."""

    def decorate(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
        @functools.wraps(method)
        def call(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            driver = self.driver
            driver.enter(what)
            try:
                return method(self, *args, **kwargs)
            finally:
                driver.leave()

        return call

    return decorate
