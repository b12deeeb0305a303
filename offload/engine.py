"""The Engine: the public API over a model cut into units (see docs/design.md).

`Engine` wires the parts together and keeps the window arithmetic: which backward ends a
gradient window, the global gradient norm, clipping and the fp16 loss scale, and when a window
is stepped, skipped or refused. What happens to each unit during a micro-step is in
schedule.py; when the CPU step runs relative to compute is the overlap policy (overlap.py).

Longer than the ~600 lines the other modules keep to, because the public surface is: the
constructor wires about ten parts (units, tiers, residency, gradients, stepping, schedule,
hyperparameters, weights, state-dict hooks) and undoes them on a failed start; the rest is the
user's API (forward, backward and plain loss.backward(), step, lr, optimizer, state dicts,
checkpoints, memory report, close), each a few lines over the part that does the work.

Threads, and what each owns:
- the main thread runs forward and backward, every hook, every collective, and all residency
  bookkeeping (acquire / release / storage resize);
- the transfer worker (one thread) runs fetches of 16-bit weights to the device and the
  gradient path off the device (copy, accumulate into the fp32 gradient, squared norm), in
  the order they were submitted;
- the optimizer worker (one thread) runs `UnitStepper.run`; the C++ Adam inside it uses its
  own pool of threads. Each unit's `step_done` event tells fetches and forwards when its new
  weights are ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from offload.config.param_groups import resolve_param_groups
from offload.config.placement import ParamTier
from offload.config.schema import Config, freeze, load_config
from offload.errors import ConfigError, NonFiniteError, OffloadError
from offload.model.materialize import has_meta_state, mapped_zeros, materialize_unit_params
from offload.model.owned import OPEN_ENGINES, RELEASED, StateDictHooks
from offload.model.unit_state import UnitState
from offload.model.units import build_units, plan_flat_layout, single_unit_warning
from offload.optim import kernels
from offload.optim.engine_optimizer import EngineOptimizer
from offload.optim.hyperparameters import GroupHyperparameters
from offload.optim.loss_scaling import DynamicLossScaler, gradient_multiplier
from offload.optim.step_hyper import StepHyper
from offload.plan.optimizer_plan import factor_needs_norm
from offload.platform.choose import device_choice, make_device
from offload.platform.collectives import Collectives
from offload.platform.device import Device
from offload.platform.rank_order import Op
from offload.runtime.events import Phase
from offload.runtime.gradients import GradientOffload
from offload.runtime.overlap import Stepping, overlap_policy
from offload.runtime.param_access import held_on_device
from offload.runtime.prefetch import step_order
from offload.runtime.residency import Residency
from offload.runtime.schedule import Schedule, ScheduleContext
from offload.runtime.stepper import StepMode, UnitStepper
from offload.runtime.weights_out import WeightsReader
from offload.storage.memory import TierLedger
from offload.storage.tiers import TierStore, default_run_name, plan_optimizer

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TIMING_KEYS = ("forward", "backward", "step", "wait_fetch", "wait_step")


# With the step overlapping the accelerator's compute, CPUs the C++ Adam leaves to the main
# thread (it launches every kernel of forward and backward: starved, the accelerator idles) and
# the transfer worker (it lands gradients and fetches weights meanwhile).
CPUS_FOR_LAUNCHING = 2
# ... but only from this many CPUs per rank: below, the Adam's share matters more.
CPUS_BEFORE_RESERVING = 8


def adam_threads(cpus: int, environ, *, overlaps_accelerator: bool = False) -> int:
    """Threads of the C++ Adam when `optimizer.threads` is 0: this process's CPUs, shared with the
    other ranks of the node (torchrun's LOCAL_WORLD_SIZE), so ranks do not oversubscribe them.
    `overlaps_accelerator`: the step runs while an accelerator computes (overlap forward or
    backward on CUDA); then CPUS_FOR_LAUNCHING of a rank's CPUs are left to the threads that
    keep the accelerator busy (the Adam is memory-bound: fewer threads lose little of its rate)."""
    ranks_here = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    share = max(1, cpus // ranks_here)
    if overlaps_accelerator and share >= CPUS_BEFORE_RESERVING:
        return share - CPUS_FOR_LAUNCHING
    return share


def initialize(
    model: nn.Module, config: Config | dict | str | os.PathLike | None = None, param_groups: list[dict] | None = None, **kwargs
) -> Engine:
    """Wraps `model` for offloaded training; see `Engine`."""
    return Engine(model, config, param_groups=param_groups, **kwargs)


class Engine:
    """Trains `model` with its states placed on device / host / NVMe as `config` says.

    `engine(*args, **kwargs)` runs the model's forward (tensor inputs are moved to the device and
    floating-point ones cast to the compute dtype); `engine.backward(loss)` runs backward
    (the loss is divided by gradient_accumulation_steps, and multiplied by the loss scale in
    fp16); `engine.step()` updates the weights at the end of each accumulation window and
    returns True when it did.

    A plain `loss.backward()` works too, except in fp16 (whose loss scaling needs
    `engine.backward`): the engine sees it reach the model's outputs and does what
    `engine.backward` does around it, except dividing the loss: as with torch, a plain
    backward under gradient accumulation backpropagates `loss / gradient_accumulation_steps`.

    `param_groups`: torch-style groups (see offload.config.param_groups); `engine.optimizer` is a
    torch.optim.Optimizer over them that LR schedulers drive. `engine.config` is read-only.

    `device`: "cuda[:N]", "cpu", "checked" (the CPU standing in for an asynchronous accelerator,
    every stream ordering checked: offload.platform.checked_device), or a Device built beforehand; by
    default `OFFLOAD_DEVICE` from the environment, else CUDA when present, else the CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config | dict | str | os.PathLike | None = None,
        *,
        process_group=None,
        device: Device | torch.device | str | None = None,
        run_name: str | None = None,
        strict: bool = True,
        param_groups: list[dict] | None = None,
    ) -> None:
        # strict=False: a DeepSpeed / accelerate key whose meaning cannot be honoured is dropped
        # with a warning instead of refused
        self.config = load_config(config, strict=strict)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"offload.initialize needs an nn.Module, got {type(model).__name__}")
        # before anything touches the model: it is not another open engine's, nor left empty by one
        OPEN_ENGINES.check(model)
        RELEASED.check(model)
        opt = self.config.optimizer
        groups = resolve_param_groups(
            model, param_groups, {"lr": opt.lr, "weight_decay": opt.weight_decay, "betas": tuple(opt.betas), "eps": opt.eps}
        )
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self.model = model
        self._closed = False
        # the process group first: started from torchrun's environment if needed (which also
        # picks this rank's CUDA device before Device reads the current one)
        choice = device_choice(device, os.environ)
        if isinstance(choice, Device):
            self.collectives = Collectives(process_group, device=choice.torch_device)
        else:
            self.collectives = Collectives(process_group, device="cpu" if choice == "checked" else choice)
        self.device = make_device(choice)
        self.compute_dtype = COMPUTE_DTYPES[self.config.precision]
        self.ledger = TierLedger()
        overlapped = self.device.is_cuda and self.config.overlap != "none"
        threads = self.config.optimizer.threads or adam_threads(
            len(os.sched_getaffinity(0)), os.environ, overlaps_accelerator=overlapped
        )
        kernels.set_num_threads(threads)

        world, rank = self.collectives.world_size, self.collectives.rank
        specs = build_units(model, self.config.wrap.module_classes, self.config.wrap.min_params)
        group_of = {id(param): index for index, group in enumerate(groups) for param in group["params"]}
        self.units = []
        for spec in specs:
            # trainable params first: the frozen ones carry no optimizer state (units.FlatLayout)
            layout = plan_flat_layout([p.numel() for p in spec.params], world, [p.requires_grad for p in spec.params])
            self.units.append(
                UnitState(
                    spec,
                    layout,
                    optimizer_numel=layout.optimizer_numel(rank),
                    param_groups=tuple(group_of[id(p)] for p in spec.params),
                )
            )
        warning = single_unit_warning(specs, ParamTier(self.config.offload.param).offloaded)
        if warning:
            logger.warning(warning)
        logger.info(
            "offload: %d units (largest %.1fM params), precision %s, param on %s, optimizer on %s, overlap %s, "
            "CPU Adam threads %d, rank %d/%d",
            len(self.units),
            max(u.spec.numel for u in self.units) / 1e6,
            self.config.precision,
            self.config.offload.param,
            self.config.offload.optimizer,
            self.config.overlap,
            kernels.get_num_threads(),
            rank,
            world,
        )

        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.policy = overlap_policy(
            self.config.overlap,
            factor_needs_norm=factor_needs_norm(self.config.gradient_clipping, self.config.precision),
        )
        self.optimizer_plan = plan_optimizer(
            self.config,
            self.units,
            compute_dtype=self.compute_dtype,
            staged_device_copies=self.device.separate_memory,
            local_rank=local_rank,
            device_memory=self.device.memory(),
        )
        self.store = TierStore(
            self.units,
            self.config,
            compute_dtype=self.compute_dtype,
            pin=self.device.pin_host_memory,
            staged_device_copies=self.device.separate_memory,
            ledger=self.ledger,
            rank=rank,
            local_rank=local_rank,
            # one run directory for all ranks (rank 0's name), each rank in its rank<r>/ below it
            run_name=self.collectives.broadcast_object(run_name or default_run_name(), what="the swap run name"),
            optimizer_tiers=self.optimizer_plan.tiers,
            device=self.device.torch_device,
            speculate=self.policy.speculative,
        )
        self.transfer = ThreadPoolExecutor(1, thread_name_prefix="offload-transfer")
        self.optimizer_worker = ThreadPoolExecutor(1, thread_name_prefix="offload-step")
        # seconds spent since the last `pop_timings()`, by phase; `wait_fetch` and `wait_step` are
        # the main thread's waits for weights to arrive and for the CPU step to finish
        self.timings: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        self.stepper = UnitStepper(self.store, self.device, rank)
        self.stepping = Stepping(self.optimizer_worker, self.stepper)
        self.residency = Residency(
            self.units,
            device=self.device,
            store=self.store,
            transfer=self.transfer,
            collectives=self.collectives,
            ledger=self.ledger,
            param_tier=self.store.param_tier,
            compute_dtype=self.compute_dtype,
            agree_before=self._agree_before_unit_collective,
        )
        self.gradients = GradientOffload(
            device=self.device,
            collectives=self.collectives,
            store=self.store,
            ledger=self.ledger,
            transfer=self.transfer,
            compute_dtype=self.compute_dtype,
            timings=self.timings,
            on_final=self._step_during_backward,
        )
        try:
            self._adopt_all()
            self._move_buffers()
        except BaseException:
            # nothing half-built outlives a failed start: threads stop, host buffers and swap files go
            self.transfer.shutdown(wait=True)
            self.optimizer_worker.shutdown(wait=True)
            try:
                self.device.close()
            finally:
                self.store.close()
            raise

        self.scaler = DynamicLossScaler(
            scale=self.config.loss_scale.initial if self.config.precision == "fp16" else 1.0,
            growth_interval=self.config.loss_scale.growth_interval,
            backoff_factor=self.config.loss_scale.backoff_factor,
            growth_factor=self.config.loss_scale.growth_factor,
            min_scale=self.config.loss_scale.min_scale,
        )
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken
        self.skipped_steps = 0  # fp16 overflows
        self.last_grad_norm: float | None = None
        self._stepped_at_micro = -1  # micro_steps at the last step() that ended a window
        # overlap 'backward': units whose gradients were not finite (not stepped); transfer worker
        self._nonfinite_units: list[str] = []
        # overlap 'backward', speculative: units stepped into their spare state in this window,
        # appended by the transfer worker, committed or taken back by step() after it drained
        self._speculated: dict[int, UnitState] = {}
        # speculative windows step() committed, stepped again (clipping acted, or the
        # hyperparameters changed), skipped (fp16 overflow) or refused (non-finite gradients)
        self.speculation_counts = {"committed": 0, "redone": 0, "skipped": 0, "refused": 0}
        # overlap 'backward': each group's hyperparameters for the window's steps, read on the main
        # thread when its last backward begins (the transfer worker submits the steps)
        self._window_hypers: list[StepHyper] | None = None
        # overlap 'backward' without speculation: units stepped in place during the window's last
        # backward (appended by the transfer worker, read by the main thread once settled). A
        # backward that fails after some stepped leaves the weights partly stepped: their names,
        # and every use is refused until load_checkpoint
        self._stepped_in_backward: list[UnitState] = []
        self._partly_stepped: list[str] = []
        self._outside_backward_began_at = 0.0
        self.hyper = GroupHyperparameters(groups, self.config.optimizer, self.config.scheduler)
        self.weights = WeightsReader(self.units, self.store, self.collectives, settle=self._drain)
        context = ScheduleContext(
            units=self.units,
            residency=self.residency,
            gradients=self.gradients,
            collectives=self.collectives,
            stepping=self.stepping,
            policy=self.policy,
            prefetch_depth=self.config.prefetch.depth,
            timings=self.timings,
            on_outside_backward=self._outside_backward_began,
        )
        self.schedule = Schedule(
            model,
            context,
            watch_external_reads=(
                self.residency.offloaded or self.config.overlap == "forward" or self.collectives.is_distributed
            ),
        )
        self.stepper.events = context.events
        self.schedule.install()
        self._state_dict_hooks = StateDictHooks(model, set(self.weights.home), self._fp32_weight, self.weights.invalidate)
        # what the engine read at start is what it uses: changing it later would silently do nothing
        freeze(self.config, "engine.config")
        OPEN_ENGINES.add(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<offload Engine over {type(self.model).__name__}, {len(self.units)} units, param {self.config.offload.param}, "
            f"optimizer {self.config.offload.optimizer}, {state}>"
        )

    # ---- construction ------------------------------------------------------------------
    def _adopt_all(self) -> None:
        """Adopts every unit in index order. Unit i + 1's values are made (materialised from the
        meta device, gathered into one flat fp32 buffer) on a helper thread while unit i's go to
        their tiers and the device, so the single-threaded random init of a meta-built model
        overlaps the copies. Units are made in order by that one thread: the random stream, and
        so the weights, are those of a model initialised unit by unit; at most two units' fp32
        values exist at once."""
        if not self.units:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="offload-materialize") as maker:
            upcoming = maker.submit(self._unit_values, self.units[0])
            for i, unit in enumerate(self.units):
                flat32 = upcoming.result()
                if i + 1 < len(self.units):
                    upcoming = maker.submit(self._unit_values, self.units[i + 1])
                self._adopt(unit, flat32)
                del flat32  # unmapped here, before the next unit's is taken

    def _unit_values(self, unit: UnitState) -> torch.Tensor:
        """The unit's initial weights as one flat fp32 buffer of its padded layout (the
        materialize thread; touches only this unit's params and its territory's modules)."""
        if has_meta_state(self.model, unit.spec):
            # a model built on the meta device gets real values one unit at a time, so the
            # whole fp32 model never exists in RAM at once
            materialize_unit_params(self.model, unit.spec)
        for name, param in zip(unit.spec.param_names, unit.spec.params):
            check_has_storage(name, param)
        # its own mapping, unmapped when dropped (a heap block per unit would stay in the process)
        flat32 = mapped_zeros(unit.layout.padded_numel, torch.float32)
        with torch.no_grad():
            for param, offset in zip(unit.spec.params, unit.layout.offsets):
                flat32[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        return flat32

    def _adopt(self, unit: UnitState, flat32: torch.Tensor) -> None:
        """Moves the unit's params into its flat buffer and stores its initial state (`flat32`,
        from _unit_values) on the tiers."""
        layout = unit.layout
        rank = self.collectives.rank
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

    def _agree_before_unit_collective(self, op: Op, unit: UnitState) -> None:
        """Residency, before a unit's collective: every rank states the same (operation, unit)."""
        self.schedule.context.agree(op, unit.index, [])

    def _move_buffers(self) -> None:
        """Module buffers (not parameters) follow the model to the device; `close()` puts them
        back where they were."""
        self._buffer_homes: list[tuple[nn.Module, str, torch.device]] = []
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and buffer.device != self.device.torch_device:
                    self._buffer_homes.append((module, name, buffer.device))
                    setattr(module, name, buffer.to(self.device.torch_device))

    # ---- forward and backward ----------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._check_open()
        self._settle_before_use()
        args, kwargs = _prepare_inputs((args, kwargs), self.device.torch_device, self.compute_dtype)
        started = time.perf_counter()
        try:
            return self.schedule.forward(*args, **kwargs)
        finally:
            self.timings["forward"] += time.perf_counter() - started

    @contextlib.contextmanager
    def params_on_device(self, module: nn.Module | None = None):
        """A block inside which the parameters of `module` (the whole model by default) can be
        read between steps: on the device, whole, with the weights of the latest step. Outside
        it an offloaded parameter's storage is freed between uses (reading it reads freed
        memory), and with overlap `forward` a step may still be writing the weights. For reading
        only (EMA, weight norms, copies): a write is refused when the block ends. With several
        ranks, every rank enters it with the same module (the weights are gathered). A large
        model can be read block by block: `for layer in model.layers: with
        engine.params_on_device(layer): ...`."""
        self._check_open()
        self._settle_before_use()
        with held_on_device(self.schedule.context, self.model if module is None else module, self._undo_write):
            yield

    def _undo_write(self, unit: UnitState) -> None:
        """A write inside params_on_device: `param: none` device weights are written again from
        this rank's fp32 weights (an offloaded unit's written copy was freed with its hold, so
        its master is not read)."""
        if not self.residency.offloaded:
            self.residency.replace_weights(unit, self.weights.weights_shard(unit))

    def _settle_before_use(self) -> None:
        """Before a forward or a read of the weights: a failed plain backward's holds are given
        back; with overlap `backward`, the steps of a window that ended wait to be scheduled."""
        self._finish_abandoned_backward()
        self._refuse_partly_stepped()
        if self.policy.steps_in_backward and self._window_ended_without_step():
            if self.policy.speculative:
                raise OffloadError(
                    "overlap 'backward' with gradient clipping or fp16: the last backward ended a gradient window and its "
                    "units were stepped speculatively, but engine.step() was not called; the weights count only once "
                    "step() has checked the global gradient norm. Call engine.step() after the backward that ends each window"
                )
            # overlap 'backward', a forward before step(): the window's steps are being scheduled
            # by the transfer worker as gradients land; let them be, so that the forward's fetches
            # ask for the weights they will get
            self.gradients.wait_all()

    @property
    def forward_order(self):
        return self.schedule.context.forward_order

    @property
    def backward_order(self):
        return self.schedule.context.backward_order

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` / gradient_accumulation_steps (times the loss scale in fp16)."""
        self._check_open()
        self._finish_abandoned_backward()
        self._refuse_partly_stepped()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise OffloadError("engine.backward needs the scalar loss tensor (e.g. out.loss)")
        if not loss.requires_grad:
            raise OffloadError("engine.backward: the loss does not require grad (was the forward run under torch.no_grad?)")
        boundary = self._before_backward()
        # agreed over ranks: a rank skipping backward alone would leave the others in its collectives
        nonfinite = self.config.precision != "fp16" and not math.isfinite(float(loss.detach()))
        self._agree_on_backward(nonfinite, float(loss.detach()) if nonfinite else None)
        self._prefetch_step_states(boundary)
        scaled = loss.float() / self.config.gradient_accumulation_steps
        if self.config.precision == "fp16":
            scaled = scaled * self.scaler.scale
        started = time.perf_counter()
        try:
            self.schedule.backward(scaled, boundary=boundary)
        except BaseException as error:
            self._after_failed_backward("the backward that ends the window failed", error)
            raise
        finally:
            self.timings["backward"] += time.perf_counter() - started
        self.micro_steps += 1

    def _before_backward(self) -> bool:
        """Checks that need no other rank, before a backward changes anything; returns whether
        it ends a gradient window. Deterministic on every rank (same counters and config)."""
        accumulation = self.config.gradient_accumulation_steps
        if self.policy.steps_in_backward and self._window_ended_without_step():
            raise OffloadError(
                f"overlap 'backward': the last backward ended a gradient window (gradient_accumulation_steps "
                f"{accumulation}) and its units were stepped as their gradients landed, but engine.step() was not "
                "called after it. Call engine.step() after the backward that ends each window; another backward first "
                "would step the weights a second time (overlap 'none' / 'forward' accumulate it into the window instead)"
            )
        boundary = (self.micro_steps + 1) % accumulation == 0
        if boundary and self.policy.steps_in_backward:
            self.hyper.check_untouched()
            self._window_hypers = self.hyper.step_hypers(self._unclipped_multiplier())
            self._stepped_in_backward = []
        return boundary

    def _agree_on_backward(self, nonfinite: bool, loss_value: float | None) -> None:
        """Several ranks: one exchange (non-finite losses, units used; schedule.py); then the
        steps still in flight finish (they read the fp32 gradients this backward writes)."""
        if self.schedule.agree_on_backward(nonfinite):
            bad_ranks = self.collectives.ranks_with(nonfinite, what="the non-finite loss check")
            self.schedule.abort_backward()
            where = ""
            if self.collectives.is_distributed:
                where = f" (not finite on rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))})"
            shown = "not finite" if loss_value is None else f"{loss_value}"
            raise NonFiniteError(
                f"the loss is {shown}{where} at micro-step {self.micro_steps}: backward "
                "was not run and no state changed; check the data and the learning rate, or use precision 'fp16' "
                "whose overflow skips the step"
            )
        self.stepping.wait()

    def _prefetch_step_states(self, boundary: bool) -> None:
        """The window's last backward begins (the steps in flight are done): the optimizer worker
        starts reading the master and moments of the first NVMe pieces the step will stream, in
        its order, while backward computes (TierStore.prefetch_optimizer_states). Not with overlap
        'backward' without speculation, whose units step one by one as their gradients land."""
        if not boundary or not self.store.streamed_units:
            return
        if self.policy.steps_in_backward and not self.policy.speculative:
            return
        order = step_order(self.forward_order.recorded, len(self.units))
        self.optimizer_worker.submit(self.store.prefetch_optimizer_states, [self.units[i] for i in order])

    def _window_ended_without_step(self) -> bool:
        """The last backward ended a gradient window and step() has not taken it yet."""
        steps = self.micro_steps
        return bool(steps) and steps % self.config.gradient_accumulation_steps == 0 and steps != self._stepped_at_micro

    def _outside_backward_began(self) -> None:
        """Inside autograd, as a backward the engine did not start (a plain `loss.backward()`)
        reaches the model's outputs: what `engine.backward` does before autograd, except the
        division by gradient_accumulation_steps (the user's, as with torch); the rest runs when
        autograd finishes (`_outside_backward_ended`, queued on its engine)."""
        self._check_open()
        try:
            if self.config.precision == "fp16":
                raise OffloadError(
                    "precision 'fp16' needs engine.backward(loss) instead of loss.backward(): the engine multiplies the "
                    "loss by the dynamic loss scale before backward (unscaled fp16 gradients underflow) and divides the "
                    "gradients by it in the step. No gradient was kept; call engine.backward(loss)"
                )
            boundary = self._before_backward()
            self._agree_on_backward(False, None)
            self._prefetch_step_states(boundary)
            self.schedule.begin_backward(boundary=boundary)
        except BaseException:
            self.schedule.abort_backward()
            raise
        self._outside_backward_began_at = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._outside_backward_ended)

    def _outside_backward_ended(self) -> None:
        try:
            self.schedule.end_backward()
        finally:
            self.timings["backward"] += time.perf_counter() - self._outside_backward_began_at
        self.micro_steps += 1

    def _finish_abandoned_backward(self) -> None:
        """A plain backward that failed inside autograd never reached its end (`queue_callback`
        runs only on success): its holds are given back here, as engine.backward's would be."""
        if self.schedule.context.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
            logger.warning("offload: a loss.backward() failed before it finished; its unit holds are released")
            self.schedule.context.backward_failed = True
            self.schedule.end_backward()
            self._after_failed_backward("a loss.backward() failed before it finished")

    def _after_failed_backward(self, why: str, error: BaseException | None = None) -> None:
        """A backward that failed. Speculative steps are taken back. Steps taken in place during a
        window's last backward (overlap 'backward' without clipping or fp16) cannot be: the units
        that stepped are named, the failure (`error`) says so, and the engine refuses to go on
        from weights partly stepped until a checkpoint is loaded. Units whose gradients were
        handed off after the failure did not step (`_step_during_backward`)."""
        if self.policy.speculative:
            self._abandon_speculation(why)
            return
        if not (self.policy.steps_in_backward and self.schedule.context.boundary_backward):
            return
        for failure in self._settle():
            logger.warning("offload: %s; work in flight failed too: %s", why, failure)
        stepped, self._stepped_in_backward = self._stepped_in_backward, []
        if not stepped:
            return
        self._partly_stepped = [unit.spec.name for unit in sorted(stepped, key=lambda unit: unit.index)]
        message = (
            f"offload: {why} after {len(stepped)} of {len(self.units)} units had stepped in place with overlap "
            f"'backward' ({', '.join(self._partly_stepped[:4])}{' …' if len(stepped) > 4 else ''}); the others did not "
            "step, and steps taken in place cannot be taken back, so the weights are partly stepped. Load a checkpoint "
            "(engine.load_checkpoint) to go on; until then the engine refuses to train"
        )
        logger.error(message)
        if error is not None:
            error.add_note(message)

    def _refuse_partly_stepped(self) -> None:
        if self._partly_stepped:
            raise OffloadError(
                f"a backward failed after units {', '.join(self._partly_stepped[:4])} had stepped in place (overlap "
                "'backward'): the weights are partly stepped. Load a checkpoint (engine.load_checkpoint) to go on"
            )

    def _unclipped_multiplier(self) -> float:
        """What the stored gradients are multiplied by when clipping does not act: the loss scale
        and the ranks' sum undone (the very value `gradient_multiplier` gives then)."""
        return gradient_multiplier(self.scaler.scale * self.collectives.world_size, 0.0, 0.0)[0]

    def _step_during_backward(self, unit: UnitState) -> None:
        """overlap 'backward' (transfer worker): the unit's gradients are final, step it now
        (speculatively, into its spare state, when the factor needs the global norm: a unit
        without a spare state, or with non-finite gradients, waits for step())."""
        if self.schedule.context.backward_failed:
            return  # its gradients may be incomplete: the failure decides what becomes of the window
        finite = unit.grad_sq_norm is not None and math.isfinite(unit.grad_sq_norm)
        # read when the window's last backward began, before any of its units could be final
        assert self._window_hypers is not None
        if self.policy.speculative:
            if finite and unit.spare_state and unit.grads_in_window and unit.index not in self._speculated:
                self._begin_steps([unit])
                self._speculated[unit.index] = unit
                self.stepping.submit([unit], self._window_hypers, StepMode.SPECULATE)
            return
        if not finite:
            self._nonfinite_units.append(unit.spec.name)
            return
        self._begin_steps([unit])
        self._stepped_in_backward.append(unit)
        self.stepping.submit([unit], self._window_hypers)

    # ---- step --------------------------------------------------------------------------
    @property
    def optimizer(self) -> EngineOptimizer:
        """The engine as a torch.optim.Optimizer (for LR schedulers and trainers; built on first
        use, see offload.optim.hyperparameters)."""
        return self.hyper.optimizer(self)

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups' dicts (params, lr, betas, eps, weight_decay), as engine.optimizer holds them."""
        return self.hyper.param_groups

    @property
    def lr(self) -> float:
        """The learning rate (of every parameter group; an error when the groups differ: read
        engine.optimizer.param_groups then). Setting it sets every group's."""
        return self.hyper.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.hyper.lr = value

    def _drain(self) -> None:
        """Waits for every gradient transfer and optimizer step in flight; re-raises their errors."""
        self.gradients.wait_all()
        self.stepping.wait()

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
        self._finish_abandoned_backward()
        self._refuse_partly_stepped()
        self._refuse_stray_grads()
        if self.micro_steps == 0 or self.micro_steps % self.config.gradient_accumulation_steps != 0:
            return False
        if self.micro_steps == self._stepped_at_micro:
            return False
        self.hyper.check_untouched()
        self._drain()
        # the window is decided from here on (stepped, skipped or refused); an interrupt in the
        # wait above leaves it open, and the next step() takes it again
        self._stepped_at_micro = self.micro_steps
        window = [unit for unit in self.units if unit.window_started]
        if self.policy.steps_in_backward and not self.policy.speculative:
            return self._finish_window_stepped_in_backward(window)
        try:
            norms = {}
            for unit in window:
                if unit.grad_sq_norm is None:
                    unit.grad_sq_norm = self.store.grad_sq_norm(unit)
                norms[unit.index] = unit.grad_sq_norm
            local = sum(norms.values())
            (total,) = self.collectives.sum_host([local], what="the global gradient norm")
        except BaseException:
            # the window stays unstepped, as without speculation: so do its speculated units
            self._abandon_speculation("step() failed before it knew the global norm")
            raise
        multiplier, norm = gradient_multiplier(
            self.scaler.scale * self.collectives.world_size, total, self.config.gradient_clipping
        )
        self.last_grad_norm = norm
        speculated, self._speculated = list(self._speculated.values()), {}
        window_hypers, self._window_hypers = self._window_hypers, None
        if not math.isfinite(norm):
            bad = [unit.spec.name for unit in window if not math.isfinite(norms[unit.index])]
            if speculated:
                self.speculation_counts["skipped" if self.config.precision == "fp16" else "refused"] += 1
            self._take_back(speculated, restore=True)
            self._discard_window()
            if self.config.precision == "fp16":
                self.scaler.update(overflow=True)
                self.skipped_steps += 1
                logger.warning(
                    "offload: fp16 gradient overflow at step %d; step skipped, loss scale now %g",
                    self.global_steps,
                    self.scaler.scale,
                )
                return False
            raise NonFiniteError(
                f"non-finite gradients (norm {norm}) in {', '.join(bad) or 'other ranks'} at step {self.global_steps}: "
                "the step was skipped and the weights are unchanged; lower the learning rate, check the data, or enable clipping"
            )
        hypers = self.hyper.step_hypers(multiplier)
        if speculated:
            # the speculative steps stand if they used this very factor and hyperparameters
            # (read when the window's last backward began: an lr set since is a redo too)
            used = [dataclasses.replace(h, grad_multiplier=multiplier) for h in window_hypers or []]
            clipped = multiplier != self._unclipped_multiplier()
            if not clipped and used == hypers:
                self._commit(speculated)
                self.speculation_counts["committed"] += 1
            else:
                self._take_back(speculated, restore=False)
                self.speculation_counts["redone"] += 1
                self._log_redo(len(speculated), clipped=clipped)
        if self.config.precision == "fp16":
            self.scaler.update(overflow=False)
        self.global_steps += 1
        order = step_order(self.forward_order.recorded, len(self.units))
        self._submit_steps([self.units[i] for i in order if self.units[i].window_started], hypers)
        return True

    def _commit(self, speculated: list[UnitState]) -> None:
        """The speculative steps stand (the factor they used is the true one): each unit's spare
        state becomes its state, and its window ends."""
        events = self.schedule.context.events
        self.weights.invalidate()
        for unit in speculated:
            unit.commit_spare()
            unit.end_window()
            events.record("step_commit", unit.index)

    def _take_back(self, speculated: list[UnitState], *, restore: bool) -> None:
        """The speculative steps do not stand: their states are left in the spare buffers and
        their step counts undone. `restore`: no step follows (skipped, refused, or the window
        abandoned), so the 16-bit weights they published are cast again from the untouched
        masters (and waited for); otherwise the units stay in the window and step again from
        their old state."""
        if not speculated:
            return
        events = self.schedule.context.events
        self.weights.invalidate()
        for unit in speculated:
            unit.step_count -= 1
            events.record("step_take_back", unit.index)
        if restore:
            self._begin_steps(speculated)
            self.stepping.submit(speculated, (), StepMode.RESTORE)
            self.stepping.wait()

    def _log_redo(self, count: int, *, clipped: bool) -> None:
        logger.info(
            "offload: step %d %s: the %d units stepped during backward step again from their old state "
            "(%d of %d speculative windows redone so far)",
            self.global_steps,
            "clips the gradients" if clipped else "has other hyperparameters than its backward began with",
            count,
            self.speculation_counts["redone"],
            sum(self.speculation_counts.values()),
        )

    def _abandon_speculation(self, why: str) -> None:
        """A window's speculative steps that will not be decided by step() (its backward, or
        step() itself, failed): the work in flight is settled and they are taken back, leaving
        the units as a run without speculation would (not stepped). Errors of the settled work
        are logged: the failure being raised is the one to report."""
        if not self.policy.speculative:
            return
        # first every hand-off in flight: the transfer worker may still submit speculative steps
        for failure in self._settle():
            logger.warning("offload: %s; discarding failed work in flight: %s", why, failure)
        self._take_back_undecided(why)

    def _take_back_undecided(self, why: str) -> None:
        """The speculative steps of a window step() will not decide (the work in flight is
        settled already), taken back."""
        if not self._speculated:
            return
        speculated, self._speculated = list(self._speculated.values()), {}
        logger.warning("offload: %s; the %d units stepped speculatively are taken back", why, len(speculated))
        self._take_back(speculated, restore=True)

    def _finish_window_stepped_in_backward(self, window: list[UnitState]) -> bool:
        nonfinite, self._nonfinite_units = self._nonfinite_units, []
        if self.collectives.ranks_with(bool(nonfinite), what="the non-finite gradient check") and not nonfinite:
            nonfinite = ["units on other ranks"]
        if nonfinite:
            self._discard_window()
            raise NonFiniteError(
                f"non-finite gradients in {', '.join(nonfinite)} at step {self.global_steps}: those units were not "
                "stepped (with overlap 'backward' the other units already were); lower the learning rate or check the data"
            )
        hypers = self._window_hypers or self.hyper.step_hypers(self._unclipped_multiplier())
        self._window_hypers = None
        self.global_steps += 1
        self._submit_steps([unit for unit in window if unit.window_started], hypers)
        return True

    def _begin_steps(self, units: list[UnitState]) -> None:
        """Units about to be submitted to the optimizer worker: their step begins (weights
        version, step_done cleared), a gather follows it where the schedule needs one, and the
        weights kept for state-dict reads are dropped."""
        context = self.schedule.context
        self.weights.invalidate()
        for unit in units:
            unit.begin_step()
            context.events.record("step_begin", unit.index)
            if context.gathers_after_step:
                unit.needs_gather = True

    def _submit_steps(self, units: list[UnitState], hypers: list[StepHyper]) -> None:
        """The window's units step on the optimizer worker; the overlap policy says whether
        step() waits for them. The config's schedule (if any) moves on to the next step."""
        self._begin_steps(units)
        self.stepping.submit(units, hypers)
        self.hyper.apply_schedule(self.global_steps)
        self.policy.on_window_end(self.stepping)

    def _refuse_stray_grads(self) -> None:
        stray = self.schedule.context.stray_grads
        if stray:
            names = sorted(set(stray))
            stray.clear()
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise OffloadError(
                f"gradients of {shown} came from a backward that never reached the model's outputs (torch.autograd.grad, "
                "or a loss of parameters read outside engine(...)), which the engine cannot follow; they were dropped. "
                "Compute the loss from what engine(...) returns and call loss.backward() or engine.backward(loss)"
            )

    def _discard_window(self) -> None:
        for unit in self.units:
            unit.end_window()

    # ---- weights out (offload.runtime.weights_out reads them) ------------------------------------
    def param16_shard(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's 16-bit shard of `unit`, wherever its home is."""
        return self.weights.param16_shard(unit)

    def _fp32_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 weights of one parameter (the model's state_dict hooks)."""
        self._check_open()
        return self.weights.param_weight(param)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and the model's buffers) under model.state_dict()'s keys, on the CPU."""
        self._check_open()
        return self.weights.state_dict(self.model)

    def pop_timings(self) -> dict[str, float]:
        """Seconds per phase since the last call (forward, backward, step, wait_fetch, wait_step)."""
        timings = dict(self.timings)
        for key in self.timings:
            self.timings[key] = 0.0
        return timings

    # ---- checkpoints (offload.checkpoint.engine_state does the work) --------------------------------
    def save_checkpoint(self, path, client_state: dict | None = None, **kwargs):
        """Saves everything needed to resume exactly; see offload.checkpoint.engine_state.save."""
        from offload.checkpoint import engine_state as checkpoint

        self._check_open()
        self._refuse_partly_stepped()
        self._drain()
        return checkpoint.save(self, path, client_state=client_state, **kwargs)

    def load_checkpoint(self, path, **kwargs) -> dict:
        """Restores a checkpoint saved by any world size and placement; returns its client_state."""
        from offload.checkpoint import engine_state as checkpoint

        self._check_open()
        # the load replaces every weight and state: work in flight that failed (a swap I/O
        # error in the last step, say) is waited for and discarded, so the load is the way back;
        # a swap file whose write failed stays unreadable until the load rewrites it
        for failure in self._settle():
            logger.warning("offload: load_checkpoint discards failed work in flight: %s", failure)
        # speculative steps of an unfinished window, taken back first: a load that fails leaves
        # the engine as it would be without them
        self._take_back_undecided("load_checkpoint in the middle of a window")
        self._window_hypers = None
        client_state = checkpoint.load(self, path, **kwargs)
        self._partly_stepped = []
        return client_state

    def _settle(self) -> list[BaseException]:
        """Waits for every gradient transfer, optimizer step and swap operation in flight (also
        those a failed step left in wait lists); returns their errors."""
        failures: list[BaseException] = []
        for wait in (self.gradients.wait_all, self.stepping.wait):
            try:
                wait()
            except Exception as error:  # noqa: BLE001 (returned to the caller, who decides)
                failures.append(error)
        if self.store.swap is not None:
            failures.extend(self.store.swap.settle())
        return failures

    def training_state(self) -> dict:
        """The engine's counters and loss scale: what a checkpoint saves beside the tensors."""
        norm = self.last_grad_norm
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "stepped_at_micro": self._stepped_at_micro,
            **self.hyper.state(),
            "loss_scaler": self.scaler.state_dict(),
            "last_grad_norm": norm if norm is None or math.isfinite(norm) else None,
        }

    def load_training_state(self, state: dict) -> None:
        """Restores what `training_state()` gave."""
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state["skipped_steps"]
        self._stepped_at_micro = state["stepped_at_micro"]
        self.hyper.load_state(state, self.global_steps)
        self.scaler.load_state_dict(state["loss_scaler"])
        self.last_grad_norm = state["last_grad_norm"]
        self.weights.invalidate()

    def memory_report(self) -> dict:
        """Bytes the engine holds now and at peak, per tier (device / host / nvme), by category;
        `optimizer_units`: the units whose optimizer state each tier holds, and why."""
        report = self.ledger.report()
        report["optimizer_units"] = {
            unit.spec.name: {"tier": unit.optimizer_tier.value, "why": reason}
            for unit, reason in zip(self.units, self.optimizer_plan.reasons)
        }
        return report

    # ---- end ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this engine is closed; create a new one with offload.initialize")

    def close(self, restore_weights: bool = True) -> None:
        """Finishes pending work, frees host buffers and removes swap files.

        With `restore_weights`, the model's parameters are left holding the final fp32 weights
        on the CPU (a full fp32 copy of the model in RAM) and its buffers where they were before
        `initialize`; without, the parameters are left empty."""
        if self._closed:
            return
        try:
            self._drain()
            final = self.consolidated_state_dict() if restore_weights else None
        finally:
            self._closed = True
            OPEN_ENGINES.discard(self)
            self.weights.invalidate()
            self.schedule.remove()
            self._state_dict_hooks.remove()
            self.transfer.shutdown(wait=True)
            self.optimizer_worker.shutdown(wait=True)
            try:
                # the streams' queued copies read and write host buffers the store frees
                self.device.close()
            finally:
                self.store.close()
        if final is not None:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, param in params.items():
                    if name in final:
                        param.data = final[name]
                for module, name, home in self._buffer_homes:
                    buffer = getattr(module, name)
                    if buffer is not None:
                        setattr(module, name, buffer.to(home))
        else:
            for unit in self.units:
                self.residency.free(unit)
            # no parameter keeps a view of freed storage: the model is marked, and says why if used
            RELEASED.mark(self.model)

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


def check_has_storage(name: str, param: torch.Tensor) -> None:
    """A parameter whose storage is smaller than its view (freed by an engine, resized by
    hand) would be read out of bounds: an error instead."""
    if param.is_meta:
        return
    needed = (param.storage_offset() + param.numel()) * param.element_size() if param.numel() else 0
    if param.untyped_storage().nbytes() < needed:
        raise OffloadError(
            f"parameter {name!r} has {param.untyped_storage().nbytes()} bytes of storage for a view of {needed}: its "
            "memory was freed (by an offload engine that owned it, or its storage resized); rebuild or reload the model"
        )
