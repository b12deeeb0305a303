"""`engine.optimizer.state_dict()` / `load_state_dict()`: the Adam state in torch's format, read
out of the tiers and written into them.

torch.optim.AdamW keeps, per parameter that has stepped, `step` (a float32 scalar tensor),
`exp_avg` and `exp_avg_sq` (the parameter's shape); its state dict numbers the parameters in
the order of its groups. The engine keeps them per unit shard, on the unit's optimizer tier
(device, host, or NVMe swap files), with one step count per unit (`UnitState.step_count`).

- `read`: every rank's shards gathered (the full, unsharded state on every rank, as FSDP's full
  state dict; every rank calls it), as fp32 CPU tensors in the parameters' shapes. A unit that
  has not stepped has no state (torch has none before a parameter's first step); neither has a
  frozen parameter. Refused, before anything is read, where it would not fit in host memory:
  optimizer state on NVMe (streamed from swap files, it is as large as the model's moments), or
  a state larger than half the RAM available to this rank now (`host_room`). The route that
  always works is `engine.save_checkpoint`, which streams the state to disk.
- `load`: checks everything first (`check`: every entry, key, shape, dtype, finite value and
  step count, and that a unit's parameters share one step count), agreed over ranks, and only
  then writes each rank's shard of the moments into its tier (streamed piece by piece through the
  store on NVMe; the masters are kept: the weights are the model's) and sets the step counts. A
  parameter without an entry starts fresh (zero moments, step 0), as in torch.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

from offload.config.sizes import format_bytes
from offload.model.unit_state import UnitState
from offload.model.units import shard_pieces
from offload.optim.engine_optimizer import OptimizerStateError
from offload.optim.moment_limits import SaturationReport
from offload.platform.collectives import Collectives
from offload.storage.tiers import TierStore

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("step", *MOMENTS)
# the share of the RAM available to a rank that engine.optimizer.state_dict() may fill
HOST_SHARE = 0.5
CHECKPOINT_ROUTE = (
    "engine.save_checkpoint(path) and engine.load_checkpoint(path), which stream the optimizer state to disk and "
    "back from any tier, with the weights"
)


def host_room(environ=os.environ) -> int:
    """Bytes of host memory engine.optimizer.state_dict() may fill on this rank: HOST_SHARE of
    the RAM available now, shared by the node's ranks (torchrun's LOCAL_WORLD_SIZE)."""
    import psutil

    ranks_here = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(psutil.virtual_memory().available * HOST_SHARE) // ranks_here


def refusal(units: list[UnitState], room: int) -> str | None:
    """Why the full state would not fit in host memory (None when it does)."""
    streamed = [unit.spec.name for unit in units if unit.optimizer_tier.streamed]
    if streamed:
        return (
            f"the optimizer state of {', '.join(streamed[:3])}{' …' if len(streamed) > 3 else ''} is on NVMe (the "
            "placement of the model's moments where RAM is short)"
        )
    needed = sum(8 * p.numel() for unit in units for i, p in enumerate(unit.spec.params) if _trainable(unit, i))
    if needed > room:
        return (
            f"the moments take {format_bytes(needed)}, more than the {format_bytes(room)} this rank may fill "
            f"(half the RAM available now, shared by the node's ranks)"
        )
    return None


def _trainable(unit: UnitState, index: int) -> bool:
    """Whether param `index` of the unit has optimizer state (it required grad at initialize)."""
    return unit.layout.offsets[index] < unit.layout.optimizer_end


def _homes(units: list[UnitState]) -> dict[int, tuple[UnitState, int]]:
    return {id(p): (unit, i) for unit in units for i, p in enumerate(unit.spec.params)}


# ---- reading -----------------------------------------------------------------------------------
def read(units: list[UnitState], store: TierStore, collectives: Collectives, params: list[nn.Parameter]) -> dict:
    """torch's `state` for `params` (engine.optimizer's parameters in group order): {index:
    {"step", "exp_avg", "exp_avg_sq"}}, full on every rank. The steps in flight are waited for
    by the caller. Before any unit stepped there is no state to gather, on any tier: empty, as
    torch's before its first step (accelerate's prepare round-trips a state dict at the start)."""
    if not any(unit.step_count for unit in units):
        return {}
    why = refusal(units, host_room())
    if collectives.ranks_with(why is not None, what="whether the optimizer state fits in host memory"):
        why = why or "it would not fit in host memory on another rank"
        raise OptimizerStateError(
            f"engine.optimizer.state_dict() would gather the whole optimizer state into host memory, but {why}. "
            f"Use {CHECKPOINT_ROUTE}"
        )
    values: dict[int, dict[str, torch.Tensor]] = {}
    shards: dict[str, torch.Tensor] = {}
    for piece in store.fp32_states(units):
        unit = piece.unit
        if unit.step_count == 0:
            continue  # not stepped yet: no state, as in torch before the first step
        if piece.start == 0:
            shards = {kind: torch.zeros(unit.shard_numel, dtype=torch.float32) for kind in MOMENTS}
        for kind in MOMENTS:
            # a resident unit comes whole, or (compact moments) in decoded chunks
            shards[kind][piece.start : piece.end].copy_(piece.views[kind])
        if not piece.last:
            continue
        full = {}
        for kind in MOMENTS:
            shard = shards[kind]
            if collectives.is_distributed:
                whole = torch.empty(unit.layout.padded_numel, dtype=torch.float32)
                collectives.all_gather_host(whole, shard, what=f"{kind} of unit {unit.spec.name}")
                shard = whole
            full[kind] = shard
        for index, param in enumerate(unit.spec.params):
            if not _trainable(unit, index):
                continue
            offset, numel = unit.layout.offsets[index], unit.layout.numels[index]
            values[id(param)] = {
                "step": torch.tensor(float(unit.step_count), dtype=torch.float32),
                **{kind: full[kind][offset : offset + numel].view(param.shape).clone() for kind in MOMENTS},
            }
    return {index: values[id(param)] for index, param in enumerate(params) if id(param) in values}


# ---- checking ----------------------------------------------------------------------------------
def _step_value(key: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise OptimizerStateError(f"{key} must be a scalar, got a tensor of shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptimizerStateError(f"{key} must be a number (torch saves a float32 scalar tensor), got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise OptimizerStateError(f"{key} must be a whole number of steps >= 0, got {value}")
    return int(value)


def _moment(key: str, value, param: nn.Parameter, kind: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise OptimizerStateError(f"{key} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise OptimizerStateError(f"{key} has shape {list(value.shape)}, its parameter {list(param.shape)}")
    if not value.is_floating_point() or value.is_complex():
        raise OptimizerStateError(f"{key} has dtype {value.dtype}; the moments are floating point (fp32 in torch's AdamW)")
    values = value.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise OptimizerStateError(f"{key} holds values that are not finite")
    if kind == "exp_avg_sq" and bool((values < 0).any()):
        raise OptimizerStateError(f"{key} holds negative values (a second moment is a mean of squares)")
    return values


def check(units: list[UnitState], params: list[nn.Parameter], state) -> tuple[dict[int, dict], dict[int, int]]:
    """The entries of `state` (torch's `state`: {index: {"step", "exp_avg", "exp_avg_sq"}})
    checked whole: ({id(param): its fp32 CPU moments}, {unit index: step count}). Raises
    OptimizerStateError naming the first key that is wrong and what is wrong with it."""
    if not isinstance(state, dict):
        raise OptimizerStateError(f"state_dict['state'] must be a dict, got {type(state).__name__}")
    homes = _homes(units)
    moments: dict[int, dict] = {}
    steps: dict[int, int] = {}
    for index, entry in state.items():
        key = f"state_dict['state'][{index!r}]"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise OptimizerStateError(f"{key}: the key must be a parameter index 0..{len(params) - 1} (its group order)")
        param = params[index]
        unit, position = homes[id(param)]
        name = unit.spec.param_names[position]
        if not _trainable(unit, position):
            raise OptimizerStateError(
                f"{key} is for {name}, which did not require grad at offload.initialize: the engine keeps no optimizer "
                "state for it"
            )
        if not isinstance(entry, dict) or set(entry) != set(STATE_KEYS):
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            hint = " (max_exp_avg_sq: amsgrad, which offload does not run)" if "max_exp_avg_sq" in str(keys) else ""
            raise OptimizerStateError(f"{key} ({name}) must hold exactly {list(STATE_KEYS)}, got {keys}{hint}")
        step = _step_value(f"{key}['step'] ({name})", entry["step"])
        moments[id(param)] = {kind: _moment(f"{key}[{kind!r}] ({name})", entry[kind], param, kind) for kind in MOMENTS}
        steps[id(param)] = step
    return moments, _unit_steps(units, steps)


def _unit_steps(units: list[UnitState], steps: dict[int, int]) -> dict[int, int]:
    """One step count per unit (Adam's bias correction in the engine is per unit): its
    parameters' counts (0 for one without an entry), which must agree."""
    counts = {}
    for unit in units:
        found = {unit.spec.param_names[i]: steps.get(id(p), 0) for i, p in enumerate(unit.spec.params) if _trainable(unit, i)}
        distinct = sorted(set(found.values()))
        if len(distinct) > 1:
            shown = ", ".join(f"{name}: {step}" for name, step in list(found.items())[:6])
            raise OptimizerStateError(
                f"the state dict gives the parameters of unit {unit.spec.name} different step counts ({shown}; 0: no "
                "entry), but the engine keeps one Adam step count per unit. Load a state dict whose parameters of one "
                "unit stepped together (a parameter that never had a gradient has none in torch's), or use " + CHECKPOINT_ROUTE
            )
        counts[unit.index] = distinct[0] if distinct else 0
    return counts


# ---- writing -----------------------------------------------------------------------------------
def write(units: list[UnitState], store: TierStore, rank: int, moments: dict[int, dict], steps: dict[int, int]) -> None:
    """Each unit's shard of the moments (checked by `check`) into its tier, the masters kept;
    then the step counts. The caller has waited for the steps in flight. Finite values beyond
    what the stored precision holds are stored saturated, with a warning naming them
    (optim.moment_limits)."""
    saturated = SaturationReport(store.codec.precision.value)
    if rank == 0:  # every rank holds the whole state dict: one of them says it
        for unit in units:
            for index, param in enumerate(unit.spec.params):
                given = moments.get(id(param))
                if given is None:
                    continue
                for kind in MOMENTS:
                    saturated.check(unit.spec.param_names[index], kind, given[kind])
    message = saturated.message("engine.optimizer.load_state_dict")
    if message is not None:
        logger.warning("offload: %s", message)
    # moments as fp32 values, encoded back into the stored precision and stored piece by piece,
    # rounded with the key of the loaded step counts (set on the units after the stream)
    for piece in store.update_fp32_moments(units, steps):
        unit = piece.unit
        start, end = unit.layout.shard_range(rank)
        for kind in MOMENTS:
            piece.views[kind][: piece.end - piece.start].zero_()
        for index, a, b, pos in shard_pieces(unit.layout.offsets, unit.layout.numels, start, end):
            given = moments.get(id(unit.spec.params[index]))
            low, high = max(pos, piece.start), min(pos + b - a, piece.end)
            if given is None or low >= high:
                continue
            for kind in MOMENTS:
                source = given[kind].reshape(-1)[a + low - pos : a + high - pos]
                piece.views[kind][low - piece.start : high - piece.start].copy_(source)
    for unit in units:
        unit.step_count = steps[unit.index]
