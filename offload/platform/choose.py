"""Which device the engine runs on: `initialize`'s `device` argument, else `OFFLOAD_DEVICE` from the
environment, else CUDA when present, else the CPU (offload.platform.device), or the checked
stand-in (offload.platform.checked_device)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from offload.errors import ConfigError
from offload.platform.checked_device import CheckedDevice
from offload.platform.device import DEVICE_KINDS, Device


def device_choice(device: Device | torch.device | str | None, environ: Mapping[str, str]) -> Device | str | torch.device | None:
    """What to build: `device` when given, else `OFFLOAD_DEVICE` from `environ`, else None (CUDA
    when present). An unknown string is a ConfigError listing the accepted ones."""
    if isinstance(device, Device):
        return device
    choice: torch.device | str | None = device
    source = "initialize(device=...)"
    if choice is None and environ.get("OFFLOAD_DEVICE"):
        choice, source = environ["OFFLOAD_DEVICE"].strip(), "OFFLOAD_DEVICE"
    if isinstance(choice, str):
        kind = choice.split(":", 1)[0]
        if kind not in DEVICE_KINDS or (kind != "cuda" and ":" in choice):
            raise ConfigError(
                f"{source}={choice!r} is not a device offload runs on: use one of "
                f"{', '.join(DEVICE_KINDS)} or cuda:N ('checked' is the CPU standing in for an "
                "asynchronous accelerator, for tests)"
            )
    return choice


def make_device(device: Device | torch.device | str | None = None, environ: Mapping[str, str] | None = None) -> Device:
    """The engine's device: `device` (a torch device, "cpu", "cuda[:N]", "checked", or a Device
    built beforehand, e.g. a CheckedDevice with its own bandwidths), else `OFFLOAD_DEVICE`, else
    CUDA when present, else the CPU."""
    choice = device_choice(device, os.environ if environ is None else environ)
    if isinstance(choice, Device):
        return choice
    if choice == "checked":
        return CheckedDevice.from_environ(os.environ if environ is None else environ)
    return Device(choice)
