"""Construction and teardown of an engine's parts: the wiring of `initialize`, apart from run time.

`build` makes, in order: the process group and the device (offload.platform.choose), the units
and their flat layouts, the overlap policy, the optimizer plan and the tier store, the two
workers (transfer, optimizer), the stepper, residency, the gradient path, the gradient window,
the weights reader and the per-unit schedule with the model's hooks; then every unit's initial
state goes to its tiers (`_adopt_all`). Parts report to the gradient window or to the schedule's
context, never back up into the Engine: the few calls that go the other way (the gradient path's
`on_final`, residency's `agree_before`, the schedule's `on_outside_backward`) are bound to the
window or the context here. `Runtime.shutdown` is the teardown half of `close()`, also run when a
start fails: nothing half-built outlives it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.config.placement import OptimizerTier, ParamTier
from offload.config.schema import Config
from offload.config.sizes import parse_size
from offload.config.state_layout import StateBytes, state_bytes_for
from offload.model.materialize import (
    check_has_storage,
    give_storage,
    has_meta_state,
    mapped_zeros,
    materialize_unit_params,
)
from offload.model.unit_state import UnitState
from offload.model.units import build_units, plan_flat_layout, single_unit_warning
from offload.optim import kernels
from offload.optim.hyperparameters import GroupHyperparameters
from offload.plan.optimizer_plan import OptimizerPlan, device_room, engine_device_bytes, factor_needs_norm
from offload.plan.room import plan_optimizer
from offload.plan.step_split import StepWindow, candidates_for, step_traffic
from offload.platform.choose import device_choice, make_device
from offload.platform.collectives import Collectives
from offload.platform.device import Device
from offload.platform.process import DrivingThread, OwningProcess
from offload.platform.process import driven as driven  # for the engine's calls, which enter Runtime.driver
from offload.runtime.device_step import DeviceStepper
from offload.runtime.gradients import GradientOffload
from offload.runtime.overlap import OverlapPolicy, Stepping, overlap_policy
from offload.runtime.residency import Residency
from offload.runtime.schedule import Schedule, ScheduleContext
from offload.runtime.step_rates import SplitPlanner, step_rates
from offload.runtime.stepper import UnitStepper
from offload.runtime.weights_in import LoadStats, PretrainedWeights, ShardValues, open_pretrained
from offload.runtime.weights_out import WeightsReader
from offload.runtime.window import GradientWindow
from offload.storage.memory import TierLedger
from offload.storage.state_codec import make_codec
from offload.storage.tiers import TierStore, default_run_name

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


class _Later:
    """What two parts call that is made after them: the schedule's context (residency agrees a
    unit's collective there) and the gradient window (the gradient path reports final units)."""

    context: ScheduleContext
    window: GradientWindow


@dataclass
class Runtime:
    """An engine's parts, as `build` wired them (who fills and waits on each: docs/design.md)."""

    model: nn.Module
    config: Config
    collectives: Collectives
    device: Device
    compute_dtype: torch.dtype
    ledger: TierLedger
    units: list[UnitState]
    policy: OverlapPolicy
    optimizer_plan: OptimizerPlan
    store: TierStore
    transfer: ThreadPoolExecutor
    optimizer_worker: ThreadPoolExecutor
    # seconds spent since the last `pop_timings()`, by phase; `wait_fetch` and `wait_step` are
    # the main thread's waits for weights to arrive and for the CPU step to finish
    timings: dict[str, float]
    stepper: UnitStepper
    stepping: Stepping
    residency: Residency
    gradients: GradientOffload
    hyper: GroupHyperparameters
    weights: WeightsReader
    window: GradientWindow
    schedule: Schedule | None = None
    # overlap `auto`'s split: what it chose, and the device lane's worker and stepper (None
    # when every unit steps on the CPU)
    split: SplitPlanner | None = None
    device_lane: tuple[ThreadPoolExecutor, DeviceStepper] | None = None
    # what parts made early call on parts made later
    later: _Later = field(default_factory=_Later)
    # the process all of this exists in, and the thread inside an engine call (offload.platform.process)
    process: OwningProcess = field(default_factory=OwningProcess)
    driver: DrivingThread = field(init=False)
    # module buffers moved to the device, and where they were (close() puts them back)
    buffer_homes: list[tuple[nn.Module, str, torch.device]] = field(default_factory=list)
    # the dtype close() hands each frozen parameter back in, by name: its own at initialize, or
    # the file's where pretrained weights filled it
    frozen_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    # what this rank read of pretrained weights at start (its shards' byte ranges and the buffers)
    weights_load: LoadStats | None = None

    def __post_init__(self) -> None:
        self.driver = DrivingThread(self.process)

    # ---- what a checkpoint reaches (offload.checkpoint.engine_state.CheckpointedEngine) ----
    @property
    def global_steps(self) -> int:
        return self.window.global_steps

    def training_state(self) -> dict:
        return self.window.training_state()

    def load_training_state(self, state: dict) -> None:
        self.window.load_training_state(state)

    def check_training_state(self, state: dict) -> None:
        self.window.check_training_state(state)

    def before_load(self) -> None:
        self.window.before_load()

    def after_load(self) -> None:
        self.window.after_load()

    def load_failed(self, reason: str) -> None:
        self.window.load_failed(reason)

    def param16_shard(self, unit: UnitState) -> torch.Tensor:
        return self.weights.param16_shard(unit)

    def drop_device_copies(self) -> None:
        self.residency.drop_device_copies()

    def replace_device_weights(self, unit: UnitState, shard32: torch.Tensor) -> None:
        self.residency.replace_weights(unit, shard32)

    def undo_write(self, unit: UnitState) -> None:
        """A write inside params_on_device: `param: none` device weights are written again from
        this rank's fp32 weights (an offloaded unit's written copy was freed with its hold, so
        its master is not read)."""
        if not self.residency.offloaded:
            self.residency.replace_weights(unit, self.weights.weights_shard(unit))

    def shutdown(self) -> None:
        """Stops the workers, waits for the device's streams and frees the store's host buffers
        and swap files (the streams' queued copies read and write buffers the store frees)."""
        self.transfer.shutdown(wait=True)
        self.optimizer_worker.shutdown(wait=True)
        if self.device_lane is not None:
            self.device_lane[0].shutdown(wait=True)
            self.device_lane[1].stop_writing()
        try:
            self.device.close()
            if self.device_lane is not None:
                self.device_lane[1].close()
        finally:
            self.store.close()


def _units(model: nn.Module, config: Config, groups: list[dict], world: int, rank: int) -> list[UnitState]:
    """The model cut into units, each with its flat layout (trainable params first: the frozen
    ones carry no optimizer state, units.FlatLayout) and its params' groups."""
    specs = build_units(model, config.wrap.module_classes, config.wrap.min_params)
    group_of = {id(param): index for index, group in enumerate(groups) for param in group["params"]}
    units = []
    for spec in specs:
        layout = plan_flat_layout([p.numel() for p in spec.params], world, [p.requires_grad for p in spec.params])
        units.append(
            UnitState(
                spec,
                layout,
                optimizer_numel=layout.optimizer_numel(rank),
                param_groups=tuple(group_of[id(p)] for p in spec.params),
            )
        )
    warning = single_unit_warning(specs, ParamTier(config.offload.param).offloaded)
    if warning:
        logger.warning(warning)
    return units


def _platform(config: Config, process_group, device) -> tuple[Collectives, Device]:
    """The process group first: started from torchrun's environment if needed (which also picks
    this rank's CUDA device before the device reads the current one); then the device."""
    choice = device_choice(device, os.environ)
    if isinstance(choice, Device):
        collectives = Collectives(process_group, config.collective_timeout, device=choice.torch_device)
    else:
        collectives = Collectives(process_group, config.collective_timeout, device="cpu" if choice == "checked" else choice)
    made = make_device(choice)
    overlapped = made.is_cuda and config.overlap != "none"
    kernels.set_num_threads(
        config.optimizer.threads or adam_threads(len(os.sched_getaffinity(0)), os.environ, overlaps_accelerator=overlapped)
    )
    return collectives, made


def _log_start(config: Config, units: list[UnitState], collectives: Collectives) -> None:
    logger.info(
        "offload: %d units (largest %.1fM params), precision %s, param on %s, optimizer on %s (moments %s), "
        "overlap %s, CPU Adam threads %d, rank %d/%d",
        len(units),
        max(u.spec.numel for u in units) / 1e6,
        config.precision,
        config.offload.param,
        config.offload.optimizer,
        config.optimizer.state_precision,
        config.overlap,
        kernels.get_num_threads(),
        collectives.rank,
        collectives.world_size,
    )
    if not any(param.requires_grad for unit in units for param in unit.spec.params):
        # inference on the engine is valid; training it is not, and engine.backward says so
        logger.info("offload: no parameter of the model requires grad: nothing to train, forward (inference) only")


def _store(config: Config, units, collectives: Collectives, device: Device, ledger, policy, run_name, compute_dtype):
    """The optimizer plan (where each unit's state goes) and the tier store that holds it."""
    local_rank = int(os.environ.get("LOCAL_RANK", collectives.rank))
    state = state_bytes(config, compute_dtype)
    plan = plan_optimizer(
        config,
        units,
        compute_dtype=compute_dtype,
        staged_device_copies=device.separate_memory,
        local_rank=local_rank,
        device_memory=device.memory(),
        state=state,
    )
    split = _plan_split(config, units, device, plan.tiers, policy, state, compute_dtype, collectives.rank)
    store = TierStore(
        units,
        config,
        compute_dtype=compute_dtype,
        pin=device.pin_host_memory,
        staged_device_copies=device.separate_memory,
        ledger=ledger,
        rank=collectives.rank,
        local_rank=local_rank,
        # one run directory for all ranks (rank 0's name), each rank in its rank<r>/ below it
        run_name=collectives.broadcast_object(run_name or default_run_name(), what="the swap run name"),
        optimizer_tiers=plan.tiers,
        device=device.torch_device,
        speculate=policy.speculative,
        state=state,
    )
    return plan, store, split


def _plan_split(config: Config, units, device: Device, tiers, policy, state: StateBytes, compute_dtype, rank: int):
    """Overlap `auto`: which units step on the device (plan.step_split, from the rates measured
    here or declared by OFFLOAD_STEP_RATES); marks them (`UnitState.steps_on_device`). None when
    the config asks for another schedule, the weights are on NVMe, or nothing can move."""
    eligible = [tier is OptimizerTier.HOST for tier in tiers]
    if policy.name != "auto" or ParamTier(config.offload.param) is ParamTier.NVME or not any(eligible):
        return None
    codec = make_codec(state, compute_dtype, rank, config.optimizer.rounding_seed)
    rates, backward = step_rates(device, codec, codec.grad_dtype, os.environ)
    if rates is None:
        return None
    compute_bytes = torch.empty(0, dtype=compute_dtype).element_size()
    offloaded = ParamTier(config.offload.param).offloaded
    engine_bytes = engine_device_bytes(
        [unit.layout.padded_numel for unit in units],
        params_offloaded=offloaded,
        compute_bytes=compute_bytes,
        prefetch_depth=config.prefetch.depth,
    )
    room = device_room(cap=parse_size(config.offload.max_device_memory), memory=device.memory(), engine_bytes=engine_bytes)
    room -= sum(state.total_bytes(unit.optimizer_numel) for unit, tier in zip(units, tiers) if tier is OptimizerTier.DEVICE)
    traffic = step_traffic(
        moment_bytes=state.moment_per_element,
        grad_bytes=state.gradient_bytes,
        compute_bytes=compute_bytes,
        param_offloaded=offloaded,
    )
    numels = [unit.optimizer_numel for unit in units]
    # `speculation_memory: 0`: no unit on the CPU has a spare state; only the device's speculate
    no_spares = parse_size(config.offload.speculation_memory) == 0
    planner = SplitPlanner(
        units,
        eligible,
        candidates_for(numels, eligible, traffic, max(0, room)),
        rates,
        traffic,
        max(0, room),
        backward,
        speculating=StepWindow.DEVICE_SPECULATIVE if no_spares else StepWindow.SPECULATIVE,
    )
    planner.use(planner.speculating)
    return planner


def state_bytes(config: Config, compute_dtype: torch.dtype) -> StateBytes:
    """The stored width of each optimizer state kind: the config's moment precision, and the
    gradient in its 16-bit arrival dtype where nothing is added into it (config.state_layout)."""
    return state_bytes_for(config, torch.empty(0, dtype=compute_dtype).element_size())


def build(
    model: nn.Module,
    config: Config,
    groups: list[dict],
    *,
    process_group,
    device,
    run_name,
    weights: str | os.PathLike | None = None,
    weights_strict: bool = True,
) -> Runtime:
    """Every part of an engine over `model`, wired, with each unit's initial state on its tiers
    and the model's hooks installed (see the module docstring). `weights`: pretrained weights
    (offload.runtime.weights_in), checked whole against the model before anything is made."""
    pretrained = open_pretrained(weights, model, strict=weights_strict, io=config.io) if weights is not None else None
    named = model.named_parameters(remove_duplicate=False)
    frozen = {name: p.dtype for name, p in named if not p.requires_grad and p.is_floating_point()}
    try:
        runtime = _build(
            model, config, groups, process_group=process_group, device=device, run_name=run_name, pretrained=pretrained
        )
    finally:
        stats = pretrained.close() if pretrained is not None else None
    runtime.weights_load = stats
    runtime.frozen_dtypes = {**frozen, **runtime.frozen_dtypes}
    return runtime


def _build(model, config, groups, *, process_group, device, run_name, pretrained: PretrainedWeights | None) -> Runtime:
    collectives, made = _platform(config, process_group, device)
    compute_dtype = COMPUTE_DTYPES[config.precision]
    units = _units(model, config, groups, collectives.world_size, collectives.rank)
    _log_start(config, units, collectives)
    policy = overlap_policy(config.overlap, factor_needs_norm=factor_needs_norm(config.gradient_clipping, config.precision))
    ledger = TierLedger()
    plan, store, split = _store(config, units, collectives, made, ledger, policy, run_name, compute_dtype)
    runtime = _wire(model, config, groups, collectives, made, compute_dtype, ledger, units, policy, plan, store, split)
    try:
        _adopt_all(runtime, pretrained)
        _move_buffers(runtime)
    except BaseException:
        # nothing half-built outlives a failed start: threads stop, host buffers and swap files go
        runtime.shutdown()
        raise
    _install_schedule(runtime)
    return runtime


def _wire(model, config, groups, collectives, made, compute_dtype, ledger, units, policy, plan, store, split) -> Runtime:
    """The workers and the run-time parts over the store, each bound to what it reports to."""
    later = _Later()

    def agree_before(op, unit: UnitState) -> None:
        later.context.agree(op, unit.index, [])

    transfer = ThreadPoolExecutor(1, thread_name_prefix="offload-transfer")
    optimizer_worker = ThreadPoolExecutor(1, thread_name_prefix="offload-step")
    timings: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
    stepper = UnitStepper(
        store, made, collectives.rank, prefetch_next_step=not policy.steps_in_backward or policy.defers_to_forward
    )
    device_lane = None
    if split is not None and any(split.candidates):
        candidates = [unit for unit, candidate in zip(units, split.candidates) if candidate]
        device_stepper = DeviceStepper(store, made, collectives.rank, candidates, ledger=ledger)
        device_lane = (ThreadPoolExecutor(1, thread_name_prefix="offload-device-step"), device_stepper)
    stepping = Stepping(optimizer_worker, stepper, device_lane)
    residency = Residency(
        units,
        device=made,
        store=store,
        transfer=transfer,
        collectives=collectives,
        ledger=ledger,
        param_tier=store.param_tier,
        compute_dtype=compute_dtype,
        agree_before=agree_before,
    )
    gradients = GradientOffload(
        device=made,
        collectives=collectives,
        store=store,
        ledger=ledger,
        transfer=transfer,
        compute_dtype=compute_dtype,
        timings=timings,
        on_final=lambda unit: later.window.step_during_backward(unit),
    )
    hyper = GroupHyperparameters(groups, config.optimizer, config.scheduler)
    weights = WeightsReader(units, store, collectives, settle=lambda: later.window.drain())
    later.window = GradientWindow(
        config=config,
        units=units,
        policy=policy,
        hyper=hyper,
        collectives=collectives,
        store=store,
        stepping=stepping,
        gradients=gradients,
        weights=weights,
        optimizer_worker=optimizer_worker,
        timings=timings,
    )
    runtime = Runtime(
        model, config, collectives, made, compute_dtype, ledger, units, policy, plan, store, transfer, optimizer_worker,
        timings, stepper, stepping, residency, gradients, hyper, weights, later.window, later=later, device_lane=device_lane,
        split=split,
    )  # fmt: skip
    later.window.split = split
    return runtime


def _install_schedule(runtime: Runtime) -> None:
    """The per-unit schedule and the model's hooks, last: from here on the model's forward and
    backward drive the engine."""
    context = ScheduleContext(
        units=runtime.units,
        residency=runtime.residency,
        gradients=runtime.gradients,
        collectives=runtime.collectives,
        stepping=runtime.stepping,
        policy=runtime.policy,
        prefetch_depth=runtime.config.prefetch.depth,
        timings=runtime.timings,
        on_outside_backward=runtime.window.outside_backward_began,
        before_read_between_steps=runtime.window.before_read_between_steps,
    )
    offloaded, distributed = runtime.residency.offloaded, runtime.collectives.is_distributed
    schedule = Schedule(
        runtime.model,
        context,
        watch_external_reads=offloaded or runtime.config.overlap != "none" or distributed,
        process=runtime.process,
        driver=runtime.driver,
    )
    runtime.stepper.events = context.events
    if runtime.device_lane is not None:
        runtime.device_lane[1].events = context.events
    runtime.later.context = context
    schedule.install()
    runtime.window.schedule = runtime.schedule = schedule


def _adopt_all(runtime: Runtime, pretrained: PretrainedWeights | None = None) -> None:
    """Adopts every unit in index order. Unit i + 1's values are made (materialised from the
    meta device and gathered into one flat fp32 buffer; or, from pretrained weights, this rank's
    shard read from the files) on a helper thread while unit i's go to their tiers and the
    device, so the single-threaded random init of a meta-built model, or the reads, overlap the
    copies. Units are made in order by that one thread: the random stream, and so the weights,
    are those of a model initialised unit by unit; at most two units' fp32 values exist at once."""
    if not runtime.units:
        return
    model, rank = runtime.model, runtime.collectives.rank
    if pretrained is not None:
        pretrained.load_buffers(model)
        runtime.frozen_dtypes.update(pretrained.frozen_dtypes(model))

    units = runtime.units

    def make(i: int) -> torch.Tensor | ShardValues:
        if pretrained is None:
            return _unit_values(model, units[i])
        return pretrained.unit_values(model, units[i], rank, units[i + 1] if i + 1 < len(units) else None)

    with ThreadPoolExecutor(1, thread_name_prefix="offload-materialize") as maker:
        upcoming = maker.submit(make, 0)
        for i, unit in enumerate(units):
            values = upcoming.result()
            if i + 1 < len(units):
                upcoming = maker.submit(make, i + 1)
            _adopt(runtime, unit, values)
            del values  # unmapped here, before the next unit's is taken


def _unit_values(model: nn.Module, unit: UnitState) -> torch.Tensor:
    """The unit's initial weights as one flat fp32 buffer of its padded layout (the
    materialize thread; touches only this unit's params and its territory's modules)."""
    if has_meta_state(model, unit.spec):
        # a model built on the meta device gets real values one unit at a time, so the
        # whole fp32 model never exists in RAM at once
        materialize_unit_params(model, unit.spec)
    for name, param in zip(unit.spec.param_names, unit.spec.params):
        check_has_storage(name, param)
    # its own mapping, unmapped when dropped (a heap block per unit would stay in the process)
    flat32 = mapped_zeros(unit.layout.padded_numel, torch.float32)
    with torch.no_grad():
        for param, offset in zip(unit.spec.params, unit.layout.offsets):
            flat32[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
    return flat32


def _adopt(runtime: Runtime, unit: UnitState, values: torch.Tensor | ShardValues) -> None:
    """Moves the unit's params into its flat buffer and stores its initial state on the tiers.
    `values`: the whole flat fp32 buffer (`_unit_values`; every rank takes rank 0's), or this
    rank's shard of it (pretrained weights: `PretrainedWeights.unit_values`)."""
    layout, collectives = unit.layout, runtime.collectives
    start, end = layout.shard_range(collectives.rank)
    if isinstance(values, ShardValues):
        values.agree(unit, collectives)
        shard = values.shard32
    else:
        # every rank starts from rank 0's weights, whatever seed each rank built its model with
        collectives.broadcast_host(values, src=0, what=f"initial weights of unit {unit.spec.name}")
        shard = values[start:end]
    runtime.store.initialise(unit, shard)
    unit.device_flat = runtime.device.empty(layout.padded_numel, runtime.compute_dtype)
    runtime.ledger.allocate("device", layout.padded_numel * unit.device_flat.element_size(), "param")
    if not isinstance(values, ShardValues):
        unit.device_flat.copy_(values)
    elif runtime.residency.offloaded:
        pass  # freed below, unwritten: the unit's first use fetches it from its home tier
    elif not collectives.is_distributed:
        unit.device_flat.copy_(shard)
    else:
        # `param: none` keeps the whole unit on every rank's device: the ranks' shards, gathered
        unit.device_flat[start:end].copy_(shard)
        collectives.all_gather_flat(unit.device_flat, unit.device_flat[start:end].clone(), what=f"weights of {unit.spec.name}")
    for param, offset in zip(unit.spec.params, layout.offsets):
        if param.is_meta:
            # filled from pretrained weights, it never had storage: a one-element stand-in first
            # (set_data refuses a meta tensor), so that, as every param, it takes the view as its
            # .data and keeps its own version counter (a fetch writing the buffer bumps none)
            give_storage(param, torch.zeros((), dtype=param.dtype).expand(param.numel()))
        param.data = unit.device_flat[offset : offset + param.numel()].view(param.shape)
    unit.resident = True
    if runtime.residency.offloaded:
        runtime.residency.free(unit)


def _move_buffers(runtime: Runtime) -> None:
    """Module buffers (not parameters) follow the model to the device; `close()` puts them
    back where they were."""
    for module in runtime.model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.device != runtime.device.torch_device:
                runtime.buffer_homes.append((module, name, buffer.device))
                setattr(module, name, buffer.to(runtime.device.torch_device))
