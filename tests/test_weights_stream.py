"""Pretrained weights streamed into the engine (`initialize(..., weights=)`, offload.runtime.weights_in)
on a small model, fast enough for every placement, one and two ranks, and the checked device:
the start values are the file's exactly, training is plain AdamW's, each rank reads only its
shards, the params the file lacks take rank 0's init on every rank, persistent buffers come
from the file, and frozen params come back in the file's dtype."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_worker import RANK_DEVICE, launch
from reference import TinyNet, batches, engine_run, max_weight_difference, mse, reference_run
from safetensors.torch import save_file
from torch import nn

import offload

# blocks of 16.7k elements: two ranks' shards of a unit are 10240 and 6.4k of them
WIDTH, DEPTH = 64, 3


def saved_model(directory, dtype=torch.float32, drop=()):
    """A seeded TinyNet's weights in one file per block (the root's in the first), as `dtype`."""
    torch.manual_seed(7)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items() if k not in drop}
    directory.mkdir(exist_ok=True)
    for index in range(DEPTH):
        part = {k: v for k, v in state.items() if k.startswith(f"blocks.{index}.") or (index == 0 and "blocks" not in k)}
        save_file(part, str(directory / f"part{index}.safetensors"))
    weight_map = {k: f"part{int(k.split('.')[1]) if k.startswith('blocks.') else 0}.safetensors" for k in state}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model, state


def meta_net():
    with torch.device("meta"):
        return TinyNet(width=WIDTH, depth=DEPTH)


def config(swap, param, optimizer, threads=0):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "threads": threads},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": str(swap)},
    }


@pytest.mark.parametrize("param, optimizer", [("none", "nvme"), ("cpu", "cpu"), ("nvme", "nvme")], ids=str)
def test_a_meta_model_starts_from_the_file_and_trains_like_adamw(tmp_path, swap_dir, param, optimizer):
    model, state = saved_model(tmp_path / "w")
    data = batches(3, inputs=8)
    reference, _ = reference_run(model, data)
    with offload.initialize(meta_net(), config(swap_dir, param, optimizer), weights=tmp_path / "w") as engine:
        start = engine.consolidated_state_dict()
        assert all(torch.equal(start[k], v) for k, v in state.items())
        engine_run(engine, data)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= 1e-5


def test_a_model_built_on_the_cpu_takes_the_files_values(tmp_path, swap_dir):
    _, state = saved_model(tmp_path / "w")
    model = TinyNet(width=WIDTH, depth=DEPTH)  # drawn from another seed
    with offload.initialize(model, config(swap_dir, "cpu", "cpu"), weights=tmp_path / "w") as engine:
        loaded = engine.consolidated_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


class Normed(nn.Module):
    """TinyNet with a persistent buffer (a scale the file holds) and a non-persistent one the
    model computes (reset_parameters fills both: materialize calls it for the missing ones)."""

    def __init__(self):
        super().__init__()
        self.net = TinyNet(width=WIDTH, depth=DEPTH)
        self.register_buffer("scale", torch.empty(1))
        self.register_buffer("offset", torch.empty(1), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        self.scale.fill_(1.0)
        self.offset.fill_(0.5)

    def forward(self, x):
        return self.net(x) * self.scale + self.offset


def test_persistent_buffers_come_from_the_file_and_the_others_from_the_model(tmp_path, swap_dir):
    torch.manual_seed(3)
    state = {k: v.contiguous() for k, v in Normed().state_dict().items()}
    state["scale"] = torch.tensor([3.0])
    save_file(state, str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        model = Normed()
    with offload.initialize(model, config(swap_dir, "cpu", "cpu"), weights=tmp_path / "w.safetensors") as engine:
        x = torch.randn(4, 8)
        out = engine(x).detach().cpu()
    model.load_state_dict(state)
    assert model.scale.item() == 3.0 and model.offset.item() == 0.5
    with torch.no_grad():
        assert torch.allclose(out, model(x), atol=1e-6)


def test_frozen_params_come_back_in_the_files_dtype(tmp_path, swap_dir):
    _, state = saved_model(tmp_path / "w", dtype=torch.bfloat16)
    model = meta_net()
    for param in model.blocks.parameters():
        param.requires_grad_(False)
    engine = offload.initialize(model, config(swap_dir, "cpu", "cpu"), weights=tmp_path / "w")
    engine_run(engine, batches(2, inputs=8))
    engine.close()
    for name, param in model.blocks.named_parameters(prefix="blocks"):
        assert param.dtype == torch.bfloat16 and torch.equal(param, state[name]), name
    assert model.inp.weight.dtype == torch.float32


def _two_ranks(rank, world, directory, swaps, cases):
    results = []
    for param, optimizer in cases:
        torch.manual_seed(100 + rank)  # each rank would draw other values for the missing params
        engine = offload.initialize(meta_net(), config(swaps[rank], param, optimizer, 1), weights=directory, device=RANK_DEVICE)
        read = engine._runtime.weights_load.bytes
        start = engine.consolidated_state_dict()
        for x, y in batches(3, inputs=8):
            engine.backward(mse(engine, x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8]))  # half of 16
            engine.step()
        results.append((read, start, engine.consolidated_state_dict()))
        engine.close(restore_weights=False)
    return results


def test_two_ranks_read_their_shards_and_agree_on_the_missing_params(tmp_path):
    """`blocks.1.down.weight` (across both ranks' shards of its unit) is not in the file: each rank
    draws it from its own seed, the engine takes rank 0's on both, so two ranks start from what one
    process seeded as rank 0 starts from (not from a mix of two draws); both ranks then train like
    one process with plain AdamW."""
    saved_model(tmp_path / "w", drop=("blocks.1.down.weight",))
    swaps = []
    for rank in range(2):
        (tmp_path / f"swap{rank}").mkdir()
        swaps.append(str(tmp_path / f"swap{rank}"))
    cases = [("none", "cpu"), ("nvme", "nvme")]
    results = launch(_two_ranks, 2, str(tmp_path / "w"), swaps, cases, deadline_s=180.0)
    assert all(r["ok"] for r in results), results
    total = sum(f.stat().st_size for f in (tmp_path / "w").glob("*.safetensors"))
    torch.manual_seed(100)
    with offload.initialize(meta_net(), config(tmp_path / "swap0", "cpu", "cpu"), weights=tmp_path / "w") as engine:
        one_process = engine.consolidated_state_dict()
    for index in range(len(cases)):
        (read0, start0, final0), (read1, start1, final1) = (r["value"][index] for r in results)
        assert read0 < 0.75 * total and read1 < 0.75 * total and read0 + read1 <= total, (read0, read1, total)
        assert all(torch.equal(start0[k], one_process[k]) and torch.equal(start1[k], one_process[k]) for k in start0)
        reference = TinyNet(width=WIDTH, depth=DEPTH)
        reference.load_state_dict(start0)
        reference, _ = reference_run(reference, batches(3, inputs=8))
        assert max_weight_difference(final0, reference) <= 1e-5
        assert all(torch.equal(final0[k], final1[k]) for k in final0)
