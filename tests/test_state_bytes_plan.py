"""Compact optimizer state in the plan (plain logic, no torch): every byte count of optimizer
state takes a `StateBytes`; fp32 moments and gradient (`FP32_STATE`, every default) give the
numbers the 16 / 12 / 4 bytes-per-element constants gave, and bf16 / int8 moments or a 16-bit
gradient give fewer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config.placement import OptimizerTier
from offload.config.schema import load_config
from offload.config.sizes import round_up
from offload.config.state_layout import (
    FP32_STATE,
    STATE_KINDS,
    StateBytes,
    StatePrecision,
    int8_moment_bytes,
    state_bytes_for,
)
from offload.plan.budgets import host_budget_bytes
from offload.plan.optimizer_plan import (
    PAGE,
    Capacity,
    DiskTraffic,
    SlotShape,
    gradient_bytes,
    piece_bounds,
    plan_leftover_ram,
    plan_optimizer_tiers,
    shape_slots,
    slot_bytes,
    slot_bytes_for,
    spare_state_bytes,
    step_disk_traffic,
    swap_bytes_for_state,
    swap_file_bytes,
)

HOST, NVME = OptimizerTier.HOST, OptimizerTier.NVME
# fp32, bf16, int8 moments with the same gradient: each smaller than the one before
ORDER = (StatePrecision.FP32, StatePrecision.BF16, StatePrecision.INT8)
gradients = st.sampled_from([2, 4])


def states(gradient: int) -> list[StateBytes]:
    return [StateBytes(precision, gradient) for precision in ORDER]


@settings(max_examples=80, deadline=None)
@given(numel=st.integers(0, 10**6), piece=st.integers(1024, 10**6), gradient=gradients)
def test_fp32_counts_what_the_old_constants_did_and_compact_state_counts_less(numel, piece, gradient):
    # fp32 moments and gradient: 16 bytes per element, 12 of them stepped, 4 the gradient
    assert FP32_STATE.total_bytes(numel) == 16 * numel and FP32_STATE.stepped_bytes(numel) == 12 * numel
    assert slot_bytes(SlotShape(piece=piece, count=3)) == 3 * 16 * piece + 4 * piece
    assert swap_bytes_for_state(numel, piece) == sum(4 * swap_file_bytes(4 * (e - s)) for s, e in piece_bounds(numel, piece))
    assert spare_state_bytes(numel) == 3 * round_up(4 * numel, PAGE)
    assert gradient_bytes(numel) == round_up(4 * numel, PAGE)
    # each precision takes at most the one before; from two elements on, strictly less
    fp32, bf16, int8 = states(gradient)
    for count in (
        lambda s: s.total_bytes(numel),
        lambda s: s.stepped_bytes(numel),
        lambda s: slot_bytes(SlotShape(piece=piece, count=3), s),
        lambda s: swap_bytes_for_state(numel, piece, s),
        lambda s: spare_state_bytes(numel, s),
        lambda s: step_disk_traffic(numel, piece, s).total,
    ):
        assert count(fp32) >= count(bf16) >= count(int8)
    if numel >= 2:
        assert fp32.total_bytes(numel) > bf16.total_bytes(numel) > int8.total_bytes(numel)
    # the gradient's own counts follow its width, whatever the moments
    assert gradient_bytes(numel, int8) == round_up(gradient * numel, PAGE)


def test_bytes_per_kind_of_each_precision():
    int8 = StateBytes(StatePrecision.INT8, 2)
    # 100 elements: 100 codes and 4 exponent bytes per moment
    assert int8_moment_bytes(100) == 104
    assert [int8.kind_bytes(kind, 100) for kind in STATE_KINDS] == [400, 104, 104, 200]
    assert int8.total_bytes(100) == 808 and int8.stepped_bytes(100) == 608
    assert StateBytes(StatePrecision.BF16, 4).total_bytes(100) == 400 + 200 + 200 + 400
    assert StateBytes(StatePrecision.INT8, 2).per_element == pytest.approx(4 + 2 * (1 + 1 / 32) + 2)
    # the slots: `count` pieces of every kind, and the transfer worker's gradient piece
    assert slot_bytes(SlotShape(piece=1024, count=3), int8) == 3 * int8.total_bytes(1024) + 2 * 1024
    assert slot_bytes_for(10**6, 2, 1024, int8) == 2 * int8.total_bytes(1024) + 2 * 1024
    # a swap file per kind and piece, each as wide as its kind
    assert swap_bytes_for_state(2048, 1024, int8) == 2 * sum(
        swap_file_bytes(b) for b in (4096, int8_moment_bytes(1024), int8_moment_bytes(1024), 2048)
    )
    assert swap_bytes_for_state(2048, 1024, int8, kinds=("grad32",)) == 2 * swap_file_bytes(2048)
    assert spare_state_bytes(100, int8) == 3 * PAGE
    assert spare_state_bytes(10**6, int8) == round_up(4 * 10**6, PAGE) + 2 * round_up(int8_moment_bytes(10**6), PAGE)


def test_disk_traffic_per_step():
    """A streamed unit's step reads and writes the master and moments; its gradient, when it is
    on NVMe, is written in backward (again, after a read, for each further micro-batch) and read
    by the step."""
    n = 1 << 20  # whole pages: the counts are the bytes per element times n
    assert step_disk_traffic(n, n) == DiskTraffic(read=16 * n, written=16 * n)
    assert step_disk_traffic(n, n, gradient_in_ram=True) == DiskTraffic(read=12 * n, written=12 * n)
    assert step_disk_traffic(n, n, accumulation_steps=3) == DiskTraffic(read=(12 + 3 * 4) * n, written=(12 + 3 * 4) * n)
    int8 = StateBytes(StatePrecision.INT8, 2)
    moments = 2 * round_up(int8_moment_bytes(n), PAGE)
    assert step_disk_traffic(n, n, int8) == DiskTraffic(read=4 * n + moments + 2 * n, written=4 * n + moments + 2 * n)
    # in pieces, each piece's files in whole pages
    assert step_disk_traffic(3000, 1024).read == sum(4 * round_up(4 * (e - s), PAGE) for s, e in piece_bounds(3000, 1024))
    assert (DiskTraffic(1, 2) + DiskTraffic(3, 4)).total == 10


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 50_000), min_size=1, max_size=8),
    tiers=st.lists(st.sampled_from([HOST, NVME, OptimizerTier.DEVICE]), min_size=8, max_size=8),
    gradient=gradients,
    sub_group_size=st.sampled_from([1024, 5000, None]),
)
def test_host_budget_follows_the_state(numels, tiers, gradient, sub_group_size):
    """host_budget_bytes: the default is FP32_STATE's (16 bytes per resident element, 16 per slot
    element and 4 for the gradient slot); a compact state's resident state, slots and gradient
    slot are its own counts, never more."""
    tiers = tiers[: len(numels)]
    kwargs = dict(
        param_tier="cpu",
        optimizer_tier=tiers,
        compute_bytes=2,
        buffer_count=None,
        prefetch_depth=2,
        staged_device_copies=True,
        sub_group_size=sub_group_size,
    )
    default = host_budget_bytes(numels, **kwargs)
    assert default == host_budget_bytes(numels, **kwargs, state=FP32_STATE)
    resident = [n for n, tier in zip(numels, tiers) if tier is HOST]
    streamed = [n for n, tier in zip(numels, tiers) if tier is NVME]
    if sum(resident):
        assert default["optimizer_state"] == 16 * sum(resident)
    if streamed:
        shape = shape_slots(streamed, buffer_count=None, sub_group_size=sub_group_size)
        assert default["optimizer_slots"] == shape.count * 16 * shape.piece and default["grad_slot"] == 4 * shape.piece
    budgets = [host_budget_bytes(numels, **kwargs, state=state) for state in states(gradient)]
    for bigger, smaller in zip(budgets, budgets[1:]):
        assert set(bigger) == set(smaller)
        assert all(smaller[use] <= bigger[use] for use in bigger)
    int8 = states(gradient)[2]
    if sum(resident):
        assert budgets[2]["optimizer_state"] == sum(int8.total_bytes(n) for n in resident)
    if streamed:
        assert budgets[2]["grad_slot"] == gradient * shape.piece
    # what does not depend on the optimizer state does not change
    assert {k: v for k, v in budgets[2].items() if "optimizer" not in k and k != "grad_slot"} == {
        k: v for k, v in default.items() if "optimizer" not in k and k != "grad_slot"
    }


def test_auto_fits_more_units_in_ram_with_compact_state():
    """plan_optimizer_tiers needs `state.total_bytes` per unit: RAM for one fp32 unit beside its
    slots holds five with int8 moments and a 16-bit gradient (8.06 bytes per element), beside
    slots that are smaller too."""
    numels = [10**6] * 10
    order = list(range(10))
    slots = slot_bytes_for(10**6, 3, 1 << 20)
    assert slots == 52 * 10**6
    capacity = Capacity(device=0, host=slots + 16 * 10**6, nvme=10**12)
    fp32 = plan_optimizer_tiers(numels, order, capacity, buffer_count=3, sub_group_size=1 << 20)
    assert fp32 == plan_optimizer_tiers(numels, order, capacity, buffer_count=3, sub_group_size=1 << 20, state=FP32_STATE)
    assert fp32.tiers == [HOST] + [NVME] * 9 and fp32.bytes_by_tier["cpu"] == 16 * 10**6
    int8 = StateBytes(StatePrecision.INT8, 2)
    unit = int8.total_bytes(10**6)
    assert unit == 8_062_500
    compact = plan_optimizer_tiers(numels, order, capacity, buffer_count=3, sub_group_size=1 << 20, state=int8)
    assert compact.slot_bytes == slot_bytes_for(10**6, 3, 1 << 20, int8) == 3 * unit + 2 * 10**6
    assert compact.tiers == [HOST] * 5 + [NVME] * 5  # (68 MB - 26.2 MB of slots) // 8.06 MB
    assert compact.bytes_by_tier == {"cpu": 5 * unit, "nvme": 5 * unit}
    # everything in RAM: the compact state fits where fp32 did not
    room = Capacity(device=0, host=10 * int8.total_bytes(10**6), nvme=0)
    assert plan_optimizer_tiers(numels, order, room, buffer_count=3, sub_group_size=None, state=int8).tiers == [HOST] * 10


def test_leftover_ram_counts_spare_states_and_gradients_in_the_states_width():
    numels = [4096, 8192, 4096]
    bf16 = StateBytes(StatePrecision.BF16, 2)
    plan = plan_leftover_ram(
        numels, [HOST, NVME, NVME], room=10**9, speculate=True, speculation_cap=None, gradient_cap=None, state=bf16
    )
    assert plan.speculating == [True, False, False] and plan.gradients_in_ram == [False, True, True]
    assert plan.spare_bytes == spare_state_bytes(4096, bf16) == 4 * 4096 + 2 * 2 * 4096
    assert plan.gradient_bytes == gradient_bytes(8192, bf16) + gradient_bytes(4096, bf16) == 2 * (8192 + 4096)
    default = plan_leftover_ram(numels, [HOST, NVME, NVME], room=10**9, speculate=True, speculation_cap=None, gradient_cap=None)
    assert (default.spare_bytes, default.gradient_bytes) == (12 * 4096, 4 * (8192 + 4096))


@pytest.mark.parametrize(
    "mapping, compute_bytes, expected",
    [
        ({}, 2, StateBytes(StatePrecision.FP32, 2)),  # bf16 compute, one micro-batch per step: a 16-bit gradient
        ({"precision": "fp32"}, 4, FP32_STATE),
        ({"gradient_accumulation_steps": 2}, 2, FP32_STATE),  # added into: fp32
        ({"optimizer": {"gradient_precision": "fp32"}}, 2, FP32_STATE),
        ({"optimizer": {"state_precision": "int8"}}, 2, StateBytes(StatePrecision.INT8, 2)),
        ({"optimizer": {"state_precision": "bf16"}, "gradient_accumulation_steps": 4}, 2, StateBytes(StatePrecision.BF16, 4)),
    ],
)
def test_state_bytes_for_a_config(mapping, compute_bytes, expected):
    assert state_bytes_for(load_config(mapping), compute_bytes) == expected
