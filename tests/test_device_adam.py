"""The accelerator's Adam (offload.optim.device_adam) against the C++ CPU kernel: the same
update to fp32 rounding, in every mode, over several steps; on the CPU here, on CUDA too where
there is one (the same test, the device the engine picks)."""

import itertools

import pytest
import torch
from reference import ENGINE_DEVICE

from offload.optim import kernels
from offload.optim.device_adam import device_adam_step

MODES = list(itertools.product([True, False], [True, False], [1.0, 0.37], [0.0, 0.1]))


@pytest.mark.parametrize("adamw_mode,bias_correction,grad_scale,weight_decay", MODES)
def test_device_adam_equals_the_cpu_kernel(adamw_mode, bias_correction, grad_scale, weight_decay):
    generator = torch.Generator().manual_seed(0)
    n = 10_007  # not a multiple of any vector width
    cpu = [torch.randn(n, generator=generator) for _ in range(2)] + [torch.zeros(n), torch.zeros(n)]
    device = [t.to(ENGINE_DEVICE) for t in cpu]
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay, adamw_mode=adamw_mode)
    for step in range(1, 6):
        grad = torch.randn(n, generator=generator)
        cpu[1].copy_(grad)
        device[1].copy_(grad)
        kernels.adam_step(
            cpu[0], cpu[1], cpu[2], cpu[3], step=step, bias_correction=bias_correction, grad_scale=grad_scale, **hyper
        )
        device_adam_step(*device, step=step, bias_correction=bias_correction, grad_scale=grad_scale, **hyper)
    for index in (0, 2, 3):  # param, exp_avg, exp_avg_sq (the gradient is consumed)
        torch.testing.assert_close(device[index].cpu(), cpu[index], rtol=2e-6, atol=2e-7)
    # and the update is not the identity: the weights moved
    assert not torch.equal(device[0].cpu(), torch.randn(n, generator=torch.Generator().manual_seed(0)))


def test_empty_range_is_a_no_op():
    empty = [torch.empty(0, device=ENGINE_DEVICE) for _ in range(4)]
    device_adam_step(*empty, step=1, lr=1.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
