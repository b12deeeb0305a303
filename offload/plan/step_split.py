"""Which units step on the accelerator and which on the CPU, under overlap `auto` (plain logic, no torch).

The C++ Adam on the host and the device are two workers of one step. A unit whose optimizer
state is in host RAM can step on the device: a copy of its state stays there (runtime/
device_step), its gradient goes up once it has landed, the exact step runs there
(`optim/moments.adam_step_torch`, the C++ kernel's bits), and the new state goes down into its
home in RAM. The device's share is bounded by three things: PCIe each way (shared with what
every step moves anyway: gradients down, weights up), the device's exact Adam (serial queues of
the step, each), and its memory, which holds the device units' copies.

Which units the device takes comes from a model of the schedule (`step_finishes`): gradients
land in reverse forward order, each worker steps, of the units landed, the one the next forward
needs first, and the next forward waits for a unit not ready when it needs it (`forward_stall`).
The units that land last and are needed first (the root, then the first blocks) set what is
left for after the backward: the device takes the root, and the CPU, which reaches the blocks
that landed last first, the blocks after it, the device those it cannot keep up with.
`plan_split` searches the sets for the shortest predicted step (without a measured backward:
the prefix of the forward order where the CPU's Adam and the device's busiest queue take about
as long, `StepSplit.optimizer_seconds`).

That is the split of a window that speculates. One that does not (`StepWindow`: speculation
paused after clipping acted, a window redone because it acted; or the CPU's units without spare
state) steps what did not speculate once the backward ended and the global norm is known, every
such unit at once, each worker in forward order, and the next backward waits for all of it:
there the device takes a larger share, in a split planned for that kind of window (`plan_split`'s
`window`), and the engine switches between the splits at window boundaries (runtime/window.py).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class StepWindow(enum.Enum):
    """The kinds of window a split is planned for: which units step before the backward ended,
    as their gradients land (speculatively: the global norm is not known yet; the others step
    once it is), and whether the device's copies of the state are current."""

    # overlap `auto` speculating: every unit (the CPU's into spare state, the device's on its copy)
    SPECULATIVE = "speculative"
    # the device's units only (their copy on the device is the spare): the CPU's have no spare
    # state (`offload.speculation_memory: 0`)
    DEVICE_SPECULATIVE = "device-speculative"
    # none: speculation paused after clipping acted (runtime/speculation)
    AFTER_BACKWARD = "after-backward"
    # none: a speculative window clipping acted in, stepped again from the old state; the units
    # that speculated on the device load their state again first (their copies are taken back)
    REDONE = "redone"

    def early(self, on_device: bool) -> bool:
        """Whether a unit on this lane steps as its gradients land."""
        return self is StepWindow.SPECULATIVE or (self is StepWindow.DEVICE_SPECULATIVE and on_device)


@dataclass(frozen=True)
class StepRates:
    """What one step's optimizer work costs on this machine: measured at start (or declared by
    `OFFLOAD_STEP_RATES`). Rates are of the configured state precision."""

    cpu_adam_gparams: float  # billions of parameters per second the C++ Adam steps (all its threads)
    device_adam_gparams: float  # the same for the exact step on the device
    h2d_gbps: float  # GB/s (1e9 bytes) host to device, pinned
    d2h_gbps: float  # GB/s device to host, pinned

    def __post_init__(self) -> None:
        for name in ("cpu_adam_gparams", "device_adam_gparams", "h2d_gbps", "d2h_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"StepRates.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class Traffic:
    """Bytes per element of a unit's optimizer state that cross PCIe in one step.

    `device_h2d` / `device_d2h`: a unit stepped on the device, whose state stays there between
    steps (its gradient up after landing; its new master and moments down into the host state,
    and with param `cpu` its new weights). `base_h2d` / `base_d2h`: every unit, wherever it
    steps (its gradient down to land; with param `cpu`, its weights fetched for forward and
    backward; with param `none`, a CPU-stepped unit's new weights up, counted in `cpu_h2d`)."""

    device_h2d: float
    device_d2h: float
    base_h2d: float
    base_d2h: float
    # a CPU-stepped unit's new weights going up (param `none`)
    cpu_h2d: float
    # device memory a device unit's copy of its state takes per element (runtime/device_step)
    device_memory: float
    # a device unit's new weights going down before they count (param `cpu`: the next fetch
    # reads them from the host)
    weights_down: float = 0.0
    # a device unit's master and moments going up when the device's copy is not current (on the
    # lane's stream, before its step: `step_finishes`'s `stale`)
    device_load: float = 0.0


def step_traffic(*, moment_bytes: float, grad_bytes: float, compute_bytes: float, param_offloaded: bool) -> Traffic:
    """The `Traffic` of a unit under this state layout: fp32 master (4 bytes), two moments of
    `moment_bytes` each, a gradient of `grad_bytes`, 16-bit (or fp32) weights of `compute_bytes`;
    `param_offloaded`: param `cpu` (the weights are fetched twice a step, and a unit's new weights
    go to the host)."""
    state = 4 + 2 * moment_bytes
    return Traffic(
        device_h2d=grad_bytes,
        device_d2h=state + (compute_bytes if param_offloaded else 0.0),
        base_h2d=2 * compute_bytes if param_offloaded else 0.0,
        base_d2h=grad_bytes,
        cpu_h2d=0.0 if param_offloaded else compute_bytes,
        # (with param `none` the step writes the new weights where the compute reads them)
        device_memory=state + grad_bytes + (compute_bytes if param_offloaded else 0.0),
        weights_down=compute_bytes if param_offloaded else 0.0,
        device_load=state,
    )


@dataclass(frozen=True)
class StepSplit:
    """Per unit (in index order) whether it steps on the device, and what the model predicts."""

    on_device: tuple[bool, ...]
    # seconds per step of the C++ Adam, and of the device worker's busiest queue (PCIe up, PCIe
    # down, the exact Adam: they pipeline unit by unit)
    cpu_seconds: float
    device_seconds: float
    h2d_seconds: float = 0.0
    d2h_seconds: float = 0.0
    # device memory the device units' state takes during the window's last backward
    device_bytes: int = 0
    reasons: tuple[str, ...] = field(default=())

    @property
    def optimizer_seconds(self) -> float:
        """The longer of the two workers: the least the optimizer takes per step."""
        return max(self.cpu_seconds, self.device_seconds)

    @property
    def device_units(self) -> int:
        return sum(self.on_device)


def _seconds(numels: list[int], chosen: list[bool], rates: StepRates, traffic: Traffic) -> tuple[float, float, float, float]:
    """(CPU Adam, device's busiest queue, H2D, D2H) seconds of a step with `chosen` on the device."""
    on_device = sum(n for n, c in zip(numels, chosen) if c)
    on_cpu = sum(numels) - on_device
    total = sum(numels)
    h2d = (on_device * traffic.device_h2d + on_cpu * traffic.cpu_h2d + total * traffic.base_h2d) / (rates.h2d_gbps * 1e9)
    d2h = (on_device * traffic.device_d2h + total * traffic.base_d2h) / (rates.d2h_gbps * 1e9)
    adam = on_device / (rates.device_adam_gparams * 1e9)
    cpu = on_cpu / (rates.cpu_adam_gparams * 1e9)
    return cpu, (max(h2d, d2h, adam) if on_device else 0.0), h2d, d2h


def step_finishes(
    numels: list[int],
    chosen: Sequence[bool],
    rates: StepRates,
    traffic: Traffic,
    backward_seconds: float,
    window: StepWindow = StepWindow.SPECULATIVE,
    stale: Sequence[bool] | None = None,
) -> list[float]:
    """When each unit is ready for the next forward, in seconds from the start of a backward of
    `backward_seconds`. Units land in reverse forward order (the root, unit 0, last): each once
    the backward has computed its share of the elements (the root's first: its head's backward
    comes first, its gradients are final at the end) and its gradient went down (one link, one
    copy after the other). Each worker steps its units one at a time, and when it is free
    takes, of those landed, the one the forward needs first (runtime/overlap.JobQueue): the CPU
    at its Adam's rate, its new weights then going up (param `none`); the device once the
    gradient went up, at its exact Adam's rate (param `cpu`: its new weights then go down). With
    param `cpu` every unit's weights then go up for its forward.

    A unit that does not step early (`window`) is released when the last gradient landed (the
    global norm is known then), or on the device once its gradient went up if later (it goes up
    as it lands either way: runtime/window.step_during_backward). In a window redone every device
    unit's gradient goes up again with its step, on the lane, and a unit `stale` (its copy not
    current: it speculated on the device) has its state loaded first."""
    total = sum(numels) or 1
    landed: dict[int, float] = {}
    # the root's part comes first (the head's backward), its gradients are final last
    computed, link = float(numels[0]) if numels else 0.0, 0.0
    for index in [*reversed(range(1, len(numels))), 0][: len(numels)]:
        computed += numels[index] if index else 0
        link = max(link, backward_seconds * computed / total) + numels[index] * traffic.base_d2h / (rates.d2h_gbps * 1e9)
        landed[index] = link
    norm_known = max(landed.values(), default=0.0)
    h2d, d2h = rates.h2d_gbps * 1e9, rates.d2h_gbps * 1e9
    fetch = traffic.base_h2d / 2 / h2d  # a unit's weights up for its forward, per element (param `cpu`)
    ready = [0.0] * len(numels)
    for on_device in (False, True):
        mine = [i for i in range(len(numels)) if bool(chosen[i]) == on_device]
        if on_device:
            up = {i: numels[i] * traffic.device_h2d / h2d for i in mine}
            if window is StepWindow.REDONE:  # its gradient goes up again, on the lane, with its step
                release = dict.fromkeys(mine, norm_known)
                load = {i: up[i] + (numels[i] * traffic.device_load / h2d if stale and stale[i] else 0.0) for i in mine}
            else:
                start = 0.0 if window.early(True) else norm_known
                release = {i: max(start, landed[i] + up[i]) for i in mine}
                load = dict.fromkeys(mine, 0.0)
            cost = {i: load[i] + numels[i] / (rates.device_adam_gparams * 1e9) for i in mine}
            after = {i: numels[i] * (traffic.weights_down / d2h + fetch) for i in mine}
        else:
            release = {i: landed[i] if window.early(False) else norm_known for i in mine}
            cost = {i: numels[i] / (rates.cpu_adam_gparams * 1e9) for i in mine}
            after = {i: numels[i] * (traffic.cpu_h2d / h2d + fetch) for i in mine}
        waiting = sorted(mine, key=lambda i: release[i])  # by release time
        landed_now: list[int] = []  # a heap of indices: the forward needs the lowest first
        free, taken = 0.0, 0
        while taken < len(waiting) or landed_now:
            while taken < len(waiting) and release[waiting[taken]] <= free:
                heapq.heappush(landed_now, waiting[taken])
                taken += 1
            if not landed_now:
                free = release[waiting[taken]]
                continue
            index = heapq.heappop(landed_now)
            free += cost[index]
            ready[index] = free + after[index]
    return ready


def forward_stall(numels: list[int], ready: Sequence[float], backward_seconds: float) -> float:
    """How long the next forward waits in all, from units ready at `ready` (`step_finishes`):
    it starts when the backward ends and needs each unit once it has computed the units before
    it (a forward of half the backward, in proportion to the blocks' elements: the root's part,
    a lookup at the start and the head at the end, is not counted before any block), later by
    what it has waited so far."""
    blocks = sum(numels[1:]) or 1
    before = 0
    stall = 0.0
    for index, numel in enumerate(numels):
        need = backward_seconds * (1 + 0.5 * before / blocks)
        stall = max(stall, ready[index] - need)
        if index:
            before += numel
    return stall


def plan_split(
    numels: list[int],
    eligible: list[bool],
    rates: StepRates | None,
    traffic: Traffic,
    *,
    device_memory: int,
    backward_seconds: float | None = None,
    candidates: list[bool] | None = None,
    window: StepWindow = StepWindow.SPECULATIVE,
    stale: Sequence[bool] | None = None,
) -> StepSplit:
    """The split of one step's optimizer work (module docstring). `numels`: each unit's optimizer
    elements on this rank, in forward order (the root first); `eligible`: the units that may step
    on the device (state resident in host RAM); `rates`: None when there is no device apart from
    the CPU (nothing moves). The device may take the eligible units from the front of that order
    while their copies fit in `device_memory` bytes (given `candidates`, only those).

    Without `backward_seconds` it takes a prefix of them: as many as make the longer of the two
    workers' times per step shortest (`optimizer_seconds`). With it (measured, or declared), the
    set whose predicted step (`predicted_step`: the compute and what the next forward waits for
    its units) is shortest, fewer elements on the device on a tie: the best prefix, then single
    changes while one shortens it (a unit added or taken off, or moved to a neighbouring
    candidate). The best set is often not a prefix: the root, which lands last and is needed
    first, on the device, and the blocks after it on the CPU, which gets to them first because
    each worker steps what the forward needs first.

    `window`: the kind of window the split is for (`StepWindow`, the predicted step's; `stale`:
    the units whose device copy a redone window loads again). Where nothing steps before the
    backward ended, the device takes a larger share."""
    if len(numels) != len(eligible):
        raise ValueError(f"plan_split: {len(numels)} numels for {len(eligible)} eligibility flags")
    if any(n < 0 for n in numels):
        raise ValueError(f"plan_split: numels must be >= 0, got {numels}")
    chosen = [False] * len(numels)
    if rates is None:
        return StepSplit(tuple(chosen), 0.0, 0.0, reasons=("no accelerator apart from the CPU",))

    order, used, reasons = [], 0.0, []
    for index in (i for i, n in enumerate(numels) if eligible[i] and n and (candidates is None or candidates[i])):
        used += numels[index] * traffic.device_memory
        if used > device_memory:
            reasons.append("device memory")
            break
        order.append(index)

    def on(units: frozenset[int]) -> list[bool]:
        return [i in units for i in range(len(numels))]

    def score(units: frozenset[int]) -> tuple[float, int]:
        if backward_seconds is None:
            cpu, device, _, _ = _seconds(numels, on(units), rates, traffic)
            value = max(cpu, device)
        else:
            value = predicted_step(numels, on(units), rates, traffic, backward_seconds, window, stale)
        # (rounded: a tie in seconds is decided by the elements on the device)
        return round(value, 12), sum(numels[i] for i in units)

    prefixes = [frozenset(order[:k]) for k in range(len(order) + 1)]
    best = min(prefixes, key=score)
    if backward_seconds is not None:
        while True:
            moves = [best ^ {index} for index in order]
            for k, index in enumerate(order):
                if index in best:
                    moves += [(best - {index}) | {other} for other in order[max(0, k - 1) : k + 2] if other not in best]
            trial = min(moves, key=score, default=best)
            if score(trial) >= score(best):
                break
            best = trial
    chosen = on(best)
    if len(best) < len(order) and "device memory" not in reasons:
        reasons.append("balanced" if backward_seconds is None else "fastest predicted step")
    cpu, device, h2d, d2h = _seconds(numels, chosen, rates, traffic)
    memory = int(sum(numels[i] for i in best) * traffic.device_memory)
    return StepSplit(tuple(chosen), cpu, device, h2d, d2h, memory, tuple(reasons))


def predicted_step(
    numels: list[int],
    on_device: Sequence[bool],
    rates: StepRates,
    traffic: Traffic,
    backward_seconds: float,
    window: StepWindow = StepWindow.SPECULATIVE,
    stale: Sequence[bool] | None = None,
) -> float:
    """Overlap auto's step under this split, from a backward of `backward_seconds` and a forward
    of half that: the compute and what the next forward waits for its units (`forward_stall`),
    or, if later, when the last unit is ready (the next backward waits for every step), or what
    a link carries in a step if that is longer. `window`: the kind of window (`StepWindow`), and
    `stale` its units whose device copy loads again (`step_finishes`)."""
    ready = step_finishes(numels, on_device, rates, traffic, backward_seconds, window, stale)
    _, _, h2d, d2h = _seconds(numels, list(on_device), rates, traffic)
    compute = 1.5 * backward_seconds + forward_stall(numels, ready, backward_seconds)
    return max(compute, max(ready, default=0.0), h2d, d2h)


def candidates_for(numels: list[int], eligible: list[bool], traffic: Traffic, device_memory: int) -> list[bool]:
    """The units `plan_split` may ever give the device: from the front, while their copies fit."""
    chosen = [False] * len(numels)
    used = 0.0
    for index, numel in enumerate(numels):
        if not eligible[index] or numel == 0:
            continue
        used += numel * traffic.device_memory
        if used > device_memory:
            break
        chosen[index] = True
    return chosen


def parse_rates(text: str) -> tuple[StepRates, float | None]:
    """`OFFLOAD_STEP_RATES`: `cpu=5,device=40,h2d=48,d2h=48` (Gparams/s, Gparams/s, GB/s, GB/s),
    and optionally `backward=1.2` (the seconds of a backward, else measured): (rates, backward)."""
    names = {"cpu": "cpu_adam_gparams", "device": "device_adam_gparams", "h2d": "h2d_gbps", "d2h": "d2h_gbps"}
    values: dict[str, float] = {}
    backward: float | None = None
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or (key not in names and key != "backward"):
            raise ValueError(
                f"OFFLOAD_STEP_RATES: expected cpu=, device=, h2d=, d2h= (and backward=), comma-separated, got {text!r}"
            )
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"OFFLOAD_STEP_RATES: {key}={value!r} is not a number") from None
        if key == "backward":
            if not math.isfinite(number) or number <= 0:
                raise ValueError(f"OFFLOAD_STEP_RATES: backward={value!r} must be seconds > 0")
            backward = number
        else:
            values[names[key]] = number
    missing = sorted(set(names) - {k for k, v in names.items() if v in values})
    if missing:
        raise ValueError(f"OFFLOAD_STEP_RATES: {', '.join(missing)} missing in {text!r}")
    return StepRates(**values), backward
