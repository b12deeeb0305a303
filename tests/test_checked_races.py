"""Races the checked device found in the engine, each run where it showed: on the checked device
with a slow host-to-device stream (so the copy in question is surely still queued), against the
same run on the plain CPU device, bitwise.

- A speculative step redone (overlap backward with clipping that acts, param none): the redo's
  kernel rewrote the host 16-bit copy while the speculative step's copy of it to the device was
  still queued (rule source-changed). The step now waits for the unit's last publish first.
- A checkpoint loaded right after a step (param none): the step's copy of its new weights, still
  queued, was forgotten, and could land over the loaded weights (rule read-before-wait at the
  next forward). The load now waits for it before writing the weights."""

from __future__ import annotations

import copy

import torch
from reference import TinyNet, batches, engine_run

import offload
from offload.platform.checked_device import CheckedDevice


def slow_device() -> CheckedDevice:
    # 0.2 MB/s: copying a TinyNet unit's weights takes tens of milliseconds
    return CheckedDevice(h2d_gbps=2e-4)


def config(swap_dir, overlap, **extra):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": "none", "optimizer": "cpu", "nvme_path": swap_dir},
        "overlap": overlap,
        **extra,
    }


def assert_same_run(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    assert losses_a == losses_b
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name


def test_redone_speculative_step_waits_for_its_publish(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    runs = []
    for device in ("cpu", slow_device()):
        with offload.initialize(copy.deepcopy(model), config(swap_dir, "backward", gradient_clipping=1e-3), device=device) as e:
            losses = engine_run(e, data)
            assert e.speculation_counts["redone"] == len(data)  # clipping acted: every step redone
            runs.append((losses, e.consolidated_state_dict()))
    assert_same_run(*runs)


def test_checkpoint_load_waits_for_the_steps_copies(swap_dir, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    runs = []
    for i, device in enumerate(("cpu", slow_device())):
        with offload.initialize(copy.deepcopy(model), config(swap_dir, "forward"), device=device) as e:
            engine_run(e, data[:2])
            e.save_checkpoint(str(tmp_path / f"ckpt{i}"))
            engine_run(e, data[2:3])  # its step's copies to the device are queued (slowly)
            e.load_checkpoint(str(tmp_path / f"ckpt{i}"))
            losses = engine_run(e, data[3:])
            runs.append((losses, e.consolidated_state_dict()))
    assert_same_run(*runs)
