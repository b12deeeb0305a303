"""Which parameters the engine trains: those that required grad at `offload.initialize` (it
keeps an fp32 master and moments for them alone; `ScheduleContext.trainable`, per unit the
indices of its trainable parameters), against what requires grad now.

Two mistakes are told apart here, before a backward runs (`GradientWindow` asks):

- a parameter frozen at `initialize` that requires grad now: refused, naming it (its gradients
  would train nothing);
- no parameter that requires grad at all, frozen at `initialize` or since: nothing to train. A
  backward of its loss (which then has no gradient) and a step() with no backward say so,
  instead of guessing at torch.no_grad; an engine over such a model is valid for inference.

Plain functions of the units and the trainable sets; main thread.
"""

from __future__ import annotations

from offload.errors import OffloadError
from offload.model.unit_state import UnitState


def refuse_unfrozen(units: list[UnitState], trainable: list[set[int]]) -> None:
    """A parameter frozen at `initialize` has no fp32 master and no moments (the engine keeps
    none for it), so one set to require grad since would get gradients that train nothing:
    refused, naming it. Freezing a trainable one after `initialize` needs nothing: like
    torch.optim, a parameter without a gradient in a window is not stepped."""
    unfrozen = [
        name
        for unit in units
        for index, (name, param) in enumerate(zip(unit.spec.param_names, unit.spec.params))
        if param.requires_grad and index not in trainable[unit.index]
    ]
    if unfrozen:
        shown = ", ".join(unfrozen[:4]) + (f" and {len(unfrozen) - 4} more" if len(unfrozen) > 4 else "")
        raise OffloadError(
            f"{shown} did not require grad when offload.initialize placed the model, and does now: the engine keeps "
            "no fp32 master or Adam moments for it, so its gradients would train nothing. Set requires_grad before "
            "offload.initialize (an engine over the model with it trainable: engine.close(), then initialize again), "
            "or freeze it again"
        )


def nothing_trainable(units: list[UnitState], trainable: list[set[int]]) -> str | None:
    """Why there is nothing to train, when no parameter of the model requires grad; else None."""
    params = [param for unit in units for param in unit.spec.params]
    if any(param.requires_grad for param in params):
        return None
    when = (
        "the trainable ones were frozen since offload.initialize" if any(trainable) else "none did at offload.initialize either"
    )
    return (
        f"no parameter of the model requires grad ({len(params)} parameters, {when}), so there is nothing to "
        "train. Set requires_grad on the parameters to train (a PEFT adapter's, or model.requires_grad_(True)) "
        "before offload.initialize; for inference alone, run the forward under torch.no_grad() and call no "
        "backward or step()"
    )


def loss_without_grad(units: list[UnitState], trainable: list[set[int]]) -> str:
    """engine.backward's error for a loss that does not require grad: the model has nothing to
    train, or (some parameter requires grad) the forward ran without autograd."""
    nothing = nothing_trainable(units, trainable)
    if nothing is not None:
        return f"engine.backward: the loss has no gradient because {nothing}"
    return "engine.backward: the loss does not require grad (was the forward run under torch.no_grad?)"
