"""Collectives over torch.distributed; identities at world size 1.

Device tensors go through the default group (NCCL on GPUs, gloo on CPU). Host-side scalars
(the gradient norm, the overflow flag) go through a gloo group, because a CPU tensor must
never be handed to NCCL. Every collective is issued from the main thread, in the same order
on every rank.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Collectives:
    """The process group the engine shards over, and a gloo group for host reductions."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, timeout_s: float | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.group = group or dist.group.WORLD
            self.world_size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        else:
            self.world_size = 1
            self.rank = 0
        self.host_group = None
        if self.world_size > 1:
            backend = dist.get_backend(self.group)
            if backend == "gloo":
                self.host_group = self.group
            else:
                ranks = dist.get_process_group_ranks(self.group)
                kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
                self.host_group = dist.new_group(ranks=ranks, backend="gloo", **kwargs)
                logger.info("created a gloo group for host-side reductions beside the %s group", backend)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def all_gather_flat(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fills `full` (world_size * shard.numel()) with every rank's shard, in rank order."""
        if not self.is_distributed:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        dist.all_gather_into_tensor(full, shard, group=self.group)

    def reduce_scatter_flat(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """`shard` receives this rank's part of the sum of every rank's `full`."""
        if not self.is_distributed:
            if full.data_ptr() != shard.data_ptr():
                shard.copy_(full)
            return
        dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM, group=self.group)

    def sum_host(self, values: list[float]) -> list[float]:
        """Sums host scalars over ranks (through gloo)."""
        if not self.is_distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.host_group)
        return tensor.tolist()

    def max_host(self, value: float) -> float:
        if not self.is_distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return float(tensor.item())

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier(group=self.host_group)
