"""`engine.optimizer`: the engine seen as a torch.optim.Optimizer.

Learning-rate schedulers (torch's `LambdaLR`, `CosineAnnealingLR`, ...; transformers'
`get_cosine_schedule_with_warmup`, ...) and trainers drive an optimizer through its
`param_groups`: they read and write each group's "lr" (and "betas" for momentum cycling). This
class is a real `torch.optim.Optimizer` subclass holding the engine's parameter groups, so they
attach to it unchanged; the engine reads every group's lr, betas, eps and weight_decay at each
step (a unit may hold parameters of several groups: each range steps with its group's values).

- `step()` is `engine.step()`; `zero_grad()` does nothing (the engine moves every gradient off
  the device during backward, so no `.grad` is left to clear).
- `state_dict()` / `load_state_dict()` carry the groups' hyperparameters, as torch's do; the
  Adam moments and master weights live in the engine's tiers and its checkpoints
  (`engine.save_checkpoint`), so `state` is empty.
- The groups are fixed at `offload.initialize` (the engine laid its buffers out by them):
  `add_param_group` afterwards is an error.
"""

from __future__ import annotations

import torch

from offload.config.schema import SchedulerConfig, betas_at, lr_at
from offload.errors import ConfigError, OffloadError


class EngineOptimizer(torch.optim.Optimizer):
    """See the module docstring. `param_groups` as `offload.config.param_groups.resolve_param_groups`
    gives them; `defaults`: the config's optimizer values."""

    def __init__(self, engine, param_groups: list[dict], defaults: dict) -> None:
        self._engine = engine
        self._building = True
        super().__init__(param_groups, defaults)
        self._building = False

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise OffloadError(
                "engine.optimizer's parameter groups are fixed when the engine is built (its buffers are laid out "
                "by them): pass every group to offload.initialize(model, config, param_groups=[...])"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """`engine.step()`: updates the weights at the end of an accumulation window. With a
        closure, it is called first (with grad enabled) and its loss returned, as torch does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine takes each gradient off the device as soon as it is final."""

    def load_state_dict(self, state_dict: dict) -> None:
        """The groups' hyperparameters from `state_dict` (torch's format and checks); with a
        config scheduler, its values for the engine's current step are put back on top."""
        super().load_state_dict(state_dict)
        self._engine.hyper.apply_schedule(self._engine.global_steps)

    def __repr__(self) -> str:
        groups = ", ".join(
            f"{{lr: {float(g['lr']):g}, weight_decay: {float(g['weight_decay']):g}, params: {len(g['params'])}}}"
            for g in self.param_groups
        )
        return f"EngineOptimizer(AdamW on the offload engine; groups: [{groups}])"


class ConfigSchedule:
    """The config's `scheduler` section driving the groups: before optimizer step k (0 = the
    first update; skipped fp16 steps do not count) every group's lr is `lr_at(k, scheduler, its
    initial lr)` and its betas `betas_at(k, ...)`. Anything else changing them (a torch LR
    scheduler attached to engine.optimizer too) is refused at the next step: two schedules
    would fight over the lr. Does nothing when the section's type is `none`."""

    def __init__(self, scheduler: SchedulerConfig, groups: list[dict]) -> None:
        self.scheduler = scheduler
        self.active = scheduler.type != "none"
        self.base = [(float(group["lr"]), tuple(group["betas"])) for group in groups]
        self.applied: list[tuple[float, tuple]] = []

    def apply(self, groups: list[dict], step: int) -> None:
        if not self.active:
            return
        for group, (lr, betas) in zip(groups, self.base):
            group["lr"] = lr_at(step, self.scheduler, lr)
            group["betas"] = tuple(betas_at(step, self.scheduler, betas))
        self.applied = [(group["lr"], tuple(group["betas"])) for group in groups]

    def check_untouched(self, groups: list[dict]) -> None:
        if not self.active:
            return
        attached = any("initial_lr" in group for group in groups)
        if attached or [(group["lr"], tuple(group["betas"])) for group in groups] != self.applied:
            what = "a torch LR scheduler is attached to engine.optimizer" if attached else "engine.optimizer's lr was changed"
            raise ConfigError(
                f"{what}, but the config's scheduler section (type {self.scheduler.type!r}) drives the learning rate: "
                "use one of the two. Remove the scheduler section (or set its type to 'none') to drive the lr with a "
                "torch or transformers scheduler, or drop the torch scheduler and keep the config's",
                key="scheduler.type",
            )

    def refuse_manual(self) -> None:
        if self.active:
            raise ConfigError(
                f"the config's scheduler section (type {self.scheduler.type!r}) drives the learning rate; setting "
                "engine.lr would be overwritten at the next step. Remove the scheduler section to set the lr yourself",
                key="scheduler.type",
            )
