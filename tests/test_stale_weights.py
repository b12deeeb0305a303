"""Never train on stale weights: the mechanisms that re-enter or abandon a unit's forward.

Each test drives the mechanism itself (`torch.utils.checkpoint` around a unit, an exception
inside forward, a parameter read outside its unit) rather than whatever a library version
happens to do, and compares fp32 training with plain PyTorch AdamW on the same model and
data to fp32 rounding. Holds are checked too: after every backward no offloaded unit is
held, whatever re-entered or abandoned its forward.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time

import pytest
import torch
from reference import Block, TinyNet, batches, max_weight_difference, mse, reference_run
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import offload

PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme"]))
CHECKPOINTING = ["non_reentrant", "non_reentrant_no_early_stop", "reentrant"]


class CheckpointedNet(TinyNet):
    """TinyNet whose blocks (the units) run under `torch.utils.checkpoint`, called on the
    module itself, so a recompute re-enters the unit's forward hooks."""

    def __init__(self, mode: str = "off") -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.mode == "off" or not torch.is_grad_enabled():
                h = block(h)
            elif self.mode == "reentrant":
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=True)
            else:
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.out(h)


def early_stop_context(mode: str):
    return torch_checkpoint.set_checkpoint_early_stop(mode != "non_reentrant_no_early_stop")


def config(swap_dir, param, optimizer, overlap="none", **extra):
    result = {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    result.update(extra)
    return result


def assert_no_unit_held(engine, caplog) -> None:
    """No unit is held after backward, and none was by the end of it (the engine drops leaked
    holds there and says so, and refetches a stale copy and says so: both are defects here)."""
    held = {unit.spec.name: unit.holders for unit in engine.units if unit.holders}
    assert not held, f"units still held after backward: {held}"
    leaks = [
        r.getMessage()
        for r in caplog.records
        if "holders at the end of backward" in r.getMessage() or "fetching again" in r.getMessage()
    ]
    assert not leaks, leaks


def assert_trains_like_plain_pytorch(model, engine_config, caplog, *, steps: int, forward_context=contextlib.nullcontext):
    """Trains `model` with plain PyTorch AdamW and a copy with the engine on the same batches
    (each engine forward inside `forward_context()`): no unit held after any backward, and the
    losses and final weights equal to fp32 rounding."""
    data = batches(steps)
    reference, reference_losses = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), engine_config)
    losses = []
    try:
        for x, y in data:
            with forward_context():
                loss = mse(engine, x, y)
            engine.backward(loss)
            assert_no_unit_held(engine, caplog)
            engine.step()
            losses.append(loss.item())
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= 1e-5
        assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", CHECKPOINTING)
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_checkpointed_units_equal_plain_pytorch(swap_dir, caplog, param, optimizer, overlap, mode):
    torch.manual_seed(0)
    with early_stop_context(mode):
        assert_trains_like_plain_pytorch(CheckpointedNet(mode), config(swap_dir, param, optimizer, overlap), caplog, steps=6)


class InnerCheckpointBlock(Block):
    """A block (a unit) that checkpoints part of itself: the recompute runs inside the unit's
    own backward and reads its norm and up-projection again."""

    def __init__(self, width: int, reentrant: bool) -> None:
        super().__init__(width)
        self.reentrant = reentrant

    def forward(self, x):
        if not torch.is_grad_enabled():
            return super().forward(x)
        inner = torch_checkpoint.checkpoint(lambda t: torch.relu(self.up(self.norm(t))), x, use_reentrant=self.reentrant)
        return x + self.down(inner)


class LayoutNet(TinyNet):
    """TinyNet (four blocks, the units) checkpointed in layouts other than one unit per call:

    - `every_other`: blocks 0 and 2 checkpointed, 1 and 3 not (transformers' `every_n_layers=2`);
    - `pairs`: blocks 0-1 in one checkpoint call, 2-3 in another (a recompute re-enters two units);
    - `all_blocks`: every block in one call (the recompute re-enters all four before any backward
      of theirs runs);
    - `inside`: each block checkpoints part of itself (InnerCheckpointBlock).
    """

    def __init__(self, layout: str, reentrant: bool) -> None:
        super().__init__()
        self.layout = layout
        self.reentrant = reentrant
        if layout == "inside":
            self.blocks = nn.ModuleList(InnerCheckpointBlock(32, reentrant) for _ in range(4))

    def _checkpointed(self, blocks, h):
        def run(t):
            for block in blocks:
                t = block(t)
            return t

        return torch_checkpoint.checkpoint(run, h, use_reentrant=self.reentrant)

    def forward(self, x):
        h = self.inp(x)
        blocks = list(self.blocks)
        if self.layout == "inside" or not torch.is_grad_enabled():
            for block in blocks:
                h = block(h)
        elif self.layout == "every_other":
            for index, block in enumerate(blocks):
                h = self._checkpointed([block], h) if index % 2 == 0 else block(h)
        elif self.layout == "pairs":
            for start in range(0, len(blocks), 2):
                h = self._checkpointed(blocks[start : start + 2], h)
        else:
            h = self._checkpointed(blocks, h)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("layout", ["every_other", "pairs", "all_blocks", "inside"])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "cpu"), ("cpu", "nvme")])
def test_checkpoint_layouts_equal_plain_pytorch(swap_dir, caplog, param, optimizer, overlap, layout, reentrant):
    """Checkpoints that cover several units, some units, or part of one: every recompute reads
    the weights of the step before (never a later step's, never freed storage), and training
    matches plain PyTorch AdamW to fp32 rounding."""
    torch.manual_seed(0)
    assert_trains_like_plain_pytorch(LayoutNet(layout, reentrant), config(swap_dir, param, optimizer, overlap), caplog, steps=5)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_saved_tensors_copied_away_equal_plain_pytorch(swap_dir, caplog, param, optimizer, overlap, checkpointed):
    """Activation offloading (torch.autograd.graph.save_on_cpu, transformers'
    `activation_checkpointing_enable(offload=True)`) packs every tensor saved for backward into a
    copy elsewhere, the weights a unit's ops save among them. Here the copy is a clone (on a GPU
    it is the host copy): backward then computes with the weights as they were in the forward,
    whatever the engine did to the unit's device buffer since, and training still equals plain
    PyTorch AdamW."""
    torch.manual_seed(0)
    assert_trains_like_plain_pytorch(
        CheckpointedNet("non_reentrant" if checkpointed else "off"),
        config(swap_dir, param, optimizer, overlap),
        caplog,
        steps=5,
        forward_context=lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t),
    )


class FailingOnce(nn.Module):
    """Raises (like a CUDA out-of-memory) the first time it runs with `armed` set."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x):
        if self.armed:
            self.armed = False
            raise RuntimeError("simulated out of memory")
        return self.inner(x)


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_exception_in_forward_then_retry(swap_dir, caplog, param, optimizer, overlap):
    """An exception inside a unit's forward unwinds every hold that forward took; a retry of
    the same batch trains exactly as if the failure never happened."""
    torch.manual_seed(0)
    model = CheckpointedNet("off")
    data = batches(6)
    reference, _ = reference_run(model, data)
    wrapped = copy.deepcopy(model)
    wrapped.blocks[2].up = FailingOnce(wrapped.blocks[2].up)
    engine = offload.initialize(wrapped, config(swap_dir, param, optimizer, overlap))
    try:
        for step, (x, y) in enumerate(data):
            if step in (1, 3):
                wrapped.blocks[2].up.armed = True
                with pytest.raises(RuntimeError, match="simulated out of memory"):
                    mse(engine, x, y)
                held = {u.spec.name: u.holders for u in engine.units if u.holders}
                assert not held, f"holds left by the failed forward: {held}"
            loss = mse(engine, x, y)
            engine.backward(loss)
            assert_no_unit_held(engine, caplog)
            engine.step()
        sd = {name.replace("inner.", ""): value for name, value in engine.consolidated_state_dict().items()}
        assert max_weight_difference(sd, reference) <= 1e-5
    finally:
        engine.close()


class ReadsAheadNet(CheckpointedNet):
    """Reads the last block's norm weight before any block runs: a read outside its unit."""

    def forward(self, x):
        h = self.inp(x) * self.blocks[-1].norm.weight.mean()
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@pytest.fixture
def slow_adam(monkeypatch):
    """Each Adam call takes 20 ms longer, so a step overlapping the next forward is still running
    when that forward reads the weights: a read that does not wait for the step reads old values."""
    from offload.runtime import stepper

    real = stepper.kernels.adam_step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(stepper.kernels, "adam_step", slow)


@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_param_read_outside_its_unit_waits_for_the_step(swap_dir, slow_adam, param, optimizer):
    torch.manual_seed(0)
    model = ReadsAheadNet()
    data = batches(5)
    reference, reference_losses = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer, "forward"))
    try:
        losses = []
        for x, y in data:
            loss = mse(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= 1e-5
    finally:
        engine.close()


def test_a_copy_from_before_a_step_is_fetched_again(swap_dir, caplog):
    """The version check itself: a unit kept on the device across a step of its weights (a hold
    nobody gave back) is fetched again at its next use, never read with the old values."""
    torch.manual_seed(0)
    engine = offload.initialize(CheckpointedNet("off"), config(swap_dir, "cpu", "cpu"))
    try:
        unit = engine.units[2]
        engine.residency.acquire(unit)  # a hold that outlives the step below
        old = unit.device_flat.clone()
        unit.begin_step()  # what step() does before the optimizer worker writes the new weights
        unit.param16.add_(1.0)
        unit.step_done.set()
        engine.residency.acquire(unit)
        assert torch.equal(unit.device_flat, old + 1.0)
        assert any("fetching again" in r.getMessage() for r in caplog.records)
    finally:
        engine.close(restore_weights=False)
