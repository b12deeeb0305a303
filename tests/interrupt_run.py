"""A training run that Ctrl-C interrupts inside `engine.step()`: the handler saves a checkpoint,
and a second process resumes from it (run by tests/test_interrupts.py).

python interrupt_run.py MODE SWAP_DIR CHECKPOINT OUT
  MODE straight:  trains STEPS steps; writes the final weights to OUT
  MODE interrupt: trains until step INTERRUPT_AT, whose step() gets SIGINT while the CPU step
                  runs; the KeyboardInterrupt handler saves CHECKPOINT and the process exits
  MODE resume:    loads CHECKPOINT, trains the remaining steps, writes the final weights to OUT
The CPU step is slowed (30 ms per Adam call), and the signal is sent by the optimizer worker from
inside the first Adam call of the interrupted step, so it always lands while that step runs,
whatever the machine's load (a timer could fire while step() still drained the gradients);
optimizer and params on NVMe, one block frozen.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference import TinyNet, batches, mse  # noqa: E402

import offload  # noqa: E402
from offload.runtime import stepper  # noqa: E402

STEPS = 6
INTERRUPT_AT = 3


# set by the main thread before the interrupted step(); the first Adam call after it sends SIGINT
INTERRUPT_ARMED = threading.Event()


def slow_adam_calls() -> None:
    real = stepper.kernels.adam_step
    main_thread = threading.main_thread().ident

    def slow(*args, **kwargs):
        if INTERRUPT_ARMED.is_set():
            INTERRUPT_ARMED.clear()
            signal.pthread_kill(main_thread, signal.SIGINT)
        time.sleep(0.03)
        return real(*args, **kwargs)

    stepper.kernels.adam_step = slow


def engine_for(swap_dir: str):
    torch.manual_seed(0)
    model = TinyNet()
    model.blocks[1].requires_grad_(False)
    config = {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": swap_dir},
        "overlap": "none",
    }
    return offload.initialize(model, config, device="cpu")


def train_step(engine, batch) -> None:
    x, y = batch
    engine.backward(mse(engine, x, y))


def main() -> None:
    mode, swap_dir, checkpoint, out = sys.argv[1:5]
    # Ctrl-C raises KeyboardInterrupt here even when the suite runs as a shell's background job,
    # which starts its processes with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    slow_adam_calls()
    data = batches(STEPS)
    engine = engine_for(swap_dir)
    start = 0
    if mode == "resume":
        engine.load_checkpoint(checkpoint)
        start = engine.global_steps
    for step in range(start, STEPS):
        train_step(engine, data[step])
        if mode == "interrupt" and step == INTERRUPT_AT:
            INTERRUPT_ARMED.set()
            try:
                engine.step()
            except KeyboardInterrupt:
                print("interrupted in step(), step in flight:", engine.stepping.pending, flush=True)
                engine.save_checkpoint(checkpoint)
                engine.close(restore_weights=False)
                return
            raise SystemExit("the interrupt did not land inside step()")
        engine.step()
    torch.save(engine.consolidated_state_dict(), out)
    engine.close(restore_weights=False)


if __name__ == "__main__":
    main()
