"""Translation of DeepSpeed (and accelerate) configs into offload's config.

`translate(mapping, strict=True)` turns a DeepSpeed JSON mapping into an offload config dict,
which `offload.config.load_config` then validates (it calls `translate` itself whenever
`is_deepspeed_config` recognises the mapping). `load_accelerate_config(path, strict=True)`
reads an accelerate config YAML, either pointing at a DeepSpeed JSON
(`deepspeed_config: {deepspeed_config_file: ...}`) or with accelerate's inline keys.

Nothing is silently dropped. Every key ends in one of four places:

* mapped onto an offload key (and an error that offload's validation raises names the
  DeepSpeed key it came from);
* used for validation only, or resolved from `"auto"`, or ignored because DeepSpeed itself
  ignores it (a disabled `fp16` / `bf16` section, an `offload_*` section whose device is
  `none`): each logged at INFO;
* a key with no meaning here (DeepSpeed tuning knobs, monitoring, schedulers...) or a key
  DeepSpeed does not know either (a typo; the nearest known key is suggested): all of them
  are collected into ONE message, raised as `ConfigError` with `strict=True` (the default)
  and logged as a WARNING with `strict=False`;
* a value that cannot be honoured (it would change the training maths or the placement in a
  way offload cannot do): always a `ConfigError`, whatever `strict` says.

Mapping rules
-------------
zero_optimization
    `stage` 0..3 (DeepSpeed's default 0). offload always partitions state across ranks, so
    the stage only decides whether `offload_param` is allowed: stage 3 maps
    `offload_param.device` (`cpu` / `nvme` / `none`) onto `offload.param`; stages 1-2 keep
    parameters on the accelerator (`offload.param = "none"`) and an active `offload_param`
    there is an error (DeepSpeed supports parameter offload only in stage 3); stage 0 with
    an active offload section is an error (DeepSpeed refuses it too).
    `offload_optimizer.device` `cpu` / `nvme` maps onto `offload.optimizer`; `none` or an
    absent section gives `cpu` (offload always keeps the optimizer on the host; logged).
    The legacy spellings `cpu_offload`, `cpu_offload_params`, `cpu_offload_use_pin_memory`
    are read as `offload_optimizer.device cpu`, `offload_param.device cpu`, `pin_memory`.
    `nvme_path`: offload has one swap directory, so the sections whose device is `nvme`
    must name the same path (compared after normalisation); two different paths are an
    error naming both keys. A `nvme` device without `nvme_path` is an error (as in DeepSpeed).
    `pin_memory`: one switch here; two active sections that disagree are an error. Absent:
    offload's default (pinned), not DeepSpeed's (pageable), because offload budgets pinned
    memory up front (logged).
    `buffer_count`: the larger of the active sections' counts; below offload's minimum of
    2 it is raised to 2 with a warning.
    `buffer_size`, `max_in_cpu`, `fast_init`, `pipeline_read`, `pipeline_write`, `ratio` and
    the bucket / persistence / prefetch knobs (`stage3_*`, `reduce_bucket_size`,
    `allgather_bucket_size`, `overlap_comm`, `contiguous_gradients`, `sub_group_size`,
    `round_robin_gradients`, `reduce_scatter`, `allgather_partitions`, ...) have no meaning
    here: offload sizes every buffer per unit exactly and always overlaps transfers with
    compute. `overlap_comm: true` is harmless but still listed (no silent drops).
aio
    `block_size` -> `io.block_size`, `queue_depth` -> `io.queue_depth`, `thread_count`
    (old spelling) or `intra_op_parallelism` (new) -> `io.threads` (both given and different
    is an error). `single_submit`, `overlap_events`, `use_gds` are listed as having no meaning;
    `use_gds: true` is always an error (GPUDirect Storage cannot be honoured).
bf16 / fp16 (and the legacy `bfloat16` section)
    `bf16.enabled` -> precision `bf16`; `fp16.enabled` -> `fp16`; neither -> `fp32`; both
    true is an error. fp16: `initial_scale_power` p -> `loss_scale.initial = 2**p`,
    `loss_scale_window` -> `loss_scale.growth_interval`, `min_loss_scale` ->
    `loss_scale.min_scale`; `loss_scale` 0 means dynamic scaling (offload's only mode), a
    positive `loss_scale` (static scaling) is an error. `hysteresis`,
    `consecutive_hysteresis`, `auto_cast` and the `*_master_weights_*` switches are listed
    (offload backs off on the first overflow and always keeps fp32 masters on the host).
    Keys of a disabled section are ignored, as DeepSpeed ignores them (logged).
optimizer
    `type` (case-insensitive) `AdamW` -> `adamw`; `Adam`, `FusedAdam`, `CPUAdam`,
    `DeepSpeedCPUAdam` -> `adamw` unless `params.adam_w_mode` is false (DeepSpeed's default
    for these types is `adam_w_mode: true`, i.e. decoupled weight decay), then `adam`.
    `AdamW` with `adam_w_mode: false` stays AdamW, as in DeepSpeed (warned). Any other type is
    an error naming it. `params`: `lr`, `betas`, `eps`, `weight_decay`, `bias_correction`
    map directly; absent ones take DeepSpeed's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
    weight_decay 0); `torch_adam: false` and `amsgrad: false` are what offload does;
    `torch_adam: true` is listed (offload always runs its C++ kernel; same maths);
    `amsgrad: true` and `max_grad_norm` are errors (use `gradient_clipping`). No `optimizer`
    section: offload's default AdamW (logged).
scheduler
    Listed as having no meaning: offload runs no learning-rate schedule; drive the learning
    rate from the training loop.
gradient_clipping, gradient_accumulation_steps
    Mapped directly.
train_batch_size, train_micro_batch_size_per_gpu
    Not part of offload's config (the training loop chooses the batch size). They are used
    for validation only (logged): with all three of batch, micro-batch and accumulation known,
    `train_batch_size == micro * gradient_accumulation_steps * world_size` must hold (world
    size from torch.distributed when initialised, else the `WORLD_SIZE` environment variable,
    else 1); with batch and micro-batch known and accumulation absent or `"auto"`, the
    accumulation steps are derived as DeepSpeed does.
"auto" values (Hugging Face Trainer / accelerate configs), each resolution logged at INFO
    optimizer params -> offload's defaults; `gradient_accumulation_steps` -> 1 (or derived
    from the batch sizes); `gradient_clipping` -> 0, clipping off (the HF Trainer would fill in
    its `max_grad_norm`: write a number to clip); batch sizes -> not checked;
    `bf16.enabled` -> true where bf16 is supported (a bf16-capable GPU, or no GPU) unless fp16
    is explicitly enabled; `fp16.enabled` -> true only where a GPU without bf16 is present and
    bf16 is not enabled. From an accelerate config, its `mixed_precision` resolves both.
    `"auto"` anywhere else is an error asking for a value.
Keys of offload's own schema (`precision`, `offload`, `prefetch`, `overlap`, `io`, `wrap`,
`loss_scale`, `seed`) at the top level of a DeepSpeed config are an error: don't mix the two.
Monitoring / logging keys (`steps_per_print`, `wall_clock_breakdown`, `flops_profiler`,
`tensorboard`, ...), `zero_allow_untested_optimizer` and DeepSpeed features offload does not
implement are listed as having no meaning here.

accelerate
    `deepspeed_config.deepspeed_config_file` (relative paths are tried against the working
    directory, then the YAML's directory) is translated like any DeepSpeed JSON; other
    inline DeepSpeed keys beside it are an error (set them in the JSON, as accelerate
    requires). Inline keys: `zero_stage`, `offload_optimizer_device`, `offload_param_device`,
    `offload_optimizer_nvme_path`, `offload_param_nvme_path`, `gradient_accumulation_steps`,
    `gradient_clipping`, with top-level `mixed_precision` (`no` / `fp16` / `bf16`; `fp8` is an
    error). `zero3_init_flag`, `zero3_save_16bit_model` and unknown inline keys are listed as
    having no meaning. Launcher keys (`num_processes`, `machine_rank`, `distributed_type`,
    the `deepspeed_*` launcher options...) are for `accelerate launch` and are logged at INFO.
"""
from __future__ import annotations

import difflib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

from offload.errors import ConfigError

log = logging.getLogger(__name__)

_OWN_KEYS = ("precision", "offload", "prefetch", "overlap", "io", "wrap", "loss_scale", "seed")

_WHY_TUNING = (
    "offload sizes every buffer per unit exactly and always overlaps transfers with compute, "
    "so DeepSpeed's bucket, persistence, prefetch and buffer-size tuning has nothing to tune"
)
_WHY_SAVE = "offload gathers full weights on demand: use engine.consolidated_state_dict() or `offload export`"
_WHY_FEATURE = "a DeepSpeed feature offload does not implement"
_WHY_MONITOR = "logging, profiling and monitoring are not configured through offload (use your own logger or torch.profiler)"
_WHY_SCHEDULER = "offload runs no learning-rate schedule; change the learning rate from your training loop"
_WHY_OPT_CHECK = "offload always runs its own CPU Adam/AdamW, so DeepSpeed's optimizer checks do not apply"
_WHY_COMM = "offload reduce-scatters gradients averaged over ranks; it has no gradient communication options"
_WHY_AIO = "offload's I/O engine has no such switch (it batches submissions and overlaps completions itself)"
_WHY_HYSTERESIS = "offload's dynamic loss scaling backs off on the first overflow; it has no hysteresis"
_WHY_MASTER = "offload always keeps fp32 master weights, gradients and optimizer states on the host"
_WHY_AUTOCAST = "offload casts parameters, not inputs; cast inputs in your training loop"
_WHY_TORCH_ADAM = "offload always runs its C++ CPU Adam/AdamW (the same maths as torch's)"
_WHY_TORCH_FLAGS = "a torch.optim implementation switch; offload runs its C++ CPU Adam/AdamW"
_WHY_OFFLOAD_TUNING = "offload sizes host buffers per unit exactly and pipelines NVMe reads and writes itself"
_WHY_RATIO = "offload places all optimizer state on one tier (no partial offload)"
_WHY_ZERO3_INIT = "offload partitions the model at initialize(); there is no construction-time hook to enable"

_TOP_LEVEL_NO_MEANING = {
    **dict.fromkeys(
        ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler",
         "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "monitor_config", "timers"),
        _WHY_MONITOR,
    ),
    "scheduler": _WHY_SCHEDULER,
    **dict.fromkeys(("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"), _WHY_OPT_CHECK),
    **dict.fromkeys(
        ("prescale_gradients", "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
         "seq_parallel_communication_data_type", "disable_allgather"),
        _WHY_COMM,
    ),
    "activation_checkpointing": "apply torch.utils.checkpoint inside the model (offload handles checkpointed modules)",
    "amp": "NVIDIA apex AMP is not supported; use bf16 or fp16",
    "data_types": "offload accumulates gradients in fp32 on the host",
    "checkpoint": "engine.save_checkpoint writes one file per tensor; it has no tag or parallel-write options",
    **dict.fromkeys(
        ("elasticity", "autotuning", "compression_training", "curriculum_learning", "data_efficiency",
         "pipeline", "sparse_attention", "tensor_parallel", "hybrid_engine", "nebula", "weight_quantization",
         "eigenvalue", "progressive_layer_drop", "quantize_training", "zero_quantized_weights", "graph_harvesting",
         "compile", "use_data_before_expert_parallelism", "use_node_local_storage"),
        _WHY_FEATURE,
    ),
}

_TOP_LEVEL_HANDLED = (
    "zero_optimization", "aio", "bf16", "bfloat16", "fp16", "optimizer", "gradient_clipping",
    "gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
)

_ZERO_NO_MEANING = {
    **dict.fromkeys(
        ("contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
         "allgather_bucket_size", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
         "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
         "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
         "model_persistence_threshold", "stage3_model_persistence_threshold", "use_multi_rank_bucket_allreduce",
         "memory_efficient_linear", "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
         "legacy_stage1", "cpu_offload_use_pin_memory_buffers", "log_trace_cache_warnings", "override_module_apply",
         "pipeline_loading_checkpoint"),
        _WHY_TUNING,
    ),
    **dict.fromkeys(
        ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
         "gather_16bit_weights_on_model_save"),
        _WHY_SAVE,
    ),
    **dict.fromkeys(
        ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
         "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather", "module_granularity_threshold",
         "zeropp_loco_param", "stage3_use_all_reduce_for_fetch_params", "log_trace_cache_warnings"),
        _WHY_FEATURE,
    ),
}
_ZERO_HANDLED = ("stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")

_OFFLOAD_HANDLED = ("device", "nvme_path", "pin_memory", "buffer_count")
_OFFLOAD_NO_MEANING = {
    "buffer_size": _WHY_OFFLOAD_TUNING,
    "max_in_cpu": _WHY_OFFLOAD_TUNING,
    "fast_init": _WHY_OFFLOAD_TUNING,
    "pipeline_read": _WHY_OFFLOAD_TUNING,
    "pipeline_write": _WHY_OFFLOAD_TUNING,
    "pipeline": _WHY_OFFLOAD_TUNING,
    "ratio": _WHY_RATIO,
}

_AIO_HANDLED = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism")
_AIO_NO_MEANING = dict.fromkeys(("single_submit", "overlap_events", "use_gds"), _WHY_AIO)

_FP16_HANDLED = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale")
_FP16_NO_MEANING = {
    "hysteresis": _WHY_HYSTERESIS,
    "consecutive_hysteresis": _WHY_HYSTERESIS,
    "auto_cast": _WHY_AUTOCAST,
    "fp16_master_weights_and_grads": _WHY_MASTER,
    "type": _WHY_MASTER,
}
_BF16_HANDLED = ("enabled",)
_BF16_NO_MEANING = dict.fromkeys(
    ("immediate_grad_update", "check_grad_overflow", "check_overflow", "bf16_master_weights_and_grads",
     "bf16_optimizer_states", "auto_cast"),
    _WHY_MASTER,
)
_BF16_NO_MEANING["auto_cast"] = _WHY_AUTOCAST

_ADAM_TYPES = ("adam", "fusedadam", "cpuadam", "deepspeedcpuadam")
_OPT_PARAMS_HANDLED = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam", "amsgrad", "max_grad_norm")
_OPT_PARAMS_NO_MEANING = dict.fromkeys(("foreach", "fused", "capturable", "differentiable", "maximize", "set_grad_none", "fp32_optimizer_states"), _WHY_TORCH_FLAGS)
# DeepSpeed's own defaults for Adam/AdamW (FusedAdam / DeepSpeedCPUAdam): used for absent params.
_DS_OPT_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

_ACCEL_INLINE = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_ACCEL_INLINE_NO_MEANING = {
    "zero3_init_flag": _WHY_ZERO3_INIT,
    "zero3_save_16bit_model": _WHY_SAVE,
    "deepspeed_moe_layer_cls_names": _WHY_FEATURE,
}
_ACCEL_LAUNCHER = ("deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")
_MIXED_PRECISIONS = ("no", "fp16", "bf16")


def _bf16_supported() -> bool:
    """bf16 on this machine: a CUDA device that supports it, or no CUDA device (the CPU runs bf16)."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return True


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:  # pragma: no cover - torch always ships torch.distributed
        pass
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ConfigError(f"environment variable WORLD_SIZE={value!r} is not an integer; unset it or fix it") from None


def _nearest(key: str, known) -> str:
    match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else "check the spelling"


class _Translation:
    def __init__(self, strict: bool, names: Optional[dict[str, str]] = None):
        self.strict = strict
        self.names = names or {}
        self.out: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # offload path -> DeepSpeed key it came from
        self.no_meaning: list[tuple[str, str]] = []  # (key, why)

    # -- naming and recording ---------------------------------------------------------
    def n(self, path: str) -> str:
        """How a DeepSpeed key path is shown to the user (accelerate keys keep their own name)."""
        return self.names.get(path, path)

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"DeepSpeed config key '{self.n(path)}': {message}")

    def set(self, target: str, value: Any, source: str) -> None:
        *parents, leaf = target.split(".")
        node = self.out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
        self.origin[target] = source

    def unused(self, path: str, why: str) -> None:
        self.no_meaning.append((self.n(path), why))

    def unknown(self, path: str, key: str, known) -> None:
        self.no_meaning.append((self.n(path), f"not a key offload knows in this section; {_nearest(key, known)}"))

    def sort_section(self, prefix: str, section: dict, handled, no_meaning: dict) -> None:
        """Records every key of `section` that is neither handled nor known as meaningless here."""
        for key in section:
            if key in handled:
                continue
            path = f"{prefix}.{key}" if prefix else key
            if key in no_meaning:
                self.unused(path, no_meaning[key])
            else:
                self.unknown(path, key, list(handled) + list(no_meaning))

    # -- typed reads ------------------------------------------------------------------
    def section(self, mapping: dict, key: str, path: str) -> Optional[dict]:
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


def translate(mapping: dict, strict: bool = True, *, _mixed_precision: Optional[str] = None,
              _names: Optional[dict[str, str]] = None, _extra_no_meaning: Optional[list[tuple[str, str]]] = None) -> dict:
    """An offload config dict from a DeepSpeed config mapping (see the module docstring for the rules).

    Keys with no meaning here are listed in one ConfigError (`strict=True`) or one logged warning
    (`strict=False`); values that cannot be honoured are a ConfigError either way. The result is
    checked with offload's validation, and an error there names the DeepSpeed key it came from.
    """
    if not isinstance(mapping, dict):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(mapping).__name__}")
    t = _Translation(strict, _names)
    if _extra_no_meaning:
        t.no_meaning.extend(_extra_no_meaning)

    mixed = sorted(key for key in mapping if key in _OWN_KEYS)
    if mixed:
        raise ConfigError(
            f"config keys {', '.join(repr(k) for k in mixed)} belong to offload's own schema but this is a DeepSpeed "
            "config (it has DeepSpeed keys such as zero_optimization / bf16 / fp16 / train_batch_size); "
            "don't mix the two: write either an offload config or a DeepSpeed config"
        )
    for key in mapping:
        if key in _TOP_LEVEL_HANDLED:
            continue
        if key in _TOP_LEVEL_NO_MEANING:
            t.unused(key, _TOP_LEVEL_NO_MEANING[key])
        else:
            t.unknown(key, key, list(_TOP_LEVEL_HANDLED) + list(_TOP_LEVEL_NO_MEANING))

    _zero(t, mapping)
    _aio(t, mapping)
    _precision(t, mapping, _mixed_precision)
    _optimizer(t, mapping)
    _steps(t, mapping)
    _report(t)
    _check(t)
    return t.out


def _device(t: _Translation, section: Optional[dict], path: str) -> str:
    if section is None:
        return "none"
    device = section.get("device", "none")
    if device is None:
        device = "none"
    if device not in ("none", "cpu", "nvme"):
        raise t.fail(f"{path}.device", f"{device!r} is not one of none, cpu, nvme")
    return device


def _zero(t: _Translation, mapping: dict) -> None:
    zero = t.section(mapping, "zero_optimization", "zero_optimization") or {}
    t.sort_section("zero_optimization", zero, _ZERO_HANDLED, _ZERO_NO_MEANING)
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise t.fail("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {stage!r}")

    sections = {}
    for name in ("offload_param", "offload_optimizer"):
        path = f"zero_optimization.{name}"
        sections[name] = t.section(zero, name, path)
    # Legacy (pre-0.3.16) spellings.
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_params": "offload_param"}
    for old, name in legacy.items():
        if old in zero:
            if t.flag(zero[old], f"zero_optimization.{old}"):
                if sections[name] is not None:
                    raise t.fail(f"zero_optimization.{old}", f"give either it or zero_optimization.{name}, not both")
                sections[name] = {"device": "cpu"}
                log.info("DeepSpeed zero_optimization.%s: true read as zero_optimization.%s.device 'cpu'", old, name)
    if "cpu_offload_use_pin_memory" in zero:
        pin = t.flag(zero["cpu_offload_use_pin_memory"], "zero_optimization.cpu_offload_use_pin_memory")
        for name in ("offload_param", "offload_optimizer"):
            if sections[name] is not None and "pin_memory" not in sections[name]:
                sections[name] = {**sections[name], "pin_memory": pin}
        log.info("DeepSpeed zero_optimization.cpu_offload_use_pin_memory read as the offload sections' pin_memory")

    devices = {name: _device(t, sections[name], f"zero_optimization.{name}") for name in sections}
    active = {name: sections[name] for name in sections if devices[name] != "none"}
    for name, section in sections.items():
        path = f"zero_optimization.{name}"
        if section is None:
            continue
        if name in active:
            t.sort_section(path, section, _OFFLOAD_HANDLED, _OFFLOAD_NO_MEANING)
        else:
            ignored = sorted(k for k in section if k != "device")
            if ignored:
                log.info("DeepSpeed %s: device is 'none', so %s are ignored (as DeepSpeed ignores them)",
                         t.n(path), ", ".join(ignored))

    if stage == 0 and active:
        raise t.fail("zero_optimization.stage", f"stage 0 cannot offload ({', '.join(t.n('zero_optimization.' + a) for a in active)} "
                     "is set; DeepSpeed refuses this too); set stage 2 or 3")
    if stage < 3 and "offload_param" in active:
        raise t.fail("zero_optimization.offload_param",
                     f"parameter offload needs zero_optimization.stage 3 (it is {stage}); set stage 3 or device 'none'")
    param = devices["offload_param"] if stage == 3 else "none"
    t.set("offload.param", param, "zero_optimization.offload_param.device")
    optimizer = devices["offload_optimizer"]
    if optimizer == "none":
        optimizer = "cpu"
        log.info("DeepSpeed %s is none or absent: offload always keeps the optimizer on the host, so offload.optimizer is 'cpu'",
                 t.n("zero_optimization.offload_optimizer.device"))
    t.set("offload.optimizer", optimizer, "zero_optimization.offload_optimizer.device")
    if stage in (1, 2, 3):
        log.info("DeepSpeed zero_optimization.stage %d: offload always partitions optimizer state across ranks", stage)

    # nvme_path: one swap directory here.
    paths = {}
    for name, section in active.items():
        key = f"zero_optimization.{name}.nvme_path"
        if devices[name] == "nvme":
            value = section.get("nvme_path")
            if not isinstance(value, str) or not value:
                raise t.fail(key, f"device 'nvme' needs a directory here, got {value!r}")
            paths[key] = value
        elif "nvme_path" in section:
            log.info("DeepSpeed %s is not used: the device there is %r", t.n(key), devices[name])
    if len({os.path.normpath(p) for p in paths.values()}) > 1:
        shown = " and ".join(f"'{t.n(k)}' = {v!r}" for k, v in paths.items())
        raise ConfigError(f"DeepSpeed config gives two different NVMe paths, {shown}; offload keeps parameters and "
                          "optimizer state in one swap directory: give both the same path")
    if paths:
        key, value = next(iter(paths.items()))
        t.set("offload.nvme_path", value, key)

    pins = {}
    for name, section in active.items():
        if "pin_memory" in section:
            pins[f"zero_optimization.{name}.pin_memory"] = t.flag(section["pin_memory"], f"zero_optimization.{name}.pin_memory")
    if len(set(pins.values())) > 1:
        shown = " and ".join(f"'{t.n(k)}' = {str(v).lower()}" for k, v in pins.items())
        raise ConfigError(f"DeepSpeed config gives {shown}; offload has one pin_memory switch for all host buffers: give both the same value")
    if pins:
        key, value = next(iter(pins.items()))
        t.set("offload.pin_memory", value, key)
    elif active:
        log.info("DeepSpeed offload sections give no pin_memory: offload's default (pinned host buffers, budgeted up front) is used")

    counts = {}
    for name, section in active.items():
        if "buffer_count" in section:
            key = f"zero_optimization.{name}.buffer_count"
            counts[key] = t.number(section["buffer_count"], key, integer=True)
    if counts:
        key = max(counts, key=counts.get)
        value = counts[key]
        if len(set(counts.values())) > 1:
            log.info("DeepSpeed buffer_count differs between offload sections (%s): offload.buffer_count uses the larger, %d",
                     ", ".join(f"{t.n(k)}={v}" for k, v in counts.items()), value)
        if value < 2:
            log.warning("DeepSpeed %s = %d is below offload's minimum of 2 buffers (read next, step this, write last); using 2",
                        t.n(key), value)
            value = 2
        t.set("offload.buffer_count", value, key)


def _aio(t: _Translation, mapping: dict) -> None:
    aio = t.section(mapping, "aio", "aio")
    if aio is None:
        return
    if aio.get("use_gds") is True:
        raise t.fail("aio.use_gds", "GPUDirect Storage cannot be honoured: offload reads swap files through host buffers; "
                     "set it to false or remove it")
    t.sort_section("aio", aio, _AIO_HANDLED, _AIO_NO_MEANING)
    if "block_size" in aio:
        t.set("io.block_size", t.number(aio["block_size"], "aio.block_size", integer=True), "aio.block_size")
    if "queue_depth" in aio:
        t.set("io.queue_depth", t.number(aio["queue_depth"], "aio.queue_depth", integer=True), "aio.queue_depth")
    threads = {k: t.number(aio[k], f"aio.{k}", integer=True) for k in ("thread_count", "intra_op_parallelism") if k in aio}
    if len(set(threads.values())) > 1:
        raise t.fail("aio.intra_op_parallelism", f"is the new spelling of aio.thread_count but the two differ ({threads}); "
                     "keep one of them")
    if threads:
        key = next(iter(threads))
        t.set("io.threads", threads[key], f"aio.{key}")


def _enabled(t: _Translation, section: Optional[dict], path: str) -> Any:
    if section is None:
        return False
    value = section.get("enabled", False)
    if value == "auto":
        return "auto"
    return t.flag(value, f"{path}.enabled")


def _precision(t: _Translation, mapping: dict, mixed_precision: Optional[str]) -> None:
    if "bf16" in mapping and "bfloat16" in mapping:
        raise t.fail("bfloat16", "is the old name of the bf16 section; keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in mapping else "bf16"
    bf16 = t.section(mapping, bf16_key, bf16_key)
    fp16 = t.section(mapping, "fp16", "fp16")
    b = _enabled(t, bf16, bf16_key)
    f = _enabled(t, fp16, "fp16")
    if b is True and f is True:
        raise t.fail("fp16.enabled", f"and {bf16_key}.enabled are both true; enable one of them")
    if mixed_precision is not None:
        for explicit, name, wanted in ((b, bf16_key, "bf16"), (f, "fp16", "fp16")):
            if explicit is True and mixed_precision != wanted:
                raise ConfigError(f"accelerate mixed_precision {mixed_precision!r} contradicts '{name}.enabled': true in the "
                                  "DeepSpeed config; make them agree")
        if b == "auto":
            b = mixed_precision == "bf16"
            log.info("DeepSpeed %s.enabled 'auto' resolved to %s from accelerate mixed_precision %r", bf16_key, str(b).lower(), mixed_precision)
        if f == "auto":
            f = mixed_precision == "fp16"
            log.info("DeepSpeed fp16.enabled 'auto' resolved to %s from accelerate mixed_precision %r", str(f).lower(), mixed_precision)
    if b == "auto":
        b = f is not True and _bf16_supported()
        log.info("DeepSpeed %s.enabled 'auto' resolved to %s (%s)", bf16_key, str(b).lower(),
                 "fp16 is enabled" if f is True else ("bf16 is supported here" if b else "this GPU has no bf16"))
    if f == "auto":
        f = b is not True and _cuda_available()
        log.info("DeepSpeed fp16.enabled 'auto' resolved to %s (%s)", str(f).lower(),
                 "bf16 is enabled" if b is True else ("a GPU without bf16 is present" if f else "no GPU: fp32"))
    precision = "bf16" if b else "fp16" if f else "fp32"
    t.set("precision", precision, f"{bf16_key}.enabled" if b else "fp16.enabled")

    if bf16 is not None:
        if b:
            t.sort_section(bf16_key, bf16, _BF16_HANDLED, _BF16_NO_MEANING)
        elif set(bf16) - {"enabled"}:
            log.info("DeepSpeed %s is disabled, so %s are ignored (as DeepSpeed ignores them)", bf16_key, ", ".join(sorted(set(bf16) - {"enabled"})))
    if fp16 is None:
        return
    if not f:
        rest = sorted(set(fp16) - {"enabled"})
        if rest:
            log.info("DeepSpeed fp16 is disabled, so %s are ignored (as DeepSpeed ignores them)", ", ".join(rest))
        return
    t.sort_section("fp16", fp16, _FP16_HANDLED, _FP16_NO_MEANING)
    scale = fp16.get("loss_scale", 0)
    if scale != "auto" and t.number(scale, "fp16.loss_scale") > 0:
        raise t.fail("fp16.loss_scale", f"{scale} asks for static loss scaling, which offload does not do (it scales "
                     "dynamically and skips a step on overflow); set it to 0")
    if fp16.get("initial_scale_power", "auto") != "auto":
        power = t.number(fp16["initial_scale_power"], "fp16.initial_scale_power", integer=True)
        t.set("loss_scale.initial", float(2.0**power), "fp16.initial_scale_power")
    if fp16.get("loss_scale_window", "auto") != "auto":
        t.set("loss_scale.growth_interval", t.number(fp16["loss_scale_window"], "fp16.loss_scale_window", integer=True), "fp16.loss_scale_window")
    if fp16.get("min_loss_scale", "auto") != "auto":
        t.set("loss_scale.min_scale", float(t.number(fp16["min_loss_scale"], "fp16.min_loss_scale")), "fp16.min_loss_scale")


def _optimizer(t: _Translation, mapping: dict) -> None:
    opt = t.section(mapping, "optimizer", "optimizer")
    if opt is None:
        log.info("DeepSpeed config has no 'optimizer' section: offload's default AdamW (optimizer.* defaults) is used")
        return
    flat = sorted(k for k in opt if k in _OPT_PARAMS_HANDLED)
    if flat:
        raise t.fail("optimizer", f"{', '.join(flat)} belong under 'optimizer.params' in a DeepSpeed config; move them there")
    t.sort_section("optimizer", opt, ("type", "params"), {"legacy_fusion": _WHY_TORCH_FLAGS})
    kind = opt.get("type")
    if not isinstance(kind, str):
        raise t.fail("optimizer.type", f"expected a string such as 'AdamW', got {kind!r}")
    params = t.section(opt, "params", "optimizer.params") or {}
    t.sort_section("optimizer.params", params, _OPT_PARAMS_HANDLED, _OPT_PARAMS_NO_MEANING)
    adam_w_mode = params.get("adam_w_mode", True)
    adam_w_mode = t.flag(adam_w_mode, "optimizer.params.adam_w_mode")
    lowered = kind.lower()
    if lowered == "adamw":
        ours = "adamw"
        if not adam_w_mode:
            log.warning("DeepSpeed optimizer.params.adam_w_mode false has no effect with type %r: DeepSpeed runs AdamW "
                        "(decoupled weight decay) and so does offload; use type 'Adam' for L2 weight decay", kind)
    elif lowered in _ADAM_TYPES:
        ours = "adamw" if adam_w_mode else "adam"
        if "adam_w_mode" not in params:
            log.info("DeepSpeed optimizer type %r without adam_w_mode means AdamW (DeepSpeed's default adam_w_mode is true)", kind)
    else:
        raise t.fail("optimizer.type", f"{kind!r} cannot be honoured: offload's CPU optimizer is Adam/AdamW only; "
                     "use type 'AdamW' (or 'Adam')")
    t.set("optimizer.type", ours, "optimizer.type")
    if params.get("torch_adam") is not None and t.flag(params["torch_adam"], "optimizer.params.torch_adam"):
        t.unused("optimizer.params.torch_adam", _WHY_TORCH_ADAM)
    if params.get("amsgrad") is not None and t.flag(params["amsgrad"], "optimizer.params.amsgrad"):
        raise t.fail("optimizer.params.amsgrad", "AMSGrad cannot be honoured (offload's Adam keeps no max of the second "
                     "moment); set it to false")
    if "max_grad_norm" in params:
        raise t.fail("optimizer.params.max_grad_norm", "is not an optimizer parameter; use the top-level 'gradient_clipping'")
    for key in ("lr", "betas", "eps", "weight_decay"):
        path = f"optimizer.params.{key}"
        value = params.get(key)
        if value == "auto":
            from offload.config import OptimizerConfig

            log.info("DeepSpeed %s 'auto' resolved to offload's default %r", path, getattr(OptimizerConfig(), key))
            continue
        if value is None:
            value = _DS_OPT_DEFAULTS[key]
            log.info("DeepSpeed %s not given: DeepSpeed's default %r is used", path, value)
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise t.fail(path, f"expected a list of two numbers, got {value!r}")
            value = tuple(t.number(v, f"{path}[{i}]") for i, v in enumerate(value))
        else:
            value = t.number(value, path)
        t.set(f"optimizer.{key}", value, path)
    if "bias_correction" in params:
        t.set("optimizer.bias_correction", t.flag(params["bias_correction"], "optimizer.params.bias_correction"),
              "optimizer.params.bias_correction")


def _steps(t: _Translation, mapping: dict) -> None:
    clip = mapping.get("gradient_clipping")
    if clip == "auto":
        t.set("gradient_clipping", 0.0, "gradient_clipping")
        log.info("DeepSpeed gradient_clipping 'auto' resolved to 0 (clipping off); the Hugging Face Trainer would use its "
                 "max_grad_norm: write a number to clip")
    elif clip is not None:
        t.set("gradient_clipping", t.number(clip, "gradient_clipping"), "gradient_clipping")

    def known(key: str) -> Optional[int]:
        value = mapping.get(key)
        if value is None or value == "auto":
            if value == "auto" and key != "gradient_accumulation_steps":
                log.info("DeepSpeed %s 'auto': not checked (your training loop chooses the batch size)", t.n(key))
            return None
        value = t.number(value, key, integer=True)
        if value < 1:
            raise t.fail(key, f"must be >= 1, got {value}")
        return value

    batch = known("train_batch_size")
    micro = known("train_micro_batch_size_per_gpu")
    accumulation = known("gradient_accumulation_steps")
    world = _world_size() if batch is not None else 1
    if batch is not None and micro is not None and accumulation is not None:
        if batch != micro * accumulation * world:
            raise ConfigError(
                f"DeepSpeed train_batch_size {batch} != train_micro_batch_size_per_gpu {micro} * gradient_accumulation_steps "
                f"{accumulation} * world size {world}; fix one of them (or drop train_batch_size)")
    elif batch is not None and micro is not None:
        if batch % (micro * world):
            raise ConfigError(f"DeepSpeed train_batch_size {batch} is not a multiple of train_micro_batch_size_per_gpu "
                              f"{micro} * world size {world}; fix one of them")
        accumulation = batch // (micro * world)
        log.info("DeepSpeed gradient_accumulation_steps derived from the batch sizes: %d", accumulation)
        t.set("gradient_accumulation_steps", accumulation, "train_batch_size")
    elif batch is not None and accumulation is not None and batch % (accumulation * world):
        raise ConfigError(f"DeepSpeed train_batch_size {batch} is not a multiple of gradient_accumulation_steps "
                          f"{accumulation} * world size {world}; fix one of them")
    if accumulation is not None and "gradient_accumulation_steps" not in t.out:
        t.set("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    elif mapping.get("gradient_accumulation_steps") == "auto" and "gradient_accumulation_steps" not in t.out:
        t.set("gradient_accumulation_steps", 1, "gradient_accumulation_steps")
        log.info("DeepSpeed gradient_accumulation_steps 'auto' resolved to 1")
    used = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if mapping.get(k) not in (None, "auto")]
    if used:
        log.info("DeepSpeed %s used for validation only: offload does not batch, your training loop does", ", ".join(used))


def _report(t: _Translation) -> None:
    if not t.no_meaning:
        return
    by_reason: dict[str, list[str]] = {}
    for key, why in t.no_meaning:
        by_reason.setdefault(why, []).append(key)
    lines = [f"  - {', '.join(keys)}: {why}" for why, keys in by_reason.items()]
    count = len(t.no_meaning)
    head = f"DeepSpeed config: {count} key{'s' if count != 1 else ''} with no meaning in offload"
    if t.strict:
        raise ConfigError(f"{head} (remove them, or load with strict=False to ignore them with a warning):\n" + "\n".join(lines))
    log.warning("%s, ignored (strict=False):\n%s", head, "\n".join(lines))


def _check(t: _Translation) -> None:
    """Validates the result now, so that an error names the DeepSpeed key the bad value came from."""
    from offload.config import Config, _from_mapping, validate

    try:
        validate(_from_mapping("", t.out, Config))
    except ConfigError as error:
        match = re.search(r"config key '([^']+)'", str(error))
        if not match:
            raise
        key = match.group(1)
        base = re.split(r"\[", key)[0]
        sources = sorted({t.n(src) for ours, src in t.origin.items() if ours == base or ours.startswith(base + ".")})
        if not sources:
            raise
        raise ConfigError(f"{error} (translated from DeepSpeed key {', '.join(repr(s) for s in sources)}; fix it there)") from error


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is in the test extras
        raise ConfigError(f"reading the accelerate config {str(path)!r} needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"accelerate config {str(path)!r} is not valid YAML: {error}") from error


def load_accelerate_config(path: str | os.PathLike, strict: bool = True):
    """A validated `offload.Config` from an accelerate config YAML whose DeepSpeed settings are inline or in a JSON file."""
    from offload.config import load_config

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"accelerate config {str(path)!r} does not exist")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"accelerate config {str(path)!r} must be a YAML mapping, got {type(data).__name__}")
    ds = data.get("deepspeed_config")
    kind = data.get("distributed_type")
    if kind not in (None, "DEEPSPEED"):
        raise ConfigError(f"accelerate config {str(path)!r} has distributed_type {kind!r}; offload reads DeepSpeed settings "
                          "only (distributed_type DEEPSPEED with a deepspeed_config section)")
    if not isinstance(ds, dict):
        raise ConfigError(f"accelerate config {str(path)!r} has no 'deepspeed_config' mapping; add one (inline keys such as "
                          "zero_stage, or deepspeed_config_file pointing at a DeepSpeed JSON)")
    mixed = data.get("mixed_precision")
    if mixed is not None and mixed not in _MIXED_PRECISIONS:
        raise ConfigError(f"accelerate config key 'mixed_precision': {mixed!r} is not one of {', '.join(_MIXED_PRECISIONS)}")
    launcher = sorted(k for k in data if k not in ("deepspeed_config", "mixed_precision"))
    launcher += sorted(f"deepspeed_config.{k}" for k in ds if k in _ACCEL_LAUNCHER)
    if launcher:
        log.info("accelerate config keys %s are for `accelerate launch`, not read by offload", ", ".join(launcher))

    extra = [(f"deepspeed_config.{k}", why) for k, why in _ACCEL_INLINE_NO_MEANING.items() if k in ds]
    file = ds.get("deepspeed_config_file")
    if file is not None:
        inline = sorted(k for k in ds if k in _ACCEL_INLINE)
        if inline:
            raise ConfigError(f"accelerate config {str(path)!r}: with deepspeed_config_file, the inline keys "
                              f"{', '.join('deepspeed_config.' + k for k in inline)} are not used; set them in the DeepSpeed JSON instead")
        for key in ds:
            if key not in _ACCEL_INLINE_NO_MEANING and key not in _ACCEL_LAUNCHER and key != "deepspeed_config_file":
                extra.append((f"deepspeed_config.{key}", f"not an accelerate DeepSpeed key offload knows; "
                              f"{_nearest(key, list(_ACCEL_INLINE) + list(_ACCEL_INLINE_NO_MEANING) + ['deepspeed_config_file'])}"))
        json_path = Path(file)
        candidates = [json_path] if json_path.is_absolute() else [Path.cwd() / json_path, path.parent / json_path]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(f"accelerate config key 'deepspeed_config.deepspeed_config_file': {str(file)!r} not found "
                              f"(tried {', '.join(str(c) for c in candidates)})")
        try:
            mapping = json.loads(found.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"DeepSpeed config file {str(found)!r} is not valid JSON: {error}") from error
        translated = translate(mapping, strict, _mixed_precision=mixed, _extra_no_meaning=extra)
        return load_config(translated, strict=strict)

    mapping: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key, value in ds.items():
        if key in _ACCEL_INLINE:
            target = _ACCEL_INLINE[key]
            names[target] = f"deepspeed_config.{key}"
            *parents, leaf = target.split(".")
            node = mapping
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        elif key not in _ACCEL_INLINE_NO_MEANING and key not in _ACCEL_LAUNCHER:
            extra.append((f"deepspeed_config.{key}", f"not an accelerate DeepSpeed key offload knows; "
                          f"{_nearest(key, list(_ACCEL_INLINE) + list(_ACCEL_INLINE_NO_MEANING))}"))
    if mixed == "bf16":
        mapping["bf16"] = {"enabled": True}
        names["bf16.enabled"] = "mixed_precision"
    elif mixed == "fp16":
        mapping["fp16"] = {"enabled": True}
        names["fp16.enabled"] = "mixed_precision"
    # accelerate's own defaults: ZeRO stage 2; offload devices "none".
    zero = mapping.setdefault("zero_optimization", {})
    zero.setdefault("stage", 2)
    translated = translate(mapping, strict, _names=names, _extra_no_meaning=extra)
    return load_config(translated, strict=strict)
