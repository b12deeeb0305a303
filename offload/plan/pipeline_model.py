"""A replay of a recorded training-step schedule under a machine cost model, without torch.

A step is recorded as a list of `Op`s in issue order: each runs on one `resource` (a serial
queue: its ops run one at a time, in list order, except that an `urgent` op waiting for the
resource goes before the non-urgent ones waiting with it, as the I/O engine's urgent queue
serves the disk) and waits for its `deps` to end. `replay`
gives every op a start and an end under a `Machine`'s rates (a discrete-event list schedule),
and the resulting `Replay` says how long the step takes, the `floor` no schedule can beat (the
busiest resource), how much of each resource's work hides under compute, and the critical path:
the chain of ops that sets the step time, i.e. what the schedule fails to hide.
`chrome_trace` turns a replay into a trace that Perfetto and chrome://tracing open.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

# The serial queues an op can run on, in the order traces and summaries list them: device
# compute, the host link each way, the device-side optimizer stream (device-tier Adam), the
# host CPU Adam, the NVMe drive each way, and the host's own work on the thread that drives
# compute (hooks, bookkeeping, Python: what it does before it can hand the device a unit).
RESOURCES: tuple[str, ...] = (
    "compute",
    "host_to_device",
    "device_to_host",
    "optimizer",
    "cpu_adam",
    "nvme_read",
    "nvme_write",
    "host",
)


@dataclass(frozen=True)
class Op:
    """One recorded piece of work of a step: `flops` (compute, optional on optimizer), `nbytes`
    (copies and NVMe IO), `elements` (parameters an Adam op updates) or `share` (host: the
    share of one unit's per-step host time, `Machine.host_unit_us`) on `resource`; it starts
    once every op in `deps` (ids of ops earlier in the list) has ended. `unit` is the model unit
    it belongs to (None for step-wide work); `label` is free text for traces. `urgent`: compute
    waits on it (a weight fetch, a step's state read): when its resource frees, it runs before
    the non-urgent ops that are ready too (the state's write-back, reads ahead of the step)."""

    id: int
    resource: str
    kind: str
    unit: int | None
    flops: float = 0.0
    nbytes: int = 0
    elements: int = 0
    deps: tuple[int, ...] = ()
    label: str = ""
    urgent: bool = False
    share: float = 0.0


@dataclass(frozen=True)
class Machine:
    """Achieved (not peak) rates of one machine, the ones `duration` prices ops with."""

    device_tflops: float  # TFLOPS (1e12 flop/s) dense 16-bit training compute achieves on the device
    h2d_gbps: float  # GB/s (1e9 bytes/s) of pinned host-to-device copies
    d2h_gbps: float  # GB/s of pinned device-to-host copies
    cpu_adam_gparams: float  # billions of parameters per second the host CPU Adam updates
    device_adam_gparams: float  # billions of parameters per second the device-tier Adam updates
    nvme_read_gbps: float  # GB/s read from the swap drive(s)
    nvme_write_gbps: float  # GB/s written to the swap drive(s)
    latency_us: float = 10.0  # µs of fixed cost per copy or IO op (launch, DMA setup, syscall)
    # µs the host spends per unit per step on the thread that drives compute (the engine's hooks
    # and bookkeeping, the model's Python and kernel launches), split over the unit's compute ops
    host_unit_us: float = 0.0
    # the CPU Adam's rate with bf16 / int8 moments (optimizer.state_precision), billions of
    # parameters per second; None: as with fp32 moments (`for_state_precision`)
    cpu_adam_bf16_gparams: float | None = None
    cpu_adam_int8_gparams: float | None = None
    # billions of parameters per second of the exact step on the device (overlap auto's split:
    # optim/moments.adam_step_torch, the C++ kernel's bits; far more memory traffic than the fused Adam)
    device_exact_adam_gparams: float = 10.0
    # GB (1e9 bytes) of device memory: what overlap auto's split may keep a copy of the state in
    device_memory_gb: float = 80.0
    # True: the drive reads and writes at once, each direction at its own rate (two queues).
    # False: one queue serves both, each transfer at its direction's rate, as a drive whose mixed
    # load gets no more than its reads or writes alone (this VM's virtual disk: 1 GiB read and
    # 1 GiB written together took 4.38 s, apart 1.76 + 2.32 s).
    nvme_duplex: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "nvme_duplex":
                if not isinstance(value, bool):
                    raise ValueError(f"Machine.nvme_duplex must be True or False, got {value!r}")
                continue
            if value is None and f.name in OPTIONAL_RATES:
                continue
            if (
                not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and f.name not in MAY_BE_ZERO)
            ):
                raise ValueError(
                    f"Machine.{f.name} must be a finite number > 0 (>= 0 for {', '.join(MAY_BE_ZERO)}), got {value!r}"
                )

    def for_state_precision(self, precision: str) -> Machine:
        """This machine with the CPU Adam's rate for moments stored in `precision` (fp32, bf16,
        int8) as its `cpu_adam_gparams`."""
        rates = {"fp32": self.cpu_adam_gparams, "bf16": self.cpu_adam_bf16_gparams, "int8": self.cpu_adam_int8_gparams}
        if precision not in rates:
            raise ValueError(f"unknown state precision {precision!r}; known: {', '.join(rates)}")
        return dataclasses.replace(self, cpu_adam_gparams=rates[precision] or self.cpu_adam_gparams)


# fields of Machine that may be 0, and the optional ones (None: the fp32 rate)
MAY_BE_ZERO = ("latency_us", "host_unit_us")
OPTIONAL_RATES = ("cpu_adam_bf16_gparams", "cpu_adam_int8_gparams")


# The GPU hosts' CPU Adam, measured on the 16-core AVX-512 Xeon host of the H100 machines lent to
# this project (benchmarks/RESULTS.md: bench_gpu's limits at 41527b1 5.4 Gparams/s on the engine's
# workload, 64M elements; bench_adam's fp32 kernel 4.7-5.65 at 30M-100M, 2026-11-26/27), and its
# compact moments at the engine's workload (bf16 grad in, bf16 copy out: bf16 moments 1.26-1.45x,
# int8 1.31-1.39x the fp32 moments, d88d97c). The H200 machines lent here have 16 cores too; their
# host is assumed the same until a GPU session measures it (benchmarks/gpu_session.sh does).
GPU_HOST_ADAM_GPARAMS = 5.0
GPU_HOST_ADAM_BF16_GPARAMS = 6.8
GPU_HOST_ADAM_INT8_GPARAMS = 6.7
# The host's own time per unit per step (hooks, bookkeeping, the model's Python and launches):
# `bench_pipeline.py --measure-host` on the 2-vCPU development VM (48 blocks of width 64, the CPU as
# the device, the main thread's CPU time): 2.8-3.4 ms in four readings on 2026-11-28 (recorded:
# 2.84), beside issue 49's wall-clock 2.5 ms on a quiet VM. Not scaled: a server core is likely
# faster, so this errs high; gpu_session.sh measures the GPU host's own and passes it to the replay.
HOST_UNIT_US = 3000.0

MACHINES: dict[str, Machine] = {
    # H100 SXM, PCIe 5.0 x16 host link, a 16-core host, one PCIe 4 NVMe drive.
    "h100-pcie5": Machine(
        device_tflops=270.0,  # 6 * 1.35e9 params * 8192 tokens / 0.247 s measured for a plain 1.35B Llama step ≈ 269 (27% of 989 peak)
        h2d_gbps=48.0,  # PCIe 5.0 x16 is 63 GB/s raw per direction; pinned cudaMemcpyAsync achieves ~45-50
        d2h_gbps=48.0,  # same link, the other direction (full duplex)
        cpu_adam_gparams=GPU_HOST_ADAM_GPARAMS,  # measured on the H100 machines' 16-core host (above)
        device_adam_gparams=80.0,  # fused Adam reads+writes ~32 B/param; ~2.6 TB/s of 3.35 TB/s HBM3
        nvme_read_gbps=6.0,  # one PCIe 4.0 x4 drive: ~7 GB/s spec, ~6 achieved with O_DIRECT
        nvme_write_gbps=5.0,  # sustained writes of the same drive, below its burst rate
        host_unit_us=HOST_UNIT_US,
        cpu_adam_bf16_gparams=GPU_HOST_ADAM_BF16_GPARAMS,
        cpu_adam_int8_gparams=GPU_HOST_ADAM_INT8_GPARAMS,
        # the exact step (moments.adam_step_torch, eager torch: ~96 kernels, ~340 bytes moved per
        # element, counted at training magnitudes): ~7.7 at 2.6 TB/s, less the launches of
        # 16M-element chunks; an estimate, unmeasured on a GPU yet
        device_exact_adam_gparams=6.0,
        device_memory_gb=80.0,
    ),
    # The same H100 on a PCIe 4.0 x16 host link: only the link differs.
    "h100-pcie4": Machine(
        device_tflops=270.0,  # same GPU and model as h100-pcie5
        h2d_gbps=25.0,  # PCIe 4.0 x16 is 31.5 GB/s raw per direction; ~25 achieved pinned
        d2h_gbps=25.0,  # same link, the other direction
        cpu_adam_gparams=GPU_HOST_ADAM_GPARAMS,  # same host as h100-pcie5
        device_adam_gparams=80.0,  # same GPU as h100-pcie5
        nvme_read_gbps=6.0,  # same drive as h100-pcie5
        nvme_write_gbps=5.0,  # same drive as h100-pcie5
        host_unit_us=HOST_UNIT_US,
        cpu_adam_bf16_gparams=GPU_HOST_ADAM_BF16_GPARAMS,
        cpu_adam_int8_gparams=GPU_HOST_ADAM_INT8_GPARAMS,
        device_exact_adam_gparams=6.0,  # same GPU as h100-pcie5
        device_memory_gb=80.0,
    ),
    # H200 SXM (the H100's compute, 4.8 TB/s HBM3e) on PCIe 5.0 x16.
    "h200-pcie5": Machine(
        device_tflops=290.0,  # same tensor cores as H100; faster HBM lifts the memory-bound kernels ~7%
        h2d_gbps=48.0,  # same PCIe 5.0 x16 link as h100-pcie5
        d2h_gbps=48.0,  # same link, the other direction
        cpu_adam_gparams=GPU_HOST_ADAM_GPARAMS,  # a 16-core host, assumed the H100 machines' (above)
        device_adam_gparams=115.0,  # 80 Gparams/s scaled by HBM bandwidth 4.8 / 3.35
        nvme_read_gbps=6.0,  # same drive as h100-pcie5
        nvme_write_gbps=5.0,  # same drive as h100-pcie5
        host_unit_us=HOST_UNIT_US,
        cpu_adam_bf16_gparams=GPU_HOST_ADAM_BF16_GPARAMS,
        cpu_adam_int8_gparams=GPU_HOST_ADAM_INT8_GPARAMS,
        device_exact_adam_gparams=8.0,  # h100-pcie5's, its memory-bound part scaled by 4.8 / 3.35
        device_memory_gb=141.0,
    ),
    # A100 SXM 80GB on PCIe 4.0 x16, an older 2-socket host.
    "a100-pcie4": Machine(
        device_tflops=130.0,  # 42% of 312 dense bf16 peak, typical for ~1B models on A100
        h2d_gbps=24.0,  # PCIe 4.0 x16, ~24 achieved pinned
        d2h_gbps=24.0,  # same link, the other direction
        cpu_adam_gparams=2.0,  # AVX2/AVX-512 CPU Adam on an older 2-socket server (an estimate: never measured)
        device_adam_gparams=50.0,  # ~32 B/param at ~1.6 TB/s of 2.0 TB/s HBM2e
        nvme_read_gbps=6.0,  # one PCIe 4.0 x4 drive
        nvme_write_gbps=5.0,  # sustained writes of the same drive
        host_unit_us=HOST_UNIT_US,  # the VM's reading, as for the others
        device_exact_adam_gparams=4.0,  # ~340 B/element at ~1.6 TB/s, less the launches
        device_memory_gb=80.0,
    ),
    # A 2-core VM with no accelerator: the "device" is the CPU itself, copies are memcpy.
    "this-cpu": Machine(
        device_tflops=0.05,  # two AVX2 cores at fp32 matmul rates, with 16-bit emulation overheads
        h2d_gbps=5.0,  # single-threaded memcpy between host buffers
        d2h_gbps=5.0,  # same memcpy the other way
        cpu_adam_gparams=0.2,  # C++ CPU Adam on two cores, ~0.1 Gparams/s each
        device_adam_gparams=0.2,  # the device-tier Adam runs on the same two cores
        nvme_read_gbps=1.0,  # a virtual disk of a cloud VM
        nvme_write_gbps=0.5,  # its writes, slower than its reads
        nvme_duplex=False,  # its reads and writes share one queue (measured with dd, above)
        host_unit_us=HOST_UNIT_US,  # this VM's reading (above)
        device_exact_adam_gparams=0.008,  # moments.adam_step_torch on the two cores (float64 emulation)
        device_memory_gb=24.0,  # the host's RAM stands in
    ),
}


def machine_from_args(name: str, **overrides: float | bool | None) -> Machine:
    """The preset `name` of `MACHINES` with each override that is not None in place of its field
    (so every rate, and `nvme_duplex`, can be a command-line flag defaulting to None)."""
    if name not in MACHINES:
        raise ValueError(f"unknown machine {name!r}; known: {', '.join(sorted(MACHINES))}")
    fields = {f.name for f in dataclasses.fields(Machine)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown machine field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(MACHINES[name], **given)


OTHER_NVME_DIRECTION = {"nvme_read": "nvme_write", "nvme_write": "nvme_read"}


def directions_wait(duplex: bool, background_depth: int) -> bool:
    """Whether a non-urgent NVMe op waits out the other direction's urgent one (`replay`): on a
    duplex drive whose I/O engine keeps no place for the non-urgent queue."""
    return duplex and background_depth == 0


SHARED_NVME = "nvme"
"""The one queue of a drive that is not duplex (`Machine.nvme_duplex` False): its reads and its
writes, which `busy` still counts apart; the floor counts them together under this name."""


def queue_of(resource: str, duplex: bool) -> str:
    """The serial queue an op on `resource` waits in: its resource, except that a drive that is
    not `duplex` serves both NVMe directions from one queue (SHARED_NVME)."""
    if not duplex and resource in ("nvme_read", "nvme_write"):
        return SHARED_NVME
    return resource


def floor_of(busy: dict[str, float], duplex: bool) -> tuple[float, str]:
    """The floor of a schedule whose resources are busy `busy` seconds each, and what sets it:
    the busiest queue (the first in `RESOURCES` order on a tie; SHARED_NVME, in nvme_read's
    place, for a drive that is not `duplex`)."""
    queues: dict[str, float] = {}
    for resource in RESOURCES:
        queue = queue_of(resource, duplex)
        queues[queue] = queues.get(queue, 0.0) + busy.get(resource, 0.0)
    order = list(queues)
    name = max(order, key=lambda q: (queues[q], -order.index(q)))
    return queues[name], name


def _describe(op: Op) -> str:
    """How error messages name an op."""
    return f"op {op.id} ({op.kind or '?'} unit {op.unit}{', ' + op.label if op.label else ''})"


def duration(op: Op, machine: Machine) -> float:
    """Seconds `op` runs on its resource under `machine`: flops for compute; latency plus bytes
    over the link rate for copies and NVMe IO; elements over the Adam rate for cpu_adam; elements
    over the device Adam rate plus flops over the device rate for the optimizer stream; its
    share of a unit's per-step host time for host."""
    if op.resource not in RESOURCES:
        raise ValueError(f"{_describe(op)}: unknown resource {op.resource!r}; known: {', '.join(RESOURCES)}")
    if not isinstance(op.kind, str) or not op.kind:
        raise ValueError(f"{_describe(op)}: has no kind")
    for name in ("flops", "nbytes", "elements", "share"):
        value = getattr(op, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{_describe(op)}: {name} must be finite and >= 0, got {value!r}")
    latency = machine.latency_us * 1e-6
    if op.resource == "compute":
        return op.flops / (machine.device_tflops * 1e12)
    if op.resource == "optimizer":
        # its work, and the copies up the device lane (overlap auto's split) queues on it
        rate = machine.device_exact_adam_gparams if op.kind == "device_adam_exact" else machine.device_adam_gparams
        copy = latency + op.nbytes / (machine.h2d_gbps * 1e9) if op.nbytes else 0.0
        return op.elements / (rate * 1e9) + op.flops / (machine.device_tflops * 1e12) + copy
    if op.resource == "cpu_adam":
        return op.elements / (machine.cpu_adam_gparams * 1e9)
    if op.resource == "host":
        return op.share * machine.host_unit_us * 1e-6
    gbps = {
        "host_to_device": machine.h2d_gbps,
        "device_to_host": machine.d2h_gbps,
        "nvme_read": machine.nvme_read_gbps,
        "nvme_write": machine.nvme_write_gbps,
    }[op.resource]
    return latency + op.nbytes / (gbps * 1e9)


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted intervals covering `spans` (empty spans dropped)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds two disjoint sorted interval lists have in common (a two-pointer sweep)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Replay:
    """A replayed step: each op's (start, end) in seconds by id, the step time (last end), each
    resource's busy seconds, and the floor: the busiest queue's busy time (copies and IO with
    their latency), which no schedule of these ops can beat; `floor_resource` names it (the
    first in `RESOURCES` order on a tie, "compute" for no ops; SHARED_NVME for the one queue of
    a drive that is not duplex). `nvme_duplex`: the machine's (`queue_of`); `background_depth`:
    the engine setting it was replayed with (`replay`)."""

    ops: tuple[Op, ...]
    spans: dict[int, tuple[float, float]]
    step_time: float
    busy: dict[str, float]
    floor: float
    floor_resource: str
    nvme_duplex: bool = True
    background_depth: int = 0

    def _intervals(self, resource: str, among: Collection[int] | None = None) -> list[tuple[float, float]]:
        """The union of the spans of `resource`'s ops (only those with ids in `among`, if given)."""
        if resource not in RESOURCES:
            raise ValueError(f"unknown resource {resource!r}; known: {', '.join(RESOURCES)}")
        return _union([self.spans[op.id] for op in self.ops if op.resource == resource and (among is None or op.id in among)])

    def hidden_share(self, resource: str, among: Collection[int] | None = None) -> float:
        """The fraction of `resource`'s busy time during which compute is busy too (1.0 for
        compute itself and for a resource that is never busy); exact, from interval unions.
        `among`: only the ops with these ids count as `resource`'s (one step of several
        replayed), hidden under any of the replay's compute."""
        mine = self._intervals(resource, among)
        busy = sum(e - s for s, e in mine)
        if resource == "compute" or busy <= 0:
            return 1.0
        return min(1.0, max(0.0, _overlap(mine, self._intervals("compute")) / busy))

    def exposed(self, resource: str, among: Collection[int] | None = None) -> float:
        """Seconds of `resource`'s busy time during which compute is idle (0 for compute);
        `among` as in `hidden_share`."""
        mine = self._intervals(resource, among)
        if resource == "compute":
            return 0.0
        return max(0.0, sum(e - s for s, e in mine) - _overlap(mine, self._intervals("compute")))

    def critical_path(self, end: int | None = None) -> list[Op]:
        """The chain of ops that sets the step time, first op first: from the op that ends last
        (the first such in list order), or from the op with id `end` (what sets its start and
        end), each step back goes to the predecessor (a dependency, preferred on a tie, the op
        that ran before it in the same queue, or, for a non-urgent NVMe op that waited out the
        other direction's urgent one (`replay`'s background_depth 0), that one) whose end is this
        op's start."""
        if not self.ops:
            return []
        by_id = {op.id: op for op in self.ops}
        if end is not None and end not in by_id:
            raise ValueError(f"critical_path: op {end} is not in the replay")
        previous: dict[int, list[int]] = {}
        last_on: dict[str, int] = {}
        last_urgent_on: dict[str, int] = {}
        position = {op.id: i for i, op in enumerate(self.ops)}
        waits = directions_wait(self.nvme_duplex, self.background_depth)
        for op in sorted(self.ops, key=lambda o: (self.spans[o.id][0], position[o.id])):  # the order they ran in
            queue = queue_of(op.resource, self.nvme_duplex)
            previous[op.id] = [last_on[queue]] if queue in last_on else []
            other = last_urgent_on.get(OTHER_NVME_DIRECTION.get(queue, ""))
            if waits and not op.urgent and other is not None:
                previous[op.id].append(other)
            last_on[queue] = op.id
            if op.urgent:
                last_urgent_on[queue] = op.id
        # the first of the ops ending last, unless asked for another
        op = max(self.ops, key=lambda o: self.spans[o.id][1]) if end is None else by_id[end]
        path = [op]
        while True:
            start = self.spans[op.id][0]
            candidates = [*op.deps, *previous[op.id]]
            found = next((c for c in candidates if self.spans[c][1] == start), None)
            if found is None:
                break
            op = by_id[found]
            path.append(op)
        return path[::-1]


def _validate(ops: Sequence[Op]) -> None:
    """Raises ValueError for duplicate ids and for deps that are missing, the op itself, or
    later in the list (the recording is in issue order: a forward reference is a recording bug)."""
    position: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.id in position:
            raise ValueError(f"{_describe(op)}: duplicate id (also at position {position[op.id]})")
        position[op.id] = i
    for i, op in enumerate(ops):
        for dep in op.deps:
            if dep not in position:
                raise ValueError(f"{_describe(op)}: depends on op {dep}, which is not in the schedule")
            if dep == op.id:
                raise ValueError(f"{_describe(op)}: depends on itself")
            if position[dep] > i:
                raise ValueError(f"{_describe(op)}: depends on op {dep}, which comes later in the recording")


def replay(ops: Sequence[Op], machine: Machine, *, background_depth: int = 0) -> Replay:
    """Replays `ops` (in issue order) on `machine`; each runs for `duration(op, machine)` seconds.

    Each resource (a drive that is not duplex: both NVMe directions together, `queue_of`)
    serves two queues, urgent and not, each in list order. An op is ready once
    all its deps have ended; a resource, when free, starts the first op of its urgent queue if
    that one is ready by then, else the first of the other queue if that one is, else whichever
    of the two is ready first (the urgent one on a tie). Nothing is preempted. Without urgent
    ops this is the plain list schedule: each op starts when the previous op on its resource
    and all its deps have ended.

    `background_depth`: the I/O engine's `io.background_depth`. The engine serves both
    directions of a drive from one pool of places, urgent pieces first; so at 0 (its default), on
    a duplex drive, a non-urgent NVMe op does not start while an urgent one of the other
    direction runs, even though the drive could serve both (it starts when that one ends, and
    then runs to its end: the engine would hold its remaining pieces back for a later urgent
    op, which this model does not). Above 0 the engine keeps places for the non-urgent queue in
    a direction with no urgent piece queued, modelled as directions that never wait for each
    other (and, within a direction, urgent ops first). A drive that is not duplex has one queue
    either way.

    Decided in time order (a discrete-event schedule): the next op to start is the one that
    can start earliest, so an op whose deps have not all started yet, which cannot start
    before then, is never overtaken by a choice made too early (an op whose last dep takes no
    time at all may become ready at the very instant another starts, and then goes second)."""
    _validate(ops)
    if not isinstance(background_depth, int) or background_depth < 0:
        raise ValueError(f"background_depth must be a whole number >= 0, got {background_depth!r}")
    lengths = {op.id: duration(op, machine) for op in ops}
    duplex = machine.nvme_duplex
    waits = directions_wait(duplex, background_depth)
    # each NVMe queue's urgent ops as placed: their starts and ends, in time order (one queue's
    # ops run one after another, and ops are placed in the order they start)
    urgent_starts: dict[str, list[float]] = {direction: [] for direction in OTHER_NVME_DIRECTION}
    urgent_ends: dict[str, list[float]] = {direction: [] for direction in OTHER_NVME_DIRECTION}

    def after_urgent(server: str, start: float) -> float:
        """The first time from `start` on at which no urgent op of `server` runs."""
        starts, ends = urgent_starts[server], urgent_ends[server]
        i = bisect.bisect_right(starts, start) - 1
        while 0 <= i < len(starts) and starts[i] <= start < ends[i]:
            start, i = ends[i], i + 1
        return start

    servers = list(dict.fromkeys(queue_of(r, duplex) for r in RESOURCES))
    queues: dict[tuple[str, bool], list[Op]] = {(q, u): [] for q in servers for u in (True, False)}
    for op in ops:
        queues[(queue_of(op.resource, duplex), op.urgent)].append(op)
    heads = dict.fromkeys(queues, 0)
    spans: dict[int, tuple[float, float]] = {}
    free_at = dict.fromkeys(servers, 0.0)
    busy = dict.fromkeys(RESOURCES, 0.0)

    def ready_at(op: Op) -> float | None:
        """When `op`'s deps have all ended; None while one of them has not been placed."""
        ends = [spans[d][1] if d in spans else None for d in op.deps]
        if any(end is None for end in ends):
            return None
        return max([0.0, *(end for end in ends if end is not None)])

    for _ in range(len(ops)):
        best: tuple[float, int, Op] | None = None  # (start, 0 urgent / 1 not, op)
        for server in servers:
            for urgent in (True, False):
                queue, head = queues[(server, urgent)], heads[(server, urgent)]
                ready = ready_at(queue[head]) if head < len(queue) else None
                if ready is None:
                    continue
                start = max(free_at[server], ready)
                if waits and not urgent and server in OTHER_NVME_DIRECTION:
                    start = after_urgent(OTHER_NVME_DIRECTION[server], start)
                candidate = (start, 0 if urgent else 1, queue[head])
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        # deps always point backwards (_validate), so the first op of some queue can start
        assert best is not None, "replay: no op can start"
        start, _, op = best
        end = start + lengths[op.id]
        spans[op.id] = (start, end)
        server = queue_of(op.resource, duplex)
        free_at[server] = end
        if op.urgent and server in urgent_starts:
            urgent_starts[server].append(start)
            urgent_ends[server].append(end)
        busy[op.resource] += lengths[op.id]
        heads[(server, op.urgent)] += 1
    floor, floor_resource = floor_of(busy, duplex)
    step_time = max((end for _, end in spans.values()), default=0.0)
    return Replay(tuple(ops), spans, step_time, busy, floor, floor_resource, duplex, background_depth)


def chrome_trace(replay: Replay, ops: Sequence[Op] | None = None) -> dict[str, Any]:
    """The replay as a Chrome trace (Perfetto, chrome://tracing): one complete event per op of
    `ops` (default: the replay's) on one thread per resource, threads named and sorted in
    `RESOURCES` order, and a flow arrow for each dependency that crosses resources."""
    ops = replay.ops if ops is None else tuple(ops)
    tid = {r: i + 1 for i, r in enumerate(RESOURCES)}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "training step (replayed)"}}]
    for r in RESOURCES:
        events.append({"ph": "M", "pid": 1, "tid": tid[r], "name": "thread_name", "args": {"name": r}})
        events.append({"ph": "M", "pid": 1, "tid": tid[r], "name": "thread_sort_index", "args": {"sort_index": tid[r]}})
    by_id = {op.id: op for op in ops}
    flow_id = 0
    for op in ops:
        if op.id not in replay.spans:
            raise ValueError(f"{_describe(op)}: not in the replay")
        start, end = replay.spans[op.id]
        events.append(
            {
                "ph": "X",
                "name": op.kind if op.unit is None else f"{op.kind} {op.unit}",
                "cat": op.resource,
                "pid": 1,
                "tid": tid[op.resource],
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {
                    "id": op.id,
                    "bytes": op.nbytes,
                    "flops": op.flops,
                    "elements": op.elements,
                    "share": op.share,
                    "label": op.label,
                },
            }
        )
        for dep in op.deps:
            source = by_id.get(dep)
            if source is None or source.resource == op.resource:
                continue
            flow_id += 1
            # The start sits inside the source slice (its start) so that viewers bind it there;
            # the arrow is drawn from that slice's end. The finish binds to the enclosing slice.
            flow = {"name": "dep", "cat": "dep", "pid": 1, "id": flow_id}
            events.append({**flow, "ph": "s", "tid": tid[source.resource], "ts": replay.spans[dep][0] * 1e6})
            events.append({**flow, "ph": "f", "bp": "e", "tid": tid[op.resource], "ts": start * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], replay: Replay, ops: Sequence[Op] | None = None) -> None:
    """Writes `chrome_trace(replay, ops)` to `path` as JSON."""
    with open(path, "w") as f:
        json.dump(chrome_trace(replay, ops), f)


def summary_lines(name: str, replay: Replay) -> list[str]:
    """Readable lines: the predicted step, the floor and its resource, their ratio, and per busy
    resource its busy time, the share of it hidden under compute and the seconds exposed."""
    ratio = f"{replay.step_time / replay.floor:.2f}x" if replay.floor > 0 else "n/a"
    lines = [
        f"{name}: predicted step {replay.step_time * 1e3:.3f} ms, floor {replay.floor * 1e3:.3f} ms ({replay.floor_resource}), step/floor {ratio}"
    ]
    for r in RESOURCES:
        if replay.busy[r] > 0:
            lines.append(
                f"  {r:<15} busy {replay.busy[r] * 1e3:10.3f} ms, hidden {replay.hidden_share(r) * 100:5.1f} %, exposed {replay.exposed(r) * 1e3:10.3f} ms"
            )
    path = replay.critical_path()
    on_path = {r: sum(replay.spans[op.id][1] - replay.spans[op.id][0] for op in path if op.resource == r) for r in RESOURCES}
    shares = ", ".join(f"{r} {t * 1e3:.3f} ms" for r, t in on_path.items() if t > 0)
    lines.append(f"  critical path: {len(path)} ops ({shares or 'none'})")
    return lines
