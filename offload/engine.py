"""The Engine: forward, backward and step over a model cut into units (see DESIGN.md).

Threads, and what each owns:
- the main thread runs forward and backward, every hook, every collective, and all residency
  bookkeeping (acquire / release / storage resize);
- the transfer worker (one thread) runs fetches of 16-bit weights to the device and the
  gradient path off the device (copy, accumulate into the fp32 gradient, squared norm), in
  the order they were submitted;
- the optimizer worker (one thread) runs `UnitStepper.run`; the C++ Adam inside it uses its
  own pool of threads. Each unit's `step_done` event tells fetches and forwards when its new
  weights are ready.

A gradient window (the micro-batches of one optimizer step) ends at the boundary backward;
`step()` then waits for the transfer worker, reduces the squared norms, and starts the step:
`overlap: none` waits for it; `forward` lets it run while the next forward computes (unit k's
pre-forward waits for unit k only); `backward` already stepped each unit as its gradients
became final during the boundary backward.
"""
from __future__ import annotations

import collections
import concurrent.futures
import enum
import functools
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from offload.collectives import Collectives
from offload.config import Config, load_config
from offload.device import Device
from offload.errors import ConfigError, NonFiniteError, OffloadError
from offload.memory import TierLedger
from offload.materialize import has_meta_state, mapped_zeros, materialize_unit_params
from offload.optim import kernels
from offload.precision import DynamicLossScaler, gradient_multiplier
from offload.prefetch import ExecutionOrder, step_order
from offload.rank_order import MISMATCH_HINT, Op, ReduceOrder
from offload.rank_order import describe as describe_op
from offload.residency import ExternalParamReads, Residency, tensors_in
from offload.state import UnitState
from offload.stepper import StepHyper, UnitStepper
from offload.tiers import TierStore, default_run_name
from offload.units import build_units, plan_flat_layout

logger = logging.getLogger(__name__)


class EntryKind(enum.Enum):
    """Who owns the hold a unit's forward takes."""

    # the model's forward: given back at the unit's post-forward
    FORWARD = "forward"
    # a forward re-run inside backward (activation checkpointing): a backward hold, given back
    # when the unit's gradients are final or at the end of backward, whether or not the
    # recompute ran to its end
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Entry:
    """A unit whose forward is running (the root is unit 0)."""

    unit: int
    kind: EntryKind


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Units whose gradients may sit on the device waiting for the transfer worker at once.
MAX_GRADS_IN_FLIGHT = 2
TIMING_KEYS = ("forward", "backward", "step", "wait_fetch", "wait_step")


def initialize(model: nn.Module, config: Config | dict | str | os.PathLike | None = None, **kwargs) -> "Engine":
    """Wraps `model` for offloaded training; see `Engine`."""
    return Engine(model, config, **kwargs)


class Engine:
    """Trains `model` with its states placed on device / host / NVMe as `config` says.

    `engine(*args, **kwargs)` runs the model's forward (tensor inputs are moved to the device and
    floating-point ones cast to the compute dtype); `engine.backward(loss)` runs backward
    (the loss is divided by gradient_accumulation_steps, and multiplied by the loss scale in
    fp16); `engine.step()` updates the weights at the end of each accumulation window and
    returns True when it did.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config | dict | str | os.PathLike | None = None,
        *,
        process_group=None,
        device: torch.device | str | None = None,
        run_name: str | None = None,
        strict: bool = True,
    ) -> None:
        # strict=False: a DeepSpeed / accelerate key whose meaning cannot be honoured is dropped
        # with a warning instead of refused
        self.config = load_config(config, strict=strict)
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"offload.initialize needs an nn.Module, got {type(model).__name__}")
        self.model = model
        # the process group first: started from torchrun's environment if needed (which also
        # picks this rank's CUDA device before Device reads the current one)
        self.collectives = Collectives(process_group, device=device)
        self.device = Device(device)
        self.compute_dtype = COMPUTE_DTYPES[self.config.precision]
        self.ledger = TierLedger()
        self._closed = False
        kernels.set_num_threads(self.config.optimizer.threads or len(os.sched_getaffinity(0)))

        world, rank = self.collectives.world_size, self.collectives.rank
        specs = build_units(model, self.config.wrap.module_classes, self.config.wrap.min_params)
        self.units = [UnitState(spec, plan_flat_layout([p.numel() for p in spec.params], world)) for spec in specs]
        self.unit_of_param = {id(p): unit.index for unit in self.units for p in unit.spec.params}
        self._trainable = [{i for i, p in enumerate(unit.spec.params) if p.requires_grad} for unit in self.units]
        logger.info(
            "offload: %d units (largest %.1fM params), precision %s, param on %s, optimizer on %s, overlap %s, rank %d/%d",
            len(self.units),
            max(u.spec.numel for u in self.units) / 1e6,
            self.config.precision,
            self.config.offload.param,
            self.config.offload.optimizer,
            self.config.overlap,
            rank,
            world,
        )

        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.store = TierStore(
            self.units,
            self.config,
            compute_dtype=self.compute_dtype,
            pin=self.device.pin_host_memory,
            staged_device_copies=self.device.is_cuda,
            ledger=self.ledger,
            rank=rank,
            local_rank=local_rank,
            # one run directory for all ranks (rank 0's name), each rank in its rank<r>/ below it
            run_name=self.collectives.broadcast_object(run_name or default_run_name(), what="the swap run name"),
        )
        self.transfer = ThreadPoolExecutor(1, thread_name_prefix="offload-transfer")
        self.optimizer_worker = ThreadPoolExecutor(1, thread_name_prefix="offload-step")
        self.residency = Residency(
            self.units,
            device=self.device,
            store=self.store,
            transfer=self.transfer,
            collectives=self.collectives,
            ledger=self.ledger,
            param_tier=self.config.offload.param,
            compute_dtype=self.compute_dtype,
            agree_before=self._agree_before_collective,
        )
        self.stepper = UnitStepper(self.store, self.device, rank)
        try:
            for unit in self.units:
                self._adopt(unit)
            self._move_buffers()
        except BaseException:
            # nothing half-built outlives a failed start: threads stop, host buffers and swap files go
            self.transfer.shutdown(wait=True)
            self.optimizer_worker.shutdown(wait=True)
            self.store.close()
            raise

        self.scaler = DynamicLossScaler(
            scale=self.config.loss_scale.initial if self.config.precision == "fp16" else 1.0,
            growth_interval=self.config.loss_scale.growth_interval,
            backoff_factor=self.config.loss_scale.backoff_factor,
            growth_factor=self.config.loss_scale.growth_factor,
            min_scale=self.config.loss_scale.min_scale,
        )
        self.lr = self.config.optimizer.lr
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken
        self.skipped_steps = 0  # fp16 overflows
        self.last_grad_norm: float | None = None
        self._stepped_at_micro = -1  # micro_steps at the last step() that ended a window
        self.forward_order = ExecutionOrder()
        self.backward_order = ExecutionOrder()
        self._phase = "idle"  # "forward" | "backward" | "idle"
        # units whose forward is running, innermost last, each with who owns its hold
        self._entered: list[Entry] = []
        self._external_holds: set[int] = set()
        # forward uses of each unit (with borrows and external reads) since the last backward,
        # and, with several ranks, the agreed order of this backward's reductions (rank_order.py)
        self._uses: collections.Counter[int] = collections.Counter()
        self._reduce_order: ReduceOrder | None = None
        self._agreement_width = max(1 + 2 * len(self.units), max(len(unit.spec.params) for unit in self.units))
        # param none with several ranks: a stepped unit's new shards are gathered at its next use
        self._gathers_after_step = not self.residency.offloaded and self.collectives.is_distributed
        self._root_holds_for_backward = 0
        self._boundary_backward = False
        self._grad_futures: list[Future] = []  # every gradient transfer of the window (errors)
        self._grads_in_flight: collections.deque[Future] = collections.deque()  # not yet known done
        self._step_future: Future | None = None
        self._backward_step_futures: list[Future] = []
        self._nonfinite_units: list[str] = []
        self._lock = threading.Lock()
        # seconds spent since the last `pop_timings()`, by phase; `wait_fetch` and `wait_step` are
        # the main thread's waits for weights to arrive and for the CPU step to finish
        self.timings: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        # Reads of a parameter outside its unit's forward are seen (and wait for the unit's
        # weights) when they could otherwise read freed storage (params offloaded), weights a
        # step is still writing (overlap forward), or a shard not yet gathered (several ranks).
        self._watch_external_reads = (
            self.residency.offloaded or self.config.overlap == "forward" or self.collectives.is_distributed
        )
        self._hooks = []
        self._register_hooks()

    # ---- construction ------------------------------------------------------------------
    def _adopt(self, unit: UnitState) -> None:
        """Moves the unit's params into its flat buffer and stores its initial state on the tiers."""
        layout = unit.layout
        rank = self.collectives.rank
        if has_meta_state(self.model, unit.spec):
            # a model built on the meta device gets real values one unit at a time, so the
            # whole fp32 model never exists in RAM at once
            materialize_unit_params(self.model, unit.spec)
        # its own mapping, unmapped on return (a heap block per unit would stay in the process)
        flat32 = mapped_zeros(layout.padded_numel, torch.float32)
        with torch.no_grad():
            for param, offset in zip(unit.spec.params, layout.offsets):
                flat32[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        # every rank starts from rank 0's weights, whatever seed each rank built its model with
        self.collectives.broadcast_host(flat32, src=0, what=f"initial weights of unit {unit.spec.name}")
        start, end = layout.shard_range(rank)
        self.store.initialise(unit, flat32[start:end])
        unit.device_flat = self.device.empty(layout.padded_numel, self.compute_dtype)
        self.ledger.allocate("device", layout.padded_numel * unit.device_flat.element_size(), "param")
        unit.device_flat.copy_(flat32)
        for param, offset in zip(unit.spec.params, layout.offsets):
            param.data = unit.device_flat[offset : offset + param.numel()].view(param.shape)
        unit.resident = True
        if self.residency.offloaded:
            self.residency.free(unit)

    def _move_buffers(self) -> None:
        """Module buffers (not parameters) follow the model to the device."""
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and buffer.device != self.device.torch_device:
                    setattr(module, name, buffer.to(self.device.torch_device))

    def _register_hooks(self) -> None:
        # post-forward hooks run even when the forward raises (always_call): an exception in a
        # unit's forward, or the early stop of a non-reentrant checkpoint recompute
        # (torch.utils.checkpoint's _StopRecomputationError), must give back what it took
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(self.model.register_forward_hook(self._root_post_forward, always_call=True))
        for unit in self.units[1:]:
            module = unit.spec.module
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._unit_pre_forward, unit.index)))
            self._hooks.append(
                module.register_forward_hook(functools.partial(self._unit_post_forward, unit.index), always_call=True)
            )
        for unit in self.units:
            for index, param in enumerate(unit.spec.params):
                if param.requires_grad:
                    hook = functools.partial(self._on_param_grad, unit.index, index)
                    self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    # ---- forward -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._check_open()
        args, kwargs = _prepare_inputs((args, kwargs), self.device.torch_device, self.compute_dtype)
        started = time.perf_counter()
        try:
            if not self._watch_external_reads:
                return self.model(*args, **kwargs)
            with ExternalParamReads(self.unit_of_param, self._is_active, self._hold_external):
                return self.model(*args, **kwargs)
        except BaseException:
            # what the always-called post-forward hooks could not unwind (a KeyboardInterrupt
            # is not an Exception, and skips them)
            self._abort_forward()
            raise
        finally:
            self.timings["forward"] += time.perf_counter() - started

    def _in_backward(self) -> bool:
        """Whether autograd is running a backward now: a forward seen now is a recompute."""
        return self._phase == "backward" or torch._C._current_graph_task_id() != -1

    def _is_active(self, unit_index: int) -> bool:
        if unit_index in self._external_holds:
            return True
        for entry in self._entered:
            if entry.unit == unit_index or unit_index in self.units[entry.unit].spec.borrows:
                return True
        return False

    def _hold_external(self, unit_index: int) -> None:
        """A param read outside its unit's forward: hold its unit until the backward is over."""
        logger.debug("offload: unit %s read outside its forward; held until the end of backward", self.units[unit_index].spec.name)
        self._external_holds.add(unit_index)
        self.residency.acquire(self.units[unit_index])
        if torch.is_grad_enabled():
            self._uses[unit_index] += 1

    def _raise_if_step_failed(self) -> None:
        future = self._step_future
        if future is not None and future.done() and future.exception() is not None:
            self._step_future = None
            raise OffloadError(f"offload: the optimizer step failed: {future.exception()}") from future.exception()

    def _enter_unit(self, unit: UnitState) -> None:
        started = time.perf_counter()
        waits_for_step = not unit.step_done.is_set()
        taken = []
        try:
            for borrowed in sorted(unit.spec.borrows):
                self.residency.acquire(self.units[borrowed])
                taken.append(borrowed)
            self.residency.acquire(unit)
        except BaseException:
            for borrowed in reversed(taken):
                self.residency.release(self.units[borrowed])
            raise
        self.timings["wait_step" if waits_for_step else "wait_fetch"] += time.perf_counter() - started
        self._raise_if_step_failed()

    def _leave_unit(self, unit: UnitState) -> None:
        self.residency.release(unit)
        for borrowed in sorted(unit.spec.borrows):
            self.residency.release(self.units[borrowed])

    def _begin_entry(self, index: int) -> Entry:
        """Pre-forward of unit `index` (the root is 0): takes its hold and records who owns it.

        In the model's forward the hold is the forward's, given back at post-forward. Inside a
        backward the forward is a recompute (activation checkpointing): its hold is a backward
        hold, given back when the unit's gradients are final or the backward ends, so a
        recompute that stops early (or raises) cannot keep the unit resident."""
        unit = self.units[index]
        kind = EntryKind.RECOMPUTE if self._in_backward() else EntryKind.FORWARD
        if kind is EntryKind.FORWARD:
            if self._phase == "idle" and index == 0:
                self._phase = "forward"
                self.forward_order.begin()
            if self._phase == "forward":
                self.forward_order.visit(index)
                self._prefetch_ahead(self.forward_order)
        self._enter_unit(unit)
        if kind is EntryKind.RECOMPUTE:
            unit.backward_holds += 1
        elif torch.is_grad_enabled():
            self._uses.update([index, *unit.spec.borrows])
        entry = Entry(index, kind)
        self._entered.append(entry)
        return entry

    def _end_entry(self, index: int) -> Entry | None:
        """Post-forward of unit `index`: pops its entry (None if its pre-forward never finished);
        the caller gives back its hold. Entries above it were abandoned by an exception that
        skipped their post-forward: their forward holds are given back here."""
        if not any(entry.unit == index for entry in self._entered):
            return None
        while True:
            entry = self._entered.pop()
            if entry.unit == index:
                return entry
            if entry.kind is EntryKind.FORWARD:
                self._leave_unit(self.units[entry.unit])

    def _abort_forward(self) -> None:
        """A forward failed: gives back every hold it still has; the next forward starts clean."""
        while self._entered and self._entered[-1].kind is EntryKind.FORWARD:
            self._leave_unit(self.units[self._entered.pop().unit])
        if self._phase == "forward":
            self.forward_order.abandon()
            self._phase = "idle"
        if not self._entered and not self._root_holds_for_backward:
            self._drop_external_holds()

    def _root_pre_forward(self, module, args):
        self._begin_entry(0)

    def _root_post_forward(self, module, args, output):
        entry = self._end_entry(0)
        if entry is None:
            return
        if entry.kind is EntryKind.RECOMPUTE:
            return  # a backward hold, given back at the end of backward
        if output is None:  # the forward raised
            self._leave_unit(self.units[0])
            self._abort_forward()
            return
        if self._phase == "forward":
            self.forward_order.end()
            self._phase = "idle"
        if self._gathers_after_step:
            self.residency.gather_stepped()
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output)):
            # the forward's hold on the root (embeddings, head) passes to its backward
            self._root_holds_for_backward += 1
            return
        self._leave_unit(self.units[0])
        if not self._entered and not self._root_holds_for_backward:
            self._drop_external_holds()

    def _unit_pre_forward(self, index: int, module, args):
        self._begin_entry(index)

    def _unit_post_forward(self, index: int, module, args, output):
        entry = self._end_entry(index)
        if entry is None:
            return
        if entry.kind is EntryKind.FORWARD:
            self._leave_unit(self.units[index])
        if output is None or not torch.is_grad_enabled():
            return
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            fired = [False]

            def before_backward(grad, unit_index=index):
                if not fired[0]:
                    fired[0] = True
                    self._pre_backward(unit_index)

            for tensor in tensors:
                tensor.register_hook(before_backward)

    def _prefetch_ahead(self, order: ExecutionOrder) -> None:
        for upcoming in order.upcoming(self.config.prefetch.depth):
            unit = self.units[upcoming]
            for borrowed in unit.spec.borrows:
                self.residency.prefetch(self.units[borrowed])
            self.residency.prefetch(unit)

    # ---- backward ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` / gradient_accumulation_steps (times the loss scale in fp16)."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise OffloadError("engine.backward needs the scalar loss tensor (e.g. out.loss)")
        if not loss.requires_grad:
            raise OffloadError("engine.backward: the loss does not require grad (was the forward run under torch.no_grad?)")
        # agreed over ranks: a rank skipping backward alone would leave the others in its collectives
        nonfinite = self.config.precision != "fp16" and not math.isfinite(float(loss.detach()))
        any_nonfinite = self._agree_on_backward(nonfinite)
        if any_nonfinite:
            bad_ranks = self.collectives.ranks_with(nonfinite, what="the non-finite loss check")
            self._reduce_order = None
            self._end_backward()
            where = ""
            if self.collectives.is_distributed:
                where = f" (not finite on rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))})"
            raise NonFiniteError(
                f"the loss is {float(loss.detach())}{where} at micro-step {self.micro_steps}: backward "
                "was not run and no state changed; check the data and the learning rate, or use precision 'fp16' "
                "whose overflow skips the step"
            )
        self._wait_step()
        self._boundary_backward = (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0
        scaled = loss.float() / self.config.gradient_accumulation_steps
        if self.config.precision == "fp16":
            scaled = scaled * self.scaler.scale
        self._phase = "backward"
        self.backward_order.begin()
        started = time.perf_counter()
        try:
            if self._reduce_order is not None:
                self._reduce_units(self._reduce_order.start())
            scaled.backward()
        finally:
            self._end_backward()
            self.timings["backward"] += time.perf_counter() - started
        self.micro_steps += 1

    def _agree_on_backward(self, nonfinite: bool) -> bool:
        """Several ranks: one exchange says whether any rank's loss is not finite and which units
        each rank's forward used (for the gradient reduction order, see rank_order.py); returns
        whether a loss was not finite."""
        uses, self._uses = self._uses, collections.Counter()
        if not self.collectives.is_distributed:
            return nonfinite
        count = len(self.units)
        used = [1 if uses[i] and self._trainable[i] else 0 for i in range(count)]
        twice = [1 if uses[i] > 1 and self._trainable[i] else 0 for i in range(count)]
        flags = self._agreement_row([int(nonfinite), *used, *twice])
        union = self.collectives.agree((Op.BACKWARD, 0), flags, self._describe_op, MISMATCH_HINT)
        used_anywhere = {i for i in range(count) if union[1 + i]}
        twice_anywhere = {i for i in range(count) if union[1 + count + i]}
        self._reduce_order = ReduceOrder(used_anywhere, {i for i in range(count) if used[i]}, twice_anywhere)
        return bool(union[0])

    def _agreement_row(self, flags: list[int]) -> list[int]:
        """Every agreement row has the same length on every rank (a collective of other sizes
        would not pair up): the longest that any agreement needs."""
        return flags + [0] * (self._agreement_width - len(flags))

    def _agree_before_collective(self, op: Op, unit: UnitState) -> None:
        row = self._agreement_row([])
        self.collectives.agree((op, unit.index), row, self._describe_op, MISMATCH_HINT)

    def _describe_op(self, key: tuple[int, int]) -> str:
        return describe_op(key, [unit.spec.name for unit in self.units])

    def _end_backward(self) -> None:
        try:
            if self._reduce_order is None:
                for unit in self.units:
                    if unit.grads_pending:
                        self._flush_grads(unit)
            else:
                self._reduce_units(self._reduce_order.finish())
                self._reduce_unannounced()
        finally:
            self._reduce_order = None
            for unit in self.units:
                self._release_backward_holds(unit)
            for _ in range(self._root_holds_for_backward):
                self._leave_unit(self.units[0])
            self._root_holds_for_backward = 0
            self._drop_external_holds()
            self.residency.release_idle()
            self.residency.reset_leaked_holds()
            if self._phase == "backward":
                self.backward_order.end()
            self._phase = "idle"
            self._entered.clear()

    def _reduce_unannounced(self) -> None:
        """Several ranks, end of backward: units with gradients that no rank's forward announced
        (a parameter used outside the model's forward) reduce now, in an order agreed first."""
        flags = [1 if unit.grads_pending else 0 for unit in self.units]
        union = self.collectives.agree((Op.EXTRAS, 0), self._agreement_row(flags), self._describe_op, MISMATCH_HINT)
        self._reduce_units([i for i in range(len(self.units) - 1, -1, -1) if union[i]])

    def _reduce_units(self, indices: list[int]) -> None:
        for index in indices:
            self._flush_grads(self.units[index])

    def _drop_external_holds(self) -> None:
        for unit_index in sorted(self._external_holds):
            self.residency.release(self.units[unit_index])
        self._external_holds.clear()

    def _pre_backward(self, index: int) -> None:
        unit = self.units[index]
        if self._phase == "backward":
            self.backward_order.visit(index)
            self._prefetch_ahead(self.backward_order)
        self._enter_unit(unit)
        unit.backward_holds += 1

    def _release_backward_holds(self, unit: UnitState) -> None:
        while unit.backward_holds:
            unit.backward_holds -= 1
            self._leave_unit(unit)

    def _on_param_grad(self, unit_index: int, param_index: int, param: torch.Tensor) -> None:
        unit = self.units[unit_index]
        unit.grads_pending.add(param_index)
        if unit.grads_pending < self._trainable[unit_index]:
            return
        if self._reduce_order is None:
            self._flush_grads(unit)
        else:
            # several ranks: the weights are no longer needed, the reduction waits its turn
            self._release_backward_holds(unit)
            self._reduce_units(self._reduce_order.grads_final(unit_index))

    def _flush_grads(self, unit: UnitState) -> None:
        """Main thread: hands the unit's gradients to the transfer worker and releases the unit.

        With several ranks, the ranks first agree that they reduce this unit and which of its
        parameters have a gradient on any rank (rank_order.py); a unit none has gradients for
        is not reduced."""
        pending, unit.grads_pending = unit.grads_pending, set()
        layout = unit.layout
        params = unit.spec.params
        if self.collectives.is_distributed:
            flags = self._agreement_row([1 if i in pending else 0 for i in range(len(params))])
            union = self.collectives.agree((Op.REDUCE, unit.index), flags, self._describe_op, MISMATCH_HINT)
            with_grad = {i for i in range(len(params)) if union[i]}
            if not with_grad:
                self._release_backward_holds(unit)
                return
        else:
            with_grad = pending
        self._bound_grads_in_flight()
        if self.device.is_cuda or self.collectives.is_distributed:
            pieces = [(0, self._flat_grad_shard(unit, pending))]
        else:
            # CPU device, one rank: the gradients are host memory already; the transfer worker
            # adds them straight into the fp32 gradient, with no flat copy in between
            pieces = []
            with torch.no_grad():
                for index in sorted(pending):
                    grad = params[index].grad
                    if grad is not None:
                        pieces.append((layout.offsets[index], grad.reshape(-1)))
                    params[index].grad = None
            self.ledger.allocate("device", sum(g.numel() * g.element_size() for _, g in pieces), "grad")
        event = self.device.record_compute_event()
        first = not unit.window_started
        unit.window_started = True
        unit.grads_in_window |= with_grad
        for _, grad in pieces:
            self.device.keep_alive_on_copy_stream(grad)
        final = self._boundary_backward and self.config.overlap == "backward" and self._reduced_once_per_backward(unit)
        if final and self._gathers_after_step:
            unit.needs_gather = True
        future = self.transfer.submit(self._offload_grad, unit, pieces, event, first, self._boundary_backward, final)
        self._grad_futures.append(future)
        self._grads_in_flight.append(future)
        self._release_backward_holds(unit)

    def _flat_grad_shard(self, unit: UnitState, pending: set[int]) -> torch.Tensor:
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

    def _bound_grads_in_flight(self) -> None:
        """Backpressure: at most MAX_GRADS_IN_FLIGHT units' gradients wait on the device for the
        transfer worker; the main thread (and so backward) waits for the oldest beyond that."""
        while self._grads_in_flight and (
            len(self._grads_in_flight) >= MAX_GRADS_IN_FLIGHT or self._grads_in_flight[0].done()
        ):
            oldest = self._grads_in_flight.popleft()
            if not oldest.done():
                started = time.perf_counter()
                oldest.exception()  # waits; errors surface in step() through _grad_futures
                self.timings["wait_fetch"] += time.perf_counter() - started

    def _reduced_once_per_backward(self, unit: UnitState) -> bool:
        """Whether this reduction of the unit's gradients is its last in this backward: always
        with several ranks (each unit reduces once, rank_order.py); with one rank, when the
        unit runs once per forward."""
        if self.collectives.is_distributed:
            return True
        recorded = self.forward_order.recorded or []
        return recorded.count(unit.index) == 1

    def _offload_grad(self, unit: UnitState, pieces: list, event, first: bool, boundary: bool, step_now: bool) -> None:
        """Transfer worker: device gradients -> fp32 gradient on its tier (+ norm at the boundary).

        `pieces` are (offset in the shard, gradient) pairs: the reduce-scattered flat shard on
        CUDA or with several ranks, the params' own gradients on a CPU device."""
        nbytes = sum(grad.numel() * grad.element_size() for _, grad in pieces)
        staging = None
        try:
            if self.device.is_cuda:
                ((offset, flat),) = pieces
                self.device.copy_waits(event)
                staging = self.store.grad_staging.take()
                with self.device.copy_stream_context():
                    staging[: flat.numel()].copy_(flat, non_blocking=True)
                self.device.record_copy_event().synchronize()
                pieces = [(offset, staging[: flat.numel()])]
            norm = self.store.accumulate_grad(unit, pieces, first, compute_norm=boundary)
            if boundary:
                unit.grad_sq_norm = norm
        finally:
            if staging is not None:
                self.store.grad_staging.give(staging)
            del pieces
            self.ledger.release("device", nbytes, "grad")
        if step_now:
            self._step_during_backward(unit)

    def _step_during_backward(self, unit: UnitState) -> None:
        """overlap 'backward' (transfer worker): the unit's gradients are final, step it now."""
        if unit.grad_sq_norm is None or not math.isfinite(unit.grad_sq_norm):
            with self._lock:
                self._nonfinite_units.append(unit.spec.name)
            return
        unit.begin_step()
        hyper = self._hyper(1.0 / self.collectives.world_size)
        with self._lock:
            self._backward_step_futures.append(self.optimizer_worker.submit(self.stepper.run, [unit], hyper))

    # ---- step --------------------------------------------------------------------------
    def _hyper(self, grad_multiplier: float) -> StepHyper:
        opt = self.config.optimizer
        return StepHyper(
            lr=self.lr,
            beta1=opt.betas[0],
            beta2=opt.betas[1],
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            adamw_mode=opt.type == "adamw",
            bias_correction=opt.bias_correction,
            grad_multiplier=grad_multiplier,
        )

    def _wait_grads(self) -> None:
        """Waits for every gradient transfer of the window; re-raises the first error. The
        transfers are forgotten only once done: an interrupted wait can be waited again."""
        concurrent.futures.wait(self._grad_futures)
        futures, self._grad_futures = self._grad_futures, []
        self._grads_in_flight.clear()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise OffloadError(f"offload: moving gradients off the device failed: {errors[0]}") from errors[0]

    def _drain(self) -> None:
        """Waits for every gradient transfer and optimizer step in flight; re-raises their errors."""
        self._wait_grads()
        self._wait_step()

    def _wait_step(self) -> None:
        """Waits for any step still running (overlap forward / backward); re-raises its error.
        A step is forgotten only once done: after an interrupt (Ctrl-C in `step()`), the next
        wait (a checkpoint's, say) still waits for it."""
        if self._step_future is not None:
            concurrent.futures.wait([self._step_future])
            future, self._step_future = self._step_future, None
            future.result()
        with self._lock:
            futures = list(self._backward_step_futures)
        concurrent.futures.wait(futures)
        with self._lock:
            del self._backward_step_futures[: len(futures)]
        for f in futures:
            f.result()

    def step(self) -> bool:
        """At the end of an accumulation window, updates the weights; returns True when it did.

        With overlap 'forward' the update runs on while the next forward computes: the
        weights are committed (each unit's next use waits for its own update)."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.timings["step"] += time.perf_counter() - started

    def _step(self) -> bool:
        self._check_open()
        if self.micro_steps == 0 or self.micro_steps % self.config.gradient_accumulation_steps != 0:
            return False
        if self.micro_steps == self._stepped_at_micro:
            return False
        self._drain()
        # the window is decided from here on (stepped, skipped or refused); an interrupt in the
        # wait above leaves it open, and the next step() takes it again
        self._stepped_at_micro = self.micro_steps
        window = [unit for unit in self.units if unit.window_started]
        nonfinite, self._nonfinite_units = self._nonfinite_units, []
        if self.config.overlap == "backward":
            return self._finish_backward_overlap(window, nonfinite)
        for unit in window:
            if unit.grad_sq_norm is None:
                unit.grad_sq_norm = self.store.grad_sq_norm(unit)
        local = sum(unit.grad_sq_norm for unit in window)
        (total,) = self.collectives.sum_host([local], what="the global gradient norm")
        multiplier, norm = gradient_multiplier(
            self.scaler.scale * self.collectives.world_size, total, self.config.gradient_clipping
        )
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            bad = [unit.spec.name for unit in window if not math.isfinite(unit.grad_sq_norm)]
            self._discard_window()
            if self.config.precision == "fp16":
                self.scaler.update(overflow=True)
                self.skipped_steps += 1
                logger.warning(
                    "offload: fp16 gradient overflow at step %d; step skipped, loss scale now %g", self.global_steps, self.scaler.scale
                )
                return False
            raise NonFiniteError(
                f"non-finite gradients (norm {norm}) in {', '.join(bad) or 'other ranks'} at step {self.global_steps}: "
                "the step was skipped and the weights are unchanged; lower the learning rate, check the data, or enable clipping"
            )
        if self.config.precision == "fp16":
            self.scaler.update(overflow=False)
        self.global_steps += 1
        order = step_order(self.forward_order.recorded, len(self.units))
        to_step = [self.units[i] for i in order if self.units[i].window_started]
        self._begin_steps(to_step)
        self._step_future = self.optimizer_worker.submit(self.stepper.run, to_step, self._hyper(multiplier))
        if self.config.overlap == "none":
            self._wait_step()
        return True

    def _finish_backward_overlap(self, window: list[UnitState], nonfinite: list[str]) -> bool:
        if self.collectives.ranks_with(bool(nonfinite), what="the non-finite gradient check") and not nonfinite:
            nonfinite = ["units on other ranks"]
        if nonfinite:
            self._discard_window()
            raise NonFiniteError(
                f"non-finite gradients in {', '.join(nonfinite)} at step {self.global_steps}: those units were not "
                "stepped (with overlap 'backward' the other units already were); lower the learning rate or check the data"
            )
        self.global_steps += 1
        rest = [unit for unit in window if unit.window_started]
        self._begin_steps(rest)
        self._step_future = self.optimizer_worker.submit(self.stepper.run, rest, self._hyper(1.0 / self.collectives.world_size))
        self._wait_step()
        return True

    def _begin_steps(self, units: list[UnitState]) -> None:
        """Main thread, before the optimizer worker steps `units`: their weights change."""
        for unit in units:
            unit.begin_step()
            if self._gathers_after_step:
                unit.needs_gather = True

    def _discard_window(self) -> None:
        for unit in self.units:
            unit.end_window()

    # ---- weights out -------------------------------------------------------------------
    def _master_shard(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's fp32 master shard of `unit`."""
        if self.store.optimizer_tier == "cpu":
            return unit.host["master"].clone()
        shard = torch.empty(unit.shard_numel, dtype=torch.float32)
        with self.store.slots_lock:
            slot = self.store.slots[0]
            self.store.swap.read_into(unit.swap_name("master"), slot.master[: unit.shard_numel]).wait()
            shard.copy_(slot.master[: unit.shard_numel])
        return shard

    def _full_master(self, unit: UnitState) -> torch.Tensor:
        shard = self._master_shard(unit)
        if not self.collectives.is_distributed:
            return shard
        full = torch.empty(unit.layout.padded_numel, dtype=torch.float32)
        self.collectives.all_gather_host(full, shard, what=f"fp32 master weights of unit {unit.spec.name}")
        return full

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and the model's buffers) under model.state_dict()'s keys, on the CPU."""
        self._check_open()
        self._drain()
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            full = self._full_master(unit)
            for param, offset in zip(unit.spec.params, unit.layout.offsets):
                values[id(param)] = full[offset : offset + param.numel()].view(param.shape).clone()
        result = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in values:
                # a tied weight appears under each of its names as its own tensor (safetensors
                # refuses shared storage)
                value = values[id(tensor)]
                result[name] = value.clone() if any(v is value for v in result.values()) else value
            else:
                result[name] = tensor.detach().to("cpu", copy=True)
        return result

    def pop_timings(self) -> dict[str, float]:
        """Seconds per phase since the last call (forward, backward, step, wait_fetch, wait_step)."""
        timings, self.timings = self.timings, dict.fromkeys(TIMING_KEYS, 0.0)
        return timings

    # ---- checkpoints (offload.checkpoint does the work) --------------------------------
    def save_checkpoint(self, path, client_state: dict | None = None, **kwargs):
        """Saves everything needed to resume exactly; see offload.checkpoint.save."""
        from offload import checkpoint

        self._check_open()
        self._drain()
        return checkpoint.save(self, path, client_state=client_state, **kwargs)

    def load_checkpoint(self, path, **kwargs) -> dict:
        """Restores a checkpoint saved by any world size and placement; returns its client_state."""
        from offload import checkpoint

        self._check_open()
        self._drain()
        return checkpoint.load(self, path, **kwargs)

    def memory_report(self) -> dict:
        """Bytes the engine holds now and at peak, per tier (device / host / nvme), by category."""
        return self.ledger.report()

    # ---- end ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this engine is closed; create a new one with offload.initialize")

    def close(self, restore_weights: bool = True) -> None:
        """Finishes pending work, frees host buffers and removes swap files.

        With `restore_weights`, the model's parameters are left holding the final fp32 weights
        on the CPU (a full fp32 copy of the model in RAM); without, they are left empty."""
        if self._closed:
            return
        try:
            self._drain()
            final = self.consolidated_state_dict() if restore_weights else None
        finally:
            self._closed = True
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self.transfer.shutdown(wait=True)
            self.optimizer_worker.shutdown(wait=True)
            self.store.close()
        if final is not None:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, param in params.items():
                    if name in final:
                        param.data = final[name]
        else:
            for unit in self.units:
                self.residency.free(unit)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc is None:
            self.close()
            return
        # leaving on an error: tell the other ranks why, and issue no collective on the way out
        # (the other ranks are elsewhere; gathering the weights would wait for them in vain)
        self.collectives.announce_failure(exc)
        try:
            self.close(restore_weights=False)
        except Exception as close_error:  # noqa: BLE001 (the original error matters more)
            logger.error("offload: closing the engine after an error failed too: %s", close_error)


def _prepare_inputs(value, device: torch.device, compute_dtype: torch.dtype):
    """Tensors in the inputs go to the device; floating-point ones take the compute dtype
    (integer ids, masks and labels keep theirs)."""
    if isinstance(value, torch.Tensor):
        dtype = compute_dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=dtype, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_prepare_inputs(v, device, compute_dtype) for v in value)
    if isinstance(value, list):
        return [_prepare_inputs(v, device, compute_dtype) for v in value]
    if isinstance(value, dict):
        return {k: _prepare_inputs(v, device, compute_dtype) for k, v in value.items()}
    return value
