"""The accelerator abstraction: CUDA streams and events, or the CPU standing in.

One code path for both. On CUDA, copies between host and device run on a dedicated copy
stream and complete an event that the compute stream waits on. On the CPU, a copy is done when
the call returns, streams are absent and every event is already complete, so the same engine
code runs (and is tested) without a GPU.
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


class Device:
    """The compute device, its copy stream, and the host-side settings that follow from it."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.torch_device = torch.device(device)
        self.is_cuda = self.torch_device.type == "cuda"
        # The copy stream: filled by the transfer worker and the optimizer worker with H2D/D2H
        # copies; the compute stream waits on the events those copies record.
        self.copy_stream = torch.cuda.Stream(self.torch_device) if self.is_cuda else None

    @property
    def pin_host_memory(self) -> bool:
        return self.is_cuda

    def copy_stream_context(self):
        if self.copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.copy_stream)

    def record_copy_event(self):
        """An event completed when the copies issued so far on the copy stream are done."""
        if self.copy_stream is None:
            return CompletedEvent()
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

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

    def copy_waits(self, event) -> None:
        """The copy stream waits for `event` (e.g. gradients produced on the compute stream)."""
        if self.copy_stream is not None and not isinstance(event, CompletedEvent):
            self.copy_stream.wait_event(event)

    def keep_alive_on_copy_stream(self, tensor: torch.Tensor) -> None:
        """Tells the caching allocator that the copy stream still uses `tensor`."""
        if self.copy_stream is not None and tensor.is_cuda:
            tensor.record_stream(self.copy_stream)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"
