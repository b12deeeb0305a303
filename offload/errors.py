"""Exceptions offload raises. Each message names the thing that is wrong and what to do."""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error offload raises on purpose."""


class ConfigError(OffloadError, ValueError):
    """A config key or value that cannot be honoured (unknown key, wrong type, bad range).

    `key` is the dotted key in the user's own file that the error is about (`"io.block_size"`,
    `"zero_optimization.offload_param.device"`, `"optimizer.betas[1]"`), or None when the error
    is about the config as a whole (a missing file, invalid JSON)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self):
        return type(self), (str(self), self.key)


class InsufficientMemoryError(OffloadError, MemoryError):
    """The placement needs more host RAM than this machine has free."""


class InsufficientSpaceError(OffloadError, OSError):
    """The swap path has less free space than the placement needs."""


class SwapError(OffloadError, OSError):
    """A swap read or write failed; the message names the file, operation and offset."""


class SwapCorruptError(SwapError):
    """A swap file is truncated, has a wrong header, or its checksum does not match."""


class NonFiniteError(OffloadError, FloatingPointError):
    """A loss or gradient is NaN or infinite where training cannot skip it."""


class OrderingError(OffloadError, RuntimeError):
    """The checked stand-in device (`OFFLOAD_DEVICE=checked`) caught an ordering an accelerator
    does not guarantee: a read before its wait, a source written while its copy was queued, a
    buffer reused while a stream still works on it. `rule`, `stream` and `what` name it."""

    def __init__(self, message: str, rule: str = "", stream: str = "", what: str = "") -> None:
        super().__init__(message)
        self.rule = rule
        self.stream = stream
        self.what = what

    def __reduce__(self):
        return type(self), (str(self), self.rule, self.stream, self.what)


class ForkedProcessError(OffloadError, RuntimeError):
    """An engine used in a process forked from the one that built it (a DataLoader worker, a
    multiprocessing task with the 'fork' start method): its I/O threads, copy streams and swap
    store exist only in the process that built it."""
