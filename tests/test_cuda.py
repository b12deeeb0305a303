"""The CUDA paths (pinned host buffers, copy stream, events); skipped without a CUDA device."""

import copy

import pytest
import torch
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, reference_run

import offload

pytestmark = pytest.mark.cuda


def fp32_config(swap_dir, param, optimizer, overlap):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }


@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_cuda_fp32_equals_plain_pytorch(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, _ = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), fp32_config(swap_dir, param, optimizer, overlap))
    assert engine.device.is_cuda
    engine_run(engine, [(x.cuda(), y.cuda()) for x, y in data])  # inputs already on the device
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_cuda_host_buffers_are_pinned(swap_dir):
    engine = offload.initialize(TinyNet(), {"offload": {"param": "cpu", "optimizer": "cpu"}})
    assert all(unit.resident_state["master"].is_pinned() for unit in engine.units)
    engine.close()


def test_device_cpu_on_a_cuda_machine_computes_on_the_cpu(swap_dir):
    """device="cpu" keeps everything off the GPU (no pinned buffers, outputs on the CPU) and
    trains exactly like the CPU reference."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(5)
    reference, _ = reference_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), fp32_config(swap_dir, "cpu", "cpu", "forward"), device="cpu")
    assert not engine.device.is_cuda and not engine.device.pin_host_memory
    with torch.no_grad():
        assert engine(data[0][0]).device.type == "cpu"
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_cuda_auto_puts_a_small_state_on_the_gpu_and_its_checkpoint_loads_on_the_host(tmp_path, swap_dir):
    """With the GPU's spare memory measured at start, `auto` keeps a small model's whole state
    there (stepped by the fused Adam on the GPU); a checkpoint saved from it (device tensors
    copied out unit by unit) resumes on the host tier like an all-host run."""
    torch.manual_seed(0)
    model = TinyNet(depth=4)
    data = [(x.cuda(), y.cuda()) for x, y in batches(8)]
    with offload.initialize(copy.deepcopy(model), fp32_config(swap_dir, "cpu", "cpu", "forward")) as straight:
        engine_run(straight, data)
        expected = straight.consolidated_state_dict()
    with offload.initialize(copy.deepcopy(model), fp32_config(swap_dir, "cpu", "auto", "forward")) as on_gpu:
        assert {e["tier"] for e in on_gpu.memory_report()["optimizer_units"].values()} == {"device"}
        assert all(unit.resident_state["master"].is_cuda for unit in on_gpu.units)
        engine_run(on_gpu, data[:4])
        on_gpu.save_checkpoint(tmp_path / "ckpt")
    with offload.initialize(copy.deepcopy(model), fp32_config(swap_dir, "cpu", "cpu", "forward")) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        engine_run(resumed, data[4:])
        got = resumed.consolidated_state_dict()
    gap = max(float((got[name] - expected[name]).abs().max()) for name in expected)
    assert gap <= fp32_weight_tolerance(resumed)
