"""Plain PyTorch training, the reference every engine test compares against.

References run in fp32 on the CPU; the engine runs on the device it picks (CUDA when present,
as offload.platform.device.Device decides), so targets go to the engine's output device and the
comparisons happen on the CPU."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

# The device offload.initialize computes on when none is given. Built without touching CUDA
# (no context is created at import: spawned or forked test processes stay clean).
ENGINE_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The kind offload.initialize builds when none is given (OFFLOAD_DEVICE, else CUDA when present),
# and whether its memory is apart from the host's (weights and gradients then cross through host
# staging buffers, which count in the host budget): CUDA and the checked stand-in
ENGINE_KIND = (os.environ.get("OFFLOAD_DEVICE") or ENGINE_DEVICE.type).split(":")[0]
ENGINE_STAGES_COPIES = ENGINE_KIND in ("cuda", "checked")

# Largest weight difference, after a few fp32 steps, between the engine and plain PyTorch AdamW.
# Adam divides by sqrt(v), so rounding differences in the gradients reach the weights nearly
# undiminished: on TinyNet the fp32 reference differs from the same run in fp64 by 6.3e-6. On
# the CPU the engine runs the same forward/backward kernels as the reference (only the Adam
# arithmetic differs), so 1e-5 holds; on CUDA the forward and backward themselves reduce in
# another order (cuBLAS, even with TF32 off), which adds about that much again (gpt_neox
# differed by 1.38e-5 on an H100). A wrong update (a step missed, a wrong lr or decay) moves
# weights by ~lr = 1e-3..1e-2 per step, far above either bound.
FP32_WEIGHT_TOLERANCE = {"cpu": 1e-5, "cuda": 5e-5}


def fp32_weight_tolerance(engine) -> float:
    """The bound for max_weight_difference of an fp32 engine run against reference_run."""
    return FP32_WEIGHT_TOLERANCE[engine.device.torch_device.type]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    """Input layer, a ModuleList of blocks (the units), an output head."""

    def __init__(self, width: int = 32, depth: int = 4, inputs: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batches(count: int, batch: int = 16, inputs: int = 8, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, inputs, generator=generator), torch.randn(batch, 1, generator=generator)) for _ in range(count)]


def mse(model, x, y):
    """Mean squared error of model(x) against y, computed where the model's output lives."""
    prediction = model(x)
    return ((prediction - y.to(prediction.device)) ** 2).mean()


def reference_run(
    model: nn.Module, data, *, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, clip=0.0, accumulation=1, adam=False
):
    """Trains a deep copy of `model` with torch.optim.AdamW (or Adam); returns (model, losses)."""
    model = copy.deepcopy(model)
    optimizer_class = torch.optim.Adam if adam else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    losses = []
    for i, (x, y) in enumerate(data):
        loss = mse(model, x, y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return model, losses


def engine_run(engine, data):
    losses = []
    for x, y in data:
        loss = mse(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def max_weight_difference(state_dict: dict, reference: nn.Module) -> float:
    """Compared on the CPU: the engine's consolidated state dict is there already, the reference too."""
    return max(
        (state_dict[name].cpu().float() - value.cpu().float()).abs().max().item()
        for name, value in reference.state_dict().items()
    )
