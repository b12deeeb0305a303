"""The host buffers that carry a unit's state between tiers, and who uses them.

- resident host buffers (`optimizer: cpu`; `param: cpu`, or `none` on CUDA): allocated once from the pool.
  The transfer worker writes gradients into `grad32`; the optimizer worker reads and writes
  the rest; the engine makes sure the two never run on one unit at once (a step starts only
  after every gradient of its window has landed).
- spare state (overlap `backward` with clipping or fp16, units with resident host state, as many
  as RAM allows: plan.plan_speculation): the optimizer worker writes a speculative step's master
  and moments into it, reading the resident ones; the main thread swaps the two
  (`commit_spare`) in step(), after waiting for every step, when the step stands.
- `OptimizerSlot`s (`optimizer: nvme`): `SlotShape.count` sets of (master, exp_avg,
  exp_avg_sq, grad32) buffers sized for one piece: a unit's state is streamed in pieces of at
  most `SlotShape.piece` elements (`plan.shape_slots`, `plan.piece_bounds`), so a 70B model's
  856M-element blocks do not cost 41 GB of slots. Only the optimizer worker uses them; a slot is
  reused for piece i + count after piece i's writes have completed. A streamed unit's new 16-bit weights
  are written into their home (`param: cpu`, `none`), or into a staging buffer (`param: nvme`).
- `staging` ring (`param: nvme`, kept by the 16-bit home `storage.param16.NvmeParam16`): host
  buffers the transfer worker reads 16-bit shards into before copying them to the device (one is
  reused once its device copy has completed), and the optimizer worker's step writes a unit's
  new weights into before their write-back (`Param16WriteBack`).
- fresh 16-bit weights (`param: nvme`, `FreshWeights`): the staging buffer a step wrote a
  unit's new weights into, offered by the optimizer worker from their publication until the
  ring hands that buffer out again. A fetch (transfer worker) or a weights read borrows it
  instead of reading the file: while the write-back is in flight, and after it (the ring gives
  out its oldest free buffer first, so a late fetch or the backward's fetch of a unit stepped
  last still finds it). Whoever takes the buffer from the ring withdraws the offer first,
  waiting until no borrow is out (`NvmeParam16._take`).
- gradient staging ring (a device with memory of its own): two host buffers of the largest
  shard; the transfer worker borrows one per gradient copy off the device
  (`TierStore.grad_staging_buffer`) and gives it back once it has added the gradient in.
- `grad_slot` (`optimizer: nvme`): the transfer worker's buffer for read-add-write of the fp32
  gradient, one piece at a time; used by one task at a time (the transfer worker is one thread).
  Made only when some NVMe unit keeps its gradient on NVMe: a unit with `gradient_in_ram` has
  it in `resident_state["grad32"]` (the transfer worker adds into it, the step reads it, as for
  resident state) and no gradient swap files.
- prefetched pieces (`optimizer: nvme`): during the window's last backward the optimizer worker
  reads the master and moments of the step's first pieces into the slots ahead of it
  (`TierStore.prefetch_optimizer_states`); the next stream uses them, anyone else using the
  slots waits them out first.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.model.unit_state import UnitState


class BufferRing:
    """A fixed set of equal host buffers handed out one at a time (blocking when all are in use)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._free: queue.Queue = queue.Queue()
        for buffer in buffers:
            self._free.put(buffer)
        self.buffers = list(buffers)

    def take(self) -> torch.Tensor:
        return self._free.get()

    def give(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


@dataclass
class _Fresh:
    buffer: torch.Tensor
    version: int
    borrows: int = 0
    # being withdrawn: lent no more, kept (so that borrows can end) until none is out
    withdrawn: bool = False


class FreshWeights:
    """Units' new 16-bit weights still in the staging buffers their steps wrote them to (see the
    module docstring). `offer`: the optimizer worker; `withdraw`: whoever takes a staging buffer
    from the ring; `borrow` and `give_back`: any reader (the transfer worker's fetches, a weights
    reader). One condition guards it all."""

    def __init__(self) -> None:
        self._by_unit: dict[int, _Fresh] = {}
        self._changed = threading.Condition()
        self.borrowed = 0  # borrows so far (how many reads of the swap file they saved)

    def offer(self, unit: UnitState, buffer: torch.Tensor) -> None:
        """`buffer` holds `unit`'s weights of its current version (its step just wrote them). An
        older copy still offered is withdrawn first (its borrows waited out)."""
        with self._changed:
            if unit.index in self._by_unit:
                self._end(unit.index)
            self._by_unit[unit.index] = _Fresh(buffer, unit.weights_version)

    def borrow(self, unit: UnitState) -> torch.Tensor | None:
        """The unit's current weights if a staging buffer still holds them (give it back with
        `give_back`), else None (read the file)."""
        with self._changed:
            fresh = self._by_unit.get(unit.index)
            if fresh is None or fresh.withdrawn or fresh.version != unit.weights_version:
                return None
            fresh.borrows += 1
            self.borrowed += 1
            return fresh.buffer

    def give_back(self, buffer: torch.Tensor) -> bool:
        """Ends a borrow of `buffer`; False when `buffer` is not a borrowed one."""
        with self._changed:
            for fresh in self._by_unit.values():
                if fresh.borrows and fresh.buffer.data_ptr() == buffer.data_ptr():
                    fresh.borrows -= 1
                    self._changed.notify_all()
                    return True
        return False

    def withdraw(self, buffer: torch.Tensor) -> None:
        """`buffer` is about to be reused: no one may borrow it from now on, and this returns
        once every borrow of it has ended (each is one host or device copy)."""
        with self._changed:
            for index in [i for i, fresh in self._by_unit.items() if fresh.buffer.data_ptr() == buffer.data_ptr()]:
                self._end(index)

    def _end(self, index: int) -> None:
        """(Condition held.) Lends the unit's copy no more, waits for its borrows, forgets it. Two
        threads may end one copy at once (the next step's `offer` and a `withdraw` of its buffer
        taken from the ring): each returns once the borrows are over, and only the copy itself is
        forgotten, never one offered meanwhile."""
        fresh = self._by_unit[index]
        fresh.withdrawn = True
        while fresh.borrows:
            self._changed.wait()
        if self._by_unit.get(index) is fresh:
            del self._by_unit[index]

    def clear(self, unit: UnitState) -> None:
        """The unit's weights were replaced by other means (a checkpoint load): no fresh copy."""
        with self._changed:
            if unit.index in self._by_unit:
                self._end(unit.index)


@dataclass
class OptimizerSlot:
    """Host buffers for one piece of an NVMe-resident unit's state while it steps (see the module
    docstring)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad32: torch.Tensor
    # (kind, elements of a piece) -> elements of the buffer that stores them (the moments may be
    # compact: storage.state_codec); the identity for fp32 state
    stored_numel: Callable[[str, int], int] = lambda kind, numel: numel
    pending_writes: list = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad32": self.grad32}

    def views(self, numel: int) -> dict[str, torch.Tensor]:
        """The stored form of a piece of `numel` elements read into the slot, by kind: the start
        of each buffer."""
        return {kind: buffer[: self.stored_numel(kind, numel)] for kind, buffer in self.tensors().items()}

    def wait_writes(self) -> None:
        """Waits for every write queued on the slot, even after one failed (the slot is reused
        only when none is in flight); raises the first failure."""
        pending, self.pending_writes = self.pending_writes, []
        first: BaseException | None = None
        for position, handle in enumerate(pending):
            try:
                handle.wait()
            except Exception as error:  # noqa: BLE001 (the first is raised once all are done)
                first = first or error
            except BaseException:
                # an interrupt: the writes not yet waited for stay queued, to be waited again
                self.pending_writes = pending[position:] + self.pending_writes
                raise
        if first is not None:
            raise first


@dataclass(frozen=True, repr=False)
class StatePiece:
    """One piece of a unit's optimizer state as `TierStore` streams it: the fp32 values of the
    state's elements [start, start + n) by kind, wherever they are now."""

    unit: UnitState
    # its place in `unit.state_pieces` (the swap files it belongs to)
    index: int
    start: int
    views: dict[str, torch.Tensor]
    # the slot the piece was read into (NVMe-resident state); None when resident (host or device)
    slot: OptimizerSlot | None
    # the unit's last piece: after it, the unit's state has been seen whole
    last: bool

    @property
    def end(self) -> int:
        return self.start + self.views["master"].numel()

    def __repr__(self) -> str:
        # no tensors: a piece's buffers may be freed (the pool closed) by the time it is shown
        return f"StatePiece({self.unit.spec.name}, piece {self.index}, [{self.start}, {self.end}), last={self.last})"
