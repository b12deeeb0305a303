"""A training progress bar (tqdm) with loss, tokens/s, step time and bytes per tier, and a
per-step time breakdown (forward, backward, step, I/O wait) as a dict and in the log.

    progress = TrainingProgress(engine, total=steps)
    for batch in batches:
        out = engine(**batch); engine.backward(out.loss); engine.step()
        progress.update(loss=out.loss.item(), tokens=batch["input_ids"].numel())
    progress.close()
    progress.last  # the last step's breakdown

Times come from `engine.pop_timings()` (seconds since the previous call): `forward` and
`backward` include the waits inside them, `wait_fetch` is time the forward/backward waited for
weights to arrive from host or NVMe (the I/O wait), `wait_step` time waited for the overlapped
CPU optimizer step. `other` is the rest of the wall time between two updates (data loading, the
caller's own work). Bytes come from `engine.memory_report()` (current and peak, per tier),
shown on the bar as `dev=... host=... nvme=...`.

While the bar is open, console logging goes through `tqdm.write` (tqdm's logging redirect), so
log lines print above the bar instead of onto it.
"""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "nvme")
TIER_LABELS = {"device": "dev", "host": "host", "nvme": "nvme"}


def _short(nbytes: int) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f}{unit}"
    return f"{nbytes}B"


def memory_postfix(breakdown: dict) -> dict[str, str]:
    """The bytes per tier as the bar shows them, `dev=0B, host=28.1M, nvme=47.4M` (plain function: tested directly)."""
    return {TIER_LABELS[tier]: _short(breakdown[f"{tier}_bytes"]) for tier in TIERS}


def step_breakdown(timings: dict[str, float], memory: dict, wall: float, *, loss: float | None, tokens: int) -> dict:
    """One step's numbers as a flat dict (plain function: tested directly)."""
    accounted = timings.get("forward", 0.0) + timings.get("backward", 0.0) + timings.get("step", 0.0)
    breakdown = {
        "loss": loss,
        "step_time": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "forward": timings.get("forward", 0.0),
        "backward": timings.get("backward", 0.0),
        "step": timings.get("step", 0.0),
        "io_wait": timings.get("wait_fetch", 0.0),
        "wait_step": timings.get("wait_step", 0.0),
        "other": max(0.0, wall - accounted),
    }
    for tier in TIERS:
        breakdown[f"{tier}_bytes"] = memory[tier]["current"]
        breakdown[f"{tier}_peak_bytes"] = memory[tier]["peak"]
    return breakdown


class TrainingProgress:
    """tqdm bar + per-step breakdown over an offload Engine (see the module docstring).

    log_every: log the breakdown at INFO every this many updates (0: never). disable: no bar
    (the breakdown is still computed and logged)."""

    def __init__(
        self,
        engine,
        total: int | None = None,
        *,
        desc: str = "train",
        log_every: int = 1,
        disable: bool = False,
        clock=time.perf_counter,
    ) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.engine = engine
        self.log_every = log_every
        self.clock = clock
        self.steps = 0
        self.last: dict | None = None
        self.history: list[dict] = []
        self._bar = tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True)
        # console log lines (this module's breakdown, the engine's warnings) above the bar, not onto it
        self._redirect = contextlib.ExitStack()
        if not disable:
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=type(self._bar)))
        engine.pop_timings()  # start from a clean slate
        self._since = clock()

    def update(self, *, loss: float | None = None, tokens: int = 0) -> dict:
        """Call once per training step (after `engine.step()`); returns the step's breakdown."""
        now = self.clock()
        wall, self._since = now - self._since, now
        breakdown = step_breakdown(self.engine.pop_timings(), self.engine.memory_report(), wall, loss=loss, tokens=tokens)
        self.steps += 1
        breakdown["index"] = self.steps
        self.last = breakdown
        self.history.append(breakdown)
        postfix = {}
        if loss is not None:
            postfix["loss"] = f"{loss:.4f}"
        postfix["tok/s"] = f"{breakdown['tokens_per_s']:.0f}"
        postfix["step"] = f"{wall:.3f}s"
        postfix.update(memory_postfix(breakdown))
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)
        if self.log_every and self.steps % self.log_every == 0:
            logger.info(
                "step %d: loss %s, %.0f tokens/s, %.3fs (forward %.3fs, backward %.3fs, step %.3fs, io wait %.3fs, "
                "step wait %.3fs, other %.3fs), bytes device %d host %d nvme %d",
                self.steps,
                "-" if loss is None else f"{loss:.4f}",
                breakdown["tokens_per_s"],
                wall,
                breakdown["forward"],
                breakdown["backward"],
                breakdown["step"],
                breakdown["io_wait"],
                breakdown["wait_step"],
                breakdown["other"],
                breakdown["device_bytes"],
                breakdown["host_bytes"],
                breakdown["nvme_bytes"],
            )
        return breakdown

    def close(self) -> None:
        self._redirect.close()
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
