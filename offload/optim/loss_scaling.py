"""Loss scaling, overflow handling and global-norm clipping: plain arithmetic, no torch state."""

from __future__ import annotations

import math
from dataclasses import dataclass

# As torch.nn.utils.clip_grad_norm_: the coefficient is max_norm / (norm + 1e-6), at most 1.
CLIP_EPSILON = 1e-6


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scaling: halve on overflow (the step is skipped), grow after a clean run."""

    scale: float = 2.0**16
    growth_interval: int = 1000
    backoff_factor: float = 0.5
    growth_factor: float = 2.0
    min_scale: float = 1.0
    clean_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def check_state_dict(self, state) -> None:
        """Raises ValueError naming the key when `state` is not one `load_state_dict` restores
        exactly: a positive finite scale and a count of clean steps."""
        if not isinstance(state, dict) or set(state) != {"scale", "clean_steps"}:
            raise ValueError(f"loss_scaler is {str(state)[:60]}, not {{'scale': ..., 'clean_steps': ...}}")
        scale, clean = state["scale"], state["clean_steps"]
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
            raise ValueError(f"loss_scaler.scale is {scale!r:.60}, not a positive finite number")
        if isinstance(clean, bool) or not isinstance(clean, int) or clean < 0:
            raise ValueError(f"loss_scaler.clean_steps is {clean!r:.60}, not a count (a non-negative integer)")

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor applied to every gradient so that the global norm is at most max_norm (0: off)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + CLIP_EPSILON))


def gradient_multiplier(loss_scale: float, total_scaled_sq_norm: float, max_norm: float) -> tuple[float, float]:
    """(the factor the kernel multiplies stored gradients by, the true global norm).

    Stored gradients carry the loss scale; the norm is computed on them and unscaled here."""
    scaled_norm = math.sqrt(total_scaled_sq_norm) if total_scaled_sq_norm >= 0 else float("nan")
    norm = scaled_norm / loss_scale
    return clip_coefficient(norm, max_norm) / loss_scale, norm
