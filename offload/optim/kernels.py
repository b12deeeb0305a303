"""The C++ CPU Adam kernel (offload._adam_ext), with argument checking.

Every function works on CPU tensors through their raw pointers (adam_step in place, or out
of place into `state_out`), runs on the extension's persistent thread pool (all CPUs this
process may use unless `set_num_threads` says otherwise) and releases the GIL while it runs.
The instruction set (AVX-512, AVX2 or portable C++) is picked at run time from what the CPU
supports; `force_isa` overrides it for tests and benchmarks.

The arithmetic follows torch.optim.AdamW / Adam (single-tensor implementation) operation
by operation, with each Python scalar rounded to fp32 as torch rounds it, so results are
identical to torch's to the last bit.
"""

from __future__ import annotations

import torch

from offload.errors import OffloadError

try:
    from offload import _adam_ext as _ext
except ImportError as exc:  # pragma: no cover - depends on the build
    raise OffloadError(
        "offload._adam_ext is not built; run `pip install -e .` or `OFFLOAD_BUILD_ONLY=adam python setup.py build_ext --inplace`"
    ) from exc

__all__ = [
    "adam_step",
    "sq_norm",
    "has_nonfinite",
    "set_num_threads",
    "get_num_threads",
    "active_isa",
    "available_isas",
    "force_isa",
    "set_streaming_threshold",
    "streaming_threshold",
]

_TYPE_CODES = {torch.float32: _ext.F32, torch.bfloat16: _ext.BF16, torch.float16: _ext.F16}
_ISA_NAMES = ("avx512", "avx2", "portable")


def _check_cpu_contiguous(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise OffloadError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type != "cpu":
        raise OffloadError(f"{op}: {name} must be on the CPU, got device {t.device}")
    if not t.is_contiguous():
        raise OffloadError(f"{op}: {name} must be contiguous (call .contiguous() first)")


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: {name} must be {names}, got {str(t.dtype).replace('torch.', '')}")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_out16: torch.Tensor | None = None,
    state_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One Adam (adamw_mode=False: L2 decay) or AdamW (decoupled decay) step, in place
    unless state_out is given.

    param, exp_avg, exp_avg_sq: fp32; grad: fp32, bf16 or fp16; all CPU, contiguous, same
    numel. The gradient used is grad * grad_scale. `step` is the step number after this
    update (1 on the first call). When given, param_out16 (bf16 or fp16, same numel)
    receives param.to(param_out16.dtype) after the update, in the same pass.

    state_out = (param_out, exp_avg_out, exp_avg_sq_out), fp32 CPU contiguous tensors of the
    same numel, makes the step out of place: param, exp_avg and exp_avg_sq are only read, and
    the updated values (bit for bit what the in-place step would leave in them) are written to
    the three outs, in the same single pass (param_out16 then holds the 16-bit copy of
    param_out). Each out must either be its own input (same data_ptr: that one is updated in
    place) or overlap none of param, grad, exp_avg, exp_avg_sq, param_out16 and the other outs.
    """
    op = "adam_step"
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_out16 is not None:
        tensors["param_out16"] = param_out16
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # out name -> (out, its input)
    if state_out is not None:
        if not isinstance(state_out, (tuple, list)) or len(state_out) != 3:
            raise TypeError(
                f"{op}: state_out must be a tuple (param_out, exp_avg_out, exp_avg_sq_out) of 3 tensors, "
                f"got {type(state_out).__name__}"
                + (f" of length {len(state_out)}" if isinstance(state_out, (tuple, list)) else "")
            )
        for k, (name, source) in enumerate((("param_out", param), ("exp_avg_out", exp_avg), ("exp_avg_sq_out", exp_avg_sq))):
            full_name = f"state_out[{k}] ({name})"
            tensors[full_name] = state_out[k]
            outs[full_name] = (state_out[k], source)
    for name, t in tensors.items():
        _check_cpu_contiguous(op, name, t)
    for name in ("param", "exp_avg", "exp_avg_sq", *outs):
        _check_dtype(op, name, tensors[name], (torch.float32,))
    _check_dtype(op, "grad", grad, (torch.float32, torch.bfloat16, torch.float16))
    if param_out16 is not None:
        _check_dtype(op, "param_out16", param_out16, (torch.bfloat16, torch.float16))
    n = param.numel()
    for name, t in tensors.items():
        if t.numel() != n:
            raise ValueError(f"{op}: {name} has {t.numel()} elements but param has {n}")
    if float(step) < 1:
        raise ValueError(f"{op}: step must be >= 1 (the step number after this update), got {step}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not float(value) >= 0.0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
    if param_out16 is not None and param_out16.data_ptr() in (param.data_ptr(), grad.data_ptr()):
        raise ValueError(f"{op}: param_out16 must not alias param or grad")
    _check_out_overlaps(op, tensors, outs)
    if n == 0:
        return

    lr = float(lr)
    weight_decay = float(weight_decay)
    # Same Python-level scalar expressions as torch/optim/adam.py::_single_tensor_adam.
    if bias_correction:
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
    else:
        bias_correction1 = bias_correction2 = 1.0
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    decoupled = bool(adamw_mode) and weight_decay != 0
    l2 = (not adamw_mode) and weight_decay != 0
    # The extension's first three pointers are the destinations; the sources come last
    # (0: in place).
    destinations = (param, exp_avg, exp_avg_sq) if state_out is None else tuple(state_out)
    _ext.adam_step(
        destinations[0].data_ptr(),
        grad.data_ptr(),
        destinations[1].data_ptr(),
        destinations[2].data_ptr(),
        0 if param_out16 is None else param_out16.data_ptr(),
        n,
        _TYPE_CODES[grad.dtype],
        _ext.NONE if param_out16 is None else _TYPE_CODES[param_out16.dtype],
        float(grad_scale),
        weight_decay,
        l2,
        1 - lr * weight_decay,
        decoupled,
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2_sqrt,
        float(eps),
        -step_size,
        0 if state_out is None else param.data_ptr(),
        0 if state_out is None else exp_avg.data_ptr(),
        0 if state_out is None else exp_avg_sq.data_ptr(),
    )


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.nbytes


def _check_out_overlaps(op: str, tensors: dict[str, torch.Tensor], outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each out is either exactly its own input (in place) or overlaps no other tensor of the step.

    A partial overlap would make the result depend on the order in which the threads write.
    """
    for out_name, (out, source) in outs.items():
        if out.data_ptr() == source.data_ptr():
            continue  # in place: same fp32 buffer of the same numel
        out_start, out_end = _byte_range(out)
        if out_start == out_end:
            continue
        for name, other in tensors.items():
            if name == out_name:
                continue
            start, end = _byte_range(other)
            if out_start < end and start < out_end:
                raise ValueError(
                    f"{op}: {out_name} overlaps {name}; each state_out tensor must be its own input "
                    "(same data_ptr, in place) or overlap none of param, grad, exp_avg, exp_avg_sq, "
                    "param_out16 and the other outs"
                )


def set_streaming_threshold(n: int | None) -> None:
    """adam_step calls with at least n elements write param_out16 with non-temporal stores
    (arrays far beyond the last-level cache); None restores the default.

    Results are identical either way; only the memory traffic differs.
    """
    if n is None:
        _ext.set_streaming_threshold(_ext.DEFAULT_STREAMING_THRESHOLD)
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_streaming_threshold: n must be an int or None, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"set_streaming_threshold: n must be >= 0, got {n}")
    _ext.set_streaming_threshold(n)


def streaming_threshold() -> int:
    """Element count from which adam_step streams (see set_streaming_threshold)."""
    return _ext.streaming_threshold()


def _check_reduce_input(op: str, t: torch.Tensor) -> None:
    _check_cpu_contiguous(op, "t", t)
    _check_dtype(op, "t", t, (torch.float32, torch.bfloat16, torch.float16))


def sq_norm(t: torch.Tensor) -> float:
    """Sum of squares of t (fp32, bf16 or fp16), accumulated in double.

    Fixed-size blocks combined in a fixed order: the same value for any thread count.
    """
    _check_reduce_input("sq_norm", t)
    return _ext.sq_norm(t.data_ptr(), t.numel(), _TYPE_CODES[t.dtype])


def has_nonfinite(t: torch.Tensor) -> bool:
    """True when t (fp32, bf16 or fp16) holds any NaN or infinity."""
    _check_reduce_input("has_nonfinite", t)
    return _ext.has_nonfinite(t.data_ptr(), t.numel(), _TYPE_CODES[t.dtype])


def set_num_threads(n: int) -> None:
    """Threads the kernels use (the calling thread included); default: the CPUs this process may use."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_threads: n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    _ext.set_num_threads(n)


def get_num_threads() -> int:
    return _ext.get_num_threads()


def active_isa() -> str:
    """The instruction set the kernels run with now: "avx512", "avx2" or "portable"."""
    return _ext.active_isa()


def available_isas() -> list[str]:
    """Instruction sets this CPU can run, best first ("portable" always)."""
    return list(_ext.available_isas())


def force_isa(name: str | None) -> None:
    """Run the kernels with instruction set `name`; None returns to the best available.

    Raises OffloadError when this CPU lacks it, ValueError for an unknown name.
    """
    if name is None:
        _ext.force_isa("")
        return
    if name not in _ISA_NAMES:
        raise ValueError(f"force_isa: unknown instruction set {name!r}; expected one of {_ISA_NAMES} or None")
    if name not in available_isas():
        raise OffloadError(f"force_isa: this CPU does not support {name!r} (available: {available_isas()})")
    _ext.force_isa(name)
