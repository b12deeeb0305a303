"""AdamW's own single-step bound, which the int8 step keeps (docs/compact_state.md, "The
single-step bound").

From zero moments, after t steps with the same gradients g_k in both,
m_t = (1 - beta1) sum_k beta1^(t-k) g_k and v_t = (1 - beta2) sum_k beta2^(t-k) g_k^2, so by
Cauchy-Schwarz (splitting beta1^j = (beta1^j / beta2^(j/2)) beta2^(j/2)):

    |m_t| / sqrt(v_t) <= B_t = (1 - beta1) / sqrt(1 - beta2) * sqrt(sum_{j<t} (beta1^2 / beta2)^j)

for every gradient sequence; equality needs gradients growing as (beta2 / beta1)^k. With the
bias corrections the update |Δw| / lr = |m̂| / (sqrt(v̂) + eps) is then at most
B_t sqrt(1 - beta2^t) / (1 - beta1^t): 1 at the first step, 7.27 in the limit for the default
betas (0.9, 0.999). Rounded moments can break the inequality (a first moment rounded up while
its second is rounded down); the int8 step takes |m'| as at most B_t sqrt(v'), which changes
nothing for moments AdamW's arithmetic could have produced.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["first_moment_bound", "update_bound", "step_limit_factor"]

_FP32_LARGEST = float(np.finfo(np.float32).max)


def _sum_of_powers(ratio: float, count: int) -> float:
    """sum_{j<count} ratio^j, math.inf where it overflows."""
    if ratio == 1.0:
        return float(count)
    try:
        return (1.0 - ratio**count) / (1.0 - ratio)
    except OverflowError:
        return math.inf


def first_moment_bound(step: int, beta1: float, beta2: float) -> float:
    """B_t for t = `step` (the step count after the update): the largest |m_t| / sqrt(v_t) of
    AdamW's moments from zero, over every gradient sequence. As the fp32 value at or above it
    (the kernels multiply sqrt(v') by it in fp32); math.inf where there is none (beta2 = 0: v
    forgets all but the last gradient) or it exceeds fp32."""
    if step < 1:
        raise ValueError(f"first_moment_bound: step must be >= 1, got {step}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"first_moment_bound: betas must be in [0, 1), got ({beta1}, {beta2})")
    if beta2 == 0.0:
        return math.inf
    bound = (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(_sum_of_powers(beta1 * beta1 / beta2, int(step)))
    rounded = np.float32(bound)
    if float(rounded) < bound:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def update_bound(step: int, beta1: float, beta2: float, bias_correction: bool = True) -> float:
    """The largest |Δw| / lr of one AdamW step (weight decay aside): B_t with the bias
    corrections, sqrt(1 - beta2^t) / (1 - beta1^t)."""
    bound = first_moment_bound(step, beta1, beta2)
    if not bias_correction:
        return bound
    return bound * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def step_limit_factor(step: int, beta1: float, beta2: float) -> float:
    """The fp32 factor the int8 step multiplies sqrt(v') by to limit |m'|: B_t, or fp32's
    largest finite value where B_t is infinite (so that the limit is never 0 * inf = NaN: with
    v' = 0 it is 0, and the step, as with a finite B_t, does not move that element)."""
    return min(first_moment_bound(step, beta1, beta2), _FP32_LARGEST)
