"""Which units step on the accelerator and which on the CPU, under overlap `auto` (plain logic, no torch).

The C++ Adam on the host and the device are two workers of one step. A unit whose optimizer
state is in host RAM can step on the device: a copy of its state stays there (runtime/
device_step), its gradient goes up once it has landed, the exact step runs there
(`optim/moments.adam_step_torch`, the C++ kernel's bits), and the new state goes down into its
home in RAM. The device's share is bounded by three things: PCIe each way (shared with what
every step moves anyway: gradients down, weights up), the device's exact Adam (serial queues of
the step, each), and its memory, which holds the device units' copies.

The device takes the units whose gradients land last (the first in forward order, the root
first): the CPU, stepping top-down as gradients land, reaches them last, and the next forward
needs them first. `plan_split` takes units from the front of that order while the busier of the
two workers gets less busy: the split where the CPU's Adam and the device's busiest queue take
about as long (it minimises the longer of the two, `StepSplit.optimizer_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


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


def finish_after_backward(
    numels: list[int], chosen: list[bool], rates: StepRates, traffic: Traffic, backward_seconds: float
) -> float:
    """When the last unit's step ends, from the start of a backward of `backward_seconds`: units
    land in reverse forward order, each when the backward has computed its share of the elements
    (the root, unit 0, last); each worker steps its units in that order, one after the other, a
    unit once it landed (the CPU at its Adam's rate; the device at the slower of its exact Adam
    and its gradient's copy up)."""
    total = sum(numels) or 1
    per_device = max(1 / (rates.device_adam_gparams * 1e9), traffic.device_h2d / (rates.h2d_gbps * 1e9))
    landed = 0
    cpu = device = 0.0
    for index in reversed(range(len(numels))):
        landed += numels[index]
        lands = backward_seconds * landed / total
        if chosen[index]:
            device = max(device, lands) + numels[index] * per_device
        else:
            cpu = max(cpu, lands) + numels[index] / (rates.cpu_adam_gparams * 1e9)
    return max(cpu, device)


def plan_split(
    numels: list[int],
    eligible: list[bool],
    rates: StepRates | None,
    traffic: Traffic,
    *,
    device_memory: int,
    backward_seconds: float | None = None,
    candidates: list[bool] | None = None,
) -> StepSplit:
    """The split of one step's optimizer work (module docstring). `numels`: each unit's optimizer
    elements on this rank, in forward order (the root first); `eligible`: the units that may step
    on the device (state resident in host RAM); `rates`: None when there is no device apart from
    the CPU (nothing moves). The device takes units from the front of the order, skipping
    ineligible ones, while their copies fit in `device_memory` bytes (and, given `candidates`,
    only those): as many as give the shortest predicted step. Without `backward_seconds` that is
    where the longer of the two workers' times per step is shortest (`optimizer_seconds`); with
    it (measured, or declared), where the last step ends soonest after the backward starts
    (`finish_after_backward`), and no link carries more than a step's worth (a backward and a
    forward of half its length)."""
    if len(numels) != len(eligible):
        raise ValueError(f"plan_split: {len(numels)} numels for {len(eligible)} eligibility flags")
    if any(n < 0 for n in numels):
        raise ValueError(f"plan_split: numels must be >= 0, got {numels}")
    chosen = [False] * len(numels)
    if rates is None:
        return StepSplit(tuple(chosen), 0.0, 0.0, reasons=("no accelerator apart from the CPU",))

    def score(trial: list[bool]) -> float:
        cpu, device, h2d, d2h = _seconds(numels, trial, rates, traffic)
        if backward_seconds is None:
            return max(cpu, device)
        finish = finish_after_backward(numels, trial, rates, traffic, backward_seconds)
        return max(finish, max(h2d, d2h) - backward_seconds / 2)

    order = [i for i, n in enumerate(numels) if eligible[i] and n and (candidates is None or candidates[i])]
    best_k, best, used, reasons = 0, score(chosen), 0.0, []
    trial = list(chosen)
    for k, index in enumerate(order, start=1):
        used += numels[index] * traffic.device_memory
        if used > device_memory:
            reasons.append("device memory")
            break
        trial[index] = True
        value = score(trial)
        if value < best:
            best_k, best = k, value
    for index in order[:best_k]:
        chosen[index] = True
    if best_k < len(order) and "device memory" not in reasons:
        reasons.append("balanced" if backward_seconds is None else "fastest predicted step")
    cpu, device, h2d, d2h = _seconds(numels, chosen, rates, traffic)
    memory = int(sum(numels[i] for i in order[:best_k]) * traffic.device_memory)
    return StepSplit(tuple(chosen), cpu, device, h2d, d2h, memory, tuple(reasons))


def predicted_step(
    numels: list[int], on_device: Sequence[bool], rates: StepRates, traffic: Traffic, backward_seconds: float
) -> float:
    """Overlap auto's step under this split, from a backward of `backward_seconds` and a forward
    of half that: the compute, unless the last unit's step ends after the backward has (the next
    forward waits for it: `finish_after_backward`), or a link carries more than the step's worth."""
    finish = finish_after_backward(numels, list(on_device), rates, traffic, backward_seconds)
    _, _, h2d, d2h = _seconds(numels, list(on_device), rates, traffic)
    return max(backward_seconds / 2 + max(backward_seconds, finish), h2d, d2h)


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
