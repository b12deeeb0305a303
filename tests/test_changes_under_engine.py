"""What a user changes on the model while an engine owns it: handled exactly as torch would, or
refused at once with an error naming the parameter and the way to do it, before any state
changes."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import TinyNet, batches, engine_run, mse

import offload
from offload.errors import OffloadError

PLACEMENTS = [("cpu", "cpu", "none"), ("none", "cpu", "forward"), ("nvme", "nvme", "forward"), ("cpu", "cpu", "backward")]


def config(swap_dir, param, optimizer, overlap):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }


@pytest.mark.parametrize("param,optimizer,overlap", PLACEMENTS)
def test_freezing_after_initialize_trains_like_torch(swap_dir, param, optimizer, overlap):
    """requires_grad_(False) mid-run: like torch.optim, the parameter gets no gradient and is not
    stepped (no weight decay either) from then on."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for i, (x, y) in enumerate(data):
        if i == 2:
            reference.blocks[1].up.weight.requires_grad_(False)
        adamw.zero_grad(set_to_none=True)
        loss = mse(reference, x, y)
        loss.backward()
        adamw.step()
        expected.append(loss.item())
    with offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer, overlap)) as engine:
        losses = engine_run(engine, data[:2])
        engine.model.blocks[1].up.weight.requires_grad_(False)
        frozen = engine.consolidated_state_dict()["blocks.1.up.weight"]
        losses += engine_run(engine, data[2:])
        weights = engine.consolidated_state_dict()
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert torch.equal(weights["blocks.1.up.weight"], frozen)  # not stepped since it was frozen
    for name, value in reference.state_dict().items():
        assert (weights[name] - value).abs().max() <= 1e-5, name


@pytest.mark.parametrize("param,optimizer,overlap", PLACEMENTS)
def test_unfreezing_a_parameter_frozen_at_initialize_is_refused(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    model.blocks[0].down.bias.requires_grad_(False)
    data = batches(4)
    with offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer, overlap)) as engine:
        engine_run(engine, data[:2])
        before = engine.consolidated_state_dict()
        engine.model.blocks[0].down.bias.requires_grad_(True)
        loss = mse(engine, *data[2])
        with pytest.raises(OffloadError, match=r"blocks\.0\.down\.bias did not require grad .* before offload.initialize"):
            engine.backward(loss)
        after = engine.consolidated_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        # frozen again, it trains on as before
        engine.model.blocks[0].down.bias.requires_grad_(False)
        engine_run(engine, data[2:])
        assert engine.global_steps == 4


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_load_state_dict_while_open_is_refused_and_changes_nothing(swap_dir, param):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    other = TinyNet().state_dict()
    with offload.initialize(
        copy.deepcopy(model), config(swap_dir, param, "nvme" if param == "nvme" else "cpu", "forward")
    ) as engine:
        engine_run(engine, data[:2])
        before = engine.consolidated_state_dict()
        with pytest.raises(
            OffloadError, match=r"load_state_dict\(\.\.\.\) while an offload engine owns the model.*load_checkpoint"
        ):
            engine.model.load_state_dict(other)
        after = engine.consolidated_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine_run(engine, data[2:])
        model_after = engine.model
    # closed, the model is the user's again
    model_after.load_state_dict(other)
    assert torch.equal(model_after.state_dict()["blocks.0.up.weight"], other["blocks.0.up.weight"])
