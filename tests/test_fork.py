"""A process forked from the one that built an engine (a DataLoader worker, a multiprocessing
task under 'fork') has the engine's memory but none of its threads: any engine call there, and
the model's forward, fail at once naming the cause; the parent trains on; workers that touch
neither train as before."""

from __future__ import annotations

import copy
import multiprocessing
import os
import time

import pytest
import torch
from reference import TinyNet, batches, engine_run, mse

import offload
from offload.errors import ForkedProcessError

FORK = multiprocessing.get_context("fork")
CHILD_SECONDS = 30


def config(swap_dir, param):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2},
        "offload": {"param": param, "optimizer": "nvme" if param == "nvme" else "cpu", "nvme_path": swap_dir},
        "overlap": "forward",
    }


def _in_child(action, engine, model, x, results):
    """Runs in the forked child: reports what the call raised, and how long it took."""
    started = time.monotonic()
    try:
        if action == "forward":
            engine(x)
        elif action == "model":
            model(x)
        elif action == "step":
            engine.step()
        elif action == "weights":
            engine.consolidated_state_dict()
        elif action == "close":
            engine.close()
        results.put(("returned", "", time.monotonic() - started))
    except BaseException as error:  # noqa: BLE001 (reported to the parent)
        results.put((type(error).__name__, str(error), time.monotonic() - started))


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("action", ["forward", "model", "step", "weights", "close"])
def test_a_forked_child_fails_at_once_and_the_parent_trains_on(swap_dir, param, action):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    reference = offload.initialize(copy.deepcopy(model), config(swap_dir, param))
    expected = engine_run(reference, data)
    reference.close()
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param))
    losses = engine_run(engine, data[:2])  # threads started, a step in flight (overlap forward)
    results = FORK.Queue()
    child = FORK.Process(target=_in_child, args=(action, engine, engine.model, data[2][0], results))
    child.start()
    child.join(CHILD_SECONDS)
    if child.is_alive():
        child.kill()
        pytest.fail(f"the forked child's {action} hung")
    kind, message, seconds = results.get(timeout=5)
    assert kind == ForkedProcessError.__name__, (kind, message)
    assert f"forked from process {os.getpid()}" in message and "spawn" in message
    assert seconds < 5
    # the parent is unaffected: it goes on exactly as an engine no child touched
    losses += engine_run(engine, data[2:])
    assert losses == expected
    engine.close()


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=generator), torch.randn(1, generator=generator)


def test_dataloader_workers_that_do_not_touch_the_engine_work(swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(model, config(swap_dir, "cpu")) as engine:
        loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context=FORK)
        for _ in range(2):
            for x, y in loader:
                engine.backward(mse(engine, x, y))
                assert engine.step()
        assert engine.global_steps == 4
