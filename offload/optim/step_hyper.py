"""What one optimizer step of one parameter group takes besides the tensors: the hyperparameters
(`StepHyper`) and the keyword arguments both Adam kernels take (`AdamArguments`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class AdamArguments(TypedDict):
    """The keyword arguments both Adam kernels take besides the tensors and the step number."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    grad_scale: float


@dataclass(frozen=True)
class StepHyper:
    """Everything one optimizer step of one parameter group needs besides the tensors (a step
    takes one per group: `hypers[g]` for the params of group g, `UnitState.param_groups`)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    # the stored gradients are multiplied by this (1/loss scale times the clipping factor)
    grad_multiplier: float

    def adam_arguments(self) -> AdamArguments:
        """The keyword arguments of both Adam kernels (kernels.adam_step, device_adam_step)."""
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw_mode": self.adamw_mode,
            "bias_correction": self.bias_correction,
            "grad_scale": self.grad_multiplier,
        }
