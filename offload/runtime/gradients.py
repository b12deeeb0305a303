"""Each unit's gradients, from the device into the fp32 gradient on the optimizer tier.

`GradientOffload.hand_off` (main thread, when a unit's gradients are final in a backward) takes
the params' device gradients (flattened, and reduce-scattered to this rank's shard with several
ranks), records a compute event, and submits `_land` to the transfer worker, which copies the
shard to the host (device-to-host stream, through a pinned staging buffer on CUDA), adds it
into the fp32 gradient and, at the end of a window, takes its squared norm. A unit whose
optimizer state is on the device (tier DEVICE) keeps its gradient there: it is added into the
device fp32 gradient on the device's optimizer stream.

In flight: every hand-off of the window is kept in `futures` until `wait_all` (errors surface
there, at the window's end); at most MAX_GRADS_IN_FLIGHT units' gradients wait on the device,
the main thread (and so backward) waits for the oldest beyond that.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch
from torch.profiler import record_function

from offload.config.placement import OptimizerTier
from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.plan.optimizer_plan import GRADS_IN_FLIGHT as MAX_GRADS_IN_FLIGHT
from offload.platform.collectives import Collectives
from offload.platform.device import Device
from offload.storage.memory import TierLedger
from offload.storage.tiers import TierStore


class GradientOffload:
    def __init__(
        self,
        *,
        device: Device,
        collectives: Collectives,
        store: TierStore,
        ledger: TierLedger,
        transfer: Executor,
        compute_dtype: torch.dtype,
        timings: dict[str, float],
        on_final: Callable[[UnitState], None],
    ) -> None:
        self.device = device
        self.collectives = collectives
        self.store = store
        self.ledger = ledger
        self.transfer = transfer
        self.compute_dtype = compute_dtype
        self.timings = timings
        # transfer worker: a unit's gradients of the window have landed and are its last (the
        # overlap policy steps it now)
        self.on_final = on_final
        self.futures: list[Future] = []  # every hand-off of the window (errors)
        self._in_flight: collections.deque[Future] = collections.deque()  # not yet known done

    # ---- main thread ----------------------------------------------------------------------
    def hand_off(self, unit: UnitState, pending: set[int], *, first: bool, boundary: bool, final: bool) -> None:
        """Takes the gradients of the params `pending` off the device (their .grad becomes None)."""
        layout = unit.layout
        params = unit.spec.params
        self._bound_in_flight()
        on_device = unit.optimizer_tier is OptimizerTier.DEVICE
        if self.collectives.is_distributed or (self.device.separate_memory and not on_device):
            shard = self._flat_shard(unit, pending)
            device_bytes = shard.numel() * shard.element_size()
            # the shard's frozen tail has no fp32 gradient to land in (state.py)
            pieces = [(0, shard[: unit.optimizer_numel])] if unit.optimizer_numel else []
        else:
            # one rank, and the gradients are where their fp32 gradient is (the CPU device's
            # host memory, or the GPU for a DEVICE-tier unit): the transfer worker adds them
            # straight into it, with no flat copy in between
            pieces = []
            with torch.no_grad():
                for index in sorted(pending):
                    grad = params[index].grad
                    if grad is not None:
                        pieces.append((layout.offsets[index], grad.reshape(-1)))
                    params[index].grad = None
            device_bytes = sum(g.numel() * g.element_size() for _, g in pieces)
            self.ledger.allocate("device", device_bytes, "grad")
        event = self.device.record_compute_event()
        reader = self.device.optimizer if on_device else self.device.device_to_host
        for _, grad in pieces:
            reader.keep_alive(grad)
        future = self.transfer.submit(self._land, unit, pieces, device_bytes, event, first, boundary, final)
        self.futures.append(future)
        self._in_flight.append(future)

    def _flat_shard(self, unit: UnitState, pending: set[int]) -> torch.Tensor:
        """The unit's gradients as one flat device buffer, reduce-scattered to this rank's shard."""
        layout = unit.layout
        params = unit.spec.params
        flat = self.device.empty(layout.padded_numel, self.compute_dtype)
        full_nbytes = flat.numel() * flat.element_size()
        self.ledger.allocate("device", full_nbytes, "grad")
        flat.zero_()
        with torch.no_grad():
            for index in pending:
                grad = params[index].grad
                if grad is not None:
                    flat[layout.offsets[index] : layout.offsets[index] + layout.numels[index]].copy_(grad.reshape(-1))
                params[index].grad = None
        if not self.collectives.is_distributed:
            return flat
        shard = self.device.empty(layout.shard_numel, self.compute_dtype)
        self.ledger.allocate("device", shard.numel() * shard.element_size(), "grad")
        self.collectives.reduce_scatter_flat(shard, flat, what=f"gradients of unit {unit.spec.name}")
        self.ledger.release("device", full_nbytes, "grad")
        return shard

    def _bound_in_flight(self) -> None:
        while self._in_flight and (len(self._in_flight) >= MAX_GRADS_IN_FLIGHT or self._in_flight[0].done()):
            oldest = self._in_flight.popleft()
            if not oldest.done():
                started = time.perf_counter()
                oldest.exception()  # waits; errors surface in wait_all
                self.timings["wait_fetch"] += time.perf_counter() - started

    def wait_all(self) -> None:
        """Waits for every hand-off of the window; re-raises the first error. The hand-offs are
        forgotten only once done: an interrupted wait can be waited again."""
        concurrent.futures.wait(self.futures)
        futures, self.futures = self.futures, []
        self._in_flight.clear()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise OffloadError(f"offload: moving gradients off the device failed: {errors[0]}") from errors[0]

    # ---- transfer worker ------------------------------------------------------------------
    def _land(self, unit: UnitState, pieces: list, device_bytes: int, event, first: bool, boundary: bool, final: bool) -> None:
        """Device gradients -> fp32 gradient on its tier (+ squared norm at the boundary).

        `pieces` are (offset in the shard, gradient) pairs: the reduce-scattered flat shard (its
        trainable part) on CUDA or with several ranks, the params' own gradients on a CPU
        device. `device_bytes`: what the hand-off put in the ledger's device tier."""
        with record_function(f"offload::grads_to_host[{unit.index}]"):
            self._accumulate(unit, pieces, device_bytes, event, first, boundary)
        if final:
            self.on_final(unit)

    def _accumulate(self, unit: UnitState, pieces: list, nbytes: int, event, first: bool, boundary: bool) -> None:
        try:
            if unit.optimizer_tier is OptimizerTier.DEVICE:
                # the fp32 gradient is on the device too: added there, on the optimizer stream,
                # after the compute that produced the gradient; nothing crosses PCIe
                stream = self.device.optimizer
                stream.waits(event)
                launched = stream.launch(
                    functools.partial(self.store.accumulate_grad, unit, pieces, first, compute_norm=boundary),
                    what=f"gradient of unit {unit.spec.name} (added on the device)",
                    unit=unit.index,
                    reads=[grad for _, grad in pieces],
                    writes=[unit.resident_state["grad32"]],
                )
                stream.record_event().synchronize()
                norm = launched.value()
                if boundary:
                    unit.grad_sq_norm = norm
                return
            if not (self.device.separate_memory and pieces):
                self._add(unit, pieces, first, boundary)
                return
            # through a host staging buffer the store lends (given back as the block ends)
            ((offset, flat),) = pieces
            to_host = self.device.device_to_host
            to_host.waits(event)
            with self.store.grad_staging_buffer() as staging:
                to_host.copy(staging[: flat.numel()], flat, what=f"gradient of unit {unit.spec.name}", unit=unit.index)
                to_host.record_event().synchronize()
                pieces = [(offset, staging[: flat.numel()])]
                self.device.host_reads(pieces[0][1], f"the staged gradient of unit {unit.spec.name}")
                self._add(unit, pieces, first, boundary)
                self.device.releasing(staging, f"the gradient staging buffer of unit {unit.spec.name}")
        finally:
            del pieces
            self.ledger.release("device", nbytes, "grad")

    def _add(self, unit: UnitState, pieces: list, first: bool, boundary: bool) -> None:
        """The gradient `pieces` (host memory) added into the unit's fp32 gradient; its squared
        norm kept at the window's boundary."""
        norm = self.store.accumulate_grad(unit, pieces, first, compute_norm=boundary)
        if boundary:
            unit.grad_sq_norm = norm
