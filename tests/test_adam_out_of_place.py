"""kernels.adam_step(..., state_out=(param_out, exp_avg_out, exp_avg_sq_out)): the out-of-place step.

The reference is the kernel's own in-place step on copies (itself checked against torch in
test_adam_kernel.py): the out-of-place result must equal it bit for bit, on every
instruction set, through the vector body, the tails, several threads and the streaming path,
and the inputs must come out bitwise untouched.
"""

import math

import pytest
import torch

from offload import _adam_ext
from offload.errors import OffloadError
from offload.optim import kernels

ALL_ISAS = ("avx512", "avx2", "portable")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT16_DTYPES = (None, torch.bfloat16, torch.float16)
# Around the 8- and 16-lane vectors, their tails and the streaming head (up to 32 elements).
SMALL_SIZES = (1, 7, 8, 9, 15, 16, 17, 31, 33, 100)
# (input offset, output offset) in elements from the start of an allocation.
OFFSETS = ((0, 0), (1, 3), (3, 1))


@pytest.fixture(autouse=True, scope="module")
def torch_single_thread():
    """torch's own ops (building and comparing the tensors) on one thread: on a small, busy
    machine its spinning workers would otherwise compete with the kernel's thread pool."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Runs the test once per instruction set this CPU has (others are skipped)."""
    if request.param not in kernels.available_isas():
        pytest.skip(f"CPU lacks {request.param}")
    kernels.force_isa(request.param)
    try:
        yield request.param
    finally:
        kernels.force_isa(None)


@pytest.fixture(params=[False, True], ids=["regular", "streaming"])
def stream(request):
    """Streaming threshold 0 (every call with param_out16 streams) or the default."""
    old = kernels.streaming_threshold()
    kernels.set_streaming_threshold(0 if request.param else None)
    try:
        yield request.param
    finally:
        kernels.set_streaming_threshold(old)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not torch.equal(bits(actual), bits(expected)):
        bad = bits(actual) != bits(expected)
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {actual.numel()} elements differ; first at {i}: "
            f"{actual[i].item()!r} vs {expected[i].item()!r}"
        )


def at_offset(values: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of values whose data starts `offset` elements past the start of its allocation."""
    t = torch.empty(values.numel() + offset, dtype=values.dtype)[offset:]
    t.copy_(values)
    return t


def garbage(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """Output buffer full of NaN: an element the kernel forgets to write shows."""
    return at_offset(torch.full((n,), math.nan, dtype=dtype), offset)


def adam(p, g, m, v, *, adamw=True, step=3, grad_scale=1.0, **kw):
    kernels.adam_step(
        p,
        g,
        m,
        v,
        step=step,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.05,
        adamw_mode=adamw,
        grad_scale=grad_scale,
        **kw,
    )


def make_state(n, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen).to(grad_dtype)
    return p, g, m, v


def check_matches_in_place(n, *, grad_dtype, out16_dtype, adamw, in_offset, out_offset, seed, grad_scale=1.0):
    p0, g0, m0, v0 = make_state(n, grad_dtype, seed)
    # Reference: the in-place step on copies.
    p_ref, m_ref, v_ref = p0.clone(), m0.clone(), v0.clone()
    out16_ref = None if out16_dtype is None else garbage(n, out16_dtype, 0)
    adam(p_ref, g0, m_ref, v_ref, adamw=adamw, grad_scale=grad_scale, param_out16=out16_ref)
    assert not torch.equal(p_ref, p0), "the step changed nothing"
    # Out of place, from and to misaligned buffers.
    p, g, m, v = (at_offset(t, in_offset) for t in (p0, g0, m0, v0))
    outs = tuple(garbage(n, torch.float32, out_offset) for _ in range(3))
    out16 = None if out16_dtype is None else garbage(n, out16_dtype, out_offset)
    adam(p, g, m, v, adamw=adamw, grad_scale=grad_scale, param_out16=out16, state_out=outs)
    what = f"n={n} offsets={in_offset},{out_offset}"
    for name, actual, expected in (("param", p, p0), ("grad", g, g0), ("exp_avg", m, m0), ("exp_avg_sq", v, v0)):
        assert_bits_equal(actual, expected, f"{what}: input {name} changed")
    for name, actual, expected in zip(("param_out", "exp_avg_out", "exp_avg_sq_out"), outs, (p_ref, m_ref, v_ref)):
        assert_bits_equal(actual, expected, f"{what}: {name}")
    if out16 is not None:
        assert_bits_equal(out16, out16_ref, f"{what}: param_out16")


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("out16_dtype", OUT16_DTYPES, ids=["no16", "bf16out", "fp16out"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32grad", "bf16grad", "fp16grad"])
def test_small_sizes_match_in_place(isa, stream, grad_dtype, out16_dtype, adamw):
    for n in SMALL_SIZES:
        for in_offset, out_offset in OFFSETS:
            check_matches_in_place(
                n,
                grad_dtype=grad_dtype,
                out16_dtype=out16_dtype,
                adamw=adamw,
                in_offset=in_offset,
                out_offset=out_offset,
                seed=n,
            )


@pytest.mark.parametrize("out16_dtype", OUT16_DTYPES, ids=["no16", "bf16out", "fp16out"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32grad", "bf16grad", "fp16grad"])
def test_threaded_sizes_match_in_place(isa, stream, grad_dtype, out16_dtype):
    # 70_001 elements: two 65536-element chunks (the second one short), taken by the threads.
    check_matches_in_place(
        70_001,
        grad_dtype=grad_dtype,
        out16_dtype=out16_dtype,
        adamw=grad_dtype != torch.float16,
        in_offset=1,
        out_offset=3,
        seed=5,
        grad_scale=0.37,
    )


def test_million_elements_match_in_place(isa):
    # Many chunks over all threads, streaming (the engine's large-array mode), L2 decay.
    old = kernels.streaming_threshold()
    kernels.set_streaming_threshold(1 << 20)
    try:
        check_matches_in_place(
            1_000_003,
            grad_dtype=torch.bfloat16,
            out16_dtype=torch.bfloat16,
            adamw=False,
            in_offset=3,
            out_offset=1,
            seed=7,
        )
    finally:
        kernels.set_streaming_threshold(old)


def test_ping_pong_over_several_steps_matches_in_place(isa):
    # The engine's pattern: step from one set of buffers into another and back.
    n = 1037
    p0, _, m0, v0 = make_state(n, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(12)
    p_ref, m_ref, v_ref = p0.clone(), m0.clone(), v0.clone()
    front = (p0.clone(), m0.clone(), v0.clone())
    back = tuple(torch.empty(n) for _ in range(3))
    for step in range(1, 8):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        adam(p_ref, g, m_ref, v_ref, step=step)
        adam(front[0], g, front[1], front[2], step=step, state_out=back)
        front, back = back, front
    for name, actual, expected in zip(("param", "exp_avg", "exp_avg_sq"), front, (p_ref, m_ref, v_ref)):
        assert_bits_equal(actual, expected, name)


def test_state_out_equal_to_inputs_is_in_place(isa):
    n = 4099
    p0, g, m0, v0 = make_state(n, torch.float16, seed=3)
    p_ref, m_ref, v_ref = p0.clone(), m0.clone(), v0.clone()
    out16_ref = torch.empty(n, dtype=torch.bfloat16)
    adam(p_ref, g, m_ref, v_ref, param_out16=out16_ref)
    # All three in place.
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    out16 = torch.empty(n, dtype=torch.bfloat16)
    adam(p, g, m, v, param_out16=out16, state_out=(p, m, v))
    for name, actual, expected in (("param", p, p_ref), ("exp_avg", m, m_ref), ("exp_avg_sq", v, v_ref)):
        assert_bits_equal(actual, expected, name)
    assert_bits_equal(out16, out16_ref, "param_out16")
    # Mixed: param in place, the moments out of place (a list works as well as a tuple).
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    m_out, v_out = torch.empty(n), torch.empty(n)
    adam(p, g, m, v, state_out=[p, m_out, v_out])
    assert_bits_equal(p, p_ref, "param")
    assert_bits_equal(m_out, m_ref, "exp_avg_out")
    assert_bits_equal(v_out, v_ref, "exp_avg_sq_out")
    assert_bits_equal(m, m0, "exp_avg input changed")
    assert_bits_equal(v, v0, "exp_avg_sq input changed")


def test_empty_tensors():
    e = torch.empty(0)
    adam(e, e.clone(), e.clone(), e.clone(), state_out=(torch.empty(0), torch.empty(0), torch.empty(0)))


@pytest.mark.parametrize("stream_mode", [False, True])
def test_traffic_kernel_reads_sources_writes_destinations(isa, stream_mode):
    # The benchmark's bandwidth kernel with separate sources: destinations = sources + grad.
    n = 100_003
    p, g, m, v = make_state(n, torch.bfloat16, seed=13)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    outs = [garbage(n, torch.float32, 1) for _ in range(3)]
    out16 = garbage(n, torch.bfloat16, 3)
    _adam_ext.adam_traffic(
        outs[0].data_ptr(),
        g.data_ptr(),
        outs[1].data_ptr(),
        outs[2].data_ptr(),
        out16.data_ptr(),
        n,
        _adam_ext.BF16,
        _adam_ext.BF16,
        stream_mode,
        param_in=p.data_ptr(),
        exp_avg_in=m.data_ptr(),
        exp_avg_sq_in=v.data_ptr(),
    )
    g32 = g.float()
    for name, actual, source in zip(("param", "exp_avg", "exp_avg_sq"), outs, (p0, m0, v0)):
        assert_bits_equal(actual, source + g32, name)
    assert_bits_equal(out16, outs[0].to(torch.bfloat16), "param_out16")
    for name, actual, expected in (("param", p, p0), ("exp_avg", m, m0), ("exp_avg_sq", v, v0)):
        assert_bits_equal(actual, expected, f"input {name} changed")


def _inputs(n=64):
    return make_state(n, torch.float32, seed=17)


@pytest.mark.parametrize(
    "state_out, error, match",
    [
        (
            lambda n: (torch.empty(n, dtype=torch.bfloat16), torch.empty(n), torch.empty(n)),
            TypeError,
            r"state_out\[0\] \(param_out\) must be float32, got bfloat16",
        ),
        (
            lambda n: (torch.empty(n), torch.empty(n, dtype=torch.float64), torch.empty(n)),
            TypeError,
            r"state_out\[1\] \(exp_avg_out\) must be float32",
        ),
        (
            lambda n: (torch.empty(n), torch.empty(n), torch.empty(n + 1)),
            ValueError,
            r"state_out\[2\] \(exp_avg_sq_out\) has 65 elements but param has 64",
        ),
        (
            lambda n: (torch.empty(n), torch.empty(2 * n)[::2], torch.empty(n)),
            OffloadError,
            r"state_out\[1\] \(exp_avg_out\) must be contiguous",
        ),
        (
            lambda n: (torch.empty(n), torch.empty(n), [0.0] * n),
            TypeError,
            r"state_out\[2\] \(exp_avg_sq_out\) must be a torch.Tensor",
        ),
        (lambda n: (torch.empty(n), torch.empty(n)), TypeError, "state_out must be a tuple .* of length 2"),
        (lambda n: torch.empty(3, n), TypeError, "state_out must be a tuple .* got Tensor"),
    ],
    ids=["dtype", "float64", "numel", "non-contiguous", "not-a-tensor", "two-outs", "stacked-tensor"],
)
def test_rejects_bad_state_out(state_out, error, match):
    p, g, m, v = _inputs()
    p0 = p.clone()
    with pytest.raises(error, match="adam_step: " + match):
        adam(p, g, m, v, state_out=state_out(p.numel()))
    assert_bits_equal(p, p0, "param changed by a refused call")


def test_rejects_overlaps():
    n = 64
    p, g, m, v = _inputs(n)
    a, b = torch.empty(n), torch.empty(n)
    big = torch.empty(4 * n)
    p_big = big[:n]
    p_big.copy_(p)
    # out shifted by one element against its own input: a partial overlap
    with pytest.raises(ValueError, match=r"adam_step: state_out\[0\] \(param_out\) overlaps param;"):
        adam(p_big, g, m, v, state_out=(big[1 : n + 1], a, b))
    # out equal to another input
    with pytest.raises(ValueError, match=r"state_out\[1\] \(exp_avg_out\) overlaps exp_avg_sq"):
        adam(p, g, m, v, state_out=(a, v, b))
    # out equal to the (fp32) gradient
    with pytest.raises(ValueError, match=r"state_out\[2\] \(exp_avg_sq_out\) overlaps grad"):
        adam(p, g, m, v, state_out=(a, b, g))
    # out partly over a 16-bit gradient
    g16 = torch.empty(3 * n, dtype=torch.bfloat16)
    g16[:n].copy_(g)
    with pytest.raises(ValueError, match=r"state_out\[0\] \(param_out\) overlaps grad"):
        adam(p, g16[:n], m, v, state_out=(g16[n // 2 :].view(torch.float32)[:n], a, b))
    # two outs sharing memory
    with pytest.raises(ValueError, match=r"state_out\[0\] \(param_out\) overlaps state_out\[1\]"):
        adam(p, g, m, v, state_out=(big[2 * n : 3 * n], big[2 * n + 5 : 3 * n + 5], b))
    # an out over param_out16
    out16 = torch.empty(2 * n, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"state_out\[2\] \(exp_avg_sq_out\) overlaps param_out16"):
        adam(p, g, m, v, param_out16=out16[:n], state_out=(a, b, out16.view(torch.float32)))
    # an out in place does not excuse another out overlapping it
    with pytest.raises(ValueError, match=r"state_out\[1\] \(exp_avg_out\) overlaps param"):
        adam(p, g, m, v, state_out=(p, p, b))
    assert_bits_equal(p_big, p, "param changed by a refused call")


def test_extension_rejects_source_overlapping_destination():
    # The C++ layer checks on its own: an out-of-place source that overlaps a destination.
    n = 64
    buf = torch.zeros(3 * n)
    g, v = torch.zeros(n), torch.zeros(n)
    args = dict(n=n, grad_type=_adam_ext.F32, out_type=_adam_ext.NONE, grad_scale=1.0, weight_decay=0.0)
    scalars = dict(
        l2_decay=False,
        decay_factor=1.0,
        decoupled_decay=False,
        beta1_weight=0.1,
        beta2=0.999,
        one_minus_beta2=0.001,
        bias_correction2_sqrt=1.0,
        eps=1e-8,
        neg_step_size=-1e-3,
    )
    with pytest.raises(ValueError, match="adam_step: exp_avg_in overlaps param without being it"):
        _adam_ext.adam_step(
            buf.data_ptr(),
            g.data_ptr(),
            buf[2 * n :].data_ptr(),
            v.data_ptr(),
            0,
            **args,
            **scalars,
            exp_avg_in=buf[n // 2 :].data_ptr(),
        )
    # a source in place (param_in is param) must still overlap no other destination
    m = torch.zeros(n)
    with pytest.raises(ValueError, match="adam_step: param_in overlaps exp_avg without being it"):
        _adam_ext.adam_step(
            buf.data_ptr(),
            g.data_ptr(),
            buf[n // 2 :].data_ptr(),
            v.data_ptr(),
            0,
            **args,
            **scalars,
            exp_avg_in=m.data_ptr(),
        )
    with pytest.raises(ValueError, match="adam_traffic: param_in overlaps exp_avg_sq without being it"):
        _adam_ext.adam_traffic(
            buf.data_ptr(),
            g.data_ptr(),
            buf[n:].data_ptr(),
            v.data_ptr(),
            0,
            n,
            _adam_ext.F32,
            _adam_ext.NONE,
            False,
            param_in=v[1:].data_ptr(),
        )
