"""Overlap `auto`, the default: units step speculatively during backward while the optimizer
worker keeps up, and step() withdraws the jobs it has not started to step them, with the rest of
the window, in the next forward's order.

The reference is overlap 'none' on the same model, config and data: every run here must be
bitwise identical to it (clipping that never, always or sometimes acts; fp32 and bf16; every
placement; accumulation; activation checkpointing). What user code does between a backward and
step() (a forward, another backward, zero_grad, a clip of its own, a failed backward) is what it
does under overlap 'forward': the speculative steps are taken back, never refused. The schedule
itself is pinned from the EventLog with a gated Adam (the worker held until the test lets it go).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from reference import TinyNet, batches, mse
from test_speculative_step import CheckpointedNet, assert_same, median_norm

import offload


def make_config(swap_dir, overlap=None, *, param="cpu", optimizer="cpu", precision="fp32", clip=0.0, gradient="auto", **extra):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "gradient_precision": gradient},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "gradient_clipping": clip,
    }
    if overlap is not None:
        config["overlap"] = overlap
    config.update(extra)
    return config


def train(model, config, data, loop=None):
    """Trains with `loop(engine, x, y)` per batch (default: forward, backward, step); returns the
    fp32 state dict, the losses and the engine's speculation counts."""
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        losses = []
        for x, y in data:
            if loop is None:
                loss = mse(engine, x, y)
                engine.backward(loss)
                engine.step()
            else:
                loss = loop(engine, x, y)
            losses.append(loss.item())
        return engine.consolidated_state_dict(), losses, dict(engine.speculation_counts)
    finally:
        engine.close()


def test_the_default_overlap_is_auto(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    try:
        assert engine.config.overlap == "auto" and engine.policy.name == "auto"
        assert engine.policy.speculative  # always: anything can be taken back
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("clipping", ["never", "always", "sometimes"])
def test_auto_equals_overlap_none_bitwise(swap_dir, precision, clipping):
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(6)
    clip = {"never": 0.0, "always": 1e-3, "sometimes": median_norm(model, swap_dir, data)}[clipping]
    expected, expected_losses, _ = train(model, make_config(swap_dir, "none", precision=precision, clip=clip), data)
    state, losses, counts = train(model, make_config(swap_dir, precision=precision, clip=clip), data)
    assert_same(state, expected)
    assert losses == expected_losses
    if clipping == "always":
        # clipping that keeps acting pauses speculation after each redo: 1 window, then 2 (of 6)
        assert counts["committed"] == 0 and counts["redone"] <= 3
    if clipping == "never":
        assert counts["redone"] == 0 and counts["committed"] > 0


@pytest.mark.parametrize("param,optimizer", [("none", "nvme"), ("nvme", "cpu"), ("nvme", "nvme")])
def test_auto_equals_overlap_none_on_every_tier(swap_dir, param, optimizer):
    """Units whose state streams from NVMe have no spare state: they step once the norm is known."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(4)
    expected, _, _ = train(model, make_config(swap_dir, "none", param=param, optimizer=optimizer, clip=0.05), data)
    state, _, _ = train(model, make_config(swap_dir, param=param, optimizer=optimizer, clip=0.05), data)
    assert_same(state, expected)


def test_auto_with_checkpointed_units_and_accumulation_equals_overlap_none(swap_dir):
    torch.manual_seed(0)
    model = CheckpointedNet(depth=3)
    data = batches(6)
    extra = {"gradient_accumulation_steps": 3}
    expected, _, _ = train(model, make_config(swap_dir, "none", clip=0.05, **extra), data)
    state, _, counts = train(model, make_config(swap_dir, clip=0.05, **extra), data)
    assert_same(state, expected)
    assert sum(counts.values()) <= 2  # one speculative window per accumulation window at most


# ---- what user code does between the backward and step(): as under overlap 'forward' ----------
def forward_before_step(engine, x, y):
    loss = mse(engine, x, y)
    engine.backward(loss)
    with torch.no_grad():
        engine(x)  # an evaluation before step(): it sees the old weights
    engine.step()
    return loss


def backward_twice_before_step(engine, x, y):
    loss = mse(engine, x, y)
    engine.backward(loss)
    engine.backward(mse(engine, x[:4], y[:4]))  # a window that ended, then another backward: it adds
    engine.step()
    return loss


def zero_grad_then_backward(engine, x, y):
    engine.backward(mse(engine, x[:4], y[:4]))
    engine.optimizer.zero_grad()  # drops what that backward stepped speculatively
    loss = mse(engine, x, y)
    engine.backward(loss)
    engine.step()
    return loss


def users_clip(engine, x, y):
    loss = mse(engine, x, y)
    engine.backward(loss)
    torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 0.05)
    engine.step()
    return loss


@pytest.mark.parametrize("loop", [forward_before_step, backward_twice_before_step, zero_grad_then_backward, users_clip])
def test_calls_between_backward_and_step_act_as_under_overlap_forward(swap_dir, loop):
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(4)
    # fp32 gradients: a second backward before step() adds into them (16-bit ones refuse it)
    expected, expected_losses, _ = train(model, make_config(swap_dir, "forward", gradient="fp32"), data, loop)
    state, losses, _ = train(model, make_config(swap_dir, gradient="fp32"), data, loop)
    assert_same(state, expected)
    assert losses == expected_losses


def test_a_read_of_the_weights_before_step_sees_the_last_steps(swap_dir):
    """param none: a parameter read between the backward and step() (a weight norm logged, say)
    sees the weights of the last step, as under overlap 'forward': the window's speculative steps
    are taken back first (the read would otherwise wait for them and see their weights)."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(4)

    def reading(seen: list[float]):
        def read_before_step(engine, x, y):
            loss = mse(engine, x, y)
            engine.backward(loss)
            seen.append(engine.model.blocks[2].up.weight.detach().double().sum().item())
            engine.step()
            return loss

        return read_before_step

    runs = {}
    for overlap in ("forward", None):
        seen: list[float] = []
        state, _, _ = train(model, make_config(swap_dir, overlap, param="none"), data, reading(seen))
        runs[overlap] = (state, seen)
    assert runs[None][1] == runs["forward"][1]
    assert_same(runs[None][0], runs["forward"][0])


def failing_once():
    """A loop whose first backward fails in the root's first gradient (the last to land: every
    block has stepped speculatively by then); it drops that window and trains on."""
    failed = []

    def loop(engine, x, y):
        loss = mse(engine, x, y)
        if not failed:
            failed.append(True)

            def boom(grad):
                raise RuntimeError("the backward fails")

            handle = engine.model.inp.weight.register_hook(boom)
            with pytest.raises(RuntimeError, match="the backward fails"):
                engine.backward(loss)
            handle.remove()
            engine.optimizer.zero_grad()
            loss = mse(engine, x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return loop


def test_a_failed_backward_leaves_nothing_stepped(swap_dir):
    """The units stepped speculatively before the failure are taken back: training goes on as if
    that backward never ran, as under overlap 'forward' (where nothing stepped yet)."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(4)
    expected, _, _ = train(model, make_config(swap_dir, "forward"), data, failing_once())
    state, _, _ = train(model, make_config(swap_dir), data, failing_once())
    assert_same(state, expected)


# ---- the schedule ------------------------------------------------------------------------------
def traced(swap_dir, **extra):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(depth=3), make_config(swap_dir, "auto", **extra))
    engine.schedule.context.events.enabled = True
    return engine, engine.schedule.context.events


def test_step_withdraws_the_steps_the_worker_did_not_reach_and_returns_at_once(swap_dir, gated_adam):
    """The worker is held in its first speculative step for the whole backward (the last
    block's, or, if the worker started after more had landed, the one of those the forward needs
    first): step() withdraws the others, queues them in the forward's order (root first) behind
    it, and returns without waiting for any; the next forward's root runs before the last of the
    blocks has stepped."""
    engine, events = traced(swap_dir)
    try:
        (x, y), (x2, _) = batches(2)
        gated_adam.set()
        engine.backward(mse(engine, x, y))
        engine.step()
        loss = mse(engine, x2, y)
        gated_adam.clear()
        engine.backward(loss)
        events.take()
        started = time.perf_counter()
        engine.step()
        assert time.perf_counter() - started < 30, "step() waited for the gated step"
        events.record("step_returned", -1)
        gated_adam.set()
        mse(engine, x2, y)
        got = events.take()
        withdrawn = [unit for name, unit in got if name == "step_withdrawn"]
        running = [unit for unit in range(4) if unit not in withdrawn]
        assert len(running) == 1, got  # the step the worker was held in
        returned = got.index(("step_returned", -1))
        last_withdrawn = max(i for i, (name, _) in enumerate(got) if name == "step_withdrawn")
        begins = [unit for name, unit in got[last_withdrawn:returned] if name == "step_begin"]
        assert begins == sorted(withdrawn), got  # submitted again in the forward's order
        assert got.index(("step_done", running[0])) > returned, got  # step() did not wait for it
        assert got.index(("pre_forward", 0)) < got.index(("step_done", max(withdrawn))), got
    finally:
        engine.close()
