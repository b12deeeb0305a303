"""The checked stand-in device (`OFFLOAD_DEVICE=checked`): the CPU run as an asynchronous
accelerator, so that the orderings a GPU run depends on are exercised, and checked, on every
test run.

Memory is host memory, as on the plain CPU device, but the engine treats it as apart from the
host (`separate_memory`): weights and gradients cross through copies and staging buffers as on
CUDA. Each side stream (`host-to-device`, `device-to-host`, `optimizer`) is a worker thread that
runs what was queued on it in order, asynchronously to the host and to the other streams, a copy
after a delay from its bytes and the stream's bandwidth. Compute is the host thread itself: a
compute event has happened when it is recorded, and `compute_waits` blocks the host.

Threads, and who waits on what:
- one worker per stream fills its `completed` count; the device's condition wakes every waiter
  (host waits, other streams' waits) when any op completes or a stream fails;
- a host wait on an event (`event.synchronize()`, `compute_waits`, `synchronize()`) blocks until
  the op before the event completed, then marks it and everything ordered before it (through
  other streams' events the stream waited on) as seen by the host.

The rules, each an `OrderingError` naming the rule, the stream and the buffer (never a hang: a
wait that cannot end raises after `STUCK_SECONDS`):
- `read-before-wait`: the host or compute reads memory a queued op writes before waiting for it:
  the reads the engine declares (`compute_reads`, `host_reads`), and every read of a parameter
  that the user's code makes on a thread the engine watches (a weight norm right after step():
  offload.runtime.param_reads declares it, naming the parameter); a copy's destination also
  holds NaN (or 0xA5 bytes) from its queueing until it lands, so an unchecked read shows up in
  the numbers;
- `source-changed`: a copy's source is checksummed when queued and again when the stream reads
  it: a write in between;
- `reuse-in-flight`: a buffer goes back to its pool, or its storage is freed, while an op on it
  has not been waited for (the record_stream / staging-reuse rule);
- `write-before-compute`: a side stream writes memory allocated after the last compute event it
  waited on (compute may still read what was there);
- `read-before-compute`: a side stream reads memory compute produced (`keep_alive`) without
  waiting on a compute event recorded once it was final.

With `record=True` each completed op, event and host wait goes to `timeline` (what ran, on which
stream, when, how many bytes, after which events): benchmarks/bench_pipeline.py replays it.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.errors import ConfigError, OrderingError
from offload.platform.device import CopyStream, Device, Launched

# PCIe 4.0 x16, each way, as achieved (32 GB/s on the wire)
DEFAULT_COPY_GBPS = 25.0
DEFAULT_LATENCY_US = 5.0
# a host wait that has not ended after this long raises instead of hanging
STUCK_SECONDS = 120.0
_POISON_BYTE = 0xA5

RULES = {
    "read-before-wait": "read memory a queued op writes before waiting for it",
    "source-changed": "a copy's source was written between its queueing and the stream reading it",
    "reuse-in-flight": "a buffer was given back or freed while an op on it was not waited for",
    "write-before-compute": "a side stream wrote memory allocated after the last compute event it waited on",
    "read-before-compute": "a side stream read memory compute produced without waiting for it to be final",
}

Span = tuple[int, int]


def _span(tensor: torch.Tensor) -> Span:
    """The bytes `tensor` covers, [first, last + 1)."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return start, start + extent * tensor.element_size()


def _overlaps(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _checksum(tensor: torch.Tensor) -> int:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy().data)


def _poison(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        else:
            tensor.view(torch.uint8).fill_(_POISON_BYTE)


@dataclass
class _Op:
    id: int
    stream: CheckedStream
    seq: int  # position on its stream, from 1
    kind: str  # "copy", "launch" or "wait"
    what: str
    unit: int | None
    reads: list[Span]
    writes: list[Span]
    nbytes: int
    run: Callable[[], Any] | None
    event: CheckedEvent | None = None  # a wait's event
    source_checksum: int | None = None
    queued_at: float = 0.0
    queued_by: str = ""  # the host thread that queued it
    after: list[int] = field(default_factory=list)  # events waited on before it, since the last op
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    seen_by_host: bool = False


class CheckedEvent:
    """A point on one stream (or on compute, `stream` None: already happened)."""

    def __init__(self, device: CheckedDevice, stream: CheckedStream | None, seq: int, event_id: int) -> None:
        self.device = device
        self.stream = stream
        self.seq = seq
        self.id = event_id

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.seq

    def synchronize(self) -> None:
        self.device.host_waits(self)

    def __repr__(self) -> str:
        where = "compute" if self.stream is None else self.stream.name
        return f"CheckedEvent({where} #{self.seq})"


class _CheckedLaunched(Launched):
    def __init__(self, op: _Op) -> None:
        super().__init__(None)
        self.op = op

    def value(self) -> Any:
        op = self.op
        if not op.seen_by_host:
            stream = op.stream
            raise stream.device.violation(
                "read-before-wait", stream, op.what, "the host read what the launched work returned before waiting for it"
            )
        if op.error is not None:
            raise op.error
        return op.result


class CheckedStream(CopyStream):
    """One side stream: a worker thread running queued ops in order."""

    def __init__(self, device: CheckedDevice, name: str, gbps: float) -> None:
        self.device = device
        self.name = name
        self.stream = None
        self.bytes_per_second = gbps * 1e9
        self.queued = 0  # ops and waits queued (their `seq`)
        self.completed = 0  # ... and completed, in order (worker)
        self.seen_by_host = 0  # ... and seen by the host (host waits)
        self.error: BaseException | None = None
        self.compute_waited = 0  # the latest compute event this stream waits on (queue order)
        self._pending_after: list[int] = []
        # (seq of the wait, event): what the host also sees when it sees this stream past seq
        self._waits: list[tuple[int, CheckedEvent]] = []
        self._queue: collections.deque[_Op | None] = collections.deque()
        # started at the first op: an engine that fails to start leaves no thread behind
        self._worker: threading.Thread | None = None

    # ---- queueing (any host thread) ---------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, what: str, unit: int | None = None) -> None:
        device = self.device
        with device.lock:
            self._check_usable(what)
            dst_span, src_span = _span(dst), _span(src)
            device.check_side_write(self, dst_span, what)
            device.check_side_read(self, src_span, what)
            checksum = _checksum(src) if device.checksums else None
            _poison(dst)

            def run() -> None:
                if checksum is not None and _checksum(src) != checksum:
                    raise device.violation(
                        "source-changed", self, what, "its source was written after the copy was queued, before it landed"
                    )
                with torch.no_grad():
                    dst.copy_(src)

            nbytes = dst.numel() * dst.element_size()
            self._enqueue("copy", what, unit, [src_span], [dst_span], nbytes, run, checksum)

    def launch(
        self,
        fn: Callable[[], Any],
        *,
        what: str,
        unit: int | None = None,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
    ) -> Launched:
        device = self.device
        with device.lock:
            self._check_usable(what)
            read_spans, write_spans = [_span(t) for t in reads], [_span(t) for t in writes]
            for span in write_spans:
                device.check_side_write(self, span, what)
            for span in read_spans:
                device.check_side_read(self, span, what)
            nbytes = sum(t.numel() * t.element_size() for t in writes)
            return _CheckedLaunched(self._enqueue("launch", what, unit, read_spans, write_spans, nbytes, fn, None))

    def record_event(self) -> CheckedEvent:
        with self.device.lock:
            event = CheckedEvent(self.device, self, self.queued, next(self.device.ids))
            self.device.log_event(event)
            return event

    def waits(self, event) -> None:
        if not isinstance(event, CheckedEvent):
            return  # a CompletedEvent
        with self.device.lock:
            self._check_usable("a wait on " + repr(event))
            if event.stream is None:
                self.compute_waited = max(self.compute_waited, event.seq)
                self._pending_after.append(event.id)
                return
            if event.stream is self:
                return
            self._enqueue("wait", f"wait on {event!r}", None, [], [], 0, None, None, event=event)
            self._waits.append((self.queued, event))
            self._pending_after.append(event.id)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        self.device.produced(self, tensor)

    def _check_usable(self, what: str) -> None:
        if self.error is not None:
            raise OrderingError(
                f"checked device: the {self.name} stream failed earlier ({self.error}); nothing more runs on it "
                f"(queueing {what})",
                rule=getattr(self.error, "rule", ""),
                stream=self.name,
                what=what,
            ) from self.error
        if self.device.closed:
            raise OrderingError(f"checked device: closed; cannot queue {what} on the {self.name} stream", stream=self.name)

    def _enqueue(self, kind, what, unit, reads, writes, nbytes, run, checksum, *, event=None) -> _Op:
        """Caller holds the device lock."""
        self.queued += 1
        op = _Op(next(self.device.ids), self, self.queued, kind, what, unit, reads, writes, nbytes, run, event, checksum)
        op.queued_at = time.perf_counter()
        op.queued_by = threading.current_thread().name
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=f"offload-checked-{self.name}", daemon=True)
            self._worker.start()
        if kind != "wait":
            op.after, self._pending_after = self._pending_after, []
            self.device.in_flight.append(op)
        self._queue.append(op)
        self.device.changed.notify_all()
        return op

    # ---- the worker -----------------------------------------------------------------------
    def _work(self) -> None:
        device = self.device
        while True:
            with device.lock:
                while not self._queue:
                    device.changed.wait()
                op = self._queue.popleft()
            if op is None:
                return
            started = time.perf_counter()
            if self.error is None:
                try:
                    self._execute(op)
                except BaseException as error:  # noqa: BLE001 - carried to every waiter of this stream
                    op.error = error
                    self.error = error
            ended = time.perf_counter()
            with device.lock:
                op.done = True
                self.completed = op.seq
                device.log_op(op, started, ended)
                device.changed.notify_all()

    def _execute(self, op: _Op) -> None:
        if op.kind == "wait":
            assert op.event is not None
            self.device.wait_for(op.event, waiter=f"the {self.name} stream")
            return
        delay = self.device.latency + op.nbytes / self.bytes_per_second
        if delay >= 20e-6:
            time.sleep(delay)
        assert op.run is not None
        op.result = op.run()

    def stop(self) -> None:
        if self._worker is None:
            return
        with self.device.lock:
            self._queue.append(None)
            self.device.changed.notify_all()
        self._worker.join(timeout=STUCK_SECONDS)


class CheckedDevice(Device):
    """The CPU as an asynchronous accelerator with checked orderings (see the module docstring).

    `h2d_gbps`, `d2h_gbps`: the copy streams' bandwidths (default PCIe 4.0 x16 as achieved);
    `latency_us`: each op's fixed cost; `checksums`: checksum copy sources (the
    `source-changed` rule); `record`: keep the timeline."""

    def __init__(
        self,
        *,
        h2d_gbps: float = DEFAULT_COPY_GBPS,
        d2h_gbps: float = DEFAULT_COPY_GBPS,
        optimizer_gbps: float = 1000.0,
        latency_us: float = DEFAULT_LATENCY_US,
        checksums: bool = True,
        record: bool = False,
    ) -> None:
        for name, value in (("h2d_gbps", h2d_gbps), ("d2h_gbps", d2h_gbps), ("optimizer_gbps", optimizer_gbps)):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"checked device: {name} must be a positive number of GB/s, got {value!r}")
        if not (latency_us >= 0 and math.isfinite(latency_us)):
            raise ConfigError(f"checked device: latency_us must be >= 0, got {latency_us!r}")
        self.torch_device = torch.device("cpu")
        self.is_cuda = False
        self.kind = "checked"
        self.latency = latency_us * 1e-6
        self.checksums = checksums
        self.record = record
        self.closed = False
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.ids = itertools.count(1)
        self.compute_clock = 0
        # queued ops the host has not seen complete (pruned as host waits see them)
        self.in_flight: list[_Op] = []
        # device memory allocated at compute clock c: side-stream writes need a compute wait > c
        self._allocations: dict[int, tuple[Span, int]] = {}
        # memory compute produced, per reader stream: its reads need a compute wait >= the clock
        self._produced: dict[int, tuple[CheckedStream, Span, int]] = {}
        self._record_keys = itertools.count()
        self.timeline: list[dict] = []
        self.time_zero = time.perf_counter()
        self.host_to_device: CheckedStream = CheckedStream(self, "host-to-device", h2d_gbps)
        self.device_to_host: CheckedStream = CheckedStream(self, "device-to-host", d2h_gbps)
        self.optimizer: CheckedStream = CheckedStream(self, "optimizer", optimizer_gbps)
        self.streams = (self.host_to_device, self.device_to_host, self.optimizer)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> CheckedDevice:
        """Settings from OFFLOAD_CHECKED_H2D_GBPS, OFFLOAD_CHECKED_D2H_GBPS,
        OFFLOAD_CHECKED_LATENCY_US (numbers), OFFLOAD_CHECKED_RECORD (1 to keep the timeline)."""
        kwargs: dict[str, Any] = {}
        for key, name in (
            ("OFFLOAD_CHECKED_H2D_GBPS", "h2d_gbps"),
            ("OFFLOAD_CHECKED_D2H_GBPS", "d2h_gbps"),
            ("OFFLOAD_CHECKED_LATENCY_US", "latency_us"),
        ):
            if environ.get(key):
                try:
                    kwargs[name] = float(environ[key])
                except ValueError:
                    raise ConfigError(f"{key}={environ[key]!r} is not a number") from None
        kwargs["record"] = environ.get("OFFLOAD_CHECKED_RECORD", "") not in ("", "0")
        return cls(**kwargs)

    @property
    def separate_memory(self) -> bool:
        return True

    @property
    def pin_host_memory(self) -> bool:
        return False

    @property
    def checks_orderings(self) -> bool:
        return True

    def violation(self, rule: str, stream: CheckedStream | None, what: str, detail: str) -> OrderingError:
        where = "compute" if stream is None else f"the {stream.name} stream"
        return OrderingError(
            f"checked device, rule {rule!r} ({RULES[rule]}): {where}, {what}: {detail}",
            rule=rule,
            stream="compute" if stream is None else stream.name,
            what=what,
        )

    # ---- compute and host ---------------------------------------------------------------------
    def record_compute_event(self) -> CheckedEvent:
        with self.lock:
            self.compute_clock += 1
            event = CheckedEvent(self, None, self.compute_clock, next(self.ids))
            self.log_event(event)
            return event

    def compute_waits(self, event) -> None:
        # compute is the host thread: its wait blocks
        if isinstance(event, CheckedEvent):
            self.host_waits(event)

    def host_waits(self, event: CheckedEvent) -> None:
        started = time.perf_counter()
        with self.lock:
            self.wait_for(event, waiter="the host")
            if event.stream is not None:
                self._seen_by_host(event.stream, event.seq)
            if self.record:
                self.timeline.append(
                    {
                        "type": "host_wait",
                        "event": event.id,
                        "thread": threading.current_thread().name,
                        "start": started - self.time_zero,
                        "end": time.perf_counter() - self.time_zero,
                    }
                )

    def wait_for(self, event: CheckedEvent, *, waiter: str) -> None:
        """Blocks until `event` happened; raises if its stream failed or it never does."""
        stream = event.stream
        if stream is None:
            return
        with self.lock:
            deadline = time.monotonic() + STUCK_SECONDS
            while stream.completed < event.seq and stream.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OrderingError(
                        f"checked device: {waiter} waited {STUCK_SECONDS:.0f} s for {event!r}, which did not happen "
                        f"(the {stream.name} stream completed {stream.completed} of {stream.queued} ops)",
                        rule="stuck",
                        stream=stream.name,
                    )
                self.changed.wait(left)
            if stream.error is not None:
                raise OrderingError(
                    f"checked device: {waiter} waited for {event!r}, but the {stream.name} stream failed: {stream.error}",
                    rule=getattr(stream.error, "rule", ""),
                    stream=stream.name,
                    what=getattr(stream.error, "what", ""),
                ) from stream.error

    def _seen_by_host(self, stream: CheckedStream, seq: int) -> None:
        """Caller holds the lock. The host saw `stream` complete up to `seq`: so every op before
        it, and what the stream waited on before it, recursively."""
        if seq <= stream.seen_by_host:
            return
        stream.seen_by_host = seq
        for position, event in stream._waits:
            if position <= seq and event.stream is not None:
                self._seen_by_host(event.stream, event.seq)
        stream._waits = [(p, e) for p, e in stream._waits if p > seq]
        still = []
        for op in self.in_flight:
            if op.stream is stream and op.seq <= seq:
                op.seen_by_host = True
            else:
                still.append(op)
        self.in_flight = still

    def synchronize(self) -> None:
        for stream in self.streams:
            self.host_waits(stream.record_event())
        with self.lock:
            self._produced.clear()

    # ---- the rules ------------------------------------------------------------------------
    def check_side_write(self, stream: CheckedStream, span: Span, what: str) -> None:
        for allocated, clock in self._allocations.values():
            if _overlaps(span, allocated) and stream.compute_waited <= clock:
                raise self.violation(
                    "write-before-compute",
                    stream,
                    what,
                    "the memory was allocated after the last compute event this stream waits on; "
                    "wait on a compute event recorded at the allocation first",
                )

    def check_side_read(self, stream: CheckedStream, span: Span, what: str) -> None:
        for key, (reader, produced, clock) in list(self._produced.items()):
            if reader is stream and _overlaps(span, produced):
                if stream.compute_waited < clock:
                    raise self.violation(
                        "read-before-compute",
                        stream,
                        what,
                        "compute produced it, and this stream does not wait on the compute event recorded when it was final",
                    )
                del self._produced[key]

    def _unseen_ops_on(self, span: Span, *, writes_only: bool) -> _Op | None:
        for op in self.in_flight:
            spans = op.writes if writes_only else op.writes + op.reads
            if any(_overlaps(span, s) for s in spans):
                return op
        return None

    def _check_read(self, tensor: torch.Tensor, what: str, reader: str) -> None:
        with self.lock:
            op = self._unseen_ops_on(_span(tensor), writes_only=True)
            if op is not None:
                raise self.violation(
                    "read-before-wait",
                    op.stream,
                    op.what,
                    f"{reader} reads {what} while this op writing it (#{op.seq} on the stream) was not waited for",
                )

    def compute_reads(self, tensor: torch.Tensor, what: str) -> None:
        self._check_read(tensor, what, "compute")

    def host_reads(self, tensor: torch.Tensor, what: str) -> None:
        self._check_read(tensor, what, "the host")

    def releasing(self, tensor: torch.Tensor, what: str) -> None:
        span = _span(tensor)
        with self.lock:
            op = self._unseen_ops_on(span, writes_only=False)
            if op is not None:
                raise self.violation(
                    "reuse-in-flight",
                    op.stream,
                    op.what,
                    f"{what} is given back or freed while this op on it (#{op.seq} on the stream) was not waited for",
                )
            self._forget(span)

    def allocated(self, tensor: torch.Tensor) -> None:
        span = _span(tensor)
        with self.lock:
            self._forget(span)
            key = next(self._record_keys)
            self._allocations[key] = (span, self.compute_clock)
        weakref.finalize(tensor, self._drop_allocation, key)

    def produced(self, stream: CheckedStream, tensor: torch.Tensor) -> None:
        with self.lock:
            key = next(self._record_keys)
            self._produced[key] = (stream, _span(tensor), self.compute_clock)
        weakref.finalize(tensor, self._drop_produced, key)

    def _drop_allocation(self, key: int) -> None:
        with self.lock:
            self._allocations.pop(key, None)

    def _drop_produced(self, key: int) -> None:
        with self.lock:
            self._produced.pop(key, None)

    def _forget(self, span: Span) -> None:
        """Caller holds the lock: memory given back or allocated anew has no history."""
        for key in [k for k, (s, _) in self._allocations.items() if _overlaps(s, span)]:
            del self._allocations[key]
        for key in [k for k, (_, s, _) in self._produced.items() if _overlaps(s, span)]:
            del self._produced[key]

    # ---- the timeline -----------------------------------------------------------------------
    def log_event(self, event: CheckedEvent) -> None:
        if self.record:
            self.timeline.append(
                {
                    "type": "event",
                    "event": event.id,
                    "stream": "compute" if event.stream is None else event.stream.name,
                    "seq": event.seq,
                    "thread": threading.current_thread().name,
                    "time": time.perf_counter() - self.time_zero,
                }
            )

    def log_op(self, op: _Op, started: float, ended: float) -> None:
        if self.record and op.kind != "wait":
            self.timeline.append(
                {
                    "type": "op",
                    "id": op.id,
                    "stream": op.stream.name,
                    "seq": op.seq,
                    "kind": op.kind,
                    "what": op.what,
                    "unit": op.unit,
                    "nbytes": op.nbytes,
                    "after": list(op.after),
                    "thread": op.queued_by,
                    "queued": op.queued_at - self.time_zero,
                    "start": started - self.time_zero,
                    "end": ended - self.time_zero,
                }
            )

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.synchronize()
        finally:
            self.closed = True
            for stream in self.streams:
                stream.stop()

    def __repr__(self) -> str:
        return (
            f"CheckedDevice(cpu standing in, asynchronous streams, host-to-device "
            f"{self.host_to_device.bytes_per_second / 1e9:g} GB/s, device-to-host "
            f"{self.device_to_host.bytes_per_second / 1e9:g} GB/s)"
        )
