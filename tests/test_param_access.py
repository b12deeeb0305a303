"""Reading parameters between steps: `engine.params_on_device(module)`.

Outside a forward, an offloaded parameter is a view of freed storage, and with overlap
`forward` a step may still be writing a `param: none` unit's weights. Inside the block every
read sees the weights of the latest step, checked against plain PyTorch AdamW trained on the
same data (the Adam steps made slow, so that with overlap `forward` they are still running when
the block opens); afterwards the offloaded units are freed again.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from reference import ENGINE_DEVICE, TinyNet, batches, fp32_weight_tolerance, mse, reference_run
from torch import nn

import offload
from offload.errors import OffloadError

PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme"]))


def config(swap_dir, param, optimizer, overlap="forward"):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }


def read_all(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().to("cpu", copy=True) for name, param in model.named_parameters()}


def storage_bytes(param: torch.Tensor) -> int:
    return param.untyped_storage().nbytes()


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_reads_between_steps_see_the_latest_weights(swap_dir, slow_adam, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer, overlap))
    tolerance = fp32_weight_tolerance(engine)
    try:
        for steps, (x, y) in enumerate(data, start=1):
            engine.backward(mse(engine, x, y))
            engine.step()
            with engine.params_on_device():
                read = read_all(engine.model)
                assert not torch.is_grad_enabled()
            reference, _ = reference_run(model, data[:steps])
            for name, expected in reference.named_parameters():
                difference = (read[name] - expected.detach()).abs().max().item()
                assert difference <= tolerance, f"{name} after step {steps}: {difference}"
            # fp32: the device weights are the master weights, bit for bit
            master = engine.consolidated_state_dict()
            assert all(torch.equal(read[name], master[name]) for name in read)
        if param != "none":
            assert all(storage_bytes(p) == 0 for p in engine.model.parameters())
        assert all(unit.holders == 0 for unit in engine.units)
    finally:
        engine.close(restore_weights=False)


def test_a_submodule_holds_only_its_units(swap_dir):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap_dir, "cpu", "cpu"))
    try:
        x, y = batches(1)[0]
        engine.backward(mse(engine, x, y))
        engine.step()
        block = engine.model.blocks[1]
        with engine.params_on_device(block):
            assert all(storage_bytes(p) > 0 for p in block.parameters())
            assert all(storage_bytes(p) == 0 for p in engine.model.blocks[0].parameters())
            read = {name: p.detach().clone() for name, p in block.named_parameters()}
        master = engine.consolidated_state_dict()
        assert all(torch.equal(read[name], master[f"blocks.1.{name}"]) for name in read)
        assert all(storage_bytes(p) == 0 for p in block.parameters())
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_write_inside_is_undone_and_refused(swap_dir, param):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param, "cpu", "none"))
    try:
        for x, y in data[:2]:
            engine.backward(mse(engine, x, y))
            engine.step()
        with pytest.raises(OffloadError, match=r"blocks\.0\.up\.weight.*written inside engine\.params_on_device"):
            with engine.params_on_device():
                engine.model.blocks[0].up.weight.mul_(2.0)
        # training goes on exactly as if nothing had been written
        x, y = data[2]
        engine.backward(mse(engine, x, y))
        engine.step()
        reference, _ = reference_run(model, data)
        with engine.params_on_device():
            read = read_all(engine.model)
        for name, expected in reference.named_parameters():
            assert (read[name] - expected.detach()).abs().max().item() <= fp32_weight_tolerance(engine), name
    finally:
        engine.close(restore_weights=False)


def test_refused_inside_a_forward_and_before_a_backward(swap_dir):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap_dir, "cpu", "cpu"))
    seen: list[str] = []

    def read_in_forward(module, args):
        try:
            with engine.params_on_device(module):
                pass
        except OffloadError as error:
            seen.append(str(error))

    try:
        handle = engine.model.blocks[2].register_forward_pre_hook(read_in_forward)
        x, y = batches(1)[0]
        loss = mse(engine, x, y)
        handle.remove()
        assert len(seen) == 1 and "during the model's forward" in seen[0]
        # between this forward and its backward the root unit is held for the backward
        with pytest.raises(OffloadError, match="held for a backward that has not run"):
            with engine.params_on_device():
                pass
        engine.backward(loss)
        engine.step()
        with engine.params_on_device():
            pass
    finally:
        engine.close(restore_weights=False)


def test_units_with_params_under_finds_tied_owner():
    from offload.runtime.param_access import units_with_params_under

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    engine = offload.initialize(Tied(), {"precision": "fp32", "offload": {"param": "cpu", "optimizer": "cpu"}})
    try:
        owners = units_with_params_under(engine.units, engine.model.head)
        assert [unit.index for unit in owners] == [0]  # the tied weight lives in the root
        assert [u.index for u in units_with_params_under(engine.units, engine.model.blocks[1])] == [2]
        with engine.params_on_device(engine.model.head):
            assert torch.equal(engine.model.head.weight.detach().cpu(), engine.consolidated_state_dict()["embed.weight"])
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_an_ema_copy_made_inside_is_a_model_of_its_own(swap_dir, param):
    """torch.optim.swa_utils.AveragedModel deep-copies the model, hooks included: built inside
    params_on_device and updated there after every step, its forward and state_dict are those of
    the same EMA over plain PyTorch, and running it neither holds nor fetches the engine's units."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    expected = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    for x, y in data:
        mse(plain, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.update_parameters(plain)

    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param, "cpu"))
    engine.schedule.context.events.enabled = True
    tolerance = fp32_weight_tolerance(engine)
    try:
        with engine.params_on_device():
            ema = AveragedModel(engine.model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        for x, y in data:
            engine.backward(mse(engine, x, y))
            engine.step()
            with engine.params_on_device():
                ema.update_parameters(engine.model)
            engine.schedule.context.events.take()
            ema(x).sum().backward()
            # the optimizer worker may still record its steps' ends; no unit's schedule moved
            moved = [event for event in engine.schedule.context.events.take() if not event[0].startswith("step_")]
            assert moved == []
            assert all(unit.holders == 0 for unit in engine.units)
        probe = data[0][0]
        assert (ema(probe.to(ENGINE_DEVICE)).cpu() - expected(probe)).abs().max().item() <= tolerance
        ema_state, expected_state = ema.state_dict(), expected.state_dict()
        assert ema_state.keys() == expected_state.keys()
        assert all((ema_state[k].cpu() - expected_state[k]).abs().max().item() <= tolerance for k in ema_state)
        master = engine.consolidated_state_dict()
        assert all((master[k] - v.detach()).abs().max().item() <= tolerance for k, v in plain.state_dict().items())
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize(
    "param,replace",
    [
        ("none", lambda model: model.double()),
        ("none", lambda model: model.blocks[1].to(torch.float16)),
        ("cpu", lambda model: setattr(model.blocks[2].up.weight, "data", torch.zeros(64, 32))),
    ],
)
def test_parameters_replaced_after_initialize_are_refused_at_the_next_forward(swap_dir, param, replace):
    """model.to() / .half() / an assignment to param.data after initialize leaves the engine
    updating buffers the model no longer reads: the next forward names the parameter instead."""
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap_dir, param, "cpu"))
    try:
        x, y = batches(1)[0]
        engine.backward(mse(engine, x, y))
        engine.step()
        replace(engine.model)
        with pytest.raises(OffloadError, match=r"parameter 'blocks\.\d\.up\.weight' no longer holds|replaced after offload"):
            mse(engine, x, y)
        assert all(unit.holders == 0 for unit in engine.units)
    finally:
        engine.close(restore_weights=False)
