"""Reading the model's parameters between steps: `engine.params_on_device(module)`.

Between uses, an offloaded unit's parameters are views of device storage freed to 0 bytes
(residency.py): a read of one is refused (param_reads.py). With `param: none` they hold weights,
and a read waits for a step still running on the optimizer worker (overlap `forward`). Inside
`held_on_device` every unit with a parameter under `module` is held on the device, its weights
those of the latest step, whole (every rank's shard gathered): reads are safe and current.

- Holds are taken in unit index order (with several ranks each gather is a collective, so
  every rank enters with the same module) after every fetch was started, and given back when
  the block ends; an offloaded unit's storage is freed again then.
- The block runs under `torch.no_grad()`: the storage is freed when it ends, so a graph
  through the weights could never be backpropagated.
- The device weights are a copy; the engine's fp32 master weights are the truth. A write
  through the parameters (an in-place op bumps their version counter) is undone and refused
  when the block ends: an offloaded unit's copy is dropped, a `param: none` unit's device
  weights are written again from the master (`undo_write`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from offload.errors import OffloadError
from offload.model.unit_state import UnitState
from offload.runtime.events import Phase
from offload.runtime.schedule import ScheduleContext


def units_with_params_under(units: list[UnitState], module: nn.Module) -> list[UnitState]:
    """The units owning a parameter of `module` (a tied weight belongs to one unit), by index."""
    wanted = {id(param) for param in module.parameters()}
    return [unit for unit in units if any(id(param) in wanted for param in unit.spec.params)]


def _versions(units: list[UnitState]) -> list[list[int]]:
    return [[param._version for param in unit.spec.params] for unit in units]


def _refuse_while_in_use(context: ScheduleContext, units: list[UnitState]) -> None:
    if context.phase is not Phase.IDLE or context.entered:
        raise OffloadError(
            f"engine.params_on_device() was called during the model's {context.phase.value}; call it between steps "
            "(inside a forward, the engine already holds the running unit's parameters on the device)"
        )
    held = [unit.spec.name for unit in units if unit.holders]
    if held:
        raise OffloadError(
            f"engine.params_on_device() was called while unit(s) {', '.join(held[:3])} are held for a backward that has "
            "not run; call it between steps, or after engine.backward()"
        )


@contextlib.contextmanager
def held_on_device(context: ScheduleContext, module: nn.Module, undo_write: Callable[[UnitState], None]) -> Iterator[None]:
    """Holds the units of `module`'s parameters on the device for the block (see the module
    docstring)."""
    units = units_with_params_under(context.units, module)
    _refuse_while_in_use(context, units)
    residency = context.residency
    for unit in units:
        residency.prefetch(unit)
    held: list[UnitState] = []
    try:
        for unit in units:
            residency.acquire(unit)
            held.append(unit)
        # a step that failed (its units' step_done are set all the same) is raised here, before
        # anyone reads weights it did not finish
        context.stepping.raise_if_failed()
        before = _versions(units)
        with torch.no_grad():
            yield
        after = _versions(units)
    finally:
        for unit in reversed(held):
            residency.release(unit)
        residency.release_idle()
    written = [
        (unit, [name for name, a, b in zip(unit.spec.param_names, old, new, strict=True) if a != b])
        for unit, old, new in zip(units, before, after, strict=True)
        if old != new
    ]
    if written:
        for unit, _ in written:
            undo_write(unit)
        names = [name for _, unit_names in written for name in unit_names]
        raise OffloadError(
            f"parameter(s) {', '.join(names[:3])}{' …' if len(names) > 3 else ''} were written inside "
            "engine.params_on_device(), which is for reading: the device weights are a copy of the engine's fp32 "
            "master weights. The write was undone. To set weights, load them into the model before "
            "offload.initialize, or use engine.load_checkpoint"
        )
