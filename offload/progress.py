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

The bar is drawn only on a terminal (stderr a TTY, or `bar=True`). While it is open, console
logging goes through `tqdm.write` (tqdm's logging redirect), so log lines print above the bar
instead of onto it. Without a terminal (a log file, a job scheduler, a pipe) there is no bar:
one plain INFO line through `logging` on the first update, then every `every_s` seconds, and on
the last (`train: step 40/300, loss 2.4567, 5,230 tokens/s, 0.392 s/step, device 0 B, host 27.4
MiB, nvme 47.0 MiB`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from offload.config.sizes import format_bytes

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "nvme")
TIER_LABELS = {"device": "dev", "host": "host", "nvme": "nvme"}


def memory_postfix(breakdown: dict) -> dict[str, str]:
    """The bytes per tier as the bar shows them, `dev=0 B, host=28.1 MiB, nvme=47.4 MiB` (plain function: tested directly)."""
    return {TIER_LABELS[tier]: format_bytes(breakdown[f"{tier}_bytes"]) for tier in TIERS}


def draws_a_bar(bar: bool | None, stream) -> bool:
    """Whether progress is a bar: as asked, else only when `stream` is a terminal (a bar's carriage
    returns written to a file or pipe make one line of every update)."""
    if bar is not None:
        return bar
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def plain_line(
    desc: str, steps: int, total: int | None, loss: float | None, tokens_per_s: float, step_s: float, breakdown: dict
) -> str:
    """One progress line without a bar, every number with its unit (plain function: tested directly)."""
    where = f"step {steps}/{total}" if total else f"step {steps}"
    shown = "" if loss is None else f", loss {loss:.4f}"
    tiers = ", ".join(f"{tier} {format_bytes(breakdown[f'{tier}_bytes'])}" for tier in TIERS)
    return f"{desc}: {where}{shown}, {tokens_per_s:,.0f} tokens/s, {step_s:.3f} s/step, {tiers}"


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
    """tqdm bar (on a terminal) or plain log lines (elsewhere) + per-step breakdown over an
    offload Engine (see the module docstring).

    log_every: log the breakdown at INFO every this many updates (0: never). disable: no bar and
    no plain lines (the breakdown is still computed, and logged per log_every). bar: True or
    False to draw the bar or not whatever stderr is; None (default) draws it on a terminal only.
    every_s: without a bar, seconds between two plain lines."""

    def __init__(
        self,
        engine,
        total: int | None = None,
        *,
        desc: str = "train",
        log_every: int = 0,
        disable: bool = False,
        bar: bool | None = None,
        every_s: float = 10.0,
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
        self.desc, self.total, self.every_s = desc, total, every_s
        self._bar_drawn = not disable and draws_a_bar(bar, sys.stderr)
        self._plain = not disable and not self._bar_drawn
        self._bar = tqdm(total=total, desc=desc, disable=not self._bar_drawn, dynamic_ncols=True)
        # console log lines (this module's breakdown, the engine's warnings) above the bar, not onto it
        self._redirect = contextlib.ExitStack()
        if self._bar_drawn:
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=type(self._bar)))
        engine.pop_timings()  # start from a clean slate
        self._since = clock()
        # since the last plain line: when it was written, steps, tokens and seconds
        self._line_at: float | None = None
        self._unlined = [0, 0, 0.0]

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
        if self._plain:
            self._plain_line(now, loss, tokens, wall, breakdown)
        if self.log_every and self.steps % self.log_every == 0:
            logger.info(
                "step %d: loss %s, %.0f tokens/s, %.3fs (forward %.3fs, backward %.3fs, step %.3fs, io wait %.3fs, "
                "step wait %.3fs, other %.3fs), device %s, host %s, nvme %s",
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
                format_bytes(breakdown["device_bytes"]),
                format_bytes(breakdown["host_bytes"]),
                format_bytes(breakdown["nvme_bytes"]),
            )
        return breakdown

    def _plain_line(self, now: float, loss: float | None, tokens: int, wall: float, breakdown: dict) -> None:
        """The first update, then one every `every_s` seconds, and the last: rates over the steps since the previous line."""
        self._unlined = [self._unlined[0] + 1, self._unlined[1] + tokens, self._unlined[2] + wall]
        if self._line_at is None or now - self._line_at >= self.every_s or self.steps == self.total:
            self._write_line(loss, breakdown)
            self._line_at = now

    def _write_line(self, loss: float | None, breakdown: dict) -> None:
        count, tokens_since, seconds = self._unlined
        rate = tokens_since / seconds if seconds > 0 else 0.0
        logger.info("%s", plain_line(self.desc, self.steps, self.total, loss, rate, seconds / count, breakdown))
        self._unlined = [0, 0, 0.0]

    def close(self) -> None:
        if self._plain and self._unlined[0] and self.last is not None:  # the steps since the last line
            self._write_line(self.last["loss"], self.last)
        self._plain = False
        self._redirect.close()
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
