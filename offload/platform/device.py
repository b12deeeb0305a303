"""The accelerator abstraction: CUDA streams and events, the CPU standing in, or the checked
stand-in (offload.platform.checked_device) that runs the CPU like an asynchronous accelerator.

One code path for all three. On CUDA, copies between host and device run on two copy streams,
one per direction (PCIe is full duplex: a unit's weights coming in need not queue behind another
unit's gradients going out); each copy records an event that its consumer waits on. On the plain
CPU, a copy is done when the call returns, there are no streams and every event has already
happened, so the same engine code runs without a GPU. `make_device` picks one: the `device`
argument of `initialize`, else `OFFLOAD_DEVICE` in the environment, else CUDA when present.

The engine issues side-stream work only through `CopyStream.copy` and `CopyStream.launch`, and
tells the device what it does with memory around them (`allocated`, `releasing`,
`compute_reads`, `host_reads`). On CUDA and the plain CPU those declarations cost nothing; the
checked device turns each into a rule it enforces (offload.platform.checked_device).

Streams and events, who fills them and who waits:
- `host_to_device`: the transfer worker copies fetched 16-bit weights into a unit's device
  buffer, and (param tier none) the optimizer worker copies a unit's new weights into it (cast
  from the device master, for a unit whose optimizer state is on the device). The
  compute stream waits on the event of the copy before the unit runs (`compute_waits`). A
  fetch's copy first waits on a compute event recorded when its storage was allocated: the
  memory may still be read by kernels queued before it was freed.
- `device_to_host`: the transfer worker copies a unit's gradient into a pinned staging buffer
  after waiting on the compute event recorded when the gradient was final, then waits on the
  copy's event on the host before adding the staged values into the fp32 gradient.
- `optimizer`: the work on optimizer state kept on the device (optimizer tier DEVICE). The
  transfer worker adds a unit's gradient into its device fp32 gradient there, after waiting on
  the compute event of the gradient; the optimizer worker runs the unit's Adam step and the
  cast of its new weights there. Each waits on the host for its own work (the squared norm is
  read back; the new 16-bit weights are copied to their home) before the unit counts as
  landed or stepped, so nothing else waits on this stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

# what OFFLOAD_DEVICE (and initialize's `device` string) accepts, besides "cuda:N"
DEVICE_KINDS = ("cpu", "cuda", "checked")


class StreamEvent(Protocol):
    """What the engine keeps of an event: a torch.cuda.Event, a CompletedEvent, or the checked
    device's event."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CompletedEvent:
    """An event that has already happened: the CPU path's copies are synchronous."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Launched:
    """The result of work launched on a side stream. On CUDA and the plain CPU the function ran
    when launched (its kernels queued, a value it returned already read back); the checked
    device's version holds it until the stream ran it (offload.platform.checked_device)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def value(self) -> Any:
        """What the launched function returned; read it only after waiting for the stream."""
        return self._result


class CopyStream:
    """A side stream (one direction of host/device copies, or the device-tier optimizer's
    work): a CUDA stream, or nothing on the CPU."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.name = name
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _context(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, what: str, unit: int | None = None) -> None:
        """Queues `dst.copy_(src)` on this stream. `what` names the buffer for errors and the
        timeline ("weights of unit layers.3"), `unit` its index."""
        with self._context():
            dst.copy_(src, non_blocking=self.stream is not None)

    def launch(
        self,
        fn: Callable[[], Any],
        *,
        what: str,
        unit: int | None = None,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
    ) -> Launched:
        """Runs `fn` with this stream current: its kernels queue here. `reads` and `writes` are
        the tensors it reads and writes (the checked device checks them)."""
        with self._context():
            return Launched(fn())

    def record_event(self):
        """An event completed when the work issued so far on this stream is done."""
        if self.stream is None:
            return CompletedEvent()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def waits(self, event) -> None:
        """This stream waits (without blocking the host) for `event`, e.g. a compute event."""
        if self.stream is not None and not isinstance(event, CompletedEvent):
            self.stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tells the caching allocator that this stream still uses `tensor` (compute made it:
        the stream reads it after waiting on a compute event recorded once it was final)."""
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)


class Device:
    """The compute device, its side streams, and the host-side settings that follow from it."""

    kind = "device"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.torch_device = torch.device(device)
        self.is_cuda = self.torch_device.type == "cuda"
        self.kind = "cuda" if self.is_cuda else "cpu"
        self.host_to_device = CopyStream(self.torch_device, "host-to-device")
        self.device_to_host = CopyStream(self.torch_device, "device-to-host")
        self.optimizer = CopyStream(self.torch_device, "optimizer")

    @property
    def separate_memory(self) -> bool:
        """Whether device memory is apart from host memory, so that weights and gradients cross
        between them through copies and staging buffers (CUDA, and the checked stand-in)."""
        return self.is_cuda

    @property
    def pin_host_memory(self) -> bool:
        return self.is_cuda

    @property
    def checks_orderings(self) -> bool:
        """Whether the declarations below are checked (the checked stand-in): the engine then
        also declares each read of a parameter its user makes (param_reads.py), whatever it
        watches otherwise."""
        return False

    def record_compute_event(self):
        """An event completed when the work issued so far on the compute stream is done."""
        if not self.is_cuda:
            return CompletedEvent()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def compute_waits(self, event) -> None:
        """The compute stream waits (without blocking the host) for `event`."""
        if self.is_cuda and not isinstance(event, CompletedEvent):
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def memory(self) -> tuple[int, int] | None:
        """The accelerator's (free, total) bytes now; None when the CPU stands in for it."""
        if not self.is_cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.torch_device)
        return int(free), int(total)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    # ---- what the engine does with memory (rules only the checked device enforces) ----------
    def allocated(self, tensor: torch.Tensor) -> None:
        """Device memory for `tensor` was just allocated (it may be memory compute freed while
        kernels that read it are still queued)."""

    def releasing(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor` is about to go back to its pool, or its storage to be freed."""

    def compute_reads(self, tensor: torch.Tensor, what: str) -> None:
        """Compute is about to read `tensor` (after its waits)."""

    def host_reads(self, tensor: torch.Tensor, what: str) -> None:
        """The host is about to read `tensor` (after its waits)."""

    def close(self) -> None:
        """Waits for every stream's work (it reads and writes host buffers the engine frees
        next) and stops what the device runs of its own (the checked device's workers)."""
        self.synchronize()

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"


def to_device_inputs(value, device: torch.device, compute_dtype: torch.dtype):
    """A forward's inputs for the device: tensors in `value` (nested in tuples, lists and dicts)
    go to `device`, floating-point ones in `compute_dtype` (integer ids, masks and labels keep
    theirs); anything else as it is."""
    if isinstance(value, torch.Tensor):
        dtype = compute_dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=dtype, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(to_device_inputs(v, device, compute_dtype) for v in value)
    if isinstance(value, list):
        return [to_device_inputs(v, device, compute_dtype) for v in value]
    if isinstance(value, dict):
        return {k: to_device_inputs(v, device, compute_dtype) for k, v in value.items()}
    return value
