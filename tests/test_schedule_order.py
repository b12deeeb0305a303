"""The order of the per-unit schedule's events, pinned for each overlap mode (FSDP2's
expected-events style), and the proof that the CPU step overlaps what it should.

TinyNet with two blocks: unit 0 is the root (input layer and head), units 1 and 2 the blocks.
"""

from __future__ import annotations

import time

import pytest
import torch
from reference import TinyNet, batches, mse

import offload


def traced_engine(swap_dir, overlap, param="cpu", optimizer="cpu", depth=1):
    torch.manual_seed(0)
    config = {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
        "prefetch": {"depth": depth},
    }
    engine = offload.initialize(TinyNet(depth=2), config)
    engine.schedule.context.events.enabled = True
    return engine


def one_step(engine, batch):
    x, y = batch
    engine.backward(mse(engine, x, y))
    engine.step()


FORWARD = [
    ("pre_forward", 0),
    ("pre_forward", 1),
    ("post_forward", 1),
    ("pre_forward", 2),
    ("post_forward", 2),
    ("post_forward", 0),
]
BACKWARD = [("pre_backward", 2), ("grads_final", 2), ("pre_backward", 1), ("grads_final", 1), ("grads_final", 0)]


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_overlap_none_steps_after_backward_in_forward_order(swap_dir, param):
    engine = traced_engine(swap_dir, "none", param=param)
    try:
        one_step(engine, batches(1)[0])
        events = engine.schedule.context.events.take()
        steps = [("step_begin", 0), ("step_begin", 1), ("step_begin", 2), ("step_done", 0), ("step_done", 1), ("step_done", 2)]
        assert events == FORWARD + BACKWARD + steps
    finally:
        engine.close()


def test_overlap_forward_steps_each_unit_before_its_next_use(swap_dir):
    engine = traced_engine(swap_dir, "forward")
    try:
        data = batches(3)
        for batch in data:
            one_step(engine, batch)
        events = engine.schedule.context.events.take()
        # the second step onwards: each unit's step is done before its next pre_forward
        for unit in range(3):
            done = [i for i, e in enumerate(events) if e == ("step_done", unit)]
            uses = [i for i, e in enumerate(events) if e == ("pre_forward", unit)]
            for step_done, next_use in zip(done, uses[1:]):
                assert step_done < next_use, (unit, events)
    finally:
        engine.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_overlap_forward_hides_the_step_behind_the_next_forward(swap_dir, gated_adam, depth):
    """step() returns before any unit has stepped (every Adam call waits for a gate the test
    opens only after step() returned), and the next forward starts computing while the later
    units are still stepping: the root (stepped first) runs its forward before the blocks'
    steps are done, whatever the prefetch depth (the root's own fetch is queued before the
    prefetches of the blocks, which wait for their steps on the one transfer worker)."""
    engine = traced_engine(swap_dir, "forward", depth=depth)
    try:
        data = batches(2)
        gated_adam.set()
        one_step(engine, data[0])
        x, y = data[1]
        engine.backward(mse(engine, x, y))  # waits for the first step
        gated_adam.clear()
        engine.schedule.context.events.take()
        started = time.perf_counter()
        engine.step()
        step_call = time.perf_counter() - started
        engine.schedule.context.events.record("step_returned", -1)
        # had step() waited for a unit's step, it would have waited for the gate's minute
        assert step_call < 30, f"step() took {step_call:.1f} s: it waited for the CPU step"
        gated_adam.set()
        mse(engine, x, y)
        events = engine.schedule.context.events.take()
        assert events.index(("step_returned", -1)) < events.index(("step_done", 0)), events
        assert events.index(("pre_forward", 0)) < events.index(("step_done", 1)), events
    finally:
        engine.close()


def test_overlap_backward_steps_a_block_while_backward_continues(swap_dir, slow_adam):
    engine = traced_engine(swap_dir, "backward")
    log = engine.schedule.context.events

    def hold_the_backward_until_block_2_steps(grad):
        # between block 1's backward and the input layer's (the root's last gradients): the
        # backward waits here until block 2's step has begun, for at most 30 s. A step that
        # began only after the backward would let it go on at the timeout, and the order below
        # would fail; without the gate that order was the threads' to decide. The log holds
        # this step's events only (taken after the first step), so an earlier step's
        # step_begin cannot open the gate
        deadline = time.monotonic() + 30
        while ("step_begin", 2) not in list(log.events) and time.monotonic() < deadline:
            time.sleep(0.001)
        return grad

    def gate_block_1_input(module, args):
        if args[0].requires_grad:
            args[0].register_hook(hold_the_backward_until_block_2_steps)

    gate = engine.model.blocks[0].register_forward_pre_hook(gate_block_1_input)
    try:
        data = batches(2)
        one_step(engine, data[0])
        log.take()
        one_step(engine, data[1])
        second = log.take()
        # block 2's step is submitted from the transfer worker as soon as its gradients land,
        # during the backward, before the root's gradients are final; the root steps at step()
        assert second[: len(FORWARD)] == FORWARD, second
        assert second.index(("step_begin", 2)) < second.index(("grads_final", 0)), second
        assert second.index(("step_begin", 2)) < second.index(("step_begin", 0)), second
        assert ("step_begin", 0) in second[second.index(("grads_final", 0)) :]
    finally:
        gate.remove()
        engine.close()


def test_a_recompute_takes_a_backward_hold_and_gives_it_back(swap_dir):
    """Non-reentrant checkpointing with early stop: the recompute's post-forward is called
    (always_call) after it stopped early, and the unit is free after its gradients are final."""
    from torch.utils import checkpoint

    class Checkpointed(TinyNet):
        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = checkpoint.checkpoint(block, h, use_reentrant=False)
            return self.out(h)

    torch.manual_seed(0)
    config = {"precision": "fp32", "offload": {"param": "cpu", "optimizer": "cpu", "nvme_path": swap_dir}, "overlap": "none"}
    engine = offload.initialize(Checkpointed(depth=2), config)
    engine.schedule.context.events.enabled = True
    try:
        one_step(engine, batches(1)[0])
        events = engine.schedule.context.events.take()
        backward = events[events.index(("post_forward", 0)) + 1 :]
        assert backward[:4] == [("pre_backward", 2), ("pre_recompute", 2), ("post_recompute", 2), ("grads_final", 2)]
        assert all(unit.holders == 0 for unit in engine.units)
    finally:
        engine.close()


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_the_backwards_first_units_are_fetched_before_autograd_reaches_them(swap_dir, param):
    """The forward let its last blocks go; the backward needs them first. engine.backward starts
    their fetches (the first unit of the recorded backward order and `prefetch.depth` after it)
    before autograd runs, so they come in while the head's backward computes: when the loss's
    gradient is taken, before any block's backward, they are on their way or there."""
    engine = traced_engine(swap_dir, "none", param=param)
    try:
        data = batches(2)
        one_step(engine, data[0])  # records the orders
        x, y = data[1]
        out = engine(x)
        blocks = engine.units[1:]
        assert not any(unit.resident or unit.fetch_future is not None for unit in blocks)
        seen: list[list[bool]] = []

        def at_the_head(grad):
            seen.append([unit.resident or unit.fetch_future is not None for unit in blocks])
            return grad

        out.register_hook(at_the_head)
        engine.backward(torch.nn.functional.mse_loss(out, y))
        engine.step()
        assert seen == [[True, True]]  # block 2 (the backward's first) and block 1 (depth 1 after it)
    finally:
        engine.close()
