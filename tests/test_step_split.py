"""Overlap `auto`'s split of the step between the CPU and the device (plan/step_split.py, the cost
model, tested directly; runtime/device_step.py, the device lane).

The device's step is the C++ kernel's arithmetic in torch (optim/moments.adam_step_torch), so a
run whose units step on the device is bit for bit the run where the CPU steps them all: the
reference is overlap 'none'. `OFFLOAD_STEP_RATES` declares the rates (and a backward's seconds)
the split is chosen from, on any device; `offload.max_device_memory` bounds its copies. The
module runs on the plain CPU and, in `make test`, on the checked device, which checks the lane's
orderings (its copies up and down, the exact step on the optimizer stream)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import TinyNet, batches, mse
from test_speculative_step import assert_same, median_norm

import offload
from offload.plan.step_split import (
    StepRates,
    StepWindow,
    candidates_for,
    forward_stall,
    parse_rates,
    plan_split,
    predicted_step,
    step_finishes,
    step_traffic,
)
from offload.runtime.device_step import WRITE_BACK_PIECES

TRAFFIC = step_traffic(moment_bytes=4, grad_bytes=2, compute_bytes=2, param_offloaded=False)
# TinyNet's blocks step in about 0.6 s each on a CPU this slow (the device three times faster),
# against a backward of 1 ms: the model sends the root, unit 1 and the last two blocks to the
# device and the block between them to the CPU (a split that is not a prefix)
SLOW_CPU = "cpu=0.00001,device=0.00003,h2d=10,d2h=10,backward=0.001"


# ---- the cost model (plain functions) ------------------------------------------------------
def test_no_device_apart_from_the_cpu_splits_nothing():
    split = plan_split([10, 20, 30], [True] * 3, None, TRAFFIC, device_memory=10**9)
    assert split.on_device == (False, False, False) and split.reasons


def test_the_split_balances_the_two_workers_without_a_backward():
    numels = [10**8] * 10
    equal = StepRates(cpu_adam_gparams=1.0, device_adam_gparams=1.0, h2d_gbps=1000.0, d2h_gbps=1000.0)
    split = plan_split(numels, [True] * 10, equal, TRAFFIC, device_memory=10**12)
    assert split.on_device == (True,) * 5 + (False,) * 5  # the first half (the last to land)
    assert split.cpu_seconds == pytest.approx(0.5) and split.device_seconds == pytest.approx(0.5)


def test_device_memory_bounds_the_split():
    numels = [10**8] * 10
    rates = StepRates(1.0, 100.0, 1000.0, 1000.0)
    room = int(3.5 * 10**8 * TRAFFIC.device_memory)
    split = plan_split(numels, [True] * 10, rates, TRAFFIC, device_memory=room)
    assert split.device_units == 3 and "device memory" in split.reasons
    assert candidates_for(numels, [True] * 10, TRAFFIC, room) == [True] * 3 + [False] * 7


def test_parse_rates_reads_the_declaration_and_refuses_what_it_cannot():
    rates, backward = parse_rates("cpu=5,device=6,h2d=48,d2h=40,backward=0.8")
    assert rates == StepRates(5.0, 6.0, 48.0, 40.0) and backward == 0.8
    assert parse_rates("cpu=5,device=6,h2d=48,d2h=40")[1] is None
    with pytest.raises(ValueError, match="d2h missing"):
        parse_rates("cpu=5,device=6,h2d=48")
    with pytest.raises(ValueError, match="expected cpu="):
        parse_rates("cpu=5,gpu=6,h2d=48,d2h=48")
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        parse_rates("cpu=0,device=6,h2d=48,d2h=48")


positive = st.floats(min_value=0.01, max_value=100.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=12),
    eligible=st.lists(st.booleans(), min_size=12, max_size=12),
    cpu=positive,
    device=positive,
    link=positive,
    memory=st.integers(min_value=0, max_value=10**11),
    backward=st.one_of(st.none(), st.floats(min_value=0.01, max_value=10.0)),
    window=st.sampled_from(StepWindow),
    stale=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_the_split_fits_and_no_prefix_or_single_change_is_faster(
    numels, eligible, cpu, device, link, memory, backward, window, stale
):
    """The device takes eligible units that fit its memory together, from the front of the
    forward order while they fit. Without a backward: the prefix that balances the two workers.
    With one: no prefix, and no unit added, taken off or moved to a neighbouring candidate, is
    predicted faster (the search's local optimum), for every kind of window."""
    eligible, stale = eligible[: len(numels)], stale[: len(numels)]
    rates = StepRates(cpu, device, link, link)
    split = plan_split(
        numels, eligible, rates, TRAFFIC, device_memory=memory, backward_seconds=backward, window=window, stale=stale
    )
    order = [i for i, n in enumerate(numels) if eligible[i] and n]
    fits = [i for k, i in enumerate(order) if sum(numels[j] for j in order[: k + 1]) * TRAFFIC.device_memory <= memory]
    chosen = [i for i, on in enumerate(split.on_device) if on]
    assert set(chosen) <= set(fits)
    assert split.device_bytes <= memory

    def score(units) -> float:
        trial = [i in units for i in range(len(numels))]
        if backward is None:
            on_device = sum(numels[i] for i in units)
            cpu_s = (sum(numels) - on_device) / (cpu * 1e9)
            d2h = (on_device * TRAFFIC.device_d2h + sum(numels) * TRAFFIC.base_d2h) / (link * 1e9)
            h2d = (on_device * TRAFFIC.device_h2d + (sum(numels) - on_device) * TRAFFIC.cpu_h2d) / (link * 1e9)
            device_s = max(h2d, d2h, on_device / (device * 1e9)) if on_device else 0.0
            return max(cpu_s, device_s)
        return predicted_step(numels, trial, rates, TRAFFIC, backward, window, stale)

    got = score(chosen)
    prefixes = [fits[:k] for k in range(len(fits) + 1)]
    if backward is None:
        assert chosen in prefixes
        assert got == pytest.approx(min(score(p) for p in prefixes), rel=1e-12, abs=1e-15)
        return
    changes = [set(chosen) ^ {i} for i in fits]
    for k, i in enumerate(fits):
        if i in chosen:
            changes += [(set(chosen) - {i}) | {j} for j in fits[max(0, k - 1) : k + 2] if j not in chosen]
    assert got <= min(score(units) for units in [*prefixes, *changes]) * (1 + 1e-9) + 1e-12


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=10), slow=positive, fast=positive)
def test_a_faster_device_never_gets_fewer_units(numels, slow, fast):
    slow, fast = sorted((slow, fast))
    count = [
        plan_split(numels, [True] * len(numels), StepRates(1.0, rate, 1e6, 1e6), TRAFFIC, device_memory=10**13).device_units
        for rate in (slow, fast)
    ]
    assert count[0] <= count[1]


FAST_LINK = step_traffic(moment_bytes=4, grad_bytes=0, compute_bytes=0, param_offloaded=False)


def test_each_worker_steps_the_landed_unit_the_forward_needs_first():
    """Three units of 1e9 elements, a backward of 1 s (the root's head first: a third of it):
    unit 2 lands at 2/3 s, unit 1 and the root at 1 s; the CPU steps one a second. Once unit 2 is
    done (5/3 s), units 1 and 0 have landed and the root goes first: the forward needs it first
    (first come, first served would step unit 1 first, and the forward would wait for the root
    until 11/3 s)."""
    rates = StepRates(cpu_adam_gparams=1.0, device_adam_gparams=2.0, h2d_gbps=1e6, d2h_gbps=1e6)
    numels = [10**9] * 3
    ready = step_finishes(numels, [False] * 3, rates, FAST_LINK, 1.0)
    assert ready == pytest.approx([8 / 3, 11 / 3, 5 / 3])
    # the root on the device (half a second): the CPU steps the two blocks as they land
    assert step_finishes(numels, [True, False, False], rates, FAST_LINK, 1.0) == pytest.approx([1.5, 8 / 3, 5 / 3])
    # the next forward starts at 1 s and needs unit 1 at once, unit 2 after half a second / 2
    assert forward_stall(numels, [8 / 3, 11 / 3, 5 / 3], 1.0) == pytest.approx(11 / 3 - 1)
    assert forward_stall(numels, [0.5, 0.5, 0.5], 1.0) == 0.0


def test_a_window_that_does_not_speculate_steps_every_unit_once_the_norm_is_known():
    """The units of test_each_worker_steps_the_landed_unit_the_forward_needs_first: the last
    gradient lands at 1 s, and nothing steps before (the global norm is known then); the CPU
    then steps them in forward order, one a second. With the root on the device (half a
    second) the CPU starts at unit 1. In a window redone, a unit that speculated on the device
    loads its state first (12 bytes an element over 12 GB/s: a second more)."""
    rates = StepRates(cpu_adam_gparams=1.0, device_adam_gparams=2.0, h2d_gbps=1e6, d2h_gbps=1e6)
    numels = [10**9] * 3
    after = StepWindow.AFTER_BACKWARD
    assert step_finishes(numels, [False] * 3, rates, FAST_LINK, 1.0, after) == pytest.approx([2.0, 3.0, 4.0])
    assert step_finishes(numels, [True, False, False], rates, FAST_LINK, 1.0, after) == pytest.approx([1.5, 2.0, 3.0])
    # the forward needs unit 2 at 1.25 s and waits for it until 4 s; its last quarter second then
    assert predicted_step(numels, [False] * 3, rates, FAST_LINK, 1.0, after) == pytest.approx(4.25)
    slow_up = StepRates(cpu_adam_gparams=1.0, device_adam_gparams=2.0, h2d_gbps=12.0, d2h_gbps=1e6)
    redone = step_finishes(numels, [True, False, False], slow_up, FAST_LINK, 1.0, StepWindow.REDONE, [True, False, False])
    assert redone == pytest.approx([2.5, 2.0, 3.0])
    # the device's units alone speculate (no spare state in RAM): unit 2 as it lands (2/3 s),
    # then the root; the CPU's unit 1 once the norm is known
    only_device = step_finishes(numels, [True, False, True], rates, FAST_LINK, 1.0, StepWindow.DEVICE_SPECULATIVE)
    assert only_device == pytest.approx([5 / 3, 2.0, 7 / 6])


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=10),
    chosen=st.lists(st.booleans(), min_size=10, max_size=10),
    cpu=positive,
    device=positive,
    link=positive,
    backward=st.floats(min_value=0.01, max_value=10.0),
)
def test_what_does_not_speculate_steps_after_the_last_gradient_landed(numels, chosen, cpu, device, link, backward):
    """In a window that does not speculate every unit is ready no sooner than the last gradient
    landed plus its own Adam; where only the device's units speculate, so is every CPU unit."""
    chosen = chosen[: len(numels)]
    rates = StepRates(cpu, device, link, link)
    # the root's gradients are final last, once the backward is done (the global norm no sooner;
    # with no elements at all, nothing to wait for)
    landed = backward if sum(numels) else 0.0
    for window in (StepWindow.AFTER_BACKWARD, StepWindow.REDONE, StepWindow.DEVICE_SPECULATIVE):
        ready = step_finishes(numels, chosen, rates, TRAFFIC, backward, window)
        for index, numel in enumerate(numels):
            if window is StepWindow.DEVICE_SPECULATIVE and chosen[index]:
                continue
            own = numel / ((device if chosen[index] else cpu) * 1e9)
            assert ready[index] >= (landed + own) * (1 - 1e-9)


def test_a_window_that_does_not_speculate_gives_the_device_a_larger_share_at_7b():
    """The 7B step at the H100 hosts' rates when clipping acts (speculation paused): every unit
    steps after the backward. The split planned for that window gives the device far more of
    the step than the speculating window's (which leaves the CPU most of it) and is predicted
    much faster there; the one for a window redone is in between (the units that speculated on
    the device load their state again first)."""
    numels = [262_148_096] + [202_383_360] * 32
    traffic = step_traffic(moment_bytes=4, grad_bytes=2, compute_bytes=2, param_offloaded=False)
    rates = StepRates(5.0, 6.0, 48.0, 48.0)
    memory = int(15.5 * numels[1] * traffic.device_memory + numels[0] * traffic.device_memory)
    backward = 0.8345

    def plan(window, stale=None):
        return plan_split(
            numels, [True] * 33, rates, traffic, device_memory=memory, backward_seconds=backward, window=window, stale=stale
        )

    speculative = plan(StepWindow.SPECULATIVE)
    after = plan(StepWindow.AFTER_BACKWARD)
    redone = plan(StepWindow.REDONE, speculative.on_device)
    assert after.device_units >= 3 * speculative.device_units
    assert speculative.device_units < redone.device_units < after.device_units + 1

    def step(split, window, stale=None):
        return predicted_step(numels, split.on_device, rates, traffic, backward, window, stale)

    assert step(after, StepWindow.AFTER_BACKWARD) < 0.8 * step(speculative, StepWindow.AFTER_BACKWARD)
    stale = speculative.on_device
    assert step(redone, StepWindow.REDONE, stale) < 0.9 * step(speculative, StepWindow.REDONE, stale)


def test_the_split_of_a_7b_step_is_the_root_on_the_device_and_the_blocks_after_it_on_the_cpu():
    """A 7B Llama at the H100 hosts' rates (CPU Adam 5, exact device Adam 6 Gparams/s, PCIe 48
    GB/s, a backward of 0.83 s, 15 units' copies fit): the best split is not a prefix of the
    forward order. The device steps the root (it lands last and is needed first); the CPU, which
    steps the blocks that land last first, gets the first blocks after it. Predicted within a
    tenth of the compute; the best prefix is predicted slower."""
    numels = [262_148_096] + [202_383_360] * 32
    traffic = step_traffic(moment_bytes=4, grad_bytes=2, compute_bytes=2, param_offloaded=False)
    rates = StepRates(5.0, 6.0, 48.0, 48.0)
    memory = int(15.5 * numels[1] * traffic.device_memory + numels[0] * traffic.device_memory)
    split = plan_split(numels, [True] * 33, rates, traffic, device_memory=memory, backward_seconds=0.8345)
    chosen = [i for i, on in enumerate(split.on_device) if on]
    assert chosen[0] == 0 and chosen != list(range(len(chosen))), chosen
    step = predicted_step(numels, split.on_device, rates, traffic, 0.8345)
    assert step < 1.1 * 1.5 * 0.8345
    prefixes = [predicted_step(numels, [i < k for i in range(33)], rates, traffic, 0.8345) for k in range(17)]
    assert step < min(prefixes)


# ---- the engine: bit for bit the CPU's training ----------------------------------------------
def make_config(swap_dir, overlap=None, *, param="none", precision="fp32", clip=0.0, state="fp32"):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "state_precision": state},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap_dir, "max_device_memory": "1GB"},
        "gradient_clipping": clip,
    }
    if overlap is not None:
        config["overlap"] = overlap
    return config


def train(model, config, data, *, save_at=None, tmp_path=None):
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        on_device = [unit.steps_on_device for unit in engine.units]
        for i, (x, y) in enumerate(data):
            engine.backward(mse(engine, x, y))
            engine.step()
            if save_at == i:
                engine.save_checkpoint(tmp_path / "ckpt")
        return engine.consolidated_state_dict(), engine.optimizer.state_dict()["state"], on_device
    finally:
        engine.close()


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for name, value in a[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key][name])), (key, name)


@pytest.mark.parametrize("param", ["none", "cpu"])
@pytest.mark.parametrize("precision,clip", [("fp32", 0.0), ("fp32", 1e-3), ("bf16", 0.0), ("bf16", 1e-3)])
def test_a_split_step_trains_bit_for_bit_as_the_cpu(swap_dir, monkeypatch, param, precision, clip):
    monkeypatch.setenv("OFFLOAD_STEP_RATES", SLOW_CPU)
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(5)
    expected, expected_state, none_on_device = train(
        model, make_config(swap_dir, "none", param=param, precision=precision, clip=clip), data
    )
    state, optimizer_state, on_device = train(model, make_config(swap_dir, param=param, precision=precision, clip=clip), data)
    assert not any(none_on_device)  # explicit overlap values keep today's schedule: no split
    assert on_device[0] and any(on_device) and not all(on_device)  # the root (the last to land) is on the device
    assert_same(state, expected)
    assert_same_optimizer_state(optimizer_state, expected_state)  # the host state is home again


# the splits differ by window: speculating, the device steps unit 1 alone (the CPU keeps up
# with the rest during the backward); after the backward, units 1 and 2; redone, units 1 to 3
WINDOWS_DIFFER = "cpu=0.00003,device=0.00006,h2d=10,d2h=10,backward=1"


@pytest.mark.parametrize("param", ["none", "cpu"])
@pytest.mark.parametrize("clipping", ["always", "sometimes"])
def test_windows_whose_clipping_acts_switch_split_bit_for_bit(swap_dir, monkeypatch, param, clipping):
    """Clipping that acts redoes the speculative window (under the split for a window redone)
    and pauses speculation (the windows after it under the split for windows that step after
    the backward), then speculates again under its own split: units change lanes between
    windows, their state in RAM either way, and the training is overlap 'none''s bit for bit."""
    monkeypatch.setenv("OFFLOAD_STEP_RATES", WINDOWS_DIFFER)
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(7)
    clip = 1e-3 if clipping == "always" else median_norm(model, swap_dir, data)
    expected, expected_state, _ = train(model, make_config(swap_dir, "none", param=param, clip=clip), data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param=param, clip=clip))
    try:
        splits = set()
        for x, y in data:
            engine.backward(mse(engine, x, y))
            splits.add(tuple(unit.steps_on_device for unit in engine.units))
            engine.step()
            splits.add(tuple(unit.steps_on_device for unit in engine.units))
        assert engine.speculation_counts["redone"] >= 2
        state, optimizer_state = engine.consolidated_state_dict(), engine.optimizer.state_dict()["state"]
    finally:
        engine.close()
    # speculating, after the backward, redone
    assert {(False, True, False, False, False), (False, True, True, False, False), (False, True, True, True, False)} <= splits
    assert_same(state, expected)
    assert_same_optimizer_state(optimizer_state, expected_state)


def test_the_device_lane_sends_new_states_down_on_its_writer_thread(swap_dir, monkeypatch):
    """With speculation paused the lane steps its units after the backward, one after the other:
    each one's new state goes down (piece by piece) on the writer thread while the lane steps
    the next, not on the lane after all of them."""
    monkeypatch.setenv("OFFLOAD_STEP_RATES", WINDOWS_DIFFER)
    monkeypatch.setenv("OFFLOAD_CHECKED_RECORD", "1")
    torch.manual_seed(0)
    with offload.initialize(TinyNet(depth=4), make_config(swap_dir, clip=1e-3), device="checked") as engine:
        for x, y in batches(3):
            engine.backward(mse(engine, x, y))
            engine.step()
        engine.consolidated_state_dict()  # (every write settled)
        timeline = list(engine.device.timeline)
    down = [e for e in timeline if e["type"] == "op" and e["what"].startswith("state of unit") and e["what"].endswith("host")]
    assert len(down) >= 3 * WRITE_BACK_PIECES
    assert {e["thread"].split("_")[0] for e in down} == {"offload-device-write-back"}


def test_without_spare_state_the_device_alone_speculates_under_its_own_split(swap_dir, monkeypatch, caplog):
    """`offload.speculation_memory: 0`: no unit on the CPU can speculate; the split is planned for
    windows where only the device's units do (here units 1 to 3), and the training is the same."""
    monkeypatch.setenv("OFFLOAD_STEP_RATES", WINDOWS_DIFFER)
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(4)
    expected, expected_state, _ = train(model, make_config(swap_dir, "none", clip=1e6), data)
    config = make_config(swap_dir, clip=1e6)
    config["offload"]["speculation_memory"] = 0
    with caplog.at_level("INFO", logger="offload"):
        state, optimizer_state, on_device = train(model, config, data)
    assert on_device == [False, True, True, True, False]
    assert any("speculate on the device only" in r.getMessage() for r in caplog.records)
    assert_same(state, expected)
    assert_same_optimizer_state(optimizer_state, expected_state)


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_compact_moments_step_on_the_device_bit_for_bit(swap_dir, monkeypatch, state):
    monkeypatch.setenv("OFFLOAD_STEP_RATES", SLOW_CPU)
    torch.manual_seed(0)
    model = TinyNet(width=64, depth=3)
    data = batches(4)
    expected, expected_state, _ = train(model, make_config(swap_dir, "none", precision="bf16", state=state), data)
    got, optimizer_state, on_device = train(model, make_config(swap_dir, precision="bf16", state=state), data)
    assert any(on_device)
    assert_same(got, expected)
    assert_same_optimizer_state(optimizer_state, expected_state)


def test_a_checkpoint_of_a_split_run_resumes_exactly(swap_dir, monkeypatch, tmp_path):
    """The save reads the host state (every state the device stepped is home first); the load
    replaces it, and the device's copies load again before their next step."""
    monkeypatch.setenv("OFFLOAD_STEP_RATES", SLOW_CPU)
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(6)
    config = make_config(swap_dir, clip=0.05)
    straight, _, _ = train(model, config, data, save_at=2, tmp_path=tmp_path)
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        assert any(unit.steps_on_device for unit in engine.units)
        for x, y in data[:1]:  # steps that the load replaces
            engine.backward(mse(engine, x, y))
            engine.step()
        engine.load_checkpoint(tmp_path / "ckpt")
        for x, y in data[3:]:
            engine.backward(mse(engine, x, y))
            engine.step()
        assert_same(engine.consolidated_state_dict(), straight)
    finally:
        engine.close()


def test_measured_backwards_plan_the_split_again_once(swap_dir, monkeypatch, caplog):
    """Rates declared without a backward's seconds: the split is the balance at start, then
    planned again from the second backward that ended a window; the training is the same."""
    monkeypatch.setenv("OFFLOAD_STEP_RATES", "cpu=0.00001,device=0.00001,h2d=10,d2h=10")
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(5)
    expected, _, _ = train(model, make_config(swap_dir, "none"), data)
    with caplog.at_level("INFO", logger="offload"):
        state, _, at_start = train(model, make_config(swap_dir), data)
    planned = [r.getMessage() for r in caplog.records if "units step on the device" in r.getMessage()]
    assert len(planned) == 2 and "chosen for a backward of" in planned[1], planned
    assert any(at_start)
    assert_same(state, expected)


def test_the_device_copies_are_in_the_ledger(swap_dir, monkeypatch):
    monkeypatch.setenv("OFFLOAD_STEP_RATES", SLOW_CPU)
    engine = offload.initialize(TinyNet(depth=3), make_config(swap_dir))
    try:
        copies = engine.memory_report()["device"]["by_category"]["step_state"]["current"]
        on_device = [unit for unit in engine.units if unit.steps_on_device]
        # master and fp32 moments, the 16-bit gradient (bf16 compute keeps it 16-bit; fp32 here: 4)
        assert on_device and copies >= sum(16 * unit.optimizer_numel for unit in on_device)
    finally:
        engine.close()


# ---- on a GPU -------------------------------------------------------------------------------
@pytest.mark.cuda
def test_on_cuda_the_rates_are_measured_and_the_split_is_exact(swap_dir, monkeypatch):
    """The next GPU session: the probe measures four finite rates, and a split forced by declared
    rates trains bit for bit as overlap 'none' on the same GPU."""
    from offload.config.state_layout import StateBytes, StatePrecision
    from offload.platform.device import Device
    from offload.runtime.step_rates import measure_rates
    from offload.storage.state_codec import make_codec

    codec = make_codec(StateBytes(StatePrecision.FP32, 2), torch.bfloat16, 0)
    rates = measure_rates(Device(), codec, torch.bfloat16)
    assert all(
        math.isfinite(v) and v > 0 for v in (rates.cpu_adam_gparams, rates.device_adam_gparams, rates.h2d_gbps, rates.d2h_gbps)
    )
    monkeypatch.setenv("OFFLOAD_STEP_RATES", SLOW_CPU)
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(4)
    expected, _, _ = train(model, make_config(swap_dir, "none", precision="bf16", clip=0.05), data)
    got, _, on_device = train(model, make_config(swap_dir, precision="bf16", clip=0.05), data)
    assert any(on_device)
    assert_same(got, expected)


# ---- offload estimate ---------------------------------------------------------------------------
def test_estimate_says_the_schedule_the_split_and_the_predicted_step(capsys, tmp_path):
    import json

    from offload.cli import main as cli_main

    args = ["estimate", "7B", "--gpu-memory", "80GB", "--ram", "512GiB", "--disk", "2TB", "--nvme-path", str(tmp_path)]
    args += ["--micro-batch", "8", "--seq-len", "1024", "--step-rates", "cpu=5,device=6,h2d=48,d2h=48"]
    assert cli_main([*args, "--device-tflops", "270", "--json"]) == 0
    schedule = json.loads(capsys.readouterr().out)["schedule"]
    assert schedule["overlap"] == "auto" and 0 < schedule["split"]["device_units"] < schedule["split"]["units"]
    assert schedule["compute_s"] < schedule["predicted_step_s"] < 2 * schedule["compute_s"]
    # while clipping acts, the split of the windows that step after the backward: more on the GPU
    assert schedule["paused"]["device_units"] > schedule["split"]["device_units"]
    assert schedule["predicted_step_s"] < schedule["paused"]["predicted_step_s"] < 2 * schedule["compute_s"]
    assert cli_main([*args, "--device-tflops", "270"]) == 0
    assert "while clipping acts" in capsys.readouterr().out
    assert cli_main(args) == 0  # no TFLOPS: the split, no predicted step
    out = capsys.readouterr().out
    assert "schedule: overlap auto, the best exact one" in out and "units step on the GPU" in out
    assert "predicted step" not in out
    assert (
        cli_main(
            [
                "estimate",
                "7B",
                "--gpu-memory",
                "80GB",
                "--ram",
                "512GiB",
                "--disk",
                "2TB",
                "--nvme-path",
                str(tmp_path),
                "--step-rates",
                "",
            ]
        )
        == 0
    )
    assert "chosen at start from the rates the engine measures there" in capsys.readouterr().out
