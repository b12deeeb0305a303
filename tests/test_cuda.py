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
    assert all(unit.host["master"].is_pinned() for unit in engine.units)
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
