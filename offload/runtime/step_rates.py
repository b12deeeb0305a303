"""The rates overlap `auto`'s split is chosen from (plan/step_split.StepRates), measured at start,
and the split as it is re-planned once a backward was measured (`SplitPlanner`).

`OFFLOAD_STEP_RATES` (`cpu=5,device=40,h2d=48,d2h=48`: Gparams/s, Gparams/s, GB/s, GB/s, and
optionally `backward=` seconds) declares them instead: tests and benchmarks/bench_pipeline.py use
it to get the split a machine with those rates would choose, on any device. Without it, on CUDA,
`measure_rates` times each of them for about half a second: the C++ Adam over `PROBE_ELEMENTS`
of this state precision on the threads the engine gave it, pinned copies each way, and the exact
device step (`moments.adam_step_torch`). Where the CPU stands in for the device there is nothing
to split: the device's Adam would run on the same cores (None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.config.sizes import format_bytes
from offload.model.unit_state import UnitState
from offload.optim import kernels, moments
from offload.plan.step_split import StepRates, StepSplit, StepWindow, Traffic, parse_rates, plan_split, predicted_step
from offload.platform.device import Device
from offload.storage.state_codec import StateCodec

logger = logging.getLogger(__name__)

PROBE_ELEMENTS = 1 << 23
COPY_BYTES = 256 << 20
HYPER: dict[str, Any] = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def step_rates(
    device: Device, codec: StateCodec, grad_dtype: torch.dtype, environ: Mapping[str, str]
) -> tuple[StepRates | None, float | None]:
    """(rates, a backward's seconds): declared (`OFFLOAD_STEP_RATES`), measured on CUDA (the
    backward's seconds then come from the first backwards: None), else (None, None)."""
    declared = environ.get("OFFLOAD_STEP_RATES")
    if declared:
        return parse_rates(declared)
    if not device.is_cuda:
        return None, None
    try:
        return measure_rates(device, codec, grad_dtype), None
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # a probe that cannot run splits nothing
        logger.warning("offload: could not measure the step's rates (%s); every unit steps on the CPU", error)
        return None, None


@dataclass
class SplitPlanner:
    """What overlap `auto`'s split is planned from, kept to plan it again once a backward was
    measured: the units (in index order: the root, then the blocks, the order they run), which
    may step on the device (`eligible`) and which have a copy of their state there
    (`candidates`: the device lane made one for each), the rates, the traffic per element.

    A split per kind of window (`StepWindow`), each planned when first used: the windows that
    speculate (`speculating`: every unit, or the device's only when the CPU's have no spare
    state), those that do not (paused after clipping acted) and those redone (clipping acted
    after they speculated), where everything steps after the backward and the device takes a
    larger share. `use` marks the units of one (`UnitState.steps_on_device`); the window calls it
    between steps, the lanes settled (runtime/window.py). Both lanes read and write a unit's
    state in its home in RAM (the device's copy mirrors it), so a unit changes lanes without
    moving state: a device copy the CPU made stale since is loaded again before the unit's next
    step there (`Stepping._host_state_changes`), a current one is used as it is. The windows that
    speculate always run under the split the spare states were planned for (a unit another split
    moves to the CPU has none: it would step only after the backward)."""

    units: list[UnitState]
    eligible: list[bool]
    candidates: list[bool]
    rates: StepRates
    traffic: Traffic
    device_memory: int
    # a backward's seconds, declared with the rates; None: measured, and the split planned
    # again once (`replan`)
    backward_seconds: float | None
    # the kind of window that speculates: every unit, or the device's only
    speculating: StepWindow = StepWindow.SPECULATIVE
    # the split each kind of window has been planned (cleared by `replan`), and the one in use
    splits: dict[StepWindow, StepSplit] = field(default_factory=dict)
    current: StepWindow | None = None

    def plan(self, window: StepWindow | None = None) -> StepSplit:
        """The split for `window`'s kind of window (default: `speculating`)."""
        window = self.speculating if window is None else window
        if window not in self.splits:
            self.splits[window] = plan_split(
                [unit.optimizer_numel for unit in self.units],
                self.eligible,
                self.rates,
                self.traffic,
                device_memory=self.device_memory,
                backward_seconds=self.backward_seconds,
                candidates=self.candidates,
                window=window,
                # a window redone: the units that speculated on the device load their state again
                stale=self.plan().on_device if window is StepWindow.REDONE else None,
            )
            self._log(window, self.splits[window])
        return self.splits[window]

    @property
    def waits_for_a_backward(self) -> bool:
        return self.backward_seconds is None

    def replan(self, backward_seconds: float) -> list[UnitState]:
        """With a measured backward: the splits again, the one in use applied (between steps,
        the lanes idle); returns the units that changed lanes."""
        self.backward_seconds = backward_seconds
        self.splits.clear()
        current, self.current = self.current, None
        return self.use(current or self.speculating)

    def use(self, window: StepWindow) -> list[UnitState]:
        """Marks the units the split for `window` sends to the device (between steps, the lanes
        idle); returns those that changed lanes."""
        split = self.plan(window)
        moved = [unit for unit, on in zip(self.units, split.on_device) if unit.steps_on_device != on]
        for unit, on in zip(self.units, split.on_device):
            unit.steps_on_device = on
        if self.current is not window:
            logger.debug("offload: overlap auto: the split for windows %s (%d units change lanes)", WINDOWS[window], len(moved))
        self.current = window
        return moved

    def _log(self, window: StepWindow, split: StepSplit) -> None:
        logger.info(
            "offload: overlap auto, windows %s: %d of %d units step on the device (their state in RAM, a copy on the "
            "device: %s), the rest with the CPU Adam; predicted optimizer work per step: CPU %.3f s, device %.3f s "
            "(PCIe %.3f s up, %.3f s down)%s%s",
            WINDOWS[window],
            split.device_units,
            len(self.units),
            format_bytes(split.device_bytes),
            split.cpu_seconds,
            split.device_seconds,
            split.h2d_seconds,
            split.d2h_seconds,
            self._predicted(split, window),
            f"; stopped by {', '.join(split.reasons)}" if split.reasons else "",
        )

    def _predicted(self, split: StepSplit, window: StepWindow) -> str:
        if not self.backward_seconds:
            return ""
        numels = [unit.optimizer_numel for unit in self.units]
        stale = self.plan().on_device if window is StepWindow.REDONE else None
        step = predicted_step(numels, split.on_device, self.rates, self.traffic, self.backward_seconds, window, stale)
        return (
            f"; chosen for a backward of {self.backward_seconds:.3g} s: predicted step {step:.3g} s against "
            f"{1.5 * self.backward_seconds:.3g} s of compute"
        )


# how the log names the windows each split is for
WINDOWS = {
    StepWindow.SPECULATIVE: "that speculate",
    StepWindow.DEVICE_SPECULATIVE: "that speculate on the device only (no spare state in RAM)",
    StepWindow.AFTER_BACKWARD: "that do not speculate (paused after clipping acted)",
    StepWindow.REDONE: "redone (clipping acted after they speculated)",
}


def _best_seconds(run: Callable[[], None], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _state(codec: StateCodec, n: int, grad_dtype: torch.dtype, device: torch.device):
    master = torch.randn(n, device=device)
    grad = torch.randn(n, device=device).to(grad_dtype)
    views = []
    for kind in ("exp_avg", "exp_avg_sq"):
        numel, dtype = codec.storage(kind, n)
        views.append(codec.moment_view(torch.zeros(numel, dtype=dtype, device=device), n, 0, n))
    return master, grad, views


def measure_rates(device: Device, codec: StateCodec, grad_dtype: torch.dtype) -> StepRates:
    """Times the four rates on this machine (module docstring)."""
    n = PROBE_ELEMENTS
    precision = codec.precision.value
    master, grad, (m, v) = _state(codec, n, grad_dtype, torch.device("cpu"))

    def cpu_step() -> None:
        if codec.compact:
            kernels.adam_step_compact(master, grad, m, v, precision=precision, position=0, rounding_key=1, step=2, **HYPER)
        else:
            kernels.adam_step(master, grad, m.values, v.values, step=2, **HYPER)

    cpu = n / _best_seconds(cpu_step) / 1e9
    dev_master, dev_grad, (dev_m, dev_v) = _state(codec, n, grad_dtype, device.torch_device)

    def device_step() -> None:
        moments.adam_step_torch(
            dev_master, dev_grad, dev_m, dev_v, precision=precision, position=0, rounding_key=1, step=2, **HYPER
        )
        device.synchronize()

    device_step()  # the first call pays for the kernels' loading
    exact = n / _best_seconds(device_step, repeats=2) / 1e9
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device.torch_device)

    def up() -> None:
        on_device.copy_(host, non_blocking=True)
        device.synchronize()

    def down() -> None:
        host.copy_(on_device, non_blocking=True)
        device.synchronize()

    h2d = COPY_BYTES / _best_seconds(up) / 1e9
    d2h = COPY_BYTES / _best_seconds(down) / 1e9
    rates = StepRates(cpu_adam_gparams=cpu, device_adam_gparams=exact, h2d_gbps=h2d, d2h_gbps=d2h)
    logger.info(
        "offload: measured for the step's split: CPU Adam %.2f Gparams/s (%s moments), the exact step on the device "
        "%.2f Gparams/s, PCIe %.1f / %.1f GB/s up / down",
        cpu,
        precision,
        exact,
        h2d,
        d2h,
    )
    return rates
