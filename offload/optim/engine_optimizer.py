"""`engine.optimizer`: the engine seen as a torch.optim.Optimizer.

Learning-rate schedulers (torch's `LambdaLR`, `CosineAnnealingLR`, ...; transformers'
`get_cosine_schedule_with_warmup`, ...) and trainers drive an optimizer through its
`param_groups`: they read and write each group's "lr" (and "betas" for momentum cycling). This
class is a real `torch.optim.Optimizer` subclass holding the engine's parameter groups, so they
attach to it unchanged; the engine reads every group's lr, betas, eps and weight_decay at each
step (a unit may hold parameters of several groups: each range steps with its group's values).

- `step()` is `engine.step()`. `zero_grad()` drops every gradient accumulated since the last
  applied step, as torch's does (set_to_none: the next backward's gradients alone are used);
  see offload.runtime.window.GradientWindow.zero_grad for accumulation windows and overlap
  'backward'. A parameter left without a gradient after it is not stepped (torch's
  `zero_grad(set_to_none=False)` would step it on a zero gradient).
- `state_dict()` is torch.optim.AdamW's: the groups (params as indices) and, per parameter that
  has stepped, `step` (float32 scalar tensor), `exp_avg`, `exp_avg_sq` (fp32 CPU tensors in
  its shape), read out of the tiers: the full state on every rank (every rank calls it, as
  FSDP's full state dict). Where it would not fit in host memory (optimizer state on NVMe, or
  over half the available RAM) it raises, naming `engine.save_checkpoint`.
  `load_state_dict()` takes that format (from `torch.optim.AdamW` over the same parameters in
  the same order too): the groups' values, the moments and step counts go into the tiers,
  exactly; everything is checked before anything changes (offload.runtime.optimizer_state).
- The groups are fixed at `offload.initialize` (the engine laid its buffers out by them):
  `add_param_group` afterwards is an error.
"""

from __future__ import annotations

import math

import torch

from offload.config.schema import SchedulerConfig, betas_at, lr_at
from offload.errors import ConfigError, OffloadError


class OptimizerStateError(OffloadError):
    """A state dict engine.optimizer cannot take (its key and what is wrong are named), or one it
    cannot make here; nothing was changed."""


def _number(key: str, value, *, low: float, high: float = math.inf, open_low: bool = False) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptimizerStateError(f"{key} must be a finite number, got {value!r}")
    if value < low or (open_low and value == low) or value >= high:
        raise OptimizerStateError(f"{key} is {value}, outside {'(' if open_low else '['}{low}, {high})")


def check_groups(saved, groups: list[dict], adamw_mode: bool) -> None:
    """A state dict's groups against the engine's (torch's checks: as many groups, as many params
    in each), and each value the engine would take: lr, betas, eps, weight_decay in range, no
    option it does not run (amsgrad, maximize, the other weight decay mode)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise OptimizerStateError("the state dict must be a dict with 'state' and 'param_groups' (torch's format)")
    if not isinstance(saved.get("state", {}), dict):
        raise OptimizerStateError("state_dict['state'] must be a dict of per-parameter state")
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise OptimizerStateError(
            f"the state dict has {len(saved_groups)} parameter groups, engine.optimizer {len(groups)} (parameters no "
            "group of offload.initialize's param_groups lists form one more group, last): make it over the same groups"
        )
    mode = "AdamW (decoupled weight decay)" if adamw_mode else "Adam (L2 weight decay)"
    for index, (group, mine) in enumerate(zip(saved_groups, groups)):
        key = f"state_dict['param_groups'][{index}]"
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise OptimizerStateError(f"{key} must be a dict with 'params', a list of parameter indices")
        if len(group["params"]) != len(mine["params"]):
            raise OptimizerStateError(
                f"{key} has {len(group['params'])} parameters, engine.optimizer's group {index} {len(mine['params'])}"
            )
        for name in ("lr", "betas", "eps", "weight_decay"):
            if name not in group:
                raise OptimizerStateError(f"{key} lacks {name!r}")
        _number(f"{key}['lr']", group["lr"], low=0.0)
        _number(f"{key}['eps']", group["eps"], low=0.0, open_low=True)
        _number(f"{key}['weight_decay']", group["weight_decay"], low=0.0)
        betas = group["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise OptimizerStateError(f"{key}['betas'] must be a pair, got {betas!r}")
        for position, beta in enumerate(betas):
            _number(f"{key}['betas'][{position}]", beta, low=0.0, high=1.0)
        for option in ("amsgrad", "maximize"):
            if group.get(option):
                raise OptimizerStateError(f"{key}[{option!r}] is True: the engine's CPU Adam does not run {option}")
        for option in ("decoupled_weight_decay", "adamw_mode"):
            if option in group and bool(group[option]) != adamw_mode:
                raise OptimizerStateError(
                    f"{key}[{option!r}] is {group[option]}, but the engine runs {mode} (the config's optimizer.type)"
                )


class EngineOptimizer(torch.optim.Optimizer):
    """See the module docstring. `param_groups` as `offload.config.param_groups.resolve_param_groups`
    gives them; `defaults`: the config's optimizer values."""

    def __init__(self, engine, param_groups: list[dict], defaults: dict) -> None:
        self._engine = engine
        # whether the last step() applied an update (engine.step() returns it)
        self.applied = False
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
        self.applied = self._engine._apply_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient accumulated since the last applied step (see the module docstring)."""
        self._engine._zero_grad()

    def _params(self) -> list:
        return [param for group in self.param_groups for param in group["params"]]

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state dict (see the module docstring)."""
        saved = super().state_dict()  # the groups, params as indices; `self.state` stays empty
        saved["state"] = self._engine._optimizer_state(self._params())
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """The groups' values, moments and step counts from `state_dict` (torch's format), checked
        whole before anything changes; with a config scheduler, its values for the engine's
        current step are put back on top."""
        adamw_mode = self._engine.hyper.config.type == "adamw"

        def check() -> None:
            check_groups(state_dict, self.param_groups, adamw_mode)

        state = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        by_position = None
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            # torch maps a state key to the parameter at its place in the saved groups' lists
            order = [key for group in state_dict["param_groups"] if isinstance(group, dict) for key in group.get("params", [])]
            places = {key: position for position, key in enumerate(order)}
            if isinstance(state, dict):
                by_position = {places.get(key, f"{key!r} (in no group's params)"): entry for key, entry in state.items()}
        self._engine._load_optimizer_state(self._params(), state if by_position is None else by_position, check)
        super().load_state_dict({**state_dict, "state": {}})
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
