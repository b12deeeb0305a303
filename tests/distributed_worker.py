"""Worker processes for tests/test_distributed.py and benchmarks/bench_sharding.py.

`launch(fn, world_size, ...)` starts `world_size` processes on the CPU (gloo), each with
torchrun's environment (MASTER_ADDR/PORT on a free port, RANK, WORLD_SIZE, LOCAL_RANK) and the
caller's environment variables, runs `fn(rank, world_size, *args)` in each and returns what each
rank returned (or the text of what it raised, or its exit code), within a deadline: a hang fails
the test, never blocks it.

The ranks are forked from a server process (multiprocessing's "forkserver" start method) that
imported torch and offload once, when this process first launched ranks: a spawned rank imports
them afresh, 2-4 s of CPU per rank and per launch on a 2-core machine, which made the launches
a large part of the suite's time. The server is a fresh interpreter that runs nothing but those
imports, so every rank still starts clean: no engine, no process group, no CUDA context, no
thread of the test process.

The ranks' engines compute on the CPU (`RANK_DEVICE`) on every machine, a GPU one included:
the group is gloo, several ranks may share one GPU (NCCL refuses two ranks on one device), and
gloo has no reduce-scatter for CUDA tensors. Multi-GPU training is what torchrun runs
(tests/test_examples.py, one rank per GPU).
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
# passed as offload.initialize(..., device=RANK_DEVICE) by every function run under launch()
RANK_DEVICE = os.environ.get("OFFLOAD_DEVICE") or "cpu"
# What the fork server imports before it forks any rank (a module it cannot import is left to
# the ranks, as multiprocessing does): the expensive imports every rank makes.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "offload", "pytest", "reference", "distributed_worker"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    rank: int, fn, world_size: int, port: int, result_dir: str, timeout_s: float, threads: int, environ: dict, args: tuple
) -> None:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    # the launching process's environment as it is now (the fork server has the one it started with)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(threads)
    outcome: dict
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        outcome = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as error:  # noqa: BLE001 (reported to the parent)
        outcome = {"ok": False, "type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(outcome, handle)
    # no destroy_process_group: after a failure it could wait on a dead peer


def launch(fn, world_size: int, *args, timeout_s: float = 30.0, deadline_s: float = 120.0, threads: int = 1) -> list[dict]:
    """Runs `fn` on `world_size` ranks; one dict per rank: {"ok", "value"} or {"ok": False, "type",
    "message"} or {"ok": False, "exitcode"} for a rank that died without reporting, plus "seconds"."""
    result_dir = tempfile.mkdtemp(prefix="offload-dist-")
    port = free_port()
    started = time.monotonic()
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts, at the first launch
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, port, result_dir, timeout_s, threads, dict(os.environ), args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    try:
        for process in context.processes:
            process.join(max(0.0, deadline_s - (time.monotonic() - started)))
        hung = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {deadline_s}s: a hang")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    seconds = time.monotonic() - started
    results = []
    for rank, process in enumerate(context.processes):
        path = os.path.join(result_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as handle:
                outcome = pickle.load(handle)
            os.remove(path)
        else:
            outcome = {"ok": False, "exitcode": process.exitcode}
        outcome["seconds"] = seconds
        results.append(outcome)
    os.rmdir(result_dir)
    return results


# ---- the training the tests compare with plain PyTorch ------------------------------------
def local_half(batch, rank: int, world_size: int):
    """This rank's equal, contiguous part of a (x, y) batch."""
    x, y = batch
    size = x.shape[0] // world_size
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def rank_swap_dirs(tmp_path, world_size: int) -> list[str]:
    """One swap directory per rank under `tmp_path` (a list for offload.nvme_path)."""
    swaps = []
    for rank in range(world_size):
        (tmp_path / f"swap{rank}").mkdir()
        swaps.append(str(tmp_path / f"swap{rank}"))
    return swaps


def make_config(swap, param, optimizer, overlap="forward", precision="fp32", **extra):
    config = {
        "precision": precision,
        # one Adam thread per rank: the ranks share the machine's cores
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "threads": 1},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
        "overlap": overlap,
    }
    config.update(extra)
    return config


def train_deep_tinynet_reporting_tiers(rank: int, world_size: int, config: dict) -> dict:
    """Six steps of TinyNet(depth=8) on this rank's half of each batch; the final fp32 weights and
    each unit's optimizer tier (memory_report()["optimizer_units"])."""
    from reference import TinyNet, batches, mse

    import offload

    torch.manual_seed(0)
    model = TinyNet(depth=8)
    with offload.initialize(copy.deepcopy(model), config, device="cpu") as engine:
        for batch in batches(6):
            x, y = local_half(batch, rank, world_size)
            engine.backward(mse(engine, x, y))
            engine.step()
        tiers = [entry["tier"] for entry in engine.memory_report()["optimizer_units"].values()]
        return {"weights": engine.consolidated_state_dict(), "tiers": tiers}


def freeze(model, prefix: str | None) -> None:
    """Turns off requires_grad for the parameters under `prefix` (a module name)."""
    if prefix:
        for name, param in model.named_parameters():
            if name.startswith(prefix + "."):
                param.requires_grad_(False)


def train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Runs every case on this rank's part of each batch; returns per case what the test checks.

    A case: {"config", "steps", "batch", "micro" (accumulation: micro-batches per step),
    "width", "freeze" (a module whose params are frozen), "report_only" (build, report memory, close)}."""
    from reference import TinyNet, batches, mse

    import offload

    results = []
    for case in cases:
        torch.manual_seed(0)
        model = TinyNet(width=case.get("width", 32))
        if rank == 1:
            # a different init on rank 1: the engine must start every rank from rank 0's weights
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
        freeze(model, case.get("freeze"))
        engine = offload.initialize(copy.deepcopy(model), case["config"], device=RANK_DEVICE)
        out: dict = {"name": case["name"]}
        store = engine.store
        out["swap_path"] = store.swap.path if store.swap is not None else None
        out["run_name"] = store.swap.run_name if store.swap is not None else None
        if case.get("report_only"):
            out["memory"] = engine.memory_report()
            engine.close(restore_weights=False)
            results.append(out)
            continue
        micro = case.get("micro", 1)
        data = batches(case.get("steps", 10) * micro, batch=case.get("batch", 16))
        losses, stepped = [], []
        for i, batch in enumerate(data):
            x, y = local_half(batch, rank, world_size)
            if case.get("overflow_at") == i and rank == 1:
                x = x * 1e5  # fp16 overflow in this rank's gradients only
            loss = mse(engine, x, y)
            engine.backward(loss)
            stepped.append(engine.step())
            losses.append(loss.item())
        out["losses"] = losses
        out["stepped"] = stepped
        out["skipped_steps"] = engine.skipped_steps
        out["speculation"] = dict(engine.speculation_counts)
        out["loss_scale"] = engine.scaler.scale
        out["last_grad_norm"] = engine.last_grad_norm
        out["memory"] = engine.memory_report()
        state = engine.consolidated_state_dict()
        out["state"] = state if rank == 0 else None
        # every rank reads the whole 16-bit device weights: the master weights, cast
        with engine.params_on_device():
            read = {name: p.detach().to("cpu", copy=True) for name, p in engine.model.named_parameters()}
        out["read_differs"] = sorted(name for name, value in read.items() if not torch.equal(value, state[name].to(value.dtype)))
        # every rank gathers the same weights: a digest tells the test they agree
        out["digest"] = float(sum(v.double().sum() * (i + 1) for i, v in enumerate(state.values())))
        engine.close(restore_weights=False)
        out["swap_left"] = os.path.exists(out["swap_path"]) if out["swap_path"] else False
        results.append(out)
    return results


def fail_mid_step(rank: int, world_size: int, swap: str, mode: str, release_path: str) -> dict:
    """Trains; rank 1 fails at step 3, by `mode`: "raise" (an exception between forward and
    backward, leaving the `with engine:` block), "exit" (os._exit(7) from inside its backward,
    after the loss check: no cleanup at all) or "hang" (stays alive before backward, outside
    any collective, until rank 0 has given up, then exits)."""
    from reference import TinyNet, batches

    import offload

    torch.manual_seed(0)
    with offload.initialize(TinyNet(), make_config(swap, "cpu", "cpu"), device=RANK_DEVICE) as engine:
        for step, batch in enumerate(batches(10)):
            x, y = local_half(batch, rank, world_size)
            prediction = engine(x)
            loss = ((prediction - y) ** 2).mean()
            if rank == 1 and step == 3:
                if mode == "exit":
                    # the output's gradient comes first in backward, before any unit's gradients
                    prediction.register_hook(lambda grad: os._exit(7))
                    engine.backward(loss)
                if mode == "hang":
                    deadline = time.monotonic() + 60
                    while not os.path.exists(release_path) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    os._exit(0)
                raise RuntimeError("injected failure on rank 1 at step 3")
            if step == 3:
                started = time.monotonic()
                try:
                    engine.backward(loss)
                    engine.step()
                except Exception as error:
                    open(release_path, "w").close()
                    error.args = (f"{error} [raised {time.monotonic() - started:.1f}s after entering backward]",)
                    raise
            else:
                engine.backward(loss)
                engine.step()
    return {"finished": True}


# ---- the benchmark ---------------------------------------------------------------------------
def bench_rank(rank: int, world_size: int, config: dict, width: int, depth: int, batch: int, warmup: int, steps: int) -> dict:
    """Step time (forward + backward + step) and memory per tier on this rank."""
    from reference import TinyNet, batches, mse

    import offload

    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=width, depth=depth, inputs=width), config, device=RANK_DEVICE)
    data = batches(warmup + steps, batch=batch * world_size, inputs=width)
    times = []
    for i, full in enumerate(data):
        x, y = local_half(full, rank, world_size)
        engine.collectives.barrier()
        started = time.perf_counter()
        engine.backward(mse(engine, x, y))
        engine.step()
        engine.stepping.wait()  # the step's full cost, overlap or not
        if i >= warmup:
            times.append(time.perf_counter() - started)
    report = engine.memory_report()
    engine.close(restore_weights=False)
    times.sort()
    return {
        "median_s": times[len(times) // 2],
        "memory": report,
        "params": sum(p.numel() for p in TinyNet(width=width, depth=depth, inputs=width).parameters()),
    }


def skip_one_backward(rank: int, world_size: int, swap: list[str], param: str) -> dict:
    """Rank 1's forward of micro-batch 1 fails inside the model, and the rank catches the error
    and goes on to the next batch (as a loop with `try: ... except: continue` does): the ranks are then a backward
    apart. Returns the losses of the steps that ran."""
    from reference import TinyNet, batches, mse

    import offload

    torch.manual_seed(0)
    config = make_config(swap, param, "cpu", "forward")
    engine = offload.initialize(TinyNet(), config, device=RANK_DEVICE)
    losses = []
    try:
        for step, batch in enumerate(batches(4)):
            x, y = local_half(batch, rank, world_size)
            if rank == 1 and step == 1:
                x = x[:, :3]  # a bad batch: the model's first layer raises inside the forward
            try:
                loss = mse(engine, x, y)
            except RuntimeError:
                if rank == 1 and step == 1:
                    continue  # the bad batch, skipped
                raise
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close(restore_weights=False)
    return {"losses": losses}
