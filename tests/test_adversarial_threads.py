"""A second thread against one engine (issue 51, findings 2 and 9): never a crash, never a bare
AssertionError; a clear OffloadError naming what to do, raised before anything changed.

- Finding 9: two threads training one engine failed with a bare AssertionError in residency.py
  (param cpu) or aborted the process ("terminate called without an active exception", param
  none). Now every engine call (and the model's own forward) made while another thread is
  inside one raises ConcurrentUseError naming both threads, and changes nothing: the thread
  inside finishes its step, and training goes on (taking turns) exactly as plain PyTorch's.

- Finding 2: a read of a parameter on another thread with param cpu or nvme segfaulted (exit
  139): the read-watching mode is per thread, and the read went to the storage freed between
  uses. Now an offloaded engine's parameters see reads on every thread: between steps such a
  read is refused naming the parameter and the routes (which work from that thread:
  `params_on_device`, `model.state_dict()`); while another thread is inside a call, it gets
  ConcurrentUseError; while another thread's micro-step is in progress, an OffloadError saying
  so. The same holds for a thread the mode covers (one that built the engine) reading while
  another trains, with any placement.

Each engine case runs in a child process: before, they killed the process.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from offload.errors import ConcurrentUseError, OffloadError
from offload.platform.process import Driving, DrivingThread, OwningProcess
from offload.runtime.param_reads import ReadVerdict, read_verdict

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: str, *args: str, timeout: float = 240) -> list[dict]:
    """Runs `script` in a child process (a crash there fails the test, not pytest); the JSON
    lines it printed."""
    result = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


# ---- the guard itself ------------------------------------------------------------------------
def test_one_thread_at_a_time_nested_calls_count_once():
    driver = DrivingThread(OwningProcess())
    driver.enter("engine.step()")
    driver.enter("engine.consolidated_state_dict()")  # a call inside a call, same thread
    assert driver.held_here()
    refused: list[BaseException] = []

    def other() -> None:
        try:
            driver.enter("engine(...)")
        except ConcurrentUseError as error:
            refused.append(error)
        assert not driver.held_here()

    thread = threading.Thread(target=other, name="the other")
    thread.start()
    thread.join()
    (error,) = refused
    assert isinstance(error, OffloadError)
    assert "engine(...) on thread 'the other' while thread 'MainThread' is inside engine.step()" in str(error)
    assert "one engine is driven by one thread at a time" in str(error)
    driver.leave()
    assert driver.held_here()  # still inside the outer call
    driver.leave()
    assert not driver.held_here()
    # free again: another thread may drive it now (a loop may move between threads)
    thread = threading.Thread(target=lambda: (driver.enter("engine(...)"), driver.leave()))
    thread.start()
    thread.join()
    assert not driver.held_here()


@pytest.mark.parametrize("driving", list(Driving))
def test_which_thread_may_act_on_a_read(driving):
    for in_backward, in_autograd, mid_step, forward_here in itertools.product([False, True], repeat=4):
        verdict = read_verdict(
            in_backward=in_backward, in_autograd=in_autograd, mid_step=mid_step, driving=driving, forward_here=forward_here
        )
        case = (in_backward, in_autograd, mid_step, forward_here, verdict)
        if in_backward and in_autograd:
            assert verdict is ReadVerdict.PASS, case  # autograd running the engine's backward
        elif driving is Driving.ELSEWHERE:
            assert verdict is ReadVerdict.BUSY, case  # another thread is inside a call
        elif driving is Driving.HERE or not mid_step or forward_here:
            assert verdict is ReadVerdict.DECIDE, case  # its own call, between steps, or its own micro-step
        else:
            assert verdict is ReadVerdict.REFUSE, case  # another thread's micro-step


# ---- finding 9: a second thread's calls while one is inside a forward -------------------------
DRIVE = r"""
import copy, json, sys, threading
import torch
sys.path.insert(0, "tests")
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse, reference_run
import offload
from offload.errors import ConcurrentUseError


def held_in_forward(param, swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(2)
    engine = offload.initialize(copy.deepcopy(model), {
        "precision": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap_dir}, "overlap": "forward"})
    inside, release = threading.Event(), threading.Event()

    def gate(module, args):  # after the engine's own pre-hook: the unit is held
        if not release.is_set():
            inside.set()
            release.wait(60)

    handle = engine.model.blocks[2].register_forward_pre_hook(gate)

    def first_step():
        x, y = data[0]
        engine.backward(mse(engine, x, y))
        engine.step()

    worker = threading.Thread(target=first_step, name="trainer")
    worker.start()
    assert inside.wait(60)
    before = (engine.micro_steps, engine.global_steps, [unit.holders for unit in engine.units])
    calls = {
        "forward": lambda: engine(data[1][0]),
        "model_forward": lambda: engine.model(data[1][0]),
        "backward": lambda: engine.backward(torch.zeros((), requires_grad=True)),
        "step": engine.step,
        "zero_grad": engine.optimizer.zero_grad,
        "optimizer_state": engine.optimizer.state_dict,
        "clip": lambda: engine.clip_grad_norm_(1.0),
        "consolidated": engine.consolidated_state_dict,
        "state_dict": engine.model.state_dict,
        "params_on_device": lambda: engine.params_on_device().__enter__(),
        "save": lambda: engine.save_checkpoint(swap_dir + "/ckpt"),
        "close": engine.close,
    }
    outcome = {}
    for name, call in calls.items():
        try:
            call()
            outcome[name] = "ran"
        except ConcurrentUseError as error:
            text = str(error)
            outcome[name] = "refused" if "'trainer' is inside engine(...)" in text and "one thread at a time" in text else text
        except BaseException as error:
            outcome[name] = f"{type(error).__name__}: {error}"
    after = (engine.micro_steps, engine.global_steps, [unit.holders for unit in engine.units])
    release.set()
    worker.join()
    handle.remove()
    # taking turns: the second step from this thread
    x, y = data[1]
    engine.backward(mse(engine, x, y))
    engine.step()
    reference, _ = reference_run(model, data)
    difference = max_weight_difference(engine.consolidated_state_dict(), reference)
    print(json.dumps({"param": param, "calls": outcome, "unchanged": before == after,
                      "trained": difference <= fp32_weight_tolerance(engine), "steps": engine.global_steps}), flush=True)
    engine.close()


def racing(param, swap_dir):
    # the audit's case: two threads each running a training loop on one engine
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), {"precision": "fp32", "offload": {"param": param, "optimizer": "cpu",
                                "nvme_path": swap_dir}})
    errors = []

    def train():
        try:
            for x, y in batches(6):
                engine.backward(mse(engine, x, y))
                engine.step()
        except BaseException as error:
            errors.append(type(error).__name__)

    threads = [threading.Thread(target=train) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"param": param, "racing": errors}), flush=True)
    engine.close(restore_weights=False)


for param in ("none", "cpu"):
    held_in_forward(param, sys.argv[1])
    racing(param, sys.argv[1])
"""


def test_a_second_thread_is_refused_while_one_is_inside_a_call(swap_dir):
    lines = run_child(DRIVE, swap_dir)
    held = [line for line in lines if "calls" in line]
    assert [line["param"] for line in held] == ["none", "cpu"]
    for line in held:
        assert set(line["calls"].values()) == {"refused"}, line
        assert line["unchanged"] and line["trained"] and line["steps"] == 2, line
    racing = [line for line in lines if "racing" in line]
    assert [line["param"] for line in racing] == ["none", "cpu"]
    for line in racing:
        # whichever thread came second while the other was inside a call stopped there, cleanly
        assert set(line["racing"]) <= {"ConcurrentUseError"}, line


# ---- finding 2: reads of parameters on another thread ------------------------------------------
READS = r"""
import copy, json, sys, threading
import torch
from torch import nn
sys.path.insert(0, "tests")
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse, reference_run
import offload
from offload.errors import ConcurrentUseError, OffloadError


def on_thread(fn):
    # fn() on a thread of its own (one the engine never saw): what it returned, or how it was refused
    out = {}

    def run():
        try:
            out["value"] = fn()
        except ConcurrentUseError as error:
            out["value"] = "busy" if "one engine is driven by one thread at a time" in str(error) and NAME in str(error) else str(error)
        except OffloadError as error:
            text = str(error)
            out["value"] = "mid-step" if "the micro-step of thread 'MainThread'" in text else "refused" if "parameter '" in text else text
        except BaseException as error:
            out["value"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=run, name="reader")
    thread.start()
    thread.join()
    return out["value"]


NAME = repr("blocks.3.down.weight")


def offloaded(param, swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(2)
    engine = offload.initialize(copy.deepcopy(model), {
        "precision": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap_dir}, "overlap": "forward"})
    weight = engine.model.blocks[3].down.weight
    x, y = data[0]
    engine.backward(mse(engine, x, y))
    engine.step()
    result = {"param": param, "class": type(weight).__name__}
    # between steps: refused, naming the parameter; the routes it names work from that thread
    for route, read in {
        "sum": lambda: weight.sum().item(),
        "detach": lambda: weight.detach().clone(),
        "print": lambda: repr(weight),
        "data": lambda: weight.data.clone(),
        "deepcopy": lambda: copy.deepcopy(engine.model),
    }.items():
        result[route] = on_thread(read)

    def on_device():
        with engine.params_on_device(engine.model.blocks[3]):
            return weight.detach().clone()

    truth = engine.consolidated_state_dict()["blocks.3.down.weight"]
    result["params_on_device"] = bool(torch.equal(on_thread(on_device), truth))
    result["state_dict"] = bool(torch.equal(on_thread(engine.model.state_dict)["blocks.3.down.weight"], truth))
    # mid-step: this thread's forward ran, its backward has not
    x, y = data[1]
    loss = mse(engine, x, y)
    result["mid_step"] = on_thread(lambda: weight.sum().item())
    engine.backward(loss)
    # while this thread is inside a call (its step, overlap forward: the next forward waits)
    inside, release = threading.Event(), threading.Event()

    def gate(module, args):
        inside.set()
        release.wait(60)

    handle = engine.model.blocks[1].register_forward_pre_hook(gate)
    engine.step()
    caller = threading.Thread(target=lambda: engine(x), name="trainer")
    caller.start()
    inside.wait(60)
    result["inside_call"] = on_thread(lambda: weight.sum().item())
    release.set()
    caller.join()
    handle.remove()
    reference, _ = reference_run(model, data)
    result["trained"] = max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()
    result["closed_class"] = type(weight).__name__
    result["after_close"] = on_thread(lambda: weight.sum().item()) == weight.sum().item()
    print(json.dumps(result), flush=True)


def watched_elsewhere(swap_dir):
    # param none, overlap forward: this thread built the engine (the mode is on its stack) and
    # reads while another thread is inside a call
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), {"precision": "fp32", "offload": {"param": "none", "optimizer": "cpu"},
                                            "overlap": "forward"})
    weight = engine.model.blocks[3].down.weight
    inside, release = threading.Event(), threading.Event()

    def gate(module, args):
        inside.set()
        release.wait(60)

    handle = engine.model.blocks[1].register_forward_pre_hook(gate)
    x, y = batches(1)[0]
    caller = threading.Thread(target=lambda: engine(x), name="trainer")
    caller.start()
    inside.wait(60)
    try:
        weight.sum()
        outcome = "read"
    except ConcurrentUseError as error:
        outcome = "busy" if NAME in str(error) else str(error)
    release.set()
    caller.join()
    handle.remove()
    print(json.dumps({"param": "none", "inside_call": outcome}), flush=True)
    engine.close()


for param in ("cpu", "nvme"):
    offloaded(param, sys.argv[1])
watched_elsewhere(sys.argv[1])
"""


def test_reads_on_another_thread_are_refused_or_correct_never_a_crash(swap_dir):
    lines = run_child(READS, swap_dir)
    offloaded = [line for line in lines if line["param"] != "none"]
    assert [line["param"] for line in offloaded] == ["cpu", "nvme"]
    for line in offloaded:
        assert line["class"] == "WatchedParameter" and line["closed_class"] == "Parameter", line
        for route in ("sum", "detach", "print", "data", "deepcopy"):
            assert line[route] == "refused", (route, line)
        assert line["mid_step"] == "mid-step" and line["inside_call"] == "busy", line
        assert line["params_on_device"] and line["state_dict"] and line["trained"] and line["after_close"], line
    (none,) = [line for line in lines if line["param"] == "none"]
    assert none["inside_call"] == "busy", none
