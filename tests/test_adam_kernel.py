"""offload.optim.kernels (the C++ CPU Adam kernel) against torch as the reference.

torch.optim.AdamW computes sqrt(exp_avg_sq) with MKL's vectorized sqrt, which is within one
ulp but not correctly rounded; the kernel's sqrt is correctly rounded. So the bit-exact
reference here is torch's own single-tensor AdamW formula, op for op with torch's kernels,
with only the sqrt taken in double (correctly rounded). The comparison with
torch.optim.AdamW itself, to a few ulps, is in test_cpu_adam.py.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config.state_layout import NORM_BLOCK
from offload.errors import OffloadError
from offload.optim import kernels

ALL_ISAS = ("avx512", "avx2", "portable")
SIZES = (0, 1, 15, 16, 17, 4097, 1_000_003)
LR, BETA1, BETA2, EPS = 1e-2, 0.9, 0.999, 1e-8


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Runs the test once per instruction set this CPU has (others are skipped)."""
    if request.param not in kernels.available_isas():
        pytest.skip(f"CPU lacks {request.param}")
    kernels.force_isa(request.param)
    yield request.param
    kernels.force_isa(None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    same = bits(actual) == bits(expected)
    both_nan = actual.isnan() & expected.isnan()
    bad = ~(same | both_nan)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {actual.numel()} elements differ; first at {i}: "
            f"{actual[i].item()!r} vs {expected[i].item()!r}"
        )


def reference_step(p, g, m, v, *, step, lr, wd, adamw, beta1=BETA1, beta2=BETA2, eps=EPS):
    """torch/optim/adam.py::_single_tensor_adam, op for op, sqrt correctly rounded."""
    if wd != 0:
        if adamw:
            p.mul_(1 - lr * wd)
        else:
            g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (v.double().sqrt().float() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bias_correction1))


def kernel_step(p, g, m, v, *, step, lr, wd, adamw, **kw):
    kernels.adam_step(p, g, m, v, step=step, lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd, adamw_mode=adamw, **kw)


def make_state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), gen


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw,wd", [(True, 0.0), (True, 0.05), (False, 0.05)])
def test_matches_torch_formula_bit_for_bit_100_steps(isa, n, adamw, wd):
    p0, gen = make_state(n, seed=n)
    p_ref, m_ref, v_ref = p0.clone(), torch.zeros(n), torch.zeros(n)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 101):
        g = torch.randn(n, generator=gen) * (0.1 if step % 2 else 3.0)
        reference_step(p_ref, g, m_ref, v_ref, step=step, lr=LR, wd=wd, adamw=adamw)
        kernel_step(p, g, m, v, step=step, lr=LR, wd=wd, adamw=adamw)
    assert_bits_equal(p, p_ref, "param")
    assert_bits_equal(m, m_ref, "exp_avg")
    assert_bits_equal(v, v_ref, "exp_avg_sq")
    if n:
        assert not torch.equal(p, p0), "the step changed nothing"


def test_small_beta1_and_no_bias_correction(isa):
    # beta1 <= 0.5 takes torch's other lerp branch; bias_correction=False uses lr as is.
    n = 1000
    p0, gen = make_state(n, seed=1)
    p_ref, m_ref, v_ref = p0.clone(), torch.zeros(n), torch.zeros(n)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        reference_step(p_ref, g, m_ref, v_ref, step=step, lr=LR, wd=0.1, adamw=True, beta1=0.3)
        kernels.adam_step(p, g, m, v, step=step, lr=LR, beta1=0.3, beta2=BETA2, eps=EPS, weight_decay=0.1)
    assert_bits_equal(p, p_ref, "param")
    assert_bits_equal(m, m_ref, "exp_avg")
    p1, m1, v1 = p0.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p0.clone(), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n, generator=gen)
    kernels.adam_step(p1, g, m1, v1, step=7, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, bias_correction=False)
    reference_step(p2, g, m2, v2, step=10**9, lr=LR, wd=0.0, adamw=True)  # beta**huge == 0: no correction
    assert_bits_equal(p1, p2, "param without bias correction")


@pytest.mark.parametrize("adamw", [True, False])
def test_late_steps_where_bias_correction2_rounds_to_one(isa, adamw):
    # From step ~17000 (beta2 0.999) sqrt(1 - beta2**step) is 1.0 in fp32 and the kernel skips
    # that division; the result must still equal torch's formula, which divides by 1.
    n = 4097
    p0, gen = make_state(n, seed=23)
    p_ref, m_ref, v_ref = p0.clone(), torch.rand(n, generator=gen), torch.rand(n, generator=gen) * 1e-3
    p, m, v = p_ref.clone(), m_ref.clone(), v_ref.clone()
    for step in (16_000, 20_000, 20_001, 10**6):
        g = torch.randn(n, generator=gen)
        reference_step(p_ref, g, m_ref, v_ref, step=step, lr=LR, wd=0.01, adamw=adamw)
        kernel_step(p, g, m, v, step=step, lr=LR, wd=0.01, adamw=adamw)
        assert_bits_equal(p, p_ref, f"param at step {step}")
        assert_bits_equal(v, v_ref, f"exp_avg_sq at step {step}")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [17, 4097, 100_003])
def test_16bit_gradients_equal_fp32_of_them(isa, grad_dtype, n):
    p0, gen = make_state(n, seed=7)
    p_ref, m_ref, v_ref = p0.clone(), torch.zeros(n), torch.zeros(n)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 11):
        g16 = torch.randn(n, generator=gen).to(grad_dtype)
        reference_step(p_ref, g16.float(), m_ref, v_ref, step=step, lr=LR, wd=0.01, adamw=True)
        kernel_step(p, g16, m, v, step=step, lr=LR, wd=0.01, adamw=True)
    assert_bits_equal(p, p_ref, "param")
    assert_bits_equal(v, v_ref, "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_gradient_pattern_is_read_exactly(isa, grad_dtype):
    # all 65536 patterns: zeros, subnormals, normals, infinities, NaNs
    g16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = g16.numel()
    p0 = torch.linspace(-2, 2, n)
    p1, m1, v1 = p0.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p0.clone(), torch.zeros(n), torch.zeros(n)
    kernel_step(p1, g16, m1, v1, step=1, lr=LR, wd=0.0, adamw=True)
    kernel_step(p2, g16.float(), m2, v2, step=1, lr=LR, wd=0.0, adamw=True)
    assert_bits_equal(m1, m2, "exp_avg")
    assert_bits_equal(v1, v2, "exp_avg_sq")
    assert_bits_equal(p1, p2, "param")


def special_fp32_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    random_patterns = torch.randint(-(2**31), 2**31 - 1, (1_000_003,), generator=gen, dtype=torch.int64)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            -float("nan"),
            65504.0,
            65519.0,
            65520.0,
            -65520.0,
            6.1e-5,
            6.0e-5,
            2.0**-24,
            2.0**-25,
            2.0**-25 * 1.0001,
            2.0**-26,
            3.0 * 2.0**-25,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            3.4e38,
            -3.4e38,
            1e-45,
            1.17e-38,
        ]
    )
    # tie cases of bf16 rounding: low 16 bits exactly 0x8000 with even and odd kept bit
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7F8000, 0x00018000], dtype=torch.int64)
    patterns = torch.cat([random_patterns, ties]).to(torch.int32).view(torch.float32)
    return torch.cat([patterns, edges])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_copy_out_equals_to_dtype_bit_for_bit(isa, out_dtype, store_mode):
    # lr = 0, zero gradient: the update leaves each value as is, so every fp32 bit
    # pattern (NaN, inf, subnormals, rounding ties, fp16 overflow edges) reaches the cast.
    values = special_fp32_values()
    n = values.numel()
    p = values.clone()
    out = torch.empty(n, dtype=out_dtype)
    kernels.adam_step(
        p,
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n),
        step=1,
        lr=0.0,
        beta1=BETA1,
        beta2=BETA2,
        eps=EPS,
        weight_decay=0.0,
        param_out16=out,
    )
    assert_bits_equal(p, values, "param (unchanged at lr 0)")
    assert_bits_equal(out, values.to(out_dtype), f"param_out16 ({out_dtype})")
    # and after real updates
    p0, gen = make_state(100_003, seed=5)
    p, m, v = p0 * 100, torch.zeros(100_003), torch.zeros(100_003)
    out = torch.empty(100_003, dtype=out_dtype)
    for step in range(1, 4):
        kernel_step(
            p,
            torch.randn(100_003, generator=gen).to(torch.bfloat16),
            m,
            v,
            step=step,
            lr=LR,
            wd=0.01,
            adamw=True,
            param_out16=out,
        )
        assert_bits_equal(out, p.to(out_dtype), "param_out16 after a step")


@pytest.fixture(params=["regular stores", "streaming stores"])
def store_mode(request):
    """Runs a test with ordinary stores and with non-temporal param_out16 stores."""
    kernels.set_streaming_threshold(0 if request.param == "streaming stores" else None)
    yield request.param
    kernels.set_streaming_threshold(None)


@pytest.fixture
def streaming():
    """Makes every adam_step call use the streaming mode (non-temporal param_out16 stores)."""
    kernels.set_streaming_threshold(0)
    yield
    kernels.set_streaming_threshold(None)


def _steps(n, grad_dtype, out, *, seed, steps=3):
    p, gen = make_state(n, seed=seed)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        kernel_step(p, g, m, v, step=step, lr=LR, wd=0.01, adamw=True, param_out16=out)
    return p, m, v


@pytest.mark.parametrize(
    "grad_dtype,out_dtype",
    [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("n", [17, 45, 200_003])
@pytest.mark.parametrize("offset", [0, 13])
def test_streaming_mode_gives_identical_results(isa, grad_dtype, out_dtype, n, offset):
    # param_out16 at every misalignment (offset elements into its storage): the head up to the
    # first 64-byte boundary, the streamed body, the tail and, past 65536 elements, chunk
    # boundaries of the thread split that fall at unaligned out16 addresses.
    def run(threshold):
        out = None if out_dtype is None else torch.full((n + offset,), 7.0, dtype=out_dtype)[offset:]
        kernels.set_streaming_threshold(threshold)
        try:
            return _steps(n, grad_dtype, out, seed=n + offset, steps=2), out
        finally:
            kernels.set_streaming_threshold(None)

    (p1, m1, v1), out1 = run(2**62)
    (p2, m2, v2), out2 = run(0)
    assert_bits_equal(p2, p1, "param")
    assert_bits_equal(m2, m1, "exp_avg")
    assert_bits_equal(v2, v1, "exp_avg_sq")
    if out_dtype is not None:
        assert_bits_equal(out2, out1, "param_out16")
        assert_bits_equal(out2, p2.to(out_dtype), "param_out16 vs param")


def test_streaming_threshold_setting():
    default = kernels.streaming_threshold()
    assert default >= 1 << 20  # only arrays far beyond a last-level cache stream by default
    try:
        kernels.set_streaming_threshold(123)
        assert kernels.streaming_threshold() == 123
    finally:
        kernels.set_streaming_threshold(None)
    assert kernels.streaming_threshold() == default
    with pytest.raises(ValueError, match="n must be >= 0"):
        kernels.set_streaming_threshold(-1)
    with pytest.raises(TypeError, match="int or None"):
        kernels.set_streaming_threshold(1.5)


@pytest.mark.parametrize("stream", [False, True])
def test_traffic_kernel_touches_every_element(isa, stream):
    # The benchmark's bandwidth limit runs this kernel; one that skipped elements would
    # overstate the limit.
    from offload import _adam_ext

    n = 200_003
    p0, gen = make_state(n, seed=19)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    p, m, v = p0.clone(), torch.ones(n), torch.full((n,), 2.0)
    out = torch.zeros(n + 3, dtype=torch.bfloat16)[3:]
    _adam_ext.adam_traffic(
        p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), out.data_ptr(), n, _adam_ext.BF16, _adam_ext.BF16, stream
    )
    g32 = g.float()
    assert_bits_equal(p, p0 + g32, "param")
    assert_bits_equal(m, 1.0 + g32, "exp_avg")
    assert_bits_equal(v, 2.0 + g32, "exp_avg_sq")
    assert_bits_equal(out, p.to(torch.bfloat16), "param_out16")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_scale_equals_prescaled_gradient(isa, grad_dtype):
    n = 40_000
    p0, gen = make_state(n, seed=11)
    p1, m1, v1 = p0.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p0.clone(), torch.zeros(n), torch.zeros(n)
    scale = 1.0 / 1024.0 * 0.37
    for step in range(1, 6):
        g = (torch.randn(n, generator=gen) * 1000).to(grad_dtype)
        kernel_step(p1, g, m1, v1, step=step, lr=LR, wd=0.01, adamw=False, grad_scale=scale)
        kernel_step(p2, g.float() * scale, m2, v2, step=step, lr=LR, wd=0.01, adamw=False)
    assert_bits_equal(p1, p2, "param")
    assert_bits_equal(v1, v2, "exp_avg_sq")


def test_one_thread_and_all_threads_identical(isa):
    n = 1_000_003
    p0, gen = make_state(n, seed=13)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    original = kernels.get_num_threads()
    try:
        for threads in (1, original, 3):
            kernels.set_num_threads(threads)
            assert kernels.get_num_threads() == threads
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            for step in range(1, 4):
                kernel_step(p, g, m, v, step=step, lr=LR, wd=0.01, adamw=True, param_out16=out)
            results.append((p, m, v, out, kernels.sq_norm(g), kernels.sq_norm(p)))
    finally:
        kernels.set_num_threads(original)
    for other in results[1:]:
        for a, b in zip(results[0][:4], other[:4]):
            assert_bits_equal(a, b, "thread count changed a result")
        assert results[0][4:] == other[4:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 17, 65_537, 1_000_003])
def test_sq_norm_accurate(isa, dtype, n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) * 3
    expected = float((t.double() ** 2).sum())
    assert kernels.sq_norm(t) == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_sq_norm_same_on_every_isa():
    t = torch.randn(1_000_003, generator=torch.Generator().manual_seed(2)) * 1e3
    values = set()
    try:
        for name in kernels.available_isas():
            kernels.force_isa(name)
            values.add(kernels.sq_norm(t))
    finally:
        kernels.force_isa(None)
    assert len(values) == 1


def _norm_in_pieces(t: torch.Tensor, bounds: list[int]) -> float:
    """sq_norm of `t` cut at `bounds`, each piece carrying the previous one's result."""
    norm = 0.0
    for start, end in zip([0, *bounds], [*bounds, t.numel()]):
        norm = kernels.sq_norm(t[start:end], norm)
    return norm


def test_sq_norm_in_whole_blocks_is_the_whole_vectors_sum_on_every_isa():
    """The engine sums a streamed unit's gradient norm piece by piece (pieces are whole
    NORM_BLOCKs: plan.optimizer_plan.whole_blocks) and a resident one in one call: the two must be
    the same bits on any CPU, whatever the values. Summing each piece on its own and adding the
    results (the order before 2026-11-28) differs in the last bit for some of these vectors,
    which is how `make test` failed on an AMX Xeon whose GEMMs gave other gradients than ours."""
    naive_differs = 0
    sizes = [10 * NORM_BLOCK + 7, 100 * NORM_BLOCK + 3]  # the second: several threads, whole
    for seed in range(24):
        n = sizes[seed % 2]
        t = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
        cuts = list(range(NORM_BLOCK * (1 + seed % 3), n, NORM_BLOCK * (1 + seed % 3)))
        values = set()
        try:
            for name in kernels.available_isas():
                kernels.force_isa(name)
                values.add(kernels.sq_norm(t))
                values.add(_norm_in_pieces(t, cuts))
        finally:
            kernels.force_isa(None)
        assert len(values) == 1, (seed, values)
        naive = sum(kernels.sq_norm(t[a:b]) for a, b in zip([0, *cuts], [*cuts, n]))
        naive_differs += naive != values.pop()
    assert naive_differs, "no vector here tells the canonical order from per-piece sums: the test proves nothing"


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    tail=st.integers(0, NORM_BLOCK - 1),
    seed=st.integers(0, 2**16),
    carried=st.sampled_from([0.0, 1.5, 1e30]),
)
def test_sq_norm_carried_through_any_whole_block_cut(blocks, tail, seed, carried):
    n = sum(blocks) * NORM_BLOCK + tail
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    cuts = [NORM_BLOCK * sum(blocks[: i + 1]) for i in range(len(blocks) - 1)]
    norm = carried
    for start, end in zip([0, *cuts], [*cuts, n]):
        norm = kernels.sq_norm(t[start:end], norm)
    assert norm == kernels.sq_norm(t, carried)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_has_nonfinite(isa, dtype, bad):
    n = 1_000_003
    t = torch.randn(n).to(dtype)
    assert not kernels.has_nonfinite(t)
    big = torch.full((100,), torch.finfo(dtype).max, dtype=dtype)
    assert not kernels.has_nonfinite(big)
    for index in (0, 654_321, n - 1):
        u = t.clone()
        u[index] = bad
        assert kernels.has_nonfinite(u), index
    assert not kernels.has_nonfinite(torch.empty(0, dtype=dtype))
    small = torch.ones(5, dtype=dtype)
    small[4] = bad
    assert kernels.has_nonfinite(small)


def test_concurrent_callers_get_correct_results():
    # The GIL is released: two Python threads may call at once; the pool serializes them.
    n = 300_000
    p0, gen = make_state(n, seed=17)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    expected = []
    for g in grads:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step in range(1, 6):
            kernel_step(p, g, m, v, step=step, lr=LR, wd=0.01, adamw=True)
        expected.append(p)
    results = [None, None]

    def work(i):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step in range(1, 6):
            kernel_step(p, grads[i], m, v, step=step, lr=LR, wd=0.01, adamw=True)
            kernels.sq_norm(p)
        results[i] = p

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        assert_bits_equal(got, want, "concurrent call")


def test_isa_selection():
    available = kernels.available_isas()
    assert available[-1] == "portable"
    assert kernels.active_isa() == (os.environ.get("OFFLOAD_CPU_ISA") or available[0])
    for name in ALL_ISAS:
        if name in available:
            kernels.force_isa(name)
            assert kernels.active_isa() == name
        else:
            with pytest.raises(OffloadError, match=name):
                kernels.force_isa(name)
    kernels.force_isa(None)
    assert kernels.active_isa() == (os.environ.get("OFFLOAD_CPU_ISA") or available[0])
    with pytest.raises(ValueError, match="sse"):
        kernels.force_isa("sse")


@pytest.mark.parametrize("isa_name", ["portable", "sse"])
def test_cpu_isa_from_the_environment(isa_name):
    """OFFLOAD_CPU_ISA rules the whole process's kernels (the suite runs under each), and
    force_isa(None) returns to it; an unknown name fails at import, naming the variable."""
    code = "from offload.optim import kernels; kernels.force_isa(None); print(kernels.active_isa())"
    env = {**os.environ, "OFFLOAD_CPU_ISA": isa_name}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if isa_name == "sse":
        assert done.returncode != 0 and "OFFLOAD_CPU_ISA: unknown instruction set 'sse'" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == isa_name


def test_thread_count_validation():
    assert kernels.get_num_threads() >= 1
    with pytest.raises(ValueError, match="n must be >= 1"):
        kernels.set_num_threads(0)
    with pytest.raises(TypeError):
        kernels.set_num_threads(2.5)


def _good(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize(
    "name,replacement,error,match",
    [
        ("param", torch.zeros(16)[::2], OffloadError, "param must be contiguous"),
        ("grad", torch.zeros(8, 2).t()[0], OffloadError, "grad must be contiguous"),
        ("exp_avg", torch.zeros(8, device="meta"), OffloadError, "exp_avg must be on the CPU"),
        ("param", torch.zeros(8, dtype=torch.float64), TypeError, "param must be float32"),
        ("exp_avg_sq", torch.zeros(8, dtype=torch.bfloat16), TypeError, "exp_avg_sq must be float32"),
        ("grad", torch.zeros(8, dtype=torch.int32), TypeError, "grad must be float32 or bfloat16 or float16"),
        ("grad", torch.zeros(9), ValueError, "grad has 9 elements but param has 8"),
        ("exp_avg", torch.zeros(7), ValueError, "exp_avg has 7 elements"),
        ("param_out16", torch.zeros(8), TypeError, "param_out16 must be bfloat16 or float16"),
        ("param_out16", torch.zeros(9, dtype=torch.bfloat16), ValueError, "param_out16 has 9 elements"),
        ("grad", [0.0] * 8, TypeError, "grad must be a torch.Tensor"),
        ("grad", torch.zeros(8).to_sparse(), OffloadError, "grad must be a dense"),
    ],
)
def test_adam_step_rejects_bad_input(name, replacement, error, match):
    args = _good()
    args[name] = replacement
    with pytest.raises(error, match=match):
        kernels.adam_step(**args, step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)


def test_adam_step_rejects_bad_hyperparameters():
    for kwargs, match in [
        ({"step": 0}, "step must be >= 1"),
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"beta2": 1.0}, "beta2 must be in"),
        ({"eps": float("nan")}, "eps must be >= 0"),
    ]:
        full = dict(step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)
        full.update(kwargs)
        with pytest.raises(ValueError, match=match):
            kernels.adam_step(**_good(), **full)


def test_reductions_reject_bad_input():
    with pytest.raises(OffloadError, match="sq_norm: t must be contiguous"):
        kernels.sq_norm(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="has_nonfinite: t must be"):
        kernels.has_nonfinite(torch.zeros(4, dtype=torch.float64))
