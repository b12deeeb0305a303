"""Where each unit's optimizer state goes under `offload.optimizer: auto` (plain logic, no torch).

A unit's optimizer state (fp32 master, exp_avg, exp_avg_sq, gradient: bytes per element of this
rank's shard as `config.state_layout.StateBytes` counts them for the config's precision, 16 with
fp32 moments and gradient) goes to the fastest tier with room, in the order the units step:

- the device first (a unit there steps on the accelerator in microseconds), after the 16-bit
  weights, the gradient buffers and an activation reserve; never on a machine whose "device" is
  the CPU itself (there the device and the host are the same memory);
- then host RAM (resident buffers, stepped in place by the C++ Adam);
- then NVMe (swap files streamed through host slots during the step, a piece at a time:
  `shape_slots` says how many slots and how large a piece).

Units step in the next forward's order, and with overlap 'forward' a unit's step only has to
finish before its own next use: the first units to step are the ones the next forward waits
for, so they take the fast tiers, and the last ones (with the most forward time ahead of them
to hide their disk traffic) take NVMe. The host slots that stream NVMe units are paid for only
when some unit goes there.

Every byte count of optimizer state here takes a `StateBytes` (`state=`, default `FP32_STATE`:
fp32 moments and gradient), the one the tiers allocate with (`state_layout.state_bytes_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from offload.config.placement import OptimizerTier
from offload.config.sizes import MIN_SUB_GROUP_SIZE, format_bytes, round_up
from offload.config.state_layout import FP32_STATE, NORM_BLOCK, STATE_KINDS, STEPPED_KINDS, StateBytes

# Swap files (a header page, then the data in whole pages: swap.py) and host pool buffers
# (memory.py) come in whole pages of this size.
PAGE = 4096
# Of the accelerator's memory, what `auto` leaves for activations and the allocator's cache when
# no `max_device_memory` says otherwise.
DEVICE_ACTIVATION_SHARE = 0.25
# Units whose gradients may wait on the device at once: the gradient hand-off
# (runtime.gradients) makes backward wait for the oldest beyond this, the estimate counts it.
GRADS_IN_FLIGHT = 2
# Of the RAM available at start, what the engine leaves to everything else when no
# `offload.max_host_memory` caps it (`host_cap_bytes`).
HOST_MARGIN = 0.10


class PlanError(ValueError):
    """The optimizer state does not fit in device, host and NVMe together."""


@dataclass(frozen=True)
class Capacity:
    """Bytes each tier can give to optimizer state (already net of everything else it holds)."""

    device: int
    host: int
    nvme: int


@dataclass
class OptimizerPlan:
    tiers: list[OptimizerTier]
    # per unit, why it went where it did (for the log and memory_report)
    reasons: list[str]
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    # host bytes of the NVMe slots (0 when no unit is on NVMe)
    slot_bytes: int = 0

    def summary(self) -> str:
        counts = {tier: self.tiers.count(tier) for tier in OptimizerTier if tier in self.tiers}
        parts = [
            f"{tier.value}: {count} unit{'' if count == 1 else 's'}, {format_bytes(self.bytes_by_tier.get(tier.value, 0))}"
            for tier, count in counts.items()
        ]
        if self.slot_bytes:
            parts.append(f"NVMe slots in RAM {format_bytes(self.slot_bytes)}")
        return "; ".join(parts)


def engine_device_bytes(padded_numels: list[int], *, params_offloaded: bool, compute_bytes: int, prefetch_depth: int) -> int:
    """What the engine itself holds on the device at its peak, besides optimizer state: the 16-bit
    weights (every unit with param `none`; the root, the running unit and those fetched ahead
    otherwise) and the gradients in flight."""
    if not padded_numels:
        return 0
    largest = max(padded_numels)
    if params_offloaded:
        others = sorted(padded_numels[1:], reverse=True)
        weights = padded_numels[0] + sum(others[: prefetch_depth + 1])
    else:
        weights = sum(padded_numels)
    return compute_bytes * (weights + GRADS_IN_FLIGHT * largest)


def device_room(*, cap: int | None, memory: tuple[int, int] | None, engine_bytes: int, reserve: int | None = None) -> int:
    """Device bytes `auto` may give to optimizer state. `memory`: the accelerator's (free, total)
    bytes measured at start, None when the CPU stands in for it (its "device" memory is the
    host's RAM: only an explicit `cap` puts state there). On an accelerator: what is free less
    the engine's own `engine_bytes` and the activations' `reserve` (default
    DEVICE_ACTIVATION_SHARE of the device), at most `cap`."""
    if memory is None:
        return max(0, cap or 0)
    free, total = memory
    if reserve is None:
        reserve = int(total * DEVICE_ACTIVATION_SHARE)
    room = max(0, free - engine_bytes - reserve)
    return room if cap is None else max(0, min(cap, room))


def piece_bounds(numel: int, piece: int) -> list[tuple[int, int]]:
    """[start, end) of each piece of at most `piece` elements (`SlotShape.piece`) a unit's
    optimizer state of `numel` elements is streamed in; one empty piece for an empty state (the
    unit still steps)."""
    if numel == 0:
        return [(0, 0)]
    return [(start, min(start + piece, numel)) for start in range(0, numel, piece)]


def piece_count(numel: int, piece: int) -> int:
    """len(piece_bounds(numel, piece)), without listing them."""
    return max(1, -(-numel // piece))


def sum_over_pieces(numel: int, piece: int, measure: Callable[[int], int]) -> int:
    """The sum of `measure(end - start)` over `piece_bounds(numel, piece)`, in closed form: every
    piece but the last is `piece` elements long. What the plans and `offload estimate` count per
    piece (swap bytes, disk traffic) costs the same for any model size this way: a 1e15-parameter
    estimate listed 15 million pieces per placement."""
    if numel == 0:
        return measure(0)
    whole, rest = divmod(numel, piece)
    return whole * measure(piece) + (measure(rest) if rest else 0)


# What unset `offload.buffer_count` and `offload.sub_group_size` are measured against
# (shape_slots): the RAM of this many slots of the largest piece, a piece of at most this many
# elements (1 GiB of fp32 state per slot).
DEFAULT_BUFFER_COUNT = 3
DEFAULT_SUB_GROUP_SIZE = 1 << 26
# The most slots the engine makes on its own: each is four pool buffers and one read ahead.
MAX_AUTO_SLOTS = 32
# Pieces the engine chooses are whole multiples of this many elements (a 4 KiB page of fp32,
# and whole norm blocks).
PIECE_ALIGN = NORM_BLOCK


@dataclass(frozen=True)
class SlotShape:
    """How NVMe-streamed optimizer state passes through RAM: `count` host slots, each holding one
    piece of at most `piece` elements of a unit's state (master, moments and gradient, each in
    its stored width: `StateBytes`). Counted in elements, so the same for every precision."""

    piece: int
    count: int


def weighted_median(numels: list[int]) -> int:
    """The size of unit that the middle element of all of them belongs to: half the elements are
    in units at most this large (0 for none). Many tiny units do not pull it down."""
    half, seen = sum(numels) / 2, 0
    for numel in sorted(numels):
        seen += numel
        if seen >= half:
            return numel
    return 0


def whole_blocks(piece: int, largest: int) -> int:
    """`piece` (at most `largest`, the largest streamed state) cut down to whole gradient-norm
    blocks (config.state_layout.NORM_BLOCK, a multiple of the int8 moments' INT8_BLOCK), so that
    every piece starts at a block of both: a streamed piece's moments encode and decode on their
    own, and the gradient's squared norm summed piece by piece is the whole unit's, bit for bit
    (optim.kernels.sq_norm). A piece as large as the largest state stays whole."""
    if piece >= largest:
        return largest
    return max(NORM_BLOCK, piece - piece % NORM_BLOCK)


def shape_slots(streamed_numels: list[int], *, buffer_count: int | None, sub_group_size: int | None) -> SlotShape:
    """The piece and the slot count for units whose optimizer states of `streamed_numels`
    elements stream from NVMe; `buffer_count` / `sub_group_size`: the config's, None when unset.

    A set key is taken as it is (a piece never exceeds the largest state). Unset ones are chosen
    to hold more pieces in the RAM that DEFAULT_BUFFER_COUNT slots of the largest piece (at most
    DEFAULT_SUB_GROUP_SIZE) would take: the piece is a typical streamed unit (the
    numel-weighted median, so the units holding half the elements are one piece each), and the
    count is as many such pieces as that RAM holds (at least DEFAULT_BUFFER_COUNT, at most
    MAX_AUTO_SLOTS). Three slots sized for a large root unit would hold three small blocks at
    a time; more, smaller ones let the step's reads run further ahead (the first `count` pieces
    are read while backward runs: tiers.TierStore.prefetch_optimizer_states)."""
    largest = max(streamed_numels, default=0)
    cap = DEFAULT_SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    # what DEFAULT_BUFFER_COUNT slots of the largest piece take (slot_bytes_for's pieces: whole blocks)
    footprint = DEFAULT_BUFFER_COUNT * whole_blocks(min(largest, cap), largest)
    if sub_group_size is not None:
        piece = min(largest, sub_group_size)
    else:
        typical = round_up(weighted_median(streamed_numels), PIECE_ALIGN)
        piece = min(largest, cap, max(MIN_SUB_GROUP_SIZE, typical, round_up(-(-footprint // MAX_AUTO_SLOTS), PIECE_ALIGN)))
    piece = whole_blocks(piece, largest)
    if buffer_count is not None:
        count = buffer_count
    elif piece == 0:
        count = DEFAULT_BUFFER_COUNT
    else:
        count = max(DEFAULT_BUFFER_COUNT, min(MAX_AUTO_SLOTS, footprint // piece))
    return SlotShape(piece=piece, count=count)


def swap_file_bytes(nbytes: int) -> int:
    """Disk bytes of one swap file of `nbytes` of data: a header page, the data in whole pages."""
    return PAGE + round_up(nbytes, PAGE)


def swap_bytes_for_state(numel: int, piece: int, state: StateBytes = FP32_STATE, *, kinds: tuple[str, ...] = STATE_KINDS) -> int:
    """Disk bytes of one unit's NVMe-resident state: a swap file per state kind (of `kinds`, all
    four by default) and piece, each as wide as `state` stores that kind (small pieces pay a
    page each for headers)."""
    return sum_over_pieces(
        numel, piece, lambda elements: sum(swap_file_bytes(state.kind_bytes(kind, elements)) for kind in kinds)
    )


def slot_bytes(shape: SlotShape, state: StateBytes = FP32_STATE) -> int:
    """Host bytes of the slots that stream NVMe-resident units: `shape.count` sets of master,
    moments and gradient for one piece (`state.total_bytes`: 16 bytes per element in fp32), plus
    the transfer worker's gradient piece (`state.gradient_bytes` per element)."""
    return shape.count * state.total_bytes(shape.piece) + state.gradient_bytes * shape.piece


def slot_bytes_for(
    largest_state: int, buffer_count: int | None, sub_group_size: int | None, state: StateBytes = FP32_STATE
) -> int:
    """At most the host bytes of the slots (`slot_bytes`) when the largest streamed state has
    `largest_state` elements, whichever units stream beside it: what `auto` sets aside for them
    before it knows which units those are (an unset key's choice never takes more RAM)."""
    return slot_bytes(
        SlotShape(
            piece=whole_blocks(DEFAULT_SUB_GROUP_SIZE if sub_group_size is None else sub_group_size, largest_state),
            count=DEFAULT_BUFFER_COUNT if buffer_count is None else buffer_count,
        ),
        state,
    )


@dataclass(frozen=True)
class DiskTraffic:
    """Bytes read from and written to the swap files in one optimizer step."""

    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written

    def __add__(self, other: DiskTraffic) -> DiskTraffic:
        return DiskTraffic(self.read + other.read, self.written + other.written)


def step_disk_traffic(
    numel: int,
    piece: int,
    state: StateBytes = FP32_STATE,
    *,
    gradient_in_ram: bool = False,
    accumulation_steps: int = 1,
) -> DiskTraffic:
    """What one unit whose optimizer state streams from NVMe moves to and from its swap files per
    optimizer step, each piece's file in whole pages: the step reads the master and moments and
    writes them back; a gradient kept on NVMe (`gradient_in_ram` False) is written as backward
    lands it, read and written again for each further micro-batch of an accumulation window of
    `accumulation_steps`, and read by the step. With fp32 moments and gradient that is 16 bytes
    per element read and 16 written (24 in all with the gradient in RAM)."""

    def each_way(elements: int) -> int:
        """Bytes one piece of `elements` reads, and as many it writes."""
        stepped = sum(round_up(state.kind_bytes(kind, elements), PAGE) for kind in STEPPED_KINDS)
        if gradient_in_ram:
            return stepped
        return stepped + accumulation_steps * round_up(state.kind_bytes("grad32", elements), PAGE)

    moved = sum_over_pieces(numel, piece, each_way)
    return DiskTraffic(read=moved, written=moved)


def weights_disk_traffic(
    shard_numels: list[int], compute_bytes: int, overlap: str, speculating: list[bool] | None = None
) -> DiskTraffic:
    """What the 16-bit weights of param `nvme` move over the disk per step, at most: each unit's
    new weights written once by its step; each unit read by its backward fetch, and by its
    forward fetch too unless its step ran just before that fetch, which then borrows the staging
    buffer the step has just written them into (storage.param16): overlap "forward", and under
    "auto" the units that do not step during backward (not `speculating`). The units stepped last
    can still be lent when the backward reaches them, so the reads can be a little less."""
    sizes = [round_up(numel * compute_bytes, PAGE) for numel in shard_numels]
    once = sum(sizes)
    if overlap == "auto":
        return DiskTraffic(read=once + sum(size for size, s in zip(sizes, speculating or []) if s), written=once)
    return DiskTraffic(read=once if overlap == "forward" else 2 * once, written=once)


def spare_state_bytes(numel: int, state: StateBytes = FP32_STATE) -> int:
    """Host bytes of one unit's spare state (overlap 'backward' with clipping or fp16): its
    master and moments once more (`STEPPED_KINDS`), each buffer in whole pages."""
    return sum(round_up(state.kind_bytes(kind, numel), PAGE) for kind in STEPPED_KINDS)


def plan_speculation(
    optimizer_numels: list[int],
    tiers: list[OptimizerTier],
    room: int,
    state: StateBytes = FP32_STATE,
    on_device: list[bool] | None = None,
) -> list[bool]:
    """Which units step speculatively during backward (overlap 'backward' with clipping or fp16:
    stepped into a spare state as soon as their gradients are final, the old state kept for an
    exact redo if the global norm asks for clipping or an fp16 overflow skips the step).

    Only units whose state is resident in RAM speculate (a DEVICE-tier unit steps on the device
    at step() in far less time than backward; an NVMe one would need a second set of swap files).
    Units are taken from the last (the first whose gradients are final in backward) to the root,
    while their spare state (`spare_state_bytes` under `state`) fits in `room` bytes of RAM; a
    unit that does not fit is passed over and smaller ones after it may still be taken. Units
    not taken step once the norm is known, exactly as with overlap 'none'. Units `on_device`
    (overlap `auto`'s split) speculate on the device, whose copy of their state is the spare: they
    take none here."""
    chosen = [False] * len(optimizer_numels)
    left = room
    for index in reversed(range(len(optimizer_numels))):
        need = spare_state_bytes(optimizer_numels[index], state)
        if on_device is not None and on_device[index]:
            continue
        if tiers[index] is OptimizerTier.HOST and optimizer_numels[index] and need <= left:
            chosen[index] = True
            left -= need
    return chosen


def gradient_bytes(numel: int, state: StateBytes = FP32_STATE) -> int:
    """Host bytes of one unit's gradient kept in RAM (`state.gradient_bytes` per element, whole pages)."""
    return round_up(state.kind_bytes("grad32", numel), PAGE)


def plan_gradients_in_ram(
    optimizer_numels: list[int], tiers: list[OptimizerTier], room: int, state: StateBytes = FP32_STATE
) -> list[bool]:
    """Which units whose optimizer state streams from NVMe keep their gradient in RAM.

    Such a unit's gradient is otherwise written to its swap file as backward lands it and read
    back by the step (`step_disk_traffic`): with fp32 moments and gradient 8 of the 32 bytes per
    param that cross the disk each step. Kept in RAM it
    never touches the disk, and the step reads and writes only the master and moments. Units are
    taken from the first (the root, whose step the next forward waits for first, and whose
    gradients are final last in backward) on, while their gradient (`gradient_bytes`) fits in
    `room` bytes; a unit that does not fit is passed over and smaller ones after it may still be
    taken. The others keep their gradient on NVMe, as before."""
    chosen = [False] * len(optimizer_numels)
    left = room
    for index, numel in enumerate(optimizer_numels):
        need = gradient_bytes(numel, state)
        if tiers[index].streamed and numel and need <= left:
            chosen[index] = True
            left -= need
    return chosen


def factor_needs_norm(gradient_clipping: float, precision: str) -> bool:
    """Whether the factor the stored gradients are multiplied by is known only from every
    gradient (clipping, or fp16's overflow check): overlap 'backward' then steps speculatively."""
    return gradient_clipping > 0 or precision == "fp16"


def host_cap_bytes(max_host_memory: int | None, available: int, ranks_per_node: int) -> int:
    """The RAM one rank's engine may use: `max_host_memory`, or the RAM `available` at start less
    HOST_MARGIN, shared by the `ranks_per_node` ranks of this node."""
    if max_host_memory is not None:
        return max_host_memory
    return int(available * (1 - HOST_MARGIN)) // ranks_per_node


@dataclass(frozen=True)
class LeftoverRam:
    """What the engine takes from the RAM its placement leaves within the host cap: spare states
    for speculative steps (overlap 'backward' with clipping or fp16), then the gradients of
    units whose optimizer state streams from NVMe. Per unit, whether it got one."""

    speculating: list[bool]
    gradients_in_ram: list[bool]
    # host bytes of the spare states and of the gradients taken
    spare_bytes: int
    gradient_bytes: int


def plan_leftover_ram(
    optimizer_numels: list[int],
    tiers: list[OptimizerTier],
    *,
    room: int,
    speculate: bool,
    speculation_cap: int | None,
    gradient_cap: int | None,
    state: StateBytes = FP32_STATE,
    on_device: list[bool] | None = None,
) -> LeftoverRam:
    """Spends `room` bytes of RAM (the host cap less everything the placement needs): first on
    spare states (`plan_speculation`, at most `speculation_cap` bytes, only when `speculate`),
    then, out of what is still left, on gradients kept in RAM (`plan_gradients_in_ram`, at most
    `gradient_cap` bytes), each as wide as `state` stores it. The engine (tiers.TierStore) and
    `offload estimate` both decide with this."""
    room = max(0, room)
    speculating = [False] * len(optimizer_numels)
    if speculate:
        speculating = plan_speculation(optimizer_numels, tiers, _capped(room, speculation_cap), state, on_device)
    spare = sum(spare_state_bytes(n, state) for n, chosen in zip(optimizer_numels, speculating) if chosen)
    in_ram = plan_gradients_in_ram(optimizer_numels, tiers, _capped(room - spare, gradient_cap), state)
    gradients = sum(gradient_bytes(n, state) for n, chosen in zip(optimizer_numels, in_ram) if chosen)
    return LeftoverRam(speculating=speculating, gradients_in_ram=in_ram, spare_bytes=spare, gradient_bytes=gradients)


def _capped(room: int, cap: int | None) -> int:
    return room if cap is None else min(room, cap)


def plan_optimizer_tiers(
    shard_numels: list[int],
    step_order: list[int],
    capacity: Capacity,
    *,
    buffer_count: int | None,
    sub_group_size: int | None,
    state: StateBytes = FP32_STATE,
) -> OptimizerPlan:
    """Per unit (indexed as `shard_numels`), the tier of its optimizer state; see the module
    docstring. `step_order` lists every unit once, in the order they step. `state`: the bytes
    of each kind of state (a unit needs `state.total_bytes` on the device or in RAM, its slots
    and swap files are as wide)."""
    if sorted(step_order) != list(range(len(shard_numels))):
        raise ValueError("step_order must list every unit exactly once")
    need = [state.total_bytes(n) for n in shard_numels]
    tiers: list[OptimizerTier | None] = [None] * len(need)
    reasons = [""] * len(need)
    device_left = capacity.device
    on_device = set()
    for unit in step_order:
        if need[unit] <= device_left:
            device_left -= need[unit]
            on_device.add(unit)
            tiers[unit] = OptimizerTier.DEVICE
            reasons[unit] = "device: fits in the accelerator's spare memory"
        else:
            break  # later units would overtake an earlier one: keep the step order's prefix
    rest = [unit for unit in step_order if unit not in on_device]
    if sum(need[u] for u in rest) <= capacity.host:
        for unit in rest:
            tiers[unit] = OptimizerTier.HOST
            reasons[unit] = "host: fits in RAM" if not on_device else "host: the device is full"
        return _finish(tiers, reasons, need, 0)
    # some units go to NVMe: their slots take RAM first, sized for the largest unit streamed;
    # start from the largest of all and shrink while fewer, smaller units are left to stream
    slots_for = max((shard_numels[u] for u in rest), default=0)
    while True:
        slots = slot_bytes_for(slots_for, buffer_count, sub_group_size, state)
        host_left = capacity.host - slots
        if host_left < 0:
            raise PlanError(
                f"the optimizer state does not fit in RAM ({format_bytes(capacity.host)} for it) and streaming "
                f"it from NVMe needs {format_bytes(slots)} of RAM for its slots; raise offload.max_host_memory, "
                "lower offload.buffer_count or offload.sub_group_size, or use more ranks"
            )
        host_units = []
        for unit in rest:
            if need[unit] <= host_left:
                host_left -= need[unit]
                host_units.append(unit)
            else:
                break
        nvme_units = rest[len(host_units) :]
        streamed = max((shard_numels[u] for u in nvme_units), default=0)
        if streamed >= slots_for:
            break
        slots_for = streamed
    slots = slot_bytes_for(slots_for, buffer_count, sub_group_size, state)
    piece = shape_slots([shard_numels[u] for u in nvme_units], buffer_count=buffer_count, sub_group_size=sub_group_size).piece
    nvme_need = sum(swap_bytes_for_state(shard_numels[u], piece, state) for u in nvme_units)
    if nvme_need > capacity.nvme:
        total = sum(need)
        raise PlanError(
            f"the optimizer state ({format_bytes(total)}) does not fit: device {format_bytes(capacity.device)}, "
            f"host {format_bytes(capacity.host)} (less {format_bytes(slots)} of NVMe slots), NVMe "
            f"{format_bytes(capacity.nvme)} free for it; {format_bytes(nvme_need)} would go to NVMe. Raise "
            "offload.max_host_memory, free disk under offload.nvme_path, or use more ranks"
        )
    for unit in host_units:
        tiers[unit] = OptimizerTier.HOST
        reasons[unit] = "host: fits in RAM beside the NVMe slots"
    for unit in nvme_units:
        tiers[unit] = OptimizerTier.NVME
        reasons[unit] = "nvme: RAM full (steps last in the order, with the most forward time to hide its I/O)"
    return _finish(tiers, reasons, need, slots)


def _finish(tiers, reasons, need, slots) -> OptimizerPlan:
    by_tier: dict[str, int] = {}
    for tier, nbytes in zip(tiers, need):
        by_tier[tier.value] = by_tier.get(tier.value, 0) + nbytes
    return OptimizerPlan(tiers=list(tiers), reasons=reasons, bytes_by_tier=by_tier, slot_bytes=slots)
