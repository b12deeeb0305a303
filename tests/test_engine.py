"""The engine against plain PyTorch (torch.optim.AdamW) on the same model, seed and data.

The engine runs on the device it picks (CUDA when present); the references run on the CPU."""

from __future__ import annotations

import copy
import itertools
import math
import os

import pytest
import torch
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, mse, reference_run

import offload

PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme"]))


def make_config(swap_dir, param="cpu", optimizer="cpu", overlap="none", precision="fp32", **extra):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    config.update(extra)
    return config


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_fp32_equals_plain_pytorch(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, reference_losses = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, overlap))
    losses = engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    engine.close()


@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("nvme", "nvme")])
def test_overlap_backward_without_clipping_equals_plain_pytorch(swap_dir, param, optimizer):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, _ = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, "backward"))
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("nvme", "nvme")])
def test_clipping_equals_clip_grad_norm(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, _ = reference_run(model, data, clip=0.05)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, overlap, gradient_clipping=0.05))
    engine_run(engine, data)
    assert engine.last_grad_norm > 0.05  # clipping was active
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


@pytest.mark.parametrize("param,optimizer", [("cpu", "cpu"), ("nvme", "nvme")])
def test_accumulation_equals_larger_batch(swap_dir, param, optimizer):
    torch.manual_seed(0)
    model = TinyNet()
    micro = batches(12, batch=8)
    merged = [
        (torch.cat([a[0], b[0], c[0]]), torch.cat([a[1], b[1], c[1]])) for a, b, c in zip(micro[0::3], micro[1::3], micro[2::3])
    ]
    reference, _ = reference_run(model, merged)
    engine = offload.initialize(
        copy.deepcopy(model), make_config(swap_dir, param, optimizer, "forward", gradient_accumulation_steps=3)
    )
    stepped = []
    for x, y in micro:
        engine.backward(mse(engine, x, y))
        stepped.append(engine.step())
    assert stepped == [False, False, True] * 4
    assert engine.global_steps == 4
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_adam_l2_mode_equals_torch_adam(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, _ = reference_run(model, data, adam=True)
    config = make_config(swap_dir, "cpu", "cpu")
    config["optimizer"]["type"] = "adam"
    engine = offload.initialize(copy.deepcopy(model), config)
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("nvme", "nvme")])
def test_bf16_tracks_reference_loss(swap_dir, param, optimizer):
    """bf16 compute (fp32 master and Adam): losses within 2% of fp32 training over 20 steps."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(20)
    _, reference_losses = reference_run(model, data, lr=3e-3)
    config = make_config(swap_dir, param, optimizer, "forward", precision="bf16")
    config["optimizer"]["lr"] = 3e-3
    engine = offload.initialize(copy.deepcopy(model), config)
    losses = engine_run(engine, data)
    for got, want in zip(losses, reference_losses):
        assert abs(got - want) <= 0.02 * abs(want) + 0.02
    assert losses[-1] < losses[0]
    engine.close()


def test_fp16_overflow_skips_exactly_that_step(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    config = make_config(swap_dir, "cpu", "cpu", "forward", precision="fp16")
    config["loss_scale"] = {"initial": 1024.0, "growth_interval": 1000}
    engine = offload.initialize(copy.deepcopy(model), config)
    results = []
    for i, (x, y) in enumerate(data):
        before = engine.consolidated_state_dict()
        loss = mse(engine, x, y)
        if i == 3:
            loss = loss * 1e30  # overflows fp16 gradients
        engine.backward(loss)
        results.append(engine.step())
        after = engine.consolidated_state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        assert changed == results[-1]
    assert results == [True, True, True, False, True, True]
    assert engine.skipped_steps == 1
    assert engine.scaler.scale == 512.0
    engine.close()


def test_nonfinite_loss_is_an_error_and_changes_nothing(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "nvme", "nvme", "forward"))
    engine_run(engine, batches(2))
    before = engine.consolidated_state_dict()
    x, y = batches(1, seed=5)[0]
    with pytest.raises(offload.NonFiniteError, match="loss is nan"):
        engine.backward(mse(engine, x, y) * float("nan"))
    assert engine.step() is False
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine_run(engine, batches(2, seed=7))  # training goes on
    engine.close()


def test_nonfinite_gradient_is_an_error_and_changes_nothing(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "cpu", "cpu", "forward"))
    engine_run(engine, batches(2))
    before = engine.consolidated_state_dict()
    x, y = batches(1, seed=5)[0]
    out = engine(x)
    # finite loss, NaN gradients: d sqrt(u)/du at u = 0 is inf, times 0 is NaN
    loss = ((out - y.to(out.device)) ** 2).mean() + 0.0 * torch.sqrt(out - out.detach()).sum()
    assert math.isfinite(loss.item())
    engine.backward(loss)
    with pytest.raises(offload.NonFiniteError, match="non-finite gradients"):
        engine.step()
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine_run(engine, batches(2, seed=7))  # the window was discarded: training goes on
    assert engine.global_steps == 4
    engine.close()


@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_device_param_bytes_are_bounded_by_prefetch_depth(swap_dir, param, depth):
    torch.manual_seed(0)
    model = TinyNet(width=64, depth=8)
    config = make_config(swap_dir, param, "cpu", "forward", prefetch={"depth": depth})
    engine = offload.initialize(model, config)
    engine_run(engine, batches(3))
    report = engine.memory_report()["device"]["by_category"]["param"]
    unit_bytes = [unit.layout.padded_numel * 4 for unit in engine.units]
    root, largest = unit_bytes[0], max(unit_bytes[1:])
    assert report["peak"] <= (depth + 2) * largest + root
    assert report["peak"] >= largest + root  # something was on the device
    assert report["current"] == 0  # all released after the step
    engine.close()


@pytest.mark.parametrize("depth", [4, 16])
def test_host_optimizer_bytes_on_nvme_do_not_grow_with_the_model(swap_dir, depth):
    config = make_config(swap_dir, "nvme", "nvme", "forward")
    # the gradients on NVMe too: kept in RAM they would grow with the model by design
    config["offload"]["gradient_memory"] = 0
    peaks = []
    for blocks in (depth, 2 * depth):
        torch.manual_seed(0)
        engine = offload.initialize(TinyNet(width=64, depth=blocks), config)
        engine_run(engine, batches(2))
        host = engine.memory_report()["host"]
        peaks.append(host["peak"])
        assert host["peak"] <= sum(engine.store.budget.values()) + 4096 * 64
        engine.close()
    assert peaks[0] == peaks[1]


def test_prefetch_falls_back_when_the_order_changes(swap_dir):
    """A model whose forward takes a different branch on some steps trains exactly."""

    class Branchy(TinyNet):
        def forward(self, x):
            h = self.inp(x)
            order = self.blocks if x.sum() > 0 else reversed(self.blocks)
            for block in order:
                h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    model = Branchy()
    data = batches(10)
    reference, _ = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "nvme", "cpu", "forward"))
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_module_called_twice_and_param_read_outside_its_forward(swap_dir):
    class Reuse(TinyNet):
        def forward(self, x):
            h = self.inp(x)
            h = self.blocks[0](h)
            h = self.blocks[0](h)  # the same unit twice
            for block in self.blocks[1:]:
                h = block(h)
            h = h + h @ self.blocks[2].down.weight @ self.blocks[2].down.weight.t()  # read outside its forward
            return self.out(h)

    torch.manual_seed(0)
    model = Reuse()
    data = batches(8)
    reference, _ = reference_run(model, data)
    for param in ("cpu", "nvme"):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, "cpu", "forward"))
        engine_run(engine, data)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
        engine.close()


def test_unused_parameter_is_not_stepped_like_torch(swap_dir):
    class Partial(TinyNet):
        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks[:-1]:  # the last block never runs
                h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    model = Partial()
    data = batches(5)
    reference, _ = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "cpu", "cpu", "forward"))
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_eval_forward_under_no_grad_releases_everything(swap_dir):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), make_config(swap_dir, "nvme", "nvme", "forward"))
    engine_run(engine, batches(2))
    with torch.no_grad():
        out = engine(batches(1)[0][0])
    assert out.shape == (16, 1)
    assert engine.memory_report()["device"]["by_category"]["param"]["current"] == 0
    engine.close()


def test_close_removes_swap_files_and_restores_weights(swap_dir):
    import os

    torch.manual_seed(0)
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir, "nvme", "nvme", "forward"))
    engine_run(engine, batches(3))
    final = engine.consolidated_state_dict()
    engine.close()
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(swap_dir) for f in files]
    assert leftovers == []
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name])
    with pytest.raises(offload.OffloadError, match="closed"):
        engine.step()


# ---- bad input ------------------------------------------------------------------------------


def test_unknown_key_names_the_nearest(swap_dir):
    with pytest.raises(offload.ConfigError, match="'offload.parm'.*'param'"):
        offload.initialize(TinyNet(), {"offload": {"parm": "cpu"}})


def test_wrong_type_is_an_error():
    with pytest.raises(offload.ConfigError, match="prefetch.depth"):
        offload.initialize(TinyNet(), {"prefetch": {"depth": "two"}})


def test_model_without_parameters_is_an_error():
    with pytest.raises(offload.ConfigError, match="no parameters"):
        offload.initialize(torch.nn.ReLU(), {})


@pytest.mark.parametrize(
    "path,message",
    [("/nonexistent/offload-swap", "does not exist|missing|create"), ("/proc/offload-swap-test", "")],
)
def test_bad_nvme_path_is_an_error_before_any_state(path, message):
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(offload.OffloadError, match=message or None):
        offload.initialize(model, {"offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": path}})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_nvme_path_too_small_is_an_error(small_tmpfs):
    with pytest.raises(offload.InsufficientSpaceError, match="free"):
        offload.initialize(TinyNet(width=256, depth=4), {"offload": {"optimizer": "nvme", "nvme_path": str(small_tmpfs)}})
    assert [f for _, _, files in os.walk(small_tmpfs) for f in files] == []
