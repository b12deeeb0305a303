"""The table of every DeepSpeed and accelerate key offload knows, for `offload.config.deepspeed`.

For each section, the keys offload maps (the `_*_HANDLED` tuples, read by the section
translators in `offload.config.deepspeed`) and, for every other key, a `_Rule` saying why it is
ignored (it only tunes speed or memory, logs, or is read by another tool) or refused (a feature
offload cannot honour), maybe by its value; what `"auto"` and absent values become; DeepSpeed's
schedulers with their parameters' defaults; accelerate's inline keys; `key_rows`, the same tables
as rows for the documentation's key table (`offload.config.docs`). Also the result,
`Translation` (plain data), and `_Builder`, which collects it and judges each key a translator
does not map against these tables. Nothing here logs or reads the machine; like the
translators, it imports nothing of `offload.config.schema`."""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from offload.errors import ConfigError

# Top-level keys of offload's own schema: seeing them in a DeepSpeed config means two schemas mixed.
_OWN_KEYS = ("precision", "offload", "prefetch", "overlap", "io", "wrap", "loss_scale", "seed")

# What "auto" becomes without the Hugging Face Trainer: the value the Trainer fills in from its
# TrainingArguments at their defaults.
TRAINER_DEFAULTS = {
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": (0.9, 0.999),
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 1,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 0,
}
# DeepSpeed's own defaults for Adam/AdamW params that are absent.
_DS_OPT_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


# ---- the result: plain data -------------------------------------------------------------
@dataclass
class Translation:
    """A peer's config as offload config data (no offload.config.schema types)."""

    config: dict = field(default_factory=dict)
    """The offload config mapping (offload's key names), to be validated by offload.config.schema."""
    sources: dict = field(default_factory=dict)
    """Offload key (dotted) -> the user's key it came from, so that an error names the latter."""
    ignored: list = field(default_factory=list)
    """(user key, why): keys that only tune, log or belong to another tool; accepted."""
    unsupported: list = field(default_factory=list)
    """(user key, why): unknown keys and features offload cannot honour; refused when strict."""
    auto: list = field(default_factory=list)
    """(user key, the value chosen): `"auto"` values and how they were resolved."""
    kind: str = "DeepSpeed"
    """Whose format this was (`DeepSpeed` or `accelerate`), for messages."""


# ---- why keys are ignored -----------------------------------------------------------------
_WHY_TUNING = (
    "bucket, persistence, prefetch and partition tuning (offload sizes each unit's buffers exactly and always overlaps transfers)"
)
_WHY_OFFLOAD_TUNING = (
    "buffer sizing and pipelining of the offload (offload sizes host buffers per unit and pipelines NVMe itself)"
)
_WHY_MONITOR = "logging, profiling and monitoring (use your own logger or torch.profiler)"
_WHY_SAVE = "saving options (use engine.consolidated_state_dict(), engine.save_checkpoint or `offload export`)"
_WHY_CHECKS = "DeepSpeed's optimizer checks (offload always runs its own CPU Adam/AdamW)"
_WHY_COMM = "communication layout and scaling that change no result at one rank and only rounding order at several"
_WHY_AIO = "I/O submission details (offload's I/O engine batches submissions and overlaps completions itself)"
_WHY_HYSTERESIS = "loss-scale back-off delay (offload backs off on the first overflow; overflowing steps are skipped either way)"
_WHY_TORCH_IMPL = "optimizer implementation switches (offload runs its C++ CPU Adam/AdamW: the same maths)"
_WHY_ZERO3_INIT = "construction-time partitioning (offload partitions the model at initialize())"
_WHY_LAUNCHER = "read by `accelerate launch`, not by the training process"
_WHY_NOT_TRAINING = "tools and services outside training (run them separately)"
_WHY_SPEED = "speed switches that change no result (torch.compile the model yourself if you want it)"
_WHY_CKPT_ACT = (
    "activation checkpointing through DeepSpeed's own API (use torch.utils.checkpoint in the model; offload handles it)"
)
_WHY_OFF = "switched off"
_WHY_DEVICE_NONE = "its section's device is 'none' (DeepSpeed ignores the section too)"
_WHY_DISABLED = "its section is disabled (DeepSpeed ignores the section too)"
_WHY_SUB_GROUP_IN_RAM = (
    "it sizes the pieces of optimizer state streamed from NVMe; offload_optimizer.device 'cpu' keeps it all in RAM"
)

_WHY_FEATURE = "a DeepSpeed feature offload does not implement; it would change training"
_WHY_QUANTIZED = "quantized weights or gradients (ZeRO++) change the maths; offload keeps 16-bit weights and gradients"
_WHY_AUTOCAST = "casting inputs (offload casts parameters; cast inputs in your training loop)"
_WHY_LOW_MASTER = (
    "16-bit master weights (offload keeps the master weights in fp32; for a smaller optimizer state set "
    "bf16.bf16_optimizer_states true, which maps to optimizer.state_precision bf16)"
)
_WHY_GRAD_DTYPE = "gradient accumulation in a 16-bit type (offload accumulates gradients in fp32)"
_WHY_AMP = "NVIDIA apex AMP (use bf16 or fp16)"
_WHY_COMM_DTYPE = "a communication data type other than the compute precision (offload reduce-scatters in the compute precision)"
_WHY_RESUME = "resuming a schedule by iteration (engine.load_checkpoint restores the step count)"


class _Rule:
    """How a key offload does not map is judged: ignored, or unsupported, maybe by its value."""

    def __init__(self, why: str, *, ok: Callable[[Any], bool] | None = None, why_not: str = "") -> None:
        self.why, self.ok, self.why_not = why, ok, why_not

    def judge(self, value: Any) -> tuple[str, str]:
        if self.ok is None or self.ok(value):
            return "ignored", self.why
        return "unsupported", self.why_not


def _ignore(why: str) -> _Rule:
    return _Rule(why)


def _off(value: Any) -> bool:
    return value is False or value is None or value == 0


def _disabled(value: Any) -> bool:
    """A feature section that is switched off ("auto" is what the Trainer resolves to off by default)."""
    return _off(value) or (isinstance(value, dict) and value.get("enabled", True) in (False, "auto"))


def _when_off(why_not: str) -> _Rule:
    return _Rule(_WHY_OFF, ok=_off, why_not=why_not)


def _when_disabled(why_not: str) -> _Rule:
    return _Rule(_WHY_OFF, ok=_disabled, why_not=why_not)


def _rules(why_or_rule, *keys: str) -> dict[str, _Rule]:
    rule = why_or_rule if isinstance(why_or_rule, _Rule) else _ignore(why_or_rule)
    return dict.fromkeys(keys, rule)


_TOP_RULES = {
    **_rules(
        _WHY_MONITOR,
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "monitor_config",
        "timers",
    ),
    **_rules(_WHY_CHECKS, "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"),
    **_rules(
        _WHY_COMM,
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "disable_allgather",
        "seq_parallel_communication_data_type",
    ),
    **_rules(_WHY_NOT_TRAINING, "autotuning", "nebula"),
    **_rules(_WHY_SPEED, "compile", "graph_harvesting"),
    "activation_checkpointing": _ignore(_WHY_CKPT_ACT),
    "checkpoint": _ignore(_WHY_SAVE),
    "amp": _when_disabled(_WHY_AMP),
    "data_types": _Rule(
        "fp32 gradient accumulation is what offload does",
        ok=lambda v: isinstance(v, dict) and v.get("grad_accum_dtype") in (None, "fp32", "float32"),
        why_not=_WHY_GRAD_DTYPE,
    ),
    **_rules(
        _when_disabled(_WHY_FEATURE),
        "elasticity",
        "compression_training",
        "curriculum_learning",
        "data_efficiency",
        "pipeline",
        "sparse_attention",
        "tensor_parallel",
        "hybrid_engine",
        "weight_quantization",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "use_data_before_expert_parallelism",
    ),
}
_TOP_HANDLED = (
    "zero_optimization",
    "aio",
    "bf16",
    "bfloat16",
    "fp16",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "communication_data_type",
)

_ZERO_RULES = {
    **_rules(
        _WHY_TUNING,
        "contiguous_gradients",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "allgather_partitions",
        "allgather_bucket_size",
        "round_robin_gradients",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
        "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear",
        "ignore_unused_parameters",
        "legacy_stage1",
        "cpu_offload_use_pin_memory_buffers",
        "log_trace_cache_warnings",
        "override_module_apply",
        "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params",
        "zero_hpz_partition_size",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "pipeline_loading_checkpoint",
    ),
    **_rules(
        _WHY_SAVE,
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        "elastic_checkpoint",
        "load_from_fp32_weights",
    ),
    **_rules(
        _when_off(_WHY_QUANTIZED),
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "zeropp_loco_param",
    ),
}
_ZERO_HANDLED = (
    "stage",
    "sub_group_size",
    "offload_param",
    "offload_optimizer",
    "cpu_offload",
    "cpu_offload_params",
    "cpu_offload_use_pin_memory",
    "aio",
    "zenflow",
)

_OFFLOAD_HANDLED = ("device", "nvme_path", "pin_memory", "buffer_count")
_OFFLOAD_RULES = {
    **_rules(_WHY_OFFLOAD_TUNING, "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write", "pipeline"),
}

_AIO_HANDLED = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_gds")
_AIO_RULES = _rules(_WHY_AIO, "single_submit", "overlap_events")

_FP16_HANDLED = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale")
_FP16_RULES = {
    **_rules(_WHY_HYSTERESIS, "hysteresis", "consecutive_hysteresis"),
    "auto_cast": _when_off(_WHY_AUTOCAST),
    "fp16_master_weights_and_grads": _when_off(_WHY_LOW_MASTER),
    "type": _ignore("the fp16 dtype name (offload's fp16 is torch.float16)"),
}
# bf16_optimizer_states and bf16_master_weights_and_grads are read together (deepspeed._bf16_state)
_BF16_HANDLED = ("enabled", "bf16_optimizer_states", "bf16_master_weights_and_grads")
_BF16_RULES = {
    **_rules(_WHY_TUNING, "immediate_grad_update", "check_grad_overflow", "check_overflow"),
    "auto_cast": _when_off(_WHY_AUTOCAST),
}

_ADAM_TYPES = ("adam", "fusedadam", "cpuadam", "deepspeedcpuadam")
_OPT_PARAMS_HANDLED = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad", "max_grad_norm")
_OPT_PARAMS_RULES = {
    **_rules(
        _WHY_TORCH_IMPL,
        "torch_adam",
        "foreach",
        "fused",
        "capturable",
        "differentiable",
        "set_grad_none",
        "fp32_optimizer_states",
    ),
    "maximize": _when_off("maximizing the objective (offload's Adam minimises; negate the loss)"),
}

# DeepSpeed scheduler type (lower case) -> offload scheduler type, and its parameters with
# DeepSpeed's defaults (None: required, or "the optimizer's lr" for warmup_max_lr of WarmupLR).
_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "warmuplr": ("warmup", {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}),
    "warmupdecaylr": (
        "warmup_decay",
        {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    ),
    "warmupcosinelr": (
        "warmup_cosine",
        {
            "total_num_steps": None,
            "warmup_min_ratio": 0.0,
            "warmup_num_steps": 1000,
            "cos_min_ratio": 0.0001,
            "warmup_type": "log",
        },
    ),
    "onecycle": (
        "one_cycle",
        {
            "cycle_min_lr": None,
            "cycle_max_lr": None,
            "decay_lr_rate": 0.0,
            "cycle_first_step_size": 2000,
            "cycle_second_step_size": None,
            "cycle_first_stair_count": 0,
            "cycle_second_stair_count": None,
            "decay_step_size": 0,
            "cycle_momentum": True,
            "cycle_min_mom": 0.8,
            "cycle_max_mom": 0.9,
            "decay_mom_rate": 0.0,
        },
    ),
    "lrrangetest": (
        "lr_range_test",
        {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 2000,
            "lr_range_test_step_rate": 1.0,
            "lr_range_test_staircase": False,
        },
    ),
}
_SCHEDULER_NAMES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_SCHEDULER_REQUIRED = {"cycle_min_lr", "cycle_max_lr", "total_num_steps"}

_ACCEL_INLINE = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_ACCEL_INLINE_RULES = {
    "zero3_init_flag": _ignore(_WHY_ZERO3_INIT),
    "zero3_save_16bit_model": _ignore(_WHY_SAVE),
    "deepspeed_moe_layer_cls_names": _ignore(_WHY_TUNING),
    **_rules(
        _WHY_LAUNCHER,
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter",
    ),
}
_MIXED_PRECISIONS = ("no", "fp16", "bf16")


# ---- the tables as rows, for the documentation --------------------------------------------
class KeyVerdict(enum.Enum):
    """What offload does with a DeepSpeed or accelerate key it meets."""

    READ = "read"
    """Translated onto an offload key."""
    IGNORED = "ignored"
    """Accepted and listed once in the log: it only tunes, logs or belongs to another tool."""
    REFUSED_UNLESS_OFF = "refused unless off"
    """Accepted while its feature is off (or its value is one offload honours); refused otherwise."""


@dataclass(frozen=True)
class KeyRow:
    """One key of one section: what offload does with it, and why (empty for a key it reads)."""

    section: str
    key: str
    verdict: KeyVerdict
    why: str = ""


SECTIONS: tuple[tuple[str, tuple[str, ...], dict[str, _Rule]], ...] = (
    ("", _TOP_HANDLED, _TOP_RULES),
    ("zero_optimization", _ZERO_HANDLED, _ZERO_RULES),
    ("zero_optimization.offload_param", _OFFLOAD_HANDLED, _OFFLOAD_RULES),
    ("zero_optimization.offload_optimizer", _OFFLOAD_HANDLED, _OFFLOAD_RULES),
    ("aio", _AIO_HANDLED, _AIO_RULES),
    ("fp16", _FP16_HANDLED, _FP16_RULES),
    ("bf16", _BF16_HANDLED, _BF16_RULES),
    ("optimizer.params", _OPT_PARAMS_HANDLED, _OPT_PARAMS_RULES),
    ("accelerate: deepspeed_config", (*_ACCEL_INLINE, "deepspeed_config_file"), _ACCEL_INLINE_RULES),
)
"""(section, the keys its translator reads, the rules for the others), as the translators judge
them (`_Builder.sort_section`); `offload_optimizer` also reads `deepspeed_offload`'s keys."""


def key_rows(sections: Sequence[tuple[str, Sequence[str], dict[str, _Rule]]] = SECTIONS) -> list[KeyRow]:
    """Every key of `sections`, section by section: the keys read in the translator's order, then
    the others sorted by name, each with its verdict and the reason the log or the error gives."""
    rows: list[KeyRow] = []
    for section, handled, rules in sections:
        rows.extend(KeyRow(section, key, KeyVerdict.READ) for key in handled)
        for key in sorted(rules):
            rule = rules[key]
            if rule.ok is None:
                rows.append(KeyRow(section, key, KeyVerdict.IGNORED, rule.why))
            else:
                rows.append(KeyRow(section, key, KeyVerdict.REFUSED_UNLESS_OFF, rule.why_not))
    return rows


def _nearest(key: str, known) -> str:
    match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else "check the spelling"


# ---- the translation state ------------------------------------------------------------------
class _Builder:
    """Collects a Translation while the sections are read (every read names the user's key)."""

    def __init__(self, names: dict[str, str] | None = None, kind: str = "DeepSpeed") -> None:
        self.names = names or {}
        self.result = Translation(kind=kind)

    def n(self, path: str) -> str:
        """How a DeepSpeed key path is shown to the user (accelerate keys keep their own name)."""
        return self.names.get(path, path)

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.result.kind} config key '{self.n(path)}': {message}", key=self.n(path))

    def set(self, target: str, value: Any, source: str) -> None:
        *parents, leaf = target.split(".")
        node = self.result.config
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
        self.result.sources[target] = self.n(source)

    def has(self, target: str) -> bool:
        return target in self.result.sources

    def ignored(self, path: str, why: str) -> None:
        self.result.ignored.append((self.n(path), why))

    def unsupported(self, path: str, why: str) -> None:
        self.result.unsupported.append((self.n(path), why))

    def auto(self, path: str, chosen: str) -> None:
        self.result.auto.append((self.n(path), chosen))

    def sort_section(self, prefix: str, section: dict, handled, rules: dict[str, _Rule]) -> None:
        """Judges every key of `section` that is not handled: ignored, unsupported or unknown."""
        for key, value in section.items():
            if key in handled:
                continue
            path = f"{prefix}.{key}" if prefix else key
            rule = rules.get(key)
            if rule is None:
                self.unsupported(path, f"not a key offload knows here; {_nearest(key, list(handled) + list(rules))}")
                continue
            kind, why = rule.judge(value)
            (self.ignored if kind == "ignored" else self.unsupported)(path, why)

    # -- typed reads ------------------------------------------------------------------
    def section(self, mapping: dict, key: str, path: str) -> dict | None:
        value = mapping.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {value!r}")
        return value

    def number(self, value: Any, path: str, *, integer: bool = False) -> Any:
        if value == "auto":
            raise self.fail(path, "'auto' cannot be resolved here; give a value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {value!r}")
        if integer:
            if isinstance(value, float) and not value.is_integer():
                raise self.fail(path, f"expected an integer, got {value!r}")
            return int(value)
        return value

    def flag(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {value!r}")
        return value
