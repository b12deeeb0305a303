"""Compact optimizer state in the engine (issue 34): bf16 and int8 Adam moments on every tier,
16-bit gradients where exact, and everything that reads or writes the state (checkpoints, the
torch optimizer's state dict, speculation, the memory report) knowing the formats.

The formats themselves and the kernels against their torch twin are tests/test_compact_kernels.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from distributed_worker import launch, rank_swap_dirs, train_cases
from distributed_worker import make_config as make_dist_config
from reference import TinyNet, batches, engine_run, mse, reference_run

import offload
from offload.config.state_layout import StateBytes, StatePrecision
from offload.errors import OffloadError

COMPACT = ["bf16", "int8"]
# final-loss distance from torch AdamW after 12 fp32-compute steps on TinyNet (measured: bf16
# 0.3%, int8 0.9%); a wrong step (a moment decoded wrongly, a lost block) moves it by far more
LOSS_TOLERANCE = {"bf16": 0.02, "int8": 0.05}


def make_config(swap_dir, precision: str, *, optimizer: str = "cpu", param: str = "none", compute: str = "fp32", **extra):
    config = {
        "precision": compute,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "state_precision": precision},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": str(swap_dir)},
    }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            config.setdefault(section, {})[name] = value
        else:
            config[key] = value
    return config


def run(model, config, data):
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        losses = engine_run(engine, data)
        return losses, engine.consolidated_state_dict(), engine.memory_report()
    finally:
        engine.close()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("precision", COMPACT)
def test_every_tier_trains_the_same_bits_and_tracks_adamw(swap_dir, precision):
    """One arithmetic on every tier: the C++ kernel on host and NVMe pieces, torch on the device
    tier, give the same weights bit for bit; and the training tracks torch AdamW."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(12)
    _, reference_losses = reference_run(model, data)
    results = {
        tier: run(model, make_config(swap_dir, precision, optimizer=tier, offload__sub_group_size=1024), data)
        for tier in ("cpu", "nvme", "device")
    }
    losses, weights, _ = results["cpu"]
    for tier in ("nvme", "device"):
        assert results[tier][0] == losses, tier
        assert_same(results[tier][1], weights)
    assert abs(losses[-1] - reference_losses[-1]) <= LOSS_TOLERANCE[precision] * reference_losses[-1]


def test_precisions_differ_and_fp32_state_is_torch_adamw(swap_dir):
    """The precision setting reaches the step: three precisions, three trajectories; fp32 is AdamW's."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(6)
    reference, _ = reference_run(model, data)
    finals = {}
    for precision in ("fp32", "bf16", "int8"):
        losses, weights, _ = run(model, make_config(swap_dir, precision), data)
        finals[precision] = losses[-1]
        if precision == "fp32":
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5)
    assert len(set(finals.values())) == 3, finals


def test_sixteen_bit_gradients_train_exactly_like_fp32_gradients(swap_dir):
    """bf16 compute, one micro-batch per step: the gradient kept in bf16 is the fp32 one's exact
    value, so training is bitwise the same, with half the gradient bytes."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(5)
    compact = run(model, make_config(swap_dir, "fp32", compute="bf16"), data)
    wide = run(model, make_config(swap_dir, "fp32", compute="bf16", optimizer__gradient_precision="fp32"), data)
    assert compact[0] == wide[0]
    assert_same(compact[1], wide[1])
    state_bytes = {
        name: report["host"]["by_category"]["optimizer_state"]["current"]
        for name, report in (("16", compact[2]), ("32", wide[2]))
    }
    # master + two moments + gradient: 14 bytes against 16 per element (pages aside)
    assert state_bytes["16"] < state_bytes["32"] * 15 / 16, state_bytes


@pytest.mark.parametrize("precision,per_element", [("fp32", 14), ("bf16", 10), ("int8", 8 + 2 / 32)])
def test_memory_report_counts_the_compact_bytes(swap_dir, precision, per_element):
    """Host bytes of the optimizer state per trainable element (bf16 compute, accumulation 1)."""
    torch.manual_seed(0)
    model = TinyNet(width=64, depth=2)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, precision, compute="bf16"))
    try:
        numel = sum(unit.optimizer_numel for unit in engine.units)
        held = engine.memory_report()["host"]["by_category"]["optimizer_state"]["current"]
        pages = 4096 * 4 * len(engine.units)
        assert numel * per_element <= held <= numel * per_element + pages, (held, numel)
        assert engine.store.state == StateBytes(StatePrecision(precision), 2)
    finally:
        engine.close()


def test_nvme_swap_files_hold_the_compact_form(swap_dir):
    torch.manual_seed(0)
    model = TinyNet(width=64, depth=2)
    on_disk = {}
    for precision in ("fp32", "int8"):
        engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, precision, optimizer="nvme", compute="bf16"))
        try:
            on_disk[precision] = engine.memory_report()["nvme"]["current"]
        finally:
            engine.close()
    # master 4 + moments 2 x (1 + 1/32) + gradient 2 against 4 + 8 + 2 per element, files a page each
    assert on_disk["int8"] < on_disk["fp32"] * 0.7, on_disk


@pytest.mark.parametrize("optimizer", ["cpu", "nvme", "device"])
@pytest.mark.parametrize("precision", COMPACT)
def test_resume_is_bitwise(swap_dir, tmp_path, precision, optimizer):
    """Saved mid-run and loaded into a new engine, training goes on bit for bit: the checkpoint
    holds the moments' decoded values, which re-encode to themselves."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(8)
    config = make_config(swap_dir, precision, optimizer=optimizer, offload__sub_group_size=1024)
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        engine_run(engine, data[:4])
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = engine_run(engine, data[4:])
        expected_weights = engine.consolidated_state_dict()
        # (state_dict() refuses NVMe-resident state: there the next steps' bits say the moments matched)
        expected_state = engine.optimizer.state_dict()["state"] if optimizer != "nvme" else {}
    finally:
        engine.close()
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine_run(engine, data[4:]) == expected
        assert_same(engine.consolidated_state_dict(), expected_weights)
        state = engine.optimizer.state_dict()["state"] if optimizer != "nvme" else {}
        for index, entry in expected_state.items():
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[index][kind], entry[kind]), (index, kind)
    finally:
        engine.close()


def test_loading_into_another_precision_converts_and_says_so(swap_dir, tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(3)
    saved = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8"))
    try:
        engine_run(saved, data)
        saved.save_checkpoint(tmp_path / "int8")
        int8_state = saved.optimizer.state_dict()["state"]
    finally:
        saved.close()
    wide = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32"))
    try:
        with caplog.at_level(logging.INFO, logger="offload"):
            wide.load_checkpoint(tmp_path / "int8")
        assert "stored in int8" in caplog.text and "converted exactly" in caplog.text  # fp32 holds every value
        state = wide.optimizer.state_dict()["state"]
        for index, entry in int8_state.items():
            assert torch.equal(state[index]["exp_avg"], entry["exp_avg"])
        wide.save_checkpoint(tmp_path / "fp32")
    finally:
        wide.close()
    caplog.clear()
    narrow = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "bf16"))
    try:
        with caplog.at_level(logging.INFO, logger="offload"):
            narrow.load_checkpoint(tmp_path / "fp32")
        assert "stored in fp32" in caplog.text and "nonzero values rounded" in caplog.text
    finally:
        narrow.close()


@pytest.mark.parametrize("precision", COMPACT)
def test_state_dict_round_trip_goes_on_bitwise(swap_dir, precision):
    """engine.optimizer.state_dict() gives the moments' fp32 values; loading them into another
    engine with the same weights continues bit for bit."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(6)
    config = make_config(swap_dir, precision)
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        engine_run(engine, data[:3])
        state = copy.deepcopy(engine.optimizer.state_dict())
        weights = engine.consolidated_state_dict()
        expected = engine_run(engine, data[3:])
    finally:
        engine.close()
    twin_model = copy.deepcopy(model)
    twin_model.load_state_dict(weights)
    engine = offload.initialize(twin_model, config)
    try:
        engine.optimizer.load_state_dict(state)
        assert engine_run(engine, data[3:]) == expected
    finally:
        engine.close()


@pytest.mark.parametrize("precision", COMPACT)
def test_speculative_steps_match_the_plain_step(swap_dir, precision):
    """overlap 'backward' with clipping steps units speculatively into spare compact state, and
    redoes them when the norm clips: the same bits as stepping after backward."""
    torch.manual_seed(0)
    model = TinyNet(depth=3)
    data = batches(6)
    plain = run(model, make_config(swap_dir, precision, gradient_clipping=0.5, overlap="none"), data)
    speculative = run(model, make_config(swap_dir, precision, gradient_clipping=0.5, overlap="backward"), data)
    assert plain[0] == speculative[0]
    assert_same(plain[1], speculative[1])


def test_fp16_overflow_skips_with_compact_state(swap_dir):
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(4)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "int8", compute="fp16"))
    try:
        engine_run(engine, data[:2])
        before = engine.consolidated_state_dict()
        x, y = data[2]
        loss = mse(engine, x, y)
        engine.backward(loss * float("inf"))
        assert engine.step() is False
        assert_same(engine.consolidated_state_dict(), before)
        engine_run(engine, data[3:])
    finally:
        engine.close()


def test_a_second_backward_before_step_is_refused_with_16_bit_gradients(swap_dir):
    """Gradients kept in bf16 (one micro-batch per step) cannot take a sum exactly: a second
    backward before step() is refused before it runs, saying what to do; with fp32 gradients
    it accumulates as before."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    (x, y), (x2, y2) = batches(2)
    engine = offload.initialize(copy.deepcopy(model), make_config(swap_dir, "fp32", compute="bf16"))
    try:
        engine.backward(mse(engine, x, y))
        with pytest.raises(OffloadError, match="gradient_accumulation_steps"):
            engine.backward(mse(engine, x2, y2))
        assert engine.step() is True
    finally:
        engine.close()
    engine = offload.initialize(
        copy.deepcopy(model), make_config(swap_dir, "fp32", compute="bf16", optimizer__gradient_precision="fp32")
    )
    try:
        engine.backward(mse(engine, x, y))
        engine.backward(mse(engine, x2, y2))
        assert engine.step() is True
    finally:
        engine.close()


def test_two_ranks_train_int8_state_in_agreement(tmp_path):
    """Each rank steps its shard's int8 blocks (keyed on its rank): both ranks end with the same
    gathered weights, the host and NVMe tiers alike, and the loss falls as with fp32 state."""
    swaps = rank_swap_dirs(tmp_path, 2)
    cases = [
        {
            "name": f"{precision}-{optimizer}",
            "steps": 6,
            "config": dist_config(swaps, "none", optimizer, state_precision=precision),
        }
        for precision, optimizer in (("int8", "cpu"), ("int8", "nvme"), ("fp32", "cpu"))
    ]
    results = launch(train_cases, 2, cases, deadline_s=240.0)
    assert all(r["ok"] for r in results), results
    rank0, rank1 = (r["value"] for r in results)
    for a, b in zip(rank0, rank1):
        assert a["digest"] == b["digest"], a["name"]
        assert a["read_differs"] == [] and b["read_differs"] == [], a["name"]
    by_name = {case["name"]: case for case in rank0}
    assert by_name["int8-cpu"]["losses"] == by_name["int8-nvme"]["losses"]
    fp32_final = by_name["fp32-cpu"]["losses"][-1]
    assert abs(by_name["int8-cpu"]["losses"][-1] - fp32_final) <= LOSS_TOLERANCE["int8"] * fp32_final


def dist_config(swaps, param, optimizer, *, state_precision):
    config = make_dist_config(swaps, param, optimizer)
    config["optimizer"]["state_precision"] = state_precision
    return config


def test_the_rounding_seed_picks_the_stream_on_every_tier(swap_dir):
    """optimizer.rounding_seed: another seed, another (equally unbiased) rounding, so other
    weights; the same seed, the same bits on every tier (the host's C++ kernel, the device's
    torch twin, NVMe pieces)."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)
    data = batches(4)
    by_seed = {}
    for seed, tier in ((0, "cpu"), (5, "cpu"), (5, "device"), (5, "nvme")):
        config = make_config(swap_dir, "int8", optimizer=tier, offload__sub_group_size=1024, optimizer__rounding_seed=seed)
        by_seed[seed, tier] = run(model, config, data)[1]
    for tier in ("device", "nvme"):
        assert_same(by_seed[5, tier], by_seed[5, "cpu"])
    assert any(not torch.equal(by_seed[0, "cpu"][name], by_seed[5, "cpu"][name]) for name in by_seed[0, "cpu"])


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "7"])
def test_a_bad_rounding_seed_is_refused_by_name(swap_dir, seed):
    config = make_config(swap_dir, "int8", optimizer__rounding_seed=seed)
    with pytest.raises(offload.ConfigError, match="optimizer.rounding_seed"):
        offload.initialize(TinyNet(depth=1), config)


def test_cpu_adamw_rounding_seed_is_its_stream():
    from offload.optim.cpu_adam import CPUAdamW

    def trained(seed):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(256))
        optimizer = CPUAdamW([p], lr=1e-2, state_precision="int8", rounding_seed=seed)
        for step in range(3):
            p.grad = torch.randn(256, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        return p.detach().clone()

    assert torch.equal(trained(9), trained(9))
    assert not torch.equal(trained(0), trained(9))
    with pytest.raises(ValueError, match="rounding_seed"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(4))], rounding_seed=-1)


def test_int8_values_of_other_codes_are_said_to_convert():
    """A checkpoint records its int8 codes: values of other codes (the E4M3 first moment of int8
    checkpoints from before the record, E3M4 without the tail) are re-encoded into E3M4T, a
    conversion the load measures and logs; values of this engine's own stored form are not."""
    from offload.checkpoint.engine_state import precision_change
    from offload.config.state_layout import INT8_CODES

    assert precision_change({"state_precision": "int8", "int8_codes": INT8_CODES}, "int8", 1, 1) is None
    assert precision_change({"state_precision": "bf16"}, "bf16", 2, 1) is None  # elementwise: any ranks
    old = precision_change({"state_precision": "int8"}, "int8", 1, 1)
    assert old is not None and "other codes (exp_avg E4M3" in old and "re-encoded" in old
    e3m4 = precision_change({"state_precision": "int8", "int8_codes": "exp_avg E3M4, sqrt(exp_avg_sq) E4M4"}, "int8", 1, 1)
    assert e3m4 is not None and "other codes" in e3m4
    regrouped = precision_change({"state_precision": "int8", "int8_codes": INT8_CODES}, "int8", 2, 1)
    assert regrouped is not None and "by 2 ranks" in regrouped and "on 1 ranks" in regrouped
    assert "stored in int8" in (precision_change({"state_precision": "int8"}, "fp32", 1, 1) or "")


@pytest.mark.parametrize("precision", ["fp32", *COMPACT])
def test_the_start_up_log_names_the_moments_precision(swap_dir, precision, caplog):
    with caplog.at_level(logging.INFO, logger="offload"):
        offload.initialize(TinyNet(), make_config(swap_dir, precision, optimizer="nvme")).close()
    starts = [r.getMessage() for r in caplog.records if "units (largest" in r.getMessage()]
    assert len(starts) == 1 and f"optimizer on nvme (moments {precision})" in starts[0], starts
