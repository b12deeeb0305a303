"""engine.save_pretrained against the disk and against the route it replaces, in one run.

A Llama-shaped model (--layers, --hidden; untied head) trained one step on the engine, then saved
three ways into directories on --path, each timed with the process's resident memory sampled
every 10 ms:

- a raw sequential write of the same number of bytes (Python os.write of a 16 MiB buffer,
  fsync; and dd from /dev/zero): the disk's rate;
- `engine.save_pretrained(dir, max_shard_size)`: the fp32 weights, streamed unit by unit;
- `model.save_pretrained(dir, state_dict=engine.consolidated_state_dict(), max_shard_size)`:
  what OffloadTrainer.save_model and the examples did before (the whole fp32 state dict in RAM,
  then transformers' writer, which serializes each shard whole).

in --rounds rounds, alternated (a shared disk's load changes). Reported: GB/s of each, best and
median round (and the streamed save's share of the raw write's), and the growth of peak resident
memory above the engine's own during each save (the heap trimmed first), largest round. A
virtual disk may write zeros faster than data: the Python write of random bytes is the like for
like comparison.

    PYTHONPATH=. python benchmarks/bench_save_pretrained.py --path /mnt/nvme/tmp --layers 16 --hidden 1024
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_checkpoint import PeakRss, dd, python_write  # noqa: E402 - the benchmarks' folder on the path first
from records import Recorder  # noqa: E402

import offload  # noqa: E402


def llama(layers: int, hidden: int, vocab: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 512),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def raw_write(directory: str, nbytes: int) -> dict:
    """Seconds to write `nbytes` sequentially and fsync them: Python os.write of a random 16 MiB
    buffer (as the savers write tensors), and dd from /dev/zero."""
    block = min(16 << 20, max(1 << 20, nbytes))
    blocks = max(1, -(-nbytes // block))
    probe = os.path.join(directory, "raw.bin")
    write_s = python_write(probe, block, blocks)
    os.remove(probe)
    dd_s = dd(["if=/dev/zero", f"of={probe}", f"bs={block}", f"count={blocks}", "conv=fsync"])
    os.remove(probe)
    return {"bytes": blocks * block, "python_s": write_s, "dd_s": dd_s}


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def trim() -> None:
    """Returns the heap's free pages to the system (glibc), so that a phase's resident memory
    grows from what the process holds, not from what it freed earlier and kept."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def timed(label: str, rounds: dict, save) -> None:
    trim()
    with PeakRss() as peak:
        started = time.perf_counter()
        directory = save()
        seconds = time.perf_counter() - started
    rounds.setdefault(label, []).append(
        {"seconds": seconds, "bytes": directory_bytes(directory), "rss_growth": peak.growth, "rss_peak": peak.peak}
    )
    shutil.rmtree(directory)


def run(args) -> dict:
    work = tempfile.mkdtemp(prefix="bench-save-pretrained-", dir=args.path)
    try:
        model = llama(args.layers, args.hidden, args.vocab)
        params = sum(p.numel() for p in model.parameters())
        config = {
            "precision": "bf16",
            "offload": {"param": "cpu", "optimizer": args.optimizer, "nvme_path": os.path.join(work, "swap")},
            "optimizer": {"lr": 1e-4},
        }
        os.mkdir(config["offload"]["nvme_path"])
        engine = offload.initialize(model, config)
        ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(1))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        out = os.path.join(work, "out")

        def streamed() -> str:
            engine.save_pretrained(out, max_shard_size=args.max_shard_size)
            return out

        def whole() -> str:
            state = engine.consolidated_state_dict()
            model.save_pretrained(out, state_dict=state, max_shard_size=args.max_shard_size)
            return out

        raw: list[dict] = []
        rounds: dict[str, list[dict]] = {}
        # alternated, so that a shared disk's changing load falls on every kind alike
        for _ in range(args.rounds):
            raw.append(raw_write(work, params * 4))
            timed("streamed", rounds, streamed)
            timed("whole", rounds, whole)
        raw.append(raw_write(work, params * 4))
        engine.close(restore_weights=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"params": params, "units": args.layers + 1, "max_shard_size": args.max_shard_size, "raw": raw, **rounds}


def report(result: dict, recorder: Recorder) -> None:
    """GB/s of each kind, best and median round (a shared disk's speed changes from one minute
    to the next), and the largest peak-RSS growth of each save; the streamed save's two rows go
    into the run's record (benchmarks/records.py)."""
    gb, mib = 1e9, 2**20
    params = result["params"]
    print(
        f"model: Llama-shaped, {params / 1e6:.0f}M params ({params * 4 / gb:.2f} GB in fp32), {result['units']} units; "
        f"max_shard_size {result['max_shard_size']}; {len(result['streamed'])} rounds"
    )
    rates = {
        "raw write, random bytes (Python os.write + fsync)": [r["bytes"] / r["python_s"] for r in result["raw"]],
        "raw write, zeros (dd /dev/zero + fsync)": [r["bytes"] / r["dd_s"] for r in result["raw"]],
        "engine.save_pretrained (streamed)": [r["bytes"] / r["seconds"] for r in result["streamed"]],
        "model.save_pretrained(consolidated_state_dict())": [r["bytes"] / r["seconds"] for r in result["whole"]],
    }
    growth = [max(r["rss_growth"] for r in result[kind]) for kind in ("streamed", "whole")]
    print(f"{'operation':50s} {'best GB/s':>9s} {'median':>7s} {'peak RSS +MiB':>14s}")
    for (name, values), grown in zip(rates.items(), [None, None, *growth]):
        extra = "" if grown is None else f"{grown / mib:14.0f}"
        print(f"{name:50s} {max(values) / gb:9.2f} {statistics.median(values) / gb:7.2f} {extra}")
    raw, zeros, streamed, whole = (statistics.median(values) for values in rates.values())
    print(
        f"engine.save_pretrained, median: {streamed / raw:.0%} of the raw write of random bytes, {streamed / zeros:.0%} "
        f"of dd's zeros, {streamed / whole:.2f}x the whole-state-dict route; peak RSS growth {growth[0] / mib:.0f} MiB "
        f"against {growth[1] / mib:.0f} MiB"
    )
    case = f"{params / 1e6:.0f}M Llama ({params * 4 / gb:.2f} GB fp32), shards of {result['max_shard_size']}, {len(result['streamed'])} rounds"
    best = {name: max(values) / gb for name, values in rates.items()}
    recorder.add(
        case, "GB/s", streamed / gb, better="higher", peer="raw write of random bytes (os.write, fsync)", peer_value=raw / gb,
        figures={"best": best, "dd_zeros_median": zeros / gb, "whole_state_dict_median": whole / gb},
    )  # fmt: skip
    recorder.add(
        case, "peak RSS growth MiB", growth[0] / mib, better="lower",
        peer="model.save_pretrained(consolidated_state_dict())", peer_value=growth[1] / mib,
    )  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=".", help="directory on the disk to measure (a temporary directory goes there)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--optimizer", default="cpu", choices=["cpu", "nvme"], help="the engine's optimizer tier")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of raw write, streamed save, whole save")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    recorder = Recorder("bench_save_pretrained", vars(args))
    result = run(args)
    report(result, recorder)
    recorder.finish()
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
