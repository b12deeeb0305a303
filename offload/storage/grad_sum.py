"""A micro-batch's gradient added into the fp32 gradient of a unit's state, and its squared norm:
plain functions over tensors, used by the tier store (`TierStore.accumulate_grad`) and the
gradient handles (user code's reads of the norm)."""

from __future__ import annotations

import torch

from offload.optim import kernels


def squared_norm(values: torch.Tensor, carried: float = 0.0) -> float:
    """Sum of squares of an fp32 gradient, accumulated in fp64 and added to `carried`: on host
    memory the C++ kernel's canonical order (`kernels.sq_norm`: a unit's gradient summed piece by
    piece, each piece carrying the previous one's result, is the whole unit's sum bit for bit),
    torch's reduction for a DEVICE-tier gradient on an accelerator (never cut into pieces)."""
    if values.device.type == "cpu":
        return kernels.sq_norm(values, carried)
    return carried + float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2


def accumulate_gradient(
    target: torch.Tensor, start: int, pieces: list[tuple[int, torch.Tensor]], first_in_window: bool, norm: float | None
) -> float | None:
    """Into `target`, the gradient of the state's elements [start, start + target.numel()): the
    parts of `pieces` ((offset, 1-D gradient), sorted, disjoint) that fall there are added, or,
    first in the window, written with zeros between them. With `norm` (the squared norm of the
    state's elements before `start`, 0.0 for the first piece) returns it continued over `target`
    (squared_norm); None computes nothing."""
    end = start + target.numel()
    cursor = start
    for offset, grad in pieces:
        low, high = max(offset, start), min(offset + grad.numel(), end)
        if low >= high:
            continue
        values = grad[low - offset : high - offset]
        if first_in_window:
            target[cursor - start : low - start].zero_()
            target[low - start : high - start].copy_(values)
            cursor = high
        else:
            target[low - start : high - start].add_(values)
    if first_in_window:
        target[cursor - start :].zero_()
    return None if norm is None else squared_norm(target, norm)
