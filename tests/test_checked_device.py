"""The checked stand-in device (`device="checked"`, `OFFLOAD_DEVICE=checked`): the CPU run as an
asynchronous accelerator whose side streams are worker threads, and which raises an
OrderingError for every ordering a GPU run depends on and the engine left out.

Three parts:
- the device itself, by direct calls (no engine): streams are asynchronous, copies land late
  (NaN until then), stream-to-stream waits order the work, each of the five rules fires when
  its ordering is missing and stays quiet when it is there, failures never hang, close() stops
  the workers;
- the device against the engine: each test removes ONE ordering the engine relies on, by a
  small monkeypatch inside the test (the library is not edited), and the run must fail with
  the rule and stream that ordering protects;
- the control: the engine, unpatched, trains on the checked device exactly (bitwise) as on the
  plain CPU device for every placement and overlap mode, with no OrderingError.

An error raised in a stream's worker surfaces at the next wait on that stream, usually wrapped
(a failed wait's OrderingError, the engine's OffloadError): `ordering_error` walks the chain
down to the violation itself.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from reference import TinyNet, batches, engine_run

import offload
from offload.errors import ConfigError, OffloadError, OrderingError
from offload.platform.checked_device import CheckedDevice, CheckedEvent
from offload.platform.choose import make_device
from offload.runtime.gradients import GradientOffload
from offload.runtime.residency import Residency
from offload.runtime.stepper import UnitStepper

# an ordering error must surface this fast (a wait that cannot end raises only after
# checked_device.STUCK_SECONDS = 120 s)
PROMPT_SECONDS = 20.0


def make_config(swap_dir, param="cpu", optimizer="cpu", overlap="none", precision="fp32"):
    return {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }


def ordering_error(error: BaseException) -> OrderingError:
    """The innermost OrderingError of `error`'s chain: the violation itself, under the wrappers
    (a failed wait's OrderingError, the engine's OffloadError)."""
    chain = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    found = [e for e in chain if isinstance(e, OrderingError)]
    assert found, f"no OrderingError in the chain: {[repr(e) for e in chain]}"
    return found[-1]


def checked_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("offload-checked-") and t.is_alive()}


@pytest.fixture
def device():
    """A checked device with the default (fast) streams, closed after the test even if it failed."""
    device = CheckedDevice()
    yield device
    with contextlib.suppress(OrderingError):
        device.close()


@contextlib.contextmanager
def held(stream):
    """The stream's worker blocks on a gate until the block ends: what is queued inside the block
    has not run before it ends (deterministic, unlike a race against a slow copy)."""
    gate = threading.Event()
    stream.launch(lambda: gate.wait(PROMPT_SECONDS), what="the gate")
    try:
        yield
    finally:
        gate.set()


def host_tensors(numel: int = 8):
    return torch.arange(numel, dtype=torch.float32) + 1, torch.zeros(numel)


# ---- the device itself ------------------------------------------------------------------------
def test_make_device_builds_the_checked_device_with_settings_from_the_environment():
    device = make_device("checked", environ={"OFFLOAD_CHECKED_H2D_GBPS": "2", "OFFLOAD_CHECKED_D2H_GBPS": "3"})
    try:
        assert isinstance(device, CheckedDevice)
        assert "CheckedDevice" in repr(device)
        assert device.kind == "checked" and device.separate_memory and not device.is_cuda
        assert device.host_to_device.bytes_per_second == 2e9
        assert device.device_to_host.bytes_per_second == 3e9
    finally:
        device.close()
    with pytest.raises(ConfigError, match="OFFLOAD_CHECKED_H2D_GBPS"):
        make_device("checked", environ={"OFFLOAD_CHECKED_H2D_GBPS": "fast"})
    with pytest.raises(ConfigError, match="h2d_gbps"):
        CheckedDevice(h2d_gbps=0)


def test_initialize_takes_the_checked_device_by_argument_or_environment(swap_dir, monkeypatch):
    with offload.initialize(TinyNet(), make_config(swap_dir), device="checked") as engine:
        assert "Checked" in repr(engine.device)
    device = CheckedDevice(h2d_gbps=3.0)
    with offload.initialize(TinyNet(), make_config(swap_dir), device=device) as engine:
        assert engine.device is device
    monkeypatch.setenv("OFFLOAD_DEVICE", "checked")
    with offload.initialize(TinyNet(), make_config(swap_dir)) as engine:
        assert isinstance(engine.device, CheckedDevice)


def test_an_unknown_offload_device_is_a_config_error_listing_the_choices(swap_dir, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "bogus")
    with pytest.raises(ConfigError) as caught:
        offload.initialize(TinyNet(), make_config(swap_dir))
    message = str(caught.value)
    assert "bogus" in message
    for kind in ("cpu", "cuda", "checked"):
        assert kind in message


def test_a_slow_copy_lands_only_after_its_event():
    # 200 bytes at 1e-6 GB/s (1 KB/s): the copy takes 0.2 s
    device = CheckedDevice(h2d_gbps=1e-6)
    try:
        src, dst = host_tensors(50)
        queued = time.perf_counter()
        device.host_to_device.copy(dst, src, what="slow")
        event = device.host_to_device.record_event()
        assert torch.isnan(dst).all()  # poisoned until it lands
        assert not event.query()
        event.synchronize()
        assert time.perf_counter() - queued >= 0.15
        assert event.query()
        assert torch.equal(dst, src)
        device.host_reads(dst, "the landed copy")  # waited for: no error
    finally:
        device.close()


def test_an_integer_destination_holds_poison_bytes_until_the_copy_lands(device):
    src, dst = torch.arange(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    with held(device.host_to_device):
        device.host_to_device.copy(dst, src, what="ids")
        assert (dst.view(torch.uint8) == 0xA5).all()
    device.host_to_device.record_event().synchronize()
    assert torch.equal(dst, src)


def test_a_stream_waiting_on_another_streams_event_runs_nothing_before_it():
    device = CheckedDevice(h2d_gbps=1e-6, record=True)  # the h2d copy below takes 0.2 s
    try:
        src, dst = host_tensors(50)
        early_src, early_dst = host_tensors()
        later_src, later_dst = host_tensors()
        device.host_to_device.copy(dst, src, what="slow")
        event = device.host_to_device.record_event()
        device.device_to_host.copy(early_dst, early_src, what="unordered")  # no wait: runs at once
        device.device_to_host.waits(event)
        device.device_to_host.copy(later_dst, later_src, what="ordered")
        device.device_to_host.record_event().synchronize()
        # the host saw the h2d copy through the device-to-host stream's wait on it
        device.host_reads(dst, "the slow copy's destination")
        ops = {entry["what"]: entry for entry in device.timeline if entry["type"] == "op"}
        assert ops["ordered"]["start"] >= ops["slow"]["end"]
        assert event.id in ops["ordered"]["after"]
        assert ops["unordered"]["end"] < ops["slow"]["end"]  # the streams run side by side
        assert torch.equal(dst, src) and torch.equal(later_dst, later_src)
    finally:
        device.close()


def test_a_write_to_a_copys_source_before_the_stream_reads_it_is_source_changed(device):
    src, dst = host_tensors()
    with held(device.host_to_device):
        device.host_to_device.copy(dst, src, what="the source")
        src.add_(1)  # the stream has not read it yet
    with pytest.raises(OrderingError) as caught:
        device.host_to_device.record_event().synchronize()
    error = ordering_error(caught.value)
    assert (error.rule, error.stream, error.what) == ("source-changed", "host-to-device", "the source")


def test_without_checksums_the_same_write_goes_unnoticed():
    device = CheckedDevice(checksums=False)
    try:
        src, dst = host_tensors()
        with held(device.host_to_device):
            device.host_to_device.copy(dst, src, what="the source")
            src.add_(1)
        device.host_to_device.record_event().synchronize()
        assert torch.equal(dst, src)
    finally:
        device.close()


def test_a_side_stream_write_into_fresh_memory_needs_a_compute_wait(device):
    src, dst = host_tensors()
    device.allocated(dst)
    with pytest.raises(OrderingError) as caught:
        device.host_to_device.copy(dst, src, what="fresh")
    assert (caught.value.rule, caught.value.stream, caught.value.what) == ("write-before-compute", "host-to-device", "fresh")
    device.host_to_device.waits(device.record_compute_event())
    device.host_to_device.copy(dst, src, what="fresh")
    device.host_to_device.record_event().synchronize()
    assert torch.equal(dst, src)


def test_a_side_stream_read_of_what_compute_made_needs_its_compute_event(device):
    produced, dst = host_tensors()
    event = device.record_compute_event()  # recorded when `produced` was final
    device.device_to_host.keep_alive(produced)
    with pytest.raises(OrderingError) as caught:
        device.device_to_host.copy(dst, produced, what="gradient")
    assert (caught.value.rule, caught.value.stream) == ("read-before-compute", "device-to-host")
    device.device_to_host.waits(event)
    device.device_to_host.copy(dst, produced, what="gradient")
    device.device_to_host.record_event().synchronize()
    assert torch.equal(dst, produced)


def test_reading_a_copys_destination_before_waiting_is_read_before_wait(device):
    src, dst = host_tensors()
    device.host_to_device.copy(dst, src, what="weights")
    # the copy may well have landed by now: the rule is about the host's wait, not the timing
    for read in (device.compute_reads, device.host_reads):
        with pytest.raises(OrderingError) as caught:
            read(dst, "the destination")
        assert (caught.value.rule, caught.value.stream, caught.value.what) == ("read-before-wait", "host-to-device", "weights")
    device.compute_reads(src, "the source")  # only what the op writes counts
    device.compute_waits(device.host_to_device.record_event())
    device.compute_reads(dst, "the destination")
    device.host_reads(dst, "the destination")


def test_a_launched_value_read_before_waiting_is_read_before_wait(device):
    launched = device.optimizer.launch(lambda: 42, what="the norm")
    with pytest.raises(OrderingError) as caught:
        launched.value()
    assert (caught.value.rule, caught.value.stream) == ("read-before-wait", "optimizer")
    device.optimizer.record_event().synchronize()
    assert launched.value() == 42


def test_giving_a_buffer_back_with_an_unseen_op_on_it_is_reuse_in_flight(device):
    src, dst = host_tensors()
    device.device_to_host.copy(dst, src, what="staged")
    event = device.device_to_host.record_event()
    deadline = time.monotonic() + PROMPT_SECONDS
    while not event.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert event.query()  # the copy is done, but the host has not waited for it
    for buffer in (src, dst):  # what the op reads counts as much as what it writes
        with pytest.raises(OrderingError) as caught:
            device.releasing(buffer, "the staging buffer")
        assert (caught.value.rule, caught.value.stream) == ("reuse-in-flight", "device-to-host")
    event.synchronize()
    device.releasing(src, "the staging buffer")
    device.releasing(dst, "the staging buffer")


def test_a_failed_stream_never_hangs_its_waiters(device):
    def broken():
        raise ValueError("kernel failed")

    src, dst = host_tensors()
    started = time.monotonic()
    with held(device.optimizer):  # nothing fails before the other stream queued its work
        device.optimizer.launch(broken, what="broken")
        event = device.optimizer.record_event()
        # another stream ordered after the failed one fails too, instead of waiting forever
        device.device_to_host.waits(event)
        device.device_to_host.copy(dst, src, what="after the failure")
    with pytest.raises(OrderingError) as caught:
        event.synchronize()
    assert isinstance(ordering_error(caught.value).__cause__, ValueError)
    with pytest.raises(OrderingError, match="failed"):
        device.device_to_host.record_event().synchronize()
    with pytest.raises(OrderingError, match="failed earlier"):
        device.optimizer.launch(lambda: None, what="more work")
    with pytest.raises(OrderingError):
        device.close()
    assert time.monotonic() - started < PROMPT_SECONDS
    assert all(stream._worker is None or not stream._worker.is_alive() for stream in device.streams)


def test_close_stops_the_stream_workers():
    before = checked_threads()
    device = CheckedDevice()
    src, dst = host_tensors()
    for stream in device.streams:
        stream.copy(dst, src, what=f"on {stream.name}")
        stream.record_event().synchronize()
    assert {t.name for t in checked_threads() - before} == {f"offload-checked-{s.name}" for s in device.streams}
    device.close()
    assert not checked_threads() - before
    with pytest.raises(OrderingError, match="closed"):
        device.host_to_device.copy(dst, src, what="after close")


# ---- the engine with one ordering removed -----------------------------------------------------
def run_to_ordering_error(swap_dir, patch, *, param="cpu", optimizer="cpu", steps=3, overlap="none") -> OrderingError:
    """Trains TinyNet on the checked device with `patch(engine)` applied; the run must fail
    promptly with an OrderingError, which is returned (the violation, under its wrappers)."""
    torch.manual_seed(0)
    engines = []
    started = time.monotonic()
    with pytest.raises(OffloadError) as caught:
        with offload.initialize(TinyNet(), make_config(swap_dir, param, optimizer, overlap), device="checked") as engine:
            engines.append(engine)
            patch(engine)
            engine_run(engine, batches(steps))
    assert time.monotonic() - started < PROMPT_SECONDS
    (engine,) = engines
    assert all(stream._worker is None or not stream._worker.is_alive() for stream in engine.device.streams)
    return ordering_error(caught.value)


def drop_compute_waits(monkeypatch, stream) -> None:
    """`stream.waits(e)` ignores compute events (the stream's waits on other streams stay)."""
    real = stream.waits

    def waits(event) -> None:
        if isinstance(event, CheckedEvent) and event.stream is None:
            return  # a compute event: dropped
        real(event)

    monkeypatch.setattr(stream, "waits", waits)


class _NotWaitedFor(CheckedEvent):
    """A stream event whose `synchronize()` returns at once: the host does not wait for it.
    (`compute_waits` on it still waits: it calls the device's host_waits directly.)"""

    def synchronize(self) -> None:
        return None


def drop_host_syncs(monkeypatch, stream) -> None:
    """Every `stream.record_event().synchronize()` returns without waiting."""
    real = stream.record_event

    def record_event():
        event = real()
        return _NotWaitedFor(event.device, event.stream, event.seq, event.id)

    monkeypatch.setattr(stream, "record_event", record_event)


def write_source_after_queueing(monkeypatch, stream, what_prefix) -> None:
    """Right after a copy named `what_prefix...` is queued, the host adds 1 to its source."""
    real = stream.copy

    def copy(dst, src, *, what, unit=None):
        real(dst, src, what=what, unit=unit)
        if what.startswith(what_prefix):
            with torch.no_grad():
                src.add_(1)

    monkeypatch.setattr(stream, "copy", copy)


def test_h2d_fetch_copy_without_its_compute_wait_is_write_before_compute(swap_dir, monkeypatch):
    # Removes, in Residency._fetch_shard, `to_device.waits(compute_done)`: the fetch's copy
    # into the unit's freshly allocated device buffer no longer waits for the compute event
    # recorded at the allocation (kernels queued before may still read that memory). The
    # host-to-device stream waits on compute events nowhere else.
    error = run_to_ordering_error(swap_dir, lambda engine: drop_compute_waits(monkeypatch, engine.device.host_to_device))
    assert (error.rule, error.stream) == ("write-before-compute", "host-to-device")
    assert error.what.startswith("weights of unit")


def test_h2d_fetch_used_without_the_compute_wait_is_read_before_wait(swap_dir, monkeypatch):
    # Removes, in Residency._complete_fetch, `device.compute_waits(event)`: compute uses the
    # fetched weights without waiting for their copy (param cpu: the fetch itself does not
    # synchronize, it has no staging buffer to give back).
    def complete_fetch_without_wait(self, unit):
        unit.fetch_future, future = None, unit.fetch_future
        future.result()  # the copy's event, not waited on
        unit.fetch_target = None
        unit.resident = True
        unit.resident_version = unit.fetch_version

    error = run_to_ordering_error(
        swap_dir, lambda engine: monkeypatch.setattr(Residency, "_complete_fetch", complete_fetch_without_wait)
    )
    assert (error.rule, error.stream) == ("read-before-wait", "host-to-device")
    assert error.what.startswith("weights of unit")


def test_h2d_new_weights_used_without_the_compute_wait_is_read_before_wait(swap_dir, monkeypatch):
    # param none: removes, in Residency._await_step, `device.compute_waits(unit.device_update_event)`:
    # the next forward reads the device weights before the copy of the step's new weights
    # (stepper._publish_to_device) was waited for. Overlap forward: step() returns before the
    # steps are done, so that wait is the forward's only one (with overlap none, step() itself
    # makes the new weights current: tests/test_reads_after_step.py removes that wait).
    def await_step_without_wait(self, unit):
        unit.step_done.wait()
        unit.device_update_event = None

    error = run_to_ordering_error(
        swap_dir,
        lambda engine: monkeypatch.setattr(Residency, "_await_step", await_step_without_wait),
        param="none",
        overlap="forward",
    )
    assert (error.rule, error.stream) == ("read-before-wait", "host-to-device")
    assert error.what.startswith("new weights of unit")


def test_h2d_staging_buffer_given_back_before_the_fetch_copy_is_reuse_in_flight(swap_dir, monkeypatch):
    # param nvme: removes, in Residency._fetch_shard, `event.synchronize()` before the staging
    # buffer the weights were read into goes back to its pool (the next fetch's read would
    # overwrite what the copy still reads). `compute_waits` on the fetch's event still waits.
    error = run_to_ordering_error(
        swap_dir, lambda engine: drop_host_syncs(monkeypatch, engine.device.host_to_device), param="nvme"
    )
    assert (error.rule, error.stream) == ("reuse-in-flight", "host-to-device")
    assert error.what.startswith("weights of unit")


def test_h2d_fetch_source_written_while_the_copy_is_queued_is_source_changed(swap_dir, monkeypatch):
    # The host writes the fetch's source (the unit's 16-bit home copy) right after its copy is
    # queued: the copy would carry the new values or the old, depending on timing. At 1e-5 GB/s
    # (10 KB/s) the first fetch (1.3 KB) takes 0.13 s, so the write lands before the stream reads.
    monkeypatch.setenv("OFFLOAD_CHECKED_H2D_GBPS", "1e-5")
    error = run_to_ordering_error(
        swap_dir, lambda engine: write_source_after_queueing(monkeypatch, engine.device.host_to_device, "weights of unit")
    )
    assert (error.rule, error.stream) == ("source-changed", "host-to-device")
    assert error.what.startswith("weights of unit")


def test_d2h_gradient_copy_without_its_compute_wait_is_read_before_compute(swap_dir, monkeypatch):
    # Removes, in GradientOffload._accumulate, `to_host.waits(event)`: the gradient is copied
    # off the device without waiting for the compute event recorded when it was final. The
    # device-to-host stream waits on compute events nowhere else.
    error = run_to_ordering_error(swap_dir, lambda engine: drop_compute_waits(monkeypatch, engine.device.device_to_host))
    assert (error.rule, error.stream) == ("read-before-compute", "device-to-host")
    assert error.what.startswith("gradient of unit")


def test_d2h_staged_gradient_read_before_its_copy_is_waited_for_is_read_before_wait(swap_dir, monkeypatch):
    # Removes, in GradientOffload._accumulate, `to_host.record_event().synchronize()`: the host
    # adds the staged gradient into the fp32 gradient without waiting for the copy into it.
    error = run_to_ordering_error(swap_dir, lambda engine: drop_host_syncs(monkeypatch, engine.device.device_to_host))
    assert (error.rule, error.stream) == ("read-before-wait", "device-to-host")
    assert error.what.startswith("gradient of unit")


def test_d2h_staging_buffer_given_back_before_the_gradient_copy_is_waited_for_is_reuse_in_flight(swap_dir, monkeypatch):
    # Moves the give-back of the gradient staging buffer (GradientOffload._accumulate's
    # `device.releasing(staging, ...)`, then the end of its `store.grad_staging_buffer()` block)
    # to right after the copy into it is queued, before its wait: the next unit's gradient could
    # be copied over it.
    def patch(engine):
        stream = engine.device.device_to_host
        real = stream.copy

        def copy(dst, src, *, what, unit=None):
            real(dst, src, what=what, unit=unit)
            engine.device.releasing(dst, f"the gradient staging buffer ({what})")

        monkeypatch.setattr(stream, "copy", copy)

    error = run_to_ordering_error(swap_dir, patch)
    assert (error.rule, error.stream) == ("reuse-in-flight", "device-to-host")
    assert error.what.startswith("gradient of unit")


def test_d2h_gradient_written_while_its_copy_is_queued_is_source_changed(swap_dir, monkeypatch):
    # Compute writes the device gradient right after its copy to the host is queued (the
    # gradient buffer reused too early). At 1e-4 GB/s (100 KB/s) the first gradient copy (the
    # last block's, 17 KB) takes 0.17 s: the write lands before the stream reads the source.
    monkeypatch.setenv("OFFLOAD_CHECKED_D2H_GBPS", "1e-4")
    error = run_to_ordering_error(
        swap_dir, lambda engine: write_source_after_queueing(monkeypatch, engine.device.device_to_host, "gradient of unit")
    )
    assert (error.rule, error.stream) == ("source-changed", "device-to-host")
    assert error.what.startswith("gradient of unit")


def test_optimizer_accumulation_without_its_compute_wait_is_read_before_compute(swap_dir, monkeypatch):
    # optimizer tier device: removes, in GradientOffload._accumulate, `stream.waits(event)`: the
    # gradient is added into the device fp32 gradient on the optimizer stream without waiting
    # for the compute event of the gradient. The optimizer stream waits on compute events
    # nowhere else.
    error = run_to_ordering_error(
        swap_dir, lambda engine: drop_compute_waits(monkeypatch, engine.device.optimizer), param="none", optimizer="device"
    )
    assert (error.rule, error.stream) == ("read-before-compute", "optimizer")
    assert error.what.startswith("gradient of unit")


def test_optimizer_accumulation_value_read_before_the_wait_is_read_before_wait(swap_dir, monkeypatch):
    # optimizer tier device: removes `stream.record_event().synchronize()` before
    # `launched.value()` in GradientOffload._accumulate (and in UnitStepper._step_on_device,
    # which runs later): the accumulation's result (the squared norm) is read unwaited.
    error = run_to_ordering_error(
        swap_dir, lambda engine: drop_host_syncs(monkeypatch, engine.device.optimizer), param="none", optimizer="device"
    )
    assert (error.rule, error.stream) == ("read-before-wait", "optimizer")
    assert error.what.startswith("gradient of unit")


def test_optimizer_step_value_read_before_the_wait_is_read_before_wait(swap_dir, monkeypatch):
    # optimizer tier device: UnitStepper._step_on_device reads `launched.value()` of the device
    # Adam right after launching it, before `stream.record_event().synchronize()`.
    def patch(engine):
        stream = engine.device.optimizer
        real = stream.launch

        def launch(fn, *, what, **kwargs):
            launched = real(fn, what=what, **kwargs)
            if what.startswith("the Adam step"):
                launched.value()
            return launched

        monkeypatch.setattr(stream, "launch", launch)

    error = run_to_ordering_error(swap_dir, patch, param="cpu", optimizer="device")
    assert (error.rule, error.stream) == ("read-before-wait", "optimizer")
    assert error.what.startswith("the Adam step of unit")


def test_the_orderings_the_patches_remove_are_where_they_say():
    # a library change that moves one of them shows here, rather than as a patch above that
    # no longer removes what its comment says
    fetch = inspect.getsource(Residency._fetch_shard)
    assert "to_device.waits(compute_done)" in fetch and "event.synchronize()" in fetch
    assert "self.device.compute_waits(event)" in inspect.getsource(Residency._complete_fetch)
    assert "compute_waits(unit.device_update_event)" in inspect.getsource(Residency._await_step)
    accumulate = inspect.getsource(GradientOffload._accumulate)
    for line in ("stream.waits(event)", "to_host.waits(event)", "record_event().synchronize()", "self.device.releasing(staging"):
        assert line in accumulate
    step = inspect.getsource(UnitStepper._step_on_device)
    assert step.index("stream.record_event().synchronize()") < step.index("launched.value()")


# ---- the control: unpatched, exactly like the plain CPU device --------------------------------
PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme", "device"]))


def train(swap_dir, device, param, optimizer, overlap, precision):
    if device == "checked":
        # 10 MB/s each way: a TinyNet unit's copy takes ~2 ms, so copies are still queued when
        # the host moves on (the default 25 GB/s lands them nearly at once)
        device = CheckedDevice(h2d_gbps=0.01, d2h_gbps=0.01)
    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(
        copy.deepcopy(model), make_config(swap_dir, param, optimizer, overlap, precision), device=device
    ) as engine:
        losses = engine_run(engine, batches(6))
        state = engine.consolidated_state_dict()
        queued = {stream.name: stream.queued for stream in getattr(engine.device, "streams", ())}
    return losses, state, queued, engine.device


def assert_trains_like_the_cpu_device(swap_dir, param, optimizer, overlap, precision):
    losses, state, queued, device = train(swap_dir, "checked", param, optimizer, overlap, precision)
    assert isinstance(device, CheckedDevice)
    cpu_losses, cpu_state, _, _ = train(swap_dir, "cpu", param, optimizer, overlap, precision)
    assert losses == cpu_losses
    assert state.keys() == cpu_state.keys()
    for name, value in cpu_state.items():
        assert torch.equal(state[name], value), name
    # the streams really carried the work (weights in, gradients out or added on the device)
    assert queued["host-to-device"] > 0
    assert (queued["optimizer"] > 0) == (optimizer == "device")
    assert (queued["device-to-host"] > 0) == (optimizer != "device")
    assert all(stream._worker is None or not stream._worker.is_alive() for stream in device.streams)


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_unpatched_fp32_trains_bitwise_like_the_cpu_device(swap_dir, param, optimizer, overlap):
    assert_trains_like_the_cpu_device(swap_dir, param, optimizer, overlap, "fp32")


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("param,optimizer", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "device")])
def test_unpatched_16_bit_trains_bitwise_like_the_cpu_device(swap_dir, param, optimizer, overlap, precision):
    assert_trains_like_the_cpu_device(swap_dir, param, optimizer, overlap, precision)


# ---- close() waits for the streams before freeing host buffers --------------------------------
CLOSE_RIGHT_AFTER_A_STEP = """
import sys
import torch
sys.path.insert(0, {tests!r})
from reference import TinyNet, batches, engine_run
import offload
from offload.platform.checked_device import CheckedDevice
torch.manual_seed(0)
config = {{"precision": "fp32", "optimizer": {{"lr": 1e-2, "weight_decay": 0.01}},
          "offload": {{"param": "none", "optimizer": "cpu", "nvme_path": {swap_dir!r}}}, "overlap": "forward"}}
device = CheckedDevice(h2d_gbps=1e-4)
engine = offload.initialize(TinyNet(), config, device=device)
engine_run(engine, batches(2))
engine.stepping.wait()  # the steps done, their copies queued (overlap forward: step() did not wait for them)
stream = device.host_to_device
in_flight = stream.queued - stream.completed
engine.close()
print("closed", in_flight, stream.queued - stream.completed)
"""


def test_close_waits_for_the_streams_before_freeing_host_buffers(swap_dir):
    # param none: the last step's copies of the new weights to the device read the host 16-bit
    # copies (pool buffers); at 1e-4 GB/s (100 KB/s) each takes ~0.17 s, so they are surely still
    # queued at close() (overlap forward: step() returns before them, nor does any forward wait
    # for them: with overlap none, step() makes them current before it returns). Freeing the pool first (as close() once did) made the stream worker read
    # unmapped memory: a segfault, hence the subprocess.
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", CLOSE_RIGHT_AFTER_A_STEP.format(tests=tests, swap_dir=swap_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    _, in_flight, left = result.stdout.split()
    assert int(in_flight) > 0  # copies were queued when close() began
    assert int(left) == 0
