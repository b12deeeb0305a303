"""Host buffers and the per-tier byte ledger.

`HostBufferPool` hands out exact-size, 4 KiB-aligned, zero-filled host buffers viewable as
torch tensors of any dtype. Each buffer is its own anonymous mmap (page-aligned, zeroed by
the kernel), with capacity rounded up to 4096 so O_DIRECT can move the padded length. With
CUDA present the buffer is page-locked in place with cudaHostRegister: never torch's caching
host allocator, which rounds sizes up to powers of two.

The pool has a budget, checked against available RAM (psutil) when the pool is made, and
every allocation is checked against it. Pool and ledger are thread-safe (one lock each).
"""

from __future__ import annotations

import logging
import mmap
import threading

import psutil
import torch

from offload.config.sizes import format_bytes
from offload.errors import InsufficientMemoryError

log = logging.getLogger(__name__)

ALIGN = 4096


def _size(n: int) -> str:
    return f"{format_bytes(n)} ({n} bytes)"


class TierLedger:
    """The engine's own account of bytes per tier (device / host / nvme) and category."""

    TIERS = ("device", "host", "nvme")

    def __init__(self):
        self._lock = threading.Lock()
        self._tiers = {t: {"current": 0, "peak": 0, "by_category": {}} for t in self.TIERS}

    def _check(self, tier: str, nbytes: int) -> None:
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r}; expected one of {self.TIERS}")
        if nbytes < 0:
            raise ValueError(f"byte count must be >= 0, got {nbytes}")

    def allocate(self, tier: str, nbytes: int, category: str = "other") -> None:
        self._check(tier, nbytes)
        with self._lock:
            t = self._tiers[tier]
            t["current"] += nbytes
            t["peak"] = max(t["peak"], t["current"])
            c = t["by_category"].setdefault(category, {"current": 0, "peak": 0})
            c["current"] += nbytes
            c["peak"] = max(c["peak"], c["current"])

    def release(self, tier: str, nbytes: int, category: str = "other") -> None:
        self._check(tier, nbytes)
        with self._lock:
            t = self._tiers[tier]
            c = t["by_category"].get(category)
            if c is None or c["current"] < nbytes:
                have = 0 if c is None else c["current"]
                raise ValueError(f"ledger: releasing {nbytes} bytes of {tier}/{category} but only {have} are allocated")
            c["current"] -= nbytes
            t["current"] -= nbytes

    def current(self, tier: str) -> int:
        with self._lock:
            return self._tiers[tier]["current"]

    def report(self) -> dict:
        with self._lock:
            return {
                tier: {
                    "current": t["current"],
                    "peak": t["peak"],
                    "by_category": {k: dict(v) for k, v in t["by_category"].items()},
                }
                for tier, t in self._tiers.items()
            }


class _Block:
    __slots__ = ("mm", "capacity", "nbytes", "category", "registered")

    def __init__(self, mm, capacity, nbytes, category, registered):
        self.mm, self.capacity, self.nbytes, self.category, self.registered = mm, capacity, nbytes, category, registered


def _key(tensor: torch.Tensor) -> int:
    # The storage's address: an empty tensor's data_ptr() is 0, its storage's is not.
    return tensor.untyped_storage().data_ptr()


def available_ram() -> int:
    return int(psutil.virtual_memory().available)


class HostBufferPool:
    """Exact-size aligned host buffers under one budget (see module docstring).

    Accounting counts each buffer's capacity (its size rounded up to 4096), which is what
    the process really holds. `allocated_bytes`, `peak_bytes` and `budget_bytes` are bytes.
    """

    def __init__(
        self, budget_bytes: int | None, *, pin: bool | None = None, ledger: TierLedger | None = None, name: str = "host pool"
    ):
        self.name = name
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        if self.pin and not torch.cuda.is_available():
            raise ValueError(f"{name}: pin=True needs CUDA, which is not available; pass pin=False")
        self.ledger = ledger
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self._blocks: dict[int, _Block] = {}  # data_ptr -> block
        self._lock = threading.Lock()
        self._closed = False
        if self.budget_bytes is not None:
            if self.budget_bytes < 0:
                raise ValueError(f"{name}: budget must be >= 0 bytes, got {self.budget_bytes}")
            free = available_ram()
            if self.budget_bytes > free:
                raise InsufficientMemoryError(
                    f"{name}: budget of {_size(self.budget_bytes)} exceeds the {_size(free)} of RAM available on this "
                    "machine; lower the host budget (offload fewer tensors to host, e.g. offload.optimizer='nvme'), "
                    "or free memory"
                )

    def alloc(self, numel: int, dtype: torch.dtype, category: str = "other", *, pin: bool = True) -> torch.Tensor:
        """A 1-D zero-filled tensor of exactly `numel` elements; data_ptr 4096-aligned. `pin`:
        False leaves it pageable even in a pinned pool (a buffer never copied to the device)."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        numel = int(numel)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        capacity = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            if self.budget_bytes is not None and self.allocated_bytes + capacity > self.budget_bytes:
                raise InsufficientMemoryError(
                    f"{self.name}: allocating {_size(capacity)} for {category} would exceed the budget of "
                    f"{_size(self.budget_bytes)} ({_size(self.allocated_bytes)} in use); raise the budget or "
                    "free buffers first"
                )
            if self.budget_bytes is None:
                free = available_ram()
                if capacity > free:
                    raise InsufficientMemoryError(
                        f"{self.name}: allocating {_size(capacity)} for {category} but only {_size(free)} of RAM is "
                        "available; offload less to host memory or free memory"
                    )
            self.allocated_bytes += capacity  # reserve before the (slow) mmap, under the lock
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        try:
            mm = mmap.mmap(-1, capacity)
            base = torch.frombuffer(mm, dtype=torch.uint8)
            registered = False
            if self.pin and pin:
                rc = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), capacity, 0)
                if int(rc) != 0:
                    raise InsufficientMemoryError(
                        f"{self.name}: cudaHostRegister of {_size(capacity)} failed (error {int(rc)}); lower the pinned budget"
                    )
                registered = True
        except BaseException:
            with self._lock:
                self.allocated_bytes -= capacity
            raise
        tensor = base.view(dtype)[:numel]
        block = _Block(mm, capacity, nbytes, category, registered)
        with self._lock:
            self._blocks[base.data_ptr()] = block
        if self.ledger is not None:
            self.ledger.allocate("host", capacity, category)
        return tensor

    def capacity_of(self, tensor: torch.Tensor) -> int:
        with self._lock:
            block = self._blocks.get(_key(tensor))
        if block is None:
            raise ValueError(f"tensor at {_key(tensor):#x} was not allocated by {self.name}")
        return block.capacity

    def free(self, tensor: torch.Tensor) -> None:
        """Return a buffer. The memory is unmapped when the last view of it is gone."""
        with self._lock:
            block = self._blocks.pop(_key(tensor), None)
            if block is None:
                raise ValueError(
                    f"{self.name}.free: tensor at {_key(tensor):#x} was not allocated by this pool or was already freed"
                )
            self.allocated_bytes -= block.capacity
        self._release(_key(tensor), block)

    def _release(self, ptr: int, block: _Block) -> None:
        if block.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        if self.ledger is not None:
            self.ledger.release("host", block.capacity, block.category)
        try:
            block.mm.close()  # succeeds only when no tensor still views it; else freed with the last view
        except BufferError:
            pass

    def close(self) -> None:
        """Unpin and free every buffer (idempotent)."""
        with self._lock:
            blocks, self._blocks = self._blocks, {}
            self.allocated_bytes = 0
            self._closed = True
        for ptr, block in blocks.items():
            self._release(ptr, block)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
