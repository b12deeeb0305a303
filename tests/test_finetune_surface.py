"""What a person fine-tuning a model uses on day one (issue 17): a plain loss.backward(),
engine.optimizer under torch and transformers LR schedulers, parameter groups, frozen
parameters without optimizer state, the model's own state_dict while the engine is open, a
closed-out or doubly wrapped model, an nn.Sequential cut into units, overlap 'backward' with an
extra backward. fp32 runs are compared with torch.optim.AdamW on the same model and data."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from reference import (
    TinyNet,
    batches,
    fp32_weight_tolerance,
    max_weight_difference,
    mse,
)
from torch import nn

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.config.param_groups import is_no_decay, param_groups_no_decay
from offload.config.schema import load_config, lr_at
from offload.errors import ConfigError, OffloadError
from offload.model.units import build_units, single_unit_warning

PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme"]))


def make_config(swap_dir, param="cpu", optimizer="cpu", overlap="none", precision="fp32", **extra):
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }
    config.update(extra)
    return config


def torch_run(model, data, *, groups=None, scheduler=None, lr=1e-2, weight_decay=0.01, accumulation=1):
    """torch.optim.AdamW on a copy of `model`; `groups(model)` gives its param groups,
    `scheduler(optimizer)` an LR scheduler stepped after each optimizer step."""
    model = copy.deepcopy(model)
    params = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    schedule = scheduler(optimizer) if scheduler else None
    for i, (x, y) in enumerate(data):
        (mse(model, x, y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
            if schedule is not None:
                schedule.step()
    return model


def plain_run(engine, data, accumulation=1, scheduler=None):
    """The FSDP2 way: loss.backward() and optimizer.step(), the loss divided by the user."""
    for x, y in data:
        (mse(engine, x, y) / accumulation).backward()
        stepped = engine.global_steps
        engine.optimizer.step()
        if engine.global_steps > stepped and scheduler is not None:
            scheduler.step()


def engine_backward_run(engine, data):
    for x, y in data:
        engine.backward(mse(engine, x, y))
        engine.step()


# ---- 1. a plain loss.backward() --------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param", ["none", "cpu"])
def test_plain_backward_equals_engine_backward_equals_torch(swap_dir, param, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    reference = torch_run(model, data)
    plain = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, overlap=overlap))
    plain_run(plain, data)
    assert (plain.micro_steps, plain.global_steps) == (6, 6)
    through_engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, overlap=overlap))
    engine_backward_run(through_engine, data)
    plain_state, engine_state = plain.consolidated_state_dict(), through_engine.consolidated_state_dict()
    assert all(torch.equal(plain_state[name], engine_state[name]) for name in engine_state)
    assert max_weight_difference(plain_state, reference) <= fp32_weight_tolerance(plain)
    plain.close()
    through_engine.close()


@pytest.mark.parametrize("param,optimizer", [("cpu", "cpu"), ("nvme", "nvme")])
def test_plain_backward_with_accumulation_divides_like_torch(swap_dir, param, optimizer):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(8)
    reference = torch_run(model, data, accumulation=2)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, gradient_accumulation_steps=2))
    plain_run(engine, data, accumulation=2)
    assert engine.global_steps == 4
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_plain_backward_in_fp16_is_refused_and_the_engine_goes_on(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir, precision="fp16"))
    x, y = batches(1)[0]
    with pytest.raises(OffloadError, match=r"fp16.*engine\.backward\(loss\)"):
        mse(engine, x, y).backward()
    assert all(unit.holders == 0 for unit in engine.units)
    assert engine.micro_steps == 0 and all(p.grad is None for p in engine.model.parameters())
    engine.backward(mse(engine, x, y))
    engine.step()
    assert engine.micro_steps == 1
    engine.close()


def test_gradients_from_a_backward_the_engine_never_saw_fail_the_step(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir, param="none"))
    engine.model.blocks[1].up.weight.pow(2).sum().backward()  # no forward of the model
    with pytest.raises(OffloadError, match=r"blocks\.1\.up\.weight.*never reached the model's outputs"):
        engine.step()
    assert engine.model.blocks[1].up.weight.grad is None
    x, y = batches(1)[0]
    mse(engine, x, y).backward()
    assert engine.step()
    engine.close()


def test_overlap_backward_refuses_a_second_backward_before_step(swap_dir):
    """With overlap 'backward' a backward that ends a window steps its units; another backward
    before step() would step them again, where 'none' and 'forward' accumulate it: refused."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, overlap="backward"))
    engine.backward(mse(engine, *data[0]))
    with pytest.raises(OffloadError, match=r"(?i)call engine\.step\(\) after the backward"):
        engine.backward(mse(engine, *data[1]))
    with pytest.raises(OffloadError, match=r"(?i)call engine\.step\(\) after the backward"):
        mse(engine, *data[1]).backward()
    assert engine.step() and engine.micro_steps == 1
    engine_backward_run(engine, data[1:])
    # the refused backwards changed nothing: as if they never ran
    reference = torch_run(model, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


# ---- 2. engine.optimizer and learning-rate schedules -----------------------------------------
def lambda_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def cosine_schedule(optimizer):
    transformers = pytest.importorskip("transformers")
    return transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=5, num_training_steps=20)


@pytest.mark.parametrize("make_scheduler", [lambda_schedule, cosine_schedule], ids=["LambdaLR", "cosine_with_warmup"])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_lr_schedulers_drive_the_engine_like_adamw(swap_dir, make_scheduler, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(20)
    reference = torch_run(model, data, scheduler=make_scheduler)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, overlap=overlap))
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    scheduler = make_scheduler(engine.optimizer)
    for x, y in data:
        mse(engine, x, y).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        scheduler.step()
    assert engine.global_steps == 20
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_optimizer_groups_state_dict_and_fixed_groups(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    optimizer = engine.optimizer
    (group,) = optimizer.param_groups
    assert (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (1e-2, 0.01, (0.9, 0.999), 1e-8)
    assert len(group["params"]) == len(list(engine.model.parameters()))
    saved = optimizer.state_dict()
    assert saved["state"] == {}
    engine.lr = 5e-3
    assert engine.lr == 5e-3 and group["lr"] == 5e-3
    optimizer.load_state_dict(saved)
    assert engine.lr == 1e-2
    with pytest.raises(OffloadError, match="fixed when the engine is built"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    optimizer.zero_grad()  # nothing to clear
    engine.close()


def test_config_scheduler_drives_the_lr_and_a_torch_scheduler_on_top_is_refused(swap_dir):
    schedule = {
        "type": "warmup_decay",
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-2,
        "warmup_num_steps": 3,
        "warmup_type": "linear",
        "total_num_steps": 10,
    }
    engine = offload.initialize(TinyNet(), make_config(swap_dir, scheduler=schedule))
    config = engine.config.scheduler
    seen = []
    for x, y in batches(5):
        seen.append(engine.optimizer.param_groups[0]["lr"])
        mse(engine, x, y).backward()
        engine.step()
    assert seen == [lr_at(k, config, 1e-2) for k in range(5)]
    with pytest.raises(ConfigError, match="scheduler section"):
        engine.lr = 1e-3
    lambda_schedule(engine.optimizer)
    x, y = batches(1)[0]
    mse(engine, x, y).backward()
    with pytest.raises(ConfigError, match="torch LR scheduler is attached.*use one of the two"):
        engine.step()
    engine.close()


def test_a_skipped_fp16_step_does_not_advance_the_config_schedule(swap_dir):
    schedule = {"type": "warmup", "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"}
    config = make_config(swap_dir, precision="fp16", scheduler=schedule, loss_scale={"initial": 1024.0})
    engine = offload.initialize(TinyNet(), config)
    seen, stepped = [], []
    for i, (x, y) in enumerate(batches(5)):
        seen.append(engine.optimizer.param_groups[0]["lr"])
        loss = mse(engine, x, y)
        engine.backward(loss * 1e30 if i == 2 else loss)  # the third overflows: skipped
        stepped.append(engine.step())
    assert stepped == [True, True, False, True, True]
    expected = [lr_at(k, engine.config.scheduler, 1e-2) for k in (0, 1, 2, 2, 3)]
    assert seen == expected
    engine.close()


def test_config_is_read_only_after_initialize(swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    with pytest.raises(ConfigError, match=r"engine\.config\.optimizer\.lr is read-only.*param_groups"):
        engine.config.optimizer.lr = 0.0
    with pytest.raises(ConfigError, match=r"engine\.config\.gradient_accumulation_steps is read-only"):
        engine.config.gradient_accumulation_steps = 2
    changed = copy.deepcopy(engine.config)  # a copy is the user's to change
    changed.optimizer.lr = 0.5
    assert load_config(changed).optimizer.lr == 0.5
    engine.close()


# ---- 3. parameter groups ---------------------------------------------------------------------
def test_no_decay_split_is_the_hugging_face_one():
    model = TinyNet(depth=1)
    decay, no_decay = param_groups_no_decay(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "blocks.0.down.weight",
        "blocks.0.up.weight",
        "inp.weight",
        "out.weight",
    ]
    assert {names[id(p)] for p in no_decay["params"]} == {n for n in names.values() if n.endswith("bias") or ".norm." in n}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert is_no_decay("model.layers.0.input_layernorm.weight", torch.zeros(4, 4))  # an RMSNorm named *norm
    assert is_no_decay("scale", torch.zeros(4))  # any 1-D parameter
    assert not is_no_decay("lm_head.weight", torch.zeros(4, 4))


def grouped(model):
    """No decay on biases and norms, and another lr for the first block: a unit (each block)
    holds parameters of several groups."""
    groups = param_groups_no_decay(model, 0.05)
    first = {id(p) for p in model.blocks[0].parameters()}
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in first]
    return [*groups, {"params": list(model.blocks[0].parameters()), "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6}]


@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_param_groups_equal_adamw_with_the_same_groups(swap_dir, param, optimizer):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(8)
    reference = torch_run(model, data, groups=grouped)
    copied = copy.deepcopy(model)
    engine = offload.initialize(copied, make_config(swap_dir, param, optimizer, overlap="forward"), param_groups=grouped(copied))
    assert [len(g["params"]) for g in engine.optimizer.param_groups] == [len(g["params"]) for g in grouped(model)]
    plain_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_param_groups_by_name_and_the_rest_with_the_config_values(swap_dir):
    engine = offload.initialize(
        TinyNet(depth=2), make_config(swap_dir), param_groups=[{"params": ["out.weight", "out.bias"], "lr": 0.5}]
    )
    first, rest = engine.optimizer.param_groups
    assert first["lr"] == 0.5 and first["weight_decay"] == 0.01 and len(first["params"]) == 2
    assert rest["lr"] == 1e-2 and len(rest["params"]) == len(list(engine.model.parameters())) - 2
    with pytest.raises(OffloadError, match="different learning rates"):
        _ = engine.lr
    engine.lr = 1e-3  # sets every group's
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-3, 1e-3]
    engine.close()


@pytest.mark.parametrize(
    "groups,message",
    [
        ([{"params": ["blocks.0.up.wieght"]}], r"'blocks\.0\.up\.wieght'.*did you mean 'blocks\.0\.up\.weight'"),
        ([{"params": ["out.bias"]}, {"params": ["out.bias"]}], r"'out\.bias' is in param_groups\[0\] and param_groups\[1\]"),
        ([{"params": ["out.bias"], "learning_rate": 1.0}], r"'learning_rate'.*did you mean 'lr'"),
        ([{"params": [nn.Parameter(torch.zeros(3))]}], "not a parameter of the model"),
        ([{"params": ["out.bias"], "betas": (0.9, 1.0)}], r"betas.*\[0, 1\)"),
        ({"params": ["out.bias"]}, "must be a list of dicts"),
    ],
)
def test_bad_param_groups_are_named(swap_dir, groups, message):
    with pytest.raises(ConfigError, match=message):
        offload.initialize(TinyNet(depth=1), make_config(swap_dir), param_groups=groups)


# ---- 4. frozen parameters ---------------------------------------------------------------------
def half_frozen(depth=4, width=64):
    torch.manual_seed(0)
    model = TinyNet(width=width, depth=depth)
    for block in model.blocks[: depth // 2]:
        block.requires_grad_(False)
    model.blocks[-1].norm.requires_grad_(False)  # a frozen param inside a trainable unit too
    return model


def optimizer_state_bytes(engine) -> int:
    host = engine.memory_report()["host"]["by_category"]
    return host.get("optimizer_state", {}).get("current", 0)


def test_frozen_parameters_hold_no_optimizer_state(swap_dir):
    model = half_frozen()
    whole = offload.initialize(TinyNet(width=64, depth=4), make_config(swap_dir))
    half = offload.initialize(copy.deepcopy(model), make_config(swap_dir))
    trainable_units = [unit for unit in half.units if any(p.requires_grad for p in unit.spec.params)]
    assert optimizer_state_bytes(half) == 16 * sum(unit.optimizer_numel for unit in half.units)
    assert all(unit.optimizer_numel == 0 for unit in half.units if unit not in trainable_units)
    assert optimizer_state_bytes(half) < 0.6 * optimizer_state_bytes(whole)
    whole.close()
    half.close()


@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_half_frozen_model_trains_like_adamw(swap_dir, param, optimizer):
    model = half_frozen(width=32)
    data = batches(6)
    reference = torch_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, optimizer, overlap="forward"))
    plain_run(engine, data)
    state = engine.consolidated_state_dict()
    assert max_weight_difference(state, reference) <= fp32_weight_tolerance(engine)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert all(torch.equal(state[n], model.state_dict()[n]) for n in frozen)  # fp32: the weights as given
    engine.close()


# ---- 6 and 7. the model itself while the engine is open, and after -----------------------------
@pytest.mark.parametrize("param,precision", [("cpu", "fp32"), ("nvme", "bf16"), ("none", "bf16")])
def test_model_state_dict_while_open_is_the_fp32_weights(swap_dir, tmp_path, param, precision):
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir, param, param if param == "nvme" else "cpu", precision=precision))
    plain_run(engine, batches(2))
    expected = engine.consolidated_state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k].cpu(), expected[k]) for k in expected)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = TinyNet()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert all(torch.equal(fresh.state_dict()[k], expected[k]) for k in expected)
    assert model.blocks[0].state_dict()["up.weight"].dtype == torch.float32  # a submodule's too
    engine.close()


def test_save_pretrained_while_open_loads_with_from_pretrained(swap_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(config)
    engine = offload.initialize(model, make_config(swap_dir, "cpu", precision="bf16"))
    ids = torch.randint(0, 96, (2, 16))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    expected = engine.consolidated_state_dict()
    model.save_pretrained(tmp_path / "out")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected if k in loaded.state_dict())
    assert torch.equal(loaded.lm_head.weight, expected["transformer.wte.weight"])
    engine.close()


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_hugging_face_model_plain_backward_equals_engine_backward(swap_dir, param):
    """GPT-2 (tied embedding and head, borrowed across units) with out.loss.backward()."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    data = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    states = []
    for plain in (True, False):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param))
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            loss.backward() if plain else engine.backward(loss)
            assert engine.step()
        states.append(engine.consolidated_state_dict())
        engine.close()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[1])


def test_closed_without_weights_the_model_says_why(swap_dir):
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir))
    engine.close(restore_weights=False)
    x, _ = batches(1)[0]
    with pytest.raises(OffloadError, match=r"closed with close\(restore_weights=False\)"):
        model(x)
    with pytest.raises(OffloadError, match=r"closed with close\(restore_weights=False\)"):
        model.state_dict()
    with pytest.raises(OffloadError, match=r"offload\.initialize\(TinyNet\).*restore_weights=False"):
        offload.initialize(model, {"offload": {"param": "cpu"}})
    # weights loaded into it again: usable, and initialize takes it
    model.to_empty(device="cpu")
    model.load_state_dict(TinyNet().state_dict())
    model(x)
    offload.initialize(model, make_config(swap_dir)).close()


def test_reinitialize_after_close_and_refuse_a_model_already_wrapped(swap_dir):
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir))
    with pytest.raises(OffloadError, match=r"already wrapped by an open engine.*over TinyNet"):
        offload.initialize(model, {})
    with pytest.raises(OffloadError, match=r"this Block .*already wrapped"):
        offload.initialize(model.blocks[0], {})
    plain_run(engine, batches(1))
    trained = engine.consolidated_state_dict()
    engine.close()  # restore_weights=True: the model holds the fp32 weights again
    again = offload.initialize(model, make_config(swap_dir))
    assert all(torch.equal(again.consolidated_state_dict()[k], trained[k]) for k in trained)
    again.close()


def test_engine_as_context_manager_closes(swap_dir):
    model = TinyNet()
    with offload.initialize(model, make_config(swap_dir)) as engine:
        plain_run(engine, batches(1))
    assert engine._closed
    assert model.inp.weight.dtype == torch.float32 and model.inp.weight.numel() == 8 * 32


# ---- 9. nn.Sequential ------------------------------------------------------------------------
def test_sequential_is_cut_into_its_children(swap_dir):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    assert [unit.name for unit in build_units(model)] == ["<root>", "0", "1", "2", "3"]
    nested = nn.Sequential(nn.Embedding(10, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), nn.Linear(8, 2))
    assert [unit.name for unit in build_units(nested)] == ["<root>", "1.0", "1.1", "1.2"]  # a ModuleList wins
    engine = offload.initialize(model, make_config(swap_dir, "cpu", precision="bf16", prefetch={"depth": 0}))
    engine(torch.randn(2, 64)).float().sum().backward()
    engine.step()
    device_param_peak = engine.memory_report()["device"]["by_category"]["param"]["peak"]
    assert device_param_peak <= 2 * 4096 * 2  # one layer's flat buffer (4096 bf16 elements), at most two, not four
    engine.close()


def test_a_model_that_is_one_unit_warns_when_weights_are_offloaded(caplog):
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    units = build_units(Flat())
    assert single_unit_warning(units, param_offloaded=False) is None
    assert "the whole model is one unit" in single_unit_warning(units, param_offloaded=True)
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        offload.initialize(Flat(), {"offload": {"param": "cpu"}}).close()
    assert "wrap.module_classes" in caplog.text


class LoraLinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update, as LoRA adapters do."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.a = nn.Linear(width, rank, bias=False)
        self.b = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.b.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class LoraNet(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, checkpoint: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), LoraLinear(width), nn.ReLU()) for _ in range(depth))
        for block in self.blocks:
            block[0].requires_grad_(False)  # a frozen norm first: the last one its backward needs
        self.out = nn.Linear(width, 1)
        self.checkpoint = checkpoint

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.checkpoint:
                h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.checkpoint == "reentrant")
            else:
                h = h + block(h)
        return self.out(h)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non-reentrant"])
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_adapters_with_frozen_weights_train_like_adamw_and_release_units(swap_dir, param, checkpoint):
    """Frozen params used after the last trainable gradient of their unit (a norm before the
    adapter, the base weight beside it) keep the unit's weights until its inputs' gradients are
    computed, and no longer: the device holds a few blocks at a time, not all of them."""
    torch.manual_seed(0)
    model = LoraNet(depth=6, checkpoint=checkpoint)
    data = batches(4)
    reference = torch_run(model, data)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, param, param, prefetch={"depth": 1}))
    plain_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    block_bytes = engine.units[1].layout.padded_numel * 4
    assert (
        engine.memory_report()["device"]["by_category"]["param"]["peak"]
        <= engine.units[0].layout.padded_numel * 4 + 4 * block_bytes
    )
    engine.close()


# ---- checkpoints of frozen params and parameter groups ----------------------------------------
@pytest.mark.parametrize("saved,loaded", [(("cpu", "cpu"), ("nvme", "nvme")), (("nvme", "nvme"), ("none", "cpu"))])
def test_half_frozen_checkpoint_resumes_exactly_in_another_placement(swap_dir, tmp_path, saved, loaded):
    model = half_frozen(width=32)
    data = batches(6)
    copied = copy.deepcopy(model)
    whole = offload.initialize(copied, make_config(swap_dir, *saved), param_groups=grouped(copied))
    plain_run(whole, data)
    expected = whole.consolidated_state_dict()
    whole.close()
    copied = copy.deepcopy(model)
    first = offload.initialize(copied, make_config(swap_dir, *saved), param_groups=grouped(copied))
    plain_run(first, data[:3])
    first.save_checkpoint(tmp_path)
    first.close()
    # the model as built for the run (frozen the same way), random weights: the checkpoint brings them
    fresh = half_frozen(width=32)
    torch.manual_seed(1)
    for param in fresh.parameters():
        param.data.normal_()
    second = offload.initialize(fresh, make_config(swap_dir, *loaded), param_groups=grouped(fresh))
    second.load_checkpoint(tmp_path)
    plain_run(second, data[3:])
    state = second.consolidated_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    second.close()
    exported = checkpoint.export(tmp_path, tmp_path / "export")
    from safetensors.torch import load_file

    exported_state = load_file(exported)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(torch.equal(exported_state[n], model.state_dict()[n]) for n in frozen)


def test_checkpoint_across_a_change_of_what_is_frozen(swap_dir, tmp_path):
    """Saved with a block frozen, loaded with it trainable: its weights come back and its
    moments start at zero; the other way round, the moments saved for it are not needed."""
    model = half_frozen(width=32)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir))
    plain_run(engine, batches(2))
    expected = engine.consolidated_state_dict()
    engine.save_checkpoint(tmp_path / "frozen")
    engine.close()
    unfrozen = copy.deepcopy(model).requires_grad_(True)
    engine = offload.initialize(unfrozen, make_config(swap_dir))
    engine.load_checkpoint(tmp_path / "frozen")
    assert all(torch.equal(engine.consolidated_state_dict()[k], expected[k]) for k in expected)
    plain_run(engine, batches(1))
    engine.save_checkpoint(tmp_path / "unfrozen")
    trained = engine.consolidated_state_dict()
    engine.close()
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir))
    engine.load_checkpoint(tmp_path / "unfrozen")
    assert all(torch.equal(engine.consolidated_state_dict()[k], trained[k]) for k in trained)
    engine.close()


def test_checkpoint_restores_each_groups_learning_rate(swap_dir, tmp_path):
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir), param_groups=grouped(model))
    scheduler = lambda_schedule(engine.optimizer)
    plain_run(engine, batches(3), scheduler=scheduler)
    rates = [g["lr"] for g in engine.optimizer.param_groups]
    engine.save_checkpoint(tmp_path)
    engine.close()
    model = TinyNet()
    engine = offload.initialize(model, make_config(swap_dir), param_groups=grouped(model))
    engine.load_checkpoint(tmp_path)
    assert [g["lr"] for g in engine.optimizer.param_groups] == rates
    engine.close()


# ---- the fine-tuning example ------------------------------------------------------------------
def test_finetune_example_no_strict_drops_what_it_cannot_honour(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", examples / "finetune_causal_lm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(
        json.dumps(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "curriculum_learning": {"enabled": True}}
        )
    )
    with pytest.raises(ConfigError, match="curriculum_learning"):
        example.main(["--tiny", "--no-progress", "--offload-config", str(deepspeed)])
    result = example.main(
        ["--tiny", "--no-progress", "--offload-config", str(deepspeed), "--no-strict", "--save", str(tmp_path / "out")]
    )
    assert len(result["losses"]) == 2
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.float32


# ---- two ranks ----------------------------------------------------------------------------------
def two_rank_surface(rank: int, world_size: int, swap_dir: str) -> dict:
    """Each rank: a half-frozen model with parameter groups, trained with loss.backward() and an
    LR scheduler on its half of each batch; the state dict (by model.state_dict(), every rank
    calling it) and each unit's optimizer_numel on this rank."""
    from distributed_worker import RANK_DEVICE, local_half

    model = half_frozen(width=32)
    config = make_config(swap_dir, "cpu", "nvme", overlap="forward")
    config["optimizer"]["threads"] = 1  # the ranks share the machine's cores
    engine = offload.initialize(model, config, param_groups=grouped(model), device=RANK_DEVICE)
    scheduler = lambda_schedule(engine.optimizer)
    for batch in batches(6):
        x, y = local_half(batch, rank, world_size)
        mse(engine, x, y).backward()
        engine.optimizer.step()
        scheduler.step()
    state = model.state_dict()  # a collective under several ranks, like consolidated_state_dict
    numels = [unit.optimizer_numel for unit in engine.units]
    engine.close(restore_weights=False)
    return {"state": state if rank == 0 else None, "optimizer_numels": numels}


def test_two_ranks_plain_backward_groups_frozen_and_a_scheduler_equal_adamw(tmp_path):
    from distributed_worker import launch

    results = launch(two_rank_surface, 2, str(tmp_path), timeout_s=30.0, deadline_s=240.0)
    for rank, outcome in enumerate(results):
        assert outcome["ok"], f"rank {rank}: {outcome.get('traceback') or outcome}"
    reference = torch_run(half_frozen(width=32), batches(6), groups=grouped, scheduler=lambda_schedule)
    assert max_weight_difference(results[0]["value"]["state"], reference) <= 1e-5
    # the frozen blocks carry no optimizer state on either rank
    assert results[0]["value"]["optimizer_numels"][1:3] == [0, 0] == results[1]["value"]["optimizer_numels"][1:3]
