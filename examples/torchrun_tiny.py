"""Sharded offloaded training at tiny size, launched with torchrun (runs on CPUs or GPUs).

Every rank owns 1/N of each unit's fp32 master weights, Adam states and gradients (on the
tiers the config names) and sees 1/N of each batch; `offload.initialize` starts the process
group from torchrun's environment (NCCL on GPUs, gloo on CPUs; timeout OFFLOAD_DIST_TIMEOUT_S,
default 600 s), or uses the one the script already initialised.

Single node, 2 processes (one GPU each; `--device cpu` runs them on the CPU with gloo, e.g. on
a machine with fewer GPUs than processes):

    torchrun --standalone --nproc_per_node 2 examples/torchrun_tiny.py

Two nodes, 4 processes each (run on every node; node_rank 0 on the first):

    torchrun --nnodes 2 --nproc_per_node 4 --node_rank 0 \\
        --rdzv_backend c10d --rdzv_endpoint first-node-host:29500 --rdzv_id my-run \\
        examples/torchrun_tiny.py --nvme /nvme0 /nvme1 /nvme2 /nvme3

With several paths after --nvme, local rank r keeps its swap files on path[r % len] (one
disk per local rank), under <path>/<run>/rank<global rank>/. Plain `python
examples/torchrun_tiny.py` runs the same thing as one process.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
from torch import nn

import offload

log = logging.getLogger("torchrun_tiny")


class TinyModel(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--param", default="cpu", choices=["none", "cpu", "nvme"])
    parser.add_argument("--optimizer", default="cpu", choices=["cpu", "nvme"])
    parser.add_argument("--nvme", nargs="*", default=None, help="swap directories (one per local rank, round robin)")
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu"],
        help="auto: GPU LOCAL_RANK when CUDA is present (NCCL), else the CPU (gloo); cpu: the CPU (gloo)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    device = "cpu" if args.device == "cpu" else None  # None: offload picks (and starts the group to match)
    on_cuda = device is None and torch.cuda.is_available()
    nvme = args.nvme or [tempfile.gettempdir()]
    config = {
        "precision": "bf16" if on_cuda else "fp32",
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "offload": {"param": args.param, "optimizer": args.optimizer, "nvme_path": nvme if len(nvme) > 1 else nvme[0]},
        "overlap": "forward",
    }
    torch.manual_seed(0)  # every rank starts from rank 0's weights anyway
    with offload.initialize(TinyModel(), config, device=device) as engine:
        rank, world = engine.collectives.rank, engine.collectives.world_size
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
        local = args.global_batch // world
        generator = torch.Generator().manual_seed(1)
        target = torch.randn(16, 1, generator=generator)
        for step in range(args.steps):
            # the same global batch on every rank; each rank trains on its own slice
            x = torch.randn(args.global_batch, 16, generator=generator)
            y = x @ target
            xs, ys = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            loss = ((engine(xs).float() - ys.to(engine.device.torch_device)) ** 2).mean()
            engine.backward(loss)
            engine.step()
            if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
                log.info("step %d loss(rank 0 slice) %.4f grad norm %.4f", step, loss.item(), engine.last_grad_norm or 0.0)
        report = engine.memory_report()
        log.info(
            "rank %d/%d: host %.2f MB, nvme %.2f MB, device peak %.2f MB",
            rank,
            world,
            report.get("host", {}).get("current", 0) / 1e6,
            report.get("nvme", {}).get("current", 0) / 1e6,
            report.get("device", {}).get("peak", 0) / 1e6,
        )
    if os.environ.get("WORLD_SIZE", "1") != "1":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
