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
