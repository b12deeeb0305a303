"""Compact optimizer state under adversarial use (issue 51, findings 5 to 8): the single-step
bound on int8 moments, extreme magnitudes, loads whose bits must not depend on the tier or on
what the engine did before, and load logs that say what a conversion really did.

The formats and kernels themselves are tests/test_compact_kernels.py; the engine's ordinary
compact routes tests/test_compact_state.py."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from reference import TinyNet, batches, engine_run

import offload
from offload import checkpoint
from offload.optim import kernels
from offload.optim import moments as M
from offload.optim.adam_bound import first_moment_bound, update_bound

COMPACT = ["bf16", "int8"]


def compact_views(precision: str, n: int) -> tuple[M.MomentView, M.MomentView]:
    """Zeroed exp_avg and exp_avg_sq views of n elements, each its own buffer."""
    numel, dtype = M.moment_storage(precision, n)
    return tuple(M.moment_view(precision, torch.zeros(numel, dtype=dtype), n, 0, n) for _ in range(2))


def each_isa():
    """Every instruction set this CPU has, forced in turn (the kernel's choice restored after)."""
    try:
        for isa in kernels.available_isas():
            kernels.force_isa(isa)
            yield isa
    finally:
        kernels.force_isa(None)


def make_config(swap_dir, precision: str, *, optimizer: str = "cpu") -> dict:
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "state_precision": precision},
        # pieces of 1024 elements: a block unit of TinyNet streams from NVMe in five
        "offload": {"param": "none", "optimizer": optimizer, "nvme_path": str(swap_dir), "sub_group_size": 1024},
    }


def saved_moments(path) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's moments as a checkpoint holds them (their decoded fp32 values)."""
    with checkpoint.CheckpointReader(path) as reader:
        names = sorted({name for name, kind in reader.stored if kind != "master"})
        return {(name, kind): reader.read_param(name, kind) for name in names for kind in ("exp_avg", "exp_avg_sq")}


# ---- finding 6: a load's rounding depends only on the loaded state ------------------------------


@pytest.mark.parametrize("precision", COMPACT)
def test_a_load_rounds_to_the_same_bits_on_every_tier_and_after_training(swap_dir, tmp_path, precision):
    """fp32 moments loaded into bf16 or int8 round stochastically, with the key of the loaded
    step: the same bits whether the state lives in RAM (one piece per unit) or streams from NVMe
    (five pieces), and whether the engine is fresh or trained other steps first (its own step
    count then differs from the checkpoint's). Before the fix every piece but a unit's last took
    the engine's old step count for its key."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(6)
    source = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        engine_run(source, data[:3])
        source.save_checkpoint(tmp_path / "fp32")
    finally:
        source.close()
    loaded = {}
    for optimizer, trained in (("cpu", 0), ("nvme", 0), ("nvme", 2), ("cpu", 2)):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, precision, optimizer=optimizer))
        try:
            engine_run(engine, data[3 : 3 + trained])
            engine.load_checkpoint(tmp_path / "fp32")
            engine.save_checkpoint(tmp_path / f"{optimizer}-{trained}")
        finally:
            engine.close()
        loaded[(optimizer, trained)] = saved_moments(tmp_path / f"{optimizer}-{trained}")
    reference = loaded[("cpu", 0)]
    for case, state in loaded.items():
        assert state.keys() == reference.keys()
        for key, values in state.items():
            assert torch.equal(values, reference[key]), (case, key)


def test_a_state_dict_load_rounds_with_its_own_step_not_the_engines(swap_dir):
    """engine.optimizer.load_state_dict of fp32 moments into int8: the same bits in a fresh
    engine and in one that trained two steps first (before the fix the re-encoding took each
    engine's own step count, 0 or 2, for its rounding key)."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(5)
    source = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        engine_run(source, data[:3])
        state = copy.deepcopy(source.optimizer.state_dict())
    finally:
        source.close()
    loaded = []
    for trained in (0, 2):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8"))
        try:
            engine_run(engine, data[3 : 3 + trained])
            engine.optimizer.load_state_dict(state)
            loaded.append(engine.optimizer.state_dict()["state"])
        finally:
            engine.close()
    assert loaded[0].keys() == loaded[1].keys() == state["state"].keys()
    for index, entry in loaded[0].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[kind], loaded[1][index][kind]), (index, kind)


# ---- finding 7: a load's log says what the conversion did ----------------------------------------


def test_an_int8_to_bf16_load_says_which_values_it_rounded(swap_dir, tmp_path, caplog):
    """int8 moments are exact fp32 numbers, but not all fit bf16: the second moment is stored as
    a root of 5 significant bits, and its square has up to 10 (bf16 keeps 8). The load measures
    and logs what it rounded (the count equals the values bf16 cannot hold) instead of claiming
    an exact conversion, and says the first moments came through exactly."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    saved = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8"))
    try:
        engine_run(saved, batches(3))
        saved.save_checkpoint(tmp_path / "int8")
        state = saved.optimizer.state_dict()["state"]
    finally:
        saved.close()
    unrepresentable = {}
    for kind in ("exp_avg", "exp_avg_sq"):
        values = torch.cat([entry[kind].reshape(-1) for entry in state.values()])
        unrepresentable[kind] = int((values != values.bfloat16().float()).sum())
    assert unrepresentable["exp_avg"] == 0 and unrepresentable["exp_avg_sq"] > 1000
    narrow = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "bf16"))
    try:
        with caplog.at_level(logging.INFO, logger="offload"):
            narrow.load_checkpoint(tmp_path / "int8")
    finally:
        narrow.close()
    lines = [r.getMessage() for r in caplog.records if "stored in int8" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "exactly" not in lines[0].split("exp_avg_sq:")[1]
    assert f"exp_avg_sq: {unrepresentable['exp_avg_sq']:,} of " in lines[0]
    assert "exp_avg: every one of" in lines[0] and "kept exactly" in lines[0]


# ---- finding 8: finite moments near the fp32 maximum ---------------------------------------------

FP32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max
# int8's largest second moment: its root's largest code below 2^64 ((31/16) 2^63), squared
INT8_V_MAX = (31 * 2.0**59) ** 2


def test_finite_values_beyond_the_format_saturate_instead_of_becoming_infinite():
    """bf16's stochastic rounding of a finite value above its largest finite (3.39e38) rounded
    up to infinity with a probability up to 1 - 2^-16; int8's first moment above 2^126 stayed at
    its top code. Both now saturate at their largest value, keeping the sign; infinities and NaN
    stay what they are."""
    n = 4096
    x = torch.linspace(BF16_MAX, FP32_MAX, n)
    x[1::2] *= -1
    x[-3:] = torch.tensor([math.inf, -math.inf, math.nan])
    for key in range(4):
        for kind in ("exp_avg", "exp_avg_sq"):
            values = x.abs() if kind == "exp_avg_sq" else x
            (view, _) = compact_views("bf16", n)
            M.encode("bf16", kind, values, view, position=0, key=key)
            back = M.decode("bf16", kind, view)
            assert torch.equal(back[:-3].abs(), torch.full((n - 3,), BF16_MAX)), (kind, key)
            assert torch.equal(back[:-3].sign(), values[:-3].sign())
            assert back[-3].item() == math.inf and back[-1].isnan()
    (m, v) = compact_views("int8", 64)
    big = torch.cat([torch.linspace(2.0**126, FP32_MAX, 32), torch.full((32,), -FP32_MAX)])
    M.encode("int8", "exp_avg", big, m, position=0, key=5, reload=True)
    assert torch.equal(M.decode("int8", "exp_avg", m), big.sign() * 2.0**126)
    # a root rounded up to 2^64 would square to infinity: the second moment saturates below it
    for reload in (False, True):
        for key in range(4):
            v_values = torch.cat([torch.linspace(INT8_V_MAX, FP32_MAX, 32), torch.linspace(1e38, FP32_MAX, 32)])
            M.encode("int8", "exp_avg_sq", v_values, v, position=0, key=key, reload=reload)
            back = M.decode("int8", "exp_avg_sq", v)
            assert bool(torch.isfinite(back).all()) and back.max().item() == INT8_V_MAX, (reload, key)
            assert torch.equal(back[:32], torch.full((32,), INT8_V_MAX))


def test_a_bf16_step_near_the_fp32_maximum_stays_finite_on_every_isa():
    """A step whose second moment lands between bf16's largest finite and fp32's maximum stores
    the largest finite bf16 on every instruction set, as the torch twin does; before, the vector
    and portable kernels rounded it up to infinity (and the element never moved again)."""
    n = 1000
    g = torch.full((n,), 5.8e20)  # (1 - beta2) g^2 = 3.364e38 on top of v
    for isa in each_isa():
        results = []
        for step_fn in (kernels.adam_step_compact, M.adam_step_torch):
            p = torch.zeros(n)
            m, v = compact_views("bf16", n)
            M.encode("bf16", "exp_avg_sq", torch.full((n,), 3.0e36), v, position=0, key=1)
            step_fn(
                p,
                g,
                m,
                v,
                precision="bf16",
                position=0,
                rounding_key=M.rounding_key(0, 0, 2),
                step=2,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
            )
            results.append(M.decode("bf16", "exp_avg_sq", v))
        assert torch.equal(results[0], results[1]), isa
        assert torch.equal(results[0], torch.full((n,), BF16_MAX)), isa


def fp32_state_with_huge_moments(swap_dir, path, model, data) -> tuple[str, str]:
    """An fp32 checkpoint at `path` whose first parameter holds a first moment of -3.4e38 and a
    second of 3.4e38 (finite, beyond bf16's and int8's largest); returns the parameter's name."""
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        engine_run(engine, data)
        state = copy.deepcopy(engine.optimizer.state_dict())
        state["state"][0]["exp_avg"].view(-1)[0] = -3.4e38
        state["state"][0]["exp_avg_sq"].view(-1)[1] = 3.4e38
        engine.optimizer.load_state_dict(state)
        engine.save_checkpoint(path)
    finally:
        engine.close()
    return "inp.weight"


@pytest.mark.parametrize("precision", COMPACT)
def test_a_load_of_moments_beyond_the_format_saturates_them_and_names_the_parameter(swap_dir, tmp_path, caplog, precision):
    """fp32 moments near the fp32 maximum loaded into bf16 (beyond its 3.39e38) or int8 (beyond
    2^126 and 3.19e38): stored as the largest value of their sign, never infinite, and one
    warning names the parameter and what to do."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(3)
    name = fp32_state_with_huge_moments(swap_dir, tmp_path / "fp32", model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, precision))
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            engine.load_checkpoint(tmp_path / "fp32")
        state = engine.optimizer.state_dict()["state"][0]
        largest_m = BF16_MAX if precision == "bf16" else 2.0**126
        assert state["exp_avg"].view(-1)[0].item() == -largest_m
        assert state["exp_avg_sq"].view(-1)[1].item() == (BF16_MAX if precision == "bf16" else INT8_V_MAX)
        assert all(bool(torch.isfinite(entry[kind]).all()) for entry in [state] for kind in ("exp_avg", "exp_avg_sq"))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "saturated" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert f"{name} exp_avg: 1 value up to 3.4e+38" in warnings[0] and "'fp32' keeps them exactly" in warnings[0]
        assert f"{name} exp_avg_sq: 1 value up to 3.4e+38" in warnings[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offload"):
            engine.optimizer.load_state_dict(engine.optimizer.state_dict())  # values it holds: nothing beyond
        assert "saturated" not in caplog.text
    finally:
        engine.close()


# ---- finding 5: no int8 step larger than AdamW's own bound -----------------------------------


def test_int8_steps_keep_adamws_single_step_bound_on_every_isa():
    """Blocks with one element at 1 and the others spread down to 2^-20 of it, gradients of a
    steady sign: AdamW's |Δw| / lr stays near 1, within its bound B_t sqrt(1 - beta2^t) /
    (1 - beta1^t) (adam_bound: 1.16 at step 20). Before the tail and the bound, int8 stored a
    small element's first moment as 0 or 2^-10 of its block while its root kept its size, and
    stepped it by up to 241 lr here; now no step exceeds the bound, on any instruction set and
    in the torch twin, and the bound is reached only where rounding would have passed it."""
    n = 32 * 64
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.empty(n).uniform_(-20, 0, generator=gen))
    scale[::32] = 1.0
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    grads = [(scale * sign * (1 + 0.1 * torch.randn(n, generator=gen))).float() for _ in range(20)]
    lr = 1e-3
    hyper = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-30, weight_decay=0.0)

    def check(step_fn, what: str) -> None:
        p = torch.zeros(n)
        m, v = compact_views("int8", n)
        for t, g in enumerate(grads, 1):
            before = p.clone()
            step_fn(p, g, m, v, precision="int8", position=0, rounding_key=M.rounding_key(0, 0, t), step=t, **hyper)
            largest = float(((p - before).abs() / lr).max())
            assert largest <= update_bound(t, 0.9, 0.999) * (1 + 1e-6), (what, t, largest)

    for isa in each_isa():
        check(kernels.adam_step_compact, isa)
    check(M.adam_step_torch, "torch twin")


def test_adamws_bound_holds_for_any_gradients_and_is_reached():
    """adam_bound.first_moment_bound is AdamW's own largest |m_t| / sqrt(v_t) (Cauchy-Schwarz):
    float64 AdamW moments over random gradient sequences stay below it, and gradients growing as
    (beta2 / beta1)^k reach it."""
    gen = torch.Generator().manual_seed(3)
    for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.0, 0.99)):
        for t in (1, 2, 7, 40, 300):
            g = torch.randn(64, t, generator=gen, dtype=torch.float64) * torch.exp(
                3 * torch.randn(64, 1, generator=gen, dtype=torch.float64)
            )
            growing = (beta2 / beta1) ** torch.arange(t, dtype=torch.float64) if beta1 > 0 else torch.ones(t, dtype=torch.float64)
            if beta1 == 0:
                growing = torch.zeros(t, dtype=torch.float64)
                growing[-1] = 1.0
            g = torch.cat([g, growing[None]])
            weights1 = (1 - beta1) * beta1 ** torch.arange(t - 1, -1, -1, dtype=torch.float64)
            weights2 = (1 - beta2) * beta2 ** torch.arange(t - 1, -1, -1, dtype=torch.float64)
            ratio = (g @ weights1).abs() / ((g * g) @ weights2).sqrt()
            bound = first_moment_bound(t, beta1, beta2)
            assert float(ratio.max()) <= bound, (beta1, beta2, t)
            assert float(ratio[-1]) >= bound * (1 - 1e-6), (beta1, beta2, t)
    assert first_moment_bound(1, 0.9, 0.999) == pytest.approx(0.1 / 0.001**0.5)
    assert math.isinf(first_moment_bound(5, 0.9, 0.0))
    assert update_bound(1, 0.9, 0.999) == pytest.approx(1.0)


def test_the_int8_limit_without_a_bound_matches_the_twin_on_every_isa():
    """With beta2 = 0 AdamW has no bound (B_t infinite): the kernels multiply sqrt(v') by fp32's
    largest value instead, so an element with v' = 0 (a zero gradient) and m' != 0 gets a limit
    of 0, not 0 * inf = NaN, on every instruction set as in the torch twin."""
    n = 256
    gen = torch.Generator().manual_seed(9)
    m_values = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    g[::3] = 0.0
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.0, eps=1e-8, weight_decay=0.0)
    results = []
    runs = [(kernels.adam_step_compact, isa) for isa in kernels.available_isas()] + [(M.adam_step_torch, None)]
    try:
        for step_fn, isa in runs:
            kernels.force_isa(isa)
            p = torch.zeros(n)
            m, v = compact_views("int8", n)
            M.encode("int8", "exp_avg", m_values, m, position=0, key=1)
            step_fn(p, g, m, v, precision="int8", position=0, rounding_key=7, step=3, **hyper)
            results.append((isa or "twin", p))
    finally:
        kernels.force_isa(None)
    for isa, p in results:
        assert bool(torch.isfinite(p).all()), isa
        assert torch.equal(p, results[-1][1]), isa
    assert bool((results[-1][1][::3] == 0).all())  # v' = 0: those elements do not move


def test_state_dict_loads_of_moments_beyond_the_format_warn_by_name(swap_dir, caplog):
    """engine.optimizer.load_state_dict and CPUAdamW.load_state_dict saturate the same way and
    say so, naming the parameter (CPUAdamW knows it by index and shape)."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8"))
    try:
        engine_run(engine, batches(2))
        state = copy.deepcopy(engine.optimizer.state_dict())
        state["state"][0]["exp_avg"].view(-1)[3] = 3.0e38
        with caplog.at_level(logging.WARNING, logger="offload"):
            engine.optimizer.load_state_dict(state)
        assert engine.optimizer.state_dict()["state"][0]["exp_avg"].view(-1)[3].item() == 2.0**126
    finally:
        engine.close()
    assert "engine.optimizer.load_state_dict: 1 finite Adam moment value" in caplog.text
    assert "inp.weight exp_avg: 1 value up to 3e+38" in caplog.text
    caplog.clear()
    p = torch.nn.Parameter(torch.zeros(40))
    optimizer = offload.CPUAdamW([p], state_precision="bf16")
    p.grad = torch.ones(40)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][0]["exp_avg_sq"][5] = FP32_MAX
    with caplog.at_level(logging.WARNING, logger="offload"):
        optimizer.load_state_dict(saved)
        loaded = optimizer.state_dict()["state"][0]["exp_avg_sq"]
    assert loaded[5].item() == BF16_MAX and bool(torch.isfinite(loaded).all())
    assert "CPUAdamW.load_state_dict" in caplog.text and "parameter 0 (shape [40]) exp_avg_sq" in caplog.text
