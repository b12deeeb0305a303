"""Gradients as code written for plain PyTorch sees them, between the backward that ends a
gradient window and `step()`.

The engine takes each gradient off the device as backward goes (runtime/gradients): its value
lives in the optimizer tier (host buffers, NVMe pieces, device tensors), summed over ranks and
micro-batches, as this rank's shard of each unit. `param.grad` would stay None, and
`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` (so accelerate's `clip_grad_norm_`, and
the Hugging Face Trainer's `max_grad_norm`) would find no gradient, return 0 and clip nothing.

So, from the end of the backward that ends a window until `step()` (or the next backward, a
checkpoint load, `close()`), every parameter with a gradient in the window holds a `GradHandle`
as its `.grad`: a tensor with the parameter's shape, dtype and device but no storage, standing
for the engine's gradient. It answers what `clip_grad_norm_` asks of it, exactly:

- the norm of one gradient (`torch.linalg.vector_norm`, `torch._foreach_norm`, `grad.norm()`):
  the true norm of the parameter's fp32 gradient (over every rank's shard, the loss scale and
  the ranks' sum undone), times the factors it was multiplied by since;
- an in-place multiplication by a scalar (`mul_`, `_foreach_mul_`): recorded, and the coming
  step multiplies the gradient by it (the same path as `engine.clip_grad_norm_`). Every
  gradient of the window must get the same factor: the engine scales them all at once.

Anything else (reading a value, adding, zeroing, copying) raises `GradientNotAvailableError`
naming the routes that work. No handle outlives the window: autograd would add the next
backward's gradient into a `.grad` that is not None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.platform.collectives import Collectives
from offload.storage.grad_sum import squared_norm
from offload.storage.tiers import TierStore

aten = torch.ops.aten

ROUTES = (
    "the gradients live in the engine's tiers (host RAM, NVMe, sharded over ranks), not in param.grad. What works: "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (or accelerator.clip_grad_norm_) between the "
    "backward that ends a window and step(); engine.clip_grad_norm_(max_norm), which returns the global norm; the "
    "config's gradient_clipping; param.grad.norm() for one parameter's norm"
)


class GradientNotAvailableError(OffloadError, RuntimeError):
    """User code did something to a parameter's `.grad` that the engine's gradient cannot do."""


def torch_clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor, computed as it does (in fp32 tensors):
    min(1, max_norm / (norm + 1e-6))."""
    total = torch.tensor(norm, dtype=torch.float32)
    return float(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))


def combine_norms(norms: list[float], norm_type: float) -> float:
    """The norm of the concatenation of tensors whose `norm_type` norms are `norms`."""
    if not norms:
        return 0.0
    if math.isinf(norm_type):
        return max(norms)
    return math.fsum(value**norm_type for value in norms) ** (1.0 / norm_type)


def check_norm_type(norm_type: float) -> float:
    """The norm types the engine computes exactly: any p > 0, and inf."""
    value = float(norm_type)
    if not (value > 0):
        raise GradientNotAvailableError(
            f"a gradient norm of type {norm_type} is not supported on the engine's gradients: use a p-norm with p > 0 "
            "(2, the default; 1; ...) or inf"
        )
    return value


@dataclass
class _Slot:
    """One parameter with a gradient in the window: where its elements lie in its unit's flat buffer."""

    unit: UnitState
    index: int  # into unit.spec.params
    param: torch.nn.Parameter


class GradHandle(torch.Tensor):
    """A parameter's `.grad` standing for the engine's gradient (see the module docstring)."""

    _owner: GradHandles
    _position: int
    _name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, owner: GradHandles, position: int, name: str) -> GradHandle:
        handle = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        handle._owner = owner
        handle._position = position
        handle._name = name
        return handle

    def __repr__(self, *, tensor_contents=None):  # torch's would read the values
        return f"GradHandle({self._name}: the engine's gradient, shape {tuple(self.shape)}; see offload.runtime.grad_handles)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.linalg_vector_norm.default:
            handle, norm_type, dim = _norm_arguments(args, kwargs)
            if dim is not None and sorted(d % max(handle.dim(), 1) for d in dim) != list(range(handle.dim())):
                raise GradientNotAvailableError(f"a norm over some dimensions of {handle._name}'s gradient: {ROUTES}")
            keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
            return handle._owner.norm_tensor(handle, norm_type, kwargs.get("dtype"), keepdim=keepdim)
        if func is aten._foreach_norm.Scalar:
            handles = args[0]
            norm_type = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            return [h._owner.norm_tensor(h, norm_type, kwargs.get("dtype")) for h in handles]
        if func in (aten.mul_.Tensor, aten.mul_.Scalar):
            handle, factor = args
            handle._owner.scale(handle, _scalar(factor, handle))
            return handle
        if func in (aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar):
            handles, factor = args
            for handle in handles:
                handle._owner.scale(handle, _scalar(factor, handle))
            return None
        first = next((a for a in _flat(args) if isinstance(a, GradHandle)), None)
        name = first._name if first is not None else "a parameter"
        raise GradientNotAvailableError(f"{func} on the .grad of {name}: {ROUTES}")


def _flat(args):
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from _flat(arg)
        else:
            yield arg


def _norm_arguments(args, kwargs):
    handle = args[0]
    norm_type = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if isinstance(dim, int):
        dim = [dim]
    return handle, norm_type, dim


def _scalar(factor, handle: GradHandle) -> float:
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise GradientNotAvailableError(f"a multiplication of {handle._name}'s gradient by a tensor: {ROUTES}")
        return float(factor.detach().to("cpu"))
    return float(factor)


class GradHandles:
    """The handles of one window, their norms (computed once per norm type, on first use, on
    every rank) and the factors user code multiplied them by.

    `drain` waits for the gradient transfers in flight; `divisor` is what the stored gradients
    carry over the true ones (the loss scale times the number of ranks)."""

    def __init__(
        self,
        *,
        store: TierStore,
        collectives: Collectives,
        drain: Callable[[], None],
        divisor: Callable[[], float],
    ) -> None:
        self.store = store
        self.collectives = collectives
        self.drain = drain
        self.divisor = divisor
        self._slots: list[_Slot] = []
        self._handles: list[GradHandle] = []
        self._factors: list[float] = []
        self._norms: dict[float, list[float]] = {}
        self._refusal: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def install(self, units: list[UnitState], refusal: str | None = None) -> None:
        """After the backward that ends a window: a handle as `.grad` of every parameter with a
        gradient in it. `refusal`: every use of them raises it (the window cannot be clipped)."""
        self.clear()
        self._refusal = refusal
        for unit in units:
            if not unit.window_started:
                continue
            for index in sorted(unit.grads_in_window):
                param = unit.spec.params[index]
                handle = GradHandle(param, self, len(self._slots), unit.spec.param_names[index])
                self._slots.append(_Slot(unit, index, param))
                self._handles.append(handle)
                self._factors.append(1.0)
                param.grad = handle

    def clear(self) -> None:
        """Each handle still in place becomes None again; the factors are forgotten."""
        for slot, handle in zip(self._slots, self._handles):
            if slot.param.grad is handle:
                slot.param.grad = None
        self._slots, self._handles, self._factors, self._norms = [], [], [], {}
        self._refusal = None

    def clipped(self) -> bool:
        """Whether user code multiplied some gradient of the window by something other than 1."""
        return any(factor != 1.0 for factor in self._factors)

    def factor(self) -> float:
        """The factor every gradient of the window was multiplied by (1 when none was); an
        error when they differ."""
        if any(math.isnan(value) for value in self._factors):
            return float("nan")  # a non-finite norm: the step is skipped (fp16) or refused
        factors = set(self._factors)
        if len(factors) <= 1:
            return factors.pop() if factors else 1.0
        scaled = [self._handles[i]._name for i, f in enumerate(self._factors) if f != 1.0]
        unscaled = [self._handles[i]._name for i, f in enumerate(self._factors) if f == 1.0]
        shown = ", ".join(unscaled[:3]) + (" …" if len(unscaled) > 3 else "")
        raise GradientNotAvailableError(
            f"the gradients of the window were multiplied by different factors ({len(scaled)} of {len(self._factors)} "
            f"parameters were, not {shown or 'the others alike'}): the engine scales every gradient of a step by one "
            "factor. Clip all of them at once: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), or "
            "engine.clip_grad_norm_(max_norm)"
        )

    def scale_all(self, factor: float) -> None:
        self._check_allowed()
        self._factors = [value * factor for value in self._factors]

    def scale(self, handle: GradHandle, factor: float) -> None:
        self._check_current(handle)
        self._check_allowed()
        self._factors[handle._position] *= factor

    def norm_tensor(self, handle: GradHandle, norm_type, dtype=None, keepdim: bool = False) -> torch.Tensor:
        """`handle`'s norm as torch returns it: a 0-dim tensor on the gradient's device (fp32,
        the engine's gradients' dtype, unless `dtype` asks for another)."""
        self._check_current(handle)
        self._check_allowed()
        norm = self.param_norms(check_norm_type(norm_type))[handle._position] * abs(self._factors[handle._position])
        shape = (1,) * handle.dim() if keepdim else ()
        return torch.full(shape, norm, dtype=dtype or torch.float32, device=handle.device)

    def param_norms(self, norm_type: float) -> list[float]:
        """The true `norm_type` norm of each handle's gradient (unscaled), computed on first use
        (a collective over ranks: every rank asks in the same order, as clip_grad_norm_ does)."""
        if norm_type not in self._norms:
            self.drain()
            partial = self._local_partials(norm_type)
            what = "the gradient norms clip_grad_norm_ asked for"
            if math.isinf(norm_type):
                total = [self.collectives.max_host(value, what=what) for value in partial]
                norms = total
            else:
                total = self.collectives.sum_host(partial, what=what)
                norms = [max(value, 0.0) ** (1.0 / norm_type) for value in total]
            divisor = self.divisor()
            self._norms[norm_type] = [value / divisor for value in norms]
        return self._norms[norm_type]

    def _local_partials(self, norm_type: float) -> list[float]:
        """Per handle, over this rank's shard: the sum of |g|^p (max |g| for inf)."""
        partial = [0.0] * len(self._slots)
        by_unit: dict[int, list[int]] = {}
        for position, slot in enumerate(self._slots):
            by_unit.setdefault(slot.unit.index, []).append(position)
        for positions in by_unit.values():
            unit = self._slots[positions[0]].unit
            layout = unit.layout
            shard_start = self.collectives.rank * layout.shard_numel
            ranges = []
            for position in positions:
                index = self._slots[position].index
                low = min(max(layout.offsets[index] - shard_start, 0), unit.optimizer_numel)
                high = min(max(layout.offsets[index] + layout.numels[index] - shard_start, 0), unit.optimizer_numel)
                ranges.append((position, low, high))
            for start, values in self.store.read_grad(unit):
                end = start + values.numel()
                for position, low, high in ranges:
                    low, high = max(low, start), min(high, end)
                    if low < high:
                        value = _partial(values[low - start : high - start], norm_type)
                        if math.isinf(norm_type):
                            partial[position] = max(partial[position], value)
                        else:
                            partial[position] += value
        return partial

    def _check_current(self, handle: GradHandle) -> None:
        if handle._position >= len(self._handles) or self._handles[handle._position] is not handle:
            raise GradientNotAvailableError(
                f"a gradient handle of {handle._name} kept past its window's step(): it stands for gradients "
                f"that are gone. Read param.grad again after the next backward; {ROUTES}"
            )

    def _check_allowed(self) -> None:
        if self._refusal is not None:
            raise GradientNotAvailableError(self._refusal)


def _partial(values: torch.Tensor, norm_type: float) -> float:
    if norm_type == 2.0:
        return squared_norm(values)
    if math.isinf(norm_type):
        return float(torch.linalg.vector_norm(values, float("inf")))
    return float(torch.linalg.vector_norm(values, norm_type, dtype=torch.float64)) ** norm_type
