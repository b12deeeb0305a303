"""Optimizers on the C++ CPU Adam kernel: `CPUAdamW` and the raw `kernels`."""

from offload.optim.cpu_adam import CPUAdamW

__all__ = ["CPUAdamW"]
