"""The per-unit schedule: what happens to each unit during a micro-step, in one place.

(Slightly over 600 lines: the point of this module is that every transition of a unit, and the
root's, can be read in one file.)

A unit goes through these transitions (module hooks call them; `UnitSchedule` implements them):

  pre_forward    take a hold: the unit's 16-bit weights on the device, current (fetched, or
                 waited for its step); fetch the next `prefetch.depth` units of the recorded order
  post_forward   give the hold back (an offloaded unit's device copy is freed at zero holders);
                 hook its outputs so that its backward announces itself
  pre_backward   take a backward hold (fetched again if it was freed); fetch ahead along the
                 recorded backward order
  grads_final    every trainable param's gradient has accumulated: give the backward holds
                 back and hand the gradients off (gradients.py), in the agreed order with
                 several ranks (rank_order.py); the overlap policy may step the unit right
                 after they land (overlap.py). A unit with frozen params keeps its weights
                 until the gradients of its inputs are computed (`inputs_done`): a frozen
                 param may still be needed after the last trainable one's gradient (a frozen
                 norm before trainable layers, a LoRA layer's frozen base weight)
  (step)         `Engine.step()` decides the window; the optimizer worker steps the unit and
                 publishes its new 16-bit weights (stepper.py), then sets `step_done`

The root unit (parameters outside every block: embeddings, head) opens and closes the model's
forward. Its post-forward also hooks the model's outputs: a backward that reaches them while
the engine did not start one (a plain `loss.backward()`) calls `ScheduleContext.on_outside_backward`,
which runs what `engine.backward` runs around autograd (the engine queues the end of it on
autograd's engine). A parameter gradient that arrives outside any backward the engine saw is
not handed off: it is recorded in `stray_grads` and `engine.step()` refuses with its name. A forward seen during backward is a recompute (activation checkpointing): its hold is a
backward hold, so a recompute that stops early cannot keep a unit resident. Each transition is
a `torch.profiler.record_function` range (`offload::pre_forward[3]`), so a profile shows the
pipeline. Everything here runs on the main thread, except what the transfer worker runs for
`GradientOffload` and the overlap policy.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

from offload.errors import ConcurrentUseError, OffloadError
from offload.model.unit_state import UnitState
from offload.platform.collectives import Collectives
from offload.platform.process import Driving, DrivingThread, OwningProcess
from offload.platform.rank_order import MISMATCH_HINT, Op, ReduceOrder
from offload.platform.rank_order import describe as describe_op
from offload.runtime.events import EntryKind, EventLog, Phase
from offload.runtime.gradients import GradientOffload
from offload.runtime.overlap import OverlapPolicy, Stepping
from offload.runtime.param_reads import ParamReads, ReadVerdict, describe_call, read_between_steps, read_verdict
from offload.runtime.prefetch import ExecutionOrder
from offload.runtime.residency import Residency, tensors_in

logger = logging.getLogger(__name__)


class CallHolds:
    """The backward holds one forward call of a unit with frozen params took (its recompute's,
    its backward's): given back when the gradients of that call's inputs are computed."""

    def __init__(self) -> None:
        self.held = 0


@dataclass(frozen=True)
class Entry:
    """A unit whose forward is running (the root is unit 0)."""

    unit: int
    kind: EntryKind
    # a unit with frozen params: the holds this call takes for backward (UnitSchedule.inputs_done)
    holds: CallHolds | None = field(default=None, compare=False)


@dataclass
class ScheduleContext:
    """Run-time state shared by every unit's schedule (one per engine; main thread only)."""

    units: list[UnitState]
    residency: Residency
    gradients: GradientOffload
    collectives: Collectives
    stepping: Stepping
    policy: OverlapPolicy
    prefetch_depth: int
    # seconds by phase since the engine's last pop_timings() (shared with the engine)
    timings: dict[str, float]
    # per unit, the indices of its params that require grad
    trainable: list[set[int]] = field(default_factory=list)
    # forwards with grad enabled this rank has started through engine(...), failed ones too:
    # each rank states the number at the start of every backward
    forwards_started: int = 0
    phase: Phase = Phase.IDLE
    forward_order: ExecutionOrder = field(default_factory=ExecutionOrder)
    backward_order: ExecutionOrder = field(default_factory=ExecutionOrder)
    # units whose forward is running, innermost last, each with who owns its hold
    entered: list[Entry] = field(default_factory=list)
    # units held because a param was read outside its unit's forward (until the end of backward)
    external_holds: set[int] = field(default_factory=set)
    # forward uses of each unit (with borrows and external reads) since the last backward
    uses: collections.Counter = field(default_factory=collections.Counter)
    # several ranks: the agreed order of this backward's reductions (rank_order.py)
    reduce_order: ReduceOrder | None = None
    # the root's forward holds, passed to the backward of each forward whose output needs grad
    root_holds_for_backward: int = 0
    # (ident, name) of the thread that ran the last forward: its micro-step (forward, loss code,
    # backward) is in progress until that backward ends (a read elsewhere meanwhile is refused)
    forward_thread: tuple[int, str] | None = None
    # whether the running backward ends a gradient window
    boundary_backward: bool = False
    # the running backward failed: gradients handed off from here on may be incomplete (set by
    # the main thread before the backward's end hands off what is left, read by the transfer
    # worker's overlap 'backward' steps; cleared when the next backward begins)
    backward_failed: bool = False
    # every unit's schedule, by unit index (set by Schedule)
    schedules: list = field(default_factory=list)
    events: EventLog = field(default_factory=EventLog)
    # called (inside autograd) when a backward reaches the model's outputs while the engine
    # did not start one: a plain loss.backward() (set by the engine)
    on_outside_backward: Callable[[], None] | None = None
    # called before a read of a parameter between steps (set by the engine: with overlap `auto`,
    # a window's speculative steps are taken back first when step() has not decided them)
    before_read_between_steps: Callable[[], None] | None = None
    # names of params whose gradient arrived outside any backward the engine saw (not handed off)
    stray_grads: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.agreement_width = max(1 + 2 * len(self.units), max(len(unit.spec.params) for unit in self.units))
        # param none with several ranks: a stepped unit's new shards are gathered at its next use
        self.gathers_after_step = not self.residency.offloaded and self.collectives.is_distributed

    def in_backward(self) -> bool:
        """Whether autograd is running a backward now: a forward seen now is a recompute."""
        return self.phase is Phase.BACKWARD or torch._C._current_graph_task_id() != -1

    def agreement_row(self, flags: list[int]) -> list[int]:
        """Every agreement row has the same length on every rank (a collective of other sizes
        would not pair up): the longest that any agreement needs."""
        return flags + [0] * (self.agreement_width - len(flags))

    def agree(self, op: Op, unit: int, flags: list[int]) -> list[int]:
        return self.collectives.agree((op, unit), self.agreement_row(flags), self.describe, MISMATCH_HINT)

    def describe(self, key: tuple[int, int]) -> str:
        return describe_op(key, [unit.spec.name for unit in self.units])


class UnitSchedule:
    """The transitions of one unit (see the module docstring), in the order they happen."""

    def __init__(self, unit: UnitState, context: ScheduleContext) -> None:
        self.unit = unit
        self.context = context
        self.index = unit.index
        # some params do not require grad: the last trainable gradient does not end the unit's backward
        self.has_frozen = len(context.trainable[unit.index]) < len(unit.spec.params)

    # ---- holds --------------------------------------------------------------------------
    def enter(self) -> None:
        """Holds the unit (and the units it borrows tied weights from) on the device."""
        context = self.context
        units = context.units
        started = time.perf_counter()
        waits_for_step = not self.unit.step_done.is_set()
        taken: list[UnitState] = []
        try:
            for borrowed in sorted(self.unit.spec.borrows):
                context.residency.acquire(units[borrowed])
                taken.append(units[borrowed])
            context.residency.acquire(self.unit)
            taken.append(self.unit)
            # a step that failed (its units' step_done are set all the same) is raised here,
            # before the unit runs on weights it did not finish
            context.stepping.raise_if_failed()
        except BaseException:
            for unit in reversed(taken):
                context.residency.release(unit)
            raise
        context.timings["wait_step" if waits_for_step else "wait_fetch"] += time.perf_counter() - started

    def leave(self) -> None:
        self.context.residency.release(self.unit)
        for borrowed in sorted(self.unit.spec.borrows):
            self.context.residency.release(self.context.units[borrowed])

    def release_backward_holds(self) -> None:
        while self.unit.backward_holds:
            self.unit.backward_holds -= 1
            self.leave()

    def release_after_grads(self) -> None:
        """The unit's trainable gradients are final: its weights are no longer needed, unless it
        has frozen params (then `inputs_done` or the end of backward gives the holds back)."""
        if not self.has_frozen:
            self.release_backward_holds()

    def watch_inputs(self, inputs) -> None:
        """Forward of a unit with frozen params (after `pre_forward`): when the gradients of its
        inputs are computed, this call's backward is over and the holds it took go back."""
        entered = self.context.entered
        if not entered or entered[-1].unit != self.index or entered[-1].holds is None:
            return
        tensors = [t for t in tensors_in(inputs) if t.requires_grad] if torch.is_grad_enabled() else []
        if tensors:
            holds = entered[-1].holds
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self.inputs_done(holds), mode="all")

    def inputs_done(self, holds: CallHolds) -> None:
        self.context.events.record("inputs_done", self.index)
        while holds.held:
            holds.held -= 1
            if self.unit.backward_holds:  # not given back already (the end of a backward)
                self.unit.backward_holds -= 1
                self.leave()

    # ---- forward ------------------------------------------------------------------------
    def pre_forward(self) -> Entry:
        """Takes the unit's hold and records who owns it: the forward's, given back at
        post-forward; inside a backward (a recompute), a backward hold."""
        context = self.context
        with record_function(f"offload::pre_forward[{self.index}]"):
            kind = EntryKind.RECOMPUTE if context.in_backward() else EntryKind.FORWARD
            if kind is EntryKind.FORWARD and context.phase is Phase.FORWARD:
                context.forward_order.visit(self.index)
                prefetch_ahead(context, context.forward_order, self.index)
            self.enter()
            # recorded once the weights are on the device and current
            context.events.record("pre_recompute" if kind is EntryKind.RECOMPUTE else "pre_forward", self.index)
            holds = CallHolds() if self.has_frozen else None
            if kind is EntryKind.RECOMPUTE:
                self.unit.backward_holds += 1
                if holds is not None:
                    holds.held += 1
            elif torch.is_grad_enabled():
                context.uses.update([self.index, *self.unit.spec.borrows])
            entry = Entry(self.index, kind, holds)
            context.entered.append(entry)
            return entry

    def end_entry(self) -> Entry | None:
        """Pops this unit's entry (None if its pre-forward never finished); the caller gives
        back its hold. Entries above it were abandoned by an exception that skipped their
        post-forward: their forward holds are given back here."""
        entered = self.context.entered
        if not any(entry.unit == self.index for entry in entered):
            return None
        while True:
            entry = entered.pop()
            if entry.unit == self.index:
                return entry
            if entry.kind is EntryKind.FORWARD:
                self.context.schedules[entry.unit].leave()

    def post_forward(self, output) -> None:
        """Gives the forward's hold back; hooks the outputs so that the unit's backward announces
        itself. `output` is None when the forward raised (or a recompute stopped early)."""
        with record_function(f"offload::post_forward[{self.index}]"):
            entry = self.end_entry()
            if entry is None:
                return
            self.context.events.record("post_forward" if entry.kind is EntryKind.FORWARD else "post_recompute", self.index)
            if entry.kind is EntryKind.FORWARD:
                self.leave()
            if output is None or not torch.is_grad_enabled():
                return
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                fired = [False]

                def before_backward(grad):
                    if not fired[0]:
                        fired[0] = True
                        self.pre_backward(entry.holds)

                for tensor in tensors:
                    tensor.register_hook(before_backward)

    # ---- backward -----------------------------------------------------------------------
    def pre_backward(self, holds: CallHolds | None = None) -> None:
        context = self.context
        with record_function(f"offload::pre_backward[{self.index}]"):
            if context.phase is Phase.BACKWARD:
                context.backward_order.visit(self.index)
                prefetch_ahead(context, context.backward_order, self.index)
            self.enter()
            context.events.record("pre_backward", self.index)
            self.unit.backward_holds += 1
            if holds is not None:
                holds.held += 1

    def on_param_grad(self, param_index: int) -> None:
        """A param's gradient has accumulated; at the last one the unit's gradients are final."""
        context = self.context
        if context.phase is not Phase.BACKWARD:
            # a backward that never reached the model's outputs (torch.autograd.grad, or a loss
            # of parameters read outside the forward): not counted; step() says so
            context.stray_grads.append(self.unit.spec.param_names[param_index])
            self.unit.spec.params[param_index].grad = None  # never added into a later backward's
            return
        self.unit.grads_pending.add(param_index)
        if self.unit.grads_pending < context.trainable[self.index]:
            return
        if context.reduce_order is None:
            self.grads_final()
        else:
            # several ranks: the weights are no longer needed, the reduction waits its turn
            self.release_after_grads()
            for index in context.reduce_order.grads_final(self.index):
                context.schedules[index].grads_final()

    def grads_final(self) -> None:
        """Hands the unit's gradients off and gives its backward holds back.

        With several ranks, the ranks first agree that they reduce this unit and which of its
        parameters have a gradient on any rank (rank_order.py); a unit none has gradients for
        is not reduced."""
        context = self.context
        unit = self.unit
        with record_function(f"offload::grads_final[{self.index}]"):
            context.events.record("grads_final", self.index)
            pending, unit.grads_pending = unit.grads_pending, set()
            params = unit.spec.params
            if context.collectives.is_distributed:
                union = context.agree(Op.REDUCE, self.index, [1 if i in pending else 0 for i in range(len(params))])
                with_grad = {i for i in range(len(params)) if union[i]}
                if not with_grad:
                    self.release_after_grads()
                    return
            else:
                with_grad = pending
            first = not unit.window_started
            unit.window_started = True
            unit.grads_in_window |= with_grad
            final = context.boundary_backward and context.policy.on_grads_final(unit) and self._reduced_once_per_backward()
            if final and context.gathers_after_step:
                unit.needs_gather = True
            context.gradients.hand_off(unit, pending, first=first, boundary=context.boundary_backward, final=final)
            self.release_after_grads()

    def _reduced_once_per_backward(self) -> bool:
        """Whether this hand-off is the unit's last in this backward: always with several ranks
        (each unit reduces once, rank_order.py); with one rank, when it runs once per forward."""
        if self.context.collectives.is_distributed:
            return True
        recorded = self.context.forward_order.recorded or []
        return recorded.count(self.index) == 1


class RootSchedule(UnitSchedule):
    """Unit 0, the model itself: its forward opens and closes the model's forward."""

    def pre_forward(self) -> Entry:
        context = self.context
        if context.phase is Phase.IDLE and not context.in_backward():
            context.phase = Phase.FORWARD
            context.forward_order.begin()
            context.forward_thread = (threading.get_ident(), threading.current_thread().name)
        return super().pre_forward()

    def post_forward(self, output) -> None:
        context = self.context
        with record_function("offload::post_forward[0]"):
            entry = self.end_entry()
            if entry is None:
                return
            context.events.record("post_forward" if entry.kind is EntryKind.FORWARD else "post_recompute", 0)
            if entry.kind is EntryKind.RECOMPUTE:
                return  # a recompute's hold is a backward hold
            if output is None:  # the forward raised
                self.leave()
                abort_forward(context)
                return
            if context.phase is Phase.FORWARD:
                context.forward_order.end()
                context.phase = Phase.IDLE
            if context.gathers_after_step:
                context.residency.gather_stepped()
            needs_grad = [t for t in tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
            if needs_grad:
                # the forward's hold on the root (embeddings, head) passes to its backward
                context.root_holds_for_backward += 1
                watch_outputs(context, needs_grad)
                return
            self.leave()
            if not context.entered and not context.root_holds_for_backward:
                drop_external_holds(context)


def watch_outputs(context: ScheduleContext, tensors: list[torch.Tensor]) -> None:
    """Hooks the model's outputs: the first gradient to reach any of them, in a backward the
    engine did not start, announces that backward (`on_outside_backward`)."""
    if context.on_outside_backward is None:
        return
    fired = [False]

    def on_output_grad(grad):
        if not fired[0]:
            fired[0] = True
            if context.phase is not Phase.BACKWARD:
                context.on_outside_backward()

    for tensor in tensors:
        tensor.register_hook(on_output_grad)


def prefetch_ahead(context: ScheduleContext, order: ExecutionOrder, current: int) -> None:
    """Starts the fetch of unit `current` (about to run) and then those of the next
    `prefetch_depth` units of `order`. The transfer worker runs fetches in submission order and
    each waits for its unit's step: the unit about to run must not queue behind later ones
    (after an overlapped step, the root's fetch would wait for the blocks' steps)."""
    for index in (current, *order.upcoming(context.prefetch_depth)):
        unit = context.units[index]
        for borrowed in unit.spec.borrows:
            context.residency.prefetch(context.units[borrowed])
        context.residency.prefetch(unit)


def abort_forward(context: ScheduleContext) -> None:
    """A forward failed: gives back every hold it still has; the next forward starts clean."""
    while context.entered and context.entered[-1].kind is EntryKind.FORWARD:
        context.schedules[context.entered.pop().unit].leave()
    if context.phase is Phase.FORWARD:
        context.forward_order.abandon()
        context.phase = Phase.IDLE
    if not context.entered and not context.root_holds_for_backward:
        drop_external_holds(context)


def drop_external_holds(context: ScheduleContext) -> None:
    for unit_index in sorted(context.external_holds):
        context.residency.release(context.units[unit_index])
    context.external_holds.clear()


class Schedule:
    """The model's hooks, the forward and backward of the model as a whole, and the unit
    schedules they drive."""

    def __init__(
        self,
        model: nn.Module,
        context: ScheduleContext,
        *,
        watch_external_reads: bool,
        process: OwningProcess,
        driver: DrivingThread,
    ) -> None:
        self.model = model
        self.context = context
        # the process the engine was built in: the model's forward anywhere else fails at once
        self.process = process
        # the thread inside an engine call: a forward on another thread meanwhile fails at once,
        # a read of a parameter is decided as a call of the engine
        self.driver = driver
        context.trainable = [{i for i, p in enumerate(unit.spec.params) if p.requires_grad} for unit in context.units]
        context.schedules = [(RootSchedule if unit.index == 0 else UnitSchedule)(unit, context) for unit in context.units]
        # Reads of a parameter outside its unit's forward and backward are seen (param_reads.py)
        # when they could otherwise read freed storage (params offloaded), weights a step is
        # still writing (overlap), or a shard not yet gathered (several ranks); on the checked
        # device every read of a parameter is declared to it, watched or not. Offloaded
        # parameters are watched on every thread (a read elsewhere reached freed storage).
        device, offloaded = context.residency.device, context.residency.offloaded
        self.reads = (
            ParamReads(
                {id(p): (unit.index, name) for unit in context.units for name, p in zip(unit.spec.param_names, unit.spec.params)},
                self.on_param_read if watch_external_reads else None,
                device.compute_reads if device.checks_orderings else None,
                [p for unit in context.units for p in unit.spec.params] if offloaded else (),
            )
            if watch_external_reads or device.checks_orderings
            else None
        )
        self.hooks: list = []

    @property
    def schedules(self) -> list[UnitSchedule]:
        return self.context.schedules

    def install(self) -> None:
        """Module and gradient hooks. Post-forward hooks run even when the forward raises
        (always_call): an exception in a unit's forward, or the early stop of a non-reentrant
        checkpoint recompute (torch.utils.checkpoint's _StopRecomputationError), must give
        back what it took."""
        hooks = self.hooks
        for schedule in self.schedules:
            module = self.model if schedule.index == 0 else schedule.unit.spec.module
            hooks.append(module.register_forward_pre_hook(_call(schedule.pre_forward, module, self.process, self.driver)))
            if schedule.has_frozen and schedule.index != 0:  # the root is held for all of backward
                hooks.append(module.register_forward_pre_hook(_inputs(schedule.watch_inputs, module), with_kwargs=True))
            hooks.append(module.register_forward_hook(_post(schedule.post_forward, module), always_call=True))
            for index, param in enumerate(schedule.unit.spec.params):
                if param.requires_grad:
                    hooks.append(param.register_post_accumulate_grad_hook(_grad(schedule.on_param_grad, index)))
        if self.reads is not None:
            self.reads.open()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        if self.reads is not None:
            self.reads.close()

    # ---- forward --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.context.forwards_started += 1
        if self.reads is not None:
            self.reads.install()
        try:
            return self.model(*args, **kwargs)
        except BaseException:
            # what the always-called post-forward hooks could not unwind (a KeyboardInterrupt
            # is not an Exception, and skips them)
            abort_forward(self.context)
            raise

    def on_param_read(self, unit_index: int, name: str, func) -> None:
        """A torch call reads parameter `name` of unit `unit_index` outside the engine's own work,
        on any thread. Decided as a call of the engine (`read_verdict`): on the thread inside a
        call, or, with none inside, on the thread whose micro-step is in progress (it ran the
        forward), or on any thread between steps; refused on the others."""
        context = self.context
        driving = self.driver.where()
        if driving is Driving.HERE:  # inside this thread's own call (its forward, params_on_device)
            self._decide_read(unit_index, name, func)
            return
        mid_step = (
            bool(context.entered) or context.phase in (Phase.FORWARD, Phase.BACKWARD) or context.root_holds_for_backward > 0
        )
        verdict = read_verdict(
            in_backward=context.phase is Phase.BACKWARD,
            in_autograd=torch._C._current_graph_task_id() != -1,
            mid_step=mid_step,
            driving=driving,
            forward_here=context.forward_thread is not None and context.forward_thread[0] == threading.get_ident(),
        )
        if verdict is ReadVerdict.PASS:
            return
        if verdict is ReadVerdict.REFUSE:
            forward = context.forward_thread[1] if context.forward_thread is not None else "?"
            raise OffloadError(
                f"{describe_call(func)} read parameter {name!r} on thread {threading.current_thread().name!r} while the "
                f"micro-step of thread {forward!r} is in progress (its forward ran, its backward has not ended): what the "
                "engine holds for it is that thread's. Read parameters on the thread that trains, or between its steps "
                "(inside `with engine.params_on_device():` when offloaded), or fp32 copies with "
                "engine.consolidated_state_dict() between that thread's calls"
            )
        # BUSY: refused here (unless that thread's call ended meanwhile: then decided as DECIDE)
        self.driver.enter(f"{describe_call(func)} of parameter {name!r}")
        try:
            self._decide_read(unit_index, name, func)
        finally:
            self.driver.leave()

    def _decide_read(self, unit_index: int, name: str, func) -> None:
        """Inside a forward, or in the loss code before its backward: the unit is held until the
        end of backward (as a tied weight read by the head). During backward: autograd's and the
        engine's own reads. Between steps: `read_between_steps` waits for the unit's step, or
        refuses a read of weights that are not there."""
        context = self.context
        if context.in_backward():
            return
        if context.entered or context.phase is Phase.FORWARD or context.root_holds_for_backward:
            if not self._is_active(unit_index):
                self._hold_external(unit_index)
            return
        if context.before_read_between_steps is not None:
            context.before_read_between_steps()
        read_between_steps(context.residency, context.stepping, context.units[unit_index], name, func)

    def _is_active(self, unit_index: int) -> bool:
        context = self.context
        if unit_index in context.external_holds:
            return True
        for entry in context.entered:
            if entry.unit == unit_index or unit_index in context.units[entry.unit].spec.borrows:
                return True
        return False

    def _hold_external(self, unit_index: int) -> None:
        """A param read outside its unit's forward: hold its unit until the backward is over."""
        context = self.context
        logger.debug(
            "offload: unit %s read outside its forward; held until the end of backward", context.units[unit_index].spec.name
        )
        # held first, then recorded: a failed acquire (a fetch's I/O error) leaves no hold to give back
        context.residency.acquire(context.units[unit_index])
        context.external_holds.add(unit_index)
        if torch.is_grad_enabled():
            context.uses[unit_index] += 1

    # ---- backward -------------------------------------------------------------------------
    def agree_on_backward(self, nonfinite: bool) -> bool:
        """Before a backward. Several ranks: one exchange says whether any rank's loss is not
        finite and which units each rank's forward used (for the reduction order, see
        rank_order.py). Returns whether a loss (any rank's) is not finite."""
        context = self.context
        uses, context.uses = context.uses, collections.Counter()
        if not context.collectives.is_distributed:
            return nonfinite
        count = len(context.units)
        used = [1 if uses[i] and context.trainable[i] else 0 for i in range(count)]
        twice = [1 if uses[i] > 1 and context.trainable[i] else 0 for i in range(count)]
        # how many training forwards came before: a rank that caught an error in a forward and went
        # on to the next batch (or skipped or repeated one) stops every rank here, instead of
        # pairing micro-batch k of one rank with k + 1 of another in the reductions that follow
        union = context.agree(Op.BACKWARD, context.forwards_started, [int(nonfinite), *used, *twice])
        used_anywhere = {i for i in range(count) if union[1 + i]}
        twice_anywhere = {i for i in range(count) if union[1 + count + i]}
        context.reduce_order = ReduceOrder(used_anywhere, {i for i in range(count) if used[i]}, twice_anywhere)
        return bool(union[0])

    def backward(self, scaled_loss: torch.Tensor, *, boundary: bool) -> None:
        """`engine.backward`: autograd between `begin_backward` and `end_backward`."""
        try:
            self.begin_backward(boundary=boundary)
            scaled_loss.backward()
        except BaseException:
            self.context.backward_failed = True
            raise
        finally:
            self.end_backward()

    def abort_backward(self) -> None:
        """A backward given up before autograd ran (a non-finite loss, a failed agreement): its
        holds are given back without the agreed reductions, which are collectives."""
        self.context.reduce_order = None
        self.end_backward()

    def begin_backward(self, *, boundary: bool) -> None:
        """Before autograd (or, for a plain loss.backward(), as it reaches the model's outputs):
        the backward's phase and order; with several ranks, the reductions agreed to come first."""
        context = self.context
        context.boundary_backward = boundary
        context.backward_failed = False
        context.phase = Phase.BACKWARD
        context.backward_order.begin()
        if context.reduce_order is not None:
            self._grads_final(context.reduce_order.start())
        # the backward's first units come in while the head's backward runs (the forward let
        # them go): what its first unit's pre_backward would fetch, a head's backward earlier
        for index in context.backward_order.upcoming(context.prefetch_depth + 1):
            for borrowed in context.units[index].spec.borrows:
                context.residency.prefetch(context.units[borrowed])
            context.residency.prefetch(context.units[index])

    def end_backward(self) -> None:
        """Hands off what is left, gives every backward hold back; no unit stays held."""
        context = self.context
        try:
            if context.reduce_order is None:
                for schedule in self.schedules:
                    if schedule.unit.grads_pending:
                        schedule.grads_final()
            else:
                self._grads_final(context.reduce_order.finish())
                self._reduce_unannounced()
        finally:
            context.reduce_order = None
            for schedule in self.schedules:
                schedule.release_backward_holds()
            for _ in range(context.root_holds_for_backward):
                self.schedules[0].leave()
            context.root_holds_for_backward = 0
            drop_external_holds(context)
            context.residency.release_idle()
            context.residency.reset_leaked_holds()
            if context.phase is Phase.BACKWARD:
                context.backward_order.end()
            context.phase = Phase.IDLE
            context.entered.clear()

    def _reduce_unannounced(self) -> None:
        """Several ranks, end of backward: units with gradients that no rank's forward announced
        (a parameter used outside the model's forward) reduce now, in an order agreed first."""
        context = self.context
        union = context.agree(Op.EXTRAS, 0, [1 if unit.grads_pending else 0 for unit in context.units])
        self._grads_final([i for i in range(len(context.units) - 1, -1, -1) if union[i]])

    def _grads_final(self, indices: list[int]) -> None:
        for index in indices:
            self.schedules[index].grads_final()


# The module hooks act only for the module they were registered on (`owner`): a copy of the
# model (copy.deepcopy, torch.optim.swa_utils.AveragedModel for an EMA) carries the hooks in its
# modules' hook dicts, and its forward, over weights of its own, must not drive the engine's units.


def _call(transition, owner: nn.Module, process: OwningProcess, driver: DrivingThread):
    """A forward pre-hook: returns None, so the module's inputs are left as they are. A forward
    in a process forked from the engine's fails at once, and so does one on a thread while
    another is inside an engine call (`model(x)` called directly is no call of the engine;
    autograd's recompute of a checkpointed block, on its own thread on CUDA, is the backward's)
    (offload.platform.process)."""

    what = f"a forward of {type(owner).__name__} under an offload engine"

    def hook(module, args) -> None:
        if module is owner:
            process.check(what)
            if torch._C._current_graph_task_id() == -1:
                try:
                    driver.check_free(what)
                except ConcurrentUseError:
                    _refused_here()[id(owner)] += 1  # its always-called post-hook then does nothing
                    raise
            transition()

    return hook


def _inputs(watch, owner: nn.Module):
    """A forward pre-hook (with kwargs) that passes the inputs on, leaving them as they are."""

    def hook(module, args, kwargs) -> None:
        if module is owner:
            watch((args, kwargs))

    return hook


def _post(transition, owner: nn.Module):
    """A forward hook: returns None, so the module's output is left as it is. After a pre-hook
    that refused the forward (another thread inside an engine call), nothing: the unit's
    entries are that thread's."""

    def hook(module, args, output) -> None:
        if module is owner:
            refused = _refused_here()
            if refused[id(owner)]:
                refused[id(owner)] -= 1
                return
            transition(output)

    return hook


# per thread, id(module) -> its forward pre-hooks that refused and whose post-hook has not run yet
_REFUSED = threading.local()


def _refused_here() -> collections.Counter:
    counts = getattr(_REFUSED, "counts", None)
    if counts is None:
        counts = _REFUSED.counts = collections.Counter()
    return counts


def _grad(transition, index: int):
    return functools.partial(_on_grad, transition, index)


def _on_grad(transition, index: int, param) -> None:
    transition(index)
