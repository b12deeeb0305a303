"""What compact optimizer state buys in memory and disk traffic: host bytes per trainable parameter
(optimizer cpu) and NVMe bytes moved per parameter per step (optimizer nvme), per
`optimizer.state_precision`, measured on the engine.

    python benchmarks/bench_state_memory.py                  # ~69M-param Llama, both parts
    python benchmarks/bench_state_memory.py --parts host --layers 4

The model: a Llama built here (random init, no downloads; 8 layers x 768, vocabulary 8192: about
69M parameters, so the engine's fixed buffers are noise next to the per-parameter state). Every run:
bf16 compute, gradient accumulation 1, param none (the 16-bit weights stay on the device: here
the CPU standing in), `optimizer.gradient_precision` auto (a 16-bit gradient where exact).

Host: `engine.memory_report()["host"]["peak"]` after a few steps, over the trainable parameter
count; the engine's own ledger of what it allocated (pinned or aligned host buffers), not RSS.

NVMe: bytes read plus bytes written by the engine's swap store over steps 2 and 3 (step 1 reads
the moments as implicit zeros, without I/O), over the parameter count and the 2 steps. Counted
by the swap store's counters (`SwapStore.bytes_read` / `bytes_written`: data bytes submitted to
the disk, O_DIRECT padding included, headers not), and checked against the kernel's count of the
process's storage I/O (/proc/self/io read_bytes / write_bytes, meaningful when the store uses
O_DIRECT, which it says: the page cache does not absorb O_DIRECT I/O). param none, so only
optimizer state crosses the disk; the gradients stay in RAM (`offload.gradient_memory` default).

Printed per precision: the measured bytes, what `config.state_layout` says they should be, the
ratio to fp32 and to issue 34's target (host: fp32 <= 14, bf16 <= 10, int8 <= 8.1 B/param; NVMe:
fp32 <= 28, int8 <= 16 B/param/step), and DeepSpeed's documented bytes per parameter beside
(documented, not measured here: DeepSpeed is not installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import offload  # noqa: E402
from offload.config.state_layout import StateBytes, gradient_bytes_for  # noqa: E402

HOST_TARGETS = {"fp32": 14.0, "bf16": 10.0, "int8": 8.1}
NVME_TARGETS = {"fp32": 28.0, "int8": 16.0}

# DeepSpeed's own figures for its ZeRO-Offload with the optimizer on the CPU: documented, not
# measured (DeepSpeed is not installed here). (precision, bytes per parameter or None, source)
DEEPSPEED_DOCUMENTED = (
    (
        "fp32",
        16.0,
        "fp32 master 4 + Adam moments 8 + fp32 gradient 4: deepspeed/runtime/zero/stage_1_and_2.py "
        "estimate_zero2_model_states_mem_needs, cpu_mem = params * max(4 * gpus, 16) * additional_buffer_factor "
        "(its default factor 1.5 makes it 24)",
    ),
    (
        "bf16",
        6.0,
        "optimizer state only, gradient not counted, and a bf16 master (not this engine's arithmetic): "
        "DeepSpeed PR #8010 (bf16_optimizer_states with offload_optimizer cpu, merged 2026-05): 'from ~10 to ~6 bytes/param'",
    ),
    ("int8", None, "DeepSpeed documents no 8-bit optimizer state for its CPU offload"),
)


def engine_state_precisions() -> tuple[str, ...]:
    """The `optimizer.state_precision` values this engine accepts: ("fp32",) until the key exists."""
    from offload.config.schema import OptimizerConfig

    if "state_precision" in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        return ("fp32", "bf16", "int8")
    return ("fp32",)


def build_model(layers: int, width: int, vocab: int, intermediate: int):
    """A Llama of random init (seed 0), no downloads."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters ({} where there is none)."""
    try:
        with open("/proc/self/io") as handle:
            return {key: int(value) for key, value in (line.split(":") for line in handle)}
    except OSError:
        return {}


def expected_bytes(state_precision: str, compute_bytes: int = 2) -> StateBytes:
    """What config.state_layout counts for this precision under the benchmark's settings."""
    return StateBytes(state_precision, gradient_bytes_for(compute_bytes, 1, "auto"))


def make_engine(model_factory, tier: str, state_precision: str, nvme_path: str, threads: int):
    optimizer = {"lr": 1e-4, "threads": threads}
    if engine_state_precisions() != ("fp32",):
        optimizer["state_precision"] = state_precision
    config = {
        "precision": "bf16",
        "optimizer": optimizer,
        "gradient_accumulation_steps": 1,
        # each step's I/O within its engine.step() call (overlap forward would run it in the next forward)
        "overlap": "none",
        "offload": {"param": "none", "optimizer": tier, "nvme_path": nvme_path},
    }
    return offload.initialize(model_factory(), config)


def one_step(engine, ids) -> None:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def measure_host(model_factory, state_precision, batches, nvme_path, threads) -> dict:
    engine = make_engine(model_factory, "cpu", state_precision, nvme_path, threads)
    try:
        params = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        for ids in batches:
            one_step(engine, ids)
        host = engine.memory_report()["host"]
    finally:
        engine.close(restore_weights=False)
    return {
        "params": params,
        "peak": host["peak"] / params,
        "current": host["current"] / params,
        "by_category": {k: v["peak"] / params for k, v in host["by_category"].items()},
    }


def measure_nvme(model_factory, state_precision, batches, nvme_path, threads) -> dict:
    engine = make_engine(model_factory, "nvme", state_precision, nvme_path, threads)
    try:
        params = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        swap = engine.store.swap
        one_step(engine, batches[0])  # the moments read as zeros: no read I/O for them
        before = (swap.bytes_read, swap.bytes_written, proc_io(), time.perf_counter())
        for ids in batches[1:]:
            one_step(engine, ids)
        after = (swap.bytes_read, swap.bytes_written, proc_io(), time.perf_counter())
        direct = swap.direct
    finally:
        engine.close(restore_weights=False)
    steps = len(batches) - 1
    per = params * steps
    return {
        "params": params,
        "read": (after[0] - before[0]) / per,
        "written": (after[1] - before[1]) / per,
        "proc_read": (after[2].get("read_bytes", 0) - before[2].get("read_bytes", 0)) / per,
        "proc_written": (after[2].get("write_bytes", 0) - before[2].get("write_bytes", 0)) / per,
        "direct": direct,
        "seconds_per_step": (after[3] - before[3]) / steps,
    }


def main(argv=None) -> dict:
    """Parses the options (see the module docstring), measures and prints; returns the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=16, help="tokens per step (one sequence): the step's compute is not measured")
    parser.add_argument("--parts", default="host,nvme", help="host, nvme or both")
    parser.add_argument("--precisions", default=None, help="comma-separated state precisions (default: all the engine has)")
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one under the working directory)")
    parser.add_argument("--threads", type=int, default=1, help="torch and C++ Adam threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    precisions = engine_state_precisions()
    if args.precisions:
        wanted = tuple(p.strip() for p in args.precisions.split(","))
        unknown = [p for p in wanted if p not in precisions]
        if unknown:
            raise SystemExit(f"--precisions: {unknown} not available in this engine; it has {list(precisions)}")
        precisions = wanted
    parts = {p.strip() for p in args.parts.split(",")}

    def model_factory():
        return build_model(args.layers, args.width, args.vocab, args.intermediate)

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (1, args.seq), generator=generator) for _ in range(3)]
    print(
        f"Llama {args.layers}x{args.width} (mlp {args.intermediate}, vocabulary {args.vocab}), bf16 compute, accumulation 1, "
        f"param none, gradient_precision auto; state precisions {list(precisions)}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if precisions == ("fp32",):
        print("only fp32: the engine has no optimizer.state_precision yet")
    results: dict = {"host": {}, "nvme": {}}
    with tempfile.TemporaryDirectory(prefix="bench-state-memory-", dir=args.nvme_path or ".") as swap:
        if "host" in parts:
            for precision in precisions:
                results["host"][precision] = measure_host(model_factory, precision, batches, swap, args.threads)
        if "nvme" in parts:
            for precision in precisions:
                results["nvme"][precision] = measure_nvme(model_factory, precision, batches, swap, args.threads)

    if results["host"]:
        params = next(iter(results["host"].values()))["params"]
        print(
            f"\nhost bytes per trainable parameter, optimizer cpu ({params / 1e6:.1f}M params; memory_report host peak after 3 steps)"
        )
        header = (
            f"{'state':<7}{'B/param':>9}{'layout':>8}{'vs fp32':>9}{'target':>8}{'vs target':>11}{'DeepSpeed*':>12}"
            "   by category (peak B/param)"
        )
        print(header)
        print("-" * len(header))
        fp32 = results["host"].get("fp32", {}).get("peak")
        deepspeed = {precision: value for precision, value, _ in DEEPSPEED_DOCUMENTED}
        for precision, row in results["host"].items():
            target = HOST_TARGETS.get(precision)
            categories = ", ".join(f"{k} {v:.3f}" for k, v in row["by_category"].items())
            print(
                f"{precision:<7}{row['peak']:>9.3f}{expected_bytes(precision).per_element:>8.3f}"
                f"{(row['peak'] / fp32 if fp32 else float('nan')):>9.3f}{target:>8.1f}{row['peak'] / target:>11.3f}"
                f"{deepspeed.get(precision) or '-':>12}   {categories}"
            )
        print("layout: what offload.config.state_layout counts per element; vs target: B/param over issue 34's target")
        print("* DeepSpeed ZeRO-Offload, optimizer on the CPU: documented, not measured")
        for precision, value, text in DEEPSPEED_DOCUMENTED:
            print(f"  {precision:<5} {value or '-'}: {text}")
    if results["nvme"]:
        params = next(iter(results["nvme"].values()))["params"]
        print(
            f"\nNVMe bytes per parameter per step, optimizer nvme ({params / 1e6:.1f}M params; steps 2..3; swap store counters)"
        )
        header = f"{'state':<7}{'read':>8}{'written':>9}{'total':>8}{'layout':>8}{'vs fp32':>9}{'target':>8}{'vs target':>11}{'/proc r+w':>11}{'s/step':>8}"
        print(header)
        print("-" * len(header))
        fp32 = results["nvme"].get("fp32")
        for precision, row in results["nvme"].items():
            total = row["read"] + row["written"]
            row["total"] = total
            # master and moments, read and written (int8 exponent bytes amortised over the model)
            layout = 2 * expected_bytes(precision).stepped_bytes(row["params"]) / row["params"]
            target = NVME_TARGETS.get(precision)
            print(
                f"{precision:<7}{row['read']:>8.3f}{row['written']:>9.3f}{total:>8.3f}{layout:>8.3f}"
                f"{(total / (fp32['read'] + fp32['written']) if fp32 else float('nan')):>9.3f}"
                + (f"{target:>8.1f}{total / target:>11.3f}" if target else f"{'-':>8}{'-':>11}")
                + f"{row['proc_read'] + row['proc_written']:>11.3f}{row['seconds_per_step']:>8.2f}"
            )
        direct = all(row["direct"] for row in results["nvme"].values())
        print(
            f"swap I/O {'O_DIRECT' if direct else 'buffered (no O_DIRECT on this path)'}: /proc/self/io "
            + ("counts the same bytes the disk saw" if direct else "may undercount (the page cache absorbs buffered I/O)")
        )
        print("documented, not measured: DeepSpeed publishes no per-step NVMe bytes for its optimizer offload")
    record_results(args, results)
    return results


def record_results(args, results: dict) -> None:
    """The run's record: host bytes per parameter and NVMe bytes per parameter per step, each
    compact precision against fp32 state."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Recorder

    recorder = Recorder("bench_state_memory", vars(args))
    model = f"Llama {args.layers}x{args.width}"
    for part, metric, value_of in (
        ("host", "host B/param", lambda row: row["peak"]),
        ("nvme", "NVMe B/param/step (read + written)", lambda row: row["read"] + row["written"]),
    ):
        rows = results[part]
        for precision, row in rows.items():
            case = f"{model} {row['params'] / 1e6:.1f}M, optimizer {'cpu' if part == 'host' else 'nvme'}: state {precision}"
            peer = {"peer": "fp32 state", "peer_value": value_of(rows["fp32"])} if precision != "fp32" and "fp32" in rows else {}
            recorder.add(case, metric, value_of(row), figures=row, **peer)
    recorder.finish()


if __name__ == "__main__":
    main()
