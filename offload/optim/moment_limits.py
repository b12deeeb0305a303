"""Finite moments a compact precision cannot hold, and what a load tells the user about them.

bf16 holds magnitudes up to 3.39e38 (fp32 reaches 3.40e38); int8's first moment up to 2^126
(8.5e37: the largest code of the largest block exponent), its second moment up to 3.19e38 (the
square of the largest root code below 2^64, whose own square overflows: docs/compact_state.md).
A finite value beyond that is stored as the largest value of its sign: it saturates, in the
step and in a load, instead of becoming infinity (bf16 stochastic rounding would round it up to
infinity with some probability, an int8 root rounded up to 2^64 squares to infinity, and an
element whose second moment is infinite never moves again). The saturation moves a value by
less than one bf16 step (0.4%), an int8 second moment by at most 6.5%, an int8 first moment by
up to 4x, in a state that AdamW's own arithmetic cannot produce (|m| above 2^126 needs
gradients whose squares overflow v). A load that saturates values says so, naming each
parameter, rather than refusing: the checkpoint stays usable in the narrower precision, and
fp32 moments keep the values exactly.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from offload.config.state_layout import StatePrecision

__all__ = ["largest_stored", "SaturationReport"]

# the largest finite bf16, 0x7F7F: (2 - 2^-7) * 2^127
_BF16_LARGEST = (2 - 2.0**-7) * 2.0**127
_INT8_FIRST_MOMENT_LARGEST = 2.0**126
_INT8_SECOND_MOMENT_LARGEST = (31 * 2.0**59) ** 2  # root code 239 of block exponent 191, squared


def largest_stored(precision: str, kind: str) -> float:
    """The largest magnitude a moment of `kind` ("exp_avg", "exp_avg_sq") keeps in `precision`
    ("fp32", "bf16", "int8"); math.inf where every finite fp32 value fits."""
    p = StatePrecision(precision)
    if kind not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"moment kind must be 'exp_avg' or 'exp_avg_sq', got {kind!r}")
    if p is StatePrecision.BF16:
        return _BF16_LARGEST
    if p is StatePrecision.INT8:
        return _INT8_FIRST_MOMENT_LARGEST if kind == "exp_avg" else _INT8_SECOND_MOMENT_LARGEST
    return math.inf


@dataclasses.dataclass
class SaturationReport:
    """The finite moment values of a load that `precision` stores saturated, per parameter and
    kind: (how many, the largest magnitude). `check` each parameter's values as they are read,
    then log `message()` once (None when nothing saturated)."""

    precision: str
    found: dict[tuple[str, str], tuple[int, float]] = dataclasses.field(default_factory=dict)

    def check(self, name: str, kind: str, values: torch.Tensor) -> None:
        """Notes the finite values of `values` (fp32, one parameter's `kind` moment or part of it)
        beyond what the precision keeps."""
        limit = largest_stored(self.precision, kind)
        if math.isinf(limit) or values.numel() == 0:
            return
        magnitude = values.abs()
        beyond = (magnitude > limit) & torch.isfinite(magnitude)
        count = int(beyond.sum())
        if count == 0:
            return
        largest = float(magnitude[beyond].max())
        before, top = self.found.get((name, kind), (0, 0.0))
        self.found[(name, kind)] = (before + count, max(top, largest))

    def message(self, what: str) -> str | None:
        """One line for the log, `what` the operation ("load_checkpoint ..."), or None."""
        if not self.found:
            return None
        total = sum(count for count, _ in self.found.values())
        listed = sorted(self.found.items(), key=lambda item: -item[1][1])
        shown = "; ".join(
            f"{name} {kind}: {count} value{'s' if count != 1 else ''} up to {largest:.4g}, kept as {largest_stored(self.precision, kind):.4g}"
            for (name, kind), (count, largest) in listed[:8]
        )
        more = f"; and {len(listed) - 8} more" if len(listed) > 8 else ""
        return (
            f"{what}: {total} finite Adam moment value{'s' if total != 1 else ''} beyond what {self.precision} moments hold "
            f"{'are' if total != 1 else 'is'} stored saturated, as the largest value of {'their' if total != 1 else 'its'} "
            f"sign ({shown}{more}). Such magnitudes mean a diverged or altered state; optimizer.state_precision 'fp32' "
            "keeps them exactly"
        )
