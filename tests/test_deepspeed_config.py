"""DeepSpeed / accelerate config translation: real-world-shaped configs load to the expected Config,
tuning and logging keys are listed in one INFO line, keys offload cannot honour are all named in one
message, values that contradict offload's maths are errors."""

import copy
import json
import logging
import re
from pathlib import Path

import pytest

from offload.config import deepspeed as deepspeed_config
from offload.config.deepspeed import translate, translate_deepspeed
from offload.config.schema import (
    Config,
    IOConfig,
    LossScaleConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    load_config,
)
from offload.errors import ConfigError

DATA = Path(__file__).parent / "data" / "deepspeed"


@pytest.fixture(autouse=True)
def _single_process_cpu(monkeypatch):
    """Deterministic environment: world size 1 and a machine without CUDA (bf16 runs on the CPU)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(deepspeed_config, "_bf16_supported", lambda: True)
    monkeypatch.setattr(deepspeed_config, "_cuda_available", lambda: False)


def load_accelerate_config(path, strict=True):
    return load_config(path, strict=strict)


def ignored_keys(mapping: dict) -> set[str]:
    return {key for key, _ in translate_deepspeed(mapping).ignored}


def the_ignored_line(caplog) -> str:
    """The one INFO line that lists the ignored keys."""
    [record] = [r for r in caplog.records if r.name == "offload.config.deepspeed" and "ignoring" in r.getMessage()]
    assert record.levelno == logging.INFO
    return record.getMessage()


def listed_keys(message: str) -> set[str]:
    """The keys named in the one 'cannot honour' message (lines '  - key, key: why')."""
    keys = set()
    for line in message.splitlines():
        match = re.match(r"\s+- (.+?): ", line)
        if match:
            keys.update(k.strip() for k in match.group(1).split(","))
    return keys


TUNING3 = {
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
# the fp16 section of the Hugging Face examples, ignored once "auto" resolves it to disabled
DISABLED_FP16 = {
    "fp16.loss_scale",
    "fp16.loss_scale_window",
    "fp16.initial_scale_power",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
}

CASES = {
    "hf_ds_config_zero2.json": (
        Config(
            precision="bf16",
            # "auto": the Hugging Face Trainer's defaults (lr 5e-5, max_grad_norm 1.0, warmup 0 steps)
            optimizer=OptimizerConfig(type="adamw", lr=5e-5),
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="none", optimizer="cpu", pin_memory=True),
            scheduler=SchedulerConfig(type="warmup", warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=0),
        ),
        {
            "steps_per_print",
            "wall_clock_breakdown",
            "zero_optimization.allgather_partitions",
            "zero_optimization.allgather_bucket_size",
            "zero_optimization.overlap_comm",
            "zero_optimization.reduce_scatter",
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.contiguous_gradients",
        }
        | DISABLED_FP16,
    ),
    "hf_ds_config_zero3.json": (
        Config(
            precision="bf16",
            optimizer=OptimizerConfig(type="adamw", lr=5e-5),
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="cpu", optimizer="cpu", pin_memory=True),
            scheduler=SchedulerConfig(type="warmup", warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=0),
        ),
        {
            "steps_per_print",
            "wall_clock_breakdown",
            "zero_optimization.overlap_comm",
            "zero_optimization.contiguous_gradients",
            "zero_optimization.reduce_bucket_size",
        }
        | TUNING3
        | DISABLED_FP16,
    ),
    "zero_infinity_nvme_aio_thread_count.json": (
        Config(
            precision="bf16",
            optimizer=OptimizerConfig(type="adamw", lr=3e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
            gradient_accumulation_steps=8,  # derived: 32 / (4 * world 1)
            gradient_clipping=1.0,
            # sub_group_size 1e12: mapped (the optimizer is on NVMe), pieces as large as the units
            offload=OffloadConfig(
                param="nvme", optimizer="nvme", nvme_path="/local_nvme", pin_memory=True, buffer_count=5, sub_group_size=10**12
            ),
            io=IOConfig(block_size=1048576, queue_depth=16, threads=2),
        ),
        {
            "steps_per_print",
            "wall_clock_breakdown",
            "zero_optimization.offload_param.buffer_size",
            "zero_optimization.offload_param.max_in_cpu",
            "zero_optimization.offload_optimizer.fast_init",
            "aio.single_submit",
            "aio.overlap_events",
        }
        | (TUNING3 - {"zero_optimization.sub_group_size"}),
    ),
    "zero_infinity_nvme_aio_intra_op.json": (
        Config(
            precision="bf16",
            optimizer=OptimizerConfig(type="adamw", lr=2e-5, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
            gradient_accumulation_steps=4,
            offload=OffloadConfig(param="cpu", optimizer="nvme", nvme_path="/mnt/nvme0/offload", pin_memory=True, buffer_count=4),
            io=IOConfig(block_size=262144, queue_depth=32, threads=8),
        ),
        {
            "steps_per_print",
            "zero_optimization.overlap_comm",
            "zero_optimization.contiguous_gradients",
            "zero_optimization.stage3_max_live_parameters",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.offload_optimizer.pipeline_read",
            "zero_optimization.offload_optimizer.pipeline_write",
            "aio.single_submit",
            "aio.overlap_events",
            "aio.use_gds",
        },
    ),
    "stage2_cpu_offload.json": (
        Config(
            precision="bf16",
            # type Adam with adam_w_mode false: L2 weight decay, i.e. offload's "adam".
            optimizer=OptimizerConfig(type="adam", lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01),
            gradient_accumulation_steps=2,
            gradient_clipping=0.5,
            offload=OffloadConfig(param="none", optimizer="cpu", pin_memory=False),
        ),
        set(),
    ),
    "fp16_loss_scale.json": (
        Config(
            precision="fp16",
            optimizer=OptimizerConfig(type="adamw", lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
            gradient_accumulation_steps=4,
            gradient_clipping=1.0,
            offload=OffloadConfig(param="none", optimizer="cpu", pin_memory=True),
            loss_scale=LossScaleConfig(initial=4096.0, growth_interval=500, min_scale=2.0),
        ),
        {
            "zero_allow_untested_optimizer",
            "zero_optimization.contiguous_gradients",
            "zero_optimization.overlap_comm",
            "fp16.auto_cast",
            "fp16.hysteresis",
            "fp16.consecutive_hysteresis",
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_config_loads_to_expected_config(name, caplog):
    expected, ignored = CASES[name]
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        config = load_config(DATA / name)  # strict: tuning and logging keys are not errors
    assert config == expected
    assert ignored_keys(json.loads((DATA / name).read_text())) == ignored
    if ignored:
        line = the_ignored_line(caplog)
        assert "\n" not in line
        assert all(key in line for key in ignored)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "'auto'" not in r.getMessage()]
    assert warned == []


def test_clean_config_loads_strictly_and_translate_returns_a_dict():
    mapping = json.loads((DATA / "stage2_cpu_offload.json").read_text())
    before = copy.deepcopy(mapping)
    out = translate(mapping)
    assert isinstance(out, dict) and "zero_optimization" not in out
    assert mapping == before, "translate must not modify its input"
    assert load_config(out) == CASES["stage2_cpu_offload.json"][0]
    assert load_config(mapping) == CASES["stage2_cpu_offload.json"][0]


def test_reasons_are_given_in_the_ignored_line(caplog):
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        load_config(DATA / "hf_ds_config_zero3.json")
    line = the_ignored_line(caplog)
    assert "sizes each unit's buffers exactly" in line
    assert "logging, profiling and monitoring" in line


def test_hf_auto_precision_on_a_gpu_without_bf16_gives_fp16(monkeypatch):
    monkeypatch.setattr(deepspeed_config, "_bf16_supported", lambda: False)
    monkeypatch.setattr(deepspeed_config, "_cuda_available", lambda: True)
    config = load_config(DATA / "hf_ds_config_zero2.json", strict=False)
    expected = copy.deepcopy(CASES["hf_ds_config_zero2.json"][0])
    expected.precision = "fp16"
    assert config == expected
    # The fp16 section is now live: its hysteresis is ignored (it only delays the back-off), the rest is read.
    assert load_config(DATA / "hf_ds_config_zero2.json") == expected
    assert {"fp16.hysteresis"} == ignored_keys(json.loads((DATA / "hf_ds_config_zero2.json").read_text())) & DISABLED_FP16


def test_auto_precision_without_bf16_or_gpu_is_fp32(monkeypatch):
    monkeypatch.setattr(deepspeed_config, "_bf16_supported", lambda: False)
    cfg = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    assert load_config(cfg).precision == "fp32"


def test_auto_values_are_resolved_loudly_in_one_warning(caplog):
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        load_config(DATA / "hf_ds_config_zero3.json")
    [record] = [r for r in caplog.records if "'auto'" in r.getMessage()]
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    for named in (
        "gradient_clipping -> 1.0",
        "gradient_accumulation_steps -> 1",
        "optimizer.params.lr -> 5e-05",
        "optimizer.params.betas -> [0.9, 0.999]",
        "bf16.enabled -> true",
        "scheduler.params.warmup_num_steps -> 0",
        "scheduler.params.warmup_max_lr -> the optimizer's lr",
    ):
        assert named in text


# -- optimizer ---------------------------------------------------------------------------


def ds(**top):
    """A minimal DeepSpeed config (recognised by its zero_optimization section)."""
    return {"zero_optimization": {"stage": 2}, **top}


@pytest.mark.parametrize(
    "kind, params, expected",
    [
        ("Adam", {}, "adamw"),  # DeepSpeed's default adam_w_mode is true
        ("adam", {"adam_w_mode": True}, "adamw"),
        ("Adam", {"adam_w_mode": False}, "adam"),
        ("AdamW", {}, "adamw"),
        ("adamw", {}, "adamw"),
        ("CPUAdam", {}, "adamw"),
        ("DeepSpeedCPUAdam", {"adam_w_mode": False}, "adam"),
        ("FusedAdam", {}, "adamw"),
    ],
)
def test_optimizer_type_and_adam_w_mode(kind, params, expected):
    config = load_config(ds(optimizer={"type": kind, "params": {"lr": 0.01, **params}}))
    assert config.optimizer == OptimizerConfig(type=expected, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_absent_optimizer_params_take_deepspeed_defaults():
    config = load_config(ds(optimizer={"type": "AdamW"}))
    assert config.optimizer == OptimizerConfig(type="adamw", lr=1e-3)


def test_adamw_with_adam_w_mode_false_stays_adamw_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="offload.config.deepspeed"):
        config = load_config(ds(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}))
    assert config.optimizer.type == "adamw"
    assert "adam_w_mode false has no effect" in caplog.text


@pytest.mark.parametrize("kind", ["Lamb", "OneBitAdam", "SGD", "Lion"])
def test_other_optimizer_types_are_errors_naming_the_type(kind):
    with pytest.raises(ConfigError, match=rf"optimizer\.type.*'{kind}'"):
        load_config(ds(optimizer={"type": kind, "params": {}}), strict=False)


def test_optimizer_errors():
    with pytest.raises(ConfigError, match="amsgrad"):
        load_config(ds(optimizer={"type": "Adam", "params": {"amsgrad": True}}), strict=False)
    with pytest.raises(ConfigError, match="max_grad_norm.*gradient_clipping"):
        load_config(ds(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}), strict=False)
    with pytest.raises(ConfigError, match="optimizer.params"):
        load_config(ds(optimizer={"type": "AdamW", "lr": 1e-3}))
    with pytest.raises(ConfigError, match=r"must be >= 0.*DeepSpeed key 'optimizer\.params\.lr'"):
        load_config(ds(optimizer={"type": "AdamW", "params": {"lr": -1.0}}))
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas"):
        load_config(ds(optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.5]}}))
    # torch_adam only picks an implementation of the same maths: ignored either way.
    assert load_config(ds(optimizer={"type": "Adam", "params": {"torch_adam": False}})).optimizer.type == "adamw"
    assert load_config(ds(optimizer={"type": "Adam", "params": {"torch_adam": True}})).optimizer.type == "adamw"
    assert ignored_keys(ds(optimizer={"type": "Adam", "params": {"torch_adam": True}})) == {"optimizer.params.torch_adam"}


# -- zero_optimization -------------------------------------------------------------------


def test_stage_rules():
    # no offload_optimizer: DeepSpeed keeps the state on the accelerator; here `auto` picks the tier
    assert load_config({"zero_optimization": {"stage": 3}}).offload == OffloadConfig(param="none", optimizer="auto")
    assert load_config({"zero_optimization": {"stage": 0}}).offload == OffloadConfig(param="none", optimizer="auto")
    with pytest.raises(ConfigError, match="stage 0 cannot offload"):
        load_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, strict=False)
    with pytest.raises(ConfigError, match=r"offload_param.*needs zero_optimization.stage 3"):
        load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, strict=False)
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage.*0, 1, 2 or 3"):
        load_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match=r"offload_param\.device.*'gpu'"):
        load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})


def test_device_none_section_is_ignored_like_deepspeed(caplog):
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "none", "pin_memory": False, "buffer_size": 1e8},
            "offload_optimizer": {"device": "none"},
        }
    }
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        config = load_config(cfg)
    assert config.offload == OffloadConfig(param="none", optimizer="auto", pin_memory=True)
    assert ignored_keys(cfg) == {"zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.buffer_size"}
    assert "device is 'none'" in the_ignored_line(caplog)


def test_nvme_paths_must_agree():
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/a"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/b"},
    }
    with pytest.raises(ConfigError) as error:
        load_config({"zero_optimization": zero}, strict=False)
    message = str(error.value)
    assert "zero_optimization.offload_param.nvme_path" in message
    assert "zero_optimization.offload_optimizer.nvme_path" in message
    assert "same path" in message
    zero["offload_optimizer"]["nvme_path"] = "/a/"
    assert load_config({"zero_optimization": zero}).offload == OffloadConfig(param="nvme", optimizer="nvme", nvme_path="/a")


def test_nvme_device_needs_a_path():
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path.*needs a directory"):
        load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


def test_nvme_path_of_a_cpu_section_is_not_used():
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/a"},
        "offload_optimizer": {"device": "cpu", "nvme_path": "/b"},
    }
    assert load_config({"zero_optimization": zero}).offload == OffloadConfig(param="nvme", optimizer="cpu", nvme_path="/a")


def test_pin_memory_must_agree():
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }
    with pytest.raises(ConfigError, match="one pin_memory switch"):
        load_config({"zero_optimization": zero})


def test_buffer_count(caplog):
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 1}}
    with caplog.at_level(logging.WARNING, logger="offload.config.deepspeed"):
        assert load_config({"zero_optimization": zero}).offload.buffer_count == 2
    assert "below offload's minimum of 2" in caplog.text
    zero["offload_optimizer"]["buffer_count"] = 6
    assert load_config({"zero_optimization": zero}).offload.buffer_count == 6


@pytest.mark.parametrize(
    "zero, mapped",
    [
        ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, True),
        (
            {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/n"},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},
            },
            True,
        ),
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, True),
        ({"stage": 3}, True),  # no offload section: offload.optimizer auto, which may stream from NVMe
        ({"stage": 3, "offload_optimizer": {"device": "none"}}, True),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, False),  # all in RAM: nothing streamed
        ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}, "offload_optimizer": {"device": "cpu"}}, False),
    ],
)
def test_sub_group_size_maps_where_optimizer_state_can_stream_from_nvme(zero, mapped):
    zero = {**zero, "sub_group_size": 2.5e7}  # JSON writes it as a float, as DeepSpeed's docs do
    translation = translate_deepspeed({"zero_optimization": zero})
    ignored = dict(translation.ignored)
    config = load_config({"zero_optimization": zero})
    if mapped:
        assert config.offload.sub_group_size == 25_000_000
        assert translation.sources["offload.sub_group_size"] == "zero_optimization.sub_group_size"
        assert "zero_optimization.sub_group_size" not in ignored
    else:
        assert config.offload.sub_group_size == OffloadConfig().sub_group_size
        assert "in RAM" in ignored["zero_optimization.sub_group_size"]


@pytest.mark.parametrize("value", [0, 100, 1024, 2**18 - 1])
def test_sub_group_size_below_the_smallest_useful_piece_means_the_default_piece(value, caplog):
    """axolotl's ZeRO-3 configs write 0: offload's default piece for the tier, not pieces of
    1024 elements that make the NVMe step crawl (issue 33, 14)."""
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}, "sub_group_size": value}
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        assert load_config({"zero_optimization": zero}).offload.sub_group_size is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"zero_optimization.sub_group_size ({value} is below the smallest useful piece" in the_ignored_line(caplog)
    zero["sub_group_size"] = 2**18
    assert load_config({"zero_optimization": zero}).offload.sub_group_size == 2**18


@pytest.mark.parametrize("value", ["auto", "big", True, 1.5e3 + 0.5])
def test_sub_group_size_must_be_an_integer(value):
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}, "sub_group_size": value}
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size"):
        load_config({"zero_optimization": zero})


def test_legacy_cpu_offload_spelling():
    config = load_config(
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True, "cpu_offload_use_pin_memory": False}}
    )
    assert config.offload == OffloadConfig(param="cpu", optimizer="cpu", pin_memory=False)


# -- aio ---------------------------------------------------------------------------------


def test_aio_old_and_new_thread_spelling():
    old = load_config({"aio": {"block_size": 8192, "queue_depth": 4, "thread_count": 3}})
    new = load_config({"aio": {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 3}})
    assert old.io == new.io == IOConfig(block_size=8192, queue_depth=4, threads=3)
    assert load_config({"aio": {"thread_count": 3, "intra_op_parallelism": 3}}).io.threads == 3
    with pytest.raises(ConfigError, match="keep one of them"):
        load_config({"aio": {"thread_count": 2, "intra_op_parallelism": 3}})


def test_use_gds_true_is_an_error_even_when_not_strict():
    with pytest.raises(ConfigError, match=r"aio\.use_gds.*GPUDirect"):
        load_config({"aio": {"use_gds": True}}, strict=False)


def test_validation_errors_name_the_deepspeed_key():
    with pytest.raises(ConfigError, match=r"io\.block_size.*multiple of 4096.*'aio\.block_size'"):
        load_config({"aio": {"block_size": 1000}})
    with pytest.raises(ConfigError, match=r"'aio\.queue_depth'"):
        load_config({"aio": {"queue_depth": 0}})
    with pytest.raises(ConfigError, match=r"aio\.block_size.*expected a number"):
        load_config({"aio": {"block_size": "big"}})
    with pytest.raises(ConfigError, match=r"aio\.queue_depth.*'auto' cannot be resolved"):
        load_config({"aio": {"queue_depth": "auto"}})


# -- precision ---------------------------------------------------------------------------


def test_precision_rules():
    assert load_config({"bf16": {"enabled": True}}).precision == "bf16"
    # (is_deepspeed_config does not know the legacy "bfloat16" marker, so translate directly.)
    assert translate({"bfloat16": {"enabled": True}})["precision"] == "bf16"
    assert load_config({"fp16": {"enabled": True}}).precision == "fp16"
    assert load_config({"fp16": {"enabled": False}, "bf16": {"enabled": False}}).precision == "fp32"
    assert load_config({"zero_optimization": {"stage": 2}}).precision == "fp32"
    with pytest.raises(ConfigError, match="both true"):
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, strict=False)
    with pytest.raises(ConfigError, match=r"bf16\.enabled.*true or false"):
        load_config({"bf16": {"enabled": "yes"}})


@pytest.mark.parametrize("master", [None, True, False])
def test_bf16_optimizer_states_map_to_bf16_moments_with_a_log_line(master, caplog):
    """DeepSpeed's bf16.bf16_optimizer_states (Adam moments in bf16; DeepSpeed asks for
    bf16_master_weights_and_grads beside it) is optimizer.state_precision bf16: offload keeps the
    master fp32 and says so at INFO; an error about the value names the DeepSpeed key."""
    bf16 = {"enabled": True, "bf16_optimizer_states": True}
    if master is not None:
        bf16["bf16_master_weights_and_grads"] = master
    mapping = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": bf16}
    with caplog.at_level(logging.INFO, logger="offload.config.deepspeed"):
        config = load_config(mapping)
    assert (config.precision, config.optimizer.state_precision, config.optimizer.gradient_precision) == ("bf16", "bf16", "auto")
    [line] = [r.getMessage() for r in caplog.records if "bf16_optimizer_states" in r.getMessage()]
    assert "optimizer.state_precision bf16" in line and "master weights in fp32" in line
    assert "optimizer.gradient_precision" in line
    assert ("bf16_master_weights_and_grads: true" in line) == bool(master)
    assert translate_deepspeed(mapping).sources["optimizer.state_precision"] == "bf16.bf16_optimizer_states"
    assert "bf16.bf16_optimizer_states" not in ignored_keys(mapping)
    # the legacy section name too
    assert translate({"bfloat16": bf16})["optimizer"]["state_precision"] == "bf16"


def test_bf16_state_keys_that_cannot_be_honoured_or_contradict():
    # bf16 master weights with fp32 moments: offload keeps the master fp32
    with pytest.raises(ConfigError, match="cannot honour") as error:
        load_config({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert error.value.key == "bf16.bf16_master_weights_and_grads" and "bf16_optimizer_states" in str(error.value)
    # bf16 moments and fp32 moments at once: an error naming both keys, even when not strict
    contradiction = {
        "bf16": {"enabled": True, "bf16_optimizer_states": True},
        "optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": True}},
    }
    with pytest.raises(ConfigError, match=r"'bf16\.bf16_optimizer_states'.*'optimizer\.params\.fp32_optimizer_states'"):
        load_config(contradiction, strict=False)
    with pytest.raises(ConfigError, match=r"bf16_optimizer_states.*true or false"):
        load_config({"bf16": {"enabled": True, "bf16_optimizer_states": "auto"}})
    # switched off, or in a disabled section (as DeepSpeed ignores it): fp32 moments
    off = {"bf16": {"enabled": True, "bf16_optimizer_states": False, "bf16_master_weights_and_grads": False}}
    assert load_config(off).optimizer.state_precision == "fp32"
    assert {"bf16.bf16_optimizer_states", "bf16.bf16_master_weights_and_grads"} <= ignored_keys(off)
    disabled = {"fp16": {"enabled": True}, "bf16": {"enabled": False, "bf16_optimizer_states": True}}
    assert load_config(disabled).optimizer.state_precision == "fp32"
    assert "bf16.bf16_optimizer_states" in ignored_keys(disabled)


def test_static_loss_scale_is_an_error_even_when_not_strict():
    with pytest.raises(ConfigError, match=r"fp16\.loss_scale.*static loss scaling"):
        load_config({"fp16": {"enabled": True, "loss_scale": 128}}, strict=False)
    # In a disabled section DeepSpeed ignores it, and so does offload.
    assert load_config({"fp16": {"enabled": False, "loss_scale": 128, "hysteresis": 2}}).precision == "fp32"


def test_fp16_defaults_match_deepspeed():
    config = load_config({"fp16": {"enabled": True, "loss_scale": 0}})
    assert config.loss_scale == LossScaleConfig(initial=2.0**16, growth_interval=1000, min_scale=1.0)


# -- steps and batch sizes ---------------------------------------------------------------


def test_batch_size_consistency(monkeypatch):
    with pytest.raises(ConfigError, match="train_batch_size 30 != train_micro_batch_size_per_gpu 4"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8})
    with pytest.raises(ConfigError, match="not a multiple"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}).gradient_accumulation_steps == 8
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}).gradient_accumulation_steps == 4
    assert (
        load_config(
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
        ).gradient_accumulation_steps
        == 4
    )
    with pytest.raises(ConfigError, match="world size 2"):
        load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8})
    # "auto" batch sizes are not checked.
    assert (
        load_config(
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
        ).gradient_accumulation_steps
        == 3
    )


def test_gradient_clipping_and_accumulation_map_directly():
    config = load_config({"bf16": {"enabled": True}, "gradient_clipping": 2.5, "gradient_accumulation_steps": 16})
    assert (config.gradient_clipping, config.gradient_accumulation_steps) == (2.5, 16)
    with pytest.raises(ConfigError, match=r"'gradient_clipping'.*must be >= 0"):
        load_config({"bf16": {"enabled": True}, "gradient_clipping": -1})


# -- unknown keys and mixing -------------------------------------------------------------


def test_all_unknown_keys_are_named_with_suggestions():
    cfg = {
        "bf16": {"enabled": True},
        "zero_optimisation": {"stage": 3},
        "gradient_clippin": 1.0,
        "aio": {"queue_dept": 8},
        "flops_profiler": {"enabled": False},  # logging: ignored, not an error
    }
    with pytest.raises(ConfigError) as error:
        load_config(cfg)
    message = str(error.value)
    assert listed_keys(message) == {"zero_optimisation", "gradient_clippin", "aio.queue_dept"}
    assert error.value.key == "zero_optimisation"
    assert "did you mean 'zero_optimization'?" in message
    assert "did you mean 'gradient_clipping'?" in message
    assert "did you mean 'queue_depth'?" in message


def test_offload_keys_in_a_deepspeed_config_are_an_error():
    with pytest.raises(ConfigError, match=r"'offload', 'precision'.*don't mix"):
        load_config({"bf16": {"enabled": True}, "precision": "bf16", "offload": {"param": "cpu"}}, strict=False)


def test_not_strict_warns_once_and_loads(caplog):
    cfg = {
        "bf16": {"enabled": True},
        "steps_per_printt": 10,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "zero_quantized_weights": True},
    }
    with caplog.at_level(logging.WARNING, logger="offload.config.deepspeed"):
        config = load_config(cfg, strict=False)
    assert config == Config(precision="bf16")
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert listed_keys(record.getMessage()) == {"steps_per_printt", "zero_optimization.zero_quantized_weights"}


# -- accelerate --------------------------------------------------------------------------


ACCELERATE_WITH_FILE = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: {file}
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: {mixed}
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

ACCELERATE_INLINE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_multinode_launcher: standard
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: nvme
  offload_optimizer_nvme_path: /nvme
  offload_param_device: cpu
  zero3_init_flag: false
  zero_stage: 3
distributed_type: DEEPSPEED
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""


def test_accelerate_yaml_pointing_at_a_deepspeed_json(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "stage2_cpu_offload.json").read_text())
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text(ACCELERATE_WITH_FILE.format(file="ds.json", mixed="bf16"))
    # zero3_init_flag only changes how DeepSpeed builds the model: ignored, also when strict
    assert load_accelerate_config(yaml_path) == CASES["stage2_cpu_offload.json"][0]


def test_accelerate_mixed_precision_resolves_auto_in_the_json(tmp_path):
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text(ACCELERATE_WITH_FILE.format(file=DATA / "hf_ds_config_zero3.json", mixed="fp16"))
    config = load_accelerate_config(yaml_path, strict=False)
    expected = copy.deepcopy(CASES["hf_ds_config_zero3.json"][0])
    expected.precision = "fp16"
    assert config == expected
    yaml_path.write_text(ACCELERATE_WITH_FILE.format(file=DATA / "hf_ds_config_zero3.json", mixed="'no'"))
    assert load_accelerate_config(yaml_path, strict=False).precision == "fp32"
    # An explicit setting in the JSON that contradicts mixed_precision is an error.
    yaml_path.write_text(ACCELERATE_WITH_FILE.format(file=DATA / "fp16_loss_scale.json", mixed="bf16"))
    with pytest.raises(ConfigError, match="contradicts 'fp16.enabled'"):
        load_accelerate_config(yaml_path, strict=False)


def test_accelerate_inline_config(tmp_path):
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text(ACCELERATE_INLINE)
    expected = Config(
        precision="bf16",
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
        offload=OffloadConfig(param="cpu", optimizer="nvme", nvme_path="/nvme"),
    )
    assert load_accelerate_config(yaml_path) == expected


def test_accelerate_inline_errors_name_accelerate_keys(tmp_path):
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text("deepspeed_config:\n  zero_stage: 3\n  offload_param_device: gpu\ndistributed_type: DEEPSPEED\n")
    with pytest.raises(ConfigError, match=r"'deepspeed_config\.offload_param_device'.*'gpu'"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text("deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 0\n")
    with pytest.raises(ConfigError, match=r"'deepspeed_config\.gradient_accumulation_steps'"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text("deepspeed_config:\n  zero_stag: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'zero_stage'"):
        load_accelerate_config(yaml_path)


def test_accelerate_config_errors(tmp_path):
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(ConfigError, match="distributed_type 'MULTI_GPU'"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text("distributed_type: DEEPSPEED\n")
    with pytest.raises(ConfigError, match="no 'deepspeed_config'"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text(f"deepspeed_config:\n  deepspeed_config_file: {DATA / 'stage2_cpu_offload.json'}\n  zero_stage: 3\n")
    with pytest.raises(ConfigError, match=r"deepspeed_config\.zero_stage.*set them in the DeepSpeed JSON"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text("deepspeed_config:\n  deepspeed_config_file: missing.json\n")
    with pytest.raises(ConfigError, match="missing.json' not found"):
        load_accelerate_config(yaml_path)
    yaml_path.write_text("deepspeed_config:\n  zero_stage: 2\nmixed_precision: fp8\n")
    with pytest.raises(ConfigError, match="'fp8' is not one of"):
        load_accelerate_config(yaml_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_accelerate_config(tmp_path / "nope.yaml")
