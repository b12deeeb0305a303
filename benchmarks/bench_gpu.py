"""offload on a GPU against plain PyTorch and DeepSpeed, one process per line, and the floor.

The same Llama-style model, init and batches for every run; each run in its own process (so
one run's memory and pinned pages never help or hurt the next). For each: seconds per step
(median of the timed steps), model TFLOPS (6 x params x tokens / step time), GPU peak, peak
RSS, start-up time (model build and engine start), and the engine's own breakdown. The floor
is computed from numbers measured in the same run: the plain forward+backward time (GPU
compute), the CPU Adam rate of this machine (the C++ kernel over the model's parameter count),
and the PCIe rate each way times the bytes a step must move for the placement; the ratio of
each offload run to that floor says how much of the hardware is left on the table.

    python benchmarks/bench_gpu.py --size 1.3b [--runs plain,none/cpu,cpu/cpu,ds2,ds3] [--steps 6]
    python benchmarks/bench_gpu.py --size 1.3b --clip 1.0 --runs plain,none/cpu@forward,none/cpu@backward,ds2
    python benchmarks/bench_gpu.py --size 7b --checkpointing --batch 4 --runs none/cpu
    python benchmarks/bench_gpu.py --size tiny --runs plain,none/cpu    # seconds on a CPU: smoke

DeepSpeed runs (ds2: ZeRO-2 with offload_optimizer cpu, pinned; ds3: ZeRO-3 with params and
optimizer on the CPU) need `import deepspeed` to work; they are skipped with the reason
otherwise. An offload run is `param/optimizer`, optionally `@overlap` (`none/cpu@backward`: that
run's overlap instead of --overlap). `--clip N` clips the global gradient norm at N in every
run (plain PyTorch with clip_grad_norm_, DeepSpeed's gradient_clipping, offload's
gradient_clipping: with overlap backward the step is then speculative). Sizes "7b" and larger build the model on the meta device for offload (materialised
one unit at a time) and are not run for plain PyTorch (it does not fit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 176, 2, 4, 4, 512),
    "1.3b": (2048, 5632, 24, 16, 16, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "13b": (5120, 13824, 40, 40, 40, 32000),
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
    times, fwd_bwd = [], []
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
    return {"times": times[2:], "fwd_bwd": statistics.median(fwd_bwd[2:]), "startup": startup}


def run_offload(args, device, param: str, optimizer: str, overlap: str) -> dict:
    import offload

    started = time.perf_counter()
    model = build(args.size, args.seq, meta=args.size not in ("tiny", "1.3b"))
    if args.checkpointing:
        enable_checkpointing(model)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.nvme_path) as swap:
        config = {
            "precision": "bf16",
            "optimizer": {"lr": 1e-4},
            "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
            "overlap": overlap,
            "gradient_clipping": args.clip,
        }
        engine = offload.initialize(model, config, device=device)
        startup = time.perf_counter() - started
        times, breakdowns = [], []
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
            report = engine.memory_report()
            speculation = dict(engine.speculation_counts)
        finally:
            engine.close(restore_weights=False)
    median = sorted(range(2, len(times)), key=lambda i: times[i])[(len(times) - 2) // 2]
    return {
        "times": times[2:],
        "breakdown": breakdowns[median],
        "startup": startup,
        "tiers": {tier: report[tier]["peak"] for tier in ("device", "host", "nvme")},
        "speculation": speculation,
    }


def run_deepspeed(args, device, stage: int) -> dict:
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 (any import failure means: not available here)
        return {"skipped": f"deepspeed not importable: {type(error).__name__}: {error}"}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + stage))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed()
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": args.clip,
    }
    started = time.perf_counter()
    model = build(args.size, args.seq, meta=False)
    if args.checkpointing:
        enable_checkpointing(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    startup = time.perf_counter() - started
    times = []
    for ids in batches(args.size, args.steps + 2, args.batch, args.seq):
        ids = ids.to(engine.device)
        sync(device)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"times": times[2:], "startup": startup}


def measure_limits(device) -> dict:
    """This machine's CPU Adam rate (params/s over a 64M-element array, the kernel the engine
    runs) and PCIe rate each way (pinned 1 GiB copies; none on a CPU device)."""
    from offload.optim import kernels

    n = 64 * 2**20
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
    limits = {"adam_params_per_s": statistics.median(rates[1:])}
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
    elif args.child in ("ds2", "ds3"):
        result = run_deepspeed(args, device, int(args.child[2]))
    elif args.child == "limits":
        result = measure_limits(device)
    else:
        placement, _, overlap = args.child.partition("@")
        param, optimizer = placement.split("/")
        result = run_offload(args, device, param, optimizer, overlap or args.overlap)
    result.update(gpu_peak=gpu_peak(device), rss_peak=peak_rss_bytes(), device=str(device))
    with open(args.out, "w") as handle:
        json.dump(result, handle)


# ---- the parent: one process per run, then the table ---------------------------------------
def spawn(args, run: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        run,
        "--out",
        out,
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--overlap",
        args.overlap,
        "--clip",
        str(args.clip),
    ]
    if args.checkpointing:
        command.append("--checkpointing")
    if args.nvme_path:
        command += ["--nvme-path", args.nvme_path]
    finished = subprocess.run(command, capture_output=True, text=True)
    try:
        if finished.returncode != 0:
            return {
                "failed": finished.stderr.strip().splitlines()[-1] if finished.stderr.strip() else f"exit {finished.returncode}"
            }
        with open(out) as handle:
            return json.load(handle)
    finally:
        os.unlink(out)


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
    if run in ("plain",) or plain_fwd_bwd is None:
        return None
    parts = [plain_fwd_bwd, params / limits["adam_params_per_s"]]
    if "h2d_bytes_per_s" in limits:
        param_passes = 2 if run.split("/")[0] != "none" else 1  # "none/cpu@backward" too
        parts.append(param_passes * 2 * params / limits["h2d_bytes_per_s"])
        parts.append(2 * params / limits["d2h_bytes_per_s"])
    return max(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--runs", default="plain,none/cpu,none/cpu@backward,cpu/cpu,ds2,ds3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--overlap", default="forward", choices=["none", "forward", "backward"])
    parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping (global norm) in every run; 0: off")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    import transformers

    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.LlamaForCausalLM(llama_config(args.size, args.seq)).parameters())
    tokens = args.batch * args.seq
    runs = [run.strip() for run in args.runs.split(",") if run.strip()]
    started = time.perf_counter()
    limits = spawn(args, "limits")
    print(
        f"Llama-style {args.size} ({params / 1e9:.2f}B params), bf16, batch {args.batch}x{args.seq}, "
        f"checkpointing {'on' if args.checkpointing else 'off'}, overlap {args.overlap} (unless @), "
        f"clip {args.clip or 'off'}, device {limits.get('device')}",
        flush=True,
    )
    print(f"[limits] measured in {time.perf_counter() - started:.0f} s", flush=True)
    results = {}
    for index, run in enumerate(runs, 1):
        results[run] = spawn(args, run)
        print(
            f"[{index}/{len(runs)}] {progress_text(run, results[run])} ({time.perf_counter() - started:.0f} s so far)", flush=True
        )
    plain = results.get("plain", {})
    plain_s = statistics.median(plain["times"]) if plain.get("times") else None
    peer = {}
    for run in runs:
        if run.startswith("ds") and results[run].get("times"):
            peer[run] = statistics.median(results[run]["times"])
    limit_text = f"CPU Adam {limits['adam_params_per_s'] / 1e9:.2f} G params/s"
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
        floor = floor_seconds(run, params, plain.get("fwd_bwd"), limits)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
