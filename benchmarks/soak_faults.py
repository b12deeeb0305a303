"""Fault-injection soak: training that is killed, interrupted and fed I/O errors ends exactly
where an undisturbed run ends, and leaves no swap behind.

A parent process runs a trainer child (nvme/nvme placement, fp32, a checkpoint every
`--every` steps) again and again until it reaches `--steps` optimizer steps:

- SIGKILL at random moments (also during start-up, a save or a load): the next child resumes
  from `latest` (a save killed before it replaced `latest` is unfinished: the resumed child
  saves its tag, `global_step<N>`, again); the dead child's swap space is the kernel's to
  reclaim (the files have no names) and its empty run directory is swept by the next start.
- SIGINT at random moments: the child catches KeyboardInterrupt and recovers in-process by
  loading `latest` (when even that is interrupted or fails, it exits and is restarted).
- Injected EIO and ENOSPC (`AioEngine.set_fault(..., count=1)`): at random steps the child arms
  one failing swap read or write in the forward, backward or step; it catches the error and
  recovers in-process by loading `latest`.

At the end the child's weights are compared bit for bit with an undisturbed run of the same
steps (same data: each step's batch is a function of the step number), and the swap
directory must be empty. Counts are printed as JSON (and written to `--out`).

    .venv/bin/python benchmarks/soak_faults.py --steps 400 --every 20 --seed 1
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
log = logging.getLogger("soak_faults")

WIDTH, DEPTH, INPUTS, BATCH = 64, 4, 16, 8
PHASES = ("forward", "backward", "step")


# ---- the child: one trainer process ----------------------------------------------------------
def build_model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1234)
            self.inp = nn.Linear(INPUTS, WIDTH)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(DEPTH)
            )
            self.out = nn.Linear(WIDTH, 1)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h)

    return Net()


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, INPUTS, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def emit(kind: str, **fields) -> None:
    print("EVENT " + json.dumps({"kind": kind, **fields}), flush=True)


def _arm(engine, fault, phase: str) -> None:
    """Arms one failing swap I/O (errno name, op) when the drawn fault belongs to `phase`."""
    if fault is not None and fault[2] == phase:
        engine.store.swap.engine.set_fault(fault[1], getattr(errno, fault[0]), count=1)


def child_main(args) -> int:
    # a parent started in the background (nohup, `&`) passes SIGINT down ignored: Ctrl-C must raise here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from safetensors.torch import save_file

    import offload
    from offload.checkpoint.engine_state import LATEST

    config = {
        "precision": "fp32",
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        # the gradients on NVMe too (not kept in RAM): backward then writes swap files, so every
        # phase has reads and writes for an armed fault to fail
        "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": args.swap, "gradient_memory": 0},
        "io": {"block_size": 65536, "queue_depth": 4, "threads": 2},
    }
    rng = random.Random(args.fault_seed)
    engine = offload.initialize(build_model(), config)
    emit("started")
    if os.path.exists(os.path.join(args.ckpt, LATEST)):
        engine.load_checkpoint(args.ckpt)
        emit("resumed", step=engine.global_steps)
    elif not args.reference:
        engine.save_checkpoint(args.ckpt, tag="start")  # every failure has somewhere to return to

    def recover(why: str) -> None:
        engine.store.swap.engine.clear_fault()
        for attempt in range(3):
            try:
                engine.load_checkpoint(args.ckpt)
                emit("recovered", why=why, step=engine.global_steps, attempts=attempt + 1)
                return
            except offload.OffloadError as e:  # the failed step's error may surface once more
                emit("load_retry", why=why, error=str(e)[:200])
        raise SystemExit(3)

    while engine.global_steps < args.steps:
        step = engine.global_steps
        fault = None
        if not args.reference and rng.random() < args.p_io:
            fault = (rng.choice(("EIO", "EIO", "ENOSPC")), rng.choice(("read", "write")), rng.choice(PHASES))
        try:
            x, y = batch(step)
            _arm(engine, fault, "forward")
            loss = (engine(x).float() - y).pow(2).mean()
            _arm(engine, fault, "backward")
            engine.backward(loss)
            _arm(engine, fault, "step")
            engine.step()
            emit("stepped", step=engine.global_steps)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if fault is not None:
                engine.store.swap.engine.clear_fault()
                emit("fault_missed", fault=fault)  # no such I/O in that phase: nothing failed
            if engine.global_steps % args.every == 0:
                # the step's own tag (global_step<N>): a child resumed after a kill between a save's
                # rename and `latest` saves that tag again, over the unfinished one (issue 51)
                engine.save_checkpoint(args.ckpt, keep_last=2)
        except KeyboardInterrupt as e:
            where = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_tb(e.__traceback__)]
            emit("interrupted", step=step, where=where[-4:])
            recover("SIGINT")
        except (offload.OffloadError, OSError) as e:
            hit = fault is not None
            emit("io_error", fault=fault, injected=hit, error=f"{type(e).__name__}: {str(e)[:160]}")
            if not hit:
                raise
            recover(fault[0])
    save_file({k: v.contiguous() for k, v in engine.consolidated_state_dict().items()}, args.result)
    engine.close()
    emit("done", step=engine.global_steps)
    return 0


# ---- the parent -------------------------------------------------------------------------------
def _child_command(args, swap: str, ckpt: str, result: str, fault_seed: int, reference: bool) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--swap",
        swap,
        "--ckpt",
        ckpt,
        "--result",
        result,
        "--fault-seed",
        str(fault_seed),
        "--p-io",
        str(args.p_io),
        "--step-sleep",
        str(args.step_sleep),
    ]
    return cmd + (["--reference"] if reference else [])


POLL_SECONDS = 0.02  # how often the parent looks at the child's output and its signal schedule


def _run_child(cmd: list[str], due_signal, counts: dict, timeout: float) -> tuple[int, list, str]:
    """Runs one trainer child. `due_signal(now, steps)` is asked every POLL_SECONDS while the
    child lives, with the monotonic time and how many steps the child has reported; it answers
    the signal to send now, or None (a SIGKILL ends the child).

    A reader thread fills `lines` with the child's output as it comes; the parent only reads
    the list (appends are atomic), and joins the thread once the child has exited."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def read_output() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read_output, name="soak-child-output", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    seen, steps = 0, 0
    while proc.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"a trainer child hung for {timeout} s")
        arrived = lines[seen:]
        seen += len(arrived)
        steps += sum(line.startswith('EVENT {"kind": "stepped"') for line in arrived)
        sig = due_signal(now, steps)
        if sig is not None:
            proc.send_signal(sig)
            counts["sigkill_sent" if sig == signal.SIGKILL else "sigint_sent"] += 1
        time.sleep(POLL_SECONDS)
    rc = proc.wait()
    reader.join()
    proc.stdout.close()
    text = "".join(lines)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("EVENT ")]
    if rc not in (0, -signal.SIGKILL) and not any(e["kind"] == "interrupted" for e in events):
        log.info("child exited with %s (a SIGINT outside the training loop):\n%s", rc, text[-1500:])
    return rc, events, text


def random_signals(rng: random.Random, p_kill: float, p_int: float, max_delay: float):
    """Every uniform(0.3, max_delay) seconds: SIGKILL with chance p_kill, SIGINT with p_int,
    else nothing. Time-driven, so a signal can land anywhere: start-up, a save, a load."""
    due = [time.monotonic() + rng.uniform(0.3, max_delay)]

    def due_signal(now: float, steps: int):
        if now < due[0]:
            return None
        due[0] = now + rng.uniform(0.3, max_delay)
        draw = rng.random()
        return signal.SIGKILL if draw < p_kill else signal.SIGINT if draw < p_kill + p_int else None

    return due_signal


def scripted_signals(rng: random.Random, script: list, step_seconds: float):
    """`script`: (steps, signal) pairs: send `signal` once the child has reported `steps` steps
    (counted over its whole life, recoveries included), a further uniform(0, step_seconds) later
    so that it lands at different points of a step. Progress-driven, so a slow or fast machine
    sends the same signals: none is lost to a child that finished first."""
    pending = [(steps, sig) for steps, sig in script]
    at = [None]

    def due_signal(now: float, steps: int):
        if not pending or steps < pending[0][0]:
            return None
        if at[0] is None:
            at[0] = now + rng.uniform(0.0, step_seconds)
        if now < at[0]:
            return None
        at[0] = None
        return pending.pop(0)[1]

    return due_signal


def _swap_leftovers(swap: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(swap):
        found += [os.path.join(dirpath, d) for d in dirnames] + [os.path.join(dirpath, f) for f in filenames]
    return found


def soak(
    steps: int,
    every: int,
    seed: int,
    workdir: str,
    *,
    p_io: float = 0.06,
    p_kill: float = 0.3,
    p_int: float = 0.35,
    max_delay: float = 4.0,
    child_timeout: float = 600.0,
    step_sleep: float = 0.0,
    plan: list | None = None,
) -> dict:
    """Runs the soak in `workdir`; returns the counts (see the module docstring).

    While a child lives, every uniform(0.3, max_delay) seconds the parent sends it SIGKILL
    (chance p_kill), SIGINT (p_int) or nothing (`random_signals`); each step arms one injected
    I/O error with chance p_io. `plan`: for the first children, the (steps the child has
    reported, signal) pairs to send instead (`scripted_signals`); later children get none.
    `step_sleep`: seconds each step sleeps (a step is then long enough for a signal to land
    at different points of it)."""
    import torch
    from safetensors.torch import load_file

    args = argparse.Namespace(steps=steps, every=every, p_io=p_io, step_sleep=step_sleep)
    plan = [list(child) for child in plan] if plan is not None else None
    rng = random.Random(seed)
    swap, ckpt = os.path.join(workdir, "swap"), os.path.join(workdir, "ckpt")
    ref_swap, ref_ckpt = os.path.join(workdir, "ref-swap"), os.path.join(workdir, "ref-ckpt")
    for d in (swap, ref_swap):
        os.makedirs(d, exist_ok=True)
    counts = {
        "steps": steps,
        "checkpoint_every": every,
        "seed": seed,
        "children": 0,
        "sigkill_sent": 0,
        "sigint_sent": 0,
        "killed": 0,
        "interrupts_caught": 0,
        "eio_injected": 0,
        "enospc_injected": 0,
        "faults_armed_but_unused": 0,
        "recovered_in_process": 0,
        "load_retries": 0,
        "restarts": 0,
        "resumed_from_checkpoint": 0,
    }
    started = time.monotonic()
    result = os.path.join(workdir, "result.safetensors")
    stillborn = 0  # children in a row that failed before training, unsignalled (a broken build fails fast)
    while True:
        counts["children"] += 1

        if plan is None:
            due_signal = random_signals(rng, p_kill, p_int, max_delay)
        else:
            due_signal = scripted_signals(rng, plan.pop(0) if plan else [], max(step_sleep, 0.05))
        cmd = _child_command(args, swap, ckpt, result, rng.randrange(1 << 30), reference=False)
        rc, events, text = _run_child(cmd, due_signal, counts, child_timeout)
        signalled = rc in (-signal.SIGKILL, -signal.SIGINT)
        stillborn = 0 if signalled or any(e["kind"] == "started" for e in events) else stillborn + 1
        if stillborn >= 3:
            raise RuntimeError(f"three trainer children in a row failed before training; the last said:\n{text[-3000:]}")
        for e in events:
            kind = e["kind"]
            if kind == "io_error" and e["injected"]:
                counts["eio_injected" if e["fault"][0] == "EIO" else "enospc_injected"] += 1
            elif kind == "interrupted":
                counts["interrupts_caught"] += 1
            elif kind == "recovered":
                counts["recovered_in_process"] += 1
            elif kind == "load_retry":
                counts["load_retries"] += 1
            elif kind == "fault_missed":
                counts["faults_armed_but_unused"] += 1
            elif kind == "resumed":
                counts["resumed_from_checkpoint"] += 1
        if rc == -signal.SIGKILL:
            counts["killed"] += 1
        if rc == 0 and any(e["kind"] == "done" for e in events):
            break
        counts["restarts"] += 1
        if counts["children"] > 20 * max(1, steps // every):
            raise RuntimeError(f"the soak makes no progress: {counts}")
    counts["soak_seconds"] = round(time.monotonic() - started, 1)
    counts["swap_left_after_soak"] = _swap_leftovers(swap)
    ref_result = os.path.join(workdir, "reference.safetensors")
    rc, _, text = _run_child(
        _child_command(args, ref_swap, ref_ckpt, ref_result, 0, reference=True),
        lambda now, steps: None,
        counts,
        child_timeout,
    )
    if rc != 0:
        raise RuntimeError(f"the undisturbed reference run failed:\n{text[-3000:]}")
    got, expected = load_file(result), load_file(ref_result)
    different = sorted(k for k in expected if k not in got or not torch.equal(got[k], expected[k]))
    counts["bit_identical"] = not different and got.keys() == expected.keys()
    counts["different_tensors"] = different
    counts["swap_left_after_reference"] = _swap_leftovers(ref_swap)
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--p-io", type=float, default=0.06, help="chance per step of one injected EIO/ENOSPC")
    parser.add_argument("--p-kill", type=float, default=0.3, help="chance per signal tick of a SIGKILL")
    parser.add_argument("--p-int", type=float, default=0.35, help="chance per signal tick of a SIGINT")
    parser.add_argument("--max-delay", type=float, default=4.0, help="signal ticks come every uniform(0.3, this) s")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    parser.add_argument("--out", default=None, help="also write the counts as JSON here")
    # child mode (internal)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--swap", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--fault-seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        logging.basicConfig(level=logging.ERROR)
        return child_main(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workdir = args.workdir or tempfile.mkdtemp(prefix="offload-soak-")
    try:
        counts = soak(
            args.steps,
            args.every,
            args.seed,
            workdir,
            p_io=args.p_io,
            p_kill=args.p_kill,
            p_int=args.p_int,
            max_delay=args.max_delay,
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(counts, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = counts["bit_identical"] and not counts["swap_left_after_soak"] and not counts["swap_left_after_reference"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
