"""The accelerator abstraction: CUDA streams and events, or the CPU standing in.

One code path for both. On CUDA, copies between host and device run on two copy streams, one
per direction (PCIe is full duplex: a unit's weights coming in need not queue behind another
unit's gradients going out); each copy records an event that its consumer waits on. On the
CPU, a copy is done when the call returns, there are no streams and every event has already
happened, so the same engine code runs (and is tested) without a GPU.

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

import torch


class CompletedEvent:
    """An event that has already happened: the CPU path's copies are synchronous."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CopyStream:
    """A side stream (one direction of host/device copies, or the device-tier optimizer's
    work): a CUDA stream, or nothing on the CPU."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.name = name
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def context(self):
        """Copies issued inside run on this stream."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def record_event(self):
        """An event completed when the copies issued so far on this stream are done."""
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
        """Tells the caching allocator that this stream still uses `tensor`."""
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)


class Device:
    """The compute device, its side streams, and the host-side settings that follow from it."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.torch_device = torch.device(device)
        self.is_cuda = self.torch_device.type == "cuda"
        self.host_to_device = CopyStream(self.torch_device, "host-to-device")
        self.device_to_host = CopyStream(self.torch_device, "device-to-host")
        self.optimizer = CopyStream(self.torch_device, "optimizer")

    @property
    def pin_host_memory(self) -> bool:
        return self.is_cuda

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

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"
