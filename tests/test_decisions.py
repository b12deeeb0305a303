"""Decision logic as plain functions: layout, shard ranges, order, clipping, loss scale, budgets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.model.units import PARAM_ALIGN_ELEMENTS, SHARD_ALIGN_ELEMENTS, build_units, plan_flat_layout
from offload.optim.loss_scaling import DynamicLossScaler, clip_coefficient, gradient_multiplier
from offload.plan.budgets import host_budget_bytes
from offload.runtime.prefetch import ExecutionOrder, step_order

numel_lists = st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(numels=numel_lists, world=st.integers(min_value=1, max_value=8))
def test_layout_is_aligned_disjoint_and_equally_sharded(numels, world):
    layout = plan_flat_layout(numels, world)
    assert layout.shard_numel % SHARD_ALIGN_ELEMENTS == 0
    assert layout.padded_numel == layout.shard_numel * world
    end = 0
    for offset, numel in zip(layout.offsets, numels):
        assert offset % PARAM_ALIGN_ELEMENTS == 0
        assert offset >= end  # params never overlap
        end = offset + numel
    assert end <= layout.padded_numel


@settings(max_examples=200, deadline=None)
@given(numels=numel_lists, world=st.integers(min_value=1, max_value=6), data=st.data())
def test_shard_ranges_cover_exactly_the_chosen_params(numels, world, data):
    layout = plan_flat_layout(numels, world)
    chosen = data.draw(st.sets(st.integers(min_value=0, max_value=len(numels) - 1)))
    covered = set()
    for rank in range(world):
        start, _ = layout.shard_range(rank)
        for a, b in layout.param_ranges_in_shard(rank, sorted(chosen)):
            assert 0 <= a < b <= layout.shard_numel
            covered.update(range(start + a, start + b))
    wanted = set()
    for index in chosen:
        wanted.update(range(layout.offsets[index], layout.offsets[index] + numels[index]))
    # every chosen element is covered; anything else covered is alignment padding between them
    assert wanted <= covered
    others = set()
    for index in set(range(len(numels))) - chosen:
        others.update(range(layout.offsets[index], layout.offsets[index] + numels[index]))
    assert not (covered & others)


def test_units_auto_wrap_takes_the_largest_module_list():
    from reference import TinyNet

    model = TinyNet(depth=3)
    units = build_units(model)
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert {id(p) for u in units for p in u.params} == {id(p) for p in model.parameters()}
    assert sum(len(u.params) for u in units) == len(list(model.parameters()))


def test_units_by_size_and_by_class():
    from reference import TinyNet

    model = TinyNet(width=16, depth=2)
    by_class = build_units(model, module_classes=["Linear"])
    assert len(by_class) == 1 + 2 + 4  # root (layer norms) + inp/out + two Linear per block
    by_size = build_units(model, min_params=500)
    assert all(u.numel >= 500 for u in by_size[1:])
    with pytest.raises(Exception, match="Conv2d"):
        build_units(model, module_classes=["Conv2d"])


def test_execution_order_records_predicts_and_re_records_on_deviation():
    order = ExecutionOrder()
    order.begin()
    for unit in [0, 1, 2, 3]:
        order.visit(unit)
        assert order.upcoming(2) == []  # nothing recorded yet
    assert order.end() is True
    order.begin()
    order.visit(0)
    assert order.upcoming(2) == [1, 2]
    order.visit(1)
    order.visit(3)  # a branch
    assert order.upcoming(2) == [] and order.deviated
    order.visit(2)
    assert order.end() is True and order.recorded == [0, 1, 3, 2]
    order.begin()
    for unit in [0, 1, 3, 2]:
        order.visit(unit)
    assert order.end() is False  # same as recorded


def test_step_order_follows_forward_and_appends_unseen_units():
    assert step_order([0, 2, 1, 2], 4) == [0, 2, 1, 3]
    assert step_order(None, 3) == [0, 1, 2]


@given(norm=st.floats(min_value=0, max_value=1e6), max_norm=st.floats(min_value=1e-3, max_value=1e3))
def test_clip_coefficient_matches_torch_definition(norm, max_norm):
    coefficient = clip_coefficient(norm, max_norm)
    assert 0 < coefficient <= 1
    assert coefficient == pytest.approx(min(1.0, max_norm / (norm + 1e-6)))
    assert clip_coefficient(norm, 0.0) == 1.0


def test_gradient_multiplier_unscales_and_reports_true_norm():
    multiplier, norm = gradient_multiplier(loss_scale=8.0, total_scaled_sq_norm=64.0 * 4.0, max_norm=0.0)
    assert norm == pytest.approx(2.0) and multiplier == pytest.approx(1 / 8)
    multiplier, norm = gradient_multiplier(loss_scale=1.0, total_scaled_sq_norm=16.0, max_norm=1.0)
    assert multiplier == pytest.approx(1 / (4.0 + 1e-6))
    _, norm = gradient_multiplier(1.0, float("inf"), 1.0)
    assert not math.isfinite(norm)


def test_loss_scaler_backs_off_and_grows():
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=2, min_scale=256.0)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    scaler.update(overflow=False)
    assert scaler.scale == 512.0
    scaler.update(overflow=False)
    assert scaler.scale == 1024.0
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 256.0  # never below min_scale
    state = scaler.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.scale == scaler.scale and other.clean_steps == scaler.clean_steps


@settings(max_examples=100, deadline=None)
@given(
    shards=st.lists(st.integers(min_value=1, max_value=10**7), min_size=1, max_size=40),
    depth=st.integers(0, 4),
    slots=st.integers(2, 5),
)
def test_nvme_host_budget_depends_on_the_largest_unit_not_the_model(shards, depth, slots):
    whole = 2**62  # a piece above every unit
    kwargs = dict(
        param_tier="nvme",
        optimizer_tier="nvme",
        compute_bytes=2,
        buffer_count=slots,
        prefetch_depth=depth,
        staged_device_copies=True,
    )
    # twice the units, same host bytes, whether the slots' piece is set or unset (shape_slots)
    for sub_group_size in (None, 1024, whole):
        budget = sum(host_budget_bytes(shards, **kwargs, sub_group_size=sub_group_size).values())
        doubled = sum(host_budget_bytes(shards + shards, **kwargs, sub_group_size=sub_group_size).values())
        assert budget == doubled
    largest = max(shards)
    # whole units in the slots (a piece above every unit): four fp32 states per slot, the fp32 gradient
    assert budget == slots * largest * 16 + 4 * largest + (depth + 2) * largest * 2 + 2 * largest * 2
    # pieces of at most sub_group_size elements: the slots no longer grow with the largest unit
    pieces = sum(host_budget_bytes(shards, **kwargs, sub_group_size=1024).values())
    piece = min(largest, 1024)
    assert pieces == slots * piece * 16 + 4 * piece + (depth + 2) * largest * 2 + 2 * largest * 2


def test_cpu_host_budget_counts_every_state():
    need = host_budget_bytes(
        [100, 200],
        param_tier="cpu",
        optimizer_tier="cpu",
        compute_bytes=2,
        buffer_count=3,
        prefetch_depth=2,
        staged_device_copies=False,
    )
    assert need == {"optimizer_state": 16 * 300, "param16": 2 * 300}


def test_adam_threads_are_shared_by_the_ranks_of_a_node():
    from offload.runtime.build import adam_threads

    assert adam_threads(16, {}) == 16
    assert adam_threads(16, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert adam_threads(2, {"LOCAL_WORLD_SIZE": "4"}) == 1


def test_adam_threads_leave_cpus_to_the_accelerator_s_threads_when_overlapped():
    """A step overlapping the accelerator leaves 2 CPUs of a rank to the kernel-launching main
    thread and the transfer worker, from 8 CPUs per rank on (below, every CPU steps)."""
    from offload.runtime.build import adam_threads

    assert adam_threads(16, {}, overlaps_accelerator=True) == 14
    assert adam_threads(16, {}, overlaps_accelerator=False) == 16
    assert adam_threads(32, {"LOCAL_WORLD_SIZE": "4"}, overlaps_accelerator=True) == 6
    assert adam_threads(7, {}, overlaps_accelerator=True) == 7
    assert adam_threads(2, {}, overlaps_accelerator=True) == 2


@settings(max_examples=300, deadline=None)
@given(
    units=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["cpu", "nvme", "device"])), max_size=10),
    room=st.integers(-(10**6), 10**8),
    speculate=st.booleans(),
    speculation_cap=st.none() | st.integers(0, 10**8),
    gradient_cap=st.none() | st.integers(0, 10**8),
)
def test_leftover_ram_spends_only_what_is_left_within_each_cap(units, room, speculate, speculation_cap, gradient_cap):
    """Spare states first, then gradients from what they leave: each within its cap, both
    together within the room; spare states only for units whose state is in RAM (and only when
    speculating), gradients only for units whose state streams from NVMe; and nothing is left
    that the next unit in each plan's order would have fitted in."""
    from offload.config.placement import OptimizerTier
    from offload.plan.optimizer_plan import gradient_bytes, plan_leftover_ram, spare_state_bytes

    numels = [n for n, _ in units]
    tiers = [OptimizerTier(t) for _, t in units]
    plan = plan_leftover_ram(
        numels, tiers, room=room, speculate=speculate, speculation_cap=speculation_cap, gradient_cap=gradient_cap
    )
    room = max(0, room)
    assert plan.spare_bytes == sum(spare_state_bytes(n) for n, c in zip(numels, plan.speculating) if c)
    assert plan.gradient_bytes == sum(gradient_bytes(n) for n, c in zip(numels, plan.gradients_in_ram) if c)
    assert plan.spare_bytes + plan.gradient_bytes <= room
    assert plan.spare_bytes <= (room if speculation_cap is None else speculation_cap)
    assert plan.gradient_bytes <= (room if gradient_cap is None else gradient_cap)
    assert speculate or not any(plan.speculating)
    for numel, tier, spare, gradient in zip(numels, tiers, plan.speculating, plan.gradients_in_ram):
        assert not spare or (tier is OptimizerTier.HOST and numel)
        assert not gradient or (tier.streamed and numel)
    # greedy: a streamed unit left out did not fit in what was left for gradients
    gradient_room = min(room - plan.spare_bytes, room if gradient_cap is None else gradient_cap)
    for numel, tier, gradient in zip(numels, tiers, plan.gradients_in_ram):
        if tier.streamed and numel and not gradient:
            assert gradient_bytes(numel) > gradient_room - plan.gradient_bytes
