"""What one node offers the estimate (`Machine`), and the probe of this one (`detect_machine`).

The part of the estimate that touches the machine: the first GPU's memory (torch.cuda),
available RAM (psutil) and free disk space at the swap path (`free_disk_bytes`). Everything
else in `offload.plan.estimate` is plain functions over sizes.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from offload.errors import ConfigError

DEVICE_KINDS = ("cuda", "cpu")


# ---- the machine ---------------------------------------------------------------------------
@dataclass
class Machine:
    """What one node offers. gpu_bytes None: no accelerator (the CPU stands in; the device tier
    is host RAM). ranks_per_node: ranks sharing this node's RAM and disk."""

    gpu_bytes: int | None
    ram_bytes: int
    disk_bytes: int
    ranks_per_node: int = 1
    nvme_path: str = "./offload-swap"
    device: str | None = None
    """The kind the engine runs on: `cuda` (host staging buffers for the copies) or `cpu`;
    None: `cuda` when gpu_bytes is given, else `cpu`."""

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cpu" if self.gpu_bytes is None else "cuda"
        if self.device not in DEVICE_KINDS:
            raise ConfigError(f"device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}", key="device")
        if self.device == "cpu":
            self.gpu_bytes = None  # the CPU stands in for the accelerator: its memory is the host's


def detect_machine(nvme_path: str = "./offload-swap", ranks_per_node: int = 1) -> Machine:
    """This machine: the first GPU's memory (torch), available RAM (psutil), free space at nvme_path."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_properties(0).total_memory if cuda else None
    return Machine(
        gpu,
        int(psutil.virtual_memory().available),
        free_disk_bytes(nvme_path),
        ranks_per_node,
        nvme_path,
        "cuda" if cuda else "cpu",
    )


def free_disk_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)
