"""The optimizer-state plan of `offload.optimizer: auto` (plain logic), tested directly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config.placement import OptimizerTier
from offload.config.sizes import parse_size
from offload.plan.optimizer_plan import (
    DEFAULT_BUFFER_COUNT,
    DEFAULT_SUB_GROUP_SIZE,
    DEVICE_ACTIVATION_SHARE,
    MAX_AUTO_SLOTS,
    Capacity,
    PlanError,
    SlotShape,
    device_room,
    engine_device_bytes,
    piece_bounds,
    plan_optimizer_tiers,
    shape_slots,
    slot_bytes,
    slot_bytes_for,
    swap_bytes_for_state,
    weighted_median,
    whole_blocks,
)

GiB = 2**30
WHOLE = 2**62  # a sub_group_size larger than any unit: every slot holds a whole unit


def test_everything_on_the_host_when_it_fits():
    plan = plan_optimizer_tiers(
        [1000] * 4, [0, 1, 2, 3], Capacity(device=0, host=10**9, nvme=0), buffer_count=3, sub_group_size=WHOLE
    )
    assert plan.tiers == [OptimizerTier.HOST] * 4
    assert plan.slot_bytes == 0
    assert plan.bytes_by_tier == {"cpu": 4 * 16000}


def test_device_first_in_step_order_then_host_then_nvme_last():
    numels = [100, 100, 100, 100, 100]
    order = [0, 3, 1, 2, 4]
    slots = slot_bytes_for(100, 1, WHOLE)
    capacity = Capacity(device=2 * 1600, host=slots + 1600, nvme=10**6)  # room for one unit beside the slots
    plan = plan_optimizer_tiers(numels, order, capacity, buffer_count=1, sub_group_size=WHOLE)
    assert [plan.tiers[u] for u in order] == [
        OptimizerTier.DEVICE,
        OptimizerTier.DEVICE,
        OptimizerTier.HOST,
        OptimizerTier.NVME,
        OptimizerTier.NVME,
    ]
    assert plan.slot_bytes == slots
    assert "nvme" in plan.reasons[4] and "device" in plan.reasons[0]


def test_too_little_everywhere_is_an_error_with_the_numbers():
    with pytest.raises(PlanError, match="does not fit.*max_host_memory"):
        plan_optimizer_tiers(
            [10**8] * 4, [0, 1, 2, 3], Capacity(device=0, host=GiB, nvme=GiB), buffer_count=3, sub_group_size=WHOLE
        )


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=12),
    device=st.integers(min_value=0, max_value=10**8),
    host=st.integers(min_value=0, max_value=2 * 10**8),
    sub_group_size=st.sampled_from([1024, 5000, 10**5, WHOLE]),
    data=st.data(),
)
def test_plan_properties(numels, device, host, sub_group_size, data):
    """Any plan: every tier within its capacity (the host's including the slots), the device
    and host take a prefix of the step order and NVMe its suffix, and nothing goes to NVMe
    while everything fits in RAM."""
    order = data.draw(st.permutations(range(len(numels))))
    capacity = Capacity(device=device, host=host, nvme=10**12)
    try:
        plan = plan_optimizer_tiers(numels, list(order), capacity, buffer_count=3, sub_group_size=sub_group_size)
    except PlanError:
        # only when RAM cannot even hold the slots that would stream the rest from NVMe
        rest_largest = max(numels)
        assert host < slot_bytes_for(rest_largest, 3, sub_group_size)
        return
    assert plan.bytes_by_tier.get("device", 0) <= device
    assert plan.bytes_by_tier.get("cpu", 0) + plan.slot_bytes <= host
    rank = {OptimizerTier.DEVICE: 0, OptimizerTier.HOST: 1, OptimizerTier.NVME: 2}
    sequence = [rank[plan.tiers[u]] for u in order]
    assert sequence == sorted(sequence)
    if sum(16 * n for n in numels) <= host:
        assert OptimizerTier.NVME not in plan.tiers
    streamed = [n for n, tier in zip(numels, plan.tiers) if tier is OptimizerTier.NVME]
    # the slots hold one piece of the largest unit streamed, whatever else is left (see the next test)
    assert plan.slot_bytes == (slot_bytes_for(max(streamed), 3, sub_group_size) if streamed else 0)


# ---- pieces of NVMe-streamed state (offload.sub_group_size) ------------------------------------
def test_piece_bounds_cut_a_unit_into_pieces_of_at_most_sub_group_size():
    assert piece_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_bounds(8, 4) == [(0, 4), (4, 8)]
    assert piece_bounds(3, 4) == [(0, 3)]  # smaller than a piece: one piece, the whole unit
    assert piece_bounds(0, 4) == [(0, 0)]  # no trainable state: still one (empty) piece, the unit steps


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(min_value=0, max_value=10**10), data=st.data())
def test_pieces_cover_the_unit_exactly_in_order(numel, data):
    # at most 10,000 pieces (a test that stays fast); larger than the unit too
    sub_group_size = data.draw(st.integers(min_value=max(1, numel // 10_000), max_value=2 * 10**10))
    pieces = piece_bounds(numel, sub_group_size)
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    for (_, end), (start, _) in zip(pieces, pieces[1:]):
        assert end == start  # contiguous: no gap, no overlap
    sizes = [end - start for start, end in pieces]
    assert all(0 < size <= sub_group_size for size in sizes) or numel == 0
    assert all(size == sub_group_size for size in sizes[:-1])  # only the last may be shorter
    assert len(pieces) == max(1, -(-numel // sub_group_size))
    # a slot holds the largest piece, a whole number of int8 moment blocks (config.state_layout.INT8_BLOCK)
    piece = shape_slots([numel], buffer_count=3, sub_group_size=sub_group_size).piece
    assert piece == whole_blocks(sub_group_size, numel)


def test_slot_bytes_are_buffer_count_pieces_of_16_bytes_and_a_4_byte_gradient_piece():
    assert shape_slots([10**9], buffer_count=3, sub_group_size=1 << 26) == SlotShape(piece=1 << 26, count=3)
    # a small unit: a piece is the whole unit, no more
    assert shape_slots([1000], buffer_count=3, sub_group_size=1 << 26) == SlotShape(piece=1000, count=3)
    assert slot_bytes(SlotShape(piece=1000, count=3)) == 3 * 16 * 1000 + 4 * 1000
    assert slot_bytes_for(1000, 3, 1 << 26) == 3 * 16 * 1000 + 4 * 1000
    assert slot_bytes_for(10**9, 3, 1 << 26) == 3 * 16 * (1 << 26) + 4 * (1 << 26)  # 3.25 GiB
    assert slot_bytes_for(10**9, 3, 1 << 26) == 3.25 * GiB
    # Llama-2-13B's largest unit (the embedding and the head, 327.7M elements): 15.9 GiB whole
    assert slot_bytes_for(327_685_120, 3, WHOLE) == 52 * 327_685_120
    assert slot_bytes_for(327_685_120, 2, 1 << 26) == 36 * (1 << 26)


# ---- the slots' shape when offload.buffer_count / offload.sub_group_size are unset ------------
GPT2_SMALL = [39_383_808] + [7_087_872] * 12  # the root (tied embedding) and 12 blocks, 124M


def test_unset_keys_give_more_slots_of_a_typical_unit_in_the_same_ram():
    """GPT-2 small on NVMe: three slots sized for the 39M-element root held three 7M blocks at
    a time; the same RAM holds sixteen block-sized pieces (the root is cut into six)."""
    before = SlotShape(piece=39_383_808, count=3)
    shape = shape_slots(GPT2_SMALL, buffer_count=None, sub_group_size=None)
    assert shape.piece == 7_088_128  # the blocks' size, in whole 1024-element pages
    assert shape.count == 16
    assert shape.count * shape.piece <= before.count * before.piece
    assert len(piece_bounds(GPT2_SMALL[0], shape.piece)) == 6
    assert all(len(piece_bounds(n, shape.piece)) == 1 for n in GPT2_SMALL[1:])
    # a key that is set is taken as it is, the other still fills the same RAM
    assert shape_slots(GPT2_SMALL, buffer_count=5, sub_group_size=None) == SlotShape(piece=7_088_128, count=5)
    assert shape_slots(GPT2_SMALL, buffer_count=None, sub_group_size=1 << 22) == SlotShape(piece=1 << 22, count=3)
    # a large model's blocks are cut at the default piece, three slots as before
    llama_7b = [262_148_096] + [202_383_360] * 32
    assert shape_slots(llama_7b, buffer_count=None, sub_group_size=None) == SlotShape(DEFAULT_SUB_GROUP_SIZE, 3)


def test_tiny_units_do_not_shrink_the_piece_and_the_slot_count_is_capped():
    # many norm-sized units beside big ones: the median by elements is a big one
    assert weighted_median([1000] * 50 + [10**6] * 4) == 10**6
    shape = shape_slots([1000] * 50 + [10**6] * 4, buffer_count=None, sub_group_size=None)
    assert shape == SlotShape(piece=10**6, count=3)
    # a huge root beside small blocks: at most MAX_AUTO_SLOTS, so the piece grows instead
    numels = [50_000_000] + [1_000_000] * 60
    assert weighted_median(numels) == 1_000_000
    shape = shape_slots(numels, buffer_count=None, sub_group_size=None)
    assert shape.piece * MAX_AUTO_SLOTS >= 3 * 50_000_000 >= shape.piece * shape.count
    assert MAX_AUTO_SLOTS - 1 <= shape.count <= MAX_AUTO_SLOTS
    assert shape_slots([], buffer_count=None, sub_group_size=None).piece == 0


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=40),
    buffer_count=st.one_of(st.none(), st.integers(min_value=2, max_value=8)),
    sub_group_size=st.one_of(st.none(), st.integers(min_value=1024, max_value=2 * 10**9)),
)
def test_slot_shape_properties(numels, buffer_count, sub_group_size):
    shape = shape_slots(numels, buffer_count=buffer_count, sub_group_size=sub_group_size)
    largest = max(numels)
    cap = DEFAULT_SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    assert 0 <= shape.piece <= min(largest, cap)  # never more than a piece can hold
    if sub_group_size is not None:
        assert shape.piece == whole_blocks(sub_group_size, largest)
    if buffer_count is not None:
        assert shape.count == buffer_count
    else:
        assert DEFAULT_BUFFER_COUNT <= shape.count <= MAX_AUTO_SLOTS
        # never more RAM than the default count of the largest piece
        assert shape.count * shape.piece <= DEFAULT_BUFFER_COUNT * min(largest, cap)
    # what `auto` sets aside before it knows the streamed units covers whatever they turn out to be
    assert slot_bytes(shape) <= slot_bytes_for(largest, buffer_count, sub_group_size)
    if sub_group_size is None and largest:
        # the units holding half the elements are one piece each (up to the default piece)
        half = sorted(n for n in numels if n <= min(weighted_median(numels), cap))
        assert all(len(piece_bounds(n, shape.piece)) == 1 for n in half)


def test_a_small_sub_group_size_keeps_more_units_in_ram():
    """Whole-unit slots take RAM that smaller pieces leave to resident units: with pieces of a
    tenth of a unit, the same RAM holds two more units' state, and two fewer stream from NVMe."""
    unit = 1024 * 1000  # pieces are whole norm blocks (1024 elements): a tenth of a unit is one
    numels = [unit] * 10
    order = list(range(10))
    host = 4 * 16 * unit + slot_bytes_for(unit, 3, WHOLE)  # four units beside whole-unit slots
    capacity = Capacity(device=0, host=host, nvme=10**12)
    whole = plan_optimizer_tiers(numels, order, capacity, buffer_count=3, sub_group_size=WHOLE)
    pieces = plan_optimizer_tiers(numels, order, capacity, buffer_count=3, sub_group_size=unit // 10)
    assert whole.tiers == [OptimizerTier.HOST] * 4 + [OptimizerTier.NVME] * 6
    # 116 unit-elements' bytes: 52 of whole-unit slots + 4 units, or 5.2 of slots + 6 units (16 each)
    assert pieces.tiers == [OptimizerTier.HOST] * 6 + [OptimizerTier.NVME] * 4
    assert whole.slot_bytes == 52 * unit and pieces.slot_bytes == 52 * unit // 10
    assert pieces.bytes_by_tier["cpu"] + pieces.slot_bytes <= host
    assert pieces.bytes_by_tier["nvme"] < whole.bytes_by_tier["nvme"]


def test_whole_unit_slots_that_do_not_fit_in_ram_fit_as_pieces():
    """RAM too small for even the slots of whole units (the 13B case before pieces) is enough
    for slots of pieces."""
    numels = [10**8] * 4
    capacity = Capacity(device=0, host=GiB, nvme=10 * GiB)
    with pytest.raises(PlanError, match="needs 4.84 GiB of RAM for its slots"):
        plan_optimizer_tiers(numels, [0, 1, 2, 3], capacity, buffer_count=3, sub_group_size=WHOLE)
    plan = plan_optimizer_tiers(numels, [0, 1, 2, 3], capacity, buffer_count=3, sub_group_size=1 << 22)
    assert plan.tiers == [OptimizerTier.NVME] * 4
    assert plan.slot_bytes == 52 * (1 << 22)


def test_device_room_on_the_cpu_is_only_what_the_cap_gives():
    """The CPU standing in for the device has no memory of its own: no cap, no device tier."""
    assert device_room(cap=None, memory=None, engine_bytes=0) == 0
    assert device_room(cap=5 * GiB, memory=None, engine_bytes=10 * GiB) == 5 * GiB


def test_device_room_on_an_accelerator_leaves_the_engine_and_activations_their_share():
    free, total = 70 * GiB, 80 * GiB
    room = device_room(cap=None, memory=(free, total), engine_bytes=10 * GiB)
    assert room == free - 10 * GiB - int(DEVICE_ACTIVATION_SHARE * total)
    assert device_room(cap=GiB, memory=(free, total), engine_bytes=10 * GiB) == GiB  # the cap when lower
    assert device_room(cap=100 * GiB, memory=(free, total), engine_bytes=10 * GiB) == room  # never more than free
    assert device_room(cap=None, memory=(GiB, total), engine_bytes=10 * GiB) == 0  # nothing spare


@given(
    numels=st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=20),
    depth=st.integers(min_value=0, max_value=4),
)
def test_engine_device_bytes_offloaded_is_at_most_everything_resident(numels, depth):
    resident = engine_device_bytes(numels, params_offloaded=False, compute_bytes=2, prefetch_depth=depth)
    offloaded = engine_device_bytes(numels, params_offloaded=True, compute_bytes=2, prefetch_depth=depth)
    assert resident == 2 * (sum(numels) + 2 * max(numels))
    assert 2 * (numels[0] + 2 * max(numels)) <= offloaded <= resident


def test_parse_size_reads_gpu_buyer_and_binary_units():
    assert parse_size("40GB") == 40 * 10**9
    assert parse_size("40GiB") == 40 * GiB
    assert parse_size("1.5 GiB") == int(1.5 * GiB)
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="not a size"):
        parse_size("forty gigs")


@pytest.mark.parametrize(
    "text,decimal,binary",
    [
        ("40GB", 40 * 10**9, 40 * GiB),
        ("40gb", 40 * 10**9, 40 * GiB),
        ("40G", 40 * GiB, 40 * GiB),
        ("40GiB", 40 * GiB, 40 * GiB),
        ("512M", 512 << 20, 512 << 20),
        ("512KiB", 512 << 10, 512 << 10),
        ("1e9", 10**9, 10**9),
        (" 1048576 ", 1 << 20, 1 << 20),
        ("2 TB", 2 * 10**12, 2 << 40),
    ],
)
def test_one_size_grammar_for_config_estimate_and_bench_io(text, decimal, binary):
    """A cap in the config, a size given to `offload estimate` and a block size given to
    `offload bench-io` are read by one grammar (offload.config.sizes): "40G" or "1e9" in a config is no
    longer an error where the estimate accepted it. KB/MB/GB/TB are powers of 10 in the config
    and for disks, powers of 2 for RAM and GPU sizes and block sizes."""
    from offload.cli import bench_io
    from offload.plan import estimate

    assert parse_size(text) == decimal
    assert estimate.parse_bytes(text) == decimal
    assert estimate.parse_bytes(text, binary=True) == binary
    assert bench_io.parse_size(text) == binary


def test_offload_estimate_plans_the_split_the_engine_makes():
    """`offload estimate` on a machine with too little RAM for the whole state: the auto rows
    hold the slots and the first units in RAM, the rest on NVMe, and say so."""
    from offload.plan import estimate as est
    from offload.plan.machine import Machine
    from offload.plan.model_shapes import shape_from_param_count

    shape = shape_from_param_count(3 * 10**9)
    machine = Machine(gpu_bytes=24 * GiB, ram_bytes=24 * GiB, disk_bytes=200 * 10**9, device="cuda")
    report = est.estimate_report(shape, machine)
    rows = {(r["param"], r["optimizer"]): r for r in report["placements"]}
    auto, cpu, nvme = rows[("none", "auto")], rows[("none", "cpu")], rows[("none", "nvme")]
    assert not cpu["fits"] and auto["fits"]
    assert nvme["nvme"]["total"] > auto["nvme"]["total"] > 0
    assert auto["host"]["total"] <= 24 * GiB * 0.9
    assert "cpu:" in auto["plan"] and "nvme:" in auto["plan"]
    assert report["recommended"]["optimizer"] == "auto"


def test_swap_files_of_small_pieces_pay_a_header_page_each_and_the_plan_counts_them():
    # 10 pieces of 1024 fp32 elements: per piece and kind one data page and one header page
    assert swap_bytes_for_state(10 * 1024, 1024) == 10 * 4 * (4096 + 4096)
    assert swap_bytes_for_state(10 * 1024, WHOLE) == 4 * (4096 + 40960)
    numels = [10 * 1024] * 3
    data_only = 16 * sum(numels)  # what the state's elements alone take
    with pytest.raises(PlanError, match="would go to NVMe"):
        plan_optimizer_tiers(
            numels,
            [0, 1, 2],
            Capacity(device=0, host=slot_bytes_for(1024, 2, 1024), nvme=data_only),
            buffer_count=2,
            sub_group_size=1024,
        )
    plan = plan_optimizer_tiers(
        numels,
        [0, 1, 2],
        Capacity(device=0, host=slot_bytes_for(1024, 2, 1024), nvme=2 * data_only),
        buffer_count=2,
        sub_group_size=1024,
    )
    assert [tier.value for tier in plan.tiers] == ["nvme"] * 3
