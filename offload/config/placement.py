"""Where each kind of training state lives: the tiers as objects.

The config names them by strings (`offload.param`: none / cpu / nvme; `offload.optimizer`:
cpu / nvme); the engine turns them into these enums once and asks them questions instead of
comparing strings. They are `str` enums, so a member still equals its config string.
"""

from __future__ import annotations

import enum


class ParamTier(str, enum.Enum):
    """Where a unit's 16-bit weights live between uses."""

    DEVICE = "none"  # on the accelerator all the time (config value `none`: not offloaded)
    HOST = "cpu"  # a host buffer, copied to the device before each use
    NVME = "nvme"  # a swap file, read through a host staging buffer before each use

    @property
    def offloaded(self) -> bool:
        """The device copy exists only while the unit is in use (fetched before, freed after)."""
        return self is not ParamTier.DEVICE

    @property
    def host_copy(self) -> bool:
        """Each unit has a resident host buffer of its 16-bit shard (its home, or with the
        weights on a CUDA device, the pinned source the new weights are copied from)."""
        return self is ParamTier.HOST


class OptimizerTier(str, enum.Enum):
    """Where the optimizer state (fp32 master weights, Adam moments, gradient) lives."""

    DEVICE = "device"  # on the accelerator, stepped there (offload.optimizer: auto may choose it)
    HOST = "cpu"  # resident host buffers, stepped in place
    NVME = "nvme"  # swap files, streamed through `buffer_count` host slots during the step

    @property
    def streamed(self) -> bool:
        return self is OptimizerTier.NVME
