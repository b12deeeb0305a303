"""What each `optimizer.state_precision` takes, side by side, for `offload estimate`: bytes per
param, per tier and the optimizer state's disk traffic per step of one placement, as
`plan.estimate` counts them with each precision's `StateBytes` (plain functions, tested directly).
"""

from __future__ import annotations

from offload.config.state_layout import FP32_STATE, StateBytes, StatePrecision, gradient_bytes_for
from offload.errors import ConfigError
from offload.plan.estimate import COMPUTE_BYTES, estimate_report, state_settings
from offload.plan.machine import Machine
from offload.plan.model_shapes import ModelShape


def state_for(
    state_precision: str, *, precision: str, accumulation_steps: int = 1, gradient_precision: str = "auto"
) -> StateBytes:
    """The StateBytes of these config values (`state_layout.state_bytes_for` without a Config):
    moments in `state_precision`, the gradient as `gradient_bytes_for` keeps it."""
    if state_precision not in {p.value for p in StatePrecision}:
        raise ConfigError(
            f"state precision {state_precision!r} is not one of {', '.join(p.value for p in StatePrecision)}",
            key="optimizer.state_precision",
        )
    return StateBytes(
        StatePrecision(state_precision), gradient_bytes_for(COMPUTE_BYTES[precision], accumulation_steps, gradient_precision)
    )


def shown_placement(report: dict) -> tuple[tuple[str, str], str]:
    """The placement a report's per-precision comparison is shown for, and why: the recommended
    one, else (nothing fits) the fastest of those with the fewest problems."""
    if report["recommended"] is not None:
        return (report["recommended"]["param"], report["recommended"]["optimizer"]), "recommended"
    counted = [row for row in report["placements"] if row["device"]["total"] is not None]
    row = min(counted, key=lambda r: len(r["problems"]))  # min keeps the first (fastest) of equals
    return (row["param"], row["optimizer"]), "nothing fits: the fastest placement with the fewest problems"


def compare_state_precisions(shape: ModelShape, machine: Machine, report: dict, **settings) -> dict:
    """What each `optimizer.state_precision` takes for the placement `report` (an
    `estimate_report` of `shape` on `machine` with `settings`, its keyword arguments) is shown for
    (`shown_placement`): per precision, bytes per param, per tier, the optimizer state's disk
    traffic per step (`step_disk_bytes`) and the weights' (`weights_disk_traffic`: the same in
    every precision, but for the units overlap auto steps during backward, as many as that
    precision's leftover RAM gives spare states), whether it fits, and that precision's own
    recommendation. The gradient keeps the width `settings["state"]` gives it."""
    placement, why = shown_placement(report)
    base = settings.pop("state", FP32_STATE)
    rows = []
    for precision in StatePrecision:
        state = StateBytes(precision, base.gradient_bytes)
        other = report if state == base else estimate_report(shape, machine, state=state, **settings)
        row = next(r for r in other["placements"] if (r["param"], r["optimizer"]) == placement)
        recommended = other["recommended"]
        rows.append(
            {
                **state_settings(state),
                **{tier: row[tier]["total"] for tier in ("device", "host", "nvme")},
                "disk_per_step": row.get("disk_per_step"),
                "weights_disk_per_step": row.get("weights_disk_per_step"),
                "plan": row.get("plan"),
                "fits": row["fits"],
                "recommended": None if recommended is None else [recommended["param"], recommended["optimizer"]],
            }
        )
    return {"param": placement[0], "optimizer": placement[1], "why": why, "rows": rows}
