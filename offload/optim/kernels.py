"""The C++ CPU Adam kernel (offload._adam_ext), with argument checking.

Every function works on CPU tensors through their raw pointers (adam_step in place, or out
of place into `state_out`), runs on the extension's persistent thread pool (all CPUs this
process may use unless `set_num_threads` says otherwise) and releases the GIL while it runs.
The instruction set (AVX-512, AVX2 or portable C++) is picked at run time from what the CPU
supports; `force_isa` overrides it for tests and benchmarks.

The arithmetic follows torch.optim.AdamW / Adam (single-tensor implementation) operation
by operation, with each Python scalar rounded to fp32 as torch rounds it, so results are
identical to torch's to the last bit.

`adam_step_compact` runs the same step on moments stored in bf16 or int8
(docs/compact_state.md), bit for bit what `offload.optim.moments.adam_step_torch` computes.
"""

from __future__ import annotations

import math
import os

import torch

from offload.config.state_layout import INT8_BLOCK, NORM_BLOCK
from offload.errors import OffloadError
from offload.optim.adam_bound import step_limit_factor
from offload.optim.moments import MomentView

try:
    from offload import _adam_ext as _ext
except ImportError as exc:  # pragma: no cover - depends on the build
    raise OffloadError(
        "offload._adam_ext is not built; run `pip install -e .` or `OFFLOAD_BUILD_ONLY=adam python setup.py build_ext --inplace`"
    ) from exc

__all__ = [
    "adam_step",
    "adam_step_compact",
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

if NORM_BLOCK != _ext.NORM_BLOCK:  # pragma: no cover - a stale build
    raise OffloadError(f"offload._adam_ext sums norms in blocks of {_ext.NORM_BLOCK}, offload expects {NORM_BLOCK}: rebuild it")

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
    _check_hyper(op, step, lr, beta1, beta2, eps, weight_decay)
    if param_out16 is not None and param_out16.data_ptr() in (param.data_ptr(), grad.data_ptr()):
        raise ValueError(f"{op}: param_out16 must not alias param or grad")
    _check_out_overlaps(op, tensors, outs)
    if n == 0:
        return
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
        *_step_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale),
        0 if state_out is None else param.data_ptr(),
        0 if state_out is None else exp_avg.data_ptr(),
        0 if state_out is None else exp_avg_sq.data_ptr(),
    )


def _check_hyper(op: str, step, lr, beta1, beta2, eps, weight_decay) -> None:
    if float(step) < 1:
        raise ValueError(f"{op}: step must be >= 1 (the step number after this update), got {step}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not float(value) >= 0.0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")


def _step_scalars(
    step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, compact: bool = False
) -> tuple:
    """The extension's scalar arguments (grad_scale .. neg_step_size), in float64: it rounds
    each to fp32 once. The bias correction of the second moment is sqrt(bias_correction2),
    which the fp32 step divides by, or for a compact step (`compact`) its inverse, which that
    step multiplies by (docs/compact_state.md)."""
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
    return (
        float(grad_scale),
        weight_decay,
        l2,
        1 - lr * weight_decay,
        decoupled,
        1 - beta1,
        beta2,
        1 - beta2,
        1 / bias_correction2_sqrt if compact else bias_correction2_sqrt,
        float(eps),
        -step_size,
    )


_MOMENT_DTYPES = {"bf16": torch.bfloat16, "int8": torch.uint8}


def _moment_tensors(op: str, name: str, view, precision: str, n: int) -> dict[str, torch.Tensor]:
    """The tensors of one compact moment view, checked: {name.values, name.block_exponents}."""
    if not isinstance(view, MomentView):
        raise TypeError(
            f"{op}: {name} must be an offload.optim.moments.MomentView (moments.moment_view builds one), got {type(view).__name__}"
        )
    tensors = {f"{name}.values": view.values}
    _check_cpu_contiguous(op, f"{name}.values", view.values)
    _check_dtype(op, f"{name}.values", view.values, (_MOMENT_DTYPES[precision],))
    if view.values.numel() != n:
        raise ValueError(f"{op}: {name}.values has {view.values.numel()} elements but param has {n}")
    if precision == "int8":
        blocks = -(-n // INT8_BLOCK)
        exponents = view.block_exponents
        if exponents is None:
            raise ValueError(f"{op}: {name}.block_exponents is None; an int8 moment needs its {blocks} block exponents")
        _check_cpu_contiguous(op, f"{name}.block_exponents", exponents)
        _check_dtype(op, f"{name}.block_exponents", exponents, (torch.uint8,))
        if exponents.numel() != blocks:
            raise ValueError(
                f"{op}: {name}.block_exponents has {exponents.numel()} elements; {n} int8 elements take ceil({n}/32) = {blocks}"
            )
        tensors[f"{name}.block_exponents"] = exponents
    elif view.block_exponents is not None:
        raise ValueError(f"{op}: {name}.block_exponents must be None for a {precision} moment")
    return tensors


def adam_step_compact(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: MomentView,
    exp_avg_sq: MomentView,
    *,
    precision: str,
    position: int,
    rounding_key: int,
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
    state_out: tuple[torch.Tensor, MomentView, MomentView] | None = None,
) -> None:
    """One Adam / AdamW step on moments stored in `precision` ("fp32", "bf16", "int8";
    docs/compact_state.md), in place unless state_out is given; bit for bit
    offload.optim.moments.adam_step_torch (same signature), for any thread count and ISA.

    param: fp32; grad: fp32, bf16 or fp16; exp_avg, exp_avg_sq: MomentViews
    (moments.moment_view) of n elements (bf16: values bfloat16; int8: values uint8 codes and
    ceil(n/32) uint8 block_exponents; fp32: values float32, run by adam_step); all CPU,
    contiguous. The elements are [position, position + n) of the unit's shard: `position`
    picks their random bits (for int8 it is a multiple of 32: the call's blocks are its
    elements 32 b .. 32 b + 31). `rounding_key` is moments.rounding_key(unit, rank, step);
    `step` the step number after this update. param_out16 (bf16 or fp16) receives the 16-bit
    copy of the new weights. state_out = (param_out, exp_avg_out, exp_avg_sq_out) writes the
    new state there, the inputs only read; each out tensor is its own input (same data_ptr)
    or overlaps no tensor of the step.
    """
    op = "adam_step_compact"
    if precision not in ("fp32", "bf16", "int8"):
        raise ValueError(f"{op}: precision must be 'fp32', 'bf16' or 'int8', got {precision!r}")
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"{op}: position must be an int >= 0 (the first element's offset in the unit's shard), got {position!r}")
    if isinstance(rounding_key, bool) or not isinstance(rounding_key, int) or not 0 <= rounding_key < 2**32:
        raise ValueError(f"{op}: rounding_key must be an int in [0, 2^32) (moments.rounding_key), got {rounding_key!r}")
    if precision == "int8" and position % INT8_BLOCK:
        raise ValueError(f"{op}: position {position} is not a multiple of {INT8_BLOCK}; an int8 range must start on a block")
    if precision == "fp32":
        for name, view in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if not isinstance(view, MomentView) or view.block_exponents is not None:
                raise TypeError(f"{op}: {name} of an fp32 step must be a MomentView(values, None)")
        outs32 = None
        if state_out is not None:
            if (
                not isinstance(state_out, (tuple, list))
                or len(state_out) != 3
                or not all(isinstance(v, MomentView) for v in state_out[1:])
            ):
                raise TypeError(f"{op}: state_out must be (param_out, MomentView, MomentView)")
            outs32 = (state_out[0], state_out[1].values, state_out[2].values)
        adam_step(
            param,
            grad,
            exp_avg.values,
            exp_avg_sq.values,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            grad_scale=grad_scale,
            param_out16=param_out16,
            state_out=outs32,
        )
        return
    _check_cpu_contiguous(op, "param", param)
    _check_cpu_contiguous(op, "grad", grad)
    _check_dtype(op, "param", param, (torch.float32,))
    _check_dtype(op, "grad", grad, (torch.float32, torch.bfloat16, torch.float16))
    n = param.numel()
    if grad.numel() != n:
        raise ValueError(f"{op}: grad has {grad.numel()} elements but param has {n}")
    tensors: dict[str, torch.Tensor] = {"param": param, "grad": grad}
    tensors.update(_moment_tensors(op, "exp_avg", exp_avg, precision, n))
    tensors.update(_moment_tensors(op, "exp_avg_sq", exp_avg_sq, precision, n))
    if param_out16 is not None:
        _check_cpu_contiguous(op, "param_out16", param_out16)
        _check_dtype(op, "param_out16", param_out16, (torch.bfloat16, torch.float16))
        if param_out16.numel() != n:
            raise ValueError(f"{op}: param_out16 has {param_out16.numel()} elements but param has {n}")
        tensors["param_out16"] = param_out16
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    destinations: tuple[torch.Tensor, MomentView, MomentView] = (param, exp_avg, exp_avg_sq)
    if state_out is not None:
        if not isinstance(state_out, (tuple, list)) or len(state_out) != 3:
            raise TypeError(
                f"{op}: state_out must be a tuple (param_out, exp_avg_out, exp_avg_sq_out) of a tensor and 2 MomentViews, "
                f"got {type(state_out).__name__}"
            )
        param_out, m_out, v_out = state_out
        _check_cpu_contiguous(op, "state_out[0] (param_out)", param_out)
        _check_dtype(op, "state_out[0] (param_out)", param_out, (torch.float32,))
        if param_out.numel() != n:
            raise ValueError(f"{op}: state_out[0] (param_out) has {param_out.numel()} elements but param has {n}")
        tensors["state_out[0] (param_out)"] = param_out
        outs["state_out[0] (param_out)"] = (param_out, param)
        for k, (name, out_view, source) in enumerate((("exp_avg_out", m_out, exp_avg), ("exp_avg_sq_out", v_out, exp_avg_sq)), 1):
            out_tensors = _moment_tensors(op, f"state_out[{k}] ({name})", out_view, precision, n)
            tensors.update(out_tensors)
            for (out_name, out), own in zip(out_tensors.items(), (source.values, source.block_exponents)):
                assert own is not None
                outs[out_name] = (out, own)
        destinations = (param_out, m_out, v_out)
    _check_hyper(op, step, lr, beta1, beta2, eps, weight_decay)
    # (the extension checks again, all of them: the gradient and each source against every
    # destination)
    _check_out_overlaps(op, tensors, outs)
    if n == 0:
        return

    def pointer(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    out_p, out_m, out_v = destinations
    _ext.adam_step_compact(
        out_p.data_ptr(),
        grad.data_ptr(),
        out_m.values.data_ptr(),
        pointer(out_m.block_exponents),
        out_v.values.data_ptr(),
        pointer(out_v.block_exponents),
        pointer(param_out16),
        n,
        _ext.MOMENT_INT8 if precision == "int8" else _ext.MOMENT_BF16,
        _TYPE_CODES[grad.dtype],
        _ext.NONE if param_out16 is None else _TYPE_CODES[param_out16.dtype],
        rounding_key,
        position,
        *_step_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, compact=True),
        # int8 only: rounded moments could otherwise step further than AdamW can (adam_bound)
        step_limit_factor(int(step), float(beta1), float(beta2)) if precision == "int8" else math.inf,
        0 if state_out is None else param.data_ptr(),
        0 if state_out is None else exp_avg.values.data_ptr(),
        0 if state_out is None else pointer(exp_avg.block_exponents),
        0 if state_out is None else exp_avg_sq.values.data_ptr(),
        0 if state_out is None else pointer(exp_avg_sq.block_exponents),
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


def sq_norm(t: torch.Tensor, carried: float = 0.0) -> float:
    """Sum of squares of t (fp32, bf16 or fp16), accumulated in double, added to `carried`.

    The order is canonical: blocks of NORM_BLOCK elements from t's start, each summed in 16
    lanes combined in a fixed order (the same bits on every instruction set), added one by one
    in block order to `carried`. So the result depends only on the values, never on the thread
    count or the CPU; and a vector cut into pieces whose lengths (all but the last) are
    multiples of NORM_BLOCK gives the same bits, piece by piece with each call carrying the
    previous one's result, as the whole vector in one call.
    """
    _check_reduce_input("sq_norm", t)
    return _ext.sq_norm(t.data_ptr(), t.numel(), _TYPE_CODES[t.dtype], float(carried))


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
    """Run the kernels with instruction set `name`; None returns to the default: the one
    OFFLOAD_CPU_ISA names when set, else the best available.

    Raises OffloadError when this CPU lacks it, ValueError for an unknown name.
    """
    if name is None:
        _ext.force_isa(_DEFAULT_ISA or "")
        return
    _check_isa(name, "force_isa")
    _ext.force_isa(name)


def _check_isa(name: str, where: str) -> None:
    if name not in _ISA_NAMES:
        raise ValueError(f"{where}: unknown instruction set {name!r}; expected one of {_ISA_NAMES}")
    if name not in available_isas():
        raise OffloadError(f"{where}: this CPU does not support {name!r} (available: {available_isas()})")


# OFFLOAD_CPU_ISA=avx2 (or portable, avx512) runs every kernel of this process with that
# instruction set: the suite runs so to show that no exact comparison depends on this CPU's
# vector width, and a user can rule the kernels' ISA in or out of a numerical question.
_DEFAULT_ISA = os.environ.get("OFFLOAD_CPU_ISA") or None
if _DEFAULT_ISA is not None:
    _check_isa(_DEFAULT_ISA, "OFFLOAD_CPU_ISA")
    _ext.force_isa(_DEFAULT_ISA)
