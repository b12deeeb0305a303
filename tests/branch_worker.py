"""Ranks that take different branches of the model: the worker side of tests/test_rank_agreement.py.

Each rank runs BranchNet on its half of every batch and skips the block that SKIPS says for
its rank and step (None: runs every block). Run under distributed_worker.launch (gloo, CPU).
"""

from __future__ import annotations

import copy

import torch
from distributed_worker import RANK_DEVICE, local_half
from reference import TinyNet, batches
from torch import nn

import offload

# per step, the block each rank skips; at step 2 both skip block 2 (no gradient on any rank:
# it must not step), at step 5 both skip block 1
SKIPS = {
    0: [None, 1, 2, None, 3, 1],
    1: [2, None, 2, 3, None, 1],
}
STEPS = len(SKIPS[0])


class BranchNet(TinyNet):
    """TinyNet that skips block `skip` (None: runs them all)."""

    def forward(self, x, skip=None):
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index != skip:
                h = block(h)
        return self.out(h)


def model_and_data():
    torch.manual_seed(0)
    return BranchNet(), batches(STEPS)


def reference(world_size: int = 2) -> tuple[nn.Module, list[float]]:
    """One process, plain AdamW: the mean over ranks of each rank's loss on its half and branch."""
    model, data = model_and_data()
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step, batch in enumerate(data):
        total = 0.0
        for rank in range(world_size):
            x, y = local_half(batch, rank, world_size)
            total = total + ((model(x, SKIPS[rank][step]) - y) ** 2).mean() / world_size
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # a block no rank ran has no gradient: not stepped
        losses.append(total.item())
    return model, losses


def train(rank: int, world_size: int, config: dict) -> dict:
    model, data = model_and_data()
    with offload.initialize(copy.deepcopy(model), config, device=RANK_DEVICE) as engine:
        for step, batch in enumerate(data):
            x, y = local_half(batch, rank, world_size)
            loss = ((engine(x, SKIPS[rank][step]) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
        weights = engine.consolidated_state_dict()
    return {"weights": weights if rank == 0 else None}
