"""The documentation's pictures, drawn by matplotlib from the engine's own arithmetic and from a
recorded step, never by hand (docs/generate.py calls `draw_all`; tests/test_docs.py draws them
again and compares the bytes with the committed files).

- `units.svg`: a 13B Llama cut into units (the root unit, then one per block), each as wide as
  its parameter count, coloured by the tier `offload.optimizer: auto` gives its optimizer state
  on one 80 GB GPU with 128 GiB of RAM (`offload.plan.estimate.plan_auto`, the engine's planner).
- `tiers.svg`: what each tier holds for a 7B model under each fixed placement, per rank
  (`offload.plan.estimate.estimate_tiers`, the figures `offload estimate` prints).
- `step-timeline.svg`: the 1.35B Llama step of `benchmarks/bench_pipeline.py` on an H100 machine
  (`--machine h100-pcie5`), replayed from the engine's recorded schedule: one lane per resource,
  for param none / optimizer cpu and param cpu / optimizer nvme. The replay's ops are kept in
  docs/assets/data/ (`timeline_data` makes that file from a `--trace` file).

The SVGs are reproducible: text stays text (no glyph outlines, so no font files are read), the
ids are salted with a fixed string and the date is left out; with the matplotlib the `docs`
extra pins, the same inputs give the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ASSETS = DOCS / "assets"
TIMELINE_DATA = ASSETS / "data" / "step-timeline-1.3b-h100.json"

# one colour per tier and per resource, the same on every picture
TIER_COLOURS = {"device": "#4c72b0", "cpu": "#55a868", "host": "#55a868", "nvme": "#c44e52"}
RESOURCE_COLOURS = {
    "compute": "#4c72b0",
    "host_to_device": "#8172b2",
    "device_to_host": "#937860",
    "optimizer": "#64b5cd",
    "cpu_adam": "#55a868",
    "nvme_read": "#c44e52",
    "nvme_write": "#dd8452",
    "host": "#8c8c8c",
}
GIB = 1 << 30


def _pyplot():
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "offload-docs", "font.size": 9})
    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")


# ---- units ---------------------------------------------------------------------------------
def units_data() -> dict:
    """A 13B Llama's units (parameters each) and the tier `auto` plans for each on one 80 GB GPU
    with 128 GiB of RAM and a 2 TB disk, at bf16 with the estimate's default activations."""
    from offload.plan import estimate as est
    from offload.plan.machine import Machine
    from offload.plan.model_shapes import shape_from_param_count

    shape = shape_from_param_count(13_000_000_000)
    machine = Machine(gpu_bytes=80 * GIB, ram_bytes=128 * GIB, disk_bytes=2 * 10**12)
    activations = est.activation_bytes(shape, micro_batch=1, seq_len=2048, precision="bf16", checkpointing=False)
    tiers, plan = est.plan_auto(
        shape, "none", machine, precision="bf16", world_size=1, prefetch_depth=2, buffer_count=None, activations=activations
    )
    assert tiers is not None, plan
    return {"params": [sum(unit) for unit in shape.unit_tensors()], "tiers": tiers, "plan": plan}


def draw_units(path: Path) -> None:
    plt = _pyplot()
    data = units_data()
    fig, ax = plt.subplots(figsize=(9, 1.9))
    left = 0.0
    for params, tier in zip(data["params"], data["tiers"]):
        ax.barh(0, params / 1e9, left=left, height=0.6, color=TIER_COLOURS[tier], edgecolor="white", linewidth=0.8)
        left += params / 1e9
    for tier, label in (("device", "on the GPU"), ("cpu", "in host RAM"), ("nvme", "on NVMe")):
        ax.barh(0, 0, color=TIER_COLOURS[tier], label=f"optimizer state {label}")
    ax.set_yticks([])
    ax.set_xlim(0, left)
    ax.set_xlabel("parameters (billions), unit by unit: the root unit (embeddings, norm, head), then each block")
    ax.set_title(f"A 13B Llama in {len(data['params'])} units, optimizer 'auto' on one 80 GB GPU, 128 GiB RAM", loc="left")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=3, frameon=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _save(fig, path)
    plt.close(fig)


# ---- tiers ---------------------------------------------------------------------------------
def tiers_data() -> list[tuple[str, dict[str, int]]]:
    """Per fixed placement (`param/optimizer`), a 7B model's bytes per tier at bf16 on CUDA."""
    from offload.plan import estimate as est
    from offload.plan.model_shapes import shape_from_param_count

    shape = shape_from_param_count(7_000_000_000)
    rows = []
    for param, optimizer in est.FIXED_PLACEMENTS:
        estimate = est.estimate_tiers(shape, param, optimizer, precision="bf16", device="cuda")
        rows.append((f"{param}/{optimizer}", {tier: estimate.total(tier) for tier in ("device", "host", "nvme")}))
    return rows


def draw_tiers(path: Path) -> None:
    plt = _pyplot()
    rows = tiers_data()
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.6), sharey=True)
    names = [name for name, _ in rows]
    for ax, (tier, title) in zip(axes, (("device", "GPU"), ("host", "host RAM"), ("nvme", "NVMe"))):
        values = [totals[tier] / GIB for _, totals in rows]
        ax.barh(names, values, color=TIER_COLOURS[tier])
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:.0f}", va="center", fontsize=8)
        ax.set_title(f"{title}, GiB", loc="left")
        ax.set_xlim(0, max(values) * 1.25 or 1)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].invert_yaxis()
    axes[0].set_ylabel("offload.param / offload.optimizer")
    fig.suptitle("A 7B model at bf16: what each tier holds, per placement (offload estimate)", x=0.01, ha="left")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


# ---- the step's timeline -------------------------------------------------------------------
def timeline_data(trace_paths: dict[str, Path]) -> dict:
    """The ops of each placement's replayed step (`bench_pipeline.py --trace` files, keyed by
    placement): per op its resource, start and duration in ms (to 0.01 ms) and its kind."""
    placements = {}
    for placement, path in trace_paths.items():
        events = json.loads(Path(path).read_text())["traceEvents"]
        ops = [
            [event["cat"], round(event["ts"] / 1e3, 2), round(event["dur"] / 1e3, 2), event["name"].split(" ")[0]]
            for event in events
            if event.get("ph") == "X"
        ]
        placements[placement] = sorted(ops, key=lambda op: (op[1], op[0]))
    return {
        "made_by": "python benchmarks/bench_pipeline.py --sizes 1.3b --placements none/cpu,cpu/nvme --machine h100-pcie5 --trace T.json",
        "placements": placements,
    }


def one_period(ops: list[list]) -> list[list]:
    """The ops of one steady-state step: from the start of the third recorded step's first
    compute op to the fourth's (the period `bench_pipeline` reports), shifted to start at 0 and
    cut at both ends; touching ops of one resource and kind are drawn as one bar."""
    starts = [start for resource, start, _, kind in ops if resource == "compute" and kind == "forward_embed"]
    begin, end = starts[2], starts[3]
    bars: list[list] = []
    last: dict[tuple[str, str], list] = {}
    for resource, start, duration, kind in ops:
        lo, hi = max(start, begin), min(start + duration, end)
        if hi <= lo:
            continue
        kind = "backward" if kind.startswith("backward") else kind
        previous = last.get((resource, kind))
        if previous is not None and lo - (previous[1] + previous[2]) <= 0.5:
            previous[2] = round(hi - begin - previous[1], 2)
            continue
        bar = [resource, round(lo - begin, 2), round(hi - lo, 2), kind]
        bars.append(bar)
        last[(resource, kind)] = bar
    return bars


def draw_timeline(path: Path, data_path: Path = TIMELINE_DATA) -> None:
    plt = _pyplot()
    data = {placement: one_period(ops) for placement, ops in json.loads(data_path.read_text())["placements"].items()}
    lanes = list(RESOURCE_COLOURS)
    fig, axes = plt.subplots(len(data), 1, figsize=(9, 1.2 + 1.3 * len(data)))
    for ax, (placement, ops) in zip(axes, data.items()):
        used = [lane for lane in lanes if any(op[0] == lane for op in ops)]
        for resource, start, duration, kind in ops:
            colour = RESOURCE_COLOURS[resource]
            if resource == "compute" and kind == "backward":
                colour = "#2a4d7a"
            ax.broken_barh([(start, duration)], (used.index(resource) - 0.4, 0.8), facecolors=colour, linewidth=0)
        ax.set_yticks(range(len(used)), [lane.replace("_", " ") for lane in used])
        ax.invert_yaxis()
        ax.set_xlim(0, max(start + duration for _, start, duration, _ in ops))
        ax.set_title(f"param / optimizer = {placement}", loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("ms at H100 rates: 270 TFLOPS, PCIe 48 GB/s, CPU Adam 5 and GPU exact Adam 6 Gparam/s, NVMe 6 / 5 GB/s")
    fig.suptitle(
        "1.35B Llama, 8 x 1024 tokens, overlap auto: one step, replayed (compute: forward light, backward dark)",
        x=0.01,
        ha="left",
    )
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


PICTURES = {"units.svg": draw_units, "tiers.svg": draw_tiers, "step-timeline.svg": draw_timeline}


def draw_all(out_dir: Path = ASSETS) -> list[Path]:
    """Draws every picture into `out_dir`; the paths written."""
    paths = []
    for name, draw in PICTURES.items():
        draw(out_dir / name)
        paths.append(out_dir / name)
    return paths
