"""Sharding: the same model trained on 1 and on 2 ranks (CPU processes, gloo), in one run.

For each placement and world size: the median step time (forward + backward + optimizer
step, the step waited for; each rank trains on its 1/N of the same global batch) and the
bytes each rank holds per tier (`engine.memory_report()`: device peak, host and NVMe now).
The cores are split evenly between the ranks (torch and Adam threads = cores // world), so
the 2-rank column shows the cost of the collectives and the saving in bytes per rank, not
extra hardware.

    python benchmarks/bench_sharding.py [--width 512 --depth 8 --steps 8 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout
sys.path.insert(0, os.path.join(ROOT, "tests"))

from distributed_worker import bench_rank, launch  # noqa: E402


def _mb(value: int) -> str:
    return f"{value / 2**20:8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--placements", nargs="+", default=["cpu/cpu", "nvme/nvme"], help="param/optimizer tiers")
    parser.add_argument("--nvme", default=tempfile.gettempdir())
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    rows = []
    for placement in args.placements:
        param, optimizer = placement.split("/")
        for world in args.worlds:
            threads = max(1, cores // world)
            config = {
                "precision": "fp32",
                "optimizer": {"lr": 1e-3, "threads": threads},
                "offload": {"param": param, "optimizer": optimizer, "nvme_path": args.nvme},
                "overlap": "forward",
            }
            results = launch(
                bench_rank,
                world,
                config,
                args.width,
                args.depth,
                args.batch,
                args.warmup,
                args.steps,
                timeout_s=120.0,
                deadline_s=600.0,
                threads=threads,
            )
            for rank, outcome in enumerate(results):
                if not outcome["ok"]:
                    raise SystemExit(f"{placement} world {world} rank {rank} failed: {outcome.get('traceback') or outcome}")
                value = outcome["value"]
                memory = value["memory"]
                rows.append(
                    {
                        "placement": placement,
                        "world": world,
                        "rank": rank,
                        "params": value["params"],
                        "step_ms": 1e3 * value["median_s"],
                        "device_peak": memory.get("device", {}).get("peak", 0),
                        "host": memory.get("host", {}).get("current", 0),
                        "nvme": memory.get("nvme", {}).get("current", 0),
                        "optimizer_state": memory.get("host", {})
                        .get("by_category", {})
                        .get("optimizer_state", {})
                        .get("current", 0),
                    }
                )

    print(
        f"model: TinyNet width {args.width} depth {args.depth}, {rows[0]['params'] / 1e6:.2f}M params, fp32, "
        f"{args.batch} rows per rank per step, {cores} cores split over the ranks; median of {args.steps} steps"
    )
    print(f"{'placement':<10} {'world':>5} {'rank':>4} {'step ms':>8} {'device peak MB':>15} {'host MB':>9} {'nvme MB':>9}")
    for row in rows:
        print(
            f"{row['placement']:<10} {row['world']:>5} {row['rank']:>4} {row['step_ms']:8.1f} {_mb(row['device_peak']):>15} "
            f"{_mb(row['host']):>9} {_mb(row['nvme']):>9}"
        )
    for placement in args.placements:
        one = [r for r in rows if r["placement"] == placement and r["world"] == 1]
        two = [r for r in rows if r["placement"] == placement and r["world"] == 2]
        if one and two:
            tier = "host" if placement.endswith("/cpu") else "nvme"
            print(
                f"{placement}: {tier} bytes per rank at 2 ranks / 1 rank = {two[0][tier] / one[0][tier]:.3f}; "
                f"step time 2 ranks / 1 rank = {max(r['step_ms'] for r in two) / one[0]['step_ms']:.2f}"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
