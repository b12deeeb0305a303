"""Adam / AdamW on the accelerator, for units whose optimizer state lives there.

The same update as the C++ CPU kernel (`kernels.adam_step`), on tensors of any device: the
gradient used is `grad * grad_scale`; `step` is the step number after this update; AdamW
decays the weights before the update (decoupled), Adam adds `weight_decay * param` to the
gradient (L2). With bias correction (the default) it runs torch's fused multi-tensor kernel
(`torch._fused_adamw_` / `torch._fused_adam_`: one pass over the four tensors, on CUDA and on
the CPU); without, plain tensor operations. Results equal the CPU kernel's to fp32 rounding
(tests/test_device_adam.py).
"""

from __future__ import annotations

import torch


def device_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> None:
    """One step in place on fp32 `param`, `exp_avg`, `exp_avg_sq` with fp32 `grad` (all on one
    device, same numel). `grad` is consumed: with a grad_scale other than 1 the fused kernel
    leaves it scaled (the engine's fp32 gradient is rewritten by the next window anyway)."""
    if param.numel() == 0:
        return
    if bias_correction:
        fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
        # the fused kernels divide the gradient by grad_scale
        scale = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=param.device)
        fused(
            [param],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(float(step), dtype=torch.float32, device=param.device)],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
        )
        return
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if weight_decay:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
