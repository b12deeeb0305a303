"""offload.CPUAdamW: a drop-in torch.optim.Optimizer on the C++ CPU Adam kernel."""

from __future__ import annotations

import logging

import torch

from offload.config.state_layout import StatePrecision
from offload.errors import OffloadError
from offload.optim import kernels, moments
from offload.optim.moment_limits import SaturationReport

logger = logging.getLogger(__name__)

_STATE_PRECISIONS = tuple(precision.value for precision in StatePrecision)
_MOMENTS = ("exp_avg", "exp_avg_sq")
# the state keys of compact moments (`moments.moment_storage`), in every precision
_COMPACT_KEYS = frozenset(f"{kind}_{precision}" for kind in _MOMENTS for precision in _STATE_PRECISIONS if precision != "fp32")

__all__ = ["CPUAdamW"]


def _as_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"CPUAdamW: {name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


def _loaded_step(step, index: int) -> int:
    """A loaded state's step count (a number, or torch's one-element tensor) as an int; a
    ValueError naming the parameter where it is not a count of steps."""
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, int | float) or not (0 <= step < 2**53 and step == int(step)):
        raise ValueError(f"CPUAdamW: parameter {index}'s step is {step!r:.60}, not a count of steps (an integer >= 0)")
    return int(step)


def _mode(where: str, adamw_mode, decoupled_weight_decay, *, default: bool) -> bool:
    """AdamW (True) or Adam with L2 (False) from either key; both given and different is an error."""
    given = {bool(v) for v in (adamw_mode, decoupled_weight_decay) if v is not None}
    if len(given) > 1:
        raise ValueError(
            f"CPUAdamW: {where} sets adamw_mode={bool(adamw_mode)} but decoupled_weight_decay="
            f"{bool(decoupled_weight_decay)}; they are one setting (True: AdamW's decoupled decay, False: Adam's L2): "
            "set one of them, or both equal"
        )
    return given.pop() if given else default


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with ``adamw_mode=False``) over fp32 CPU parameters.

    Same hyperparameters, param groups and state layout as torch.optim.AdamW (state keys
    ``step`` as a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``), so a state dict saved
    by either loads into the other and training continues identically. Every step runs the
    vectorized, multithreaded C++ kernel (offload.optim.kernels.adam_step) and matches
    torch's single-tensor AdamW bit for bit.

    Parameters must be fp32, dense, contiguous and on the CPU. ``amsgrad`` and ``maximize``
    are not supported and raise.

    ``state_precision`` stores the Adam moments as ``"fp32"`` (the default: torch's state, bit
    for bit), ``"bf16"`` or ``"int8"`` (docs/compact_state.md: stochastic rounding, int8 in
    blocks of 32 elements with a shared exponent; 2 or about 1 byte per moment per element
    instead of 4). Compact moments are kept in the state as ``exp_avg_<precision>`` and
    ``exp_avg_sq_<precision>`` buffers (``moments.moment_storage``); ``state_dict()`` holds
    them decoded, as fp32 ``exp_avg`` / ``exp_avg_sq`` like torch's (so torch.optim.AdamW
    loads it), plus a top-level ``state_precision``; ``load_state_dict`` re-encodes fp32
    moments (from any optimizer) into this optimizer's precision. A state dict of a compact
    CPUAdamW re-encodes to exactly the moments it was saved from: training resumes bit for bit.
    Each parameter's rounding uses its index in the optimizer (groups in order), its step and
    ``rounding_seed`` (an int >= 0: which stream of random bits; the engine's
    ``optimizer.rounding_seed``).

    ``lr`` and ``betas`` may be scalar tensors, as with torch: they are kept as given and read at
    every step, so a loop or scheduler that updates the tensor in place takes effect. Each
    group's mode is torch's ``decoupled_weight_decay`` key and this class's ``adamw_mode``, kept
    equal: a group (or the constructor) given ``decoupled_weight_decay=False`` runs Adam with L2
    weight decay (the kernel's adam mode), as torch.optim.AdamW does with that group key; the
    two keys set to different values is an error.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool | None = None,
        *,
        bias_correction: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        state_precision: str = "fp32",
        rounding_seed: int = 0,
    ):
        if state_precision not in _STATE_PRECISIONS:
            raise ValueError(f"CPUAdamW: state_precision must be one of {_STATE_PRECISIONS}, got {state_precision!r}")
        if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int) or not 0 <= rounding_seed < 2**32:
            raise ValueError(f"CPUAdamW: rounding_seed must be an int in [0, 2^32), got {rounding_seed!r}")
        self.rounding_seed = rounding_seed
        # how the moments are stored: this optimizer's choice, not a group's (a loaded state
        # dict is re-encoded into it)
        self.state_precision = state_precision
        # tensors are kept (read at every step), their values checked now
        if not _as_float("lr", lr) >= 0.0:
            raise ValueError(f"CPUAdamW: invalid lr {_as_float('lr', lr)} (must be >= 0)")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdamW: invalid eps {eps} (must be >= 0)")
        if len(tuple(betas)) != 2:
            raise ValueError(f"CPUAdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(_as_float("betas", b) for b in betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"CPUAdamW: invalid beta at index {index}: {beta} (must be in [0, 1))")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdamW: invalid weight_decay {weight_decay} (must be >= 0)")
        self._check_unsupported(amsgrad, maximize)
        adamw_mode = _mode("the constructor", adamw_mode, decoupled_weight_decay, default=True)
        if not isinstance(lr, torch.Tensor):
            lr = float(lr)
        defaults = dict(
            lr=lr,
            betas=tuple(b if isinstance(b, torch.Tensor) else float(b) for b in betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bool(bias_correction),
            amsgrad=False,
            maximize=False,
            # torch.optim.Adam/AdamW's group keys, so that a state dict saved here loads there
            # with the same meaning (torch.optim.Adam reads decoupled_weight_decay).
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=adamw_mode,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p)

    @staticmethod
    def _check_unsupported(amsgrad, maximize) -> None:
        if amsgrad:
            raise OffloadError("CPUAdamW: amsgrad=True is not supported (use torch.optim.AdamW for AMSGrad)")
        if maximize:
            raise OffloadError("CPUAdamW: maximize=True is not supported (negate the loss instead)")

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise OffloadError(f"CPUAdamW: parameters must be on the CPU, got one on {p.device}")
        if p.layout != torch.strided:
            raise OffloadError(f"CPUAdamW: parameters must be dense tensors, got layout {p.layout}")
        if p.dtype != torch.float32:
            raise TypeError(f"CPUAdamW: parameters must be float32 (fp32 master weights), got {p.dtype}")
        if not p.is_contiguous():
            raise OffloadError(
                f"CPUAdamW: parameters must be contiguous, got one of shape {tuple(p.shape)} with strides {p.stride()}"
            )

    def add_param_group(self, param_group: dict) -> None:
        # A group may choose its mode by either key (torch's decoupled_weight_decay, or
        # adamw_mode); both are set, equal, before torch fills in the defaults
        if "adamw_mode" in param_group or "decoupled_weight_decay" in param_group:
            mode = _mode(
                f"parameter group {len(self.param_groups)}",
                param_group.get("adamw_mode"),
                param_group.get("decoupled_weight_decay"),
                default=True,
            )
            param_group["adamw_mode"] = param_group["decoupled_weight_decay"] = mode
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._check_param(p)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["state_precision"] = self.state_precision
        state["rounding_seed"] = self.rounding_seed
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if not hasattr(self, "state_precision"):
            self.state_precision = "fp32"
        if not hasattr(self, "rounding_seed"):
            self.rounding_seed = 0
        for group in self.param_groups:
            # A state dict saved by torch.optim.AdamW has no adamw_mode: AdamW saves
            # decoupled_weight_decay=True (torch.optim.Adam saves False).
            if "adamw_mode" not in group:
                group["adamw_mode"] = bool(group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", True)
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group["decoupled_weight_decay"] = group["adamw_mode"]
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if p_state and not torch.is_tensor(p_state.get("step")):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    def _parameters(self) -> list[torch.Tensor]:
        """Every parameter, groups in order: a parameter's position is its index in the state dict."""
        return [p for group in self.param_groups for p in group["params"]]

    def _compact_state(self, p: torch.Tensor, index: int, state: dict) -> list[moments.MomentView]:
        """The compact moments of parameter `p` (index `index`), created as zeros or encoded from
        fp32 moments (a loaded state dict) the first time."""
        precision = self.state_precision
        n = p.numel()
        numel, dtype = moments.moment_storage(precision, n)
        views = []
        for kind in _MOMENTS:
            key = f"{kind}_{precision}"
            if key not in state:
                if kind in state:
                    state[key] = self._encoded(kind, state.pop(kind), p, index, _loaded_step(state.get("step", 0), index))
                else:
                    state[key] = torch.zeros(numel, dtype=dtype)
            buffer = state[key]
            if buffer.dtype != dtype or buffer.numel() != numel:
                raise ValueError(
                    f"CPUAdamW: {key} must hold {numel} {str(dtype).replace('torch.', '')} for a parameter of {n} elements, "
                    f"got {buffer.numel()} {str(buffer.dtype).replace('torch.', '')}"
                )
            views.append(moments.moment_view(precision, buffer, n, 0, n))
        return views

    def _encoded(self, kind: str, values, p: torch.Tensor, index: int, step: int) -> torch.Tensor:
        """A new buffer holding fp32 moment `values` (of parameter `p`, index `index`, `step`
        steps in) in this optimizer's precision; a ValueError naming what is wrong with them, a
        warning naming the parameter for values beyond what the precision holds (saturated)."""
        n = p.numel()
        if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.numel() != n:
            what = f"{values.numel()} elements" if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"CPUAdamW: parameter {index}'s {kind} has {what}, its parameter {n} fp32 elements")
        saturated = SaturationReport(self.state_precision)
        saturated.check(f"parameter {index} (shape {list(p.shape)})", kind, values.detach().float())
        message = saturated.message("CPUAdamW.load_state_dict")
        if message is not None:
            logger.warning("offload: %s", message)
        numel, dtype = moments.moment_storage(self.state_precision, n)
        buffer = torch.zeros(numel, dtype=dtype)
        moments.encode(
            self.state_precision,
            kind,
            values.detach().reshape(-1).float().contiguous(),
            moments.moment_view(self.state_precision, buffer, n, 0, n),
            position=0,
            key=moments.rounding_key(index, 0, step, self.rounding_seed),
            reload=True,
        )
        return buffer

    def _loaded_moments(self, state_dict: dict) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Every check of a state dict to load, and its fp32 moments encoded into this optimizer's
        precision, before anything of the optimizer changes: parameter -> its compact buffers.
        Refusals are ValueErrors (a state dict whose groups do not match is left to torch's
        load, which refuses it before changing anything)."""
        saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
        if not (isinstance(saved_groups, list) and isinstance(saved_state, dict)) or [
            len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved_groups
        ] != [len(g["params"]) for g in self.param_groups]:
            return {}
        compact = self.state_precision != "fp32"
        encoded = {}
        saved_ids = [i for group in saved_groups for i in group["params"]]
        for index, (saved_id, p) in enumerate(zip(saved_ids, self._parameters())):
            state = saved_state.get(saved_id)
            if not state:
                continue
            step = _loaded_step(state.get("step", 0), index)
            if not compact:
                continue
            foreign = sorted(k for k in state if k in _COMPACT_KEYS and not k.endswith(f"_{self.state_precision}"))
            if foreign:
                raise ValueError(
                    f"CPUAdamW: parameter {index}'s state holds {foreign[0]}, moments stored in another precision than "
                    f"this optimizer's {self.state_precision}: load what that optimizer's state_dict() gives (fp32 moments)"
                )
            buffers = {}
            for kind in _MOMENTS:
                key = f"{kind}_{self.state_precision}"
                if key in state:
                    buffers[key] = state[key].clone()
                    moments.moment_view(self.state_precision, buffers[key], p.numel(), 0, p.numel())
                elif kind in state:
                    buffers[key] = self._encoded(kind, state[kind], p, index, step)
            encoded[p] = buffers
        return encoded

    def state_dict(self) -> dict:
        """torch's state dict; compact moments decoded to fp32 ``exp_avg`` / ``exp_avg_sq`` (the
        optimizer's own state is left as it is), with the precision as ``state_precision``."""
        saved = super().state_dict()
        if self.state_precision == "fp32":
            return saved
        precision = self.state_precision
        parameters = self._parameters()
        packed = {}
        for index, param_state in saved["state"].items():
            param_state = dict(param_state)  # torch's packed state shares these dicts with self.state
            p = parameters[index]
            for kind in _MOMENTS:
                key = f"{kind}_{precision}"
                if key in param_state:
                    view = moments.moment_view(precision, param_state.pop(key), p.numel(), 0, p.numel())
                    param_state[kind] = moments.decode(precision, kind, view).reshape(p.shape)
            packed[index] = param_state
        saved["state"] = packed
        saved["state_precision"] = precision
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict; fp32 moments are re-encoded into this optimizer's precision
        (exactly the saved moments when the state dict came from a compact CPUAdamW). All or
        nothing: every parameter's state is checked and encoded first (`_loaded_moments`, from the
        state dict as given, before torch's load and its hooks), so a state dict refused with a
        ValueError leaves the optimizer as it was."""
        state_dict = dict(state_dict)
        state_dict.pop("state_precision", None)
        encoded = self._loaded_moments(state_dict)
        super().load_state_dict(state_dict)
        for p, buffers in encoded.items():
            state = self.state[p]
            for kind in _MOMENTS:
                state.pop(kind, None)
            state.update(buffers)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compact = self.state_precision != "fp32"
        index = -1  # the parameter's index in the optimizer (groups in order)
        for group_index, group in enumerate(self.param_groups):
            self._check_unsupported(group.get("amsgrad", False), group.get("maximize", False))
            # set apart after construction (group["decoupled_weight_decay"] = False): which one
            # was meant is unknown, so neither is guessed
            adamw_mode = _mode(
                f"parameter group {group_index}", group["adamw_mode"], group["decoupled_weight_decay"], default=True
            )
            # read now: a tensor lr or betas updated in place since the last step takes effect
            beta1, beta2 = (_as_float("betas", b) for b in group["betas"])
            lr = _as_float("lr", group["lr"])
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise OffloadError("CPUAdamW: sparse gradients are not supported")
                self._check_param(p)
                if grad.shape != p.shape:
                    raise ValueError(f"CPUAdamW: gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(p.shape)}")
                if not grad.is_contiguous():
                    grad = grad.contiguous()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    if not compact:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_t = state["step"]
                step_t += 1
                hyper = {
                    "step": step_t.item(),
                    "lr": lr,
                    "beta1": beta1,
                    "beta2": beta2,
                    "eps": group["eps"],
                    "weight_decay": group["weight_decay"],
                    "adamw_mode": adamw_mode,
                    "bias_correction": group.get("bias_correction", True),
                }
                if compact:
                    exp_avg, exp_avg_sq = self._compact_state(p, index, state)
                    kernels.adam_step_compact(
                        p.view(-1),
                        grad.view(-1),
                        exp_avg,
                        exp_avg_sq,
                        precision=self.state_precision,
                        position=0,
                        rounding_key=moments.rounding_key(index, 0, int(step_t.item()), self.rounding_seed),
                        **hyper,
                    )
                else:
                    kernels.adam_step(p, grad, state["exp_avg"], state["exp_avg_sq"], **hyper)
        return loss
