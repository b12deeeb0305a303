"""Where a unit's 16-bit weights live between steps: their home, chosen once by the param tier.

`TierStore` makes one home at start and hands it every 16-bit operation; no one else sees it.

- `HostParam16` (param `cpu`; `none`, whose pinned host copy is the source of the device copy, or
  on the CPU device no host copy at all: the device buffer, which the runtime handles, is the
  home): `unit.param16` is the home. A step writes its new weights there in place: nothing is
  staged, read back or written back.
- `NvmeParam16` (param `nvme`): the home is the unit's `param16` swap file. A step writes the new
  weights into a staging buffer of the ring (optimizer worker: `target`), and `publish` starts
  their write to the file and offers the buffer to fetches (`FreshWeights`); the optimizer worker
  settles that write (`Param16WriteBack.wait`) before it takes the next staging buffer, which
  gives the buffer back to the ring still offered. The offer ends when the ring hands that buffer
  out again (`_take` withdraws it, waiting out the borrows) or the unit's next step offers
  another. Fetches (transfer worker) and weight reads (main thread) `read` a unit's weights: the
  fresh buffer if still offered, else the file read into a staging buffer; they give it back
  with `give_back`. The ring hands out its oldest free buffer, so the copy of the unit stepped
  last stays longest: a fetch delayed behind a loaded CPU, or the backward's fetch of the last
  units stepped, borrows it instead of reading the file again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offload.model.unit_state import UnitState
from offload.storage.buffers import BufferRing, FreshWeights

if TYPE_CHECKING:
    from offload.storage.swap import SwapHandle, SwapStore


class Param16WriteBack:
    """A unit's new 16-bit weights on their way from a staging buffer to their swap file (param
    nvme). Made by the optimizer worker's `TierStore.publish_param16`; waited on by the same
    worker (`wait`) before it takes another staging buffer or ends its run."""

    def __init__(self, home: NvmeParam16, buffer: torch.Tensor, handle: SwapHandle) -> None:
        self._home = home
        self._buffer = buffer
        self._handle = handle
        self._settled = False

    def wait(self) -> None:
        """Settles the write: waits for it, then gives the buffer back to the ring, still lent
        to fetches (the file now holds the same weights); a failed write withdraws it from
        fetches, gives it back too, and raises. An interrupt during the wait leaves it pending
        (the write may still read the buffer): wait again. Once settled, a wait returns at once."""
        if self._settled:
            return
        try:
            self._handle.wait()
        except Exception:
            self._settled = True
            self._home.give_back_published(self._buffer, written=False)
            raise
        self._settled = True
        self._home.give_back_published(self._buffer, written=True)


class Param16Home:
    """The 16-bit weights' home, one per store (see the module docstring): what a step, a fetch
    and a weights read do with them. `target`, `read_into`, `publish`, `release`: the optimizer
    worker's step; `read` and `give_back`: any reader; `store_values`: start and a checkpoint load."""

    def target(self, unit: UnitState) -> torch.Tensor:
        """Where a step writes the unit's new weights (whole shard)."""
        raise NotImplementedError

    def read_into(self, unit: UnitState, out: torch.Tensor) -> None:
        """Fills `out`, a `target`, with the unit's current weights."""
        raise NotImplementedError

    def publish(self, unit: UnitState, out: torch.Tensor) -> Param16WriteBack | None:
        """Sends the new weights in `out`, a `target`, home; the write still in flight, if any."""
        raise NotImplementedError

    def release(self, out: torch.Tensor) -> None:
        """A `target` that will not be published (its step failed)."""
        raise NotImplementedError

    def read(self, unit: UnitState) -> tuple[torch.Tensor, bool]:
        """The unit's weights on the host: (tensor, whether it is a staging buffer to give back)."""
        raise NotImplementedError

    def store_values(self, unit: UnitState, values32: torch.Tensor) -> None:
        """Makes `values32` (the whole shard, fp32) the unit's weights."""
        raise NotImplementedError

    def give_back(self, tensor: torch.Tensor) -> None:
        """A staging buffer `read` returned, or a `target`, is free again."""
        raise NotImplementedError


class HostParam16(Param16Home):
    """The home is `unit.param16` in host memory (see the module docstring)."""

    def target(self, unit: UnitState) -> torch.Tensor:
        assert unit.param16 is not None, f"unit {unit.spec.name} has no 16-bit host copy"
        return unit.param16

    def read_into(self, unit: UnitState, out: torch.Tensor) -> None:
        """`out` is the home (`target`): it holds the current weights already."""

    def publish(self, unit: UnitState, out: torch.Tensor) -> Param16WriteBack | None:
        """The step wrote into the home: nothing to send."""
        return None

    def release(self, out: torch.Tensor) -> None:
        """The home is not lent: nothing to give back."""

    def read(self, unit: UnitState) -> tuple[torch.Tensor, bool]:
        # param tier cpu always has the host copy; `none` has it on CUDA, and on the CPU (no host
        # copy: the device buffer is the home) nothing reads it through here
        # (weights_out.param16_shard reads the device buffer, a fetch only runs when offloaded)
        assert unit.param16 is not None, f"unit {unit.spec.name} has no 16-bit host copy"
        return unit.param16, False

    def store_values(self, unit: UnitState, values32: torch.Tensor) -> None:
        if unit.param16 is not None:  # `none` on the CPU has no host copy: the device buffer is it
            unit.param16.copy_(values32)

    def give_back(self, tensor: torch.Tensor) -> None:
        raise RuntimeError("give_back_staging: the tensor is not a staging buffer")


class NvmeParam16(Param16Home):
    """The home is the unit's `param16` swap file (see the module docstring). `staging`: the ring
    (prefetch.depth + 2 buffers of the largest shard); `swap`: the store's swap store, while open."""

    def __init__(self, staging: list[torch.Tensor], swap: Callable[[], SwapStore]) -> None:
        self.staging = BufferRing(staging)
        # new 16-bit weights a fetch may borrow while their write-back is in flight
        self.fresh = FreshWeights()
        self._swap = swap

    def _take(self) -> torch.Tensor:
        """A staging buffer from the ring (blocks while all are in use), no longer lent to
        fetches: an offer of the weights it still holds is withdrawn, its borrows waited out."""
        buffer = self.staging.take()
        self.fresh.withdraw(buffer)
        return buffer

    def target(self, unit: UnitState) -> torch.Tensor:
        """A staging buffer of the ring, the unit's size (blocks while all are in use)."""
        return self._take()[: unit.shard_numel]

    def read_into(self, unit: UnitState, out: torch.Tensor) -> None:
        """The unit's current weights, read from their file into `out`."""
        self._swap().read_into(unit.swap_name("param16"), out, urgent=True).wait()

    def publish(self, unit: UnitState, out: torch.Tensor) -> Param16WriteBack:
        """Starts writing `out` (a `target`) to the unit's file and offers it to fetches; a write
        that cannot start gives `out` back and raises."""
        try:
            handle = self._swap().write_from(unit.swap_name("param16"), out, urgent=True)
        except BaseException:
            self.give_back(out)
            raise
        # The unit counts as stepped without waiting for this write: a fetch until then borrows
        # `out` itself (FreshWeights), a later one reads the file, which the swap store orders
        # after the write. The staging buffer goes back once the write completed and no borrow
        # is out (Param16WriteBack.wait).
        writeback = Param16WriteBack(self, out, handle)
        self.fresh.offer(unit, out)
        return writeback

    def release(self, out: torch.Tensor) -> None:
        """A `target` not published (its step failed) goes back to the ring."""
        self.give_back(out)

    def read(self, unit: UnitState) -> tuple[torch.Tensor, bool]:
        fresh = self.fresh.borrow(unit)
        if fresh is not None:
            # the step's staging buffer still holds them: no read back of the file being written
            return fresh, True
        staging = self._take()
        try:
            self._swap().read_into(unit.swap_name("param16"), staging[: unit.shard_numel], urgent=True).wait()
        except BaseException:
            self.staging.give(staging)
            raise
        return staging[: unit.shard_numel], True

    def store_values(self, unit: UnitState, values32: torch.Tensor) -> None:
        self.fresh.clear(unit)
        staging = self._take()
        try:
            staging[: unit.shard_numel].copy_(values32)
            self._swap().write_from(unit.swap_name("param16"), staging[: unit.shard_numel]).wait()
        finally:
            self.staging.give(staging)

    def give_back_published(self, buffer: torch.Tensor, *, written: bool) -> None:
        """The staging buffer a step's new weights were written from, its write settled: free
        for the ring. `written`: the file holds them, so the buffer stays lent to fetches until
        the ring hands it out again (`_take`); else it is withdrawn first (the borrows out
        ended), as the file may hold anything. Straight into the ring, not through `give_back`,
        which would take it for the end of a borrow still out."""
        if not written:
            self.fresh.withdraw(buffer)
        self.staging.give(self._staging_buffer(buffer))

    def _staging_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole ring buffer `tensor` (a unit-sized view of it) begins."""
        for buffer in self.staging.buffers:
            if buffer.data_ptr() == tensor.data_ptr():
                return buffer
        raise RuntimeError("give_back_staging: the tensor is not a staging buffer")

    def give_back(self, tensor: torch.Tensor) -> None:
        if self.fresh.give_back(tensor):
            return
        self.staging.give(self._staging_buffer(tensor))
