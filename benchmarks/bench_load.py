"""Pretrained weights in (issue 48, item 6): how fast `initialize(weights=)` reads the shards against
reading the same files raw, and what RAM it holds against the `from_pretrained` route.

    PYTHONPATH=. python benchmarks/bench_load.py --dir /work/bench-load             # a 1.1B Llama in bf16
    PYTHONPATH=. python benchmarks/bench_load.py --dir /work/bench-load --scale     # 3.4B, param/optimizer nvme, steps

1. Writes a Llama-shaped model (TinyLlama-1.1B's shape; with --scale OpenLLaMA-3B's, 3.43B
   params) as bf16 safetensors shards of at most --shard-gb, with random values, generated shard
   by shard (the model is never whole in RAM), plus config.json and the index. Kept between runs.
2. Load rate, --rounds times, the page cache dropped before each run (each file fsync'ed, then
   POSIX_FADV_DONTNEED, which evicts its clean pages without root): a plain sequential read of
   every shard in 16 MiB requests (what `dd bs=16M` does); in fresh processes, the load's reads
   alone (each unit's byte ranges, requests and buffers as the load makes them), the load's
   reading and converting (`PretrainedWeights.unit_values` over every unit as the engine's
   materialize thread calls it, nothing placed); and the meta model and
   `initialize(weights=DIR)` with param and optimizer in RAM (`cpu`, int8 moments to fit 24
   GiB; its time includes the engine's first touch of its own host buffers). Prints medians.
3. Peak RSS (getrusage of each fresh process), same placement for both: the meta model +
   `weights=` against `from_pretrained(DIR, dtype=float32)` + `initialize(model)` (the example's
   old route), param and optimizer on NVMe (what a model larger than RAM uses).
4. --scale: the 3.4B model with param nvme / optimizer nvme (int8 moments, to fit the swap in
   this machine's disk; prefetch depth 1 and 16M-element state pieces, as the CPU standing in for
   the accelerator puts the "device" memory in RSS too), initialised from its shards and stepped
   --steps times; peak RSS against the model's bf16 size. The swap files go with the engine; --clean removes the shards too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_io  # noqa: E402

GB = 1e9
SHAPES = {
    # TinyLlama-1.1B
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    # OpenLLaMA-3B: 3.43B params
    "3b": {
        "hidden_size": 3200,
        "intermediate_size": 8640,
        "num_hidden_layers": 26,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
}


def llama_config(size: str):
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False, **SHAPES[size])


def write_shards(directory: str, size: str, shard_bytes: int) -> None:
    """The model's bf16 state, shard by shard: each tensor drawn when its shard is written."""
    import transformers
    from safetensors.torch import save_file

    config = llama_config(size)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    groups: list[list[str]] = [[]]
    used = 0
    for key, shape in shapes.items():
        nbytes = shape.numel() * 2
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    os.makedirs(directory, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for number, keys in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for key in keys:
            if key.endswith("norm.weight"):
                shard[key] = torch.ones(shapes[key], dtype=torch.bfloat16)
            else:
                shard[key] = (torch.randn(shapes[key], generator=generator) * 0.02).to(torch.bfloat16)
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        print(f"  wrote {name} ({sum(t.numel() for t in shard.values()) * 2 / GB:.2f} GB)", flush=True)
        del shard
    total = sum(s.numel() * 2 for s in shapes.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle)
    config.save_pretrained(directory)


def shard_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def drop_cache(files: list[str]) -> None:
    """Evicts the files' pages from the page cache (bench_io's eviction, file by file)."""
    for path in files:
        bench_io.drop_cache(path)


def raw_read(files: list[str]) -> tuple[int, float]:
    """Every file read front to back in 16 MiB requests: (bytes, seconds)."""
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    total = 0
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while True:
                count = handle.readinto(view)
                if not count:
                    break
                total += count
    return total, time.perf_counter() - started


def read_stage(directory: str, config: dict, convert: bool = True) -> dict:
    """The load's reading and converting alone, as the engine's materialize thread runs it (each
    unit's shard read, the next one's reads started before this one's conversion), with no
    placing: what the disk and the conversion give, apart from the engine's own buffers.
    `convert` False: the same reads (the same byte ranges, requests and buffers), nothing else.
    Timed from the end of the check of the files and keys (`check_s`, reported apart)."""
    import transformers

    from offload.config.schema import load_config
    from offload.model.unit_state import UnitState
    from offload.model.units import build_units, plan_flat_layout
    from offload.runtime.weights_in import open_pretrained

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    units = []
    for spec in build_units(model):
        layout = plan_flat_layout([p.numel() for p in spec.params], 1)
        units.append(UnitState(spec, layout, optimizer_numel=layout.optimizer_numel(0), param_groups=(0,) * len(spec.params)))
    started = time.perf_counter()
    weights = open_pretrained(directory, model, strict=True, io=load_config(config).io)
    checked = time.perf_counter() - started
    started = time.perf_counter()
    if convert:
        for i, unit in enumerate(units):
            weights.unit_values(model, unit, 0, units[i + 1] if i + 1 < len(units) else None)
    else:  # one unit's reads ahead of the one waited for, as the load keeps them
        pending = weights._submit(weights._plan(units[0], 0))
        for unit in units[1:] + [None]:
            upcoming = weights._submit(weights._plan(unit, 0)) if unit is not None else None
            pending.wait()
            pending = upcoming
    stats = weights.close()
    seconds = time.perf_counter() - started
    return {
        "route": "stage",
        "read_bytes": stats.bytes,
        "read_s": stats.read_seconds,
        "initialize_s": seconds,
        "check_s": checked,
    }


def rank_stage(rank: int, world: int, directory: str, port: int, queue) -> None:
    """One of `world` ranks (gloo on this machine): its shards' reads and conversion, as the load
    runs them, then the alternative's traffic: every unit's fp32 values broadcast from rank 0."""
    import torch.distributed as dist
    import transformers

    from offload.config.schema import load_config
    from offload.model.unit_state import UnitState
    from offload.model.units import build_units, plan_flat_layout
    from offload.runtime.weights_in import open_pretrained

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    units = []
    for spec in build_units(model):
        layout = plan_flat_layout([p.numel() for p in spec.params], world)
        units.append(UnitState(spec, layout, optimizer_numel=layout.optimizer_numel(rank), param_groups=(0,) * len(spec.params)))
    dist.barrier()
    started = time.perf_counter()
    weights = open_pretrained(directory, model, strict=True, io=load_config({}).io)
    for i, unit in enumerate(units):
        weights.unit_values(model, unit, rank, units[i + 1] if i + 1 < len(units) else None)
    stats = weights.close()
    dist.barrier()
    sharded = time.perf_counter() - started
    started = time.perf_counter()
    for unit in units:  # the same units' fp32 values from rank 0, as the model's own init sends them
        dist.broadcast(torch.zeros(unit.layout.padded_numel), src=0)
    broadcast = time.perf_counter() - started
    queue.put((rank, stats.bytes, sharded, broadcast))
    dist.destroy_process_group()


def compare_rank_reading(shards: str, files: list[str], world: int = 2) -> None:
    """Each of `world` ranks reading its shards, against the broadcast the other scheme needs."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    drop_cache(files)
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=rank_stage, args=(r, world, shards, port, queue)) for r in range(world)]
    for process in processes:
        process.start()
    results = sorted(queue.get() for _ in processes)
    for process in processes:
        process.join()
    total = sum(os.path.getsize(f) for f in files)
    reads = ", ".join(f"rank {r} {count / GB:.2f} GB" for r, count, _, _ in results)
    print(
        f"{world} ranks: each read its shards ({reads}; {total / GB:.2f} GB in the files), read and converted in "
        f"{max(r[2] for r in results):.1f} s; rank 0 broadcasting every unit's fp32 values instead moves "
        f"{2 * total / GB:.2f} GB (fp32: twice the bf16 files) to each rank, which took {max(r[3] for r in results):.1f} s "
        "over gloo on top of rank 0 reading all of it"
    )


def child(route: str, directory: str, config: dict, steps: int) -> dict:
    """One measured route in this (fresh) process; returns its figures as a dict."""
    import transformers

    import offload

    if route in ("stage", "reads"):
        return read_stage(directory, config, convert=route == "stage")
    started = time.perf_counter()
    if route == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        loaded = time.perf_counter() - started
        engine = offload.initialize(model, config)
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
        loaded = 0.0
        engine = offload.initialize(model, config, weights=directory)
    ready = time.perf_counter() - started
    stats = engine._runtime.weights_load
    step_seconds = []
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        begun = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        step_seconds.append(time.perf_counter() - begun)
    engine.close(restore_weights=False)
    return {
        "route": route,
        "from_pretrained_s": loaded,
        "initialize_s": ready,
        "read_bytes": stats.bytes if stats else None,
        "read_s": stats.read_seconds if stats else None,
        "step_s": step_seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_child(route: str, directory: str, config: dict, steps: int = 0) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        route,
        "--dir",
        directory,
        "--config",
        json.dumps(config),
        "--steps",
        str(steps),
    ]
    # the child's log (offload's INFO lines: the load's progress) goes to this process's stderr
    output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO}).stdout
    return json.loads(output.strip().splitlines()[-1])


def engine_config(swap: str, param: str, optimizer: str, **optimizer_keys) -> dict:
    # no RAM spent beyond what the placement needs (the engine would keep NVMe units' gradients
    # and spare states in RAM it finds free): the peak RSS is then the placement's, and the load's
    return {
        "precision": "bf16",
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap, "gradient_memory": 0, "speculation_memory": 0},
        "optimizer": {"lr": 1e-5, **optimizer_keys},
        "overlap": "none",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="where the shards (and the swap files) go")
    parser.add_argument("--scale", action="store_true", help="the 3.4B run: param and optimizer nvme, stepped")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--clean", action="store_true", help="remove the shards at the end")
    parser.add_argument("--ranks", action="store_true", help="only: two ranks reading their shards against a broadcast")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        logging.basicConfig(level=logging.INFO, format="    %(asctime)s %(message)s", stream=sys.stderr)
        print(json.dumps(child(args.child, args.dir, json.loads(args.config), args.steps)))
        return
    size = "3b" if args.scale else "1b"
    shards = os.path.join(args.dir, f"llama-{size}-bf16")
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    if not os.path.exists(os.path.join(shards, "config.json")):
        print(f"writing the {size} model's shards to {shards}", flush=True)
        write_shards(shards, size, int(args.shard_gb * GB))
    files = shard_files(shards)
    model_bytes = sum(os.path.getsize(f) for f in files)
    print(f"model: {model_bytes / GB:.2f} GB of bf16 shards in {len(files)} files")
    try:
        if args.ranks:
            compare_rank_reading(shards, files)
        elif args.scale:
            scale_run(shards, swap, files, model_bytes, args.steps)
        else:
            rate_and_rss(shards, swap, files, model_bytes, args.rounds)
    finally:
        if args.clean:
            shutil.rmtree(shards, ignore_errors=True)


def rate_and_rss(shards: str, swap: str, files: list[str], model_bytes: int, rounds: int) -> None:
    rates: dict[str, list[float]] = {"raw": [], "reads": [], "stage": [], "weights": []}
    for round_ in range(rounds):
        drop_cache(files)
        count, seconds = raw_read(files)
        rates["raw"].append(count / seconds)
        line = [f"raw {rates['raw'][-1] / GB:.2f}"]
        for route in ("reads", "stage", "weights"):
            drop_cache(files)
            extra = {"state_precision": "int8"} if route == "weights" else {}
            result = run_child(route, shards, engine_config(swap, "cpu", "cpu", **extra))
            rates[route].append(result["read_bytes"] / result["initialize_s"])
            checked = f", after a {result['check_s']:.1f} s check" if "check_s" in result else ""
            line.append(f"{route} {rates[route][-1] / GB:.2f} ({result['initialize_s']:.1f} s{checked})")
        print(f"  round {round_ + 1} (GB/s): " + "; ".join(line), flush=True)
    median = {route: statistics.median(values) for route, values in rates.items()}
    print(
        f"load rate (medians of {rounds}, page cache dropped, GB/s): raw sequential read {median['raw'] / GB:.2f}; "
        f"the load's reads alone {median['reads'] / GB:.2f} ({median['reads'] / median['raw']:.0%} of raw); its reads "
        f"and bf16->fp32 conversion {median['stage'] / GB:.2f} ({median['stage'] / median['raw']:.0%}); the whole "
        f"initialize(weights=), param and optimizer in RAM, {median['weights'] / GB:.2f} ({median['weights'] / median['raw']:.0%})"
    )
    nvme = engine_config(swap, "nvme", "nvme")
    for route in ("weights", "from_pretrained"):
        drop_cache(files)
        result = run_child(route, shards, nvme)
        print(
            f"peak RSS, param/optimizer nvme, {route:15s}: {result['peak_rss'] / GB:.2f} GB "
            f"({result['peak_rss'] / model_bytes:.2f}x the bf16 model), start {result['initialize_s']:.1f} s"
        )


def scale_run(shards: str, swap: str, files: list[str], model_bytes: int, steps: int) -> None:
    drop_cache(files)
    config = engine_config(swap, "nvme", "nvme", state_precision="int8")
    # the CPU stands in for the accelerator here, so the units on the "device" (prefetched ahead,
    # in use, their gradients) are RSS too: one unit ahead, and state pieces of 16M elements
    config["prefetch"] = {"depth": 1}
    config["offload"]["sub_group_size"] = 1 << 24
    result = run_child("weights", shards, config, steps)
    print(
        f"scale run: initialize(weights=) {result['initialize_s']:.1f} s ({result['read_bytes'] / GB:.2f} GB read, "
        f"{result['read_s']:.1f} s of it waiting for the disk); steps "
        f"{', '.join(f'{s:.1f}' for s in result['step_s'])} s; peak RSS {result['peak_rss'] / GB:.2f} GB = "
        f"{result['peak_rss'] / model_bytes:.2f}x the model's bf16 size ({model_bytes / GB:.2f} GB)"
    )


if __name__ == "__main__":
    main()
