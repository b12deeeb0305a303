"""`offload estimate`: bytes per tier for a model under every placement, what fits, what to use,
and (unless `--state-precision` picks one) what each optimizer state precision takes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from offload.config.sizes import parse_size
from offload.config.state_layout import StatePrecision
from offload.errors import ConfigError
from offload.plan import estimate as est
from offload.plan.machine import DEVICE_KINDS, Machine, detect_machine
from offload.plan.model_shapes import ModelShape, shape_from_hf_config, shape_from_param_count
from offload.plan.optimizer_plan import device_room, engine_device_bytes
from offload.plan.precisions import compare_state_precisions, state_for
from offload.plan.step_split import StepWindow, parse_rates, plan_split, predicted_step, step_traffic
from offload.platform.descriptors import hard_limit_shortfall

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="a parameter count (7B, 7e9, 350M), a Hugging Face config.json, or a model directory holding one"
    )
    parser.add_argument(
        "--config",
        help="an offload, DeepSpeed JSON or accelerate YAML config: precision, prefetch depth, buffer count, sub-group "
        "size (offload.sub_group_size, DeepSpeed's zero_optimization.sub_group_size), overlap, gradient clipping, the "
        "caps of optimizer auto (offload.max_device_memory, offload.max_host_memory) and of the RAM left over "
        "(offload.gradient_memory, offload.speculation_memory) are read from it",
    )
    parser.add_argument(
        "--precision", choices=sorted(est.COMPUTE_BYTES), help="compute precision (default: the config's, else bf16)"
    )
    parser.add_argument(
        "--state-precision",
        choices=[p.value for p in StatePrecision],
        help="how the Adam moments are stored (optimizer.state_precision; default: the config's, else fp32); "
        "without it, a table shows what each precision takes for the recommended placement",
    )
    parser.add_argument("--world-size", type=int, default=1, help="ranks the model is sharded over (default 1)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="machines the ranks are spread over (default 1: they share this machine's RAM and disk)",
    )
    parser.add_argument(
        "--gpu-memory",
        help="memory of one GPU, e.g. 24GB or 80GiB, read in binary units as GPU makers mean "
        "them (24GB = 24 GiB) (default: detected with torch; none without a GPU)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_KINDS,
        help="what the engine will run on: cuda (its copies are "
        "staged through host buffers, counted in host) or cpu (default: cuda when a GPU is detected or "
        "--gpu-memory is given, else cpu)",
    )
    parser.add_argument("--ram", help="RAM available, e.g. 128GB, read in binary units (default: psutil's available memory)")
    parser.add_argument(
        "--disk", help="free disk at --nvme-path, e.g. 2TB, read in decimal units as disk makers mean them (default: detected)"
    )
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: the config's, else ./offload-swap)")
    parser.add_argument("--layers", type=int, help="with a parameter count: the number of blocks (default: a llama-like guess)")
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="with a parameter count: the vocabulary size (default 32000)"
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="micro-batch size for the rough activation figure (default 1)")
    parser.add_argument(
        "--seq-len", type=int, default=2048, help="sequence length for the rough activation figure (default 2048)"
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing is on (smaller activation figure)")
    parser.add_argument(
        "--no-strict",
        action="store_true",
        help="with a DeepSpeed or accelerate --config: drop the keys "
        "offload cannot honour with a warning instead of refusing the config",
    )
    parser.add_argument(
        "--step-rates",
        default=os.environ.get("OFFLOAD_STEP_RATES"),
        help="the rates overlap auto's split of the step between the CPU and the GPU is chosen from, as the engine "
        "measures them at start: cpu=,device=,h2d=,d2h= (CPU Adam and the GPU's exact step in Gparams/s, PCIe GB/s each "
        "way; default: OFFLOAD_STEP_RATES); with them the schedule line says which units the GPU would step",
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        help="the GPU's achieved TFLOPS on this model: with --step-rates, the schedule line predicts the step "
        "(6 flops per parameter per token of micro-batch x sequence, two thirds of them in backward)",
    )
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")


def _shape(args) -> ModelShape:
    text = args.model
    if Path(text).exists():
        return shape_from_hf_config(text)
    try:
        count = est.parse_count(text)
    except ConfigError:
        raise ConfigError(
            f"{text!r} is neither a parameter count (7B, 7e9) nor an existing config.json or model directory"
        ) from None
    return shape_from_param_count(count, layers=args.layers, vocab_size=args.vocab_size)


def missing_swap_note(nvme_path: str, *, given: bool) -> str | None:
    """Nothing when the swap directory exists; a note when the default one does not (its disk is
    measured at the nearest parent); a ConfigError when a path the user gave does not exist
    (its nearest parent may be another file system: its free space would be a wrong answer)."""
    if Path(nvme_path).is_dir():
        return None
    if Path(nvme_path).exists():
        raise ConfigError(f"--nvme-path {nvme_path} is not a directory; give the swap directory")
    if given:
        raise ConfigError(
            f"--nvme-path {nvme_path} does not exist, so the free space of its disk cannot be measured; "
            f"create it (mkdir -p {nvme_path}) on the disk for swap, or give that disk's free space with --disk"
        )
    return f"{nvme_path} does not exist yet: disk free space measured at its nearest existing parent (--nvme-path, --disk)"


def build_report(args) -> dict:
    from offload.config.schema import Config, load_config

    config = load_config(args.config, strict=not args.no_strict) if args.config else Config()
    precision = args.precision or config.precision
    nvme_path = args.nvme_path or config.offload.nvme_path
    if isinstance(nvme_path, list):
        nvme_path = nvme_path[0]
    if args.world_size < 1 or args.nodes < 1:
        raise ConfigError("--world-size and --nodes must be >= 1")
    ranks_per_node = -(-args.world_size // args.nodes)
    notes = []
    if args.disk is None:
        note = missing_swap_note(nvme_path, given=args.nvme_path is not None or nvme_path != Config().offload.nvme_path)
        if note:
            notes.append(note)
    machine = detect_machine(nvme_path, ranks_per_node)

    def size(option: str, text: str, *, binary: bool) -> int:
        nbytes = est.parse_bytes(text, binary=binary)
        note = est.size_note(option, text, nbytes, binary=binary)
        if note:
            notes.append(note)
        return nbytes

    gpu_bytes, device = machine.gpu_bytes, machine.device
    if args.gpu_memory is not None:
        gpu_bytes = None if args.gpu_memory.lower() == "none" else size("--gpu-memory", args.gpu_memory, binary=True)
        device = "cuda" if gpu_bytes is not None else "cpu"
    if args.device is not None:
        device = args.device
    if device == "cuda" and gpu_bytes is None:
        raise ConfigError("--device cuda needs the GPU's memory: no GPU was detected here, so give --gpu-memory (e.g. 24GB)")
    ram = size("--ram", args.ram, binary=True) if args.ram is not None else machine.ram_bytes
    disk = size("--disk", args.disk, binary=False) if args.disk is not None else machine.disk_bytes
    machine = Machine(gpu_bytes, ram, disk, ranks_per_node, nvme_path, device)
    settings: dict[str, Any] = dict(
        precision=precision,
        world_size=args.world_size,
        prefetch_depth=config.prefetch.depth,
        buffer_count=config.offload.buffer_count,
        sub_group_size=config.offload.sub_group_size,
        max_device_memory=parse_size(config.offload.max_device_memory),
        max_host_memory=parse_size(config.offload.max_host_memory),
        overlap=config.overlap,
        gradient_clipping=config.gradient_clipping,
        speculation_memory=parse_size(config.offload.speculation_memory),
        gradient_memory=parse_size(config.offload.gradient_memory),
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        checkpointing=args.checkpointing,
        accumulation_steps=config.gradient_accumulation_steps,
        # the moments as asked, the gradient as the engine keeps it (state_layout.state_bytes_for)
        state=state_for(
            args.state_precision or config.optimizer.state_precision,
            precision=precision,
            accumulation_steps=config.gradient_accumulation_steps,
            gradient_precision=config.optimizer.gradient_precision,
        ),
    )
    shape = _shape(args)
    report = est.estimate_report(shape, machine, **settings)
    if report["recommended"] is None and not args.checkpointing:
        report["with_checkpointing"] = _checkpointing_fit(
            est.estimate_report(shape, machine, **dict(settings, checkpointing=True))
        )
    if args.state_precision is None:
        report["state_precisions"] = compare_state_precisions(shape, machine, report, **settings)
    report["machine"]["size_notes"] = notes
    report["schedule"] = schedule_report(shape, machine, report, args, **settings)
    return report


def schedule_report(shape: ModelShape, machine: Machine, report: dict, args, **settings) -> dict:
    """Which schedule the engine runs for the recommended placement, and with overlap auto which
    units the GPU would step (plan.step_split, from --step-rates and the GPU's memory) and the
    predicted step (with --device-tflops)."""
    overlap = settings["overlap"]
    schedule: dict[str, Any] = {"overlap": overlap, "split": None, "predicted_step_s": None, "compute_s": None}
    recommended = report["recommended"]
    if overlap != "auto" or recommended is None:
        return schedule
    row = next(
        r for r in report["placements"] if (r["param"], r["optimizer"]) == (recommended["param"], recommended["optimizer"])
    )
    schedule["speculating_units"] = (row.get("leftover_ram") or {}).get("speculating_units", 0)
    if not args.step_rates or machine.device != "cuda" or machine.gpu_bytes is None or row["param"] == "nvme":
        return schedule
    rates, backward = parse_rates(args.step_rates)
    state, world = settings["state"], settings["world_size"]
    if args.device_tflops:
        tokens = args.micro_batch * args.seq_len
        backward = 4 * shape.num_params * tokens / (args.device_tflops * 1e12)
    numels = shape.shard_numels(world)
    if row["optimizer"] == "auto":
        tiers, _ = est.plan_auto(
            shape,
            row["param"],
            machine,
            precision=settings["precision"],
            world_size=world,
            prefetch_depth=settings["prefetch_depth"],
            buffer_count=settings["buffer_count"],
            max_device_memory=settings["max_device_memory"],
            max_host_memory=settings["max_host_memory"],
        )
        eligible = [tier == "cpu" for tier in tiers or []] or [False] * len(numels)  # None: nothing fits
    else:
        eligible = [row["optimizer"] == "cpu"] * len(numels)
    compute_bytes = est.COMPUTE_BYTES[settings["precision"]]
    traffic = step_traffic(
        moment_bytes=state.moment_per_element,
        grad_bytes=state.gradient_bytes,
        compute_bytes=compute_bytes,
        param_offloaded=row["param"] != "none",
    )
    engine = engine_device_bytes(
        shape.padded_numels(world),
        params_offloaded=row["param"] != "none",
        compute_bytes=compute_bytes,
        prefetch_depth=settings["prefetch_depth"],
    )
    room = device_room(cap=settings["max_device_memory"], memory=(machine.gpu_bytes, machine.gpu_bytes), engine_bytes=engine)
    room -= row["device"]["by_category"].get("optimizer_state", 0)
    split = plan_split(numels, eligible, rates, traffic, device_memory=max(0, room), backward_seconds=backward)
    schedule["split"] = {
        "device_units": split.device_units,
        "units": len(numels),
        "device_bytes": split.device_bytes,
        "cpu_s": split.cpu_seconds,
        "device_s": split.device_seconds,
        "reasons": list(split.reasons),
    }
    if backward is not None:
        schedule["compute_s"] = 1.5 * backward
        schedule["predicted_step_s"] = predicted_step(numels, split.on_device, rates, traffic, backward)
        # a window that does not speculate (clipping acted: speculation paused) has a split of its own
        window = StepWindow.AFTER_BACKWARD
        paused = plan_split(
            numels, eligible, rates, traffic, device_memory=max(0, room), backward_seconds=backward, window=window
        )
        schedule["paused"] = {
            "device_units": paused.device_units,
            "predicted_step_s": predicted_step(numels, paused.on_device, rates, traffic, backward, window),
        }
    return schedule


def schedule_lines(schedule: dict | None) -> list[str]:
    """The schedule part of the report in words."""
    if not schedule:
        return []
    if schedule["overlap"] != "auto":
        return [f"schedule: overlap {schedule['overlap']} (the config's)"]
    lines = [
        f"schedule: overlap auto, the best exact one: units step during backward as their gradients are final "
        f"({schedule.get('speculating_units', 0)} with spare states in RAM; on the GPU, none needed) and the rest during "
        "the next forward, in its order"
    ]
    split = schedule["split"]
    if split is None:
        lines.append(
            "  its split between the CPU and the GPU is chosen at start from the rates the engine measures there "
            "(--step-rates predicts it here)"
        )
        return lines
    lines.append(
        f"  split: {split['device_units']} of {split['units']} units step on the GPU (a copy of their state there, "
        f"{est.format_bytes(split['device_bytes'])}), the rest with the CPU Adam; optimizer work per step: CPU "
        f"{split['cpu_s']:.3g} s, GPU {split['device_s']:.3g} s"
    )
    if schedule["predicted_step_s"] is not None:
        lines.append(
            f"  predicted step {schedule['predicted_step_s']:.3g} s, against {schedule['compute_s']:.3g} s of compute "
            f"({schedule['predicted_step_s'] / schedule['compute_s']:.2f}x)"
        )
    paused = schedule.get("paused")
    if paused is not None:
        lines.append(
            f"  while clipping acts (speculation paused, every unit steps after the backward): {paused['device_units']} "
            f"units on the GPU, predicted step {paused['predicted_step_s']:.3g} s "
            f"({paused['predicted_step_s'] / schedule['compute_s']:.2f}x)"
        )
    return lines


def _checkpointing_fit(report: dict) -> dict | None:
    """What fits once activation checkpointing shrinks the activations (`report`: the estimate
    with checkpointing on), for a machine where nothing fits without it; None if nothing does."""
    recommended = report["recommended"]
    if recommended is None:
        return None
    return {
        "param": recommended["param"],
        "optimizer": recommended["optimizer"],
        "activations_bytes": report["activations_bytes"],
    }


def _nothing_fits_line(report: dict) -> str:
    fit = report.get("with_checkpointing")
    if fit is None:
        return "recommended: nothing fits; add GPUs (--world-size), RAM or disk, or use a smaller model"
    f = est.format_bytes
    return (
        f"recommended: nothing fits with these activations ({f(report['activations_bytes'])} per GPU); with activation "
        f"checkpointing (model.gradient_checkpointing_enable() in transformers) param {fit['param']} / optimizer "
        f"{fit['optimizer']} fits, its activations about {f(fit['activations_bytes'])}: run again with --checkpointing "
        f"for its config, or lower --micro-batch / --seq-len"
    )


def format_report(report: dict) -> str:
    f = est.format_bytes
    model, settings, machine = report["model"], report["settings"], report["machine"]
    gpu = f(machine["gpu_bytes"]) if machine["gpu_bytes"] else "none (the CPU stands in)"
    lines = [
        (
            f"model: {model['name']}: {model['params'] / 1e9:.2f}B params in {model['units']} units "
            f"(largest {model['largest_unit_params'] / 1e6:.1f}M, root {model['root_unit_params'] / 1e6:.1f}M)"
        ),
        (
            f"settings: {settings['precision']} on {settings['device']}, world size {settings['world_size']} "
            f"({settings['ranks_per_node']} per node), prefetch depth {settings['prefetch_depth']}, "
            f"optimizer on NVMe through {settings['nvme_slots']['count']} slots of "
            f"{settings['nvme_slots']['piece']:,} elements (buffer count {settings['buffer_count'] or 'auto'}, "
            f"sub-group size {settings['sub_group_size'] or 'auto'})"
        ),
        (
            f"optimizer state: {_state_words(settings['state'])} (optimizer.state_precision, optimizer.gradient_precision; "
            f"gradient accumulation {settings['gradient_accumulation_steps']})"
        ),
        (
            f"machine: GPU {gpu}, RAM {f(machine['ram_bytes'])} available, disk {f(machine['disk_bytes'])} free at "
            f"{machine['nvme_path']}"
        ),
        *machine.get("size_notes", []),
        "",
        "bytes per rank (host and nvme are shared by the ranks of a node):",
        f"{'param / optimizer':<18} {'device':>10} {'host':>10} {'nvme':>10}  fits",
    ]
    for row in report["placements"]:
        verdict = "yes" if row["fits"] else "no: " + "; ".join(row["problems"])
        lines.append(
            f"{row['param'] + ' / ' + row['optimizer']:<18} {f(row['device']['total']):>10} {f(row['host']['total']):>10} "
            f"{f(row['nvme']['total']):>10}  {verdict}"
        )
        if row.get("plan"):
            lines.append(f"{'':<18} optimizer state split: {row['plan']}")
        lines.extend(f"{'':<18} {line}" for line in leftover_lines(row.get("leftover_ram"), settings["state"]))
        disk = row.get("disk_per_step")
        if disk and disk["read"] + disk["written"]:
            lines.append(
                f"{'':<18} disk traffic of the optimizer state per step: {f(disk['read'])} read + {f(disk['written'])} written"
            )
        weights = row.get("weights_disk_per_step")
        if weights and weights["read"] + weights["written"]:
            lines.append(
                f"{'':<18} disk traffic of the 16-bit weights per step: up to {f(weights['read'])} read + "
                f"{f(weights['written'])} written (each unit's fetches and its step's write-back)"
            )
        files = row.get("swap_files", 0)
        if files:
            shortfall = hard_limit_shortfall(files)
            lines.append(f"{'':<18} swap files: {files:,}, each held open for the run" + (f"; {shortfall}" if shortfall else ""))
    activations = report["activations_bytes"]
    lines.append("")
    lines.append(
        f"activations (micro-batch {settings['micro_batch']} x {settings['seq_len']} tokens"
        f"{', checkpointing' if settings['checkpointing'] else ''}): about {f(activations)} per GPU "
        f"({report['activations_note']})"
    )
    if report.get("state_precisions"):
        lines.append("")
        lines.extend(precision_lines(report["state_precisions"], settings["state"]["state_precision"]))
    saved = report["checkpoint"]
    lines.append(
        f"checkpoint: {f(saved['bytes'])} on disk (fp32 master and moments); a load checks it whole before applying it: "
        f"{f(saved['load_extra_ram_per_rank'])} more RAM per rank, no more disk, {f(saved['load_bytes_read'])} read; "
        f"a save with overwrite=True needs room for both ({f(saved['overwrite_extra_disk'])} more) until it completes"
    )
    recommended = report["recommended"]
    if recommended is None:
        lines.append(_nothing_fits_line(report))
    else:
        lines.append(f"recommended: param {recommended['param']}, optimizer {recommended['optimizer']}; config:")
        lines.append(json.dumps(recommended["config"], indent=2))
        lines.extend(schedule_lines(report.get("schedule")))
    return "\n".join(lines)


def _state_words(state: dict) -> str:
    gradient = "fp32" if state["gradient_bytes"] == 4 else "16-bit"
    return f"{state['state_precision']} moments, fp32 master, {gradient} gradient: {state['bytes_per_param']:g} bytes per param"


def precision_lines(table: dict, chosen: str) -> list[str]:
    """The per-precision comparison (plan.precisions.compare_state_precisions) as a table."""
    f = est.format_bytes
    lines = [
        f"what each optimizer.state_precision takes for {table['param']} / {table['optimizer']} ({table['why']}; "
        "choose one with --state-precision or the config):",
        f"{'precision':<12} {'B/param':>7} {'device':>10} {'host':>10} {'nvme':>10} {'disk per step (read + written)':>32}  "
        "fits  recommended",
    ]
    weights = None
    for row in table["rows"]:
        name = row["state_precision"] + (" *" if row["state_precision"] == chosen else "")
        disk = row["disk_per_step"]
        # the weights' traffic: the placement's, and with overlap auto the units that step during
        # backward (as many as the RAM left over gives spare states, in each precision) read twice
        weights = row.get("weights_disk_per_step")
        if disk is not None and weights:
            disk = {way: disk[way] + weights[way] for way in ("read", "written")}
        traffic = "-" if disk is None else f"{f(disk['read'])} + {f(disk['written'])}"
        recommended = "nothing fits" if row["recommended"] is None else " / ".join(row["recommended"])
        lines.append(
            f"{name:<12} {row['bytes_per_param']:>7.3g} {f(row['device']):>10} {f(row['host']):>10} {f(row['nvme']):>10} "
            f"{traffic:>32}  {'yes' if row['fits'] else 'no':<4}  {recommended}"
        )
        if row["plan"]:
            lines.append(f"{'':<12} optimizer state split: {row['plan']}")
    lines.append(
        "(* the precision the placement rows above count; every precision keeps fp32 master weights and fp32 checkpoints)"
    )
    if weights and weights["read"] + weights["written"]:
        lines.append("(disk per step: the optimizer state's, and the 16-bit weights' on nvme)")
    return lines


def leftover_lines(leftover: dict | None, state: dict | None = None) -> list[str]:
    """What the engine takes beside a placement's row from the RAM left over, in words; `state`:
    the report's settings["state"] (the gradient's width)."""
    if not leftover:
        return []
    f = est.format_bytes
    lines = []
    if leftover["spare_state"]:
        lines.append(
            f"+ {f(leftover['spare_state'])} of the RAM left over: spare states for {leftover['speculating_units']} of "
            f"{leftover['resident_units']} units in RAM to step during backward (offload.speculation_memory caps it)"
        )
    if leftover["gradient"]:
        freed = (
            f" (less the {f(leftover['grad_slot_freed'])} gradient slot then not needed)" if leftover["grad_slot_freed"] else ""
        )
        width = "fp32" if state is None or state["gradient_bytes"] == 4 else "16-bit"
        lines.append(
            f"+ {f(leftover['gradient'])} of the RAM left over{freed}: {width} gradients of {leftover['gradient_units']} of "
            f"{leftover['streamed_units']} NVMe units; {f(leftover['nvme_saved'])} less on nvme, and those units' steps "
            "move only the master and moments over the disk (offload.gradient_memory caps it)"
        )
    return lines


def run(args) -> int:
    try:
        report = build_report(args)
    except ConfigError as error:
        print(f"offload estimate: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
