"""The process an engine belongs to. Its worker threads, copy streams, I/O engine and swap store
exist only in the process that built it: a child forked from it (a DataLoader worker, a
multiprocessing task under the 'fork' start method) has a copy of the engine's memory but none
of its threads, so a call there would wait forever on a future or a condition nobody will set.
`OwningProcess.check` makes every such call fail at once instead, naming the cause; the parent
is unaffected, and a child that does not touch the engine (or the model) works as before."""

from __future__ import annotations

import os

from offload.errors import ForkedProcessError


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
