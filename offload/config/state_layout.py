"""How many bytes each kind of a unit's optimizer state takes, per state precision (no torch).

A unit shard's optimizer state has four kinds: the fp32 `master`, the Adam moments `exp_avg`
and `exp_avg_sq`, and the gradient `grad32` (the name is historical: it holds the gradient in
its arrival dtype where that is exact, `gradient_bytes` 2, else fp32). The moments are stored
in the config's `optimizer.state_precision`:

- `fp32`: 4 bytes each (torch.optim.AdamW's own state, bit for bit);
- `bf16`: 2 bytes each, rounded stochastically;
- `int8`: 1 byte per element plus one shared power-of-two exponent byte per block of
  `INT8_BLOCK` elements (docs/compact_state.md has the format).

Everything that counts state bytes (the host budget, the slots, swap files, `auto`'s plan,
`offload estimate`, `memory_report`) asks a `StateBytes`, so the counts agree with what the
tiers allocate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload.config.schema import Config

INT8_BLOCK = 32  # elements sharing one exponent byte (a block never holds two parameters: units.PARAM_ALIGN_ELEMENTS)
# The gradient norm's canonical block (offload.optim.kernels.sq_norm; the C++ kNormBlock): a
# unit's squared norm is summed block by block in this order, so a streamed piece of optimizer
# state is always a whole number of these (plan.optimizer_plan.whole_blocks) and the norm in
# pieces is the norm of the whole unit, bit for bit. A multiple of INT8_BLOCK.
NORM_BLOCK = 1024
# The int8 code formats (docs/compact_state.md), as checkpoints record them: values a checkpoint
# holds re-encode to themselves only under the codes that produced them. Before 2026-11-26 the
# first moment was E4M3 (INT8_CODES_BEFORE, what an int8 checkpoint without the record used),
# until 2026-11-28 E3M4 with linear subnormal codes ("exp_avg E3M4, sqrt(exp_avg_sq) E4M4").
INT8_CODES = "exp_avg E3M4T, sqrt(exp_avg_sq) E4M4"
INT8_CODES_BEFORE = "exp_avg E4M3, sqrt(exp_avg_sq) E4M4"


class StatePrecision(str, enum.Enum):
    """How the Adam moments are stored (`optimizer.state_precision`)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
# every kind of a unit's optimizer state (model.unit_state.STATE_KINDS), and what a step writes
# anew (model.unit_state.STEPPED_KINDS): the gradient is only read
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq", "grad32")
STEPPED_KINDS = ("master", "exp_avg", "exp_avg_sq")


def int8_moment_bytes(numel: int) -> int:
    """Bytes of one int8 moment of `numel` elements: a code per element, then an exponent byte per block."""
    return numel + -(-numel // INT8_BLOCK)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per state kind for one precision of the moments and one gradient width."""

    precision: StatePrecision = StatePrecision.FP32
    # bytes per gradient element: 4 (fp32, accumulated), or 2 (kept in its 16-bit arrival dtype)
    gradient_bytes: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", StatePrecision(self.precision))
        if self.gradient_bytes not in (2, 4):
            raise ValueError(f"gradient_bytes must be 2 or 4, got {self.gradient_bytes}")

    def moment_bytes(self, numel: int) -> int:
        """Bytes of one Adam moment of `numel` elements (a piece of a unit's state)."""
        if self.precision is StatePrecision.FP32:
            return 4 * numel
        if self.precision is StatePrecision.BF16:
            return 2 * numel
        return int8_moment_bytes(numel)

    def kind_bytes(self, kind: str, numel: int) -> int:
        """Bytes of state kind `kind` ("master", "exp_avg", "exp_avg_sq", "grad32") for `numel` elements."""
        if kind == "master":
            return 4 * numel
        if kind in MOMENT_KINDS:
            return self.moment_bytes(numel)
        if kind == "grad32":
            return self.gradient_bytes * numel
        raise ValueError(f"unknown state kind {kind!r}")

    def stepped_bytes(self, numel: int) -> int:
        """Master and moments: what a step writes anew (a speculative step's spare state)."""
        return 4 * numel + 2 * self.moment_bytes(numel)

    def total_bytes(self, numel: int) -> int:
        """All four kinds of `numel` elements."""
        return self.stepped_bytes(numel) + self.gradient_bytes * numel

    @property
    def moment_per_element(self) -> float:
        """Bytes per element of one moment, for large states (the int8 exponents amortised)."""
        return {StatePrecision.FP32: 4.0, StatePrecision.BF16: 2.0, StatePrecision.INT8: 1.0 + 1.0 / INT8_BLOCK}[self.precision]

    @property
    def per_element(self) -> float:
        """Bytes per element of all four kinds, for large states (the int8 exponents amortised)."""
        return 4.0 + 2 * self.moment_per_element + self.gradient_bytes

    def describe(self) -> str:
        """In words, e.g. "int8 moments, fp32 master, 16-bit gradient: 8.06 bytes per param"."""
        gradient = "fp32 gradient" if self.gradient_bytes == 4 else "16-bit gradient"
        return f"{self.precision.value} moments, fp32 master, {gradient}: {self.per_element:.3g} bytes per param"


FP32_STATE = StateBytes()
"""Today's state: fp32 moments and an fp32 gradient, 16 bytes per element (every plan function's default)."""


def gradient_bytes_for(compute_bytes: int, accumulation_steps: int, gradient_precision: str) -> int:
    """Bytes per element of the stored gradient. It keeps its arrival dtype (the compute dtype,
    also after a reduce-scatter, which runs in it) when nothing is ever added into it: one
    micro-batch per step. `gradient_precision` "fp32" keeps it fp32 regardless."""
    if gradient_precision == "fp32" or compute_bytes == 4 or accumulation_steps != 1:
        return 4
    return 2


def state_bytes_for(config: Config, compute_bytes: int) -> StateBytes:
    """The StateBytes of a validated config whose compute dtype takes `compute_bytes` per element:
    its `optimizer.state_precision`, and the gradient width `gradient_bytes_for` gives for its
    `gradient_accumulation_steps` and `optimizer.gradient_precision`. What the tiers allocate,
    `auto` plans, and `offload estimate` counts."""
    return StateBytes(
        precision=StatePrecision(config.optimizer.state_precision),
        gradient_bytes=gradient_bytes_for(compute_bytes, config.gradient_accumulation_steps, config.optimizer.gradient_precision),
    )
