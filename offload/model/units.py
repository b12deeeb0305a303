"""Cutting a model into units, and each unit's flat layout.

A unit is a module whose parameters move together: one flat buffer holds them (each param a
view at an aligned offset), padded so that every rank's shard has the same, aligned length.
The parameters that require grad come first; the frozen ones after them, from an aligned
offset on (`FlatLayout.optimizer_end`): the optimizer state (fp32 master, moments, fp32
gradient) of shard `rank` covers only the part of the shard below that offset, so a frozen
parameter has none. Decision logic here is plain Python over names and counts; `build_units`
applies it to a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from offload.config.sizes import round_up
from offload.errors import ConfigError

# Each parameter starts at a multiple of this many elements (64 bytes of bf16: a cache line).
# A multiple of config.state_layout.INT8_BLOCK: an int8 moment's block (one shared exponent) never
# holds elements of two parameters, so a parameter's step never re-encodes another's.
PARAM_ALIGN_ELEMENTS = 32
# Each rank's shard is a multiple of this many elements (4 KiB of bf16, 8 KiB of fp32: O_DIRECT).
SHARD_ALIGN_ELEMENTS = 2048


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in its unit's flat buffer, and how the buffer is sharded."""

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shard_numel: int
    world_size: int
    # the trainable params lie below this offset of the flat buffer, the frozen ones above it
    # (a multiple of SHARD_ALIGN_ELEMENTS; the whole buffer when nothing is frozen)
    optimizer_end: int = -1

    def __post_init__(self) -> None:
        if self.optimizer_end < 0:
            object.__setattr__(self, "optimizer_end", self.padded_numel)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def optimizer_numel(self, rank: int) -> int:
        """How many elements at the start of shard `rank` carry optimizer state (the trainable
        params of the shard are all among them; 0 when the shard holds only frozen ones)."""
        return min(max(self.optimizer_end - rank * self.shard_numel, 0), self.shard_numel)

    def params_in_shard(self, rank: int) -> list[int]:
        """Indices of the params with at least one element in shard `rank`."""
        return [index for index, _, _, _ in shard_pieces(self.offsets, self.numels, *self.shard_range(rank))]

    def param_ranges_in_shard(self, rank: int, which: list[int] | None = None) -> list[tuple[int, int]]:
        """[start, end) ranges, relative to shard `rank`, of the params `which` (all by default),
        merged where adjacent; padding between merged params is included only when both sides are."""
        shard_start, shard_end = self.shard_range(rank)
        chosen = set(range(len(self.offsets)) if which is None else which)
        # in memory order: two params merge when they are neighbours there (only alignment
        # padding between them) and both are chosen
        in_memory = sorted(range(len(self.offsets)), key=lambda i: self.offsets[i])
        ranges: list[tuple[int, int]] = []
        previous_chosen = False
        for index in in_memory:
            if index not in chosen:
                previous_chosen = False
                continue
            start = max(self.offsets[index], shard_start)
            end = min(self.offsets[index] + self.numels[index], shard_end)
            if start >= end:
                previous_chosen = False
                continue
            start, end = start - shard_start, end - shard_start
            if ranges and previous_chosen and ranges[-1][1] >= start - PARAM_ALIGN_ELEMENTS:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
            previous_chosen = True
        return ranges


def plan_flat_layout(numels: list[int], world_size: int = 1, trainable: list[bool] | None = None) -> FlatLayout:
    """Aligned offsets for `numels` and the per-rank shard length (equal for every rank).

    `trainable` (all True by default) says which params require grad: those are placed first,
    in order, and the frozen ones after `optimizer_end` (aligned), also in order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    trainable = [True] * len(numels) if trainable is None else list(trainable)
    if len(trainable) != len(numels):
        raise ValueError(f"{len(numels)} numels but {len(trainable)} trainable flags")
    offsets = [0] * len(numels)
    cursor = 0
    for index, numel in enumerate(numels):
        if trainable[index]:
            cursor = round_up(cursor, PARAM_ALIGN_ELEMENTS)
            offsets[index] = cursor
            cursor += numel
    frozen = [index for index in range(len(numels)) if not trainable[index]]
    optimizer_end = None
    if frozen:
        cursor = optimizer_end = round_up(cursor, SHARD_ALIGN_ELEMENTS)
        for index in frozen:
            cursor = round_up(cursor, PARAM_ALIGN_ELEMENTS)
            offsets[index] = cursor
            cursor += numels[index]
    shard_numel = round_up(max(1, -(-cursor // world_size)), SHARD_ALIGN_ELEMENTS)
    if optimizer_end is None:
        optimizer_end = shard_numel * world_size
    return FlatLayout(tuple(offsets), tuple(numels), shard_numel, world_size, optimizer_end)


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


def _largest_container(model: nn.Module, kind: type[nn.Module]) -> tuple[str, nn.Module] | None:
    """The `kind` container (ModuleList, Sequential) holding the most parameters, among those
    with at least two children that hold parameters (a list of one is no cut)."""
    best: tuple[str, nn.Module] | None = None
    best_count = 0
    for name, module in model.named_modules():
        if not isinstance(module, kind):
            continue
        if sum(1 for child in module.children() if any(True for _ in child.parameters())) < 2:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > best_count:
            best, best_count = (name, module), count
    return best


def _automatic_container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """Automatic cut: each child of the largest nn.ModuleList (the blocks of a transformer);
    a model without one (an nn.Sequential stack) is cut into the children of its largest
    nn.Sequential."""
    best: tuple[str, nn.Module] | None = None
    best_count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = (name, module), count
    return best if best is not None else _largest_container(model, nn.Sequential)


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
    found = _automatic_container(model)
    if found is None:
        return []
    list_name, module_list = found
    return [
        (f"{list_name}.{child_name}" if list_name else child_name, child) for child_name, child in module_list.named_children()
    ]


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


def single_unit_warning(units: list[UnitSpec], param_offloaded: bool) -> str | None:
    """A warning when offloading the weights cannot save device memory: every parameter is in
    one unit, which is on the device whenever any of it runs."""
    holding = [unit for unit in units if unit.params]
    if not param_offloaded or len(holding) != 1:
        return None
    unit = holding[0]
    return (
        f"offload: the whole model is one unit ({unit.name}, {unit.numel / 1e6:.2f}M params): with offload.param "
        "offloaded it is fetched whole for every forward and backward, so the device holds all of it and nothing is "
        "saved; set wrap.module_classes (the block class) or wrap.min_params (parameters per unit) to cut it"
    )


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


def shard_pieces(offsets, numels, shard_start: int, shard_end: int) -> list[tuple[int, int, int, int]]:
    """(param index, start, end, position in shard): the element range [start, end) of each
    flattened param that lies in the flat-buffer range [shard_start, shard_end)."""
    pieces = []
    for index, (offset, numel) in enumerate(zip(offsets, numels)):
        low, high = max(offset, shard_start), min(offset + numel, shard_end)
        if low < high:
            pieces.append((index, low - offset, high - offset, low - shard_start))
    return pieces
