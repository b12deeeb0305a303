"""offload on a GPU against plain PyTorch and DeepSpeed, one process per line, and the floor.

The same Llama-style model, init and batches for every run; each run in its own process (so
one run's memory and pinned pages never help or hurt the next). For each: seconds per step
(median of the timed steps), model TFLOPS (6 x params x tokens / step time), GPU peak, peak
RSS, start-up time (model build and engine start), each step's loss, and the engine's own
breakdown. The floor is computed from numbers measured in the same run: the plain
forward+backward time (GPU compute), the CPU Adam rate of this machine (the C++ kernel over
the model's parameter count), and the PCIe rate each way times the bytes a step must move for
the placement; the ratio of each offload run to that floor says how much of the hardware is
left on the table. The run writes its record (benchmarks/records.py) after every run: each
offload run against plain PyTorch and against each DeepSpeed run, each DeepSpeed run against
plain PyTorch, with every figure.

    python benchmarks/bench_gpu.py --size 1.3b [--runs plain,none/cpu,cpu/cpu,ds2,superoffload] [--steps 6]
    python benchmarks/bench_gpu.py --size 1.3b --clip 1.0 --runs plain,none/cpu@forward,none/cpu@backward,ds2
    python benchmarks/bench_gpu.py --size 13b --checkpointing --batch 4 --runs recommended
    python benchmarks/bench_gpu.py --size tiny --runs plain,none/cpu    # seconds on a CPU: smoke

An offload run is `param/optimizer`, optionally `@overlap` (`none/cpu@backward`: that run's
overlap instead of --overlap); `--overlap default` (the default) leaves the key out, so the run
gets the engine's own schedule. `recommended` is the placement `offload estimate` recommends for
this model, batch and checkpointing on this machine (`--recommend` prints it and exits).
DeepSpeed runs need `import deepspeed` to work and are skipped with the reason otherwise:
ds2 (ZeRO-2, offload_optimizer cpu, pinned: ZeRO-Offload), ds3 (ZeRO-3, params and optimizer
on the CPU), superoffload (ZeRO-3 with offload_optimizer's super_offload) and zenflow (ZeRO-2
ZeRO-Offload with a zenflow section: its deferred updates are not exact AdamW, so compare its
losses with plain PyTorch's). `--clip N` clips the global gradient norm at N in every run
(plain PyTorch with clip_grad_norm_, DeepSpeed's gradient_clipping, offload's
gradient_clipping: with overlap backward the step is then speculative). Sizes "7b" and larger
build the model on the meta device for offload (materialised one unit at a time) and are not
run for plain PyTorch (it does not fit).

Time boxes (a lent GPU's minutes): `--run-timeout S` stops a run's process after S seconds,
`--deadline T` (seconds since the epoch) starts no run with less than `--min-run` seconds left
before T and stops the one running at T; such runs are recorded as failed or skipped, the
others kept. `--in-process` runs each run in this process instead (no isolation: for the dry
run of gpu_session.sh on a CPU, where a process per run costs seconds of imports each).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from records import Recorder  # noqa: E402

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 176, 2, 4, 4, 512),
    "1.3b": (2048, 5632, 24, 16, 16, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "13b": (5120, 13824, 40, 40, 40, 32000),
}
PLAIN = "plain PyTorch"
# the DeepSpeed runs, as the tables name them when they are the peer
DEEPSPEED_RUNS = {
    "ds2": "DeepSpeed ZeRO-Offload (ZeRO-2, offload_optimizer cpu)",
    "ds3": "DeepSpeed ZeRO-3 (param and optimizer cpu)",
    "superoffload": "DeepSpeed SuperOffload (ZeRO-3, super_offload)",
    "zenflow": "DeepSpeed ZenFlow (ZeRO-2 offload, zenflow)",
}


def llama_config(size: str, seq: int):
    import transformers

    hidden, intermediate, layers, heads, kv, vocab = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build(size: str, seq: int, *, meta: bool):
    import transformers

    torch.manual_seed(0)
    config = llama_config(size, seq)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)
    return transformers.LlamaForCausalLM(config)


def batches(size: str, count: int, batch: int, seq: int) -> list[torch.Tensor]:
    vocab = SIZES[size][5]
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(count)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def enable_checkpointing(model) -> None:
    """Every decoder layer checkpointed (non-reentrant), through transformers'
    `activation_checkpointing_enable` where it exists (5.23 on), else its older name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# ---- one run, in its own process ---------------------------------------------------------
def run_plain(args, device) -> dict:
    started = time.perf_counter()
    model = build(args.size, args.seq, meta=False).to(device)
    if args.checkpointing:
        enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    startup = time.perf_counter() - started
    times, fwd_bwd, losses = [], [], []
    for ids in batches(args.size, args.steps + 2, args.batch, args.seq):
        ids = ids.to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync(device)
        t1 = time.perf_counter()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        fwd_bwd.append(t1 - t0)
        losses.append(loss.item())
    return {"times": times[2:], "fwd_bwd": statistics.median(fwd_bwd[2:]), "startup": startup, "losses": losses}


def offload_config(param: str, optimizer: str, overlap: str, clip: float, swap: str) -> dict:
    """The engine's config of one run; overlap `default` leaves the key out (the engine's own schedule)."""
    config = {
        "precision": "bf16",
        "optimizer": {"lr": 1e-4},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
        "gradient_clipping": clip,
    }
    if overlap != "default":
        config["overlap"] = overlap
    return config


def run_offload(args, device, param: str, optimizer: str, overlap: str) -> dict:
    import offload

    started = time.perf_counter()
    model = build(args.size, args.seq, meta=args.size not in ("tiny", "1.3b"))
    if args.checkpointing:
        enable_checkpointing(model)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.nvme_path) as swap:
        engine = offload.initialize(model, offload_config(param, optimizer, overlap, args.clip, swap), device=device)
        startup = time.perf_counter() - started
        times, breakdowns, losses = [], [], []
        try:
            for ids in batches(args.size, args.steps + 2, args.batch, args.seq):
                sync(device)
                engine.pop_timings()
                engine.stepper.pop_timings()
                t0 = time.perf_counter()
                out = engine(input_ids=ids, labels=ids)
                engine.backward(out.loss)
                engine.step()
                sync(device)
                times.append(time.perf_counter() - t0)
                breakdowns.append({**engine.pop_timings(), **{f"cpu_{k}": v for k, v in engine.stepper.pop_timings().items()}})
                losses.append(out.loss.item())
            report = engine.memory_report()
            speculation = dict(engine.speculation_counts)
            resolved_overlap = engine.config.overlap
        finally:
            engine.close(restore_weights=False)
    median = sorted(range(2, len(times)), key=lambda i: times[i])[(len(times) - 2) // 2]
    return {
        "times": times[2:],
        "breakdown": breakdowns[median],
        "startup": startup,
        "tiers": {tier: report[tier]["peak"] for tier in ("device", "host", "nvme")},
        "speculation": speculation,
        "losses": losses,
        "overlap": resolved_overlap,
    }


def deepspeed_config(run: str, batch: int, clip: float) -> dict:
    """DeepSpeed's config for each of DEEPSPEED_RUNS: bf16, AdamW at lr 1e-4, pinned host
    buffers; SuperOffload and ZenFlow as DeepSpeed's tutorials configure them."""
    cpu = {"device": "cpu", "pin_memory": True}
    zero: dict = {
        "ds2": {"stage": 2, "offload_optimizer": cpu},
        "ds3": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu},
        "superoffload": {
            "stage": 3,
            "offload_optimizer": {**cpu, "ratio": 0.9, "super_offload": True, "cpuadam_cores_perc": 0.9},
        },
        "zenflow": {
            "stage": 2,
            "offload_optimizer": cpu,
            "zenflow": {
                "topk_ratio": 0.05,
                "select_strategy": "auto",
                "select_interval": "auto",
                "update_interval": 4,
                "full_warm_up_rounds": 0,
                "overlap_step": True,
            },
        },
    }[run]
    return {
        "train_micro_batch_size_per_gpu": batch,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": clip,
    }


def run_deepspeed(args, device, run: str) -> dict:
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 (any import failure means: not available here)
        return {"skipped": f"deepspeed not importable: {type(error).__name__}: {error}"}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + zlib.crc32(run.encode()) % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed()
    started = time.perf_counter()
    model = build(args.size, args.seq, meta=False)
    if args.checkpointing:
        enable_checkpointing(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(run, args.batch, args.clip)
    )
    startup = time.perf_counter() - started
    times, losses = [], []
    for ids in batches(args.size, args.steps + 2, args.batch, args.seq):
        ids = ids.to(engine.device)
        sync(device)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"times": times[2:], "startup": startup, "losses": losses, "deepspeed": deepspeed.__version__}


def measure_limits(device, elements: int) -> dict:
    """This machine's CPU Adam rate (params/s over `elements`, the kernel the engine runs on
    its workload: bf16 gradient in, bf16 copy out) and PCIe rate each way (pinned 1 GiB
    copies; none on a CPU device)."""
    from offload.optim import kernels

    n = elements
    master, exp_avg, exp_avg_sq = (torch.zeros(n) for _ in range(3))
    grad = torch.randn(n).to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    rates = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        kernels.adam_step(
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=1e-4,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adamw_mode=True,
            bias_correction=True,
            grad_scale=1.0,
            param_out16=out16,
        )
        rates.append(n / (time.perf_counter() - t0))
    limits = {"adam_params_per_s": statistics.median(rates[1:]), "adam_elements": n, "adam_threads": kernels.get_num_threads()}
    if device.type == "cuda":
        nbytes = 2**30
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for name, (dst, src) in {"h2d_bytes_per_s": (dev, host), "d2h_bytes_per_s": (host, dev)}.items():
            dst.copy_(src, non_blocking=True)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            sync(device)
            limits[name] = 3 * nbytes / (time.perf_counter() - t0)
    return limits


def child(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if args.child == "plain":
        result = run_plain(args, device)
    elif args.child in DEEPSPEED_RUNS:
        result = run_deepspeed(args, device, args.child)
    elif args.child == "limits":
        result = measure_limits(device, args.limits_elements)
    else:
        placement, _, overlap = args.child.partition("@")
        param, optimizer = placement.split("/")
        result = run_offload(args, device, param, optimizer, overlap or args.overlap)
    result.update(gpu_peak=gpu_peak(device), rss_peak=peak_rss_bytes(), device=str(device))
    with open(args.out, "w") as handle:
        json.dump(result, handle)


# ---- the parent: one process per run, then the table ---------------------------------------
def child_command(args, run: str, out: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--child", run, "--out", out, "--size", args.size]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--overlap", args.overlap]
    command += ["--clip", str(args.clip), "--limits-elements", str(args.limits_elements)]
    if args.checkpointing:
        command.append("--checkpointing")
    if args.nvme_path:
        command += ["--nvme-path", args.nvme_path]
    return command


def spawn(args, run: str, timeout: float | None = None) -> dict:
    """`run` in a process of its own (its own process group, so that a run stopped at its time
    box takes the processes it started with it); its result, or why there is none."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    process = subprocess.Popen(
        child_command(args, run, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return {"failed": f"stopped at its time box, {timeout:g} s"}
        if process.returncode != 0:
            return {"failed": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {process.returncode}"}
        with open(out) as handle:
            return json.load(handle)
    finally:
        os.unlink(out)


def run_here(args, run: str) -> dict:
    """`run` in this process (`--in-process`), through the same child()."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-run-") as folder:
        out = os.path.join(folder, "result.json")
        try:
            child(argparse.Namespace(**{**vars(args), "child": run, "out": out}))
        except Exception as error:  # noqa: BLE001 - reported as the run's failure, as a child's exit would be
            return {"failed": f"{type(error).__name__}: {error}"}
        with open(out) as handle:
            return json.load(handle)


def progress_text(run: str, result: dict) -> str:
    """One finished run in a line, printed as it ends: a lease that stops the script part way
    through keeps what was measured before."""
    if "skipped" in result or "failed" in result:
        return f"{run}: {result.get('skipped') or 'failed: ' + result['failed']}"
    return f"{run}: {statistics.median(result['times']):.3f} s/step, start-up {result['startup']:.1f} s"


def floor_seconds(run: str, params: int, plain_fwd_bwd: float | None, limits: dict) -> float | None:
    """The least a step can take: GPU compute (plain forward+backward), the CPU Adam over every
    parameter, and the PCIe traffic (16-bit weights in, 16-bit gradients out; with params
    offloaded the weights come in twice, for forward and backward). The largest of them."""
    if run == "plain" or run in DEEPSPEED_RUNS or plain_fwd_bwd is None:
        return None
    parts = [plain_fwd_bwd, params / limits["adam_params_per_s"]]
    if "h2d_bytes_per_s" in limits:
        param_passes = 2 if run.split("/")[0] != "none" else 1  # "none/cpu@backward" too
        parts.append(param_passes * 2 * params / limits["h2d_bytes_per_s"])
        parts.append(2 * params / limits["d2h_bytes_per_s"])
    return max(parts)


def run_label(run: str, overlap: str) -> str:
    """How tables name a run: an offload run with its overlap (`none/cpu@default`: the engine's own)."""
    if run == "plain" or run in DEEPSPEED_RUNS or "@" in run:
        return run
    return f"{run}@{overlap}"


def recommend(args) -> dict:
    """The placement `offload estimate` recommends for this model (its Hugging Face config),
    batch, sequence and checkpointing on this machine: {"param", "optimizer", "config"}, each
    None when nothing fits."""
    import contextlib
    import io

    from offload import cli

    with tempfile.TemporaryDirectory(prefix="bench-gpu-estimate-") as folder:
        config = os.path.join(folder, "config.json")
        llama_config(args.size, args.seq).to_json_file(config)
        command = ["estimate", config, "--json", "--micro-batch", str(args.batch), "--seq-len", str(args.seq)]
        command += ["--nvme-path", args.nvme_path or tempfile.gettempdir()]
        if args.checkpointing:
            command.append("--checkpointing")
        if args.ram:
            command += ["--ram", args.ram]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = cli.main(command)
    if code != 0:
        raise SystemExit(f"offload estimate {' '.join(command)} failed (exit {code})")
    recommended = json.loads(printed.getvalue())["recommended"] or {}
    return {key: recommended.get(key) for key in ("param", "optimizer", "config")}


def workload_text(args, params: int) -> str:
    text = f"Llama {args.size} ({params / 1e9:.2f}B) bf16 b{args.batch}x{args.seq}"
    if args.checkpointing:
        text += " checkpointing"
    if args.clip:
        text += f" clip {args.clip:g}"
    return text


def record_rows(args, runs: list[str], results: dict, params: int, limits: dict) -> list[dict]:
    """The record's rows for the runs measured so far: plain PyTorch alone; each offload run
    against plain PyTorch and each DeepSpeed run; each DeepSpeed run against plain PyTorch; the
    measured limits."""
    from records import make_row

    tokens = args.batch * args.seq
    work = workload_text(args, params)
    seconds = {run: statistics.median(r["times"]) for run, r in results.items() if r.get("times")}
    plain = results.get("plain", {})
    rows = []
    for run in runs:
        if run not in seconds:
            continue
        result = results[run]
        figures = {
            "times": result["times"],
            "startup_s": result["startup"],
            "tflops": 6 * params * tokens / seconds[run] / 1e12,
            "gpu_peak_gib": result["gpu_peak"] / 2**30,
            "rss_peak_gib": result["rss_peak"] / 2**30,
            "losses": result.get("losses"),
        }
        for key in ("breakdown", "speculation", "tiers", "overlap", "deepspeed"):
            if key in result:
                figures[key] = result[key]
        floor = floor_seconds(run, params, plain.get("fwd_bwd"), limits)
        if floor:
            figures["floor_s"] = floor
        case = f"{work} {run_label(run, args.overlap)}"
        if run == "plain":
            rows.append(make_row(case, "s/step", seconds[run], figures={**figures, "fwd_bwd_s": result["fwd_bwd"]}))
            continue
        peers = [("plain", PLAIN)] + (
            [(ds, DEEPSPEED_RUNS[ds]) for ds in DEEPSPEED_RUNS if ds in seconds] if run not in DEEPSPEED_RUNS else []
        )
        measured = [(name, text) for name, text in peers if name in seconds]
        for name, text in measured or [(None, None)]:
            rows.append(make_row(case, "s/step", seconds[run], peer=text, peer_value=seconds.get(name), figures=figures))
    if limits.get("adam_params_per_s"):
        rows.append(
            make_row(
                f"CPU Adam, the engine's workload (bf16 grad in, bf16 copy out), {limits['adam_elements'] / 2**20:g}M elements, "
                f"{limits['adam_threads']} threads",
                "Gparam/s",
                limits["adam_params_per_s"] / 1e9,
                better="higher",
            )
        )
    for key, direction in (("h2d_bytes_per_s", "host to device"), ("d2h_bytes_per_s", "device to host")):
        if key in limits:
            rows.append(make_row(f"PCIe {direction}, pinned 1 GiB copies", "GB/s", limits[key] / 1e9, better="higher"))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--runs", default="plain,none/cpu,cpu/cpu,ds2,superoffload")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after 2 warm-up steps")
    parser.add_argument(
        "--overlap", default="default", choices=["default", "none", "forward", "backward"], help="default: the engine's own"
    )
    parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping (global norm) in every run; 0: off")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--ram", default=None, help="RAM for `recommended` (offload estimate --ram); default: what is available")
    parser.add_argument("--recommend", action="store_true", help="print the recommended placement as JSON and exit")
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds a run's process may take")
    parser.add_argument("--deadline", type=float, default=None, help="seconds since the epoch by which every run must end")
    parser.add_argument("--min-run", type=float, default=60.0, help="with --deadline: the least time a run is started with")
    parser.add_argument("--in-process", action="store_true", help="each run in this process (the dry run's speed)")
    parser.add_argument("--limits-elements", type=int, default=64 * 2**20, help="elements the CPU Adam rate is measured over")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.recommend:
        print(json.dumps(recommend(args)))
        return 0

    import transformers

    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.LlamaForCausalLM(llama_config(args.size, args.seq)).parameters())
    tokens = args.batch * args.seq
    runs = [run.strip() for run in args.runs.split(",") if run.strip()]
    recorder = Recorder("bench_gpu", vars(args), tag=args.size)
    if "recommended" in runs:
        chosen = recommend(args)
        placement = f"{chosen['param']}/{chosen['optimizer']}" if chosen["param"] else None
        recorder.note(f"recommended by offload estimate: {placement or 'nothing fits'}")
        print(f"offload estimate recommends {placement or 'nothing (no placement fits)'} here", flush=True)
        runs = [placement if run == "recommended" else run for run in runs if run != "recommended" or placement]
    started = time.perf_counter()

    def timed_run(run: str) -> dict:
        if run in DEEPSPEED_RUNS and importlib.util.find_spec("deepspeed") is None:
            return {"skipped": "deepspeed not installed (no module named deepspeed)"}
        timeout = args.run_timeout
        if args.deadline is not None:
            left = args.deadline - time.time()
            if left < args.min_run:
                return {"skipped": f"no time left ({max(0.0, left):.0f} s before the deadline, {args.min_run:.0f} s needed)"}
            timeout = left if timeout is None else min(timeout, left)
        if args.in_process:
            return run_here(args, run)
        return spawn(args, run, timeout)

    limits = timed_run("limits")
    if "adam_params_per_s" not in limits:
        print(f"[limits] {limits.get('skipped') or limits.get('failed')}", flush=True)
        limits = {}
    print(
        f"Llama-style {args.size} ({params / 1e9:.2f}B params), bf16, batch {args.batch}x{args.seq}, "
        f"checkpointing {'on' if args.checkpointing else 'off'}, overlap {args.overlap} (unless @), "
        f"clip {args.clip or 'off'}, device {limits.get('device')}",
        flush=True,
    )
    print(f"[limits] measured in {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, dict] = {}
    for index, run in enumerate(runs, 1):
        results[run] = timed_run(run)
        print(
            f"[{index}/{len(runs)}] {progress_text(run, results[run])} ({time.perf_counter() - started:.0f} s so far)", flush=True
        )
        if "skipped" in results[run] or "failed" in results[run]:
            recorder.note(progress_text(run, results[run]))
        recorder.record["rows"] = record_rows(args, runs, results, params, limits)
        recorder.write()
    recorder.finish()
    plain = results.get("plain", {})
    plain_s = statistics.median(plain["times"]) if plain.get("times") else None
    peer = {run: statistics.median(results[run]["times"]) for run in runs if run in DEEPSPEED_RUNS and results[run].get("times")}
    limit_text = f"CPU Adam {limits['adam_params_per_s'] / 1e9:.2f} G params/s" if limits else "CPU Adam not measured"
    if "h2d_bytes_per_s" in limits:
        limit_text += f", PCIe host->device {limits['h2d_bytes_per_s'] / 1e9:.1f} GB/s, device->host {limits['d2h_bytes_per_s'] / 1e9:.1f} GB/s"
    print(f"measured here: {limit_text}; plain forward+backward {plain.get('fwd_bwd', float('nan')):.3f} s")
    header = f"{'run':<19}{'s/step':>8}{'vs plain':>9}{'TFLOPS':>8}{'GPU GiB':>9}{'RSS GiB':>9}{'start s':>8}{'floor s':>8}{'/floor':>7}  breakdown / peers"
    print(header)
    print("-" * len(header))
    for run in runs:
        result = results[run]
        if "skipped" in result or "failed" in result:
            print(f"{run:<19}  {result.get('skipped') or 'failed: ' + result['failed']}")
            continue
        seconds = statistics.median(result["times"])
        floor = floor_seconds(run, params, plain.get("fwd_bwd"), limits) if limits else None
        line = (
            f"{run:<19}{seconds:>8.3f}{(seconds / plain_s if plain_s else float('nan')):>9.2f}"
            f"{6 * params * tokens / seconds / 1e12:>8.1f}{result['gpu_peak'] / 2**30:>9.1f}"
            f"{result['rss_peak'] / 2**30:>9.1f}{result['startup']:>8.1f}"
            f"{(floor or float('nan')):>8.3f}{(seconds / floor if floor else float('nan')):>7.2f}"
        )
        if "breakdown" in result:
            b = result["breakdown"]
            line += "  " + " ".join(
                f"{k}={b[k]:.3f}" for k in ("forward", "backward", "step", "wait_fetch", "wait_step", "cpu_adam") if k in b
            )
            line += "  " + " ".join(f"{peer_run} {peer_s / seconds:.2f}x" for peer_run, peer_s in peer.items())
            if any(result.get("speculation", {}).values()):
                line += "  speculative windows " + " ".join(f"{k} {v}" for k, v in result["speculation"].items())
        print(line)
    losses = {run: r["losses"] for run, r in results.items() if r.get("losses")}
    if losses:
        print("losses per step (warm-up steps first):")
        for run, values in losses.items():
            print(f"  {run:<17} " + " ".join(f"{v:.4f}" if math.isfinite(v) else str(v) for v in values))
    if recorder.path:
        print(f"record: {os.path.relpath(recorder.path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
