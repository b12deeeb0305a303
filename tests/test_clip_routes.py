"""Clipping on every route (issue 31): `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`
in a loop written for plain PyTorch, and `engine.clip_grad_norm_`, clip on the engine's global
norm exactly as torch does (weights within fp32 rounding of torch AdamW with the same clipping,
the norm returned equal to torch's), or raise naming the route that works. Never a silent 0."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse

import offload
from offload.errors import OffloadError
from offload.runtime.grad_handles import GradHandle, GradientNotAvailableError, combine_norms, torch_clip_coefficient

MAX_NORM = 0.05  # below every gradient norm of these runs: clipping acts at each step


def make_config(swap_dir, param="cpu", optimizer="cpu", overlap="none", precision="fp32", **extra):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "threads": 1},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    config.update(extra)
    return config


def torch_clipped_run(model, data, *, max_norm=MAX_NORM, norm_type=2.0, accumulation=1):
    """torch AdamW with clip_grad_norm_ at each window's end; returns (model, norms)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms = []
    for i, (x, y) in enumerate(data):
        (mse(model, x, y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)))
            optimizer.step()
            optimizer.zero_grad()
    return model, norms


def engine_clipped_run(engine, data, *, clip, accumulation=1):
    """The same loop on the engine: loss.backward(), `clip()` at each window's end, engine.optimizer.step()."""
    norms = []
    for i, (x, y) in enumerate(data):
        (mse(engine, x, y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            norms.append(float(clip()))
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return norms


# each param tier (none, cpu), optimizer tier (cpu, nvme) and overlap (none, forward) twice
@pytest.mark.parametrize(
    "param,optimizer,overlap",
    [("none", "cpu", "forward"), ("cpu", "cpu", "none"), ("none", "nvme", "none"), ("cpu", "nvme", "forward")],
)
def test_torch_clip_grad_norm_in_a_plain_loop_equals_torch(swap_dir, param, optimizer, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    reference, torch_norms = torch_clipped_run(model, data)
    assert min(torch_norms) > MAX_NORM  # clipping acted at every step
    with offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, overlap)) as engine:
        clip = lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), MAX_NORM)  # noqa: E731
        norms = engine_clipped_run(engine, data, clip=clip)
        assert norms == pytest.approx(torch_norms, rel=1e-5)
        assert engine.last_grad_norm == pytest.approx(torch_norms[-1], rel=1e-5)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
        # nothing left behind: each .grad went back to None at step()
        assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_engine_clip_grad_norm_equals_torch_for_each_norm_type(swap_dir, norm_type):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    max_norm = MAX_NORM
    reference, torch_norms = torch_clipped_run(model, data, max_norm=max_norm, norm_type=norm_type)
    placement = ("cpu", "nvme", "forward") if norm_type == 2.0 else ("none", "cpu", "none")
    with offload.initialize(copy.deepcopy(model), make_config(swap_dir, *placement)) as engine:
        norms = engine_clipped_run(engine, data, clip=lambda: engine.clip_grad_norm_(max_norm, norm_type))
        assert norms == pytest.approx(torch_norms, rel=1e-5)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)


@pytest.mark.parametrize("norm_type", [math.inf])
def test_torch_clip_with_other_norm_types_equals_torch(swap_dir, norm_type):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    max_norm = 0.01
    reference, torch_norms = torch_clipped_run(model, data, max_norm=max_norm, norm_type=norm_type)
    with offload.initialize(copy.deepcopy(model), make_config(swap_dir, "none", "cpu")) as engine:
        clip = lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), max_norm, norm_type=norm_type)  # noqa: E731
        norms = engine_clipped_run(engine, data, clip=clip)
        assert norms == pytest.approx(torch_norms, rel=1e-5)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)


def test_clipping_at_the_end_of_an_accumulation_window_equals_torch(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    reference, torch_norms = torch_clipped_run(model, data, accumulation=3)
    config = make_config(swap_dir, "cpu", "cpu", "forward", gradient_accumulation_steps=3)
    with offload.initialize(copy.deepcopy(model), config) as engine:
        clip = lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), MAX_NORM)  # noqa: E731
        norms = engine_clipped_run(engine, data, clip=clip, accumulation=3)
        assert engine.global_steps == 2
        assert norms == pytest.approx(torch_norms, rel=1e-5)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
        # in the middle of a window there is no gradient yet to clip: said so, not a silent 0
        mse(engine, *data[0]).backward()
        with pytest.raises(OffloadError, match="after the backward that ends a gradient window"):
            engine.clip_grad_norm_(1.0)


def test_user_clipping_and_config_clipping_compose_as_torch_twice(swap_dir):
    """The config's gradient_clipping acts on the gradients clip_grad_norm_ left, as a second
    clip_grad_norm_ would; with overlap 'backward' the speculative steps are redone."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(3)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in data:
        mse(reference, x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.2)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    config = make_config(swap_dir, "cpu", "cpu", "backward", gradient_clipping=MAX_NORM)
    with offload.initialize(copy.deepcopy(model), config) as engine:
        engine_clipped_run(engine, data, clip=lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 0.2))
        assert engine.speculation_counts["redone"] == 3
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)


def test_overlap_backward_stepping_in_place_refuses_clipping_naming_gradient_clipping(swap_dir):
    with offload.initialize(TinyNet(), make_config(swap_dir, "cpu", "cpu", "backward")) as engine:
        x, y = batches(1)[0]
        mse(engine, x, y).backward()
        with pytest.raises(GradientNotAvailableError, match="gradient_clipping"):
            torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 1.0)
        with pytest.raises(OffloadError, match="gradient_clipping"):
            engine.clip_grad_norm_(1.0)
        assert engine.step()


def test_fp16_norm_is_of_the_unscaled_gradients(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(copy.deepcopy(model), make_config(swap_dir, "cpu", "cpu", precision="fp16")) as engine:
        x, y = batches(1)[0]
        engine.backward(mse(engine, x, y))
        assert engine.scaler.scale > 1000
        torch_route = float(torch.nn.utils.clip_grad_norm_(engine.model.parameters(), math.inf))
        norm = float(engine.clip_grad_norm_(math.inf))
        assert engine.step()
        assert torch_route == pytest.approx(engine.last_grad_norm, rel=1e-5)
        assert norm == pytest.approx(engine.last_grad_norm, rel=1e-5)
    plain = copy.deepcopy(model)
    mse(plain, x, y).backward()
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf)), rel=1e-2)


def test_what_the_engine_gradient_cannot_do_is_refused_naming_the_routes(swap_dir):
    with offload.initialize(TinyNet(), make_config(swap_dir)) as engine:
        x, y = batches(1)[0]
        mse(engine, x, y).backward()
        grad = engine.model.inp.weight.grad
        assert isinstance(grad, GradHandle) and grad.shape == engine.model.inp.weight.shape
        for read in (lambda: grad.sum(), lambda: grad.zero_(), lambda: grad + 1, lambda: grad.clone()):
            with pytest.raises(GradientNotAvailableError, match=r"clip_grad_norm_.*engine\.clip_grad_norm_"):
                read()
        assert "engine's gradient" in repr(grad)
        # one parameter's norm: as torch gives it
        assert float(grad.norm()) > 0
        # clipping only some parameters: refused at step(), before anything changes
        torch.nn.utils.clip_grad_norm_(engine.model.blocks[0].parameters(), 1e-4)
        with pytest.raises(GradientNotAvailableError, match="different factors"):
            engine.step()
        assert engine.global_steps == 0
        # a backward before step() would lose the clip: refused
        with pytest.raises(OffloadError, match=r"step\(\) was not called"):
            mse(engine, x, y).backward()
        torch.nn.utils.clip_grad_norm_(
            [p for p in engine.model.parameters() if p not in set(engine.model.blocks[0].parameters())], 1e-4
        )
        # the factors now differ again (1e-4 x torch's coefficient on block 0 only): still refused
        with pytest.raises(GradientNotAvailableError):
            engine.step()


def test_a_handle_kept_past_its_step_is_refused(swap_dir):
    with offload.initialize(TinyNet(), make_config(swap_dir)) as engine:
        x, y = batches(1)[0]
        mse(engine, x, y).backward()
        kept = engine.model.out.weight.grad
        engine.step()
        assert engine.model.out.weight.grad is None
        with pytest.raises(GradientNotAvailableError, match="past its window"):
            kept.norm()


def test_unused_parameters_have_no_gradient_as_with_torch(swap_dir):
    class Branchy(TinyNet):
        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks[:2]:
                h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    model = Branchy()
    data = batches(2)
    reference, torch_norms = torch_clipped_run(model, data)
    with offload.initialize(copy.deepcopy(model), make_config(swap_dir, "cpu", "cpu")) as engine:
        clip = lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), MAX_NORM)  # noqa: E731
        x, y = data[0]
        mse(engine, x, y).backward()
        assert engine.model.blocks[3].up.weight.grad is None and engine.model.blocks[1].up.weight.grad is not None
        norms = [float(clip())]
        engine.step()
        norms += engine_clipped_run(engine, data[1:], clip=clip)
        assert norms == pytest.approx(torch_norms, rel=1e-5)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)


def test_torch_clip_coefficient_and_combined_norms():
    for norm, max_norm in [(3.0, 1.0), (0.5, 1.0), (1e-9, 0.0), (math.inf, 1.0)]:
        expected = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
        assert torch_clip_coefficient(norm, max_norm) == float(expected)
    assert combine_norms([3.0, 4.0], 2.0) == pytest.approx(5.0)
    assert combine_norms([3.0, 4.0], 1.0) == 7.0
    assert combine_norms([3.0, 4.0], math.inf) == 4.0
    assert combine_norms([], 2.0) == 0.0


# ---- two ranks (gloo) ------------------------------------------------------------------------
def _clip_on_two_ranks(rank: int, world_size: int, swaps: list[str]) -> dict:
    from distributed_worker import RANK_DEVICE, local_half

    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(model, make_config(swaps, "cpu", "nvme", "forward"), device=RANK_DEVICE) as engine:
        data = [local_half(batch, rank, world_size) for batch in batches(3)]
        clip = lambda: torch.nn.utils.clip_grad_norm_(engine.model.parameters(), MAX_NORM)  # noqa: E731
        norms = engine_clipped_run(engine, data, clip=clip)
        return {"norms": norms, "weights": engine.consolidated_state_dict()}


def test_two_ranks_clip_on_the_global_norm_as_one_rank_with_the_whole_batch(tmp_path):
    """Each rank's handles hold the norm over both ranks' shards, of the ranks' mean gradient."""
    from distributed_worker import launch, rank_swap_dirs

    torch.manual_seed(0)
    reference, torch_norms = torch_clipped_run(TinyNet(), batches(3))
    results = launch(_clip_on_two_ranks, 2, rank_swap_dirs(tmp_path, 2), deadline_s=240)
    assert all(result["ok"] for result in results), results
    for result in results:
        assert result["value"]["norms"] == pytest.approx(torch_norms, rel=1e-5)
        assert max_weight_difference(result["value"]["weights"], reference) <= 1e-5
