"""Compact Adam state (docs/compact_state.md): the formats and the step in torch
(offload.optim.moments), and the C++ kernel (kernels.adam_step_compact) against them bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config.state_layout import INT8_BLOCK, int8_moment_bytes
from offload.errors import OffloadError
from offload.optim import kernels
from offload.optim import moments as M

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The torch reference runs many small elementwise operations: on a shared two-core machine
    torch's spinning OpenMP workers made them (and the kernel between them) 5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def views(precision, n, device="cpu"):
    """Zeroed exp_avg and exp_avg_sq views of n elements (each its own piece buffer)."""
    numel, dtype = M.moment_storage(precision, n)
    return tuple(M.moment_view(precision, torch.zeros(numel, dtype=dtype, device=device), n, 0, n) for _ in range(2))


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that any NaN equals any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    same = int_bits(actual) == int_bits(expected)
    if actual.is_floating_point():
        same |= actual.isnan() & expected.isnan()
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {actual.numel()} differ; first at {i}: {actual[i].item()!r} vs {expected[i].item()!r}"
        )


# ---- random bits ----------------------------------------------------------------------------


def fmix32_numpy(h: np.ndarray) -> np.ndarray:
    """An independent fmix32 in uint32 arithmetic (wraps mod 2^32 by itself)."""
    h = h.astype(np.uint32)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def test_hash_values_are_pinned():
    # MurmurHash3's finalizer: fmix32(1) is its published 0x514E28B7
    assert [M.fmix32(x) for x in (0, 1, 2, 0xFFFFFFFF, 0x12345678)] == [0, 0x514E28B7, 0x30F4C306, 0x81F16F39, 0xE37CD1BC]
    assert M.rounding_key(0, 0, 1) == 0xCD7AD63D
    assert M.rounding_key(3, 1, 7) == 0x1E66B2F0
    assert M.rounding_key(2**32 + 3, 1, 7) == 0x1E66B2F0  # inputs taken mod 2^32
    assert M.rounding_key(123456, 7, 100000) == 0xDA2354AF
    # positions wrap mod 2^32
    assert M.random_bits(0xDEADBEEF, 2**32 - 2, 4).tolist() == [0x182E95FB, 0xFB58C23C, 0x0DE5C6A9, 0xDD6A89D7]
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        M.rounding_key(0, 0, -1)


def test_random_bits_equal_an_independent_fmix32():
    key = M.rounding_key(5, 2, 11)
    position = 2**32 - 1000
    got = M.random_bits(key, position, 5000).numpy()
    index = (np.arange(5000, dtype=np.uint64) + position) % 2**32
    expected = fmix32_numpy((index ^ key).astype(np.uint32))
    assert (got == expected.astype(np.int64)).all()
    # a range at an offset is the same words as the middle of a longer range
    assert torch.equal(M.random_bits(key, 77, 100), M.random_bits(key, 0, 177)[77:])


# ---- storage and views ----------------------------------------------------------------------


def test_storage_and_views():
    assert M.moment_storage("fp32", 70) == (70, torch.float32)
    assert M.moment_storage("bf16", 70) == (70, torch.bfloat16)
    assert M.moment_storage("int8", 70) == (int8_moment_bytes(70), torch.uint8) == (73, torch.uint8)
    buffer = torch.arange(73, dtype=torch.uint8)
    view = M.moment_view("int8", buffer, 70, 32, 70)
    assert view.values.tolist() == list(range(32, 70)) and view.block_exponents.tolist() == [71, 72]
    assert view.values.data_ptr() == buffer.data_ptr() + 32  # views, not copies
    view = M.moment_view("int8", buffer, 70, 0, 33)
    assert view.values.numel() == 33 and view.block_exponents.tolist() == [70, 71]
    assert M.moment_view("int8", buffer, 70, 64, 64).block_exponents.numel() == 0
    with pytest.raises(ValueError, match="start 16 is not a multiple of 32"):
        M.moment_view("int8", buffer, 70, 16, 70)
    with pytest.raises(ValueError, match="buffer of 73 elements"):
        M.moment_view("int8", buffer[:72], 70, 0, 70)
    fp32 = torch.zeros(10)
    view = M.moment_view("fp32", fp32, 10, 3, 7)
    assert view.block_exponents is None and view.values.data_ptr() == fp32.data_ptr() + 12
    with pytest.raises(ValueError, match="state precision must be one of"):
        M.moment_storage("fp8", 4)


# ---- formats --------------------------------------------------------------------------------


def encoded(precision, kind, x, *, position=0, key=1, reload=False, root=False):
    (view, _) = views(precision, x.numel())
    M.encode(precision, kind, x, view, position=position, key=key, reload=reload, root=root)
    return view


def roundtrip(precision, kind, x, **kw):
    return M.decode(precision, kind, encoded(precision, kind, x, **kw))


def int8_values(kind: str, seed: int, blocks: int, top: int) -> torch.Tensor:
    """Decoded int8 values: random codes with magnitudes up to `top`, random exponents, one
    NaN block (255) and one zero block (0). exp_avg: exponents 1..252 (all); exp_avg_sq:
    90..190, where v = root * root is a normal fp32 number (the range a step's v has: roots
    of at most sqrt(fp32 max) < 2^64; v below 2^-126 would lose bits to fp32 subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    n = blocks * INT8_BLOCK
    codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64)
    magnitude = codes & 127 if kind == "exp_avg" else codes
    codes = torch.where(magnitude > top, codes - magnitude + top, codes)
    low, high = (1, 253) if kind == "exp_avg" else (90, 191)
    exponents = torch.randint(low, high, (blocks,), generator=gen, dtype=torch.int64)
    for block, e in ((3, 255), (5, 0)):
        exponents[block] = e
        codes[block * INT8_BLOCK : (block + 1) * INT8_BLOCK] = 0
    return M.decode("int8", kind, M.MomentView(codes.to(torch.uint8), exponents.to(torch.uint8)))


def test_int8_code_values_follow_the_doc():
    # every code's value by the formula in docs/compact_state.md, computed in double
    for kind, top in (("exp_avg", 128), ("exp_avg_sq", 256)):
        codes = torch.arange(top, dtype=torch.uint8)
        values = M.decode("int8", kind, M.MomentView(codes, torch.full((top // 32,), 127, dtype=torch.uint8)))
        if kind == "exp_avg_sq":
            values = values.sqrt()
        for c in range(top):
            if kind == "exp_avg":  # E3M4T: zero, the tail 2^(c - 22) (codes 1..14), E3M4 from 2^-7
                tail = 2.0 ** (c - 22) if c else 0.0
                expected = tail if c < 15 else (1 + ((c - 15) & 15) / 16) * 2.0 ** (((c - 15) >> 4) - 7)
            else:  # E4M4, subnormal below code 16
                expected = (1 + (c & 15) / 16) * 2.0 ** ((c >> 4) - 15) if c >= 16 else c * 2.0**-18
            assert values[c].item() == expected, (kind, c)
        assert values[top - 1 if kind == "exp_avg" else 240].item() == 1.0
    values = M.decode(
        "int8", "exp_avg", M.MomentView(torch.arange(128, dtype=torch.uint8), torch.full((4,), 127, dtype=torch.uint8))
    )
    assert values[1].item() == 2.0**-21 and values[14].item() == 2.0**-8 and values[15].item() == 2.0**-7
    # bit 7 of an exp_avg code is the sign (-0.0 included)
    negative = M.decode(
        "int8",
        "exp_avg",
        M.MomentView(torch.tensor([0x80 | 127, 0x80], dtype=torch.uint8), torch.tensor([130], dtype=torch.uint8)),
    )
    assert negative[0].item() == -8.0 and int_bits(negative)[1].item() == int_bits(torch.tensor(-0.0)).item()


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_bf16_decode_of_encode_is_the_identity_on_bf16_values(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * torch.exp2(torch.randint(-140, 120, (10_000,), generator=gen).float())
    if kind == "exp_avg_sq":
        x = x.abs()
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, -3e-39, 3.3895e38])]).bfloat16().float()
    for key in (0, 1, 0xFFFFFFFF):
        assert_same(roundtrip("bf16", kind, x, key=key, position=123), x, f"bf16 {kind} round trip")
    nan = encoded("bf16", kind, torch.tensor([math.nan, -math.nan]))
    assert int_bits(nan.values).tolist() == [0x7FC0, 0x7FC0]


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_int8_decode_of_encode_is_the_identity_on_decoded_values(kind):
    # reload=True: on every decoded value (block magnitudes up to 1.0 * scale: y <= 1), which
    # is what makes a checkpoint of decoded fp32 moments resume bitwise. The step's rule: on
    # blocks whose largest magnitude is below 1.0 * scale (the next test has the exception).
    one = 112 if kind == "exp_avg" else 240
    for reload, top in ((True, one), (False, one - 1)):
        x = int8_values(kind, seed=1, blocks=400, top=top)
        for key in (0, 1, 0xFFFFFFFF):
            view = encoded("int8", kind, x, key=key, position=32 * 5, reload=reload)
            assert_same(M.decode("int8", kind, view), x, f"int8 {kind} round trip, reload={reload}")
            assert view.block_exponents[3].item() == 255 and view.block_exponents[5].item() == 0


def test_the_steps_int8_rule_is_not_idempotent_and_reload_is():
    # docs/compact_state.md: e = A + 1 from the block's largest magnitude. A largest value that
    # an encode rounded up to exactly 1.0 * scale re-encodes one exponent higher, where the
    # block's smallest odd code is not representable. reload=True (the rule for values read
    # back from a checkpoint) keeps the exponent and the values.
    scale = 2.0**-3  # exponent byte 124
    x = torch.zeros(32)
    x[0] = 1.0 * scale  # code 127: what y = 0.99 rounded up to
    x[1] = 17 / 16 * 2.0**-7 * scale  # code 16, E3M4's lowest binade: one binade down it is in the tail
    view = M.MomentView(torch.tensor([127, 16] + [0] * 30, dtype=torch.uint8), torch.tensor([124], dtype=torch.uint8))
    assert_same(M.decode("int8", "exp_avg", view), x, "the block")
    moved = encoded("int8", "exp_avg", x)
    assert moved.block_exponents.item() == 125
    assert M.decode("int8", "exp_avg", moved)[1].item() != x[1].item()  # between two powers of two at the coarser scale
    kept = encoded("int8", "exp_avg", x, reload=True)
    assert kept.block_exponents.item() == 124
    assert_same(M.decode("int8", "exp_avg", kept), x, "reload")


def test_int8_special_blocks():
    x = torch.zeros(5 * 32)
    x[32:64] = torch.linspace(-1, 1, 32)
    x[40] = math.nan  # block 1: NaN
    x[64:96] = torch.linspace(0, 1, 32)
    x[70] = math.inf  # block 2: inf
    x[96] = -0.0  # block 3: zeros (one negative)
    x[128:160] = torch.linspace(1e-42, 1e-40, 32)  # block 4: subnormal fp32
    view = encoded("int8", "exp_avg", x)
    assert view.block_exponents.tolist()[:4] == [0, 255, 255, 0]
    assert view.values[32:96].eq(0).all(), "a non-finite block's codes are 0"
    assert view.values[96].item() == 0x80 and view.values[97:128].eq(0).all()
    back = M.decode("int8", "exp_avg", view)
    assert back[32:96].isnan().all() and back[96:128].eq(0).all() and back[:32].eq(0).all()
    assert int_bits(back[96:97]).item() == int_bits(torch.tensor([-0.0])).item()
    assert view.block_exponents[4].item() == 1  # subnormal: scale 2^-126
    # within one code of x: 1/16 of it in E3M4's range (from 2^-7 of the scale), the power of two
    # below it in the tail, the floor 2^-21 * scale below that
    magnitude = x[128:160].abs()
    spacing = torch.clamp(torch.where(magnitude >= 2.0**-133, magnitude / 16, magnitude), min=2.0**-147)
    assert ((back[128:160] - x[128:160]).abs() <= spacing).all()
    # an exp_avg_sq block holding v = inf or NaN decodes NaN; zeros stay zero
    v = torch.tensor([0.0] * 32 + [1.0] * 31 + [math.inf])
    back = roundtrip("int8", "exp_avg_sq", v)
    assert back[:32].eq(0).all() and back[32:].isnan().all()


def test_int8_partial_last_block_touches_nothing_beyond_its_range():
    n, piece = 70, 96
    buffer = torch.full((int8_moment_bytes(piece),), 0xAB, dtype=torch.uint8)
    view = M.moment_view("int8", buffer, piece, 0, n)
    x = torch.linspace(-1, 1, n)
    M.encode("int8", "exp_avg", x, view, position=0, key=3)
    assert buffer[n:piece].eq(0xAB).all() and buffer[piece + 3 :].eq(0xAB).all()
    assert ((M.decode("int8", "exp_avg", view) - x).abs() <= x.abs() / 8 + 2.0**-17).all()
    # the last block's exponent comes from its own 6 elements
    small = torch.cat([torch.ones(64), torch.full((6,), 1e-3)])
    assert encoded("int8", "exp_avg", small).block_exponents[2].item() == (int_bits(torch.tensor(1e-3)).item() >> 23) + 1


@pytest.mark.parametrize(
    "precision,kind", [("bf16", "exp_avg"), ("bf16", "exp_avg_sq"), ("int8", "exp_avg"), ("int8", "exp_avg_sq")]
)
def test_stochastic_rounding_is_unbiased(precision, kind):
    # One block of 32 values encoded at 4096 positions (one key): each value rounds to one of
    # its two neighbours, and their mean is the value within 5 standard errors (a standard
    # deviation is at most half the neighbours' distance d, bounded here by the format's
    # relative spacing plus, for int8, its subnormal spacing). Round to nearest or truncation
    # is off by up to d / 2, some 25 standard errors.
    gen = torch.Generator().manual_seed(2)
    target = torch.rand(32, generator=gen) * 0.9 + 0.05
    target[0] = 1.0  # the block's largest: int8 scale 2 (e = A + 1)
    # int8's subnormal range (a root's above its smallest code: below, it is floored, not rounded)
    target[1] = 3e-6 if kind == "exp_avg" else 3e-5
    if kind == "exp_avg":
        target[2:8] = -target[2:8]
    copies = 4096
    # the target is what is stored for bf16; int8 exp_avg_sq stores the target as a root, and
    # what comes back unbiased is its square, v
    back = roundtrip(precision, kind, target.repeat(copies), position=0, key=M.rounding_key(1, 0, 1), root=True).view(copies, 32)
    back = back.double()
    for j in range(32):
        assert back[:, j].unique().numel() <= 2, (j, back[:, j].unique())
    if precision == "bf16":
        d = target.double().abs() * 2.0**-7
    else:
        mantissa, subnormal = (4, 10) if kind == "exp_avg" else (4, 18)
        d = target.double().abs() * 2.0**-mantissa + 2.0 * 2.0**-subnormal
    expected = target.double()
    if precision == "int8" and kind == "exp_avg_sq":
        expected, d = expected**2, d * (2 * expected + d)  # hi^2 - lo^2 for roots d apart
    standard_error = d / 2 / math.sqrt(copies)
    err = (back.mean(0) - expected).abs()
    assert (err <= 5 * standard_error).all(), (err / standard_error).max()
    # and it does round: most elements take both neighbours
    assert (back.max(0).values != back.min(0).values).sum() > 16


@pytest.mark.parametrize("spread", ["normal", "subnormal"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_the_second_moment_comes_back_unbiased(precision, spread):
    # 128 stores of 16384 values with one key each (the rounding is per element and key): the
    # mean of the decoded v over the true v is 1 within 5 standard errors. "normal": v spread
    # over two binades (int8 roots in the codes' normal range). "subnormal": each block's first
    # v is 1 and the others 2^-32..2^-29, so their roots lie 2^-16..2^-14.5 of it, among int8's
    # subnormal codes 2..11 (the first is left out of the mean). int8 stores v's root: rounding
    # the root without bias would bring v back larger by the rounding's variance, +3.6e-4 (14
    # standard errors) and +1.7% (89) here
    gen = torch.Generator().manual_seed(3)
    v = torch.rand(32 * 512, generator=gen)
    if spread == "normal":
        v = v.mul(2.0).exp2().mul(1e-6)
    else:
        v = v.mul(3.0).exp2().mul(2.0**-32)
        v[::32] = 1.0
    measured = torch.ones(v.numel(), dtype=torch.bool)
    if spread == "subnormal":
        measured[::32] = False
    stores = 128
    ratios = torch.stack(
        [
            roundtrip(precision, "exp_avg_sq", v, position=0, key=M.rounding_key(1, 0, k + 1)).double()[measured]
            / v.double()[measured]
            for k in range(stores)
        ]
    )
    standard_error = ratios.std().item() / math.sqrt(ratios.numel())
    bias = ratios.mean().item() - 1.0
    assert abs(bias) <= 5 * standard_error, (bias, standard_error)


# ---- the step in torch ----------------------------------------------------------------------


# ---- the fused multiply-add, two ways --------------------------------------------------------
def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def boundary_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a * b + c whose float64 sum lands exactly on an fp32 midpoint while the exact sum does not:
    a * b = 2^-24 (1 + r 2^-47), r < 2^18, so 1 + a * b rounds in float64 to 1 + 2^-24, the midpoint
    between 1 and 1 + 2^-23, and only the exact sum says which way (up, or down for 2^-24 (1 - ...));
    with either sign of c, and c at the other end of the binade."""
    pairs = [(8390624, 16773185), (8390625, 16773183), (8390626, 16773181)]
    a = [m * 2.0**-23 for m, _ in pairs]
    b = [n * 2.0**-48 for _, n in pairs]
    rows = []
    for x, y in zip(a, b):
        for sign in (1.0, -1.0):
            rows += [(x, sign * y, sign * 1.0), (x, sign * y, sign * 1.9999998807907104), (-x, sign * y, sign * 1.0)]
    a, b, c = (torch.tensor([row[i] for row in rows], dtype=torch.float32) for i in range(3))
    return a, b, c


def test_fast_fma_takes_the_slow_way_where_the_float64_sum_is_on_a_midpoint():
    a, b, c = boundary_cases()
    exact = M._fma(a, b, c)
    assert torch.equal(fp32_bits(M._fma_fast(a, b, c)), fp32_bits(exact))
    assert not torch.equal(fp32_bits((a.double() * b.double() + c.double()).float()), fp32_bits(exact))  # the trap


fp32_values = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(fp32_values, fp32_values, fp32_values), min_size=1, max_size=64), st.booleans())
def test_fast_fma_is_the_round_to_odd_emulation_bit_for_bit(rows, scalar_a):
    """Any fp32 operands (subnormals, zeros of either sign, infinities, NaN), a as a tensor or as
    the scalar the step passes: the same bits as `_fma` (whose exactness test_compact_kernels
    checks against the C++ kernel)."""
    a, b, c = (torch.tensor([row[i] for row in rows], dtype=torch.float32) for i in range(3))
    if scalar_a:
        a_value = float(a[0])
        got, expected = M._fma_fast(a_value, b, c), M._fma(a_value, b, c)
    else:
        got, expected = M._fma_fast(a, b, c), M._fma(a, b, c)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(fp32_bits(got)[~nan], fp32_bits(expected)[~nan])


def test_fast_fma_moves_fewer_bytes():
    """The reason for it: the step's float64 emulation passes over memory less than half as much
    (counted per element by a dispatch mode, at training magnitudes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ not in ("view", "_unsafe_view", "alias", "detach", "slice"):
                tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
                Count.total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    n = 1 << 16
    gen = torch.Generator().manual_seed(0)
    g, m, v = torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen) * 1e-4, torch.rand(n, generator=gen) * 1e-7
    counts = []
    for fma in (M._fma, M._fma_fast):
        Count.total = 0
        with Count():
            fma(0.1, g - m, m)
            fma(g * 0.001, g, v)
        counts.append(Count.total / n)
    assert counts[1] < 0.5 * counts[0], counts


@pytest.mark.parametrize(
    "adamw,wd,bias_correction,grad_scale,beta1", [(True, 0.01, True, 1.0, 0.9), (False, 0.05, False, 0.37, 0.3)]
)
def test_torch_step_fp32_is_the_cpu_kernel(adamw, wd, bias_correction, grad_scale, beta1):
    gen = torch.Generator().manual_seed(4)
    n = 1003
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    out16 = torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen) * (0.1 if step % 2 else 3.0)
        hp = dict(
            step=step,
            lr=1e-2,
            beta1=beta1,
            beta2=0.999,
            eps=1e-8,
            weight_decay=wd,
            adamw_mode=adamw,
            bias_correction=bias_correction,
        )
        kernels.adam_step(p, g, m, v, grad_scale=grad_scale, **hp)
        M.adam_step_torch(
            p2,
            g,
            M.MomentView(m2),
            M.MomentView(v2),
            precision="fp32",
            position=0,
            rounding_key=0,
            grad_scale=grad_scale,
            param_out16=out16,
            **hp,
        )
    assert_same(p2, p, "param")
    assert_same(m2, m, "exp_avg")
    assert_same(v2, v, "exp_avg_sq")
    assert_same(out16, p.bfloat16(), "param_out16")


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_compact_moments_follow_fp32_adam(precision):
    # The moments are rounded, not wrong: 50 steps stay near fp32 Adam started from the same
    # (decoded) state. v starts at 0.6 of the gradients' mean square and grows by 0.07% a step
    # on average at beta2 = 0.999, less than half a bf16 step: round to nearest (tried) ends
    # 0.9% (bf16) or -3% (int8) off fp32's sum of v, stochastic rounding 0.06% and 0.15%.
    gen = torch.Generator().manual_seed(5)
    n = 2048
    p32 = torch.randn(n, generator=gen)
    p = p32.clone()
    m, v = views(precision, n)
    M.encode(precision, "exp_avg", torch.randn(n, generator=gen) * 1e-3, m, position=0, key=9)
    M.encode(precision, "exp_avg_sq", (torch.rand(n, generator=gen) + 0.5) * 2.4e-4, v, position=0, key=9)
    m32, v32 = M.decode(precision, "exp_avg", m), M.decode(precision, "exp_avg_sq", v)
    start_v = v32.sum()
    for step in range(1, 51):
        g = torch.randn(n, generator=gen) * 2e-2
        hp = dict(step=1000 + step, **HYPER)
        kernels.adam_step(p32, g, m32, v32, **hp)
        M.adam_step_torch(p, g, m, v, precision=precision, position=0, rounding_key=M.rounding_key(0, 0, step), **hp)
    mc, vc = M.decode(precision, "exp_avg", m), M.decode(precision, "exp_avg_sq", v)
    bounds = {"bf16": (0.01, 0.01, 0.03, 3e-3), "int8": (0.1, 0.2, 0.3, 1e-2)}[precision]
    assert (p - p32).abs().max() < bounds[0]  # 50 * lr = 0.5: what a wrong step moves
    assert (mc - m32).norm() / m32.norm() < bounds[1]
    assert (vc - v32).norm() / v32.norm() < bounds[2]
    assert v32.sum() / start_v > 1.02  # v grew
    assert abs(vc.sum() / v32.sum() - 1) < bounds[3]  # and so did the rounded one, as much


# ---- the C++ kernel against torch -----------------------------------------------------------

ALL_ISAS = ("avx512", "avx2", "portable")


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Runs the test once per instruction set this CPU has (others are skipped)."""
    if request.param not in kernels.available_isas():
        pytest.skip(f"CPU lacks {request.param}")
    kernels.force_isa(request.param)
    yield request.param
    kernels.force_isa(None)


@pytest.fixture
def threads():
    """Restores the kernels' thread count after a test that sets it."""
    before = kernels.get_num_threads()
    yield
    kernels.set_num_threads(before)


def state(precision, n, seed):
    """Parameters and moments of n elements after an encode of random moments."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m, v = views(precision, n)
    # magnitudes spread over 2^20 (2^30 for v) within a block: every int8 code range is used
    spread_m = torch.exp2(-20 * torch.rand(n, generator=gen))
    spread_v = torch.exp2(-30 * torch.rand(n, generator=gen))
    M.encode(precision, "exp_avg", torch.randn(n, generator=gen) * 1e-3 * spread_m, m, position=0, key=seed)
    M.encode(precision, "exp_avg_sq", torch.rand(n, generator=gen) * 1e-6 * spread_v, v, position=0, key=seed)
    return p, m, v, gen


def copy_view(view):
    return M.MomentView(view.values.clone(), None if view.block_exponents is None else view.block_exponents.clone())


def assert_state_same(a, b, what):
    (pa, ma, va), (pb, mb, vb) = a, b
    assert_same(pa, pb, f"{what}: param")
    for name, x, y in (("exp_avg", ma, mb), ("exp_avg_sq", va, vb)):
        assert_same(x.values, y.values, f"{what}: {name} values")
        if x.block_exponents is not None:
            assert_same(x.block_exponents, y.block_exponents, f"{what}: {name} block exponents")


# (n, grad dtype, param_out16 dtype, hyperparameters): partial vectors and blocks, every
# gradient dtype, both 16-bit copies, Adam and AdamW, both lerp branches, bias correction off,
# a gradient scale; 70_001 elements run on the thread pool (two chunks)
CASES = [
    (1, torch.float32, None, dict(HYPER)),
    (33, torch.bfloat16, torch.bfloat16, dict(HYPER, beta1=0.3, adamw_mode=False, weight_decay=0.05)),
    (4099, torch.float16, torch.float16, dict(HYPER, bias_correction=False, grad_scale=0.37)),
    (70_001, torch.bfloat16, torch.bfloat16, dict(HYPER)),
]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("n,grad_dtype,out_dtype,hyper", CASES, ids=[str(c[0]) for c in CASES])
def test_kernel_equals_torch_bit_for_bit(isa, precision, n, grad_dtype, out_dtype, hyper):
    p, m, v, gen = state(precision, n, seed=n)
    ref = (p.clone(), copy_view(m), copy_view(v))
    out16 = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    ref16 = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    before = p.clone()
    for step in range(1, 4):
        g = (torch.randn(n, generator=gen) * 10.0 ** (-step)).to(grad_dtype)
        common = dict(precision=precision, position=96, rounding_key=M.rounding_key(7, 1, step), step=step, **hyper)
        kernels.adam_step_compact(p, g, m, v, param_out16=out16, **common)
        M.adam_step_torch(*ref[:1], g, *ref[1:], param_out16=ref16, **common)
        assert_state_same((p, m, v), ref, f"{isa} {precision} step {step}")
        if out16 is not None:
            assert_same(out16, ref16, "param_out16")
    assert not torch.equal(p, before)


def test_results_do_not_depend_on_the_thread_count(threads):
    n = 140_001  # three chunks of the pool; a partial last block
    results = []
    for count in (1, 2):
        kernels.set_num_threads(count)
        for precision in ("bf16", "int8"):
            p, m, v, gen = state(precision, n, seed=3)
            g = torch.randn(n, generator=gen).bfloat16()
            kernels.adam_step_compact(p, g, m, v, precision=precision, position=0, rounding_key=5, step=1, **HYPER)
            results.append((p, m, v))
    assert_state_same(results[0], results[2], "bf16, 1 vs 2 threads")
    assert_state_same(results[1], results[3], "int8, 1 vs 2 threads")


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_range_split_on_a_block_is_the_same_step(precision):
    # a call over [0, n) equals calls over [0, k) and [k, n) of the same piece (k a multiple
    # of 32, position offset by k): the random bits depend only on the position
    n, k, base = 1000, 320, 64
    p, m, v, gen = state(precision, n, seed=11)
    buffers = [view_buffer(precision, x, n) for x in (m, v)]
    g = torch.randn(n, generator=gen)
    whole = (p.clone(), *[M.moment_view(precision, b.clone(), n, 0, n) for b in buffers])
    hp = dict(precision=precision, rounding_key=99, step=2, **HYPER)
    kernels.adam_step_compact(whole[0], g, whole[1], whole[2], position=base, **hp)
    for start, end in ((0, k), (k, n)):
        pieces = [M.moment_view(precision, b, n, start, end) for b in buffers]
        kernels.adam_step_compact(p[start:end], g[start:end], *pieces, position=base + start, **hp)
    assert_state_same((p, m, v), whole, "split")


def view_buffer(precision, view, n):
    """The piece buffer a whole-piece view (from views()) lies in."""
    numel, dtype = M.moment_storage(precision, n)
    buffer = torch.empty(0, dtype=dtype).set_(view.values.untyped_storage(), 0, (numel,))
    assert M.moment_view(precision, buffer, n, 0, n).values.data_ptr() == view.values.data_ptr()
    return buffer


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_out_of_place_leaves_the_inputs_and_equals_in_place(isa, precision):
    n = 1000
    p, m, v, gen = state(precision, n, seed=12)
    g = torch.randn(n, generator=gen)
    snapshot = (p.clone(), copy_view(m), copy_view(v))
    hp = dict(precision=precision, position=0, rounding_key=4, step=3, **HYPER)
    outs = (torch.empty(n), *views(precision, n))
    kernels.adam_step_compact(p, g, m, v, state_out=outs, **hp)
    assert_state_same((p, m, v), snapshot, "inputs after an out-of-place step")
    kernels.adam_step_compact(p, g, m, v, **hp)
    assert_state_same(outs, (p, m, v), "out of place vs in place")
    # an out may be its own input (that one in place)
    p2, m2, v2 = snapshot[0].clone(), copy_view(snapshot[1]), copy_view(snapshot[2])
    outs = (p2, *views(precision, n))
    kernels.adam_step_compact(p2, g, m2, v2, state_out=outs, **hp)
    assert_state_same(outs, (p, m, v), "param in place, moments out of place")


def test_nonfinite_gradients_poison_only_their_block(isa):
    n = 96
    for precision in ("bf16", "int8"):
        p, m, v, gen = state(precision, n, seed=13)
        ref = (p.clone(), copy_view(m), copy_view(v))
        g = torch.randn(n, generator=gen)
        g[40], g[70] = math.nan, math.inf
        hp = dict(precision=precision, position=0, rounding_key=4, step=3, **HYPER)
        kernels.adam_step_compact(p, g, m, v, **hp)
        M.adam_step_torch(ref[0], g, ref[1], ref[2], **hp)
        assert_state_same((p, m, v), ref, precision)
        back = M.decode(precision, "exp_avg", m)
        if precision == "int8":
            assert m.block_exponents[1:].tolist() == [255, 255] and back[32:].isnan().all()
            assert not back[:32].isnan().any()
        else:
            assert back[40].isnan() and back[70].isinf() and back.isfinite().sum() == n - 2


def test_extreme_magnitudes(isa):
    # block 0: exp_avg near the fp32 maximum (exponent byte 253, y >= 1: codes saturate);
    # block 1: subnormal exp_avg and exp_avg_sq; block 2: v of 1e-44 (roots below 2^-72);
    # block 3: exponent bytes 194 and 177 (the vector kernels' unfolded scale factors)
    n = 128
    m_values = torch.cat([torch.full((32,), 3.0e38), torch.full((32,), 1e-40), torch.full((32,), 1e-30), torch.full((32,), 1e20)])
    v_values = torch.cat([torch.full((32,), 1.0), torch.full((32,), 1e-42), torch.full((32,), 1e-44), torch.full((32,), 1e30)])
    m_values = m_values * torch.linspace(0.01, 1, 32).repeat(4)
    m_values[::3] *= -1
    for precision in ("bf16", "int8"):
        m, v = views(precision, n)
        M.encode(precision, "exp_avg", m_values, m, position=0, key=1)
        M.encode(precision, "exp_avg_sq", v_values, v, position=0, key=1)
        if precision == "int8":
            assert m.block_exponents.tolist()[:3] == [253, 1, 28]
            assert m.block_exponents[3].item() == 194 and v.block_exponents[3].item() == 177
        p = torch.randn(n, generator=torch.Generator().manual_seed(16))
        ref = (p.clone(), copy_view(m), copy_view(v))
        g = torch.zeros(n)
        g[64:] = 1e-25
        hp = dict(precision=precision, position=0, rounding_key=4, step=3, **dict(HYPER, beta1=0.01))
        kernels.adam_step_compact(p, g, m, v, **hp)
        M.adam_step_torch(ref[0], g, ref[1], ref[2], **hp)
        assert_state_same((p, m, v), ref, precision)


def test_block_exponents_on_both_sides_of_the_scaled_form(isa):
    """The vector kernels fold a block's scale into the exponent field for block exponent bytes
    23..252 of a first moment and 16..252 of a second (and skip the subnormal formula of a
    second-moment block with no root in that range): the blocks on both sides of each edge, and
    second-moment blocks with and without subnormal codes, step like the torch reference."""
    exponents = [14, 15, 16, 17, 22, 23, 127, 251, 252, 253]
    n = 32 * len(exponents)
    # block k's largest first moment has exponent byte exponents[k] (the last one's, 1.7 * 2^127,
    # is limited to 253: its codes saturate); within a block magnitudes fall to 2^-24 of it
    # (E3M4T's tail below 2^-7, and below its floor 2^-21), signs alternate
    largest = torch.tensor([1.5 * 2.0 ** (e - 128) for e in exponents[:-1]] + [1.7 * 2.0**127])
    largest = largest.repeat_interleave(32)
    m_values = largest * torch.exp2(-24 * torch.linspace(0, 1, 32)).repeat(len(exponents))
    m_values[1::2] *= -1
    # second moments: even blocks within 2^20 of their largest (no root in the subnormal range),
    # odd blocks over 2^40 (some); one block all zero
    spread = torch.tensor([20.0, 40.0] * (len(exponents) // 2)).repeat_interleave(32)
    v_values = torch.exp2(-spread * torch.rand(n, generator=torch.Generator().manual_seed(5)))
    v_values[64:96] = 0
    m, v = views("int8", n)
    M.encode("int8", "exp_avg", m_values, m, position=0, key=1)
    M.encode("int8", "exp_avg_sq", v_values, v, position=0, key=1)
    assert m.block_exponents.tolist() == exponents
    assert (v.values[32:64] < 16).any() and (v.values[:32] >= 16).all()
    p = torch.randn(n, generator=torch.Generator().manual_seed(6))
    ref = (p.clone(), copy_view(m), copy_view(v))
    for step in range(1, 4):
        # gradients small against the first moments (each block keeps its exponent byte), but
        # the first step pushes the last block's beyond 2^127 (y above 2: codes limited to 127;
        # its second moments overflow, a non-finite block)
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * largest.clamp(max=1.0) * 1e-3
        if step == 1:
            g[-32:] = 2.5e38 * m_values[-32:].sign()
        hp = dict(precision="int8", position=0, rounding_key=M.rounding_key(3, 0, step), step=step, **HYPER)
        kernels.adam_step_compact(p, g, m, v, **hp)
        M.adam_step_torch(ref[0], g, ref[1], ref[2], **hp)
        assert_state_same((p, m, v), ref, f"{isa} step {step}")
    assert m.block_exponents.tolist() == exponents


def test_flush_denormal_does_not_change_the_step(isa):
    # torch.set_flush_denormal(True) sets flush-to-zero and denormals-are-zero on the calling
    # thread, which runs (part of) the kernel: the kernel still computes with IEEE subnormals
    n = 1000
    for precision in ("bf16", "int8"):
        p, m, v, gen = state(precision, n, seed=17)
        ref = (p.clone(), copy_view(m), copy_view(v))
        g = torch.randn(n, generator=gen) * 1e-30
        hp = dict(precision=precision, position=0, rounding_key=4, step=3, **HYPER)
        M.adam_step_torch(ref[0], g, ref[1], ref[2], **hp)
        assert torch.set_flush_denormal(True)
        try:
            kernels.adam_step_compact(p, g, m, v, **hp)
        finally:
            torch.set_flush_denormal(False)
        assert_state_same((p, m, v), ref, precision)
        if precision == "int8":  # the test has subnormal codes to decode
            assert ((m.values & 127) < 8).sum() > 10 and (v.values < 16).sum() > 10


def test_fp32_precision_runs_the_fp32_kernel():
    n = 100
    p, m, v, gen = state("fp32", n, seed=14)
    p2, m2, v2 = p.clone(), m.values.clone(), v.values.clone()
    g = torch.randn(n, generator=gen)
    kernels.adam_step_compact(p, g, m, v, precision="fp32", position=0, rounding_key=0, step=1, **HYPER)
    kernels.adam_step(p2, g, m2, v2, step=1, **HYPER)
    assert_state_same((p, m, v), (p2, M.MomentView(m2), M.MomentView(v2)), "fp32")


def test_errors_name_the_argument():
    n = 64
    p, m, v, _ = state("int8", n, seed=15)
    g = torch.zeros(n)
    hp = dict(precision="int8", rounding_key=1, step=1, **HYPER)
    with pytest.raises(ValueError, match="position 16 is not a multiple of 32"):
        kernels.adam_step_compact(p, g, m, v, position=16, **hp)
    with pytest.raises(ValueError, match=r"exp_avg.block_exponents has 3 elements; 64 int8 elements take ceil\(64/32\) = 2"):
        kernels.adam_step_compact(p, g, M.MomentView(m.values, torch.zeros(3, dtype=torch.uint8)), v, position=0, **hp)
    with pytest.raises(TypeError, match="exp_avg_sq.values must be uint8, got bfloat16"):
        kernels.adam_step_compact(p, g, m, M.MomentView(torch.zeros(n, dtype=torch.bfloat16)), position=0, **hp)
    with pytest.raises(TypeError, match="exp_avg must be an offload.optim.moments.MomentView"):
        kernels.adam_step_compact(p, g, m.values, v, position=0, **hp)
    with pytest.raises(ValueError, match="grad has 63 elements but param has 64"):
        kernels.adam_step_compact(p, g[:63], m, v, position=0, **hp)
    with pytest.raises(ValueError, match="rounding_key must be an int in"):
        kernels.adam_step_compact(p, g, m, v, position=0, **dict(hp, rounding_key=2**32))
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or 'int8'"):
        kernels.adam_step_compact(p, g, m, v, position=0, **dict(hp, precision="int4"))
    with pytest.raises(ValueError, match="beta2 must be in"):
        kernels.adam_step_compact(p, g, m, v, position=0, **dict(hp, beta2=1.0))
    with pytest.raises(OffloadError, match=r"exp_avg.values must be contiguous"):
        strided = M.MomentView(torch.zeros(2 * n, dtype=torch.uint8)[::2], m.block_exponents)
        kernels.adam_step_compact(p, g, strided, v, position=0, **hp)
    # an out overlapping another tensor (not its own input)
    out_m = M.MomentView(v.values, torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"state_out\[1\] \(exp_avg_out\).values overlaps exp_avg_sq.values"):
        kernels.adam_step_compact(p, g, m, v, position=0, state_out=(torch.empty(n), out_m, views("int8", n)[1]), **hp)
    # in place, the gradient overlapping a destination (checked by the extension)
    with pytest.raises(ValueError, match="grad overlaps param"):
        kernels.adam_step_compact(p, p, m, v, position=0, **hp)


def test_a_nonzero_root_never_rounds_to_zero():
    """Roots below the smallest E4M4 code (2^-18 of the block's scale) take code 1, whatever the
    random bits: a zero second moment under a nonzero first one would step by m / eps. Zero stays zero."""
    target = torch.zeros(32)
    target[0] = 1.0
    target[1] = 1e-9
    target[2] = 0.0
    copies = 256
    back = roundtrip("int8", "exp_avg_sq", target.repeat(copies), position=0, key=M.rounding_key(1, 0, 1), root=True)
    back = back.view(copies, 32).double().sqrt()
    assert (back[:, 1] == 2.0**-18 * 2).all()  # code 1 at the block's scale 2
    assert (back[:, 2] == 0).all()
