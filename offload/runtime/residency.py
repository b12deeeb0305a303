"""Device copies of each unit's 16-bit weights: fetched ahead, held while used, freed after.

Every unit's params are views into its `device_flat` buffer. With `param: none` that buffer
always holds the weights. With `param: cpu|nvme` its storage is freed (resized to 0 bytes)
between uses: the params keep their shapes, and a read of their values outside the engine's
work is refused before it reaches the freed memory (param_reads.py). A fetch re-allocates the storage (main thread) and the transfer worker
fills it from the host copy or the swap file, on the host-to-device stream; the compute stream waits on
the copy's event before the unit runs.

Residency is counted: `acquire` adds a holder (the unit's forward, its backward, a unit that
borrows a tied weight, an external read), `release` removes one; at zero holders an offloaded
unit's storage is freed. Holders and storage changes happen on the main thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch
from torch.profiler import record_function

from offload.config.placement import ParamTier
from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.platform.collectives import Collectives
from offload.platform.device import Device
from offload.platform.rank_order import Op
from offload.storage.memory import TierLedger
from offload.storage.tiers import TierStore

logger = logging.getLogger(__name__)


def _device_flat(unit: UnitState) -> torch.Tensor:
    """The unit's device buffer: the engine makes one for every unit at start (engine.py),
    before anything here runs, and keeps it (only its storage is freed and re-allocated)."""
    assert unit.device_flat is not None, f"unit {unit.spec.name} has no device buffer"
    return unit.device_flat


def _taken_fetch(unit: UnitState) -> Future:
    """Takes the unit's fetch in flight off it. There is one: the callers complete or abandon
    a fetch `prefetch` submitted (the transfer executor's Future)."""
    future, unit.fetch_future = unit.fetch_future, None
    assert isinstance(future, Future), f"unit {unit.spec.name} has no fetch in flight"
    return future


class Residency:
    def __init__(
        self,
        units: list[UnitState],
        *,
        device: Device,
        store: TierStore,
        transfer: Executor,
        collectives: Collectives,
        ledger: TierLedger,
        param_tier: ParamTier,
        compute_dtype: torch.dtype,
        agree_before: Callable[[Op, UnitState], None],
    ) -> None:
        self.units = units
        self.device = device
        self.store = store
        self.transfer = transfer
        self.collectives = collectives
        self.ledger = ledger
        self.offloaded = param_tier.offloaded
        # several ranks: called before each gather, so that the ranks fail at once, naming what
        # each was about to do, when they are out of step (rank_order.py)
        self.agree_before = agree_before
        self.element_size = torch.empty(0, dtype=compute_dtype).element_size()

    # ---- storage (main thread) ----------------------------------------------------------
    def _nbytes(self, unit: UnitState) -> int:
        return unit.layout.padded_numel * self.element_size

    def materialize(self, unit: UnitState) -> None:
        storage = _device_flat(unit).untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes(unit))
            self.device.allocated(_device_flat(unit))
            self.ledger.allocate("device", self._nbytes(unit), "param")

    def free(self, unit: UnitState) -> None:
        storage = _device_flat(unit).untyped_storage()
        if storage.nbytes() != 0:
            self.device.releasing(_device_flat(unit), f"the device buffer of unit {unit.spec.name}")
            storage.resize_(0)
            self.ledger.release("device", self._nbytes(unit), "param")
        unit.resident = False

    # ---- fetching -----------------------------------------------------------------------
    def prefetch(self, unit: UnitState) -> None:
        """Starts bringing an offloaded unit to the device, unless it is there or on its way."""
        if not self.offloaded or unit.resident or unit.fetch_future is not None:
            return
        self.materialize(unit)
        device_flat = _device_flat(unit)
        if self.collectives.is_distributed:
            unit.fetch_target = self.device.empty(unit.shard_numel, device_flat.dtype)
            self.device.allocated(unit.fetch_target)
            self.ledger.allocate("device", unit.shard_numel * self.element_size, "param_shard")
        else:
            unit.fetch_target = device_flat
        # The storage just allocated may be memory the compute stream freed while kernels that
        # read it are still queued: the copy must not write it before they finish.
        compute_done = self.device.record_compute_event()
        unit.fetch_version = unit.weights_version
        unit.fetch_future = self.transfer.submit(self._fetch, unit, unit.fetch_target, compute_done)

    def _fetch(self, unit: UnitState, target: torch.Tensor, compute_done):
        """Transfer worker: waits for the unit's pending step, copies its 16-bit shard to `target`."""
        with record_function(f"offload::fetch[{unit.index}]"):
            return self._fetch_shard(unit, target, compute_done)

    def _fetch_shard(self, unit: UnitState, target: torch.Tensor, compute_done):
        unit.step_done.wait()
        source, staged = self.store.read_param16(unit)
        to_device = self.device.host_to_device
        try:
            to_device.waits(compute_done)
            to_device.copy(target[: unit.shard_numel], source, what=f"weights of unit {unit.spec.name}", unit=unit.index)
            event = to_device.record_event()
            if staged:
                event.synchronize()  # the staging buffer is reused by the next fetch
                self.device.releasing(source, f"the staging buffer of unit {unit.spec.name}'s weights")
        finally:
            if staged:
                self.store.give_back_staging(source)
        return event

    def _complete_fetch(self, unit: UnitState) -> None:
        event = _taken_fetch(unit).result()
        self.device.compute_waits(event)
        if unit.fetch_target is not unit.device_flat:
            # prefetch set `fetch_target` (this rank's shard) with the fetch; only this clears it
            assert unit.fetch_target is not None
            self._gather(unit, _device_flat(unit), unit.fetch_target)
            self.ledger.release("device", unit.shard_numel * self.element_size, "param_shard")
        unit.fetch_target = None
        unit.resident = True
        unit.resident_version = unit.fetch_version

    def _abandon_fetch(self, unit: UnitState) -> None:
        """A fetch nobody will use: waits for its copy, gathers nothing (the other ranks may not
        have fetched this unit), leaves the unit not resident. A fetch that failed raises here,
        after its shard buffer left the ledger and the unit."""
        try:
            _taken_fetch(unit).result().synchronize()
        finally:
            if unit.fetch_target is not None and unit.fetch_target is not unit.device_flat:
                self.ledger.release("device", unit.shard_numel * self.element_size, "param_shard")
            unit.fetch_target = None

    def _gather(self, unit: UnitState, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Several ranks: `full` receives every rank's shard of the unit, after the ranks agreed
        that this is the collective each of them issues now (rank_order.py)."""
        self.agree_before(Op.GATHER, unit)
        self.collectives.all_gather_flat(full, shard, what=f"weights of unit {unit.spec.name}")

    def _await_step(self, unit: UnitState) -> None:
        """Param tier `none`: the compute stream waits for the step's write into `device_flat`."""
        unit.step_done.wait()
        if unit.device_update_event is not None:
            self.device.compute_waits(unit.device_update_event)
            unit.device_update_event = None

    def weights_current(self, units: list[UnitState]) -> None:
        """Param tier `none`, once step() waited for `units`' steps: compute waits for the copies
        of their new weights to the device, so that a read right after step() sees them (with
        overlap `none` on one rank no read is watched: param_reads.py). On CUDA a stream wait,
        nothing for the host; each event stays for the host waits that need it (the unit's next
        step rewrites the host copy the copy reads, a checkpoint load too)."""
        if self.offloaded:
            return
        for unit in units:
            if unit.device_update_event is not None:
                self.device.compute_waits(unit.device_update_event)

    def _gather_resident(self, unit: UnitState) -> None:
        self._await_step(unit)
        start, end = unit.layout.shard_range(self.collectives.rank)
        device_flat = _device_flat(unit)
        self._gather(unit, device_flat, device_flat[start:end].clone())
        unit.needs_gather = False

    def _refresh_resident(self, unit: UnitState) -> None:
        """Param tier `none`: the unit's new weights, whole. With several ranks each stepped unit
        is gathered once, in index order (this one and every lower one not gathered yet), so the
        ranks issue the same gathers in the same order even when they run different units."""
        if self.collectives.is_distributed:
            for earlier in self.units[: unit.index + 1]:
                if earlier.needs_gather:
                    self._gather_resident(earlier)
        self._await_step(unit)

    def gather_stepped(self) -> None:
        """End of a forward (param tier `none`, several ranks): gathers the stepped units this
        rank's forward did not use (another rank's may have), in index order."""
        for unit in self.units:
            if unit.needs_gather:
                self._gather_resident(unit)

    # ---- holding ------------------------------------------------------------------------
    def acquire(self, unit: UnitState) -> None:
        """Adds a holder; the unit's weights are on the device, current, when this returns."""
        if unit.holders == 0:
            _check_params_view_buffer(unit)
        if not self.offloaded:
            self._refresh_resident(unit)
        else:
            while not (unit.resident and unit.resident_version == unit.weights_version):
                if unit.resident:
                    # a copy from before the unit's last step: the engine released it too late
                    # (a bookkeeping bug); it is refetched, never used
                    logger.warning(
                        "offload: unit %s was on the device with the weights of step version %d, now %d; fetching again",
                        unit.spec.name,
                        unit.resident_version,
                        unit.weights_version,
                    )
                    unit.resident = False
                if unit.fetch_future is None:
                    self.prefetch(unit)
                self._complete_fetch(unit)
        if unit.holders == 0:
            self.device.compute_reads(_device_flat(unit), f"weights of unit {unit.spec.name}")
        unit.holders += 1

    def release(self, unit: UnitState) -> None:
        if unit.holders <= 0:
            raise RuntimeError(f"offload: unit {unit.spec.name} released more often than acquired")
        unit.holders -= 1
        if unit.holders == 0 and self.offloaded:
            self.free(unit)

    def drop_device_copies(self) -> None:
        """Between steps (a checkpoint load replaces every weight): no offloaded unit keeps, or
        is fetching, a device copy. A fetch that failed is discarded with a warning (its weights
        are being replaced: recovery after an I/O error). With param none, the steps' copies of
        new weights to the device are waited for: they read the host copies the load rewrites,
        and would land over the loaded weights (found by the checked device)."""
        if not self.offloaded:
            for unit in self.units:
                if unit.device_update_event is not None:
                    unit.device_update_event.synchronize()
                    unit.device_update_event = None
            return
        for unit in self.units:
            if unit.holders:
                raise OffloadError(
                    f"unit {unit.spec.name} is in use (inside a forward or backward); load a checkpoint between steps"
                )
            if unit.fetch_future is not None:
                try:
                    self._abandon_fetch(unit)
                except Exception as error:  # noqa: BLE001 (the failed fetch's weights are replaced anyway)
                    logger.warning("offload: discarding a failed fetch of unit %s: %s", unit.spec.name, error)
            self.free(unit)

    def replace_weights(self, unit: UnitState, shard32: torch.Tensor) -> None:
        """Param tier `none`: this rank's shard of the device weights takes `shard32` (cast); with
        several ranks the whole unit is gathered at its next use."""
        if self.offloaded:
            return
        if unit.device_update_event is not None:
            # a step's copy of its new weights still queued would land over the loaded ones
            # (found by the checked device)
            self.device.compute_waits(unit.device_update_event)
            unit.device_update_event = None
        start, end = unit.layout.shard_range(self.collectives.rank)
        _device_flat(unit)[start:end].copy_(shard32)
        unit.needs_gather = self.collectives.is_distributed

    def reset_leaked_holds(self) -> None:
        """End of backward: no unit may stay held into the step. Holds still counted here were
        leaked (a forward that never finished); they are dropped and an offloaded unit freed."""
        for unit in self.units:
            if unit.holders:
                logger.warning(
                    "offload: unit %s still had %d holders at the end of backward; released", unit.spec.name, unit.holders
                )
                unit.holders = 0
                if self.offloaded:
                    if unit.fetch_future is not None:
                        self._abandon_fetch(unit)
                    self.free(unit)

    def release_idle(self) -> None:
        """Frees every offloaded unit nobody holds (prefetched but unused ones included)."""
        if not self.offloaded:
            return
        for unit in self.units:
            if unit.holders == 0:
                if unit.fetch_future is not None:
                    self._abandon_fetch(unit)
                self.free(unit)


def _check_params_view_buffer(unit: UnitState) -> None:
    """Every param of the unit still views its device buffer. `model.to(...)`, `.half()`,
    `.cpu()` or an assignment to `param.data` after initialize replaces a param's storage: the
    engine would go on updating a buffer the model no longer reads (and with the weights
    offloaded, the conversion itself read freed storage). Out of the sight of torch function
    modes: param_reads.py would take these looks at the params for reads."""
    with torch._C.DisableTorchFunction():
        storage = _device_flat(unit).untyped_storage()._cdata
        for name, param in zip(unit.spec.param_names, unit.spec.params, strict=True):
            if param.untyped_storage()._cdata != storage:
                raise OffloadError(
                    f"parameter {name!r} no longer holds the engine's weights ({param.dtype} on {param.device}): it "
                    "was replaced after offload.initialize (model.to(), .half(), .cpu(), or an assignment to "
                    "param.data). The engine places the weights itself; for CPU copies use model.state_dict(), "
                    "engine.consolidated_state_dict() or engine.close(). Remove the call, or rebuild the engine"
                )


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors inside a module output: tensors, tuples, lists, dicts, dataclass-like outputs."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found
