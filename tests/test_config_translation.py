"""DeepSpeed, Hugging Face and accelerate configs as their documentation writes them load without
strict=False; the translators return plain data; errors carry the key; the DeepSpeed schedules
translate to a `scheduler` section whose arithmetic (`lr_at`, `betas_at`) is DeepSpeed's."""

from __future__ import annotations

import json
import logging
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import deepspeed as deepspeed_config
from offload.config import schema as config_module
from offload.config.deepspeed import Translation, translate_accelerate, translate_deepspeed
from offload.config.schema import Config, IOConfig, OffloadConfig, OptimizerConfig, SchedulerConfig, betas_at, load_config, lr_at
from offload.errors import ConfigError

DATA = Path(__file__).parent / "data" / "deepspeed"
LOGGER = "offload.config.deepspeed"


@pytest.fixture(autouse=True)
def _single_process_cpu(monkeypatch):
    """Deterministic environment: world size 1, and a machine without CUDA (bf16 runs on the CPU)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(deepspeed_config, "_bf16_supported", lambda: True)
    monkeypatch.setattr(deepspeed_config, "_cuda_available", lambda: False)


def translation_of(name: str) -> Translation:
    path = DATA / name
    return translate_accelerate(path) if path.suffix == ".yaml" else translate_deepspeed(json.loads(path.read_text()))


# ---- the documentation's configs ----------------------------------------------------------------
ZERO_TUNING = {
    "overlap_comm",
    "contiguous_gradients",
    "sub_group_size",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
}
LAUNCHER = {
    "compute_environment",
    "distributed_type",
    "fsdp_config",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "num_machines",
    "num_processes",
    "use_cpu",
}
HF_AUTO_OPTIMIZER = OptimizerConfig(type="adamw", lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
HF_AUTO_WARMUP = SchedulerConfig(type="warmup", warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=0)
DECAY_AUTO = SchedulerConfig(type="warmup_decay", warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=0, total_num_steps=None)

DOCS = {
    # DeepSpeed ZeRO-Offload tutorial: ZeRO-2, optimizer on the CPU
    "ds_docs_zero_offload_stage2.json": (
        Config(precision="fp32", optimizer=OptimizerConfig(), offload=OffloadConfig(param="none", optimizer="cpu")),
        {"zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm"},
    ),
    # DeepSpeed ZeRO tutorial, ZeRO-Infinity with CPU offload: ZeRO-3, parameters and optimizer on the CPU
    "ds_docs_zero_infinity_cpu_stage3.json": (
        Config(precision="fp32", offload=OffloadConfig(param="cpu", optimizer="cpu")),
        {
            f"zero_optimization.{k}"
            for k in (
                "contiguous_gradients",
                "stage3_max_live_parameters",
                "stage3_max_reuse_distance",
                "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold",
                "reduce_bucket_size",
                "sub_group_size",
            )
        },
    ),
    # Hugging Face DeepSpeed guide, ZeRO-2 with the optimizer on the CPU
    "hf_docs_zero2.json": (
        Config(precision="fp32", offload=OffloadConfig(param="none", optimizer="cpu", pin_memory=True)),
        {
            f"zero_optimization.{k}"
            for k in (
                "allgather_partitions",
                "allgather_bucket_size",
                "overlap_comm",
                "reduce_scatter",
                "reduce_bucket_size",
                "contiguous_gradients",
                "round_robin_gradients",
            )
        },
    ),
    # Hugging Face DeepSpeed guide, the notebook's full ZeRO-3 config (fp16 "auto": fp32 without a GPU)
    "hf_docs_zero3_notebook.json": (
        Config(
            precision="fp32",
            optimizer=HF_AUTO_OPTIMIZER,
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="cpu", optimizer="cpu", pin_memory=True),
            scheduler=HF_AUTO_WARMUP,
        ),
        {f"zero_optimization.{k}" for k in ZERO_TUNING}
        | {"steps_per_print", "wall_clock_breakdown"}
        | {f"fp16.{k}" for k in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale")},
    ),
    # Hugging Face DeepSpeed guide, ZeRO-Infinity: parameters and optimizer on NVMe
    "hf_docs_zero3_nvme.json": (
        Config(
            precision="fp32",
            optimizer=HF_AUTO_OPTIMIZER,
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            # sub_group_size 1e9 (DeepSpeed's default) is mapped: the optimizer state is on NVMe
            offload=OffloadConfig(
                param="nvme", optimizer="nvme", nvme_path="/local_nvme", pin_memory=True, buffer_count=5, sub_group_size=10**9
            ),
            io=IOConfig(block_size=262144, queue_depth=32, threads=1),
            scheduler=HF_AUTO_WARMUP,
        ),
        {f"zero_optimization.{k}" for k in ZERO_TUNING - {"sub_group_size"}}
        | {"steps_per_print", "wall_clock_breakdown"}
        | {f"fp16.{k}" for k in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale")}
        | {
            "zero_optimization.offload_optimizer.fast_init",
            "zero_optimization.offload_param.buffer_size",
            "zero_optimization.offload_param.max_in_cpu",
            "zero_optimization.aio.single_submit",
            "zero_optimization.aio.overlap_events",
        },
    ),
    # accelerate DeepSpeed plugin, ZeRO-2
    "accelerate_docs_zero2_plugin.yaml": (
        Config(
            precision="fp16",
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="none", optimizer="auto"),
        ),
        LAUNCHER | {"deepspeed_config.zero3_init_flag"},
    ),
    # accelerate DeepSpeed plugin, ZeRO-3 with CPU offload
    "accelerate_docs_zero3_cpu_plugin.yaml": (
        Config(
            precision="fp16",
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="cpu", optimizer="cpu"),
        ),
        LAUNCHER | {"deepspeed_config.zero3_init_flag", "deepspeed_config.zero3_save_16bit_model"},
    ),
    # accelerate with a DeepSpeed config file, ZeRO-3 with CPU offload
    "accelerate_docs_zero3_offload_file.yaml": (
        Config(
            precision="fp16",
            optimizer=OptimizerConfig(type="adamw", lr=5e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="cpu", optimizer="cpu", pin_memory=True),
            scheduler=DECAY_AUTO,
        ),
        LAUNCHER
        | {"deepspeed_config.zero3_init_flag", "fp16.hysteresis", "steps_per_print", "wall_clock_breakdown"}
        | {f"zero_optimization.{k}" for k in ZERO_TUNING},
    ),
    # accelerate with a DeepSpeed config file, ZeRO-2
    "accelerate_docs_zero2_file.yaml": (
        Config(
            precision="fp16",
            optimizer=OptimizerConfig(type="adamw", lr=5e-5, weight_decay=0.0),
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="none", optimizer="auto"),
            scheduler=DECAY_AUTO,
        ),
        LAUNCHER
        | {
            "deepspeed_config.zero3_init_flag",
            "fp16.hysteresis",
            "steps_per_print",
            "wall_clock_breakdown",
            "optimizer.params.torch_adam",
        }
        | {
            f"zero_optimization.{k}"
            for k in (
                "allgather_partitions",
                "allgather_bucket_size",
                "overlap_comm",
                "reduce_scatter",
                "reduce_bucket_size",
                "contiguous_gradients",
            )
        },
    ),
}


@pytest.mark.parametrize("name", sorted(DOCS))
def test_documented_config_loads_strictly_to_the_right_placement(name, caplog):
    expected, ignored = DOCS[name]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = load_config(DATA / name)  # strict, the default
    assert config == expected
    translation = translation_of(name)
    assert translation.unsupported == []
    assert {key for key, _ in translation.ignored} == ignored
    # ONE INFO line names every ignored key, each with a reason
    [line] = [r for r in caplog.records if r.name == LOGGER and "ignoring" in r.getMessage()]
    assert line.levelno == logging.INFO and "\n" not in line.getMessage()
    assert all(key in line.getMessage() for key in ignored)
    assert all(why for _, why in translation.ignored)
    # no other warning than the one that lists the "auto" values
    others = [r for r in caplog.records if r.levelno >= logging.WARNING and "'auto'" not in r.getMessage()]
    assert others == []


def test_auto_values_are_one_warning_naming_each_and_its_value(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_config(DATA / "hf_docs_zero3_nvme.json")
    [record] = [r for r in caplog.records if "'auto'" in r.getMessage()]
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    autos = {key for key, _ in translation_of("hf_docs_zero3_nvme.json").auto}
    assert autos == {
        "fp16.enabled",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
    }
    assert all(f"{key} -> " in text for key in autos)
    assert "fp16.enabled -> false (no GPU: fp32)" in text


def test_auto_precision_on_a_gpu(monkeypatch):
    monkeypatch.setattr(deepspeed_config, "_cuda_available", lambda: True)
    assert load_config(DATA / "hf_docs_zero3_nvme.json").precision == "fp16"  # fp16 "auto" with a GPU present


def test_accelerate_total_num_steps_auto_loads_and_lr_at_names_the_key():
    config = load_config(DATA / "accelerate_docs_zero3_offload_file.yaml")
    assert config.scheduler.total_num_steps is None
    with pytest.raises(ConfigError, match="scheduler.total_num_steps") as error:
        lr_at(0, config.scheduler, config.optimizer.lr)
    assert error.value.key == "scheduler.total_num_steps"
    config.scheduler.total_num_steps = 100
    assert lr_at(50, config.scheduler, config.optimizer.lr) == pytest.approx(5e-5 * 51 / 98)


# ---- what is ignored, what is refused ----------------------------------------------------------
def ds(**top):
    return {"zero_optimization": {"stage": 2}, **top}


@pytest.mark.parametrize(
    "mapping, key",
    [
        (ds(zero_optimization={"stage": 3, "zero_quantized_weights": True}), "zero_optimization.zero_quantized_weights"),
        (ds(zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.05}}), "zero_optimization.zenflow"),
        (ds(compression_training={"weight_quantization": {}}), "compression_training"),
        (ds(curriculum_learning={"enabled": True}), "curriculum_learning"),
        (ds(amp={"enabled": True}), "amp"),
        (ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}), "bf16.bf16_master_weights_and_grads"),
        (ds(bf16={"enabled": True}, communication_data_type="fp32"), "communication_data_type"),
        (ds(data_types={"grad_accum_dtype": "bf16"}), "data_types"),
        (ds(zero_optimizaton={}), "zero_optimizaton"),
    ],
)
def test_what_cannot_be_honoured_is_one_error_naming_the_key(mapping, key):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert error.value.key == key
    assert "cannot honour" in str(error.value) and "strict=False" in str(error.value)


@pytest.mark.parametrize(
    "mapping, key",
    [
        (ds(zero_optimization={"stage": 3, "zero_quantized_weights": False}), "zero_optimization.zero_quantized_weights"),
        (
            ds(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1}}),
            "zero_optimization.offload_optimizer.ratio",
        ),
        (ds(curriculum_learning={"enabled": False}), "curriculum_learning"),
        (ds(amp={"enabled": "auto", "opt_level": "auto"}), "amp"),
        (ds(bf16={"enabled": True}, communication_data_type="bf16"), "communication_data_type"),
        (ds(data_types={"grad_accum_dtype": "fp32"}), "data_types"),
        (ds(activation_checkpointing={"partition_activations": True}), "activation_checkpointing"),
        (ds(flops_profiler={"enabled": True}), "flops_profiler"),
        (ds(zero_force_ds_cpu_optimizer=False), "zero_force_ds_cpu_optimizer"),
    ],
)
def test_switched_off_features_and_tuning_are_ignored(mapping, key):
    load_config(mapping)
    assert key in {k for k, _ in translate_deepspeed(mapping).ignored}


def test_not_strict_drops_what_cannot_be_honoured_with_one_warning(caplog):
    mapping = ds(zero_optimization={"stage": 3, "zero_quantized_gradients": True, "overlap_comm": True}, steps_per_prnt=10)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = load_config(mapping, strict=False)
    assert config.offload == OffloadConfig()
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "zero_optimization.zero_quantized_gradients" in warning.getMessage()
    assert "steps_per_prnt" in warning.getMessage() and "did you mean 'steps_per_print'?" in warning.getMessage()


def test_values_that_contradict_the_maths_are_errors_even_when_not_strict():
    for mapping, key in [
        (ds(optimizer={"type": "Adam", "params": {"amsgrad": True}}), "optimizer.params.amsgrad"),
        (ds(fp16={"enabled": True, "loss_scale": 128}), "fp16.loss_scale"),
        (ds(aio={"use_gds": True}), "aio.use_gds"),
        (ds(optimizer={"type": "Lamb", "params": {}}), "optimizer.type"),
        (ds(scheduler={"type": "Cyclic", "params": {}}), "scheduler.type"),
    ]:
        with pytest.raises(ConfigError) as error:
            load_config(mapping, strict=False)
        assert error.value.key == key


# ---- the optimizer type -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["AdamW", "ADAMW", "adamw", "Adamw"])
def test_adamw_spellings_are_adamw_in_both_schemas(kind):
    assert load_config({"optimizer": {"type": kind}}).optimizer.type == "adamw"
    assert load_config(ds(optimizer={"type": kind, "params": {}})).optimizer.type == "adamw"


def test_misspelt_choices_suggest_the_right_value():
    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        load_config({"optimizer": {"type": "AdamWW"}})
    with pytest.raises(ConfigError, match="did you mean 'warmup_cosine'") as error:
        load_config({"scheduler": {"type": "WarmupCosineLR"}})
    assert error.value.key == "scheduler.type"
    assert load_config({"precision": "BF16"}).precision == "bf16"


# ---- plain data, one validation, errors with keys ------------------------------------------------
def test_translators_import_nothing_of_offload_config():
    code = (
        "import sys, offload.config.deepspeed as d, json; "
        "t = d.translate_deepspeed(json.load(open(sys.argv[1]))); "
        "assert 'offload.config.schema' not in sys.modules, 'offload.config.schema was imported'; "
        "assert isinstance(t.config, dict) and isinstance(t.sources, dict); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(DATA / "hf_docs_zero3_nvme.json")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_deepspeed_config_is_validated_once(monkeypatch):
    calls = []
    real = config_module.validate
    monkeypatch.setattr(config_module, "validate", lambda config: calls.append(1) or real(config))
    load_config(DATA / "hf_docs_zero3_nvme.json")
    assert len(calls) == 1


@pytest.mark.parametrize(
    "mapping, key",
    [
        ({"precison": "bf16"}, "precison"),
        ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas[1]"),
        ({"io": {"block_size": 1000}}, "io.block_size"),
        ({"scheduler": {"type": "one_cycle"}}, "scheduler.cycle_min_lr"),
        ({"aio": {"block_size": 1000}}, "aio.block_size"),  # translated: the DeepSpeed key
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}, "zero_optimization": {}}, "optimizer.params.betas"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
    ],
)
def test_config_errors_carry_the_users_key(mapping, key):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert error.value.key == key
    assert f"'{key}'" in str(error.value)


def test_accelerate_errors_carry_the_accelerate_key(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 0\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert error.value.key == "deepspeed_config.gradient_accumulation_steps"


def test_config_error_keeps_its_key_through_pickle():
    error = pickle.loads(pickle.dumps(ConfigError("bad", key="io.threads")))
    assert (str(error), error.key) == ("bad", "io.threads")
    assert isinstance(error, ValueError)


def test_offload_scheduler_section_is_not_taken_for_deepspeed():
    config = load_config({"scheduler": {"type": "warmup_cosine", "total_num_steps": 100, "warmup_num_steps": 10}})
    assert config.scheduler == SchedulerConfig(type="warmup_cosine", total_num_steps=100, warmup_num_steps=10)


# ---- DeepSpeed's scheduler section ---------------------------------------------------------------
@pytest.mark.parametrize(
    "section, expected",
    [
        ({"type": "WarmupLR", "params": {}}, SchedulerConfig(type="warmup")),
        (
            {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "warmup_type": "linear"},
            },
            SchedulerConfig(type="warmup", warmup_min_lr=1e-6, warmup_max_lr=1e-3, warmup_num_steps=100, warmup_type="linear"),
        ),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}},
            SchedulerConfig(type="warmup_decay", total_num_steps=1000, warmup_max_lr=0.001),
        ),  # DeepSpeed's default max lr
        (
            {"type": "warmupcosinelr", "params": {"total_num_steps": 500, "warmup_num_steps": 50, "cos_min_ratio": 0.1}},
            SchedulerConfig(type="warmup_cosine", total_num_steps=500, warmup_num_steps=50, cos_min_ratio=0.1),
        ),
        (
            {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100, "cycle_momentum": False},
            },
            SchedulerConfig(
                type="one_cycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=100, cycle_momentum=False
            ),
        ),
        (
            {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_staircase": True}},
            SchedulerConfig(type="lr_range_test", lr_range_test_min_lr=1e-5, lr_range_test_staircase=True),
        ),
    ],
)
def test_deepspeed_scheduler_translates(section, expected):
    assert load_config(ds(scheduler=section)).scheduler == expected


def test_deepspeed_scheduler_errors():
    with pytest.raises(ConfigError) as error:
        load_config(ds(scheduler={"type": "WarmupDecayLR", "params": {}}))
    assert error.value.key == "scheduler.params.total_num_steps"
    with pytest.raises(ConfigError) as error:
        load_config(ds(scheduler={"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}))
    assert error.value.key == "scheduler.params.cycle_min_lr"
    with pytest.raises(ConfigError) as error:  # WarmupCosineLR has ratios, not warmup_min_lr
        load_config(ds(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_lr": 0}}))
    assert error.value.key == "scheduler.params.warmup_min_lr"
    with pytest.raises(ConfigError) as error:
        load_config(ds(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}))
    assert error.value.key == "scheduler.params.warmup_type"
    with pytest.raises(ConfigError) as error:
        load_config(ds(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": -1}}))
    assert error.value.key == "scheduler.params.warmup_num_steps"


# ---- lr_at / betas_at against DeepSpeed's formulas -----------------------------------------------
# DeepSpeed advances its schedule after each applied update, so update k runs at last_batch_iteration
# k - 1; each expected value below is DeepSpeed's formula worked by hand at that iteration.
def test_warmup_log_and_linear():
    log_ = SchedulerConfig(type="warmup", warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    assert lr_at(0, log_, 1.0) == 0.0  # before the first advance: warmup_min_lr
    assert lr_at(1, log_, 1.0) == 0.0  # log(0 + 1) = 0
    assert lr_at(2, log_, 1.0) == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert lr_at(10, log_, 1.0) == pytest.approx(0.1)
    assert lr_at(500, log_, 1.0) == 0.1
    linear = SchedulerConfig(type="warmup", warmup_min_lr=0.01, warmup_max_lr=None, warmup_num_steps=10, warmup_type="linear")
    assert lr_at(6, linear, 0.11) == pytest.approx(0.01 + 0.10 * 5 / 10)  # warmup_max_lr null: the optimizer's lr
    assert lr_at(11, linear, 0.11) == pytest.approx(0.11)
    # fewer than 2 warmup steps are 2, as in DeepSpeed
    short = SchedulerConfig(type="warmup", warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0)
    assert [lr_at(k, short, 1.0) for k in range(4)] == [0.0, 0.0, 1.0, 1.0]


def test_warmup_decay():
    s = SchedulerConfig(
        type="warmup_decay", warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear", total_num_steps=20
    )
    assert lr_at(6, s, 1.0) == pytest.approx(0.05)
    assert lr_at(11, s, 1.0) == pytest.approx(0.1)  # (20 - 10) / (20 - 10)
    assert lr_at(16, s, 1.0) == pytest.approx(0.05)  # (20 - 15) / 10
    assert lr_at(21, s, 1.0) == 0.0
    assert lr_at(40, s, 1.0) == 0.0


def test_warmup_cosine():
    s = SchedulerConfig(
        type="warmup_cosine",
        warmup_min_ratio=0.0,
        cos_min_ratio=0.0,
        warmup_num_steps=10,
        warmup_type="linear",
        total_num_steps=20,
    )
    assert lr_at(0, s, 0.1) == 0.0  # DeepSpeed's WarmupCosineLR starts at 0 before its first advance
    assert lr_at(6, s, 0.1) == pytest.approx(0.05)
    assert lr_at(11, s, 0.1) == pytest.approx(0.1 * (1 + math.cos(math.pi * 0.1)) / 2)
    assert lr_at(20, s, 0.1) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(30, s, 0.1) == pytest.approx(0.0, abs=1e-15)  # held at the floor past the end
    floor = SchedulerConfig(
        type="warmup_cosine",
        warmup_min_ratio=0.5,
        cos_min_ratio=0.2,
        warmup_num_steps=10,
        warmup_type="linear",
        total_num_steps=20,
    )
    assert lr_at(1, floor, 1.0) == pytest.approx(0.5)
    assert lr_at(25, floor, 1.0) == pytest.approx(0.2)


def test_one_cycle_lr_and_momentum():
    s = SchedulerConfig(type="one_cycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)
    expected = {0: 0.01, 5: 0.055, 10: 0.1, 15: 0.055, 19: 0.019, 20: 0.01, 21: 0.01, 100: 0.01}
    assert {k: lr_at(k, s, 1.0) for k in expected} == pytest.approx(expected)
    moms = {0: 0.8, 5: 0.85, 10: 0.8, 21: 0.9}  # step 0: DeepSpeed's constructor writes cycle_min_mom
    assert {k: betas_at(k, s, (0.9, 0.999))[0] for k in moms} == pytest.approx(moms)
    assert betas_at(5, s, (0.9, 0.999))[1] == 0.99
    off = SchedulerConfig(type="one_cycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_momentum=False)
    assert betas_at(5, off, (0.9, 0.999)) == (0.9, 0.999)
    decay = SchedulerConfig(
        type="one_cycle",
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=10,
        decay_lr_rate=0.5,
        decay_step_size=5,
        decay_mom_rate=0.01,
    )
    assert lr_at(26, decay, 1.0) == pytest.approx(0.01 / (1 + 0.5 * 6 / 5))
    assert betas_at(26, decay, (0.9, 0.999))[0] == pytest.approx(0.9 * (1 + 0.01 * 6 / 5))
    stairs = SchedulerConfig(
        type="one_cycle", cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=10, cycle_first_stair_count=2
    )
    assert [lr_at(k, stairs, 1.0) for k in (4, 5, 7, 10)] == pytest.approx([0.0, 0.5, 0.5, 1.0])


def test_lr_range_test():
    s = SchedulerConfig(type="lr_range_test", lr_range_test_min_lr=0.001, lr_range_test_step_size=10)
    assert [lr_at(k, s, 1.0) for k in (0, 5, 10)] == pytest.approx([0.001, 0.0015, 0.002])
    stairs = SchedulerConfig(
        type="lr_range_test", lr_range_test_min_lr=0.001, lr_range_test_step_size=10, lr_range_test_staircase=True
    )
    assert [lr_at(k, stairs, 1.0) for k in (0, 5, 10)] == pytest.approx([0.001, 0.001, 0.002])


def test_no_schedule_is_the_optimizer_lr():
    assert lr_at(123, SchedulerConfig(), 3e-4) == 3e-4
    assert betas_at(7, SchedulerConfig(), (0.9, 0.95)) == (0.9, 0.95)


@settings(max_examples=60, deadline=None)
@given(
    low=st.floats(0, 1e-2),
    high=st.floats(1e-2, 1),
    warmup=st.integers(0, 50),
    total=st.integers(1, 200),
    kind=st.sampled_from(["log", "linear"]),
    step=st.integers(0, 400),
)
def test_schedules_stay_in_their_bounds(low, high, warmup, total, kind, step):
    warm = SchedulerConfig(type="warmup", warmup_min_lr=low, warmup_max_lr=high, warmup_num_steps=warmup, warmup_type=kind)
    assert low - 1e-12 <= lr_at(step, warm, 1.0) <= high + 1e-12
    assert lr_at(step, warm, 1.0) <= lr_at(step + 1, warm, 1.0) + 1e-12  # warmup never falls
    decay = SchedulerConfig(
        type="warmup_decay",
        warmup_min_lr=low,
        warmup_max_lr=high,
        warmup_num_steps=warmup,
        warmup_type=kind,
        total_num_steps=total,
    )
    assert 0.0 <= lr_at(step, decay, 1.0) <= high + 1e-12
    cosine = SchedulerConfig(type="warmup_cosine", warmup_num_steps=warmup, warmup_type=kind, total_num_steps=total)
    assert 0.0 <= lr_at(step, cosine, high) <= high + 1e-12
    cycle = SchedulerConfig(type="one_cycle", cycle_min_lr=low, cycle_max_lr=high, cycle_first_step_size=max(1, warmup))
    assert low - 1e-12 <= lr_at(step, cycle, 1.0) <= high + 1e-12
