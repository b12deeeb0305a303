"""offload.CPUAdamW as a drop-in for torch.optim.AdamW / Adam."""

import copy

import pytest
import torch

import offload
from offload.errors import OffloadError
from offload.optim import CPUAdamW, kernels

# torch.optim.AdamW's sqrt (MKL) is within one ulp, not correctly rounded (see
# test_adam_kernel.py, which checks the kernel bit for bit against torch's formula): after
# 100 steps parameters agree to a few ulps. A wrong formula misses this by orders of magnitude.
TOL = dict(rtol=1e-6, atol=1e-6)


def make_params(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run_both(ours, theirs, params_ours, params_theirs, steps, seed=1, schedulers=()):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(params_ours, params_theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad = g.clone()
            b.grad = g.clone()
        ours.step()
        theirs.step()
        for s in schedulers:
            s.step()


def assert_params_close(params_ours, params_theirs):
    for a, b in zip(params_ours, params_theirs):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)


SIZES = [0, 1, 15, 16, 17, 4097, 1_000_003]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.02])
def test_matches_torch_after_100_steps(adamw, weight_decay):
    params = make_params([(s,) for s in SIZES[:-1]] + [(3, 5)])
    ref_params = clone_params(params)
    ours = CPUAdamW(params, lr=3e-3, weight_decay=weight_decay, adamw_mode=adamw)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    theirs = ref_cls(ref_params, lr=3e-3, weight_decay=weight_decay)
    run_both(ours, theirs, params, ref_params, steps=100)
    assert_params_close(params, ref_params)
    for a, b in zip(params, ref_params):
        sa, sb = ours.state[a], theirs.state[b]
        assert sa["step"].dtype == sb["step"].dtype == torch.float32 and float(sa["step"]) == 100.0
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], **TOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("adamw", [True, False])
def test_large_param_matches_torch(adamw):
    params = make_params([(SIZES[-1],)])
    ref_params = clone_params(params)
    ours = CPUAdamW(params, lr=1e-2, weight_decay=0.01, adamw_mode=adamw)
    theirs = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref_params, lr=1e-2, weight_decay=0.01)
    run_both(ours, theirs, params, ref_params, steps=100)
    assert_params_close(params, ref_params)


def test_param_groups_and_lr_scheduler():
    params = make_params([(100,), (33,), (7, 9)])
    ref_params = clone_params(params)

    def groups(ps):
        return [
            {"params": [ps[0]]},
            {"params": [ps[1]], "lr": 1e-2, "weight_decay": 0.0},
            {"params": [ps[2]], "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        ]

    ours = CPUAdamW(groups(params), lr=2e-3, weight_decay=0.03)
    theirs = torch.optim.AdamW(groups(ref_params), lr=2e-3, weight_decay=0.03)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) for o in (ours, theirs)]
    run_both(ours, theirs, params, ref_params, steps=50, schedulers=schedulers)
    assert ours.param_groups[1]["lr"] == theirs.param_groups[1]["lr"] == 1e-2 * 0.5**5
    assert_params_close(params, ref_params)


def test_params_without_grad_are_skipped():
    params = make_params([(10,), (10,)])
    before = params[1].detach().clone()
    opt = CPUAdamW(params)
    params[0].grad = torch.ones(10)
    opt.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state
    assert not torch.equal(params[0].detach(), before)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_interchanges_with_torch(direction):
    sizes = [(100,), (4, 25), (1,)]
    start = make_params(sizes, seed=4)
    first_params = clone_params(start)
    if direction == "torch_to_ours":
        first = torch.optim.AdamW(first_params, lr=1e-2, weight_decay=0.05)
    else:
        first = CPUAdamW(first_params, lr=1e-2, weight_decay=0.05)
    # 10 steps in the first optimizer, with a checkpoint after 5
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randn(s, generator=gen) for s in sizes] for _ in range(10)]
    for i in range(5):
        for p, g in zip(first_params, grads[i]):
            p.grad = g.clone()
        first.step()
    saved = copy.deepcopy(first.state_dict())
    resumed_params = clone_params(first_params)
    for i in range(5, 10):
        for p, g in zip(first_params, grads[i]):
            p.grad = g.clone()
        first.step()
    # load the checkpoint into the other optimizer and continue
    if direction == "torch_to_ours":
        second = CPUAdamW(resumed_params, lr=99.0, weight_decay=0.0)
    else:
        second = torch.optim.AdamW(resumed_params, lr=99.0, weight_decay=0.0)
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == 1e-2 and second.param_groups[0]["weight_decay"] == 0.05
    for i in range(5, 10):
        for p, g in zip(resumed_params, grads[i]):
            p.grad = g.clone()
        second.step()
    assert_params_close(resumed_params, first_params)
    for p in resumed_params:
        assert float(second.state[p]["step"]) == 10.0
        assert second.state[p]["step"].dtype == torch.float32


def test_adam_state_dict_keeps_l2_mode():
    # A torch.optim.Adam state dict (decoupled_weight_decay False) loads as Adam, not AdamW.
    params = make_params([(50,)])
    torch_adam = torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)
    ours = CPUAdamW(clone_params(params))
    ours.load_state_dict(torch_adam.state_dict())
    assert ours.param_groups[0]["adamw_mode"] is False
    ours_adamw = CPUAdamW(clone_params(params), weight_decay=0.1)
    assert ours_adamw.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True


def test_closure_and_public_name():
    assert offload.CPUAdamW is CPUAdamW
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = CPUAdamW([param], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (param**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 5.0
    assert param[0].item() < 1.0 and param[1].item() > -2.0


def test_multithreaded_result_equals_single_thread():
    params = make_params([(300_001,)])
    other = clone_params(params)
    original = kernels.get_num_threads()
    try:
        for ps, threads in ((params, 1), (other, max(2, original))):
            kernels.set_num_threads(threads)
            opt = CPUAdamW(ps, lr=1e-2)
            gen = torch.Generator().manual_seed(3)
            for _ in range(5):
                ps[0].grad = torch.randn(300_001, generator=gen)
                opt.step()
    finally:
        kernels.set_num_threads(original)
    assert torch.equal(params[0].detach(), other[0].detach())


def test_rejects_bad_params_and_options():
    with pytest.raises(OffloadError, match="amsgrad"):
        CPUAdamW(make_params([(3,)]), amsgrad=True)
    with pytest.raises(OffloadError, match="maximize"):
        CPUAdamW(make_params([(3,)]), maximize=True)
    with pytest.raises(OffloadError, match="on the CPU"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(OffloadError, match="contiguous"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(4, 3).t())])
    with pytest.raises(TypeError, match="float32"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="lr"):
        CPUAdamW(make_params([(3,)]), lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        CPUAdamW(make_params([(3,)]), betas=(0.9, 1.0))
    with pytest.raises(OffloadError, match="contiguous"):
        opt = CPUAdamW(make_params([(3,)]))
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 3).t())]})


def test_rejects_bad_grads_at_step():
    param = torch.nn.Parameter(torch.zeros(4))
    opt = CPUAdamW([param])
    param.grad = torch.zeros(4).to_sparse()
    with pytest.raises(OffloadError, match="sparse"):
        opt.step()
    # a parameter made non-contiguous after construction
    param.data = torch.zeros(4, 2).t()[0]
    param.grad = torch.zeros(4)
    with pytest.raises(OffloadError, match="contiguous"):
        opt.step()


def test_rejects_mismatched_loaded_state():
    param = torch.nn.Parameter(torch.zeros(4))
    opt = CPUAdamW([param])
    param.grad = torch.ones(4)
    opt.step()
    opt.state[param]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="exp_avg has 5 elements"):
        opt.step()


# ---- issue 33, finding 4: tensor hyperparameters and torch's decoupled_weight_decay ----------
def test_tensor_lr_and_betas_updated_in_place_are_read_at_every_step():
    """A loop (or scheduler) that updates the lr / betas tensors in place: torch reads them at
    each step, so does CPUAdamW (it turned them into floats at construction)."""
    params = make_params([(33,), (4, 5)])
    theirs_params, ours_params = clone_params(params), clone_params(params)
    lr_t, lr_o = torch.tensor(1e-2), torch.tensor(1e-2)
    betas_t, betas_o = (torch.tensor(0.9), torch.tensor(0.999)), (torch.tensor(0.9), torch.tensor(0.999))
    theirs = torch.optim.AdamW(theirs_params, lr=lr_t, betas=betas_t, weight_decay=0.05, foreach=False)
    ours = CPUAdamW(ours_params, lr=lr_o, betas=betas_o, weight_decay=0.05)
    assert ours.param_groups[0]["lr"] is lr_o
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        for lr, betas in ((lr_t, betas_t), (lr_o, betas_o)):
            lr.fill_(1e-2 * (0.7**step))
            betas[0].fill_(0.9 - 0.02 * step)
            betas[1].fill_(0.999 - 0.001 * step)
        for a, b in zip(ours_params, theirs_params):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert_params_close(ours_params, theirs_params)


@pytest.mark.parametrize("how", ["group", "constructor"])
def test_decoupled_weight_decay_false_runs_adam_with_l2_like_torch(how):
    """torch.optim.AdamW with a group `decoupled_weight_decay=False` runs Adam (L2 decay): so
    does CPUAdamW, and its state dict says one mode in both keys."""
    params = make_params([(50,), (7, 3)])
    theirs_params, ours_params = clone_params(params), clone_params(params)
    if how == "group":
        theirs = torch.optim.AdamW([{"params": theirs_params, "decoupled_weight_decay": False}], lr=1e-2, weight_decay=0.1)
        ours = CPUAdamW([{"params": ours_params, "decoupled_weight_decay": False}], lr=1e-2, weight_decay=0.1)
    else:
        theirs = torch.optim.Adam(theirs_params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False)
        ours = CPUAdamW(ours_params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False)
    run_both(ours, theirs, ours_params, theirs_params, steps=20)
    assert_params_close(ours_params, theirs_params)
    group = ours.state_dict()["param_groups"][0]
    assert group["decoupled_weight_decay"] is False and group["adamw_mode"] is False


def test_the_two_mode_keys_set_apart_are_refused():
    params = make_params([(5,)])
    with pytest.raises(ValueError, match="adamw_mode=True but decoupled_weight_decay=False"):
        CPUAdamW([{"params": params, "adamw_mode": True, "decoupled_weight_decay": False}])
    with pytest.raises(ValueError, match="adamw_mode=False but decoupled_weight_decay=True"):
        CPUAdamW(params, adamw_mode=False, decoupled_weight_decay=True)
    ours = CPUAdamW(params)
    ours.param_groups[0]["decoupled_weight_decay"] = False  # set after construction: which one is meant?
    params[0].grad = torch.ones(5)
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="parameter group 0 sets adamw_mode=True but decoupled_weight_decay=False"):
        ours.step()
    assert torch.equal(params[0].detach(), before)


# ---- issue 34: compact moments (state_precision) ---------------------------------------------
from offload.optim import moments  # noqa: E402


def wide_grads(sizes, steps, seed):
    """Gradients whose magnitudes spread over 2^20: every int8 code range gets used."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * torch.exp2(-20 * torch.rand(s, generator=gen)) for s in sizes] for _ in range(steps)]


def run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_compact_precision_is_the_compact_kernel(precision):
    # parameter i's moments take position 0 and rounding_key(i, 0, step), i counted over groups
    sizes = [(33,), (4, 25), (1,)]
    params = make_params(sizes, seed=5)
    reference = [p.detach().clone().reshape(-1) for p in params]
    states = []
    for p in params:
        numel, dtype = moments.moment_storage(precision, p.numel())
        states.append(
            [moments.moment_view(precision, torch.zeros(numel, dtype=dtype), p.numel(), 0, p.numel()) for _ in range(2)]
        )
    opt = CPUAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-2, state_precision=precision)
    grads = wide_grads(sizes, steps=4, seed=6)
    run(opt, params, grads)
    for step, step_grads in enumerate(grads, 1):
        for index, (p, g) in enumerate(zip(reference, step_grads)):
            kernels.adam_step_compact(
                p, g.reshape(-1), *states[index], precision=precision, position=0, rounding_key=moments.rounding_key(index, 0, step),
                step=step, lr=3e-3 if index == 2 else 1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
            )  # fmt: skip
    for p, ref in zip(params, reference):
        assert torch.equal(p.detach().reshape(-1), ref)
        buffer = opt.state[p][f"exp_avg_{precision}"]  # the moments are kept compact
        assert (buffer.numel(), buffer.dtype) == moments.moment_storage(precision, p.numel())
    saved = opt.state_dict()
    assert saved["state_precision"] == precision
    saved_state = saved["state"]
    for index, (p, (m, v)) in enumerate(zip(params, states)):
        assert saved_state[index]["exp_avg"].shape == p.shape and saved_state[index]["exp_avg"].dtype == torch.float32
        assert torch.equal(saved_state[index]["exp_avg"].reshape(-1), moments.decode(precision, "exp_avg", m))
        assert torch.equal(saved_state[index]["exp_avg_sq"].reshape(-1), moments.decode(precision, "exp_avg_sq", v))
        assert f"exp_avg_{precision}" not in saved_state[index]
        assert f"exp_avg_{precision}" in opt.state[p]  # state_dict() leaves the optimizer's own state alone


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_compact_state_dict_round_trip_continues_bit_for_bit(precision):
    sizes = [(65_536,), (70,)]
    start = make_params(sizes, seed=7)
    first_params = clone_params(start)
    first = CPUAdamW(first_params, lr=1e-2, state_precision=precision)
    grads = wide_grads(sizes, steps=8, seed=8)
    run(first, first_params, grads[:4])
    saved = copy.deepcopy(first.state_dict())
    resumed_params = clone_params(first_params)
    run(first, first_params, grads[4:])
    second = CPUAdamW(resumed_params, lr=99.0, state_precision=precision)
    second.load_state_dict(saved)
    run(second, resumed_params, grads[4:])
    for a, b in zip(first_params, resumed_params):
        assert torch.equal(a.detach(), b.detach())
    for index, (a, b) in enumerate(zip(first_params, resumed_params)):
        for kind in ("exp_avg", "exp_avg_sq"):
            key = f"{kind}_{precision}"
            assert torch.equal(first.state[a][key], second.state[b][key]), (index, kind)
    if precision == "int8":
        # the test means something: re-encoding the saved moments with the step's exponent rule
        # (not the one for reloading) would not have given them back
        x = saved["state"][0]["exp_avg"].reshape(-1)
        numel, dtype = moments.moment_storage("int8", x.numel())
        view = moments.moment_view("int8", torch.zeros(numel, dtype=dtype), x.numel(), 0, x.numel())
        moments.encode("int8", "exp_avg", x, view, position=0, key=1)
        assert not torch.equal(moments.decode("int8", "exp_avg", view), x)


def test_compact_state_dicts_load_across_precisions_and_into_torch():
    sizes = [(100,), (4, 25)]
    params = make_params(sizes, seed=9)
    grads = wide_grads(sizes, steps=3, seed=10)
    int8 = CPUAdamW(clone_params(params), lr=1e-2, state_precision="int8")
    run(int8, int8.param_groups[0]["params"], grads)
    saved = int8.state_dict()
    # into torch.optim.AdamW: fp32 moments under torch's keys
    theirs = torch.optim.AdamW(clone_params(params), lr=1.0)
    theirs.load_state_dict(copy.deepcopy(saved))
    for index, p in enumerate(theirs.param_groups[0]["params"]):
        assert torch.equal(theirs.state[p]["exp_avg"], saved["state"][index]["exp_avg"])
    # into bf16: int8's exp_avg has at most 4 significant bits, bf16 holds it exactly; its
    # exp_avg_sq (a root squared: up to 10 bits) is rounded
    bf16 = CPUAdamW(clone_params(params), state_precision="bf16")
    bf16.load_state_dict(copy.deepcopy(saved))
    again = bf16.state_dict()
    for index in saved["state"]:
        assert torch.equal(again["state"][index]["exp_avg"], saved["state"][index]["exp_avg"])
        v, v_saved = again["state"][index]["exp_avg_sq"], saved["state"][index]["exp_avg_sq"]
        assert ((v - v_saved).abs() <= v_saved * 2.0**-7).all() and not torch.equal(v, v_saved)
    assert again["state_precision"] == "bf16"
    # and an fp32 torch state dict into int8: encoded (rounded), then it trains on
    fp32_saved = theirs.state_dict()
    back = CPUAdamW(clone_params(params), state_precision="int8")
    back.load_state_dict(fp32_saved)
    run(back, back.param_groups[0]["params"], grads)
    with pytest.raises(ValueError, match="state_precision must be one of"):
        CPUAdamW(clone_params(params), state_precision="fp16")


def test_default_precision_is_fp32_bit_for_bit():
    sizes = [(37,), (3, 5)]
    params = make_params(sizes, seed=11)
    a, b = clone_params(params), clone_params(params)
    grads = wide_grads(sizes, steps=3, seed=12)
    run(CPUAdamW(a, lr=1e-2), a, grads)
    explicit = CPUAdamW(b, lr=1e-2, state_precision="fp32")
    run(explicit, b, grads)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
    assert "state_precision" not in explicit.state_dict() and "exp_avg" in explicit.state[b[0]]
