"""engine.optimizer keeps torch.optim.Optimizer's contract (issue 33, findings 1-3; issue 31,
items 1 and 4): `state_dict()` holds torch AdamW's state, `load_state_dict()` applies it exactly
(or refuses it whole, naming the key), `zero_grad()` drops the gradients since the last applied
step, a step() with nothing to apply and a scheduler stepped on micro-batches are told. fp32
runs are compared with torch.optim.AdamW on the same model and data."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse

import offload
from offload.errors import OffloadError
from offload.optim.engine_optimizer import OptimizerStateError

LR, DECAY = 1e-2, 0.01


def make_config(swap_dir, optimizer="cpu", param="cpu", overlap="forward", **extra):
    config = {
        "precision": "fp32",
        "optimizer": {"lr": LR, "weight_decay": DECAY},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    config.update(extra)
    return config


def torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)


def train_plain(model, optimizer, data):
    """The plain loop: model and optimizer are torch's, or engine.model's forward through the
    engine (`model` is then the engine) and engine.optimizer."""
    for x, y in data:
        mse(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def round_trip(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


# ---- finding 1: state_dict() is torch AdamW's ---------------------------------------------------
@pytest.mark.parametrize("optimizer", ["cpu", "device"])
def test_state_dict_holds_what_torch_adamw_holds(swap_dir, optimizer):
    torch.manual_seed(0)
    model, data = TinyNet(), batches(3)
    reference = copy.deepcopy(model)
    theirs = torch_adamw(reference)
    train_plain(reference, theirs, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, optimizer=optimizer))
    assert engine.optimizer.state_dict()["state"] == {}  # as torch before its first step
    train_plain(engine, engine.optimizer, data)
    ours, expected = engine.optimizer.state_dict(), theirs.state_dict()
    assert sorted(ours["state"]) == sorted(expected["state"]) == list(range(len(list(model.parameters()))))
    assert [len(g["params"]) for g in ours["param_groups"]] == [len(g["params"]) for g in expected["param_groups"]]
    for index, entry in expected["state"].items():
        mine = ours["state"][index]
        assert set(mine) == {"step", "exp_avg", "exp_avg_sq"}
        assert mine["step"].dtype == torch.float32 and mine["step"].shape == () and float(mine["step"]) == 3.0
        for kind in ("exp_avg", "exp_avg_sq"):
            assert mine[kind].dtype == torch.float32 and mine[kind].device.type == "cpu"
            torch.testing.assert_close(mine[kind], entry[kind], rtol=1e-4, atol=1e-7)
    engine.close()


def test_state_dict_refuses_optimizer_state_on_nvme_naming_save_checkpoint(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir, optimizer="nvme"))
    train_plain(engine, engine.optimizer, batches(1))
    with pytest.raises(OptimizerStateError, match=r"is on NVMe.*engine\.save_checkpoint"):
        engine.optimizer.state_dict()
    engine.close()


# ---- finding 2: load_state_dict() applies it; a checkpointed plain loop resumes exactly --------
@pytest.mark.parametrize("resume_on", ["cpu", "nvme", "device"])
def test_plain_loop_checkpointed_with_state_dicts_resumes_exactly(swap_dir, resume_on):
    """torch.save(model.state_dict()) and torch.save(optimizer.state_dict()), a new model and
    engine, model.load_state_dict before initialize, engine.optimizer.load_state_dict: goes on
    as the uninterrupted run and as torch's AdamW (the resumed engine's optimizer state may be
    on NVMe: the load streams)."""
    torch.manual_seed(0)
    model, data = TinyNet(), batches(6)
    reference = copy.deepcopy(model)
    train_plain(reference, torch_adamw(reference), data)

    first = offload.initialize(copy.deepcopy(model), make_config(swap_dir))
    train_plain(first, first.optimizer, data[:3])
    saved_model, saved_optimizer = round_trip(first.model.state_dict()), round_trip(first.optimizer.state_dict())
    train_plain(first, first.optimizer, data[3:])
    uninterrupted = first.consolidated_state_dict()
    first.close()

    resumed_model = TinyNet()
    resumed_model.load_state_dict(saved_model)
    engine = offload.initialize(resumed_model, make_config(swap_dir, optimizer=resume_on))
    engine.optimizer.load_state_dict(saved_optimizer)
    train_plain(engine, engine.optimizer, data[3:])
    state = engine.consolidated_state_dict()
    assert max(float((state[k] - uninterrupted[k]).abs().max()) for k in state) <= 1e-6
    assert max_weight_difference(state, reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_a_torch_adamw_state_dict_loads_and_training_goes_on_like_torch(swap_dir):
    torch.manual_seed(0)
    model, data = TinyNet(), batches(8)
    reference = copy.deepcopy(model)
    theirs = torch_adamw(reference)
    train_plain(reference, theirs, data[:4])
    halfway_model, halfway_optimizer = round_trip(reference.state_dict()), round_trip(theirs.state_dict())
    train_plain(reference, theirs, data[4:])

    resumed = TinyNet()
    resumed.load_state_dict(halfway_model)
    engine = offload.initialize(resumed, make_config(swap_dir, optimizer="nvme"))
    engine.optimizer.load_state_dict(halfway_optimizer)
    assert [unit.step_count for unit in engine.units] == [4] * len(engine.units)
    train_plain(engine, engine.optimizer, data[4:])
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def _corrupt(saved, how):
    state = saved["state"]
    if how == "shape":
        state[2]["exp_avg"] = state[2]["exp_avg"].reshape(-1)
    elif how == "dtype":
        state[2]["exp_avg_sq"] = state[2]["exp_avg_sq"].to(torch.int32)
    elif how == "not finite":
        state[3]["exp_avg"][0] = float("nan")
    elif how == "negative":
        state[3]["exp_avg_sq"][0] = -1.0
    elif how == "amsgrad state":
        state[0]["max_exp_avg_sq"] = state[0]["exp_avg_sq"].clone()
    elif how == "index":
        state[99] = state.pop(1)
    elif how == "step":
        state[0]["step"] = torch.tensor(2.5)
    elif how == "steps within a unit":
        state[3]["step"] = torch.tensor(7.0)  # blocks.0.up.bias; blocks.0.up.weight keeps 4
    elif how == "groups":
        saved["param_groups"] = saved["param_groups"] * 2
    elif how == "group size":
        saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:-1]
    elif how == "lr":
        saved["param_groups"][0]["lr"] = float("inf")
    elif how == "amsgrad":
        saved["param_groups"][0]["amsgrad"] = True
    elif how == "l2 mode":
        saved["param_groups"][0]["decoupled_weight_decay"] = False
    return saved


REFUSALS = {
    "shape": r"\['state'\]\[2\]\['exp_avg'\] \(blocks\.0\.up\.weight\) has shape \[2048\], its parameter \[64, 32\]",
    "dtype": r"\['exp_avg_sq'\] \(blocks\.0\.up\.weight\) has dtype torch.int32",
    "not finite": r"\[3\]\['exp_avg'\] \(blocks\.0\.up\.bias\) holds values that are not finite",
    "negative": r"\[3\]\['exp_avg_sq'\] \(blocks\.0\.up\.bias\) holds negative values",
    "amsgrad state": r"must hold exactly \['step', 'exp_avg', 'exp_avg_sq'\].*amsgrad",
    "index": r"\['state'\]\[.99 \(in no group's params\).\]: the key must be a parameter index",
    "step": r"\['step'\] \(inp\.weight\) must be a whole number of steps >= 0, got 2\.5",
    "steps within a unit": r"parameters of unit blocks\.0 different step counts \(blocks\.0\.up\.weight: 4, blocks\.0\.up\.bias: 7",
    "groups": r"the state dict has 2 parameter groups, engine\.optimizer 1",
    "group size": r"\['param_groups'\]\[0\] has 27 parameters, engine\.optimizer's group 0 28",
    "lr": r"\['param_groups'\]\[0\]\['lr'\] must be a finite number",
    "amsgrad": r"\['amsgrad'\] is True: the engine's CPU Adam does not run amsgrad",
    "l2 mode": r"\['decoupled_weight_decay'\] is False, but the engine runs AdamW",
}


def test_a_bad_state_dict_is_refused_whole_naming_the_key_and_nothing_changes(swap_dir):
    torch.manual_seed(0)
    model, data = TinyNet(), batches(4)
    reference = copy.deepcopy(model)
    theirs = torch_adamw(reference)
    train_plain(reference, theirs, data)
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    train_plain(engine, engine.optimizer, data[:2])
    before, lr_before = engine.optimizer.state_dict(), engine.optimizer.param_groups[0]["lr"]
    for how, message in REFUSALS.items():
        with pytest.raises(OptimizerStateError, match=message):
            engine.optimizer.load_state_dict(_corrupt(copy.deepcopy(theirs.state_dict()), how))
        after = engine.optimizer.state_dict()
        assert [unit.step_count for unit in engine.units] == [2] * len(engine.units), how
        assert all(torch.equal(after["state"][i][k], before["state"][i][k]) for i in before["state"] for k in before["state"][i])
        assert engine.optimizer.param_groups[0]["lr"] == lr_before
    engine.close()


# ---- finding 3: zero_grad() drops the gradients since the last applied step -------------------
def _bad_batch_loop(model, optimizer, data, bad, *, nan_loss):
    """The skip-a-bad-batch loop: backward, then skip (zero_grad, continue) a non-finite loss,
    or batches the loop decides to skip."""
    for i, (x, y) in enumerate(data):
        loss = mse(model, x, y)
        if i in bad and nan_loss:
            loss = loss * float("nan")
        loss.backward()
        if not torch.isfinite(loss) or i in bad:
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    "overlap,clipping,nan_loss",
    [("none", 0.0, True), ("forward", 0.0, False), ("backward", 0.0, True), ("backward", 1.0, False)],
)
def test_skipping_a_bad_batch_with_zero_grad_matches_torch(swap_dir, overlap, clipping, nan_loss):
    torch.manual_seed(0)
    model, data, bad = TinyNet(), batches(5), {1, 3}
    reference = copy.deepcopy(model)
    theirs = torch_adamw(reference)
    for i, (x, y) in enumerate(data):
        loss = mse(reference, x, y)
        loss.backward()
        if i in bad:
            theirs.zero_grad()
            continue
        if clipping:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clipping)
        theirs.step()
        theirs.zero_grad()
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, overlap=overlap, gradient_clipping=clipping))
    _bad_batch_loop(engine, engine.optimizer, data, bad, nan_loss=nan_loss)
    assert engine.global_steps == len(data) - len(bad)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


@pytest.mark.parametrize("overlap,dropped_after", [("forward", (2, 5)), ("backward", (2,))])
def test_zero_grad_between_two_backwards_keeps_the_second_within_an_accumulation_window(swap_dir, overlap, dropped_after):
    """Accumulation 2, a plain loop stepping at every 2nd backward (its own counter): a
    zero_grad after backward 3 (mid-window) drops it, and the window still ends at backward 4
    with that gradient alone; one after backward 6 (the window's last) leaves step() nothing to
    apply (torch's step then changes nothing either). With overlap 'backward' a window's last
    backward steps in place: only the mid-window zero_grad, after a window stepped so."""
    torch.manual_seed(0)
    model, data, k = TinyNet(), batches(8), 2
    reference = copy.deepcopy(model)
    theirs = torch_adamw(reference)
    config = make_config(swap_dir, overlap=overlap, gradient_accumulation_steps=k)
    engine = offload.initialize(copy.deepcopy(model), config)
    for net, optimizer in ((reference, theirs), (engine, engine.optimizer)):
        for i, (x, y) in enumerate(data):
            (mse(net, x, y) / k).backward()
            if i in dropped_after:
                optimizer.zero_grad()
            if (i + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
    assert engine.global_steps == 4 - (5 in dropped_after)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_zero_grad_after_units_stepped_in_place_is_refused_with_the_reason(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir, overlap="backward"))
    (x, y), _ = batches(2)
    mse(engine, x, y).backward()  # ends the window: its units step in place as gradients land
    with pytest.raises(OffloadError, match="already stepped in place.*cannot be taken back"):
        engine.optimizer.zero_grad()
    assert engine.step()
    engine.optimizer.zero_grad()  # right after a step: nothing to drop
    engine.close()


# ---- issue 31: a step() with nothing to apply, a scheduler stepped on micro-batches -------------
def test_step_without_a_backward_warns_once(swap_dir, caplog):
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    (x, y), _ = batches(2)
    mse(engine, x, y).backward()
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert engine.step()
        assert not caplog.records
        assert not engine.step()
        assert not engine.optimizer.step()
    warnings = [r for r in caplog.records if "no backward since the last step()" in r.getMessage()]
    assert len(warnings) == 1
    engine.close()


def test_a_scheduler_stepped_on_every_micro_batch_warns_once_naming_the_fix(swap_dir, caplog):
    engine = offload.initialize(TinyNet(), make_config(swap_dir, gradient_accumulation_steps=4))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1 / (step + 1))
    with caplog.at_level(logging.WARNING, logger="offload"):
        for x, y in batches(8):
            engine.backward(mse(engine, x, y))
            if engine.step():  # the right loop: no warning
                scheduler.step()
        assert not caplog.records
        for x, y in batches(8):
            engine.backward(mse(engine, x, y))
            engine.optimizer.step()
            scheduler.step()
    warnings = [r for r in caplog.records if "if engine.step(): scheduler.step()" in r.getMessage()]
    assert len(warnings) == 1 and len(caplog.records) == 1
    engine.close()


# ---- two ranks: the full state on every rank, loaded into each rank's shard ---------------------
def two_rank_state(rank: int, world_size: int, swap_dir: str, torch_state: dict) -> dict:
    """Each rank: TinyNet trained on its half of each batch, then engine.optimizer.state_dict()
    (every rank calls it); a second engine loads torch's state dict and reads it back."""
    from distributed_worker import RANK_DEVICE, local_half

    torch.manual_seed(0)
    config = make_config(swap_dir)
    config["optimizer"]["threads"] = 1  # the ranks share the machine's cores
    engine = offload.initialize(TinyNet(), config, device=RANK_DEVICE)
    train_plain(engine, engine.optimizer, [local_half(batch, rank, world_size) for batch in batches(3)])
    trained = engine.optimizer.state_dict()["state"]
    engine.close(restore_weights=False)
    second = offload.initialize(TinyNet(), config, device=RANK_DEVICE)
    second.optimizer.load_state_dict(torch_state)
    loaded = second.optimizer.state_dict()["state"]
    second.close(restore_weights=False)
    return {"trained": trained, "loaded": loaded}


def test_two_ranks_each_get_the_full_state_and_load_their_shard(tmp_path):
    from distributed_worker import launch

    torch.manual_seed(0)
    reference = TinyNet()
    theirs = torch_adamw(reference)
    train_plain(reference, theirs, batches(3))
    expected = theirs.state_dict()
    results = launch(two_rank_state, 2, str(tmp_path), expected, timeout_s=30.0, deadline_s=240.0)
    for rank, outcome in enumerate(results):
        assert outcome["ok"], f"rank {rank}: {outcome.get('traceback') or outcome}"
        value = outcome["value"]
        assert sorted(value["trained"]) == sorted(expected["state"]) == sorted(value["loaded"])
        for index, entry in expected["state"].items():
            assert float(value["trained"][index]["step"]) == 3.0
            for kind in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(value["trained"][index][kind], entry[kind], rtol=1e-4, atol=1e-7)
                assert torch.equal(value["loaded"][index][kind], entry[kind])
