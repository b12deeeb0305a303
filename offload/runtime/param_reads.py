"""Reads of the model's parameters by code that is not the engine's: seen, and made safe.

A parameter is a view of its unit's device buffer. Outside the unit's own forward and backward
that buffer may not hold what the parameter should read: with `param: cpu|nvme` its storage is
freed between uses (a read is undefined: torch's "data is not allocated yet", or a segmentation
fault), and with overlap a step may still be writing a `param: none` unit's weights after
`engine.step()` returned. Such reads come from a parameter read outside its unit inside the
forward (a tied head, a regulariser), from the loss code between forward and backward, and from
anything between steps: a callback, a logger, an EMA, a copy, evaluation, `print(param)`.

They are seen through torch's `__torch_function__` protocol: one `TorchFunctionMode`, shared by
every engine, sits at the bottom of the function-mode stack of each thread that built an engine
or ran its forward (at the bottom, so that the user's own modes keep entering and leaving in
their order above it). It looks at the tensors of each torch call; when one is a parameter an
open engine watches (`ParamReads`) and the call reads its values, the engine decides
(`Schedule.on_param_read`): hold the unit on the device, wait for its step, or refuse with an
error naming what to use. Calls that only look at a parameter's metadata (shape, dtype,
device, `requires_grad`, `.grad`, hooks) are not reads (`reads_weights`). The mode leaves a
thread's stack when the last engine that installed it there closes; an engine collected without
`close()` stops being watched (the registry holds engines weakly).

Other threads. The mode is thread-local, and a read on a thread without it went straight to the
device buffer: with the weights offloaded, to freed storage (a read of another thread segfaulted,
issue 51). So while an offloaded engine is open its parameters are of class `WatchedParameter`
(an `nn.Parameter` whose `__torch_function__` sees a read on any thread; set back to
`nn.Parameter` at close), and a read there goes to the same decision. Which thread may act on a
read (`read_verdict`): the engine's schedule and holds belong to the thread inside its call
(`offload.platform.process.DrivingThread`), so a read is decided as a call of the engine (a
thread reading while another is inside a call gets ConcurrentUseError), and a read from another
thread than the one whose micro-step is in progress (it ran the forward, whose backward has not
ended) is refused. Autograd's own reads during the engine's backward (the recompute of a
checkpointed block, on CUDA on autograd's device thread) pass.

Not seen: with `param: none`, reads on threads where no engine ran (the weights stay allocated:
they race with the training thread as in plain PyTorch); reads under
`torch._C.DisableTorchFunction` (and, on such threads, under `DisableTorchFunctionSubclass`);
reads of a tensor taken from a parameter while it was readable (a `detach()` inside
`engine.params_on_device()`) after the block ended; parameters of a class of the model's own
(not `nn.Parameter`), whose class is not changed.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.platform.process import Driving
from offload.runtime.overlap import Stepping
from offload.runtime.residency import Residency

# Properties whose value is (a view of) the parameter's data: reading one is a read.
_DATA_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})

# Calls that look at a parameter without reading its values (its storage may be freed meanwhile).
_METADATA_CALLS = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr,
        torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.retain_grad,
        torch.Tensor.requires_grad_,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
        torch.Tensor.new_empty,
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.numel,
        torch._has_compatible_shallow_copy_type,
        torch.is_floating_point,
        torch.is_complex,
        torch.empty_like,
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
    }
)


def reads_weights(func) -> bool:
    """Whether a torch call on a parameter reads its values (or hands out a view that could).
    Getting a property reads only for the data's own views (`.data`, `.T`, ...); setting one
    (`param.grad = None`, `requires_grad`) never does."""
    if func in _METADATA_CALLS:
        return False
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _DATA_PROPERTIES
    return name not in ("__set__", "__delete__")


def returns_itself(func, args: tuple, kwargs: dict) -> bool:
    """Whether a conversion hands back the tensor itself, reading nothing: `t.to(...)` to the
    device, dtype and layout it has (a `model.to(device)` that changes nothing, as the Hugging
    Face Trainer calls at its start), `t.cpu()` of a CPU tensor."""
    tensor = args[0] if args else None
    if not isinstance(tensor, torch.Tensor):
        return False
    if func is torch.Tensor.cpu:
        return tensor.device.type == "cpu"
    if func is not torch.Tensor.to or kwargs.get("copy"):
        return False
    try:
        parsed = torch._C._nn._parse_to(*args[1:], **{key: value for key, value in kwargs.items() if key != "non_blocking"})
    except (TypeError, RuntimeError):
        return False
    device, dtype, _, memory_format = parsed
    same_device = device is None or device == tensor.device or (device.type == tensor.device.type and device.index is None)
    return same_device and dtype in (None, tensor.dtype) and memory_format in (None, torch.preserve_format)


# Conversions: called on a parameter between steps they would move or recast the engine's weights.
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "double", "float", "half", "bfloat16", "type"})


def conversion_note(func) -> str:
    """For a conversion (`model.to()`, `.cpu()`, `.half()`...) read as a parameter read: a
    sentence saying that the engine places the weights itself, and where such a call comes from;
    else ""."""
    if getattr(func, "__name__", None) not in _CONVERSIONS:
        return ""
    return (
        " If it came from moving or recasting the model (model.to(), .cpu(), .half(), ...): the engine places and "
        "casts the weights itself, and a model under it cannot be moved or recast. The Hugging Face Trainer moves the "
        "model to TrainingArguments.device at its start: on a GPU machine, do not pass use_cpu=True with an engine's "
        "model."
    )


def describe_call(func) -> str:
    """`Tensor.sum`, `Tensor.data`: the call as an error message names it."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return f"{'Tensor.' if getattr(torch.Tensor, name, None) is not None else ''}{name}"


class ReadVerdict(enum.Enum):
    """What a read of a watched parameter gets (`read_verdict`)."""

    # autograd running the engine's backward: its own reads
    PASS = "pass"
    # the engine decides (`Schedule.on_param_read`: hold, wait or refuse), inside its
    # DrivingThread as a call of its own
    DECIDE = "decide"
    # refused (ConcurrentUseError): another thread is inside an engine call
    BUSY = "busy"
    # refused: another thread's micro-step is in progress (its forward ran, its backward has not
    # ended), and what the engine holds for it is that thread's to use
    REFUSE = "refuse"


def read_verdict(*, in_backward: bool, in_autograd: bool, mid_step: bool, driving: Driving, forward_here: bool) -> ReadVerdict:
    """`in_backward`: the engine's backward is running; `in_autograd`: this thread runs autograd's
    graph (torch's current graph task); `mid_step`: a forward ran whose backward has not ended;
    `driving`: where the thread inside an engine call is; `forward_here`: this thread ran the
    last forward (the model's own `model(x)` too, which is no engine call)."""
    if in_backward and in_autograd:
        return ReadVerdict.PASS
    if driving is Driving.ELSEWHERE:
        return ReadVerdict.BUSY
    if mid_step and driving is Driving.NOBODY and not forward_here:
        return ReadVerdict.REFUSE
    return ReadVerdict.DECIDE


class WatchedParameter(nn.Parameter):
    """An offloaded engine's parameter while the engine is open (see the module docstring): a
    read on a thread without the mode is checked here; on a thread with it, the mode has
    checked it already. Copies are plain parameters."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _OWNERS and not getattr(_THREAD, "has_mode", False) and not returns_itself(func, args, kwargs or {}):
            _check_call(func, args)
            if kwargs:
                _check_call(func, tuple(kwargs.values()))
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]


class ParamReads:
    """One engine's parameters, watched while it is open: a call reading one calls
    `on_read(unit_index, param_name, func)` first (on the calling thread), which waits, holds
    or raises; then, on a device that checks orderings, `checked_read(param, what)` declares
    the read (the checked device raises `OrderingError` if a copy into the parameter's memory
    was not waited for). `on_read` None: the engine needs no read watched (param none, overlap
    none, one rank: step() returns with its new weights current), and only the checked device
    looks. `everywhere`: parameters watched on every thread (an offloaded engine's: they become
    `WatchedParameter`s while it is open). Inside the engine's own walks over the parameters
    (`suspend` / `resume` on the walking thread: the model's state_dict, whose `detach()` of
    each parameter is replaced by fp32 weights) reads are not checked."""

    def __init__(
        self,
        params: dict[int, tuple[int, str]],
        on_read: Callable[[int, str, object], None] | None,
        checked_read: Callable[[torch.Tensor, str], None] | None = None,
        everywhere: Sequence[nn.Parameter] = (),
    ) -> None:
        self.params = params
        self.on_read = on_read
        self.checked_read = checked_read
        self.everywhere = [param for param in everywhere if type(param) is nn.Parameter]
        self._walks = threading.local()  # `depth`: this thread's walks in progress

    def open(self) -> None:
        """Watched from now on, on this thread (and on each thread `install` is called from), and
        the `everywhere` parameters on every thread."""
        keys = tuple(self.params)
        reference = weakref.ref(self, lambda dead: _forget(keys, dead))
        for key in keys:
            _OWNERS[key] = reference
        _OPEN.add(self)
        for param in self.everywhere:
            param.__class__ = WatchedParameter
        self.install()

    def install(self) -> None:
        """The mode on this thread's stack (each forward calls it: a loop may train from a thread
        other than the one that built the engine)."""
        self._walks.depth = 0
        _install_mode()

    def close(self) -> None:
        """No longer watched; the mode leaves this thread's stack if no open engine uses it."""
        _forget(tuple(self.params), _OWNERS.get(next(iter(self.params), -1)))
        _OPEN.discard(self)
        self.params = {}
        for param in self.everywhere:  # each was an nn.Parameter when the engine opened
            param.__class__ = nn.Parameter
        self.everywhere = []
        if not _OPEN:
            _remove_mode()

    def _walking(self) -> int:
        depth: int = getattr(self._walks, "depth", 0)
        return depth

    def suspend(self) -> None:
        self._walks.depth = self._walking() + 1

    def resume(self) -> None:
        self._walks.depth = max(0, self._walking() - 1)

    def check(self, func, tensor: torch.Tensor) -> None:
        found = self.params.get(id(tensor))
        if found is None or self._walking():
            return
        if self.on_read is not None:
            self.on_read(found[0], found[1], func)
        if self.checked_read is not None:
            self.checked_read(tensor, f"parameter {found[1]!r} ({describe_call(func)})")


# id(parameter) -> its engine's ParamReads, held weakly: an engine collected without close()
# leaves (and its parameters with it). `_OPEN`: the engines watching, for the mode's removal.
# `_THREAD.has_mode`: the mode is on this thread's stack (WatchedParameter leaves it the reads).
_OWNERS: dict[int, weakref.ref[ParamReads]] = {}
_OPEN: weakref.WeakSet[ParamReads] = weakref.WeakSet()
_THREAD = threading.local()


def _forget(keys: tuple[int, ...], reference) -> None:
    for key in keys:
        if reference is not None and _OWNERS.get(key) is reference:
            del _OWNERS[key]


def read_between_steps(residency: Residency, stepping: Stepping, unit: UnitState, name: str, func) -> None:
    """A read of `unit`'s parameter `name` between steps (no forward or backward running).
    Inside `engine.params_on_device()` (the unit held, current) it reads what is there. Else,
    with `param: none`, it waits for the unit's step (overlap: the step may still be running)
    and raises the step's failure; an offloaded unit's weights are not on the device, and the
    read is refused, naming the routes that read them."""
    if unit.holders and (not residency.offloaded or (unit.resident and unit.resident_version == unit.weights_version)):
        return
    call = describe_call(func)
    if residency.offloaded:
        raise OffloadError(
            f"{call} read parameter {name!r} between steps, but its weights are not on the device: with offload.param "
            f"cpu or nvme the engine keeps them there only while it runs their unit ({unit.spec.name}), and frees that "
            "memory after each use. Read fp32 copies with engine.consolidated_state_dict() (or model.state_dict()), or "
            "read the parameters on the device inside `with engine.params_on_device(module):` (module: the model, or one "
            "of its blocks)." + conversion_note(func)
        )
    if unit.needs_gather:
        raise OffloadError(
            f"{call} read parameter {name!r} between steps, but its unit ({unit.spec.name}) was just stepped and each rank "
            "holds only its own shard of the new weights until the next forward gathers them. Read fp32 copies with "
            "engine.consolidated_state_dict(), or read the parameters inside `with engine.params_on_device(module):` "
            "(on every rank, with the same module)." + conversion_note(func)
        )
    residency._await_step(unit)
    stepping.raise_if_failed()


class _ParamReadsMode(TorchFunctionMode):
    """The one mode (see the module docstring): its handler runs with itself popped, so the
    engine's work inside `on_read` is not seen again."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _OWNERS and not returns_itself(func, args, kwargs):
            _check_call(func, args)
            if kwargs:
                _check_call(func, tuple(kwargs.values()))
        return func(*args, **kwargs)


def _check_call(func, values: tuple) -> None:
    for value in values:
        for candidate in value if isinstance(value, (list, tuple)) else (value,):
            reference = _OWNERS.get(id(candidate)) if isinstance(candidate, torch.Tensor) else None
            reads = None if reference is None else reference()
            if reads is not None and reads_weights(func):
                reads.check(func, candidate)


_MODE = _ParamReadsMode()


def _stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _install_mode() -> None:
    """At the bottom of this thread's stack, once: the modes above are taken off and put back
    in their order, so each of them still leaves with its own `__exit__` (which pops the top)."""
    _THREAD.has_mode = True
    if any(mode is _MODE for mode in _stack()):
        return
    above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(_MODE)
    for mode in reversed(above):
        torch._C._push_on_torch_function_stack(mode)


def _remove_mode() -> None:
    """Off this thread's stack, the modes above it put back in their order."""
    _THREAD.has_mode = False
    stack = _stack()
    if not any(mode is _MODE for mode in stack):
        return
    for _ in stack:
        torch._C._pop_torch_function_stack()
    for mode in stack:
        if mode is not _MODE:
            torch._C._push_on_torch_function_stack(mode)


def mode_installed() -> bool:
    """Whether the mode is on this thread's stack (tests)."""
    return any(mode is _MODE for mode in _stack())
