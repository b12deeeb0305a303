"""Cutting a model into units, and each unit's flat layout.

A unit is a module whose parameters move together: one flat buffer holds them (each param a
view at an aligned offset), padded so that every rank's shard has the same, aligned length.
Decision logic here is plain Python over names and counts; `build_units` applies it to a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from offload.errors import ConfigError

# Each parameter starts at a multiple of this many elements (16 bytes of bf16: vector loads).
PARAM_ALIGN_ELEMENTS = 8
# Each rank's shard is a multiple of this many elements (4 KiB of bf16, 8 KiB of fp32: O_DIRECT).
SHARD_ALIGN_ELEMENTS = 2048


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in its unit's flat buffer, and how the buffer is sharded."""

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shard_numel: int
    world_size: int

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_ranges_in_shard(self, rank: int, which: list[int] | None = None) -> list[tuple[int, int]]:
        """[start, end) ranges, relative to shard `rank`, of the params `which` (all by default),
        merged where adjacent; padding between merged params is included only when both sides are."""
        shard_start, shard_end = self.shard_range(rank)
        indices = range(len(self.offsets)) if which is None else sorted(which)
        ranges: list[tuple[int, int]] = []
        previous_index = None
        for index in indices:
            start = max(self.offsets[index], shard_start)
            end = min(self.offsets[index] + self.numels[index], shard_end)
            if start >= end:
                continue
            start, end = start - shard_start, end - shard_start
            if ranges and previous_index == index - 1 and ranges[-1][1] >= start - PARAM_ALIGN_ELEMENTS:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
            previous_index = index
        return ranges


def plan_flat_layout(numels: list[int], world_size: int = 1) -> FlatLayout:
    """Aligned offsets for `numels` and the per-rank shard length (equal for every rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    offsets = []
    cursor = 0
    for numel in numels:
        cursor = round_up(cursor, PARAM_ALIGN_ELEMENTS)
        offsets.append(cursor)
        cursor += numel
    shard_numel = round_up(max(1, -(-cursor // world_size)), SHARD_ALIGN_ELEMENTS)
    return FlatLayout(tuple(offsets), tuple(numels), shard_numel, world_size)


@dataclass
class UnitSpec:
    """A unit before any state exists: the module, its own params, and units it borrows from."""

    index: int
    name: str
    module: nn.Module
    param_names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    # indices of units owning parameters that this unit's modules also use (tied weights)
    borrows: set[int] = field(default_factory=set)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    best = None
    best_count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = (name, module), count
    return best


def choose_unit_modules(model: nn.Module, module_classes: list[str], min_params: int) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that become units, in registration order (the root excluded)."""
    if module_classes:
        wanted = set(module_classes)
        known = {type(m).__name__ for m in model.modules()}
        missing = wanted - known
        if missing:
            raise ConfigError(
                f"config key 'wrap.module_classes': {sorted(missing)} not found in the model; "
                f"its module classes are: {', '.join(sorted(known))}"
            )
        chosen = []
        taken: list[str] = []
        for name, module in model.named_modules():
            if not name or type(module).__name__ not in wanted:
                continue
            if any(name.startswith(prefix + ".") for prefix in taken):
                continue  # the outermost match wins
            taken.append(name)
            chosen.append((name, module))
        return chosen
    if min_params > 0:
        return _size_based_units(model, min_params)
    found = _largest_module_list(model)
    if found is None:
        return []
    list_name, module_list = found
    return [(f"{list_name}.{child_name}" if list_name else child_name, child) for child_name, child in module_list.named_children()]


def _size_based_units(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    """Post-order: a module becomes a unit once the parameters not yet in a unit reach min_params."""
    chosen: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name:
            return
        unclaimed = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        if unclaimed >= min_params:
            chosen.append((name, module))
            claimed.update(id(p) for p in module.parameters())

    visit("", model)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(chosen, key=lambda item: order[id(item[1])])


def build_units(model: nn.Module, module_classes: list[str] | None = None, min_params: int = 0) -> list[UnitSpec]:
    """Units of `model`: unit 0 is the root (everything not in another unit), then the chosen
    modules. Each parameter belongs to exactly one unit: the first, in registration order, whose
    subtree holds it; another unit whose subtree also holds it borrows it from that owner."""
    chosen = choose_unit_modules(model, list(module_classes or []), min_params)
    owner: dict[int, int] = {}
    units = [UnitSpec(0, "<root>", model)]
    for index, (name, module) in enumerate(chosen, start=1):
        unit = UnitSpec(index, name, module)
        for param_name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in owner:
                if owner[id(param)] != index:
                    unit.borrows.add(owner[id(param)])
                continue
            owner[id(param)] = index
            unit.param_names.append(f"{name}.{param_name}")
            unit.params.append(param)
        units.append(unit)
    root = units[0]
    for param_name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner:
            continue
        owner[id(param)] = 0
        root.param_names.append(param_name)
        root.params.append(param)
    for unit in units[1:]:
        unit.borrows.discard(unit.index)
    if not any(unit.params for unit in units):
        raise ConfigError("the model has no parameters: there is nothing to train or offload")
    # a unit with no parameters of its own still matters when it borrows (a tied output head)
    kept = [unit for unit in units if unit.params or unit.borrows or unit.index == 0]
    remap = {unit.index: new_index for new_index, unit in enumerate(kept)}
    for unit in kept:
        unit.index = remap[unit.index]
        unit.borrows = {remap[b] for b in unit.borrows if b in remap}
    return kept
