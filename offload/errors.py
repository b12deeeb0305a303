"""Exceptions offload raises. Each message names the thing that is wrong and what to do.

An error the user caused (a config key, a placement, a misuse) is raised at the public call the
user made (`offload.initialize`, `offload.load_config`): its traceback ends there instead of
running through offload's inside, which only says where offload noticed, not what to change.
Nothing is lost: the error raised inside, with its whole traceback, is the shown error's
`__context__`, and `OFFLOAD_FULL_TRACEBACK=1` keeps every traceback whole.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


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


class WeightsError(OffloadError, ValueError):
    """Pretrained weights (`initialize(..., weights=path)`) that cannot be loaded as they are: a
    damaged or lying safetensors file, an index naming a missing file or one outside its
    directory, a key the model does not have, a shape or dtype that does not fit. The message
    names the file and the key; nothing was placed when it is raised (docs/pretrained.md)."""


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


class ConcurrentUseError(OffloadError, RuntimeError):
    """An engine called from a second thread while another thread is inside one of its calls
    (or a parameter it watches read there): one engine is driven by one thread at a time."""


class ForkedProcessError(OffloadError, RuntimeError):
    """An engine used in a process forked from the one that built it (a DataLoader worker, a
    multiprocessing task with the 'fork' start method): its I/O threads, copy streams and swap
    store exist only in the process that built it."""


FULL_TRACEBACK_ENV = "OFFLOAD_FULL_TRACEBACK"


def name_config_file(error: OffloadError, config_file: str | os.PathLike) -> None:
    """Names the config file in the message of an error about one of its keys (in place: raise it
    on), unless the message names it already."""
    if isinstance(error, ConfigError) and error.key is not None and os.fspath(config_file) not in str(error):
        error.args = (f"config file {os.fspath(config_file)!r}: {error}", *error.args[1:])


def at_users_call(error: OffloadError) -> OffloadError | None:
    """`error` again, to raise at the user's call (`raise at_users_call(error) from
    error.__cause__`): a copy without offload's frames, the original its `__context__`. None
    where the whole traceback is wanted (OFFLOAD_FULL_TRACEBACK=1) or the error cannot be copied."""
    if os.environ.get(FULL_TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        short = copy.copy(error)
    except (TypeError, ValueError, AttributeError):  # arguments that do not round-trip: raised as it is
        return None
    short.__traceback__ = None
    return short


def raised_at_users_call(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorates a public entry: an OffloadError from inside is raised again at the entry
    (`at_users_call`), chained to its own cause, if any, as before."""

    @functools.wraps(function)
    def public_entry(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return function(*args, **kwargs)
        except OffloadError as error:
            short = at_users_call(error)
            if short is None:
                raise
            raise short from error.__cause__

    return public_entry
