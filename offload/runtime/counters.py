"""The gradient window's counters as a checkpoint saves them, and their check (plain data, no torch).

`check_counters` is the first pass of a checkpoint load (offload.checkpoint.verify) for the part
`GradientWindow.training_state()` owns: every key offload writes and no other, the counts
integers in range, and consistent with one another."""

from __future__ import annotations

import math


def check_counters(state: dict, expected: set[str]) -> None:
    """Raises ValueError naming the key and what is wrong with the counters of `state` (a
    `training_state()` read back from a file); `expected`: the keys `training_state()` writes."""
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(
            f"{'lacks ' + ', '.join(missing) if missing else ''}{' and ' if missing and extra else ''}"
            f"{'has keys offload never writes: ' + ', '.join(extra) if extra else ''}"
        )
    for key in ("global_steps", "micro_steps", "skipped_steps", "stepped_at_micro"):
        value, least = state[key], -1 if key == "stepped_at_micro" else 0  # -1: never stepped
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{key} is {value!r:.60}, not a count (an integer, at least {least})")
    # each step, taken or skipped, ended a window of at least one micro-step
    if state["global_steps"] + state["skipped_steps"] > state["micro_steps"] or state["stepped_at_micro"] > state["micro_steps"]:
        raise ValueError(
            f"counters disagree: {state['global_steps']} steps and {state['skipped_steps']} skipped, the last at "
            f"micro-step {state['stepped_at_micro']}, in {state['micro_steps']} micro-steps"
        )
    norm = state["last_grad_norm"]
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int | float) or not 0 <= norm < math.inf):
        raise ValueError(f"last_grad_norm is {norm!r:.60}, not a finite non-negative number or null")
