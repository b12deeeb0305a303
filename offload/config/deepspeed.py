"""Translation of DeepSpeed and accelerate configs into offload config data.

The table of every key offload knows, and why each is mapped, ignored or refused, is
`offload.config.deepspeed_keys`; this module reads each section against it.

`translate_deepspeed(mapping)` and `translate_accelerate(path)` return a `Translation`: plain
data (the offload config as a dict, which user key each offload key came from, and what was
ignored, refused or resolved from `"auto"`). They import nothing of `offload.config.schema`;
`offload.config.schema.load_config` calls them, then `report(translation, strict)`, then validates the
dict once, naming the user's key in any error. `translate(mapping, strict)` is the short form
that returns the dict.

Every key ends in one of four places:

* mapped onto an offload key;
* **ignored**: it only tunes speed or memory, logs, or is read by another tool (bucket sizes,
  `overlap_comm`, `stage3_*`, `buffer_size`, `max_in_cpu`, `fast_init`, `sub_group_size` with
  the optimizer state in RAM, `aio.single_submit`, `steps_per_print`, `wall_clock_breakdown`,
  fp16 `hysteresis`, accelerate's `zero3_init_flag`, launcher keys...), so it cannot change
  what training computes here. All of them are listed, with the reason, in ONE log line at INFO;
* **unsupported**: a key offload does not know (a typo: the nearest known key is suggested),
  or a feature switched on whose meaning offload cannot honour (`zero_quantized_weights`,
  `compression_training`, ZenFlow's `zenflow`...). All are named in ONE `ConfigError`
  (`strict=True`, the default) or ONE WARNING (`strict=False`, which drops them);
* a value that contradicts offload's maths (AMSGrad, static loss scaling, GPUDirect Storage,
  a non-Adam optimizer, `fp8`): always a `ConfigError`, whatever `strict` says.

`"auto"` values (Hugging Face Trainer / accelerate configs) are resolved to what the Trainer
would fill in from its arguments at their defaults (`lr` 5e-5, `betas` (0.9, 0.999), `eps`
1e-8, `weight_decay` 0, `gradient_clipping` 1.0, accumulation 1, warmup 0 steps); precision
from accelerate's `mixed_precision`, else from the machine (bf16 where it runs, the CPU included;
the Trainer's default arguments would give fp32). Each is listed with the value chosen and why,
in ONE WARNING.

Mapping rules
-------------
zero_optimization
    `stage` 0..3 (DeepSpeed's default 0). offload always partitions state across ranks, so
    the stage only decides whether `offload_param` is allowed: stage 3 maps
    `offload_param.device` (`cpu` / `nvme` / `none`) onto `offload.param`; stages 1-2 keep
    parameters on the accelerator and an active `offload_param` there is an error (as in
    DeepSpeed). `offload_optimizer.device` `cpu` / `nvme` maps onto `offload.optimizer`;
    `none` or absent gives `cpu`. Legacy `cpu_offload`, `cpu_offload_params`,
    `cpu_offload_use_pin_memory` are read as the new sections. One swap directory: sections
    whose device is `nvme` must name the same `nvme_path`. One `pin_memory` switch (absent:
    pinned, offload's default). `buffer_count`: the larger of the active sections' (at least 2).
    `sub_group_size` -> `offload.sub_group_size` (the piece of a unit's optimizer state streamed
    from NVMe and stepped at once: the host slots hold `buffer_count` pieces, 16 bytes per
    element in fp32) when the optimizer state can live on NVMe (`offload.optimizer` `nvme`, or `auto`
    from device `none` or no section), at any stage. A value below the smallest useful piece
    (2^18 elements, 0 included, as axolotl writes it) leaves offload's default piece for the
    tier. DeepSpeed's default and the Hugging Face examples' value, 1e9, makes slots of up to
    16 GB each for a model whose units are that large: lower it to save RAM. With the optimizer
    on `cpu` nothing is streamed and the key is ignored. SuperOffload's
    `offload_optimizer.super_offload` / `cpuadam_cores_perc`, `offload_optimizer.ratio` and
    ZenFlow's `zenflow`: `offload.config.deepspeed_offload` says what each maps to.
    An `aio` section inside `zero_optimization` (as the Hugging Face docs write it) is read as
    the top-level `aio`.
aio
    `block_size`, `queue_depth`, `thread_count` / `intra_op_parallelism` -> `io.*`;
    `use_gds: true` is an error.
bf16 / fp16 (and legacy `bfloat16`)
    -> `precision` (neither: `fp32`; both: error). fp16 `initial_scale_power`,
    `loss_scale_window`, `min_loss_scale` -> `loss_scale.*`; a positive `loss_scale` (static
    scaling) is an error. Keys of a disabled section are ignored, as DeepSpeed ignores them.
    `bf16_optimizer_states: true` (bf16 Adam moments; with or without `bf16_master_weights_and_grads`)
    -> `optimizer.state_precision` `bf16`, logged: the master stays fp32. `bf16_master_weights_and_grads`
    alone cannot be honoured; `bf16_optimizer_states` with `optimizer.params.fp32_optimizer_states:
    true` is an error naming both.
optimizer
    `type` (case-insensitive) `AdamW` -> `adamw`; `Adam`, `FusedAdam`, `CPUAdam`,
    `DeepSpeedCPUAdam` -> `adamw` unless `params.adam_w_mode` is false, then `adam`. Other types
    are an error. Absent params take DeepSpeed's defaults (lr 1e-3...).
scheduler
    `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest` (case-insensitive)
    -> offload's `scheduler` section (`warmup`, `warmup_decay`, `warmup_cosine`, `one_cycle`,
    `lr_range_test`) with the same parameter names; absent params take DeepSpeed's defaults.
train_batch_size, train_micro_batch_size_per_gpu
    Checked against `gradient_accumulation_steps` and the world size, or used to derive it.
accelerate
    `deepspeed_config.deepspeed_config_file` (relative to the working directory, then to the
    YAML) is translated like any DeepSpeed JSON; or the inline keys `zero_stage`,
    `offload_optimizer_device`, `offload_param_device`, `offload_*_nvme_path`,
    `gradient_accumulation_steps`, `gradient_clipping`, with top-level `mixed_precision`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from offload.config import deepspeed_offload
from offload.config.deepspeed_keys import (
    _ACCEL_INLINE,
    _ACCEL_INLINE_RULES,
    _ADAM_TYPES,
    _AIO_HANDLED,
    _AIO_RULES,
    _BF16_HANDLED,
    _BF16_RULES,
    _DS_OPT_DEFAULTS,
    _FP16_HANDLED,
    _FP16_RULES,
    _MIXED_PRECISIONS,
    _OFFLOAD_HANDLED,
    _OFFLOAD_RULES,
    _OPT_PARAMS_HANDLED,
    _OPT_PARAMS_RULES,
    _OWN_KEYS,
    _SCHEDULER_NAMES,
    _SCHEDULER_REQUIRED,
    _SCHEDULERS,
    _TOP_HANDLED,
    _TOP_RULES,
    _WHY_COMM_DTYPE,
    _WHY_DEVICE_NONE,
    _WHY_DISABLED,
    _WHY_LAUNCHER,
    _WHY_LOW_MASTER,
    _WHY_OFF,
    _WHY_RESUME,
    _WHY_SUB_GROUP_IN_RAM,
    _WHY_TORCH_IMPL,
    _ZERO_HANDLED,
    _ZERO_RULES,
    TRAINER_DEFAULTS,
    Translation,
    _Builder,
    _ignore,
    _nearest,
    _Rule,
)
from offload.errors import ConfigError

log = logging.getLogger(__name__)

_TRAINER_DEFAULT = "the Hugging Face Trainer's default"


# ---- machine facts (patched in tests) -------------------------------------------------------
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


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(value) if value is None or isinstance(value, (int, float, str, list)) else repr(value)


# ---- DeepSpeed ------------------------------------------------------------------------------
def translate_deepspeed(
    mapping: dict, *, mixed_precision: str | None = None, names: dict[str, str] | None = None, kind: str = "DeepSpeed"
) -> Translation:
    """A DeepSpeed config mapping as offload config data (see the module docstring).

    Raises ConfigError for values that cannot be honoured; collects everything else in the
    returned Translation (nothing is logged or refused here: `report` does that)."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(mapping).__name__}")
    b = _Builder(names, kind)
    mixed = sorted(key for key in mapping if key in _OWN_KEYS)
    if mixed:
        raise ConfigError(
            f"config keys {', '.join(repr(k) for k in mixed)} belong to offload's own schema but this is a DeepSpeed "
            "config (it has DeepSpeed keys such as zero_optimization / bf16 / fp16 / train_batch_size); "
            "don't mix the two: write either an offload config or a DeepSpeed config",
            key=mixed[0],
        )
    b.sort_section("", mapping, _TOP_HANDLED, _TOP_RULES)
    _zero(b, mapping)
    _aio(b, mapping)
    _precision(b, mapping, mixed_precision)
    _communication_dtype(b, mapping)
    _optimizer(b, mapping)
    _scheduler(b, mapping)
    _steps(b, mapping)
    return b.result


def _device(b: _Builder, section: dict | None, path: str) -> str:
    if section is None:
        return "none"
    device = section.get("device", "none")
    if device is None:
        device = "none"
    if device not in ("none", "cpu", "nvme"):
        raise b.fail(f"{path}.device", f"{device!r} is not one of none, cpu, nvme")
    return device


def _zero(b: _Builder, mapping: dict) -> None:
    zero = b.section(mapping, "zero_optimization", "zero_optimization") or {}
    b.sort_section("zero_optimization", zero, _ZERO_HANDLED, _ZERO_RULES)
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise b.fail("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {stage!r}")

    sections = {name: b.section(zero, name, f"zero_optimization.{name}") for name in ("offload_param", "offload_optimizer")}
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_params": "offload_param"}
    for old, name in legacy.items():
        if old in zero and b.flag(zero[old], f"zero_optimization.{old}"):
            if sections[name] is not None:
                raise b.fail(f"zero_optimization.{old}", f"give either it or zero_optimization.{name}, not both")
            sections[name] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in zero:
        pin = b.flag(zero["cpu_offload_use_pin_memory"], "zero_optimization.cpu_offload_use_pin_memory")
        for name, section in list(sections.items()):
            if section is not None and "pin_memory" not in section:
                sections[name] = {**section, "pin_memory": pin}

    devices = {name: _device(b, sections[name], f"zero_optimization.{name}") for name in sections}
    # a device other than none means the section is there (_device gives none for a missing one)
    active = {name: section for name, section in sections.items() if section is not None and devices[name] != "none"}
    for name, section in sections.items():
        path = f"zero_optimization.{name}"
        if section is None:
            continue
        if name in active:
            extra = deepspeed_offload.OPTIMIZER_OFFLOAD_KEYS if name == "offload_optimizer" else ()
            b.sort_section(path, section, _OFFLOAD_HANDLED + extra, _OFFLOAD_RULES)
        else:
            for key in section:
                if key != "device":
                    b.ignored(f"{path}.{key}", _WHY_DEVICE_NONE)

    if stage == 0 and active:
        raise b.fail(
            "zero_optimization.stage",
            f"stage 0 cannot offload ({', '.join(b.n('zero_optimization.' + a) for a in active)} "
            "is set; DeepSpeed refuses this too); set stage 2 or 3",
        )
    if stage < 3 and "offload_param" in active:
        raise b.fail(
            "zero_optimization.offload_param",
            f"parameter offload needs zero_optimization.stage 3 (it is {stage}); set stage 3 or device 'none'",
        )
    b.set("offload.param", devices["offload_param"] if stage == 3 else "none", "zero_optimization.offload_param.device")
    # device none (DeepSpeed: on the accelerator) is `auto`, which fills the fastest tier with room
    b.set(
        "offload.optimizer",
        {"nvme": "nvme", "cpu": "cpu"}.get(devices["offload_optimizer"], "auto"),
        "zero_optimization.offload_optimizer.device",
    )

    paths = {}
    for name, section in active.items():
        key = f"zero_optimization.{name}.nvme_path"
        if devices[name] == "nvme":
            value = section.get("nvme_path")
            if not isinstance(value, str) or not value:
                raise b.fail(key, f"device 'nvme' needs a directory here, got {value!r}")
            paths[key] = value
        elif "nvme_path" in section:
            b.ignored(key, f"the section's device is {devices[name]!r}, not 'nvme'")
    if len({os.path.normpath(p) for p in paths.values()}) > 1:
        shown = " and ".join(f"'{b.n(k)}' = {v!r}" for k, v in paths.items())
        raise ConfigError(
            f"{b.result.kind} config gives two different NVMe paths, {shown}; offload keeps parameters and "
            "optimizer state in one swap directory: give both the same path",
            key=b.n(next(iter(paths))),
        )
    if paths:
        key, value = next(iter(paths.items()))
        b.set("offload.nvme_path", value, key)

    pins = {}
    for name, section in active.items():
        if "pin_memory" in section:
            pins[f"zero_optimization.{name}.pin_memory"] = b.flag(section["pin_memory"], f"zero_optimization.{name}.pin_memory")
    if len(set(pins.values())) > 1:
        shown = " and ".join(f"'{b.n(k)}' = {str(v).lower()}" for k, v in pins.items())
        raise ConfigError(
            f"{b.result.kind} config gives {shown}; offload has one pin_memory switch for all host buffers: "
            "give both the same value",
            key=b.n(next(iter(pins))),
        )
    if pins:
        key, value = next(iter(pins.items()))
        b.set("offload.pin_memory", value, key)

    counts = {}
    for name, section in active.items():
        if "buffer_count" in section:
            key = f"zero_optimization.{name}.buffer_count"
            counts[key] = b.number(section["buffer_count"], key, integer=True)
    if counts:
        key = max(counts, key=counts.__getitem__)
        value = counts[key]
        if value < 2:
            log.warning(
                "%s %s = %d is below offload's minimum of 2 buffers (read next, step this, write last); using 2",
                b.result.kind,
                b.n(key),
                value,
            )
            value = 2
        b.set("offload.buffer_count", value, key)
    if "offload_optimizer" in active:
        deepspeed_offload.optimizer_offload(b, active["offload_optimizer"], devices["offload_optimizer"])
    deepspeed_offload.sub_group_size(b, zero, _WHY_SUB_GROUP_IN_RAM)
    deepspeed_offload.zenflow(b, zero)


def _aio(b: _Builder, mapping: dict) -> None:
    aio = b.section(mapping, "aio", "aio")
    prefix = "aio"
    nested = b.section(mapping.get("zero_optimization") or {}, "aio", "zero_optimization.aio")
    if nested is not None:
        if aio is not None:
            raise b.fail("zero_optimization.aio", "DeepSpeed reads 'aio' at the top level; give one aio section, not two")
        aio, prefix = nested, "zero_optimization.aio"
    if aio is None:
        return
    if aio.get("use_gds") not in (None, False):
        raise b.fail(
            f"{prefix}.use_gds",
            "GPUDirect Storage cannot be honoured: offload reads swap files through host buffers; set it to false or remove it",
        )
    if "use_gds" in aio:
        b.ignored(f"{prefix}.use_gds", _WHY_OFF)
    b.sort_section(prefix, aio, _AIO_HANDLED, _AIO_RULES)
    for key, ours in (("block_size", "io.block_size"), ("queue_depth", "io.queue_depth")):
        if key in aio:
            b.set(ours, b.number(aio[key], f"{prefix}.{key}", integer=True), f"{prefix}.{key}")
    threads = {k: b.number(aio[k], f"{prefix}.{k}", integer=True) for k in ("thread_count", "intra_op_parallelism") if k in aio}
    if len(set(threads.values())) > 1:
        raise b.fail(
            f"{prefix}.intra_op_parallelism",
            f"is the new spelling of {prefix}.thread_count but the two differ ({threads}); keep one of them",
        )
    if threads:
        key = next(iter(threads))
        b.set("io.threads", threads[key], f"{prefix}.{key}")


def _enabled(b: _Builder, section: dict | None, path: str) -> Any:
    if section is None:
        return False
    value = section.get("enabled", False)
    if value == "auto":
        return "auto"
    return b.flag(value, f"{path}.enabled")


def _precision(b: _Builder, mapping: dict, mixed_precision: str | None) -> None:
    if "bf16" in mapping and "bfloat16" in mapping:
        raise b.fail("bfloat16", "is the old name of the bf16 section; keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in mapping else "bf16"
    bf16 = b.section(mapping, bf16_key, bf16_key)
    fp16 = b.section(mapping, "fp16", "fp16")
    bf, fp = _enabled(b, bf16, bf16_key), _enabled(b, fp16, "fp16")
    if bf is True and fp is True:
        raise b.fail("fp16.enabled", f"and {bf16_key}.enabled are both true; enable one of them")
    if mixed_precision is not None:
        for explicit, name, wanted in ((bf, bf16_key, "bf16"), (fp, "fp16", "fp16")):
            if explicit is True and mixed_precision != wanted:
                raise ConfigError(
                    f"accelerate mixed_precision {mixed_precision!r} contradicts '{name}.enabled': true in the "
                    "DeepSpeed config; make them agree",
                    key="mixed_precision",
                )
        if bf == "auto":
            bf = mixed_precision == "bf16"
            b.auto(f"{bf16_key}.enabled", f"{_show(bf)} (accelerate mixed_precision {mixed_precision!r})")
        if fp == "auto":
            fp = mixed_precision == "fp16"
            b.auto("fp16.enabled", f"{_show(fp)} (accelerate mixed_precision {mixed_precision!r})")
    # no Trainer arguments here (the Trainer's defaults would give fp32): the machine decides
    if bf == "auto":
        bf = fp is not True and _bf16_supported()
        if fp is True:
            why = "fp16 is enabled"
        elif bf:
            why = f"{'this GPU supports bf16' if _cuda_available() else 'no GPU: the CPU computes in bf16'}; set it to false for fp32"
        else:
            why = "this GPU has no bf16"
        b.auto(f"{bf16_key}.enabled", f"{_show(bf)} ({why})")
    if fp == "auto":
        fp = bf is not True and _cuda_available()
        why = "bf16 is enabled" if bf is True else ("a GPU without bf16 is present" if fp else "no GPU: fp32")
        b.auto("fp16.enabled", f"{_show(fp)} ({why})")
    precision = "bf16" if bf else "fp16" if fp else "fp32"
    b.set("precision", precision, f"{bf16_key}.enabled" if bf else "fp16.enabled")

    if bf16 is not None:
        if bf:
            b.sort_section(bf16_key, bf16, _BF16_HANDLED, _BF16_RULES)
            _bf16_state(b, bf16, bf16_key, mapping)
        else:
            for key in sorted(set(bf16) - {"enabled"}):
                b.ignored(f"{bf16_key}.{key}", _WHY_DISABLED)
    if fp16 is None:
        return
    if not fp:
        for key in sorted(set(fp16) - {"enabled"}):
            b.ignored(f"fp16.{key}", _WHY_DISABLED)
        return
    b.sort_section("fp16", fp16, _FP16_HANDLED, _FP16_RULES)
    scale = fp16.get("loss_scale", 0)
    if scale != "auto" and b.number(scale, "fp16.loss_scale") > 0:
        raise b.fail(
            "fp16.loss_scale",
            f"{scale} asks for static loss scaling, which offload does not do (it scales "
            "dynamically and skips a step on overflow); set it to 0",
        )
    if fp16.get("initial_scale_power", "auto") != "auto":
        power = b.number(fp16["initial_scale_power"], "fp16.initial_scale_power", integer=True)
        b.set("loss_scale.initial", float(2.0**power), "fp16.initial_scale_power")
    if fp16.get("loss_scale_window", "auto") != "auto":
        b.set(
            "loss_scale.growth_interval",
            b.number(fp16["loss_scale_window"], "fp16.loss_scale_window", integer=True),
            "fp16.loss_scale_window",
        )
    if fp16.get("min_loss_scale", "auto") != "auto":
        b.set("loss_scale.min_scale", float(b.number(fp16["min_loss_scale"], "fp16.min_loss_scale")), "fp16.min_loss_scale")


def _bf16_state(b: _Builder, bf16: dict, prefix: str, mapping: dict) -> None:
    """An enabled bf16 section's `bf16_optimizer_states` and `bf16_master_weights_and_grads`."""
    states_key, master_key = f"{prefix}.bf16_optimizer_states", f"{prefix}.bf16_master_weights_and_grads"
    states = b.flag(bf16["bf16_optimizer_states"], states_key) if "bf16_optimizer_states" in bf16 else None
    master = b.flag(bf16["bf16_master_weights_and_grads"], master_key) if "bf16_master_weights_and_grads" in bf16 else None
    if not states:
        if states is False:
            b.ignored(states_key, _WHY_OFF)
        if master:
            b.unsupported(master_key, _WHY_LOW_MASTER)
        elif master is False:
            b.ignored(master_key, _WHY_OFF)
        return
    params = (mapping.get("optimizer") or {}).get("params") if isinstance(mapping.get("optimizer"), dict) else None
    fp32_states = params.get("fp32_optimizer_states") if isinstance(params, dict) else None
    if fp32_states is True:
        raise ConfigError(
            f"{b.result.kind} config keys '{b.n(states_key)}': true and 'optimizer.params.fp32_optimizer_states': true "
            "contradict each other (Adam moments in bf16 and in fp32); remove one of them",
            key=b.n(states_key),
        )
    b.set("optimizer.state_precision", "bf16", states_key)
    log.info(
        "%s %s: true -> optimizer.state_precision bf16: the Adam moments are stored in bf16 (rounded stochastically); "
        "offload keeps the master weights in fp32%s and the gradient as optimizer.gradient_precision says (auto: "
        "16-bit when each step has one micro-batch, fp32 when gradients accumulate)",
        b.result.kind,
        b.n(states_key),
        f" ({b.n(master_key)}: true asks for bf16 master weights and gradients; that part is not taken)" if master else "",
    )


def _communication_dtype(b: _Builder, mapping: dict) -> None:
    if "communication_data_type" not in mapping:
        return
    value = mapping["communication_data_type"]
    precision = b.result.config["precision"]
    same = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16", "half"), "fp32": ("fp32", "float32", "float")}[precision]
    if value is None or str(value).lower() in same:
        b.ignored("communication_data_type", f"the compute precision ({precision}) is what offload communicates in")
    else:
        b.unsupported("communication_data_type", _WHY_COMM_DTYPE)


def _optimizer(b: _Builder, mapping: dict) -> None:
    opt = b.section(mapping, "optimizer", "optimizer")
    if opt is None:
        log.info("%s config has no 'optimizer' section: offload's default AdamW (optimizer.* defaults) is used", b.result.kind)
        return
    flat = sorted(k for k in opt if k in _OPT_PARAMS_HANDLED)
    if flat:
        raise b.fail("optimizer", f"{', '.join(flat)} belong under 'optimizer.params' in a DeepSpeed config; move them there")
    b.sort_section("optimizer", opt, ("type", "params"), {"legacy_fusion": _ignore(_WHY_TORCH_IMPL)})
    kind = opt.get("type")
    if not isinstance(kind, str):
        raise b.fail("optimizer.type", f"expected a string such as 'AdamW', got {kind!r}")
    params = b.section(opt, "params", "optimizer.params") or {}
    b.sort_section("optimizer.params", params, _OPT_PARAMS_HANDLED, _OPT_PARAMS_RULES)
    adam_w_mode = b.flag(params.get("adam_w_mode", True), "optimizer.params.adam_w_mode")
    lowered = kind.lower()
    if lowered == "adamw":
        ours = "adamw"
        if not adam_w_mode:
            log.warning(
                "DeepSpeed optimizer.params.adam_w_mode false has no effect with type %r: DeepSpeed runs AdamW "
                "(decoupled weight decay) and so does offload; use type 'Adam' for L2 weight decay",
                kind,
            )
    elif lowered in _ADAM_TYPES:
        ours = "adamw" if adam_w_mode else "adam"
    else:
        raise b.fail(
            "optimizer.type",
            f"{kind!r} cannot be honoured: offload's CPU optimizer is Adam/AdamW only; use type 'AdamW' (or 'Adam')",
        )
    b.set("optimizer.type", ours, "optimizer.type")
    if params.get("amsgrad") is not None and b.flag(params["amsgrad"], "optimizer.params.amsgrad"):
        raise b.fail(
            "optimizer.params.amsgrad",
            "AMSGrad cannot be honoured (offload's Adam keeps no max of the second moment); set it to false",
        )
    if "max_grad_norm" in params:
        raise b.fail("optimizer.params.max_grad_norm", "is not an optimizer parameter; use the top-level 'gradient_clipping'")
    for key in ("lr", "betas", "eps", "weight_decay"):
        path = f"optimizer.params.{key}"
        value = params.get(key)
        if value == "auto":
            value = TRAINER_DEFAULTS[path]
            b.auto(path, f"{_show(value)} ({_TRAINER_DEFAULT})")
        elif value is None:
            value = _DS_OPT_DEFAULTS[key]
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise b.fail(path, f"expected a list of two numbers, got {value!r}")
            value = tuple(b.number(v, f"{path}[{i}]") for i, v in enumerate(value))
        else:
            value = b.number(value, path)
        b.set(f"optimizer.{key}", value, path)
    if "bias_correction" in params:
        b.set(
            "optimizer.bias_correction",
            b.flag(params["bias_correction"], "optimizer.params.bias_correction"),
            "optimizer.params.bias_correction",
        )


def _scheduler(b: _Builder, mapping: dict) -> None:
    sched = b.section(mapping, "scheduler", "scheduler")
    if sched is None:
        return
    b.sort_section("scheduler", sched, ("type", "params"), {})
    kind = sched.get("type")
    if not isinstance(kind, str) or kind.lower() not in _SCHEDULERS:
        raise b.fail(
            "scheduler.type",
            f"{kind!r} cannot be honoured: offload translates {', '.join(_SCHEDULER_NAMES)}; "
            "use one of them, or drive the learning rate from your training loop (engine.optimizer)",
        )
    ours, defaults = _SCHEDULERS[kind.lower()]
    b.set("scheduler.type", ours, "scheduler.type")
    params = b.section(sched, "params", "scheduler.params") or {}
    rules = {"last_batch_iteration": _Rule(_WHY_RESUME, ok=lambda v: v == -1, why_not=_WHY_RESUME + "; remove it")}
    b.sort_section("scheduler.params", params, tuple(defaults), rules)
    for key, default in defaults.items():
        path = f"scheduler.params.{key}"
        value = params.get(key, default)
        if value == "auto":
            if key == "warmup_max_lr":
                value = None
                b.auto(path, "the optimizer's lr")
            elif key == "total_num_steps":
                value = None
                b.auto(
                    path,
                    "unknown: set scheduler.total_num_steps to the number of optimizer steps before training "
                    "(the Hugging Face Trainer computes it from the data)",
                )
            elif path in TRAINER_DEFAULTS:
                value = TRAINER_DEFAULTS[path]
                b.auto(path, f"{_show(value)} ({_TRAINER_DEFAULT})")
            else:
                raise b.fail(path, "'auto' cannot be resolved here; give a value")
        elif value is None:
            if key in _SCHEDULER_REQUIRED:
                raise b.fail(path, f"{kind} needs it (DeepSpeed has no default); give a value")
        elif key == "warmup_type":
            if value not in ("log", "linear"):
                raise b.fail(path, f"{value!r} is not one of log, linear")
        elif key in ("cycle_momentum", "lr_range_test_staircase"):
            value = b.flag(value, path)
        else:
            integer = key.endswith(("_steps", "_size", "_count"))
            value = b.number(value, path, integer=integer)
        b.set(f"scheduler.{key}", value, path if key in params else "scheduler.type")


def _steps(b: _Builder, mapping: dict) -> None:
    clip = mapping.get("gradient_clipping")
    if clip == "auto":
        clip = TRAINER_DEFAULTS["gradient_clipping"]
        b.auto("gradient_clipping", f"{_show(clip)} ({_TRAINER_DEFAULT} max_grad_norm)")
        b.set("gradient_clipping", clip, "gradient_clipping")
    elif clip is not None:
        b.set("gradient_clipping", b.number(clip, "gradient_clipping"), "gradient_clipping")

    def known(key: str) -> int | None:
        value = mapping.get(key)
        if value is None or value == "auto":
            if value == "auto" and key != "gradient_accumulation_steps":
                b.auto(key, "not checked (your training loop chooses the batch size)")
            return None
        value = b.number(value, key, integer=True)
        if value < 1:
            raise b.fail(key, f"must be >= 1, got {value}")
        return value

    batch = known("train_batch_size")
    micro = known("train_micro_batch_size_per_gpu")
    accumulation = known("gradient_accumulation_steps")
    world = _world_size() if batch is not None else 1
    if batch is not None and micro is not None and accumulation is not None:
        if batch != micro * accumulation * world:
            raise ConfigError(
                f"DeepSpeed train_batch_size {batch} != train_micro_batch_size_per_gpu {micro} * gradient_accumulation_steps "
                f"{accumulation} * world size {world}; fix one of them (or drop train_batch_size)",
                key="train_batch_size",
            )
    elif batch is not None and micro is not None:
        if batch % (micro * world):
            raise ConfigError(
                f"DeepSpeed train_batch_size {batch} is not a multiple of train_micro_batch_size_per_gpu "
                f"{micro} * world size {world}; fix one of them",
                key="train_batch_size",
            )
        accumulation = batch // (micro * world)
        log.info("DeepSpeed gradient_accumulation_steps derived from the batch sizes: %d", accumulation)
        b.set("gradient_accumulation_steps", accumulation, "train_batch_size")
    elif batch is not None and accumulation is not None and batch % (accumulation * world):
        raise ConfigError(
            f"DeepSpeed train_batch_size {batch} is not a multiple of gradient_accumulation_steps "
            f"{accumulation} * world size {world}; fix one of them",
            key="train_batch_size",
        )
    if accumulation is not None and not b.has("gradient_accumulation_steps"):
        b.set("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    elif mapping.get("gradient_accumulation_steps") == "auto" and not b.has("gradient_accumulation_steps"):
        value = TRAINER_DEFAULTS["gradient_accumulation_steps"]
        b.set("gradient_accumulation_steps", value, "gradient_accumulation_steps")
        b.auto("gradient_accumulation_steps", f"{_show(value)} ({_TRAINER_DEFAULT})")


# ---- accelerate -----------------------------------------------------------------------------
def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is in the test extras
        raise ConfigError(f"reading the accelerate config {str(path)!r} needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"accelerate config {str(path)!r} is not valid YAML: {error}") from error


def translate_accelerate(path: str | os.PathLike) -> Translation:
    """An accelerate config YAML (DeepSpeed settings inline, or in a JSON file it names) as offload config data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"accelerate config {str(path)!r} does not exist")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"accelerate config {str(path)!r} must be a YAML mapping, got {type(data).__name__}")
    ds = data.get("deepspeed_config")
    kind = data.get("distributed_type")
    if kind not in (None, "DEEPSPEED"):
        raise ConfigError(
            f"accelerate config {str(path)!r} has distributed_type {kind!r}; offload reads DeepSpeed settings "
            "only (distributed_type DEEPSPEED with a deepspeed_config section)",
            key="distributed_type",
        )
    if not isinstance(ds, dict):
        raise ConfigError(
            f"accelerate config {str(path)!r} has no 'deepspeed_config' mapping; add one (inline keys such as "
            "zero_stage, or deepspeed_config_file pointing at a DeepSpeed JSON)",
            key="deepspeed_config",
        )
    mixed = data.get("mixed_precision")
    if mixed is not None and mixed not in _MIXED_PRECISIONS:
        raise ConfigError(
            f"accelerate config key 'mixed_precision': {mixed!r} is not one of {', '.join(_MIXED_PRECISIONS)}",
            key="mixed_precision",
        )
    ignored = [(k, _WHY_LAUNCHER) for k in data if k not in ("deepspeed_config", "mixed_precision")]
    unsupported: list[tuple[str, str]] = []
    file = ds.get("deepspeed_config_file")
    known = list(_ACCEL_INLINE) + list(_ACCEL_INLINE_RULES) + ["deepspeed_config_file"]
    for key, value in ds.items():
        if key in _ACCEL_INLINE_RULES:
            verdict, why = _ACCEL_INLINE_RULES[key].judge(value)
            (ignored if verdict == "ignored" else unsupported).append((f"deepspeed_config.{key}", why))
        elif key not in _ACCEL_INLINE and key != "deepspeed_config_file":
            unsupported.append(
                (f"deepspeed_config.{key}", f"not an accelerate DeepSpeed key offload knows; {_nearest(key, known)}")
            )

    mapping: dict[str, Any]
    if file is not None:
        inline = sorted(k for k in ds if k in _ACCEL_INLINE)
        if inline:
            raise ConfigError(
                f"accelerate config {str(path)!r}: with deepspeed_config_file, the inline keys "
                f"{', '.join('deepspeed_config.' + k for k in inline)} are not used; set them in the DeepSpeed "
                "JSON instead",
                key=f"deepspeed_config.{inline[0]}",
            )
        json_path = Path(file)
        candidates = [json_path] if json_path.is_absolute() else [Path.cwd() / json_path, path.parent / json_path]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(
                f"accelerate config key 'deepspeed_config.deepspeed_config_file': {str(file)!r} not found "
                f"(tried {', '.join(str(c) for c in candidates)})",
                key="deepspeed_config.deepspeed_config_file",
            )
        try:
            mapping = json.loads(found.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"DeepSpeed config file {str(found)!r} is not valid JSON: {error}") from error
        result = translate_deepspeed(mapping, mixed_precision=mixed)
    else:
        mapping = {}
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
        if mixed in ("bf16", "fp16"):
            mapping[mixed] = {"enabled": True}
            names[f"{mixed}.enabled"] = "mixed_precision"
        mapping.setdefault("zero_optimization", {}).setdefault("stage", 2)  # accelerate's default stage
        result = translate_deepspeed(mapping, names=names, kind="accelerate")
    result.ignored[:0] = ignored
    result.unsupported[:0] = unsupported
    return result


# ---- reporting ------------------------------------------------------------------------------
def _group(pairs: list[tuple[str, str]]) -> dict[str, list[str]]:
    by_reason: dict[str, list[str]] = {}
    for key, why in pairs:
        by_reason.setdefault(why, []).append(key)
    return by_reason


def report(translation: Translation, strict: bool = True) -> None:
    """Refuses (strict) or warns about the unsupported keys, in one message; logs the ignored keys
    in one INFO line and the `"auto"` resolutions in one WARNING line."""
    kind = translation.kind
    if translation.unsupported:
        count = len(translation.unsupported)
        lines = [f"  - {', '.join(keys)}: {why}" for why, keys in _group(translation.unsupported).items()]
        head = f"{kind} config: {count} key{'s' if count != 1 else ''} offload cannot honour"
        if strict:
            raise ConfigError(
                f"{head} (fix or remove them, or load with strict=False to drop them with a warning):\n" + "\n".join(lines),
                key=translation.unsupported[0][0],
            )
        log.warning("%s, dropped (strict=False):\n%s", head, "\n".join(lines))
    if translation.ignored:
        groups = "; ".join(f"{', '.join(keys)} ({why})" for why, keys in _group(translation.ignored).items())
        log.info("%s config: ignoring %d key(s) that cannot change training here: %s", kind, len(translation.ignored), groups)
    if translation.auto:
        chosen = "; ".join(f"{key} -> {value}" for key, value in translation.auto)
        log.warning(
            "%s config: 'auto' values resolved here, with no Trainer arguments to fill them (write values to choose others): %s",
            kind,
            chosen,
        )


def translate(mapping: dict, strict: bool = True) -> dict:
    """The offload config dict for a DeepSpeed config mapping, after `report` (not yet validated:
    `offload.load_config` does that, naming the DeepSpeed key of any error)."""
    result = translate_deepspeed(mapping)
    report(result, strict)
    return result.config
