"""offload.config.schema: loading, validation and documentation of offload's own config schema."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import schema as config_module
from offload.config.schema import (
    Config,
    IOConfig,
    LossScaleConfig,
    OffloadConfig,
    OptimizerConfig,
    PrefetchConfig,
    SchedulerConfig,
    WrapConfig,
    field_docs,
    is_deepspeed_config,
    load_config,
)
from offload.errors import ConfigError


def test_defaults():
    assert load_config() == Config()
    assert load_config({}) == Config()
    assert Config().precision == "bf16" and Config().offload.optimizer == "auto"


@pytest.mark.parametrize(
    "mapping, key, nearest",
    [
        ({"precison": "bf16"}, "precison", "precision"),
        ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
        ({"offload": {"parm": "cpu"}}, "offload.parm", "param"),
        ({"io": {"thread": 2}}, "io.thread", "threads"),
        ({"optimizer": {"zz": 1e-3}}, "optimizer.zz", None),
    ],
)
def test_unknown_key_names_the_key_and_the_nearest_valid_one(mapping, key, nearest):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    message = str(error.value)
    assert f"unknown config key '{key}'" in message
    if nearest:
        assert f"did you mean '{nearest}'?" in message
    else:
        assert "valid keys here:" in message and "lr" in message


@pytest.mark.parametrize(
    "mapping, key, expected",
    [
        ({"precision": 16}, "precision", "expected a string"),
        ({"gradient_accumulation_steps": "2"}, "gradient_accumulation_steps", "expected an integer"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps", "expected an integer"),
        ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps", "expected an integer"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping", "expected a number"),
        ({"offload": {"pin_memory": 1}}, "offload.pin_memory", "expected true or false"),
        ({"offload": "cpu"}, "offload", "expected an object"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas", "expected a list of 2"),
        ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas[1]", "expected a number"),
        ({"wrap": {"module_classes": "Block"}}, "wrap.module_classes", "expected a list"),
        ({"wrap": {"module_classes": [1]}}, "wrap.module_classes[0]", "expected a string"),
        ({"offload": {"nvme_path": 5}}, "offload.nvme_path", "matches none of the accepted types"),
        ({"seed": "1"}, "seed", "matches none of the accepted types"),
    ],
)
def test_wrong_types_name_the_key(mapping, key, expected):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert f"'{key}'" in str(error.value)
    assert expected in str(error.value)


def test_accepted_conversions():
    config = load_config(
        {
            "gradient_accumulation_steps": 2.0,
            "gradient_clipping": 1,
            "optimizer": {"betas": [0.8, 0.9]},
            "offload": {"nvme_path": ["/a", "/b"]},
            "seed": 7,
        }
    )
    assert config.gradient_accumulation_steps == 2 and isinstance(config.gradient_accumulation_steps, int)
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)
    assert config.optimizer.betas == (0.8, 0.9)
    assert config.offload.nvme_path == ["/a", "/b"]
    assert config.seed == 7
    assert load_config({"seed": None}).seed is None


@pytest.mark.parametrize(
    "mapping, key",
    [
        ({"optimizer": {"lr": -1.0}}, "optimizer.lr"),
        ({"optimizer": {"betas": [1.0, 0.999]}}, "optimizer.betas[0]"),
        ({"optimizer": {"betas": [0.9, -0.1]}}, "optimizer.betas[1]"),
        ({"optimizer": {"eps": 0.0}}, "optimizer.eps"),
        ({"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay"),
        ({"optimizer": {"threads": -1}}, "optimizer.threads"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -0.5}, "gradient_clipping"),
        ({"gradient_clipping": float("nan")}, "gradient_clipping"),
        ({"prefetch": {"depth": -1}}, "prefetch.depth"),
        ({"offload": {"buffer_count": 1}}, "offload.buffer_count"),
        ({"offload": {"nvme_path": []}}, "offload.nvme_path"),
        ({"io": {"block_size": 1000}}, "io.block_size"),
        ({"io": {"block_size": 0}}, "io.block_size"),
        ({"io": {"queue_depth": 0}}, "io.queue_depth"),
        ({"io": {"threads": 0}}, "io.threads"),
        ({"io": {"background_depth": 4}}, "io.background_depth"),
        ({"io": {"background_depth": -1}}, "io.background_depth"),
        ({"io": {"threads": 8, "queue_depth": 2, "background_depth": 2}}, "io.background_depth"),
        ({"wrap": {"min_params": -1}}, "wrap.min_params"),
        ({"loss_scale": {"initial": 0.0}}, "loss_scale"),
        ({"loss_scale": {"min_scale": -1.0}}, "loss_scale"),
        ({"loss_scale": {"backoff_factor": 1.0}}, "loss_scale"),
        ({"loss_scale": {"growth_factor": 0.5}}, "loss_scale"),
        ({"loss_scale": {"growth_interval": 0}}, "loss_scale"),
    ],
)
def test_out_of_range_values_name_the_key(mapping, key):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert f"config key '{key}'" in str(error.value)


def test_boundary_values_are_accepted():
    config = load_config(
        {
            "optimizer": {"lr": 0.0, "betas": [0.0, 0.0], "weight_decay": 0.0, "threads": 0},
            "prefetch": {"depth": 0},
            "offload": {"buffer_count": 2},
            "io": {"block_size": 4096, "queue_depth": 1, "threads": 1},
            "loss_scale": {"growth_factor": 1.0},
        }
    )
    assert config.io == IOConfig(block_size=4096, queue_depth=1, threads=1)


@pytest.mark.parametrize(
    "mapping, key, nearest",
    [
        ({"precision": "fp8"}, "precision", None),
        ({"precision": "bf61"}, "precision", "bf16"),
        ({"offload": {"param": "gpu"}}, "offload.param", None),
        ({"offload": {"optimizer": "none"}}, "offload.optimizer", None),
        ({"offload": {"optimizer": "nvm"}}, "offload.optimizer", "nvme"),
        ({"overlap": "backwards"}, "overlap", "backward"),
        ({"optimizer": {"type": "sgd"}}, "optimizer.type", None),
        ({"optimizer": {"state_precision": "8bit"}}, "optimizer.state_precision", "int8"),
        ({"optimizer": {"state_precision": "int4"}}, "optimizer.state_precision", "int8"),
        ({"optimizer": {"state_precision": "bfloat16"}}, "optimizer.state_precision", "bf16"),
        ({"optimizer": {"gradient_precision": "fp16"}}, "optimizer.gradient_precision", None),
        ({"optimizer": {"gradient_precision": "atuo"}}, "optimizer.gradient_precision", "auto"),
    ],
)
def test_choices_name_the_key_and_accepted_values(mapping, key, nearest):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    message = str(error.value)
    assert f"config key '{key}'" in message and "is not one of" in message
    if nearest:
        assert f"did you mean '{nearest}'?" in message


def test_state_and_gradient_precision_keys():
    """optimizer.state_precision: how the Adam moments are stored; optimizer.gradient_precision:
    auto keeps a 16-bit gradient where exact. Read case-insensitively; an invalid value names the
    key and every valid one (config.state_layout.StatePrecision's)."""
    from offload.config.state_layout import StatePrecision

    assert (Config().optimizer.state_precision, Config().optimizer.gradient_precision) == ("fp32", "auto")
    assert config_module.STATE_PRECISIONS == tuple(p.value for p in StatePrecision)
    config = load_config({"optimizer": {"state_precision": "INT8", "gradient_precision": "FP32"}})
    assert (config.optimizer.state_precision, config.optimizer.gradient_precision) == ("int8", "fp32")
    with pytest.raises(ConfigError) as error:
        load_config({"optimizer": {"state_precision": "fp8"}})
    assert error.value.key == "optimizer.state_precision" and "fp32, bf16, int8" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_config({"optimizer": {"gradient_precision": "bf16"}})
    assert error.value.key == "optimizer.gradient_precision" and "auto, fp32" in str(error.value)
    assert "16-bit" in str(error.value)  # says what auto already does


def test_sub_group_size_doc_says_pieces_are_whole_blocks():
    from offload.config.state_layout import NORM_BLOCK
    from offload.plan.optimizer_plan import whole_blocks

    doc = field_docs(OffloadConfig)["sub_group_size"]
    assert f"whole blocks of {NORM_BLOCK} elements" in doc
    assert whole_blocks(5000, 10**6) == 4096 and whole_blocks(5000, 4000) == 4000  # what it describes


def test_overlap_backward_is_accepted_with_clipping_and_fp16():
    """Both speculate (tests/test_speculative_step.py); nothing about them is refused any more."""
    assert load_config({"overlap": "backward", "gradient_clipping": 1.0}).gradient_clipping == 1.0
    assert load_config({"overlap": "backward", "precision": "fp16"}).precision == "fp16"
    assert load_config({"overlap": "backward", "precision": "bf16"}).overlap == "backward"


def test_config_instance_is_validated():
    with pytest.raises(ConfigError, match="'precision'"):
        load_config(Config(precision="fp8"))
    with pytest.raises(ConfigError, match="'overlap'"):
        load_config(Config(overlap="sideways"))


@settings(max_examples=40, deadline=None)
@given(
    precision=st.sampled_from(["bf16", "fp32"]),
    param=st.sampled_from(["none", "cpu", "nvme"]),
    optimizer=st.sampled_from(["cpu", "nvme"]),
    accumulation=st.integers(1, 64),
    clipping=st.floats(0.0, 10.0),
    lr=st.floats(0.0, 1.0),
    block_pages=st.integers(1, 1024),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)
def test_valid_configs_round_trip_through_json(precision, param, optimizer, accumulation, clipping, lr, block_pages, seed):
    mapping = {
        "precision": precision,
        "offload": {"param": param, "optimizer": optimizer},
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "optimizer": {"lr": lr},
        "io": {"block_size": 4096 * block_pages},
        "seed": seed,
    }
    config = load_config(mapping)
    assert load_config(json.loads(json.dumps(config.to_dict()))) == config
    assert load_config(config) == config


CONFIG_CLASSES = [Config, OptimizerConfig, OffloadConfig, PrefetchConfig, IOConfig, WrapConfig, LossScaleConfig, SchedulerConfig]


def test_every_config_dataclass_is_covered():
    found = {obj for obj in vars(config_module).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)}
    assert found == set(CONFIG_CLASSES)


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda cls: cls.__name__)
def test_field_docs_documents_every_field(cls):
    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert sorted(docs) == sorted(names), f"fields without a docstring: {sorted(set(names) - set(docs))}"
    for name in names:
        assert len(docs[name]) > 10, f"{cls.__name__}.{name} has no real docstring"
        assert "\n" not in docs[name]


def test_field_docs_reads_the_string_under_each_field():
    assert field_docs(IOConfig)["block_size"] == "Bytes per swap I/O request (a multiple of 4096)."


@pytest.mark.parametrize(
    "mapping",
    [
        {"bfloat16": {"enabled": True}},
        {"scheduler": {"type": "WarmupLR", "params": {}}},
        {"steps_per_print": 10},
        {"zero_allow_untested_optimizer": True},
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
    ],
)
def test_is_deepspeed_config_recognises_more_deepspeed_keys(mapping):
    assert is_deepspeed_config(mapping)


def test_offload_optimizer_section_is_not_taken_for_deepspeed():
    assert not is_deepspeed_config({"optimizer": {"type": "adamw", "lr": 1e-4}})


@pytest.mark.parametrize(
    "mapping, key, nearest",
    [
        ({"optimizer": {"learning_rate": 1e-3}}, "optimizer.learning_rate", "lr"),
        ({"max_grad_norm": 1.0}, "max_grad_norm", "gradient_clipping"),
        ({"optimizer": {"epsilon": 1e-6}}, "optimizer.epsilon", "eps"),
    ],
)
def test_unknown_key_suggests_the_aliased_key(mapping, key, nearest):
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert f"unknown config key '{key}'; did you mean '{nearest}'?" in str(error.value)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_load_config_reads_an_accelerate_yaml(tmp_path, suffix):
    path = tmp_path / f"accelerate{suffix}"
    path.write_text(
        "distributed_type: DEEPSPEED\n"
        "mixed_precision: bf16\n"
        "deepspeed_config:\n"
        "  zero_stage: 3\n"
        "  offload_param_device: cpu\n"
        "  offload_optimizer_device: cpu\n"
        "  gradient_clipping: 1.0\n"
    )
    config = load_config(path)
    assert (config.precision, config.offload.param, config.offload.optimizer, config.gradient_clipping) == (
        "bf16",
        "cpu",
        "cpu",
        1.0,
    )
    path.write_text("distributed_type: MULTI_GPU\n")
    with pytest.raises(ConfigError, match="distributed_type 'MULTI_GPU'"):
        load_config(path)
