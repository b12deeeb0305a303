"""The parameter groups' hyperparameters: who sets them, when the engine reads them.

Each group is a torch-style dict (params, lr, betas, eps, weight_decay). Three things may change
its values between steps: the user (through `engine.lr` or `engine.optimizer.param_groups`), a
torch or transformers LR scheduler attached to `engine.optimizer`, or the config's `scheduler`
section (`ConfigSchedule`; it refuses to share the lr with either of the others). The engine
reads them once per step, on the main thread, into one `StepHyper` per group (overlap backward:
when the window's last backward begins, since its units step during that backward).

Under gradient accumulation a step() inside a window applies nothing (it returns False). A torch
scheduler attached to `engine.optimizer` and stepped after every `optimizer.step()` would then
advance k times per update: the loop must step it when an update was applied
(`if engine.step(): scheduler.step()`). The engine cannot step or hold back the user's scheduler,
so it tells: when a group's lr changed, with a torch scheduler attached (its "initial_lr" key),
since a step() that applied nothing, the next step() warns once, naming that loop. Once
`engine.optimizer` is built, `engine.step()` goes through its `step()` (`built_optimizer`), so
what wraps it (a torch scheduler's count of optimizer steps, step hooks) sees every step.

`engine.optimizer` is built on first use: torch.optim.Optimizer imports torch._dynamo (about 2 s
and 70 MB of host memory) the first time one is made, which a training loop that never asks for
it should not pay. Until then the groups are the dicts given at construction; once built, the
optimizer's (its `load_state_dict` replaces them).
"""

from __future__ import annotations

import logging

from offload.config.param_groups import GROUP_KEYS, check_group_value
from offload.config.schema import OptimizerConfig, SchedulerConfig
from offload.errors import ConfigError, OffloadError
from offload.optim.engine_optimizer import ConfigSchedule, EngineOptimizer
from offload.optim.step_hyper import StepHyper

logger = logging.getLogger(__name__)


class GroupHyperparameters:
    """See the module docstring. `groups`: as offload.config.param_groups.resolve_param_groups gives them."""

    def __init__(self, groups: list[dict], optimizer: OptimizerConfig, scheduler: SchedulerConfig) -> None:
        self._groups = groups
        self._optimizer: EngineOptimizer | None = None
        self.config = optimizer
        self.defaults = {
            "lr": optimizer.lr,
            "weight_decay": optimizer.weight_decay,
            "betas": tuple(optimizer.betas),
            "eps": optimizer.eps,
        }
        self.schedule = ConfigSchedule(scheduler, groups)
        self.schedule.apply(groups, 0)
        # each group's lr right after a step() that applied nothing (None after one that did)
        self._lrs_after_idle_step: list[float] | None = None
        self._warned_scheduler = False

    def optimizer(self, engine) -> EngineOptimizer:
        """`engine.optimizer`, built on the first call."""
        if self._optimizer is None:
            self._optimizer = EngineOptimizer(engine, self._groups, defaults=self.defaults)
        return self._optimizer

    @property
    def built_optimizer(self) -> EngineOptimizer | None:
        """`engine.optimizer` if it was asked for (None until then)."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups if self._optimizer is not None else self._groups

    def step_hypers(self, grad_multiplier: float) -> list[StepHyper]:
        """Each group's values as they are now, for the step about to be submitted."""
        return [
            StepHyper(
                lr=float(group["lr"]),
                beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw_mode=self.config.type == "adamw",
                bias_correction=self.config.bias_correction,
                grad_multiplier=grad_multiplier,
            )
            for group in self.param_groups
        ]

    @property
    def lr(self) -> float:
        rates = {float(group["lr"]) for group in self.param_groups}
        if len(rates) > 1:
            raise OffloadError(
                f"the parameter groups have different learning rates {sorted(rates)}: read or set each in "
                "engine.optimizer.param_groups[i]['lr']"
            )
        return rates.pop()

    @lr.setter
    def lr(self, value: float) -> None:
        self.schedule.refuse_manual()
        for group in self.param_groups:
            group["lr"] = value

    def after_step(self, applied: bool) -> None:
        """A step() returned `applied`; one that applied nothing keeps the lrs it leaves."""
        self._lrs_after_idle_step = None if applied else [float(group["lr"]) for group in self.param_groups]

    def check_scheduler_stepped_alone(self) -> None:
        """Before a step(): warns once if an attached torch scheduler moved the lr since a step()
        that applied nothing (see the module docstring)."""
        before, self._lrs_after_idle_step = self._lrs_after_idle_step, None
        if before is None or self._warned_scheduler:
            return
        groups = self.param_groups
        if any("initial_lr" in group for group in groups) and before != [float(group["lr"]) for group in groups]:
            self._warned_scheduler = True
            logger.warning(
                "offload: the learning rate changed after an engine step that applied no update (a micro-batch inside a "
                "gradient accumulation window): an LR scheduler stepped on every micro-batch advances "
                "gradient_accumulation_steps times per update. Step it only when an update was applied: "
                "`if engine.step(): scheduler.step()` (this warning is shown once)"
            )

    def check_untouched(self) -> None:
        """Before a step: with a config schedule, nothing else changed the lr (see ConfigSchedule)."""
        self.schedule.check_untouched(self.param_groups)

    def apply_schedule(self, step: int) -> None:
        """The config schedule's values for optimizer step `step` (nothing without one)."""
        self.schedule.apply(self.param_groups, step)

    def state(self) -> dict:
        """What a checkpoint saves: each group's values, and the first group's lr (all that
        checkpoints before parameter groups had)."""
        return {
            "lr": float(self.param_groups[0]["lr"]),
            "param_groups": [
                {key: (list(group[key]) if key == "betas" else float(group[key])) for key in GROUP_KEYS}
                for group in self.param_groups
            ],
        }

    def check_state(self, state: dict) -> None:
        """Raises ValueError naming the key when `state` (`state()`'s, read back from a file) holds
        a value `load_state` could not apply: a learning rate, betas, eps or weight decay out of
        range or of the wrong type, or groups that are not a list of dicts."""
        saved = state.get("param_groups")
        try:
            check_group_value("engine", "lr", state.get("lr"))
            if saved is None:
                return
            if not isinstance(saved, list) or not all(isinstance(values, dict) for values in saved):
                raise ConfigError(f"engine['param_groups'] must be a list of dicts, got {str(saved)[:60]}")
            for index, values in enumerate(saved):
                unknown = sorted(set(values) - set(GROUP_KEYS))
                if unknown:
                    raise ConfigError(f"engine['param_groups'][{index}] has keys offload never writes: {unknown}")
                for key in GROUP_KEYS:
                    if key in values:
                        check_group_value(f"engine['param_groups'][{index}]", key, values[key])
        except ConfigError as error:
            raise ValueError(str(error).removeprefix("engine")) from None

    def load_state(self, state: dict, step: int) -> None:
        """Restores `state()`'s values; a checkpoint with other groups gives its lr to every group.
        The config's schedule, if any, is a function of the step: its values for `step` win."""
        groups = self.param_groups
        saved = state.get("param_groups")
        if saved is not None and len(saved) == len(groups):
            for group, values in zip(groups, saved):
                group.update(
                    {key: (tuple(values[key]) if key == "betas" else values[key]) for key in GROUP_KEYS if key in values}
                )
        else:
            if saved is not None:
                logger.warning(
                    "offload: the checkpoint has %d parameter groups, this engine %d: only the learning rate (%g) is "
                    "restored, into every group",
                    len(saved),
                    len(groups),
                    state["lr"],
                )
            for group in groups:
                group["lr"] = state["lr"]
        self.apply_schedule(step)
