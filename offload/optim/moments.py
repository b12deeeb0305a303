"""The compact Adam moment formats and the compact step in torch (docs/compact_state.md).

The reference for the C++ kernel (`offload.optim.kernels.adam_step_compact`) and the step the
device tier runs: every function here gives, on any device, bit for bit what the kernel gives
on the CPU. Only exactly rounded fp32 operations are used (add, subtract, multiply, divide;
the fused multiply-adds and the square root are computed through float64 and rounded once),
and the formats' integer arithmetic runs on int64 tensors holding unsigned 32-bit values.

Storage of one moment of a piece of `n` elements (`moment_storage`):

- `fp32`: n float32;
- `bf16`: n bfloat16 (the bits of the value, rounded stochastically);
- `int8`: one uint8 buffer of `int8_moment_bytes(n)` bytes: n codes, then ceil(n / 32) block
  exponents. `moment_view` cuts the codes and exponents of a range out of it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from offload.config.state_layout import INT8_BLOCK, StatePrecision, int8_moment_bytes
from offload.optim.adam_bound import step_limit_factor

__all__ = [
    "MomentView",
    "ROUNDING_SEED",
    "moment_storage",
    "moment_view",
    "fmix32",
    "rounding_key",
    "random_bits",
    "decode",
    "encode",
    "adam_step_torch",
]

ROUNDING_SEED = 0x0FF1CAD5
_MASK32 = 0xFFFFFFFF
_KINDS = ("exp_avg", "exp_avg_sq")


class MomentView(NamedTuple):
    """One moment of a range of elements, as stored.

    fp32: `values` float32 (n), no exponents; bf16: `values` bfloat16 (n), no exponents; int8:
    `values` uint8 codes (n) and `block_exponents` uint8 (ceil(n / 32)), one per block of 32
    elements starting at the range's first element.
    """

    values: torch.Tensor
    block_exponents: torch.Tensor | None = None


def _precision(precision) -> StatePrecision:
    try:
        return StatePrecision(precision)
    except ValueError:
        raise ValueError(f"state precision must be one of 'fp32', 'bf16', 'int8', got {precision!r}") from None


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"moment kind must be 'exp_avg' or 'exp_avg_sq', got {kind!r}")


def moment_storage(precision: str, numel: int) -> tuple[int, torch.dtype]:
    """(numel, dtype) of the buffer that holds one moment of a piece of `numel` elements."""
    p = _precision(precision)
    if numel < 0:
        raise ValueError(f"moment_storage: numel must be >= 0, got {numel}")
    if p is StatePrecision.FP32:
        return numel, torch.float32
    if p is StatePrecision.BF16:
        return numel, torch.bfloat16
    return int8_moment_bytes(numel), torch.uint8


def moment_view(precision: str, buffer: torch.Tensor, piece_numel: int, start: int, end: int) -> MomentView:
    """The view of elements [start, end) (relative to the piece) of the moment buffer of a piece
    of `piece_numel` elements (a buffer shaped as `moment_storage` says). For int8, `start` must
    be a multiple of 32 (a block's first element); the exponents are those of the blocks that
    [start, end) touches."""
    p = _precision(precision)
    numel, dtype = moment_storage(p.value, piece_numel)
    if buffer.dtype != dtype or buffer.dim() != 1 or buffer.numel() != numel:
        raise ValueError(
            f"moment_view: a {p.value} moment of {piece_numel} elements is a 1-d {str(dtype).replace('torch.', '')} "
            f"buffer of {numel} elements, got shape {tuple(buffer.shape)} of {str(buffer.dtype).replace('torch.', '')}"
        )
    if not 0 <= start <= end <= piece_numel:
        raise ValueError(f"moment_view: need 0 <= start <= end <= piece_numel ({piece_numel}), got [{start}, {end})")
    if p is not StatePrecision.INT8:
        return MomentView(buffer[start:end], None)
    if start % INT8_BLOCK:
        raise ValueError(
            f"moment_view: start {start} is not a multiple of {INT8_BLOCK}; an int8 range must begin on a block boundary"
        )
    first, last = start // INT8_BLOCK, -(-end // INT8_BLOCK)
    return MomentView(buffer[start:end], buffer[piece_numel + first : piece_numel + last])


# ---- counter-based random bits -------------------------------------------------------------


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer (mod 2^32)."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h


def rounding_key(unit: int, rank: int, step: int, seed: int = 0) -> int:
    """The rounding key of one unit's step:
    fmix32(fmix32(fmix32(fmix32(step) ^ rank) ^ unit) ^ SEED ^ seed), each input taken mod 2^32.
    `step` is the unit's Adam step count after this step; `seed` the run's
    `optimizer.rounding_seed` (0: the default stream)."""
    for name, value in (("unit", unit), ("rank", rank), ("step", step), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rounding_key: {name} must be an int >= 0, got {value!r}")
    inner = fmix32(fmix32(fmix32(step) ^ (rank & _MASK32)) ^ (unit & _MASK32))
    return fmix32(inner ^ ROUNDING_SEED ^ (seed & _MASK32))


def _mul32(h: torch.Tensor, constant: int) -> torch.Tensor:
    """h * constant mod 2^32 for h in [0, 2^32) held in int64, without overflowing int64: the
    high half of h contributes only the low 16 bits of its product."""
    low = (h & 0xFFFF) * constant
    high = ((h >> 16) * constant) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _fmix32_tensor(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(key: int, position: int, n: int, device=None) -> torch.Tensor:
    """bits(i) = fmix32(key ^ ((position + i) mod 2^32)) for i in [0, n): uint32 values in int64."""
    if position < 0:
        raise ValueError(f"random_bits: position must be >= 0, got {position}")
    index = (torch.arange(n, dtype=torch.int64, device=device) + (position & _MASK32)) & _MASK32
    return _fmix32_tensor(index ^ (key & _MASK32))


# ---- bit-level helpers ----------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of fp32 x as unsigned 32-bit values in int64."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 numbers with the given bits (unsigned 32-bit values in int64)."""
    return ((bits ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def _f32(x: float) -> float:
    """x rounded to fp32 (as the kernel rounds each scalar), as a Python float."""
    return float(np.float32(x))


def _fma(a: torch.Tensor | float, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (a fused multiply-add), exactly, on any device.

    a * b of two fp32 numbers is exact in float64; the float64 sum is made round-to-odd (its
    exact error, Knuth's two-sum, decides whether an even last bit moves one step towards it),
    and rounding a round-to-odd float64 (53 bits >= 24 + 2) to fp32 is the correct rounding.
    """
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    product = a64 * b64
    assert isinstance(product, torch.Tensor)
    c64 = c.double()
    total = product + c64
    virtual = total - product
    error = (product - (total - virtual)) + (c64 - virtual)
    bits = total.view(torch.int64)
    move = (error != 0) & ((bits & 1) == 0) & torch.isfinite(total)
    towards = torch.where((error > 0) == (total > 0), 1, -1)
    bits = torch.where(move, bits + towards, bits)
    return bits.view(torch.float64).float()


# fp32's smallest normal number: below it (and at it, where a sum just below may round to it)
# fp32 rounds at a fixed position (2^-149), not 29 bits below the float64's: `_fma_fast` takes
# those the slow way
_FP32_SMALLEST_NORMAL = 2.0**-126


def _fma_fast(a: torch.Tensor | float, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """`_fma`, in far fewer passes over memory: the same bits, by construction.

    s = a * b + c in float64 (the product is exact, the sum rounded once) is what `_fma` starts
    from; rounding s to fp32 is already the correctly rounded fma, except where s is exactly one
    of fp32's rounding boundaries (a midpoint between two fp32 numbers, or the overflow
    threshold): every boundary is a float64 number, so if s and the exact sum rounded to fp32
    differently, a boundary would lie between them, closer to the exact sum than s, which is its
    nearest float64. Those elements, and the few in fp32's subnormal range (whose boundaries sit
    elsewhere), are computed by `_fma` (round-to-odd); every other element is s rounded to fp32.
    A boundary of the normal range is the float64 whose 29 low bits (those fp32 drops) are
    exactly 1 followed by 28 zeros; a sum rounded to at most fp32's smallest normal number in
    magnitude (zeros too, which are exact) goes the slow way."""
    if isinstance(a, torch.Tensor):
        s = a.double().mul_(b)
    else:
        assert isinstance(b, torch.Tensor)  # one of a, b is the elements' tensor
        s = b.double().mul_(a)
    s.add_(c)
    suspect = (s.view(torch.int64) & 0x1FFFFFFF) == 0x10000000
    rounded = s.float()
    suspect |= rounded.abs() <= _FP32_SMALLEST_NORMAL
    index = suspect.nonzero().squeeze(1)
    if index.numel():

        def pick(t):
            return t[index] if isinstance(t, torch.Tensor) else t

        rounded[index] = _fma(pick(a), pick(b), pick(c))
    return rounded


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (torch's CPU sqrt is within an ulp, not exact; a
    float64 square root rounded to fp32 is)."""
    return x.double().sqrt().float()


# ---- bf16 -----------------------------------------------------------------------------------

_BF16_SUM_LIMIT = 0x7F7FFFFF  # the largest finite bf16's bits, with every dropped bit set


def _encode_bf16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """bf16 bits of x rounded with r (< 2^16) added below the kept half. A finite x saturates at
    the largest finite bf16 (its magnitude's sum limited to 0x7F7FFFFF) instead of rounding to
    infinity; infinities stay, NaN is 0x7FC0 (adam_kernels.h, encode_bf16)."""
    u = _bits(x)
    magnitude = u & 0x7FFFFFFF
    h = (torch.minimum(magnitude + r, torch.clamp(magnitude, min=_BF16_SUM_LIMIT)) | (u & 0x80000000)) >> 16
    h = torch.where(torch.isnan(x), 0x7FC0, h)
    return ((h ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


# ---- int8 -----------------------------------------------------------------------------------


# exp_avg's magnitude codes (E3M4T, docs/compact_state.md): 0 is zero; 1..14 the tail, the
# powers of two 2^(c - 22) = float((c + 105) << 23), from 2^-21 to 2^-8; 15..127 E3M4,
# float((c + 1905) << 19), from 2^-7 to 1.0 (code 127). Bit 7 of a code is the sign.
_M_TAIL_BASE = 105
_M_NORMAL_BASE = 1905
_M_FIRST_NORMAL = 15
_M_FLOOR = 2.0**-21  # the smallest nonzero code; below it a value rounds between 0 and it
_M_TOP = 127
# exp_avg_sq's root (E4M4): codes 16..255 float((c + 1792) << 19) from 2^-14 to 1.0 (code 240),
# below them the subnormal steps c * 2^-18 = float((c + 1808) << 19) - 2^-14
_ROOT_SUBNORMAL_BASE = 1808
_ROOT_NORMAL_BASE = 1792
_ROOT_SUBNORMAL_END = 2.0**-14
_ROOT_TOP = 255
# in the block of exponent 191 (roots in [2^63, 2^64)) code 240 is 2^64, whose square overflows:
# a v there saturates at code 239, (31/16) 2^63 (adam_kernels.h, root_code_limit)
_ROOT_OVERFLOW_EXPONENT = 191
_ROOT_TOP_BELOW_OVERFLOW = 239


def _block_exponents(magnitude_bits: torch.Tensor, reload: bool) -> torch.Tensor:
    """Block exponent bytes (int64) from the magnitudes' bits (int64), zero-padded to whole blocks."""
    largest = magnitude_bits.view(-1, INT8_BLOCK).amax(dim=1)
    if reload:
        # an exact power of two 2^k as the largest magnitude takes k's exponent (y = 1)
        e = torch.clamp((largest + 0x7FFFFF) >> 23, max=253)
    else:
        e = torch.clamp((largest >> 23) + 1, max=253)
    e = torch.where(largest == 0, 0, e)
    return torch.where(largest >= 0x7F800000, 255, e)


def _first_moment_position(y: torch.Tensor) -> torch.Tensor:
    """Where y (|x| in units of its block's scale, fp32) falls among exp_avg's magnitude codes, as
    code << 19 | the dropped bits: the larger of the E3M4 position bits(y) - 1905 << 19 and the
    tail's (bits(t) >> 4) - 105 << 19 with t = max(y, (y + 2^-21) / 2). The first is the larger
    from 2^-7 on, the second below; halving y + 2^-21 below the floor maps [0, 2^-21) linearly
    onto the binade under it, one code below code 1 (adam_kernels.h, e3m4t_position)."""
    tail = torch.maximum(y, (y + _M_FLOOR) * 0.5)
    return torch.maximum(_bits(y) - (_M_NORMAL_BASE << 19), (_bits(tail) >> 4) - (_M_TAIL_BASE << 19))


def _root_position(root: torch.Tensor) -> torch.Tensor:
    """Where a root (in units of its block's scale) falls among the E4M4 codes, code << 19 | the
    dropped bits: from the subnormal end on bits(root) - 1792 << 19, below bits(root + 2^-14)
    (an fp32 add) - 1808 << 19."""
    return torch.where(
        root < _ROOT_SUBNORMAL_END,
        _bits(root + _ROOT_SUBNORMAL_END) - (_ROOT_SUBNORMAL_BASE << 19),
        _bits(root) - (_ROOT_NORMAL_BASE << 19),
    )


def _encode_int8(x: torch.Tensor, r: torch.Tensor, kind: str, reload: bool):
    """(codes uint8 n, exponents uint8 ceil(n/32)) of fp32 x (exp_avg: the moment; exp_avg_sq:
    its root), with the random words' bits r (int64)."""
    n = x.numel()
    blocks = -(-n // INT8_BLOCK)
    u = _bits(x)
    magnitude = u & 0x7FFFFFFF
    padded = torch.nn.functional.pad(magnitude, (0, blocks * INT8_BLOCK - n))
    e = _block_exponents(padded, reload)
    inverse = _float(torch.clamp(254 - e, min=0) << 23)
    y = x.abs() * inverse.repeat_interleave(INT8_BLOCK)[:n]
    if kind == "exp_avg":
        # x unbiased, and its sign
        c = torch.clamp((_first_moment_position(y) + r) >> 19, max=_M_TOP) | ((u >> 31) << 7)
    else:
        # x^2 unbiased; a root above zero never rounds to code 0: a zero second moment under a
        # nonzero first one would step by m / eps (docs/compact_state.md)
        position = _root_position(y)
        limit = torch.where(e == _ROOT_OVERFLOW_EXPONENT, _ROOT_TOP_BELOW_OVERFLOW, _ROOT_TOP).repeat_interleave(INT8_BLOCK)[:n]
        c = torch.minimum((position >> 19) + _root_rounds_up(position, r), limit)
        c = torch.maximum(c, (u > 0).to(c.dtype))
    c = torch.where((e == 255).repeat_interleave(INT8_BLOCK)[:n], 0, c)
    return c.to(torch.uint8), e.to(torch.uint8)


def _root_rounds_up(position: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """1 where a root at `position` (code << 19 | F) rounds up so that its square comes back
    unbiased: with probability (x^2 - lo^2) / (hi^2 - lo^2) = f - f (1 - f) / (2L + 1), f = F / 2^19
    and L = lo / (hi - lo) = min(code, 16 + code % 16) (codes below 16 are the subnormal steps
    code * 2^-18, a normal binade's (16 + m) / 16 of its power of two). In 32-bit integers:
    up iff (2L + 1) (F - r) > F - ((F >> 3)^2 >> 13) (adam_kernels.h, root_rounds_up)."""
    c = position >> 19
    fraction = position & 0x7FFFF
    odd = 2 * torch.minimum(c, 16 + (c & 15)) + 1
    high = fraction >> 3
    gap = fraction - ((high * high) >> 13)
    return (odd * (fraction - r) > gap).to(position.dtype)


def _decode_int8(codes: torch.Tensor, exponents: torch.Tensor, kind: str):
    n = codes.numel()
    c = codes.to(torch.int64)
    sign = None
    if kind == "exp_avg":
        sign = c >> 7
        c = c & 127
        tail = _float((c + _M_TAIL_BASE) << 23)
        value = torch.where(c < _M_FIRST_NORMAL, tail, _float((c + _M_NORMAL_BASE) << 19))
        value = torch.where(c == 0, 0.0, value)
    else:
        normal = c >= 16
        value = _float(torch.where(normal, c + _ROOT_NORMAL_BASE, c + _ROOT_SUBNORMAL_BASE) << 19)
        value = torch.where(normal, value, value - _ROOT_SUBNORMAL_END)
    e = exponents.to(torch.int64)
    scale = torch.where(e == 255, math.nan, _float(e << 23))
    x = value * scale.repeat_interleave(INT8_BLOCK)[:n]
    if sign is not None:
        x = torch.where(sign == 1, -x, x)
    return x


def _check_view(op: str, name: str, precision: StatePrecision, view: MomentView, n: int | None = None) -> int:
    if not isinstance(view, MomentView):
        raise TypeError(f"{op}: {name} must be a MomentView (moments.moment_view builds one), got {type(view).__name__}")
    values, exponents = view
    expected = {StatePrecision.FP32: torch.float32, StatePrecision.BF16: torch.bfloat16, StatePrecision.INT8: torch.uint8}
    if values.dtype != expected[precision]:
        raise TypeError(
            f"{op}: {name}.values of a {precision.value} moment must be {str(expected[precision]).replace('torch.', '')}, "
            f"got {str(values.dtype).replace('torch.', '')}"
        )
    count = values.numel()
    if n is not None and count != n:
        raise ValueError(f"{op}: {name} has {count} elements but param has {n}")
    if precision is StatePrecision.INT8:
        blocks = -(-count // INT8_BLOCK)
        if exponents is None or exponents.dtype != torch.uint8 or exponents.numel() != blocks:
            got = "None" if exponents is None else f"{exponents.numel()} of {str(exponents.dtype).replace('torch.', '')}"
            raise ValueError(f"{op}: {name}.block_exponents of {count} int8 elements must be {blocks} uint8, got {got}")
    elif exponents is not None:
        raise ValueError(f"{op}: {name}.block_exponents must be None for a {precision.value} moment")
    return count


def decode(precision: str, kind: str, view: MomentView, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of a stored moment (int8 exp_avg_sq: the stored root, squared). Exact:
    every stored value is an fp32 number. Written into `out` (fp32, same numel) when given."""
    p = _precision(precision)
    _check_kind(kind)
    n = _check_view("decode", kind, p, view)
    if p is StatePrecision.FP32:
        x = view.values
    elif p is StatePrecision.BF16:
        x = view.values.float()
    elif n == 0:
        x = torch.zeros(0, device=view.values.device)
    else:
        exponents = view.block_exponents
        assert exponents is not None  # checked above
        if kind == "exp_avg":
            x = _decode_int8(view.values.reshape(-1), exponents, "exp_avg")
        else:
            root = _decode_int8(view.values.reshape(-1), exponents, "exp_avg_sq")
            x = root * root
    x = x.reshape(view.values.shape)
    if out is None:
        return x if x is not view.values else x.clone()
    out.copy_(x.reshape(out.shape))
    return out


def encode(
    precision: str,
    kind: str,
    values: torch.Tensor,
    view: MomentView,
    *,
    position: int,
    key: int,
    root: bool = False,
    reload: bool = False,
) -> None:
    """Store fp32 `values` (same numel) into `view`, rounding stochastically with the random
    words of elements [position, position + n) under `key` (for int8, `position` is a multiple
    of 32 and the view's blocks start at its first element).

    exp_avg_sq: `values` is v; int8 stores sqrt(v) (correctly rounded), its code rounded so
    that the decoded v = root^2 is unbiased. `root=True` says `values` already is that root
    (the step passes the root it computed).

    `reload=True` is for values read back from a checkpoint (fp32 values an encode decoded
    before): a block whose largest magnitude is exactly a power of two 2^k takes the exponent
    with k's binade at y = 1 (code 112 / 240) instead of the next one. Those values then
    re-encode to themselves, which the step's rule does not guarantee: a block maximum rounded
    up to 1.0 * scale would move the block to the next exponent and lose the last bit of its
    smallest codes. Values that decode exactly are not rounded (their random bits add below
    the kept bits), so `position` and `key` matter only for values that are not representable.
    """
    p = _precision(precision)
    _check_kind(kind)
    n = _check_view("encode", kind, p, view)
    if values.numel() != n:
        raise ValueError(f"encode: values has {values.numel()} elements but the view holds {n}")
    if values.dtype != torch.float32:
        raise TypeError(f"encode: values must be float32, got {str(values.dtype).replace('torch.', '')}")
    if p is StatePrecision.INT8 and position % INT8_BLOCK:
        raise ValueError(f"encode: position {position} is not a multiple of {INT8_BLOCK} (an int8 range starts on a block)")
    x = values.reshape(-1)
    if p is StatePrecision.FP32:
        view.values.copy_(x.reshape(view.values.shape))
        return
    if n == 0:
        return
    bits = random_bits(key, position, n, x.device)
    if p is StatePrecision.BF16:
        r = bits & 0xFFFF if kind == "exp_avg" else bits >> 16
        view.values.copy_(_encode_bf16(x, r).reshape(view.values.shape))
        return
    assert view.block_exponents is not None
    if kind == "exp_avg":
        codes, exponents = _encode_int8(x, bits & 0x7FFFF, "exp_avg", reload=reload)
    else:
        codes, exponents = _encode_int8(x if root else _sqrt(x), bits >> 13, "exp_avg_sq", reload=reload)
    view.values.copy_(codes.reshape(view.values.shape))
    view.block_exponents.copy_(exponents.reshape(view.block_exponents.shape))


# ---- the step -------------------------------------------------------------------------------


class _Scalars(NamedTuple):
    """AdamW's scalars for one step, each rounded to fp32 once (kernels.adam_step's rounding)."""

    grad_scale: float
    apply_scale: bool
    weight_decay: float
    l2_decay: bool
    decay_factor: float
    decoupled_decay: bool
    lerp_small: bool
    lerp_coeff: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float  # the fp32 step divides sqrt(v') by it
    bias_correction2_rsqrt: float  # a compact step multiplies sqrt(v') by it
    divide_bc2: bool  # the factor of the fp32 step != 1 (x / 1 == x: skipped)
    multiply_bc2: bool  # that of a compact step != 1
    eps: float
    neg_step_size: float


def _scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale) -> _Scalars:
    lr = float(lr)
    weight_decay = float(weight_decay)
    # the same Python expressions as kernels.adam_step (torch/optim/adam.py::_single_tensor_adam)
    if bias_correction:
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
    else:
        bias_correction1 = bias_correction2 = 1.0
    step_size = lr / bias_correction1
    beta1_weight = _f32(1 - beta1)
    bc2_sqrt = _f32(bias_correction2**0.5)
    bc2_rsqrt = _f32(1 / bias_correction2**0.5)
    lerp_small = abs(beta1_weight) < 0.5
    return _Scalars(
        grad_scale=_f32(grad_scale),
        apply_scale=float(grad_scale) != 1.0,
        weight_decay=_f32(weight_decay),
        l2_decay=(not adamw_mode) and weight_decay != 0,
        decay_factor=_f32(1 - lr * weight_decay),
        decoupled_decay=bool(adamw_mode) and weight_decay != 0,
        lerp_small=lerp_small,
        lerp_coeff=beta1_weight if lerp_small else _f32(beta1_weight - 1.0),
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1 - beta2),
        bias_correction2_sqrt=bc2_sqrt,
        bias_correction2_rsqrt=bc2_rsqrt,
        divide_bc2=bc2_sqrt != 1.0,
        multiply_bc2=bc2_rsqrt != 1.0,
        eps=_f32(eps),
        neg_step_size=_f32(-step_size),
    )


def _check_step(step, lr, beta1, beta2, eps, weight_decay) -> None:
    op = "adam_step_torch"
    if float(step) < 1:
        raise ValueError(f"{op}: step must be >= 1 (the step number after this update), got {step}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not float(value) >= 0.0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")


def adam_step_torch(
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
    """One Adam / AdamW step on stored moments, on any device: decode, the fp32 kernel's
    arithmetic (kernels.adam_step, operation for operation; a compact precision multiplies by
    the inverse bias correction of the second moment instead of dividing), encode. Bit for bit what
    kernels.adam_step_compact computes on the CPU (and, for fp32, kernels.adam_step).

    param: fp32 master weights; grad: fp32, bf16 or fp16; the moments: views of `precision`
    ("fp32", "bf16", "int8"), all over the same n elements, which are elements
    [position, position + n) of the unit's shard (for int8 position is a multiple of 32).
    `rounding_key` is `rounding_key(unit, rank, step)`; `step` the step number after this
    update. param_out16 (bf16 or fp16) receives the 16-bit copy of the new weights when given.
    state_out = (param_out, exp_avg_out, exp_avg_sq_out) writes the new state there instead of
    in place (the inputs are then only read).
    """
    p_ = _precision(precision)
    op = "adam_step_torch"
    n = param.numel()
    _check_view(op, "exp_avg", p_, exp_avg, n)
    _check_view(op, "exp_avg_sq", p_, exp_avg_sq, n)
    if param.dtype != torch.float32:
        raise TypeError(f"{op}: param must be float32, got {str(param.dtype).replace('torch.', '')}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16) or grad.numel() != n:
        raise ValueError(f"{op}: grad must be fp32, bf16 or fp16 with {n} elements, got {grad.dtype} with {grad.numel()}")
    if p_ is StatePrecision.INT8 and position % INT8_BLOCK:
        raise ValueError(f"{op}: position {position} is not a multiple of {INT8_BLOCK} (an int8 range starts on a block)")
    _check_step(step, lr, beta1, beta2, eps, weight_decay)
    if state_out is None:
        param_out, m_out, v_out = param, exp_avg, exp_avg_sq
    else:
        param_out, m_out, v_out = state_out
        _check_view(op, "state_out[1]", p_, m_out, n)
        _check_view(op, "state_out[2]", p_, v_out, n)
    if n == 0:
        return
    s = _scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale)
    m = decode(p_.value, "exp_avg", exp_avg).reshape(-1)
    v = decode(p_.value, "exp_avg_sq", exp_avg_sq).reshape(-1)
    g = grad.reshape(-1).float()
    p = param.reshape(-1)
    if s.apply_scale:
        g = g * s.grad_scale
    if s.l2_decay:
        g = _fma_fast(p, s.weight_decay, g)  # grad.add(param, alpha=weight_decay)
    if s.decoupled_decay:
        p = p * s.decay_factor  # param.mul_(1 - lr * weight_decay)
    m = _fma_fast(s.lerp_coeff, g - m, m if s.lerp_small else g)  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * s.beta2  # exp_avg_sq.mul_(beta2)
    v = _fma_fast(g * s.one_minus_beta2, g, v)  # .addcmul_(grad, grad, value=1 - beta2)
    root = _sqrt(v)
    if p_ is StatePrecision.FP32:
        denom = (root / s.bias_correction2_sqrt if s.divide_bc2 else root) + s.eps
    else:  # one division fewer per element (docs/compact_state.md)
        denom = (root * s.bias_correction2_rsqrt if s.multiply_bc2 else root) + s.eps
    m_step = m
    if p_ is StatePrecision.INT8:
        # |m'| taken as at most B_t sqrt(v'), AdamW's own bound (adam_bound); where the limit
        # is NaN (a NaN v', whose step is NaN anyway) |m'| is kept
        limit = root * step_limit_factor(int(step), float(beta1), float(beta2))
        magnitude = torch.where(limit < m.abs(), limit, m.abs())
        m_step = _float(_bits(magnitude) | (_bits(m) & 0x80000000))
    p = p + (m_step * s.neg_step_size) / denom  # param.addcdiv_(exp_avg, denom, value=-step_size)
    param_out.copy_(p.reshape(param_out.shape))
    encode(p_.value, "exp_avg", m, m_out, position=position, key=rounding_key)
    if p_ is StatePrecision.INT8:
        encode(p_.value, "exp_avg_sq", root, v_out, position=position, key=rounding_key, root=True)
    else:
        encode(p_.value, "exp_avg_sq", v, v_out, position=position, key=rounding_key)
    if param_out16 is not None:
        param_out16.copy_(p.to(param_out16.dtype).reshape(param_out16.shape))
