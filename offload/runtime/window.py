"""The gradient window: which backward ends a window of gradient accumulation, the global
gradient norm, clipping and the fp16 loss scale, and whether a window is stepped, skipped or
refused; the steps during backward (overlap 'backward', speculative or in place) and what
becomes of them when a backward or step() fails.

`GradientWindow` is the engine's counters and decisions between a backward and a step; the
Engine delegates `backward`, `step` and the training state to it. The parts report to it: the
gradient path calls `step_during_backward` as each unit's gradients are final (transfer worker),
the schedule calls `outside_backward_began` when a plain `loss.backward()` reaches the model's
outputs (inside autograd, main thread). Everything else runs on the main thread.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Executor

import torch

from offload.config.schema import Config
from offload.errors import NonFiniteError, OffloadError
from offload.model.unit_state import UnitState
from offload.optim.hyperparameters import GroupHyperparameters
from offload.optim.loss_scaling import DynamicLossScaler, clip_coefficient, gradient_multiplier
from offload.optim.step_hyper import StepHyper
from offload.plan.step_split import StepWindow
from offload.platform.collectives import Collectives
from offload.runtime import optimizer_state, trainable
from offload.runtime.counters import check_counters
from offload.runtime.events import Phase
from offload.runtime.grad_handles import GradHandles, check_norm_type, combine_norms, torch_clip_coefficient
from offload.runtime.gradients import GradientOffload
from offload.runtime.overlap import OverlapPolicy, Stepping
from offload.runtime.prefetch import step_order
from offload.runtime.schedule import Schedule
from offload.runtime.speculation import Speculation
from offload.runtime.step_rates import SplitPlanner
from offload.runtime.weights_out import WeightsReader
from offload.storage.tiers import TierStore

logger = logging.getLogger(__name__)


class GradientWindow:
    """The counters and decisions of gradient windows (see the module docstring)."""

    def __init__(
        self,
        *,
        config: Config,
        units: list[UnitState],
        policy: OverlapPolicy,
        hyper: GroupHyperparameters,
        collectives: Collectives,
        store: TierStore,
        stepping: Stepping,
        gradients: GradientOffload,
        weights: WeightsReader,
        optimizer_worker: Executor,
        timings: dict[str, float],
    ) -> None:
        self.config = config
        self.units = units
        self.policy = policy
        self.hyper = hyper
        self.collectives = collectives
        self.store = store
        self.stepping = stepping
        self.gradients = gradients
        self.weights = weights
        self.optimizer_worker = optimizer_worker
        self.timings = timings
        # the per-unit schedule, attached once built (it reports plain backwards to this window)
        self.schedule: Schedule
        # overlap `auto`'s split (set by build when some unit may step on the device), and the
        # seconds of the backwards that ended a window, which plan it again once
        self.split: SplitPlanner | None = None
        self._boundary_seconds: list[float] = []
        self.closed = False
        self.scaler = DynamicLossScaler(
            scale=config.loss_scale.initial if config.precision == "fp16" else 1.0,
            growth_interval=config.loss_scale.growth_interval,
            backoff_factor=config.loss_scale.backoff_factor,
            growth_factor=config.loss_scale.growth_factor,
            min_scale=config.loss_scale.min_scale,
        )
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken
        self.skipped_steps = 0  # fp16 overflows
        self.last_grad_norm: float | None = None
        self._stepped_at_micro = -1  # micro_steps at the last step() that ended a window
        # overlap 'backward': units whose gradients were not finite (not stepped); transfer worker
        self._nonfinite_units: list[str] = []
        # overlap `auto`, and 'backward' with clipping or fp16: the window's speculative steps
        self.speculation = Speculation(
            policy, stepping, gradients, weights, self._begin_steps, lambda: self.schedule.context.events
        )
        self.speculation_counts = self.speculation.counts
        # overlap 'backward': each group's hyperparameters for the window's steps, read on the main
        # thread when its last backward begins (the transfer worker submits the steps)
        self._window_hypers: list[StepHyper] | None = None
        # overlap 'backward' without speculation: units stepped in place during the window's last
        # backward (appended by the transfer worker, read by the main thread once settled). A
        # backward that fails after some stepped leaves the weights partly stepped: their names,
        # and every use is refused until load_checkpoint
        self._stepped_in_backward: list[UnitState] = []
        self._partly_stepped: list[str] = []
        # why the state is part loaded (a checkpoint that passed its checks failed to apply), or None
        self._part_loaded: str | None = None
        self._outside_backward_began_at = 0.0
        # backwards since the last window step() decided or zero_grad dropped: what zero_grad
        # has to drop (none right after a step, whose units may still be stepping)
        self._backwards_undecided = 0
        # whether a backward ran since the last step() call; a step() without one warns once
        self._backward_since_step_call = False
        self._warned_step_without_backward = False
        # each trainable param's .grad between the backward that ends a window and step():
        # what torch.nn.utils.clip_grad_norm_ reads and scales (runtime/grad_handles)
        self.handles = GradHandles(
            store=store,
            collectives=collectives,
            drain=self.drain,
            divisor=lambda: self.scaler.scale * self.collectives.world_size,
        )

    def check_open(self) -> None:
        """The engine is not closed (its parts are shut down once it is)."""
        if self.closed:
            raise OffloadError("this engine is closed; create a new one with offload.initialize")

    def before_load(self) -> None:
        """A checkpoint load replaces every weight and state: work in flight that failed (a swap
        I/O error in the last step, say) is waited for and discarded, so the load is the way
        back; speculative steps of an unfinished window are taken back first, so that a load
        that fails leaves the engine as it would be without them."""
        for failure in self.settle():
            logger.warning("offload: load_checkpoint discards failed work in flight: %s", failure)
        self.handles.clear()
        self.speculation.take_back_undecided("load_checkpoint in the middle of a window")
        self._window_hypers = None

    def after_load(self) -> None:
        """A checkpoint was loaded: weights partly stepped by a failed backward are gone, and the
        device's copies of the state (overlap `auto`'s split) load again."""
        self._partly_stepped = []
        self._part_loaded = None
        self.stepping.invalidate_device_copies()

    def load_failed(self, reason: str) -> None:
        """A checkpoint was applied in part: training is refused until a load succeeds."""
        self._part_loaded = reason
        logger.error("offload: %s; load a checkpoint to go on", reason)

    def settle_before_use(self) -> None:
        """Before a forward or a read of the weights: a failed plain backward's holds are given
        back; with overlap `backward`, the steps of a window that ended wait to be scheduled."""
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        if self.policy.steps_in_backward and self._window_ended_without_step():
            if self.policy.defers_to_forward:
                # as with overlap 'forward', nothing of the window is stepped before step()
                self.speculation.take_back_before_step("a forward before step()")
                return
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

    def before_read_between_steps(self) -> None:
        """A parameter is read between steps (main thread): with overlap `auto`, after the
        backward that ended a window and before step(), its speculative steps are taken back,
        so the read sees the weights overlap 'forward' shows there (the last step's)."""
        if self.policy.defers_to_forward and self._window_ended_without_step():
            self.speculation.take_back_before_step("a read of the weights before step()")

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` / gradient_accumulation_steps (times the loss scale in fp16)."""
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise OffloadError("engine.backward needs the scalar loss tensor (e.g. out.loss)")
        if not loss.requires_grad:
            raise OffloadError(trainable.loss_without_grad(self.units, self.schedule.context.trainable))
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
        if boundary:
            self._boundary_seconds = [*self._boundary_seconds[-1:], time.perf_counter() - started]
        self._count_backward()

    def _before_backward(self) -> bool:
        """Checks that need no other rank, before a backward changes anything; returns whether
        it ends a gradient window. Deterministic on every rank (same counters and config)."""
        trainable.refuse_unfrozen(self.units, self.schedule.context.trainable)
        self._drop_handles_before_backward()
        if self.policy.defers_to_forward:
            self.stepping.wait_steps()  # the last window's steps (and commits) end their windows
        accumulation = self.config.gradient_accumulation_steps
        if self.policy.defers_to_forward and self._window_ended_without_step():
            # another backward adds its gradients to the window, as with overlap 'forward'
            self.speculation.take_back_before_step("a backward before step()")
        elif self.policy.steps_in_backward and self._window_ended_without_step():
            raise OffloadError(
                f"overlap 'backward': the last backward ended a gradient window (gradient_accumulation_steps "
                f"{accumulation}) and its units were stepped as their gradients landed, but engine.step() was not "
                "called after it. Call engine.step() after the backward that ends each window; another backward first "
                "would step the weights a second time (overlap 'none' / 'forward' accumulate it into the window instead)"
            )
        if any(unit.window_started for unit in self.units):
            self.store.refuse_gradient_sum("this backward would add its gradients to those of the last, before step()")
        boundary = (self.micro_steps + 1) % accumulation == 0
        if boundary and self.policy.steps_in_backward:
            self.hyper.check_untouched()
            self._window_hypers = self.hyper.step_hypers(self._unclipped_multiplier())
            self._stepped_in_backward = []
            self.speculation.begin_window()
        return boundary

    def _agree_on_backward(self, nonfinite: bool, loss_value: float | None) -> None:
        """Several ranks: one exchange (non-finite losses, units used; schedule.py); then the
        steps in flight finish (they read the gradients this backward writes; not their write-back)."""
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
        self.stepping.wait_steps()

    def _prefetch_step_states(self, boundary: bool) -> None:
        """The window's last backward begins (the steps in flight are done): the optimizer worker
        starts reading the master and moments of the first NVMe pieces the step will stream, in
        its order, while backward computes (TierStore.prefetch_optimizer_states). Not with overlap
        'backward' without speculation, whose units step one by one as their gradients land."""
        if not boundary:
            return
        self._replan_split()
        if self.split is not None:
            self._use_split(self.split.speculating if self.speculation.this_window else StepWindow.AFTER_BACKWARD)
        order = step_order(self.schedule.context.forward_order.recorded, len(self.units))
        # the workers step what they were given in this order (a unit landed later first)
        self.stepping.order_by(order)
        # the device units' state up to the device (overlap `auto`'s split), the last to land first
        self.stepping.begin_window_on_device()
        self.stepping.prefetch_on_device([self.units[i] for i in reversed(order)])
        if not self.store.streamed_units or (self.policy.steps_in_backward and not self.policy.speculative):
            return
        self.optimizer_worker.submit(self.store.prefetch_optimizer_states, [self.units[i] for i in order])

    def _replan_split(self) -> None:
        """Overlap `auto`'s split, planned again once its rates were measured (not declared with a
        backward's seconds), from the second backward that ended a window (the first warms up);
        between steps, with every new state home first (units may change lanes)."""
        split = self.split
        if split is None or not split.waits_for_a_backward or len(self._boundary_seconds) < 2:
            return
        self.stepping.wait()
        split.replan(self._boundary_seconds[-1])

    def _use_split(self, window: StepWindow) -> None:
        """Overlap `auto`: the window steps under the split planned for it (`SplitPlanner`: one
        for windows that speculate, one for those that do not), switched here when it changes:
        at the start of a window's last backward (before anything of it steps), or in step()
        before a redo, with every step and new state of the windows before it home first. A
        unit that changes lanes reads its state from RAM either way (a device copy the CPU made
        stale since loads again: `Stepping`)."""
        split = self.split
        if split is None or split.current is window:
            return
        self.stepping.wait()
        split.use(window)

    def _window_ended_without_step(self) -> bool:
        """The last backward ended a gradient window and step() has not taken it yet."""
        steps = self.micro_steps
        return bool(steps) and steps % self.config.gradient_accumulation_steps == 0 and steps != self._stepped_at_micro

    def outside_backward_began(self) -> None:
        """Inside autograd, as a backward the engine did not start (a plain `loss.backward()`)
        reaches the model's outputs: what `engine.backward` does before autograd, except the
        division by gradient_accumulation_steps (the user's, as with torch); the rest runs when
        autograd finishes (`_outside_backward_ended`, queued on its engine)."""
        self.check_open()
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
        self._count_backward()

    def _count_backward(self) -> None:
        self.micro_steps += 1
        self._backwards_undecided += 1
        self._backward_since_step_call = True
        self._after_backward()

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
        handed off after the failure did not step (`step_during_backward`)."""
        if self.policy.speculative:
            self.speculation.abandon(why, self.settle)
            return
        if not (self.policy.steps_in_backward and self.schedule.context.boundary_backward):
            return
        for failure in self.settle():
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

    def refuse_partly_stepped(self) -> None:
        if self._part_loaded is not None:
            raise OffloadError(f"{self._part_loaded}: load a checkpoint (engine.load_checkpoint) to go on")
        if self._partly_stepped:
            raise OffloadError(
                f"a backward failed after units {', '.join(self._partly_stepped[:4])} had stepped in place (overlap "
                "'backward'): the weights are partly stepped. Load a checkpoint (engine.load_checkpoint) to go on"
            )

    def _unclipped_multiplier(self) -> float:
        """What the stored gradients are multiplied by when clipping does not act: the loss scale
        and the ranks' sum undone (the very value `gradient_multiplier` gives then)."""
        return gradient_multiplier(self.scaler.scale * self.collectives.world_size, 0.0, 0.0)[0]

    def step_during_backward(self, unit: UnitState) -> None:
        """overlap 'backward' (transfer worker): the unit's gradients are final, step it now
        (speculatively, into its spare state, when the factor needs the global norm: a unit
        without a spare state, or with non-finite gradients, waits for step())."""
        if self.schedule.context.backward_failed:
            return  # its gradients may be incomplete: the failure decides what becomes of the window
        finite = unit.grad_sq_norm is not None and math.isfinite(unit.grad_sq_norm)
        # read when the window's last backward began, before any of its units could be final
        assert self._window_hypers is not None
        if self.policy.speculative:
            if finite and unit.can_speculate and unit.grads_in_window and self.speculation.this_window:
                self.speculation.submit(unit, self._window_hypers)
            elif finite and unit.grads_in_window:
                # a device unit that does not speculate: its gradient goes up now all the same
                # (the copy is of this window: a gradient that changes is of another one)
                self.stepping.upload_grad_on_device(unit)
            return
        if not finite:
            self._nonfinite_units.append(unit.spec.name)
            return
        self._begin_steps([unit])
        self._stepped_in_backward.append(unit)
        self.stepping.submit([unit], self._window_hypers)

    def drain(self, write_backs: bool = True) -> None:
        """Waits for every gradient transfer and optimizer step in flight, and with `write_backs`
        for the steps' state write-backs too (`Stepping.wait_steps`); re-raises their errors."""
        self.gradients.wait_all()
        self.stepping.wait() if write_backs else self.stepping.wait_steps()

    def step(self) -> bool:
        """At the end of an accumulation window, updates the weights; returns True when it did.

        With overlap 'forward' the update runs on while the next forward computes: the
        weights are committed (each unit's next use waits for its own update)."""
        started = time.perf_counter()
        self._warn_step_without_backward()
        self.hyper.check_scheduler_stepped_alone()
        try:
            applied = self._step()
        finally:
            self.timings["step"] += time.perf_counter() - started
        self.hyper.after_step(applied)
        return applied

    def _step(self) -> bool:
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        self._refuse_stray_grads()
        if self.micro_steps == 0 or self.micro_steps % self.config.gradient_accumulation_steps != 0:
            return False
        if self.micro_steps == self._stepped_at_micro:
            return False
        self.hyper.check_untouched()
        if self.policy.defers_to_forward:
            # the units the optimizer worker has not reached step in the next forward's order;
            # those it is stepping go on (their commit is queued after them: `_commit`)
            self.gradients.wait_all()
            self.speculation.withdraw_queued()
        else:
            self.drain(write_backs=False)  # the next step streams after the last one's write-back
        # what user code's clip_grad_norm_ multiplied the window's gradients by (an error, before
        # anything changes, when it scaled some and not others)
        user_factor = self.handles.factor()
        self.handles.clear()
        # the window is decided from here on (stepped, skipped or refused); an interrupt in the
        # wait above leaves it open, and the next step() takes it again
        self._stepped_at_micro = self.micro_steps
        self._backwards_undecided = 0
        # the units stepped in place during its last backward belong to this window alone (a
        # zero_grad in the next one has none to refuse)
        self._stepped_in_backward = []
        window = [unit for unit in self.units if unit.window_started]
        if self.policy.steps_in_backward and not self.policy.speculative:
            return self._finish_window_stepped_in_backward(window)
        try:
            norms, total = self._window_sq_norms(window)
        except BaseException:
            # the window stays unstepped, as without speculation: so do its speculated units
            self.speculation.abandon("step() failed before it knew the global norm", self.settle)
            raise
        multiplier, norm = self._multiplier(total, user_factor)
        self.last_grad_norm = norm
        speculated = self.speculation.take()
        window_hypers, self._window_hypers = self._window_hypers, None
        if not math.isfinite(norm):
            bad = [unit.spec.name for unit in window if not math.isfinite(norms[unit.index])]
            if speculated:
                self.speculation_counts["skipped" if self.config.precision == "fp16" else "refused"] += 1
            self.speculation.take_back(speculated, restore=True)
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
        # the speculative steps stand if they used this very factor and hyperparameters (read
        # when the window's last backward began: an lr set since is a redo too)
        used = [dataclasses.replace(h, grad_multiplier=multiplier) for h in window_hypers or []]
        clipped = multiplier != self._unclipped_multiplier()
        why = "clips the gradients" if clipped else "has other hyperparameters than its backward began with"
        stands = not clipped and used == hypers
        committed = self.speculation.decide(speculated, stands=stands, why=why, step=self.global_steps)
        if speculated and not stands and self.policy.defers_to_forward:
            # the whole window steps again now, each device unit's state loaded again first
            self._use_split(StepWindow.REDONE)
        if self.config.precision == "fp16":
            self.scaler.update(overflow=False)
        self.global_steps += 1
        order = step_order(self.schedule.context.forward_order.recorded, len(self.units))
        # (a commit queued after a running step ends that unit's window only once it ran)
        self._submit_steps([self.units[i] for i in order if self.units[i].window_started and i not in committed], hypers)
        return True

    def _window_sq_norms(self, window: list[UnitState]) -> tuple[dict[int, float], float]:
        """Each unit's squared norm of its stored gradient shard, and their sum over units and
        ranks (loss-scaled, summed over ranks: `gradient_multiplier` undoes both)."""
        norms = {}
        for unit in window:
            if unit.grad_sq_norm is None:
                unit.grad_sq_norm = self.store.grad_sq_norm(unit)
            norms[unit.index] = unit.grad_sq_norm
        (total,) = self.collectives.sum_host([sum(norms.values())], what="the global gradient norm")
        return norms, total

    def _multiplier(self, total_sq: float, user_factor: float) -> tuple[float, float]:
        """(what the step multiplies the stored gradients by, the global norm before clipping).
        `user_factor`: what clip_grad_norm_ multiplied the gradients by; the config's
        gradient_clipping then acts on the gradients so scaled, as it would after torch's."""
        loss_scale = self.scaler.scale * self.collectives.world_size
        if user_factor == 1.0:
            return gradient_multiplier(loss_scale, total_sq, self.config.gradient_clipping)
        unclipped, norm = gradient_multiplier(loss_scale, total_sq, 0.0)
        if not math.isfinite(user_factor):
            # torch would step on non-finite gradients; the engine refuses (or, fp16, skips) the step
            logger.warning("offload: clip_grad_norm_ multiplied the gradients by %s", user_factor)
            return float("nan"), float("nan")
        scaled = user_factor * norm
        return unclipped * user_factor * clip_coefficient(scaled, self.config.gradient_clipping), norm

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """engine.clip_grad_norm_: the global gradient norm of the window (as torch computes it
        on the full gradients, of those clip_grad_norm_ scaled already if it did), and the
        coming step clips by torch's coefficient min(1, max_norm / (norm + 1e-6))."""
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        norm_type = check_norm_type(norm_type)
        if not self._window_ended_without_step():
            raise OffloadError(
                "engine.clip_grad_norm_ goes after the backward that ends a gradient window (gradient_accumulation_steps "
                f"{self.config.gradient_accumulation_steps}; {self.micro_steps} backward(s) so far) and before step(), "
                "as torch.nn.utils.clip_grad_norm_ goes before optimizer.step()"
            )
        if self.policy.steps_in_backward and not self.policy.speculative:
            raise OffloadError(self._clip_refusal())
        current = self.handles.factor()
        if self.policy.defers_to_forward:
            self.gradients.wait_all()
            self.speculation.withdraw_queued()  # the factor changes: the steps would be redone
        self.drain()
        if norm_type == 2.0:
            _, total = self._window_sq_norms([unit for unit in self.units if unit.window_started])
            norm = gradient_multiplier(self.scaler.scale * self.collectives.world_size, total, 0.0)[1]
        else:
            norm = combine_norms(self.handles.param_norms(norm_type), norm_type)
        norm *= abs(current)
        self.handles.scale_all(torch_clip_coefficient(norm, max_norm))
        return torch.tensor(norm, dtype=torch.float32)

    def _clip_refusal(self) -> str:
        return (
            "clipping by clip_grad_norm_ with overlap 'backward' and no gradient_clipping in the config: each unit "
            "stepped in place as soon as its gradients were final, before the global norm was known, so its "
            "gradients can no longer be clipped. Set the config's gradient_clipping to the max norm instead (the "
            "steps during backward are then speculative, and step() clips on the global norm exactly; "
            "engine.last_grad_norm holds it), or use overlap 'forward'"
        )

    def _after_backward(self) -> None:
        """A backward ended: if it ended the window, the params' .grad become its handles."""
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return
        refusal = self._clip_refusal() if self.policy.steps_in_backward and not self.policy.speculative else None
        self.handles.install(self.units, refusal)

    def _drop_handles_before_backward(self) -> None:
        """autograd adds into a .grad that is not None: the handles go before a backward; a clip
        they recorded that no step() took would be lost, so that is refused."""
        if self.handles.clipped():
            raise OffloadError(
                "clip_grad_norm_ scaled the gradients of the window the last backward ended, but step() was not called "
                "before this backward: the engine cannot scale only the gradients accumulated so far. Call step() "
                "after clip_grad_norm_ (clip only after the backward that ends a window)"
            )
        self.handles.clear()

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
        """The window's units step on the optimizer worker; if the policy waits for them, reads see them at once."""
        self._begin_steps(units)
        self.stepping.submit(units, hypers)
        self.hyper.apply_schedule(self.global_steps)
        if self.policy.on_window_end(self.stepping):
            self.schedule.context.residency.weights_current(units)

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

    def settle(self) -> list[BaseException]:
        """Waits for every gradient transfer, optimizer step and swap operation in flight (also
        those a failed step left in wait lists); returns their errors."""
        failures: list[BaseException] = []
        for wait in (self.gradients.wait_all, self.stepping.wait):
            try:
                wait()
            except Exception as error:  # noqa: BLE001 (returned to the caller, who decides)
                failures.append(error)
        failures.extend(self.store.settle())
        return failures

    # ---- engine.optimizer.zero_grad(), and a step() with nothing to apply ----------------------
    def zero_grad(self) -> None:
        """torch's `optimizer.zero_grad()` (set_to_none): every gradient accumulated since the
        last window step() decided is dropped; the next backward's gradients alone are used. The
        backwards still count (`micro_steps`): a window ends at every k-th backward, as
        `if (i + 1) % k == 0: optimizer.step()` ends it in a plain loop, and holds the gradients
        of its backwards since the zero_grad. Right after a step (nothing since) it does nothing.

        Dropped exactly where nothing was applied yet: speculative steps (overlap 'backward' with
        clipping or fp16) are taken back. Units stepped in place during the backward that ended
        the window (overlap 'backward' without clipping or fp16) cannot be: refused, naming them,
        before anything changes. With the config's gradient_accumulation_steps, `step();
        zero_grad()` on every micro-batch is accelerate's loop: a zero_grad() right after a step()
        that applied nothing because the window is still open keeps the window's gradients, as
        accelerate's optimizer does while it accumulates (a zero_grad() with no step() since the
        last backward drops them)."""
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        accumulating = not self._backward_since_step_call and self.micro_steps % self.config.gradient_accumulation_steps
        if not self._backwards_undecided or accumulating:
            return
        # the gradients in flight land first (and, overlap 'backward', the steps they started)
        self.gradients.wait_all()
        self.speculation.withdraw_queued()
        self.stepping.wait()
        if self._stepped_in_backward:
            names = [unit.spec.name for unit in sorted(self._stepped_in_backward, key=lambda unit: unit.index)]
            raise OffloadError(
                f"zero_grad() after the backward that ended a gradient window with overlap 'backward': units "
                f"{', '.join(names[:4])}{' …' if len(names) > 4 else ''} already stepped in place on its gradients as "
                "they landed, and a step taken in place cannot be taken back; nothing was dropped. To skip such a batch, "
                "decide before its backward (engine.backward refuses a non-finite loss before anything changes), or use "
                "overlap 'forward' (exact, the default) or add gradient_clipping (its steps are speculative until step())"
            )
        # the window's .grad handles and any clip recorded on them go with its gradients
        self.handles.clear()
        self.speculation.take_back(self.speculation.take(), restore=True)
        self._discard_window()
        self._nonfinite_units = []
        self._window_hypers = None
        self._backwards_undecided = 0
        # a window that ended with the dropped backward is decided (nothing to step): step() returns False
        if self.micro_steps % self.config.gradient_accumulation_steps == 0:
            self._stepped_at_micro = self.micro_steps

    def optimizer_state(self, params: list) -> dict:
        """engine.optimizer.state_dict()'s `state` (offload.runtime.optimizer_state.read), once
        the steps in flight are done: the state of the last applied step."""
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        self.drain()
        return optimizer_state.read(self.units, self.store, self.collectives, params)

    def load_optimizer_state(self, params: list, state, check_groups) -> None:
        """engine.optimizer.load_state_dict()'s moments and step counts into the tiers, between
        windows; `check_groups()` checks the rest of the state dict. Everything is checked, and
        agreed over ranks, before anything changes (offload.runtime.optimizer_state)."""
        self.check_open()
        self._finish_abandoned_backward()
        self.refuse_partly_stepped()
        self.drain()
        error: BaseException | None = None
        if self._backwards_undecided or any(unit.window_started for unit in self.units):
            error = optimizer_state.OptimizerStateError(
                "engine.optimizer.load_state_dict() in the middle of a gradient accumulation window (backwards since "
                "the last step): load it between steps, after step() applied an update or before the first backward"
            )
        try:
            if error is None:
                check_groups()
                moments, steps = optimizer_state.check(self.units, params, state)
        except OffloadError as found:
            error = found
        if self.collectives.ranks_with(error is not None, what="the optimizer state dict check") and error is None:
            error = optimizer_state.OptimizerStateError("the optimizer state dict was refused on another rank (see its log)")
        if error is not None:
            raise error
        optimizer_state.write(self.units, self.store, self.collectives.rank, moments, steps)
        self.stepping.invalidate_device_copies()

    def _warn_step_without_backward(self) -> None:
        """A step() with no backward since the last one applies nothing: warned once (a loop that
        lost its backward, or calls step() twice)."""
        if not self._backward_since_step_call and not self._warned_step_without_backward:
            self._warned_step_without_backward = True
            nothing = trainable.nothing_trainable(self.units, self.schedule.context.trainable)
            if nothing is not None:
                logger.warning("offload: engine.step() has nothing to apply and returns False: %s", nothing)
            else:
                logger.warning(
                    "offload: engine.step() was called with no backward since the last step() (micro-step %d): there is "
                    "nothing to apply and it returns False. Call engine.backward(loss) (or loss.backward()) on a loss of "
                    "engine(...)'s output before each step() (this warning is shown once)",
                    self.micro_steps,
                )
        self._backward_since_step_call = False

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

    def check_training_state(self, state: dict) -> None:
        """Raises ValueError naming the key when `state` (what `training_state()` gave, read back
        from a file nobody vouches for) is not one `load_training_state` restores exactly."""
        check_counters(state, set(self.training_state()))
        self.hyper.check_state(state)
        self.scaler.check_state_dict(state["loss_scaler"])

    def load_training_state(self, state: dict) -> None:
        """Restores what `training_state()` gave."""
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state["skipped_steps"]
        self._stepped_at_micro = state["stepped_at_micro"]
        self._backwards_undecided = 0
        self.hyper.load_state(state, self.global_steps)
        self.scaler.load_state_dict(state["loss_scaler"])
        self.last_grad_norm = state["last_grad_norm"]
        self.weights.invalidate()
