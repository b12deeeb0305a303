"""DeepSpeed's newest offload keys (issue 33, 15 and 16): SuperOffload's `super_offload` and
`cpuadam_cores_perc`, `offload_optimizer.ratio` and ZenFlow's `zenflow` map to what offload does
or are refused with the true reason; `"auto"` precision says what it chose and why."""

from __future__ import annotations

import logging

import pytest

from offload.config import deepspeed as deepspeed_config
from offload.config import deepspeed_offload
from offload.config.schema import load_config
from offload.errors import ConfigError

# DeepSpeedExamples' training/DeepSpeed-SuperOffload README: "Enable SuperOffload (one line)"
SUPER_OFFLOAD = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": True,
            "ratio": 0.90,
            "super_offload": True,
            "cpuadam_cores_perc": 0.90,
        },
    },
    "bf16": {"enabled": True},
}


def stage3(**offload_optimizer) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", **offload_optimizer}}}


def test_super_offload_config_maps_to_overlap_auto_threads_and_optimizer_auto(monkeypatch):
    monkeypatch.setattr(deepspeed_offload, "_cpus", lambda: 10)
    translation = deepspeed_config.translate_deepspeed(SUPER_OFFLOAD)
    assert translation.unsupported == []
    config = load_config(SUPER_OFFLOAD)
    assert (config.overlap, config.optimizer.threads, config.offload.optimizer) == ("auto", 9, "auto")
    assert translation.sources["overlap"] == "zero_optimization.offload_optimizer.super_offload"
    assert translation.sources["optimizer.threads"] == "zero_optimization.offload_optimizer.cpuadam_cores_perc"
    assert translation.sources["offload.optimizer"] == "zero_optimization.offload_optimizer.ratio"


def test_super_offload_false_keeps_the_default_overlap():
    translation = deepspeed_config.translate_deepspeed(stage3(super_offload=False))
    assert "overlap" not in translation.config
    assert ("zero_optimization.offload_optimizer.super_offload", "switched off") in translation.ignored
    assert load_config(stage3(super_offload=False)).overlap == "auto"


@pytest.mark.parametrize("share", [0, 1.5, -0.1])
def test_cpuadam_cores_perc_outside_its_range_is_refused(share):
    with pytest.raises(ConfigError, match=r"cpuadam_cores_perc.*\(0, 1\]"):
        load_config(stage3(cpuadam_cores_perc=share))


@pytest.mark.parametrize("ratio, tier", [(0.3, "auto"), (0.9, "auto"), (0, "device"), (1, "cpu")])
def test_ratio_maps_to_the_tier_that_holds_that_share(ratio, tier):
    assert load_config(stage3(ratio=ratio)).offload.optimizer == tier


def test_ratio_with_nvme_or_out_of_range_is_refused_with_the_reason():
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "ratio": 0.5}}}
    with pytest.raises(ConfigError, match="offload_optimizer.ratio.*rest on the GPU.*device 'cpu'"):
        load_config(nvme)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        load_config(stage3(ratio=2))


def test_zenflow_is_refused_as_not_exact_adamw_naming_the_exact_overlap():
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.05}}}
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert error.value.key == "zero_optimization.zenflow"
    message = str(error.value)
    assert "not exact AdamW" in message and "overlap 'auto'" in message and "not a key offload knows" not in message
    off = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": None}}
    assert load_config(off).overlap == "auto"


def test_auto_precision_on_a_cpu_machine_says_what_it_chose_and_why(monkeypatch, caplog):
    monkeypatch.setattr(deepspeed_config, "_cuda_available", lambda: False)
    monkeypatch.setattr(deepspeed_config, "_bf16_supported", lambda: True)
    config = {
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    with caplog.at_level(logging.WARNING, logger="offload.config.deepspeed"):
        assert load_config(config).precision == "bf16"
    [record] = [r for r in caplog.records if "'auto'" in r.getMessage()]
    text = record.getMessage()
    assert "bf16.enabled -> true (no GPU: the CPU computes in bf16; set it to false for fp32)" in text
    assert "optimizer.params.lr -> 5e-05 (the Hugging Face Trainer's default)" in text
    # the Trainer's default arguments give fp32: the message no longer claims it chose as they would
    assert "as the Hugging Face Trainer would" not in text
