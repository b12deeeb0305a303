"""overlap 'backward' with clipping or fp16: units step speculatively during backward into a
spare state, and step() commits them or steps them again from the old state.

The reference is overlap 'none' on the same model, config and data: the speculative run must be
bitwise identical to it, whether clipping acts on no step, on every step or on some, in fp32 and
bf16, with activation checkpointing around units (torch.utils.checkpoint), over every param tier,
with only part of the units speculating (RAM), and in fp16 with an overflow; plain PyTorch with
clip_grad_norm_ checks the clipped run itself."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, mse, reference_run
from tier_caps import auto_config, shard_numels, split_caps
from torch.utils import checkpoint

import offload
from offload.config.placement import OptimizerTier
from offload.errors import OffloadError
from offload.plan.optimizer_plan import plan_speculation, spare_state_bytes


def make_config(swap_dir, overlap, *, param="cpu", optimizer="cpu", precision="fp32", clip=0.05, **extra):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
        "gradient_clipping": clip,
    }
    config.update(extra)
    return config


class CheckpointedNet(TinyNet):
    """TinyNet with every block run under torch.utils.checkpoint (non-reentrant): each unit's
    forward runs again inside backward, after the units above it stepped speculatively."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.out(h)


def run(model, config, data):
    """Trains; returns (final fp32 state dict, losses, grad norms, the engine's speculation counts)."""
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        losses, norms = [], []
        for x, y in data:
            loss = mse(engine, x, y)
            engine.backward(loss)
            assert engine.step()
            losses.append(loss.item())
            norms.append(engine.last_grad_norm)
        return engine.consolidated_state_dict(), losses, norms, dict(engine.speculation_counts)
    finally:
        engine.close()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bitwise equal: {different}"


def median_norm(model, swap_dir, data) -> float:
    """A clipping threshold between the run's gradient norms: some steps clip, others do not."""
    _, _, norms, _ = run(model, make_config(swap_dir, "none", clip=0.0), data)
    return sorted(norms)[len(norms) // 2]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("clipping", ["never", "always", "sometimes"])
@pytest.mark.parametrize("model_class", [TinyNet, CheckpointedNet])
def test_speculative_steps_equal_overlap_none_bitwise(swap_dir, precision, clipping, model_class):
    torch.manual_seed(0)
    model = model_class(depth=3)
    data = batches(8)
    clip = {"never": 1e6, "always": 1e-3, "sometimes": median_norm(model, swap_dir, data)}[clipping]
    expected, expected_losses, expected_norms, _ = run(model, make_config(swap_dir, "none", precision=precision, clip=clip), data)
    state, losses, norms, counts = run(model, make_config(swap_dir, "backward", precision=precision, clip=clip), data)
    assert_same(state, expected)
    assert losses == expected_losses
    assert norms == expected_norms
    clipped = sum(norm + 1e-6 > clip for norm in norms)
    assert counts == {"committed": len(data) - clipped, "redone": clipped, "skipped": 0, "refused": 0}
    if clipping == "sometimes":
        assert 0 < clipped < len(data)


def test_accumulation_windows_speculate_once_per_window(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(9, batch=8)

    def accumulate(overlap):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, overlap, clip=0.5, gradient_accumulation_steps=3))
        try:
            stepped = []
            for x, y in data:
                engine.backward(mse(engine, x, y))
                stepped.append(engine.step())
            return engine.consolidated_state_dict(), stepped, dict(engine.speculation_counts)
        finally:
            engine.close()

    expected, expected_stepped, _ = accumulate("none")
    state, stepped, counts = accumulate("backward")
    assert stepped == expected_stepped == [False, False, True] * 3
    assert sum(counts.values()) == 3
    assert_same(state, expected)


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_speculative_clipped_run_equals_clip_grad_norm(swap_dir, param):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(8)
    reference, reference_losses = reference_run(model, data, clip=0.05)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "backward", param=param, clip=0.05))
    try:
        losses = engine_run(engine, data)
        assert engine.speculation_counts["redone"] > 0  # clipping acted, the steps were redone
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
        assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    finally:
        engine.close()


def test_units_beyond_the_ram_for_spares_step_after_the_norm(swap_dir):
    """With RAM for only some spare states, the others step once the norm is known; exact."""
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = batches(6)
    clip = median_norm(model, swap_dir, data)
    probe = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "none", clip=clip))
    # room for the spare states of the two last blocks, not for a third
    needs = [spare_state_bytes(unit.optimizer_numel) for unit in probe.units]
    others = sum(probe.store.budget.values())
    probe.close()
    cap = others + 4096 * 64 + needs[-1] + needs[-2] + needs[-3] // 2
    expected, _, _, _ = run(model, make_config(swap_dir, "none", clip=clip), data)
    engine = offload.initialize(
        copy.deepcopy(model),
        make_config(
            swap_dir,
            "backward",
            clip=clip,
            offload={"param": "cpu", "optimizer": "cpu", "nvme_path": swap_dir, "max_host_memory": cap},
        ),
    )
    try:
        chosen = engine.store.speculating
        assert chosen[-2:] == [True, True] and not all(chosen), chosen
        assert [bool(unit.spare_state) for unit in engine.units] == chosen
        report = engine.memory_report()
        assert report["host"]["by_category"]["spare_state"]["current"] >= sum(n for n, c in zip(needs, chosen) if c)
        for x, y in data:
            engine.backward(mse(engine, x, y))
            engine.step()
        assert_same(engine.consolidated_state_dict(), expected)
    finally:
        engine.close()


@pytest.mark.parametrize("budget", ["none", "last block"])
def test_speculation_memory_caps_the_spare_states(swap_dir, budget):
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(4)
    probe = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "none"))
    last = spare_state_bytes(probe.units[-1].optimizer_numel)
    probe.close()
    cap = 0 if budget == "none" else last + 4096
    offload_config = {"param": "cpu", "optimizer": "cpu", "nvme_path": swap_dir, "speculation_memory": cap}
    expected, _, _, _ = run(model, make_config(swap_dir, "none", clip=1e-3, offload=offload_config), data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "backward", clip=1e-3, offload=offload_config))
    try:
        assert engine.store.speculating == [False] * 3 + [budget == "last block"]
        for x, y in data:
            engine.backward(mse(engine, x, y))
            engine.step()
        assert_same(engine.consolidated_state_dict(), expected)
        assert engine.speculation_counts["redone"] == (len(data) if budget == "last block" else 0)
    finally:
        engine.close()


def test_optimizer_auto_speculates_only_units_in_ram(swap_dir):
    """Units on NVMe (optimizer auto under a RAM cap) step after the norm; exact."""
    torch.manual_seed(0)
    model = TinyNet(width=256, depth=8)
    data = batches(4)
    shards = shard_numels(model)
    # units 0-2 in RAM, the blocks from 3 on NVMe (3 does not fit: 16 bytes per element), and
    # beside them room for the spare state of one block (12 bytes per element) and the pool's
    # page rounding
    _, host_cap = split_caps(model, "cpu", device_units=0, host_units=3)
    host_cap += 4 * shards[3] + 600_000
    config = auto_config(swap_dir, "cpu", "none", device_cap=0, host_cap=host_cap)
    config["gradient_clipping"] = 1e-3
    expected, _, _, _ = run(model, config, data)
    engine = offload.initialize(copy.deepcopy(model), {**config, "overlap": "backward"})
    try:
        tiers = [unit.optimizer_tier for unit in engine.units]
        assert tiers == [OptimizerTier.HOST] * 3 + [OptimizerTier.NVME] * 6, tiers
        # the last block in RAM speculates; no room for the one before it, none on NVMe
        assert engine.store.speculating[1:] == [False, True] + [False] * 6, engine.store.speculating
        for x, y in data:
            engine.backward(mse(engine, x, y))
            engine.step()
        assert engine.speculation_counts["redone"] == len(data)
        assert_same(engine.consolidated_state_dict(), expected)
    finally:
        engine.close()


class PoisonedHead(TinyNet):
    """TinyNet with one more root parameter that, when `poison` is set, gets a NaN gradient (d
    sqrt(u)/du at 0 is inf, times 0) while the loss and every other gradient stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.zeros(1))
        self.poison = False

    def forward(self, x):
        out = super().forward(x)
        return out + 0.0 * torch.sqrt(self.gate) if self.poison else out


def test_nonfinite_gradient_is_an_error_and_changes_nothing(swap_dir):
    """Speculative: no unit has stepped for good when the norm is not finite (without clipping,
    overlap 'backward' steps the finite units and says so)."""
    torch.manual_seed(0)
    model = PoisonedHead()
    trained = copy.deepcopy(model)
    engine = offload.initialize(trained, make_config(swap_dir, "backward", precision="bf16", clip=1.0))
    try:
        for x, y in batches(2):
            engine.backward(mse(engine, x, y))
            engine.step()
        before = engine.consolidated_state_dict()
        masters = [unit.resident_state["master"].clone() for unit in engine.units]
        x, y = batches(1, seed=5)[0]
        trained.poison = True
        engine.backward(mse(engine, x, y))
        trained.poison = False
        with pytest.raises(offload.NonFiniteError, match="weights are unchanged"):
            engine.step()
        # the blocks had stepped speculatively; they were taken back
        assert engine.speculation_counts["refused"] == 1
        assert_same(engine.consolidated_state_dict(), before)
        for unit, master in zip(engine.units, masters):
            assert torch.equal(unit.resident_state["master"], master)
        # and the 16-bit weights they published during backward were put back: the next forward
        # gives the output of a run that never saw the failed window
        output = engine(x).detach()
        engine.backward(mse(engine, x, y))  # training goes on
        engine.step()
        assert engine.global_steps == 3
    finally:
        engine.close()
    plain = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "none", precision="bf16", clip=1.0))
    try:
        for x1, y1 in batches(2):
            plain.backward(mse(plain, x1, y1))
            plain.step()
        assert torch.equal(plain(x).detach(), output)
    finally:
        plain.close()


def test_fp16_overflow_skips_the_step_and_restores_the_weights(swap_dir):
    torch.manual_seed(0)
    model = PoisonedHead()
    data = batches(6)

    def fp16_run(overlap):
        config = make_config(
            swap_dir, overlap, precision="fp16", clip=0.0, loss_scale={"initial": 1024.0, "growth_interval": 1000}
        )
        trained = copy.deepcopy(model)
        engine = offload.initialize(trained, config)
        stepped, weights = [], []
        try:
            for i, (x, y) in enumerate(data):
                before = engine.consolidated_state_dict()
                # one root gradient is not finite (the blocks' are, and step speculatively)
                trained.poison = i == 3
                engine.backward(mse(engine, x, y))
                stepped.append(engine.step())
                weights.append(engine.consolidated_state_dict())
                if i == 3:
                    assert_same(weights[-1], before)  # the 16-bit weights too: the next forward proves it
            return stepped, weights, engine.scaler.scale, dict(engine.speculation_counts), engine.units[1].step_count
        finally:
            engine.close()

    expected_stepped, expected_weights, expected_scale, _, expected_count = fp16_run("none")
    stepped, weights, scale, counts, count = fp16_run("backward")
    assert stepped == expected_stepped == [True, True, True, False, True, True]
    for got, want in zip(weights, expected_weights):
        assert_same(got, want)
    assert scale == expected_scale == 512.0
    assert counts == {"committed": 5, "redone": 0, "skipped": 1, "refused": 0}
    assert count == expected_count == 5


def test_a_forward_before_step_is_refused(swap_dir):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), make_config(swap_dir, "backward"))
    try:
        (x, y), (x2, y2) = batches(2)
        engine.backward(mse(engine, x, y))
        with pytest.raises(offload.OffloadError, match="engine.step"):
            engine(x2)
        assert engine.step()
        engine.backward(mse(engine, x2, y2))
        engine.step()
    finally:
        engine.close()


def traced_engine(swap_dir, *, clip, model=None):
    """A speculative engine on a 3-unit TinyNet whose schedule records its events."""
    torch.manual_seed(0)
    engine = offload.initialize(model or TinyNet(depth=2), make_config(swap_dir, "backward", clip=clip))
    engine.schedule.context.events.enabled = True
    return engine, engine.schedule.context.events


class CallsInBackward(TinyNet):
    """TinyNet whose input layer's backward (the root's, the last of backward) first calls
    `on_backward()`: a test's hook into backward after the blocks' gradients are final."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__(depth=depth)
        self.on_backward = lambda: None

    def forward(self, x):
        h = _CallInBackward.apply(self.inp(x), self)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class _CallInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, model):
        ctx.model = model
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        ctx.model.on_backward()
        return grad, None


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def raise_once(model: CallsInBackward) -> None:
    """The model's next backward fails (once), after the blocks' gradients are final."""

    def fail():
        model.on_backward = lambda: None
        raise RuntimeError("injected failure in backward")

    model.on_backward = fail


def test_event_order_speculate_during_backward_then_commit(swap_dir):
    model = CallsInBackward(depth=2)
    engine, events = traced_engine(swap_dir, clip=1e6, model=model)
    # the root's backward waits (at most 20 s) for block 2's speculative step: it happens
    # during backward, however fast the rest of backward is
    model.on_backward = lambda: wait_until(lambda: ("step_done", 2) in events.events)
    try:
        (x, y), (x2, y2) = batches(2)
        engine.backward(mse(engine, x, y))
        engine.step()
        engine(x2)
        stepped = events.take()
        # block 2 steps (speculatively) before the root's gradients are final, and every unit's
        # speculative step is done before step() commits them; none steps again
        assert stepped.index(("step_done", 2)) < stepped.index(("grads_final", 0)), stepped
        last_done = max(stepped.index(("step_done", unit)) for unit in range(3))
        assert last_done < min(stepped.index(("step_commit", unit)) for unit in range(3)), stepped
        assert [e for e in stepped if e[0] == "step_begin"] == [("step_begin", 2), ("step_begin", 1), ("step_begin", 0)]
        assert ("step_take_back", 2) not in stepped
    finally:
        engine.close()


def test_a_redo_runs_during_the_next_forward(swap_dir, slow_adam):
    """Clipping acts: step() takes the speculative steps back and submits every unit again; it
    returns at once, and the next forward starts while the last block is still stepping."""
    engine, events = traced_engine(swap_dir, clip=1e-3)
    try:
        (x, y), (x2, _) = batches(2)
        engine.backward(mse(engine, x, y))
        engine.step()
        events.record("step_returned", -1)
        engine(x2)
        stepped = events.take()
        returned = stepped.index(("step_returned", -1))
        take_back = stepped.index(("step_take_back", 2))
        assert take_back < stepped.index(("step_begin", 2), take_back) < returned, stepped
        assert ("step_commit", 2) not in stepped
        after = stepped[returned:]
        assert after.index(("pre_forward", 0)) < after.index(("step_done", 2)), after
    finally:
        engine.close()


def test_checkpoint_after_speculative_steps_resumes_exactly(swap_dir, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    clip = median_norm(model, swap_dir, data)
    config = make_config(swap_dir, "backward", clip=clip)
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        for x, y in data[:3]:
            engine.backward(mse(engine, x, y))
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        for x, y in data[3:]:
            engine.backward(mse(engine, x, y))
            engine.step()
        straight = engine.consolidated_state_dict()
    finally:
        engine.close()
    resumed = offload.initialize(copy.deepcopy(model), config)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        for x, y in data[3:]:
            resumed.backward(mse(resumed, x, y))
            resumed.step()
        assert_same(resumed.consolidated_state_dict(), straight)
    finally:
        resumed.close()


# ---- the plan (plain function) ------------------------------------------------------------


def test_plan_speculation_takes_the_last_units_first():
    host = OptimizerTier.HOST
    numels = [1000, 4096, 4096, 4096]
    one = spare_state_bytes(4096)
    assert plan_speculation(numels, [host] * 4, 2 * one) == [False, False, True, True]
    assert plan_speculation(numels, [host] * 4, 10**9) == [True] * 4
    assert plan_speculation(numels, [host, host, OptimizerTier.NVME, host], 10**9) == [True, True, False, True]
    assert plan_speculation(numels, [host] * 4, 0) == [False] * 4
    # a unit that does not fit is passed over; a smaller one after it is still taken
    assert plan_speculation([1000, 10**6, 4096], [host] * 3, one + spare_state_bytes(1000)) == [True, False, True]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(list(OptimizerTier))), max_size=12),
    st.integers(0, 4 * 10**7),
)
def test_plan_speculation_properties(units, room):
    numels = [n for n, _ in units]
    tiers = [t for _, t in units]
    chosen = plan_speculation(numels, tiers, room)
    used = sum(spare_state_bytes(n) for n, c in zip(numels, chosen) if c)
    assert used <= room
    left = room
    for index in reversed(range(len(units))):
        need = spare_state_bytes(numels[index])
        eligible = tiers[index] is OptimizerTier.HOST and numels[index] > 0
        if chosen[index]:
            assert eligible
            left -= need
        else:
            # greedy from the last unit: one eligible unit left out did not fit at its turn
            assert not eligible or need > left


# ---- a window left undecided: the speculation is taken back, as if it never ran ------------


def same_story(swap_dir, story, **config):
    """Runs `story(engine, model)` under overlap none and under the speculative backward; both
    must end bitwise equal (weights, step counts, and the next forward's output)."""
    torch.manual_seed(0)
    model = CallsInBackward()
    outcomes = []
    for overlap in ("none", "backward"):
        trained = copy.deepcopy(model)
        engine = offload.initialize(trained, make_config(swap_dir, overlap, **config))
        try:
            story(engine, trained)
            x = batches(1, seed=9)[0][0]
            outcomes.append(
                (engine.consolidated_state_dict(), [u.step_count for u in engine.units], engine(x).detach(), engine.global_steps)
            )
        finally:
            engine.close()
    (state, counts, output, steps), (state2, counts2, output2, steps2) = outcomes
    assert_same(state2, state)
    assert counts2 == counts and steps2 == steps
    assert torch.equal(output2, output)


def test_a_failed_backward_takes_the_speculation_back(swap_dir):
    def story(engine, model):
        data = batches(3)
        engine.backward(mse(engine, *data[0]))
        engine.step()
        raise_once(model)
        with pytest.raises(RuntimeError, match="injected"):
            engine.backward(mse(engine, *data[1]))
        engine.backward(mse(engine, *data[1]))  # the retry
        engine.step()
        engine.backward(mse(engine, *data[2]))
        engine.step()

    same_story(swap_dir, story, clip=1e6)


def test_a_backward_failing_before_any_step_in_place_goes_on_as_overlap_none(swap_dir):
    """Overlap 'backward' without speculation: the backward fails in the last block, after the
    output layer's gradients reached the root unit and before any unit's gradients are final.
    The root's partial gradients, handed off as the failed backward ends, step nothing (they
    stay in the window, as under overlap 'none'), and the retry trains as overlap 'none' does."""

    def story(engine, model):
        data = batches(3)
        engine.backward(mse(engine, *data[0]))
        engine.step()
        failures = [RuntimeError("injected failure in backward")]

        def fail_once(module, grad_output):
            if failures:
                raise failures.pop()

        handle = model.blocks[3].register_full_backward_pre_hook(fail_once)
        loss = mse(engine, *data[1])
        with pytest.raises(RuntimeError, match="injected"):
            engine.backward(loss)
        handle.remove()
        engine.backward(mse(engine, *data[1]))
        engine.step()
        engine.backward(mse(engine, *data[2]))
        engine.step()

    same_story(swap_dir, story, clip=0.0)


@pytest.mark.parametrize("backward", ["engine", "plain"])
def test_a_backward_failing_after_steps_in_place_refuses_to_train_until_a_load(swap_dir, tmp_path, backward):
    """Overlap 'backward' without speculation: the backward fails after the blocks stepped in
    place (the root did not). Those steps cannot be taken back: the failure says which units
    stepped, every use that would train on the mixed weights is refused, and a checkpoint load
    is the way on, after which training equals plain PyTorch."""
    torch.manual_seed(0)
    model = CallsInBackward()
    data = batches(3)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "backward", clip=0.0))
    events = engine.schedule.context.events
    events.enabled = True
    try:
        engine.backward(mse(engine, *data[0]))
        engine.step()
        engine.save_checkpoint(tmp_path / "after-1")
        blocks_stepped = [("step_done", index) for index in range(1, 5)]

        def fail_after_the_blocks_stepped():
            engine.model.on_backward = lambda: None
            wait_until(lambda: all(event in events.events for event in blocks_stepped))
            raise RuntimeError("injected failure in backward")

        engine.model.on_backward = fail_after_the_blocks_stepped
        events.take()
        loss = mse(engine, *data[1])
        with pytest.raises(RuntimeError, match="injected") as failure:
            engine.backward(loss) if backward == "engine" else loss.backward()
        refused = "weights are partly stepped"
        if backward == "engine":
            assert "4 of 5 units had stepped in place" in "".join(failure.value.__notes__)
        with pytest.raises(OffloadError, match=refused):
            engine.step()  # a plain backward's failure is seen here, as the engine finishes it
        assert [u.step_count for u in engine.units] == [1, 2, 2, 2, 2]
        with pytest.raises(OffloadError, match=refused):
            engine(data[1][0])
        with pytest.raises(OffloadError, match=refused):
            engine.save_checkpoint(tmp_path / "mixed")
        engine.load_checkpoint(tmp_path / "after-1")
        for batch in data[1:]:
            engine.backward(mse(engine, *batch))
            engine.step()
        reference, _ = reference_run(model, data)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    finally:
        engine.close()


def test_a_failed_load_checkpoint_between_backward_and_step_takes_the_speculation_back(swap_dir, tmp_path):
    def story(engine, model):
        data = batches(2)
        engine.backward(mse(engine, *data[0]))
        engine.step()
        engine.backward(mse(engine, *data[1]))
        with pytest.raises(Exception, match="checkpoint|exist|found"):
            engine.load_checkpoint(tmp_path / "no-such-checkpoint")
        engine.step()

    same_story(swap_dir, story, clip=1e6)


def test_a_step_failing_before_the_norm_takes_the_speculation_back(swap_dir):
    def story(engine, model):
        data = batches(3)
        engine.backward(mse(engine, *data[0]))
        engine.step()
        engine.backward(mse(engine, *data[1]))
        real = engine.collectives.sum_host

        def interrupted(*args, **kwargs):
            engine.collectives.sum_host = real
            raise KeyboardInterrupt

        engine.collectives.sum_host = interrupted
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert engine.step() is False  # the window was decided (not stepped), as without speculation
        engine.backward(mse(engine, *data[2]))
        engine.step()

    same_story(swap_dir, story, clip=1e6)


def test_an_lr_set_between_backward_and_step_is_a_redo(swap_dir):
    def story(engine, model):
        data = batches(3)
        for i, batch in enumerate(data):
            engine.backward(mse(engine, *batch))
            if i == 1:
                engine.lr = 3e-3
            engine.step()
        if engine.config.overlap == "backward":
            assert engine.speculation_counts == {"committed": 2, "redone": 1, "skipped": 0, "refused": 0}

    same_story(swap_dir, story, clip=1e6)
