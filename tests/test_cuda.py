"""The CUDA paths (pinned host buffers, copy stream, events); skipped without a CUDA device."""
import copy

import pytest
import torch

import offload
from reference import TinyNet, batches, engine_run, max_weight_difference, reference_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_cuda_fp32_equals_plain_pytorch(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(10)
    reference, _ = reference_run(model, data)
    config = {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    engine = offload.initialize(copy.deepcopy(model), config)
    assert engine.device.is_cuda
    engine_run(engine, [(x.cuda(), y.cuda()) for x, y in data])
    # TF32 may be on for matmuls: allow for it
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= 1e-4
    engine.close()


def test_cuda_host_buffers_are_pinned(swap_dir):
    engine = offload.initialize(TinyNet(), {"offload": {"param": "cpu", "optimizer": "cpu"}})
    assert all(unit.host["master"].is_pinned() for unit in engine.units)
    engine.close()
