"""offload estimate counts real models: mixture-of-experts (Mixtral, Qwen-MoE, DeepSeek-V2/V3) and
tied embeddings (Gemma, Gemma-2) from their published config.json, to the published figures; it
refuses what it cannot count; its host bytes follow the engine's own budget on CUDA as on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.cli import main as cli_main
from offload.config.sizes import round_up
from offload.config.state_layout import FP32_STATE, STATE_KINDS, StateBytes, StatePrecision
from offload.errors import ConfigError
from offload.plan import estimate as est
from offload.plan.budgets import host_budget_bytes
from offload.plan.machine import Machine
from offload.plan.model_shapes import ModelShape, shape_from_hf_config, shape_from_module, shape_from_param_count
from offload.plan.optimizer_plan import shape_slots, swap_bytes_for_state

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).parent / "data" / "hf_configs"

# Published parameter counts (model cards / papers), and how close the count must be. Exact
# where the published figure is exact; the others are published rounded to 0.1B.
PUBLISHED = {
    "llama-2-7b-hf.json": (6_738_415_616, 0),
    "mixtral-8x7b-instruct-v0.1.json": (46_702_792_704, 0),  # "46.7B"
    "gemma-2-9b.json": (9_241_705_984, 0),  # "9.24B": the output head is the embedding (tied)
    "qwen1.5-moe-a2.7b.json": (14.3e9, 0.05e9),  # "14.3B": 60 routed experts and a shared expert per layer
    "qwen3-30b-a3b.json": (30.5e9, 0.05e9),  # "30.5B": 128 routed experts per layer
    "deepseek-v2-lite.json": (15.7e9, 0.05e9),  # "15.7B": one dense layer, then 64 routed + 2 shared experts
    "deepseek-v3.json": (671e9, 0.5e9),  # "671B" (the multi-token-prediction layer is not part of the trained model)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_count_to_the_published_figure(name):
    expected, tolerance = PUBLISHED[name]
    count = shape_from_hf_config(CONFIGS / name).num_params
    assert abs(count - expected) <= tolerance, f"{name}: {count:,} vs published {expected:,.0f}"


def test_mixture_of_experts_is_not_counted_as_one_expert():
    mixtral = shape_from_hf_config(CONFIGS / "mixtral-8x7b-instruct-v0.1.json")
    assert mixtral.num_params > 46e9  # was 7.24B: the experts were counted once
    assert len(mixtral.unit_tensors()) == 33  # root + 32 blocks, each holding its 8 experts
    deepseek = shape_from_hf_config(CONFIGS / "deepseek-v2-lite.json")
    first, second = (sum(u) for u in deepseek.unit_tensors()[1:3])
    assert first < second / 5  # the first layer is dense (first_k_dense_replace 1)


# ---- against the models transformers builds ----------------------------------------------------
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 300}
MLA = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
TINY = {
    "gemma": {**SMALL, "model_type": "gemma", "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 16},
    "gemma2": {**SMALL, "model_type": "gemma2", "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16},
    "gemma2_untied": {
        **SMALL,
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
    },
    "qwen3_tied": {
        **SMALL,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "mixtral": {**SMALL, "model_type": "mixtral", "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4},
    "qwen2_moe": {
        **SMALL,
        "model_type": "qwen2_moe",
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 80,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        **SMALL,
        "model_type": "qwen3_moe",
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
    },
    "deepseek_v2": {
        **SMALL,
        **MLA,
        "model_type": "deepseek_v2",
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
    },
    "deepseek_v3": {
        **SMALL,
        **MLA,
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
    },
}


def hf_model(config: dict):
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(config["model_type"], **kwargs))


@pytest.mark.parametrize("name", sorted(TINY))
def test_shape_matches_the_model_transformers_builds(name):
    config = TINY[name]
    model = hf_model(config)
    shape = shape_from_hf_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    real = shape_from_module(model)  # the engine's own unit cut
    assert [sorted(u) for u in shape.unit_tensors()] == [sorted(u) for u in real.unit_tensors()]
    assert shape.padded_numels(2) == real.padded_numels(2)


def test_tied_embeddings_follow_the_config_and_the_family_default():
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1000}
    embedding = 1000 * 64
    for model_type, tied_by_default in (("llama", False), ("qwen2", False), ("gemma", True), ("gemma2", True)):
        default = shape_from_hf_config({"model_type": model_type, **base}).num_params
        tied = shape_from_hf_config({"model_type": model_type, **base, "tie_word_embeddings": True}).num_params
        untied = shape_from_hf_config({"model_type": model_type, **base, "tie_word_embeddings": False}).num_params
        assert untied - tied == embedding
        assert default == (tied if tied_by_default else untied)


# ---- what it cannot count ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "t5", "d_model": 512},
        {"model_type": "falcon", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 300},
        {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 300},  # no model_type at all
    ],
)
def test_an_unknown_model_type_is_refused_by_name(config):
    with pytest.raises(ConfigError) as error:
        shape_from_hf_config(config)
    message = str(error.value)
    assert f"model_type {config.get('model_type', '')!r}" in message
    assert "mixtral" in message and "deepseek_v3" in message and "llama" in message  # the supported ones
    assert "parameter count" in message
    assert error.value.key == "model_type"


def test_a_dense_type_with_expert_fields_is_refused():
    config = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_experts": 8,
    }
    with pytest.raises(ConfigError, match="num_experts") as error:
        shape_from_hf_config(config)
    assert error.value.key == "num_experts"


def test_a_missing_field_names_it():
    with pytest.raises(ConfigError, match="num_local_experts") as error:
        shape_from_hf_config({**SMALL, "model_type": "mixtral", "num_hidden_layers": 2})
    assert error.value.key == "num_local_experts"


# ---- host bytes: the engine's own budget, on CUDA as on the CPU --------------------------------
def test_issue_12_figures_none_cpu_bf16():
    """The run of issue 12: memory_report() measured 13,783,040 host bytes on CUDA, 12,091,392 on the CPU."""
    shape = shape_from_hf_config(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        }
    )
    assert est.estimate_tiers(shape, "none", "cpu", precision="bf16", device="cuda").total("host") == 13_783_040
    assert est.estimate_tiers(shape, "none", "cpu", precision="bf16", device="cpu").total("host") == 12_091_392


def pages(nbytes: int) -> int:
    return max(4096, round_up(nbytes, 4096))


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 6),
    width=st.integers(1, 40),
    world=st.integers(1, 4),
    depth=st.integers(0, 4),
    buffers=st.one_of(st.none(), st.integers(2, 5)),
    placement=st.sampled_from(est.FIXED_PLACEMENTS),
    precision=st.sampled_from(["bf16", "fp32"]),
    device=st.sampled_from(["cuda", "cpu"]),
    sub_group_size=st.sampled_from([1024, 5000, 1 << 26, None]),
    state=st.sampled_from([FP32_STATE, StateBytes(StatePrecision.BF16, 2), StateBytes(StatePrecision.INT8, 2)]),
)
def test_host_estimate_is_host_budget_bytes_rounded_as_the_pool_allocates(
    layers, width, world, depth, buffers, placement, precision, device, sub_group_size, state
):
    """Every category of host_budget_bytes (called with staged_device_copies, sub_group_size and
    the state's widths as the engine does on that device) appears in the estimate, each buffer
    rounded up to whole 4 KiB pages; the NVMe slots are shaped as the engine shapes them (None:
    an unset key), each state kind one buffer of a piece, as wide as `state` stores it; the swap
    files likewise."""
    shape = ModelShape("t", (1000 * width, 7), (333 * width, 5, 17 * width), layers)
    param, optimizer = placement
    cb = est.COMPUTE_BYTES[precision]
    estimate = est.estimate_tiers(
        shape,
        param,
        optimizer,
        precision=precision,
        world_size=world,
        prefetch_depth=depth,
        buffer_count=buffers,
        device=device,
        sub_group_size=sub_group_size,
        state=state,
    )
    shards = shape.shard_numels(world)
    budget = host_budget_bytes(
        shards,
        param_tier=param,
        optimizer_tier=optimizer,
        compute_bytes=cb,
        buffer_count=buffers,
        prefetch_depth=depth,
        staged_device_copies=device == "cuda",
        sub_group_size=sub_group_size,
        state=state,
    )
    assert set(estimate.host) == set(budget)
    largest = max(shards)
    slots = shape_slots(shards, buffer_count=buffers, sub_group_size=sub_group_size)
    rounded = {
        "optimizer_state": sum(pages(state.kind_bytes(kind, n)) for n in shards for kind in STATE_KINDS),
        "optimizer_slots": slots.count * sum(pages(state.kind_bytes(kind, slots.piece)) for kind in STATE_KINDS),
        "grad_slot": pages(state.gradient_bytes * slots.piece),
        "param16": sum(pages(cb * n) for n in shards),
        "param_staging": (depth + 2) * pages(cb * largest),
        "grad_staging": 2 * pages(cb * largest),
    }
    for category, nbytes in budget.items():
        assert estimate.host[category] == rounded[category]
        assert 0 <= estimate.host[category] - nbytes < 4096 * (5 * len(shards) + 4 * slots.count + depth + 8)
    # the staged copies exist on CUDA only
    assert ("grad_staging" in estimate.host) == (device == "cuda")
    if optimizer == "nvme":
        weights = sum(4096 + pages(cb * n) for n in shards) if param == "nvme" else 0
        assert estimate.nvme["swap"] == weights + sum(swap_bytes_for_state(n, slots.piece, state) for n in shards)


def test_streamed_state_is_sized_in_pieces_of_sub_group_size():
    """The optimizer on NVMe: the host slots hold one piece per state kind, and each piece is its
    own swap file (a 4 KiB header and its data rounded up to 4 KiB), as the engine reserves them."""
    shape = ModelShape("t", (10_000,), (2500,), 2)
    assert shape.shard_numels() == [10_240, 4096, 4096]  # padded as the engine lays units out
    whole = est.estimate_tiers(shape, "none", "nvme", precision="bf16", buffer_count=3, device="cpu")
    assert whole.host["optimizer_slots"] == 3 * 4 * pages(4 * 10_240) and whole.host["grad_slot"] == pages(4 * 10_240)
    assert whole.nvme["swap"] == 4 * sum(4096 + pages(4 * n) for n in (10_240, 4096, 4096))
    # 3100 is cut down to whole norm blocks of 1024 elements (plan.optimizer_plan.whole_blocks): 3072
    pieces = est.estimate_tiers(shape, "none", "nvme", precision="bf16", buffer_count=3, device="cpu", sub_group_size=3100)
    assert pieces.host["optimizer_slots"] == 3 * 4 * pages(4 * 3072) and pieces.host["grad_slot"] == pages(4 * 3072)
    # 10,240 = 3 x 3072 + 1024 and 4096 = 3072 + 1024: eight swap files per state kind
    files = [3072, 3072, 3072, 1024, 3072, 1024, 3072, 1024]
    assert pieces.nvme["swap"] == 4 * sum(4096 + pages(4 * n) for n in files)
    with pytest.raises(ConfigError, match="sub_group_size must be >= 1024"):
        est.estimate_tiers(shape, "none", "nvme", sub_group_size=1000)


def test_report_and_recommended_config_carry_the_sub_group_size(tmp_path):
    import offload

    shape = shape_from_param_count(3 * 10**9)
    machine = Machine(gpu_bytes=24 << 30, ram_bytes=24 << 30, disk_bytes=200 * 10**9, device="cuda", nvme_path=str(tmp_path))
    report = est.estimate_report(shape, machine, sub_group_size=1 << 20)
    assert report["settings"]["sub_group_size"] == 1 << 20
    assert report["settings"]["nvme_slots"] == {"piece": 1 << 20, "count": 3}
    rows = {(r["param"], r["optimizer"]): r for r in report["placements"]}
    assert rows[("none", "nvme")]["host"]["by_category"]["grad_slot"] == 4 << 20
    assert report["recommended"]["optimizer"] == "auto"
    config = offload.load_config(report["recommended"]["config"])
    assert config.offload.sub_group_size == 1 << 20
    default = est.estimate_report(shape, machine)
    by_default = {(r["param"], r["optimizer"]): r for r in default["placements"]}
    # smaller pieces, smaller slots: more RAM for the state of units kept in it
    assert rows[("none", "nvme")]["host"]["total"] < by_default[("none", "nvme")]["host"]["total"]


def test_estimate_report_uses_the_machine_device():
    shape = shape_from_param_count(10**8, layers=4)
    cuda = est.estimate_report(shape, Machine(gpu_bytes=80 << 30, ram_bytes=1 << 40, disk_bytes=1 << 40))
    cpu = est.estimate_report(shape, Machine(gpu_bytes=None, ram_bytes=1 << 40, disk_bytes=1 << 40))
    assert (cuda["settings"]["device"], cpu["settings"]["device"]) == ("cuda", "cpu")
    host = {r["param"] + r["optimizer"]: r["host"]["by_category"] for r in cuda["placements"]}
    assert "grad_staging" in host["nonecpu"] and "param16" in host["nonecpu"]
    assert all("grad_staging" not in r["host"]["by_category"] for r in cpu["placements"])
    with pytest.raises(ConfigError, match="device"):
        est.estimate_tiers(shape, "none", "cpu", device="tpu")


# ---- the command line ---------------------------------------------------------------------------
def test_cli_counts_mixtral_and_reads_24gb_as_24_gib(tmp_path, capsys):
    code = cli_main(
        [
            "estimate",
            str(CONFIGS / "mixtral-8x7b-instruct-v0.1.json"),
            "--json",
            "--gpu-memory",
            "24GB",
            "--ram",
            "256GB",
            "--disk",
            "2TB",
            "--nvme-path",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["params"] == 46_702_792_704
    assert report["machine"]["gpu_bytes"] == 24 << 30
    assert report["machine"]["ram_bytes"] == 256 << 30
    assert report["machine"]["disk_bytes"] == 2 * 10**12
    notes = " ".join(report["machine"]["size_notes"])
    assert "--gpu-memory 24GB read as 25,769,803,776 bytes" in notes and "--disk 2TB" in notes
    assert report["settings"]["device"] == "cuda"
    rows = {(r["param"], r["optimizer"]): r for r in report["placements"]}
    assert not rows[("none", "cpu")]["fits"]  # 93 GB of bf16 weights cannot stay on a 24 GiB GPU
    assert report["recommended"] is None or report["recommended"]["param"] != "none"


def test_cli_table_prints_how_sizes_were_read(capsys):
    assert cli_main(["estimate", "7B", "--gpu-memory", "24GB", "--ram", "64GiB", "--disk", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "--gpu-memory 24GB read as" in out and "binary" in out
    assert "--ram 64GiB" not in out  # GiB is not ambiguous
    assert "on cuda" in out


def test_cli_device(capsys):
    assert cli_main(["estimate", "1B", "--json", "--gpu-memory", "80GB", "--device", "cpu", "--ram", "1TB", "--disk", "1TB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["device"] == "cpu" and report["machine"]["gpu_bytes"] is None
    assert cli_main(["estimate", "1B", "--gpu-memory", "none", "--device", "cuda"]) == 2
    assert "--device cuda needs" in capsys.readouterr().err


def test_cli_unknown_model_type_is_an_error_naming_it(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2}))
    assert cli_main(["estimate", str(path)]) == 2
    assert "model_type 'falcon'" in capsys.readouterr().err


def test_cli_no_strict_reads_a_config_with_keys_offload_cannot_honour(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}))
    assert cli_main(["estimate", "1B", "--config", str(ds), "--gpu-memory", "none", "--ram", "1TB", "--disk", "1TB"]) == 2
    assert "zero_quantized_weights" in capsys.readouterr().err
    assert (
        cli_main(["estimate", "1B", "--config", str(ds), "--no-strict", "--gpu-memory", "none", "--ram", "1TB", "--disk", "1TB"])
        == 0
    )
