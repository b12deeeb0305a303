"""The device, host and NVMe tiers of every unit's state: allocation at start, reads and writes after.

`TierStore` owns the host buffer pool and the swap store. It sizes the pool from the placement
before allocating anything (`plan.budgets.host_budget_bytes`), reserves every swap file up front
(a full disk fails here, not mid-step), and gives the engine a small vocabulary: initialise a
unit's state, stream its optimizer state piece by piece, read its master, fetch/publish/store
the 16-bit weights (through the home the param tier chose, storage.param16), accumulate a
gradient, lend a gradient staging buffer, settle the swap operations in flight. It is the
storage layer's one face: the swap store, its handles, the slots and the staging rings are
reached through it alone. Which thread calls what is documented in `storage.buffers`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from offload.config.placement import OptimizerTier, ParamTier
from offload.config.schema import Config
from offload.config.sizes import format_bytes, parse_size
from offload.config.state_layout import FP32_STATE, StateBytes
from offload.errors import OffloadError
from offload.model.unit_state import STATE_KINDS, STEPPED_KINDS, UnitState
from offload.plan.budgets import host_budget_bytes, pool_page_slack
from offload.plan.optimizer_plan import (
    piece_bounds,
    plan_leftover_ram,
    shape_slots,
)
from offload.plan.room import host_cap, nvme_path_for_rank
from offload.storage.buffers import BufferRing, OptimizerSlot, StatePiece
from offload.storage.grad_sum import accumulate_gradient, squared_norm
from offload.storage.memory import HostBufferPool, TierLedger
from offload.storage.param16 import HostParam16, NvmeParam16, Param16Home, Param16WriteBack
from offload.storage.state_codec import RoundingTally, StateCodec, make_codec

if TYPE_CHECKING:
    from offload.storage.swap import SwapHandle, SwapStore

logger = logging.getLogger(__name__)


class TierStore:
    def __init__(
        self,
        units: list[UnitState],
        config: Config,
        *,
        compute_dtype: torch.dtype,
        pin: bool,
        staged_device_copies: bool,
        ledger: TierLedger,
        rank: int,
        local_rank: int,
        run_name: str,
        optimizer_tiers: list[OptimizerTier] | None = None,
        device: torch.device | None = None,
        speculate: bool = False,
        state: StateBytes = FP32_STATE,
    ) -> None:
        """`optimizer_tiers`: each unit's (the plan of `offload.optimizer: auto`); by default the
        config's `offload.optimizer` for every unit. `speculate`: units step speculatively during
        backward (overlap 'backward' with clipping or fp16); the units with resident host state
        get a spare state, as many as the RAM left after everything else allows
        (plan.plan_speculation). `state`: the bytes of each state kind (the moments' precision,
        the gradient's width; config.state_layout), whose formats `self.codec` knows."""
        self.state = state
        self.codec: StateCodec = make_codec(state, compute_dtype, rank, config.optimizer.rounding_seed)
        self.units = units
        self.param_tier = ParamTier(config.offload.param)
        if optimizer_tiers is None:
            optimizer_tiers = [OptimizerTier(config.offload.optimizer)] * len(units)
        # the fp32 states cover each shard's trainable part only (state.py); a slot holds one piece
        self.slot_shape = shape_slots(
            [unit.optimizer_numel for unit, tier in zip(units, optimizer_tiers) if tier.streamed],
            buffer_count=config.offload.buffer_count,
            sub_group_size=config.offload.sub_group_size,
        )
        for unit, tier in zip(units, optimizer_tiers):
            unit.optimizer_tier = tier
            if tier.streamed:
                unit.state_pieces = piece_bounds(unit.optimizer_numel, self.slot_shape.piece)
            else:
                unit.state_pieces = [(0, unit.optimizer_numel)]
        self.streamed_units = [unit for unit in units if unit.optimizer_tier.streamed]
        self.compute_dtype = compute_dtype
        # where DEVICE-tier optimizer state is allocated (the engine's compute device)
        self.device = torch.device("cpu") if device is None else device
        self._device_state_bytes = 0  # what this store put in the ledger's device tier
        self.ledger = ledger
        self.prefetch_depth = config.prefetch.depth
        compute_bytes = torch.empty(0, dtype=compute_dtype).element_size()
        shard_numels = [unit.shard_numel for unit in units]
        self.largest_shard = max(shard_numels, default=0)
        self.budget = host_budget_bytes(
            shard_numels,
            param_tier=self.param_tier,
            optimizer_tier=list(optimizer_tiers),
            compute_bytes=compute_bytes,
            buffer_count=config.offload.buffer_count,
            prefetch_depth=config.prefetch.depth,
            staged_device_copies=staged_device_copies,
            optimizer_numels=[unit.optimizer_numel for unit in units],
            sub_group_size=config.offload.sub_group_size,
            state=state,
        )
        # Page-rounding per buffer: every buffer's capacity rounds up to 4 KiB.
        page_slack = pool_page_slack(len(units), self.slot_shape.count, config.prefetch.depth)
        self._plan_leftover_ram(config, sum(self.budget.values()) + page_slack, speculate)
        total_budget = sum(self.budget.values())
        self.pool = HostBufferPool(
            total_budget + page_slack,
            pin=pin and config.offload.pin_memory,
            ledger=ledger,
            name="offload host pool",
        )
        # made when some unit's state is on NVMe (a streamed optimizer tier, or param tier nvme)
        self.swap: SwapStore | None = None
        # held by whoever uses the optimizer slots (the optimizer worker's step, a checkpoint's
        # save or load, a read of the masters): one user at a time, whichever thread it is on
        self._slots_lock = threading.RLock()
        # reads of the master and moments of the next step's first pieces, started into slots
        # 0, 1, ... ahead of it (`prefetch_optimizer_states`, optimizer worker, during the
        # boundary backward): (unit, piece index, read handles) per slot in that order. Taken by
        # the next stream, which uses those that match its own first pieces and waits out the
        # rest; dropped (waited out) by anything else that uses the slots. Under _slots_lock.
        self._prefetched: list[tuple[UnitState, int, list[SwapHandle]]] = []
        # the slot of a stream's (and its prefetch's) first piece; each stream moves it on by its
        # piece count: the next step's first pieces go into the slots written back first. Under _slots_lock.
        self._first_slot = 0
        # a stream consumed with leave_writes: the pieces to read ahead once its writes are waited
        # for (settle_stream); None when nothing is left. Under _slots_lock.
        self._unsettled: list[tuple[UnitState, int]] | None = None
        self._nvme_bytes_recorded = 0  # what this store put in the ledger's nvme tier
        try:
            if self.streamed_units or self.param_tier is ParamTier.NVME:
                from offload.storage.swap import SwapStore

                path = nvme_path_for_rank(config.offload.nvme_path, local_rank)
                self.swap = SwapStore(
                    path,
                    run_name=run_name,
                    rank=rank,
                    block_size=config.io.block_size,
                    queue_depth=config.io.queue_depth,
                    threads=config.io.threads,
                    background_depth=config.io.background_depth,
                )
                specs = {}
                for unit in units:
                    for piece, (start, end) in enumerate(unit.state_pieces):
                        for kind in unit.swap_kinds:
                            specs[unit.swap_name(kind, piece)] = self.codec.storage(kind, end - start)
                    if self.param_tier is ParamTier.NVME:
                        specs[unit.swap_name("param16")] = (unit.shard_numel, compute_dtype)
                self.swap.reserve(specs)
                self._nvme_bytes_recorded = self.swap.nbytes_on_disk()
                ledger.allocate("nvme", self._nvme_bytes_recorded, "swap")
            self._allocate_host()
        except BaseException:
            self.close()
            raise

    def _plan_leftover_ram(self, config: Config, others: int, speculate: bool) -> None:
        """Spends the RAM left beside `others` bytes (plan.plan_leftover_ram): spare states for the
        units that step speculatively during backward (when `speculate`), then fp32 gradients in
        RAM for units whose state streams from NVMe; both join the budget. Without a gradient
        left on NVMe, the transfer worker's `grad_slot` is not needed."""
        room = max(0, host_cap(config) - others)
        tiers = [unit.optimizer_tier for unit in self.units]
        leftover = plan_leftover_ram(
            [unit.optimizer_numel for unit in self.units],
            tiers,
            room=room,
            speculate=speculate,
            speculation_cap=parse_size(config.offload.speculation_memory),
            gradient_cap=parse_size(config.offload.gradient_memory),
            state=self.state,
            on_device=[unit.steps_on_device for unit in self.units],
        )
        self.speculating = leftover.speculating
        for unit, in_ram in zip(self.units, leftover.gradients_in_ram):
            unit.gradient_in_ram = in_ram
        if leftover.spare_bytes:
            self.budget["spare_state"] = leftover.spare_bytes
        if leftover.gradient_bytes:
            self.budget["gradient"] = leftover.gradient_bytes
        if self.streamed_units and all(unit.gradient_in_ram for unit in self.streamed_units):
            del self.budget["grad_slot"]
        if speculate:
            logger.info(
                "offload: overlap %s: %d of %d units (of %d with their state in RAM) step speculatively during "
                "backward (%s of spare state in RAM, %s was free for it); the rest step once the global "
                "gradient norm is known",
                config.overlap,
                sum(leftover.speculating),
                len(self.units),
                sum(tier is OptimizerTier.HOST for tier in tiers),
                format_bytes(leftover.spare_bytes),
                format_bytes(room),
            )
        if self.streamed_units:
            logger.info(
                "offload: %d of %d units with their optimizer state on NVMe keep their fp32 gradient in RAM "
                "(%s, %s was free for it); the step reads and writes only their master and moments",
                sum(leftover.gradients_in_ram),
                len(self.streamed_units),
                format_bytes(leftover.gradient_bytes),
                format_bytes(room - leftover.spare_bytes),
            )

    def _allocate_host(self) -> None:
        largest = self.largest_shard
        for unit, speculating in zip(self.units, self.speculating):
            if unit.optimizer_tier is OptimizerTier.DEVICE:
                # on the accelerator, stepped there (offload.optimizer.device_adam)
                for kind in STATE_KINDS:
                    numel, dtype = self.codec.storage(kind, unit.optimizer_numel)
                    unit.resident_state[kind] = torch.empty(numel, dtype=dtype, device=self.device)
                nbytes = sum(t.numel() * t.element_size() for t in unit.resident_state.values())
                self.ledger.allocate("device", nbytes, "optimizer_state")
                self._device_state_bytes += nbytes
            elif unit.optimizer_tier is OptimizerTier.HOST:
                for kind in STATE_KINDS:
                    numel, dtype = self.codec.storage(kind, unit.optimizer_numel)
                    if unit.optimizer_numel:
                        unit.resident_state[kind] = self.pool.alloc(numel, dtype, category="optimizer_state")
                    else:  # only frozen params in this shard: nothing to hold (not even a page)
                        unit.resident_state[kind] = torch.empty(0, dtype=dtype)
                if speculating:
                    for kind in STEPPED_KINDS:
                        # pageable: only the CPU Adam reads and writes it, never a copy to the device
                        numel, dtype = self.codec.storage(kind, unit.optimizer_numel)
                        unit.spare_state[kind] = self.pool.alloc(numel, dtype, category="spare_state", pin=False)
            elif unit.gradient_in_ram:
                # an NVMe-streamed unit's gradient, kept in RAM (_plan_gradients): the transfer
                # worker adds into it, the step reads it in place of a slot's grad32
                unit.resident_state["grad32"] = self.pool.alloc(
                    unit.optimizer_numel, self.codec.grad_dtype, category="gradient", pin=False
                )
        self._slots: list[OptimizerSlot] = []
        if self.streamed_units:
            self._slots = [self._allocate_slot(self.slot_shape.piece) for _ in range(self.slot_shape.count)]
            logger.info(
                "offload: the optimizer state on NVMe streams through %d slots of %s elements (%s of RAM; "
                "offload.buffer_count, offload.sub_group_size)",
                self.slot_shape.count,
                f"{self.slot_shape.piece:,}",
                format_bytes(self.budget["optimizer_slots"]),
            )
            if "grad_slot" in self.budget:
                self._grad_slot = self.pool.alloc(self.slot_shape.piece, self.codec.grad_dtype, category="grad_slot")
        if "param16" in self.budget:
            for unit in self.units:
                unit.param16 = self.pool.alloc(unit.shard_numel, self.compute_dtype, category="param16")
        # the 16-bit weights' home (storage.param16): their swap file through a staging ring
        # (param nvme), or the host copy just made (cpu, none on CUDA) or none (none on the CPU)
        self._param16: Param16Home
        if self.param_tier is ParamTier.NVME:
            count = self.prefetch_depth + 2
            staging = [self.pool.alloc(largest, self.compute_dtype, category="param_staging") for _ in range(count)]
            self._param16 = NvmeParam16(staging, self._require_swap)
        else:
            self._param16 = HostParam16()
        if "grad_staging" in self.budget:
            self._grad_staging = BufferRing(
                [self.pool.alloc(largest, self.compute_dtype, category="grad_staging") for _ in range(2)]
            )

    def _allocate_slot(self, numel: int) -> OptimizerSlot:
        """One slot: the buffers of STATE_KINDS for `numel` elements each (one piece, in each
        kind's stored form: `codec.storage`), allocated in that order."""
        master, exp_avg, exp_avg_sq, grad32 = (
            self.pool.alloc(*self.codec.storage(kind, numel), category="optimizer_slots") for kind in STATE_KINDS
        )
        return OptimizerSlot(master, exp_avg, exp_avg_sq, grad32, stored_numel=self.codec.storage_numel)

    def _host_empty(self, kind: str, numel: int) -> torch.Tensor:
        """An uninitialised host tensor for `numel` elements of `kind` in its stored form."""
        stored, dtype = self.codec.storage(kind, numel)
        return torch.empty(stored, dtype=dtype)

    def _require_swap(self) -> SwapStore:
        """The swap store, for an operation on NVMe-resident state (a streamed optimizer tier or
        param tier nvme): __init__ makes it whenever some unit has such state, and only close()
        drops it."""
        assert self.swap is not None, "no swap store: no unit's state is on NVMe"
        return self.swap

    @property
    def compute_bytes(self) -> int:
        return torch.empty(0, dtype=self.compute_dtype).element_size()

    # ---- start --------------------------------------------------------------------------
    def initialise(self, unit: UnitState, shard_values: torch.Tensor) -> None:
        """Stores the unit's initial state from this rank's fp32 shard of its weights: master =
        their trainable part, moments = 0, 16-bit = all of them cast. Called once per unit, at
        start, on the buffers `_allocate_host` just made."""
        master_values = shard_values[: unit.optimizer_numel]
        if not unit.optimizer_tier.streamed:
            unit.resident_state["master"].copy_(master_values)
            if unit.optimizer_tier is OptimizerTier.DEVICE:
                for kind in ("exp_avg", "exp_avg_sq", "grad32"):
                    unit.resident_state[kind].zero_()
            # host buffers come zero-filled from the pool (fresh mappings): zeroing them again
            # was a third of start-up (7.9 GB of memset at 0.66B params, 81 GB at 7B)
        else:
            # only the master is written: the moments and the fp32 gradient start at zero, and a
            # swap file never written reads as zeros without touching the disk (at 3B params:
            # 12 GB of start-up writes instead of 48 GB)
            swap = self._require_swap()
            slot = self._slots[0]
            for piece, (start, end) in enumerate(unit.state_pieces):
                views = slot.views(end - start)
                views["master"].copy_(master_values[start:end])
                for kind in unit.swap_kinds:
                    buffer = views[kind]
                    name = unit.swap_name(kind, piece)
                    if kind != "master":
                        if swap.never_written(name):
                            continue
                        buffer.zero_()
                    slot.pending_writes.append(swap.write_from(name, buffer))
                slot.wait_writes()
        self.store_param16_values(unit, shard_values)

    def store_param16_values(self, unit: UnitState, values32: torch.Tensor) -> None:
        """The 16-bit home copy of `values32`, this rank's whole shard (used at start and after
        loading a checkpoint); with param nvme written to its file and waited for."""
        self._param16.store_values(unit, values32)

    # ---- optimizer slots (optimizer: nvme; optimizer worker only) --------------------------
    def _load_piece(
        self, unit: UnitState, piece: int, slot: OptimizerSlot, kinds: tuple[str, ...], *, urgent: bool
    ) -> list[SwapHandle]:
        """Starts reading those of `kinds` that the unit keeps in swap files, of one piece, into
        `slot`. `urgent`: a stream's read, which the step (and the forward behind it) waits on,
        goes ahead of the state writes queued before it; a prefetch's does not (AioEngine)."""
        swap = self._require_swap()
        start, end = unit.state_pieces[piece]
        views = slot.views(end - start)
        return [
            swap.read_into(unit.swap_name(kind, piece), views[kind], urgent=urgent) for kind in unit.swap_kinds if kind in kinds
        ]

    @staticmethod
    def _streamed_pieces(units: list[UnitState]) -> list[tuple[UnitState, int]]:
        """Every piece a stream over `units` reads into a slot, in order: (unit, its piece index)."""
        return [(unit, j) for unit in units if unit.optimizer_tier.streamed for j in range(len(unit.state_pieces))]

    def prefetch_optimizer_states(self, units: list[UnitState]) -> None:
        """Optimizer worker, while the window's last backward computes: starts reading the master
        and moments of the first pieces a stream over `units` (the next step, in its order) will
        read, one per slot, so that the step finds them there. Never the gradient: backward is
        still writing it. The state read does not change before the step (only a step or a
        checkpoint load writes it, and the load drops these reads first). Best effort: a piece whose
        read failed is read again by the step (a lasting error is met there)."""
        with self._slots_lock:
            self._settle_unsettled()
            wanted = self._streamed_pieces(units)[: len(self._slots)]
            if [(unit, j) for unit, j, _ in self._prefetched] == wanted:
                return  # already read ahead, by the last step's end (_wait_writes_then_prefetch)
            self._drop_prefetch()
            self._prefetch_pieces(wanted, range(len(wanted)))

    def _prefetch_pieces(self, wanted: list[tuple[UnitState, int]], positions: Iterable[int]) -> None:
        """Reads the master and moments of `wanted[p]` into the slot of position p for each p of
        `positions` (in order, after `_prefetched`'s), once the slot's writes are done. Best
        effort, as `prefetch_optimizer_states`. Under _slots_lock."""
        try:
            for position in positions:
                unit, j = wanted[position]
                slot = self._slot_at(position)
                slot.wait_writes()
                self._prefetched.append((unit, j, self._load_piece(unit, j, slot, STEPPED_KINDS, urgent=False)))
        except Exception:
            logger.debug("offload: prefetching the next step's optimizer state failed", exc_info=True)
            self._drop_prefetch()

    def _drop_prefetch(self) -> None:
        """Waits out the prefetched reads (their slots are about to be used otherwise) and forgets
        them; a failed one is the next reader's to meet. Under _slots_lock."""
        prefetched, self._prefetched = self._prefetched, []
        for _, _, handles in prefetched:
            _wait_quietly(handles)

    def stream_optimizer_states(
        self,
        units: list[UnitState],
        *,
        include_grad: bool,
        timings: dict[str, float] | None = None,
        prefetch_next: bool = False,
        leave_writes: bool = False,
    ) -> Generator[StatePiece, None, None]:
        """Yields each unit's optimizer state in order, piece by piece: a resident unit (host or
        device) as one piece of its own buffers (slot None); an NVMe one as the pieces of
        `state_pieces`, piece i read into the slot of position i (`_slot_at`) while piece i + 1
        is already being read, a slot refilled only after its queued writes
        (`store_optimizer_state`) completed. The consumer may modify the views and queue writes
        before asking for the next piece. `timings`: seconds in `wait_read` and `wait_write`.
        Once every piece was consumed the stream's end waits for the slots' writes, oldest
        first, and with `prefetch_next` (the next step streams the same pieces) reads the next
        stream's first pieces into the slots as they free; `leave_writes` leaves that end to
        `settle_stream` or the next user of the slots, so the consumer goes on meanwhile."""
        if not any(unit.optimizer_tier.streamed for unit in units):
            for unit in units:
                yield StatePiece(unit, 0, 0, unit.resident_state, None, last=True)
            return
        with self._slots_lock:
            self._settle_unsettled()
            yield from self._stream_through_slots(units, include_grad, timings, prefetch_next, leave_writes)

    def settle_stream(self) -> None:
        """The end of a stream consumed with `leave_writes`, if not done yet (a write failure raised)."""
        with self._slots_lock:
            self._settle_unsettled()

    def _settle_unsettled(self) -> None:  # under _slots_lock, before any other use of the slots
        if self._unsettled is not None:
            wanted, self._unsettled = self._unsettled, None
            self._wait_writes_then_prefetch(wanted)

    def stream_optimizer_states_on_host(self, units: list[UnitState]) -> Iterator[StatePiece]:
        """As `stream_optimizer_states` (without the gradient), with the states of DEVICE-tier
        units copied to the host, one unit at a time (a checkpoint's save writes them as bytes)."""
        for piece in self.stream_optimizer_states(units, include_grad=False):
            if piece.unit.optimizer_tier is OptimizerTier.DEVICE:
                views = {kind: tensor.to("cpu") for kind, tensor in piece.views.items() if kind != "grad32"}
                piece = StatePiece(piece.unit, 0, 0, views, None, last=True)
            yield piece

    def _slot_at(self, position: int) -> OptimizerSlot:
        """The slot of a stream's piece `position` (and of its prefetched read). Under _slots_lock."""
        return self._slots[(self._first_slot + position) % len(self._slots)]

    def _stream_through_slots(
        self,
        all_units: list[UnitState],
        include_grad: bool,
        timings: dict[str, float] | None,
        prefetch_next: bool,
        leave_writes: bool,
    ) -> Iterator[StatePiece]:
        slots = self._slots
        pieces = self._streamed_pieces(all_units)
        reads: dict[int, list[SwapHandle]] = {}

        def timed(key: str, started: float) -> None:
            if timings is not None:
                timings[key] += time.perf_counter() - started

        # the reads ahead of pieces 0, 1, ... that are this stream's own are waited for as the
        # stream reaches each (not all before the first: the first pieces' writes then go out while
        # the later ones read); the others are waited out now (their slots are about to be refilled)
        started = time.perf_counter()
        prefetched, self._prefetched = self._prefetched, []
        own: dict[int, list[SwapHandle]] = {}
        for position, (unit, j, handles) in enumerate(prefetched):
            if position < len(pieces) and pieces[position] == (unit, j):
                own[position] = handles
            else:
                _wait_quietly(handles)
        timed("wait_read", started)

        kinds = STATE_KINDS if include_grad else STEPPED_KINDS

        def start_read(i: int) -> None:
            slot = self._slot_at(i)
            unit, j = pieces[i]
            if i in own:
                # prefetched (master and moments); the gradient, when wanted, is read now
                reads[i] = self._load_piece(unit, j, slot, ("grad32",) if include_grad else (), urgent=True)
                return
            started = time.perf_counter()
            slot.wait_writes()
            timed("wait_write", started)
            reads[i] = self._load_piece(unit, j, slot, kinds, urgent=True)

        consumed = False
        try:
            if pieces:
                start_read(0)
            i = 0
            for unit in all_units:
                if not unit.optimizer_tier.streamed:
                    yield StatePiece(unit, 0, 0, unit.resident_state, None, last=True)
                    continue
                for j, (start, end) in enumerate(unit.state_pieces):
                    if i + 1 < len(pieces):
                        start_read(i + 1)
                    started = time.perf_counter()
                    prefetched_reads = own.pop(i, None)
                    if prefetched_reads is not None and not _wait_quietly(prefetched_reads):
                        logger.warning(
                            "offload: reading unit %s's optimizer state ahead of the step failed; it is read again",
                            unit.spec.name,
                        )
                        reads[i] += self._load_piece(unit, j, self._slot_at(i), STEPPED_KINDS, urgent=True)
                    for handle in reads.pop(i):
                        handle.wait()
                    timed("wait_read", started)
                    slot = self._slot_at(i)
                    views = slot.views(end - start)
                    if unit.gradient_in_ram:
                        views["grad32"] = unit.resident_state["grad32"][start:end]
                    yield StatePiece(unit, j, start, views, slot, last=j == len(unit.state_pieces) - 1)
                    i += 1
            consumed = True
        finally:
            # reads still in flight when the consumer stops early, or fails, finish before their
            # slots can be reused; an error already propagating is the one raised
            for pending in (*reads.values(), *own.values()):
                _wait_quietly(pending)
            self._first_slot = (self._first_slot + len(pieces)) % len(slots)
            # the slots' writes waited for now, or by settle_stream (leave_writes); a stream
            # consumed to its end reads the next one's first pieces ahead as they free
            self._unsettled = pieces[: len(slots)] if consumed and prefetch_next else []
            if not (consumed and leave_writes):
                self._settle_unsettled()

    def _claim_slots(self) -> None:
        """Before a use of the slots other than a stream: a stream's end left to settle is done,
        and the reads ahead are waited out and forgotten. Under _slots_lock."""
        self._settle_unsettled()
        self._drop_prefetch()

    def _wait_writes_then_prefetch(self, wanted: list[tuple[UnitState, int]]) -> None:
        """The end of a stream: waits for every slot's writes, oldest first, reading
        `wanted[position]` into the slot of `position` as soon as it is free (beside the later
        writes, on a drive that does both at once). The first write failure is raised once every
        slot's writes are done, with no read left in flight. Under _slots_lock."""
        failure: BaseException | None = None
        for position in range(len(self._slots)):
            try:
                self._slot_at(position).wait_writes()
            except Exception as error:  # noqa: BLE001 (raised once every slot is waited for)
                failure = failure or error
            if failure is None and position < len(wanted) and len(self._prefetched) == position:
                self._prefetch_pieces(wanted, [position])
        if failure is not None:
            self._drop_prefetch()
            raise failure

    def overwrite_optimizer_states(self, units: list[UnitState]) -> Iterator[StatePiece]:
        """Yields each unit's master, exp_avg and exp_avg_sq piece by piece (views without the
        gradient), for the caller to fill completely (a checkpoint load); what it wrote is
        stored on the unit's tier before the next piece's slot is reused. Nothing is read first."""
        with self._slots_lock:
            self._claim_slots()
            try:
                streamed = 0
                for unit in units:
                    if unit.optimizer_tier is OptimizerTier.DEVICE:
                        # filled on the host (a checkpoint reads into host memory), then copied over
                        staged = {kind: self._host_empty(kind, unit.optimizer_numel) for kind in STEPPED_KINDS}
                        yield StatePiece(unit, 0, 0, staged, None, last=True)
                        for kind, values in staged.items():
                            unit.resident_state[kind].copy_(values)
                        continue
                    if not unit.optimizer_tier.streamed:
                        views = {kind: unit.resident_state[kind] for kind in STATE_KINDS if kind != "grad32"}
                        yield StatePiece(unit, 0, 0, views, None, last=True)
                        continue
                    for j, (start, end) in enumerate(unit.state_pieces):
                        slot = self._slots[streamed % len(self._slots)]
                        streamed += 1
                        slot.wait_writes()
                        views = slot.views(end - start)
                        del views["grad32"]
                        piece = StatePiece(unit, j, start, views, slot, last=j == len(unit.state_pieces) - 1)
                        yield piece
                        self.store_optimizer_state(piece)
            finally:
                for slot in self._slots:
                    slot.wait_writes()

    # ---- the state as fp32 numbers (checkpoints, engine.optimizer's state dict) -----------------
    def fp32_states(self, units: list[UnitState]) -> Iterator[StatePiece]:
        """`stream_optimizer_states_on_host` with the moments as fp32 values (decoded chunk by
        chunk from a compact precision: StateCodec.fp32_pieces); read only."""
        return self.codec.fp32_pieces(self.stream_optimizer_states_on_host(units), decode=True, encode_steps=None)

    def overwrite_fp32_states(
        self, units: list[UnitState], steps: Sequence[int] | Mapping[int, int], tally: RoundingTally | None = None
    ) -> Iterator[StatePiece]:
        """`overwrite_optimizer_states` with fp32 moments for the caller to fill: what it wrote is
        encoded into the stored form before the piece is stored, rounded with the key of
        `steps[unit.index]` (the step count of the state written), and measured into `tally`
        when given (StateCodec.fp32_pieces)."""
        return self.codec.fp32_pieces(self.overwrite_optimizer_states(units), decode=False, encode_steps=steps, tally=tally)

    def update_fp32_moments(self, units: list[UnitState], steps: Sequence[int] | Mapping[int, int]) -> Iterator[StatePiece]:
        """Each unit's state piece by piece, moments as fp32 values the caller may change (the
        master is only read): what it leaves is encoded back, rounded with the key of
        `steps[unit.index]`, and a streamed piece stored before the next is read."""
        source = self.stream_optimizer_states(units, include_grad=False)
        return self.codec.fp32_pieces(self._stored_after_use(source), decode=True, encode_steps=steps)

    def _stored_after_use(self, pieces: Iterator[StatePiece]) -> Iterator[StatePiece]:
        """`pieces`, each streamed one stored back once the consumer asks for the next."""
        for piece in pieces:
            yield piece
            if piece.slot is not None:
                self.store_optimizer_state(piece)

    def store_optimizer_state(self, piece: StatePiece, include_grad: bool = False) -> None:
        """Queues the writes of a streamed piece's states from its slot back to their swap files."""
        assert piece.slot is not None, "only a piece read into a slot is stored back"
        swap = self._require_swap()
        views = piece.slot.views(piece.end - piece.start)
        for kind in piece.unit.swap_kinds:
            if kind == "grad32" and not include_grad:
                continue
            piece.slot.pending_writes.append(swap.write_from(piece.unit.swap_name(kind, piece.index), views[kind]))

    # ---- gradients (transfer worker only) --------------------------------------------------
    def accumulate_grad(
        self, unit: UnitState, pieces: list[tuple[int, torch.Tensor]], first_in_window: bool, compute_norm: bool
    ) -> float | None:
        """Adds this micro-batch's gradient into the fp32 gradient; returns the squared norm of the
        accumulated gradient when `compute_norm`, else None: the same bits whether the gradient
        is resident or streams in pieces (grad_sum.squared_norm carries it piece to piece).

        `pieces` are (offset in the shard, 1-D gradient) pairs, all within the shard's trainable
        part (`optimizer_numel`); the elements they do not cover had no gradient in this
        micro-batch (zero). An NVMe-resident gradient is read, added to and written back one
        piece of `state_pieces` at a time, through `_grad_slot`."""
        pieces = sorted(pieces, key=lambda piece: piece[0])
        if not first_in_window:
            self.refuse_gradient_sum(f"a second gradient landed in unit {unit.spec.name}'s window")
        if "grad32" not in unit.swap_kinds:
            return accumulate_gradient(unit.resident_state["grad32"], 0, pieces, first_in_window, 0.0 if compute_norm else None)
        swap = self._require_swap()
        norm: float | None = 0.0 if compute_norm else None
        for j, (start, end) in enumerate(unit.state_pieces):
            target = self._grad_slot[: end - start]
            name = unit.swap_name("grad32", j)
            # urgent: backward waits for its gradients' landings (at most GRADS_IN_FLIGHT units)
            if not first_in_window:
                swap.read_into(name, target, urgent=True).wait()
            norm = accumulate_gradient(target, start, pieces, first_in_window, norm)
            swap.write_from(name, target, urgent=True).wait()
        return norm

    def refuse_gradient_sum(self, what: str) -> None:
        """Raises, saying `what` happened, when gradients are kept in their 16-bit arrival dtype
        (one micro-batch per step), where a sum would round; returns with fp32 gradients. The
        window refuses a second backward before a step; a landing checks again."""
        if self.codec.grad_dtype == torch.float32:
            return
        dtype = str(self.codec.grad_dtype).replace("torch.", "")
        raise OffloadError(
            f"{what}: with gradient_accumulation_steps 1 offload keeps each gradient in {dtype}, where a sum would "
            "round. Call step() after every backward, set gradient_accumulation_steps to the backward calls per step "
            '(accumulated in fp32), or set optimizer.gradient_precision to "fp32"'
        )

    def grad_sq_norm(self, unit: UnitState) -> float:
        """Squared norm of the stored fp32 gradient (for a unit whose window ended early)."""
        if "grad32" not in unit.swap_kinds:
            return squared_norm(unit.resident_state["grad32"])
        norm = 0.0
        for j, (start, end) in enumerate(unit.state_pieces):
            target = self._grad_slot[: end - start]
            self._require_swap().read_into(unit.swap_name("grad32", j), target).wait()
            norm = squared_norm(target, norm)
        return norm

    def read_grad(self, unit: UnitState) -> Iterator[tuple[int, torch.Tensor]]:
        """The stored fp32 gradient as (offset in the shard, values) pieces: the resident buffer
        whole, or each NVMe piece read into the gradient slot (valid until the next piece is
        asked for). Main thread, with the gradient transfers waited for (the slot is theirs)."""
        if "grad32" not in unit.swap_kinds:
            yield 0, unit.resident_state["grad32"]
            return
        for j, (start, end) in enumerate(unit.state_pieces):
            target = self._grad_slot[: end - start]
            self._require_swap().read_into(unit.swap_name("grad32", j), target).wait()
            yield start, target

    # ---- 16-bit weights (their home: storage.param16) ---------------------------------------
    def read_param16(self, unit: UnitState) -> tuple[torch.Tensor, bool]:
        """The unit's 16-bit shard on the host (a fetch on the transfer worker, a weights read on
        the main thread): (tensor, whether it is a staging buffer to give back with
        `give_back_staging`). With param nvme, the buffer a step still offers (its write-back in
        flight), else the file read into a staging buffer."""
        return self._param16.read(unit)

    def give_back_staging(self, tensor: torch.Tensor) -> None:
        """A staging buffer `read_param16` returned, or a `param16_target` not published, is free again."""
        self._param16.give_back(tensor)

    def param16_target(self, unit: UnitState) -> torch.Tensor:
        """Optimizer worker: where a step writes the unit's new 16-bit weights (its whole shard).
        The host home (param cpu; none on CUDA, the pinned source of the device copy), or with
        param nvme a staging buffer taken from the ring (blocking while all are in use), which
        `publish_param16` hands on, or `give_back_staging` returns if the step fails first."""
        return self._param16.target(unit)

    def read_param16_into(self, unit: UnitState, out: torch.Tensor) -> None:
        """Optimizer worker: fills `out`, a `param16_target`, with the unit's current 16-bit
        weights (a step that leaves some params unchanged writes the shard back whole): with param
        nvme read from the unit's file, waited for; the host home already holds them."""
        self._param16.read_into(unit, out)

    def publish_param16(self, unit: UnitState, out: torch.Tensor) -> Param16WriteBack | None:
        """Optimizer worker, after the step wrote `out` (a `param16_target`): sends the new
        weights home. With param nvme the write to the unit's file is started and `out` offered to
        fetches while it is in flight; the write-back returned is the caller's to `wait` (settled
        before the worker takes another target: one write behind), which gives `out` back. A
        write that cannot start gives `out` back and raises. None when `out` is the home."""
        return self._param16.publish(unit, out)

    # ---- masters (main thread, the steps in flight waited for) -----------------------------
    def read_master(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's fp32 master shard of `unit` (its `optimizer_numel` elements),
        wherever it lives: its resident buffer (host or device), or its swap files read piece by
        piece through slot 0 (holding the slots; the next step's prefetched pieces are dropped
        first, as by anything else that uses the slots: slot 0 no longer holds its piece)."""
        if not unit.optimizer_tier.streamed:
            return unit.resident_state["master"].to("cpu", copy=True)
        shard = torch.empty(unit.optimizer_numel, dtype=torch.float32)
        swap = self._require_swap()
        with self._slots_lock:
            self._claim_slots()
            buffer = self._slots[0].master
            for piece, (start, end) in enumerate(unit.state_pieces):
                if end > start:
                    swap.read_into(unit.swap_name("master", piece), buffer[: end - start]).wait()
                    shard[start:end].copy_(buffer[: end - start])
        return shard

    # ---- gradient staging (transfer worker) --------------------------------------------------
    @contextmanager
    def grad_staging_buffer(self) -> Iterator[torch.Tensor]:
        """A host buffer of the largest shard's size in the compute dtype, lent for one gradient's
        copy off a device with its own memory (two in the ring; blocks while both are lent),
        given back when the block ends, however it ends. The caller waits for the copy into it
        before the block ends."""
        staging = self._grad_staging.take()
        try:
            yield staging
        finally:
            self._grad_staging.give(staging)

    # ---- swap operations ---------------------------------------------------------------------
    def settle(self) -> list[BaseException]:
        """Completes every swap operation in flight and returns the failures no one has been told
        of yet (SwapStore.settle); [] when no state is on NVMe."""
        if self.swap is None:
            return []
        return self.swap.settle()

    def close(self) -> None:
        if self._device_state_bytes:
            self.ledger.release("device", self._device_state_bytes, "optimizer_state")
            self._device_state_bytes = 0
            for unit in self.units:
                if unit.optimizer_tier is OptimizerTier.DEVICE:
                    unit.resident_state.clear()
        if self._nvme_bytes_recorded:
            self.ledger.release("nvme", self._nvme_bytes_recorded, "swap")
            self._nvme_bytes_recorded = 0
        if self.swap is not None:
            with self._slots_lock:
                self._unsettled = None  # the swap store's close completes the writes
                self._drop_prefetch()
            self.swap.close()
            self.swap = None
        self.pool.close()


def _wait_quietly(handles: list[SwapHandle]) -> bool:
    """Waits for reads that may be abandoned; returns whether all succeeded. A failure is logged,
    not raised: the piece is read again by whoever needs it (and a lasting error is met there),
    or an error already propagating is the one to report."""
    succeeded = True
    for handle in handles:
        try:
            handle.wait()
        except Exception:
            succeeded = False
            logger.debug("offload: a swap read that may be abandoned failed", exc_info=True)
    return succeeded


def default_run_name() -> str:
    """A run name no other run on any machine or container shares (a pid alone repeats after a
    container restart, and two engines of one process share it); rank 0's is broadcast."""
    import uuid

    return f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
