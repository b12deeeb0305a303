"""Config dataclasses, loading from a dict / JSON path / Config, and validation.

(Over 600 lines because every field's docstring lives here, where the README's key table is
generated from, and validation is one pass over all of them.)

Every key is optional. The config is validated whole when it is loaded: an unknown key is an
error that names the key and the nearest valid one; a value of the wrong type or out of range
is an error that names the key and the accepted values. Nothing is silently defaulted.

Each field carries a docstring (the string literal under it); `field_docs` reads them so
that documentation is generated from this file.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import math
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from offload.config.key_hints import unknown_key_hint
from offload.config.sizes import MIN_SUB_GROUP_SIZE, parse_size
from offload.errors import ConfigError, name_config_file, raised_at_users_call

PRECISIONS = ("bf16", "fp16", "fp32")
PARAM_TIERS = ("none", "cpu", "nvme")
OPTIMIZER_TIERS = ("auto", "device", "cpu", "nvme")
OVERLAPS = ("auto", "none", "forward", "backward")
OPTIMIZER_TYPES = ("adamw", "adam")
# how the Adam moments are stored (config.state_layout.StatePrecision), and the gradient
STATE_PRECISIONS = ("fp32", "bf16", "int8")
GRADIENT_PRECISIONS = ("auto", "fp32")
SCHEDULER_TYPES = ("none", "warmup", "warmup_decay", "warmup_cosine", "one_cycle", "lr_range_test")
WARMUP_TYPES = ("log", "linear")
# Names users bring from DeepSpeed and transformers for our choices (suggested, not accepted).
VALUE_ALIASES = {
    "warmuplr": "warmup",
    "constant_with_warmup": "warmup",
    "warmupdecaylr": "warmup_decay",
    "linear": "warmup_decay",
    "warmupcosinelr": "warmup_cosine",
    "cosine": "warmup_cosine",
    "onecycle": "one_cycle",
    "lrrangetest": "lr_range_test",
    "constant": "none",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "gpu": "none",
    "8bit": "int8",
    "uint8": "int8",
}


class ReadOnlyOnceFrozen:
    """A config section that `freeze` makes read-only: the engine reads its config once, at
    `offload.initialize`, so a later assignment (`engine.config.optimizer.lr = 0`) would change
    nothing; it is an error instead. A copy (`copy.deepcopy`, `dataclasses.replace`) is not frozen."""

    def __setattr__(self, name: str, value: Any) -> None:
        path = self.__dict__.get("_frozen_as")
        if path is not None:
            raise ConfigError(
                f"{path}.{name} is read-only: the engine read its config at offload.initialize and would not see the "
                "change. Set learning rates through engine.optimizer.param_groups (or engine.lr, or an LR scheduler on "
                "engine.optimizer); for anything else, close the engine and initialize a new one with the changed config",
                key=name,
            )
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_frozen_as", None)
        return state


def freeze(config: ReadOnlyOnceFrozen, path: str = "config") -> None:
    """Makes `config` and every section in it read-only (see ReadOnlyOnceFrozen); `path` names
    it in the error (e.g. "engine.config")."""
    assert dataclasses.is_dataclass(config)  # every ReadOnlyOnceFrozen subclass is a @dataclass section
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if isinstance(value, ReadOnlyOnceFrozen):
            freeze(value, f"{path}.{item.name}")
    object.__setattr__(config, "_frozen_as", path)


@dataclass
class OptimizerConfig(ReadOnlyOnceFrozen):
    type: str = "adamw"
    """`adamw` (decoupled weight decay) or `adam` (L2 penalty added to the gradient)."""
    lr: float = 1e-4
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """Weight decay coefficient (decoupled for adamw, L2 for adam)."""
    bias_correction: bool = True
    """Apply Adam's bias correction to both moments."""
    state_precision: str = "fp32"
    """How the Adam moments (`exp_avg`, `exp_avg_sq`) are stored: `fp32` (4 bytes each; torch.optim.AdamW bit for bit), `bf16` (2 bytes each, rounded stochastically) or `int8` (1 byte each and a shared power-of-two exponent byte per block of 32 elements, rounded stochastically; docs/compact_state.md has the format). The step computes in fp32 and the master weights stay fp32 in every precision; checkpoints store fp32 values. Per param the optimizer state takes 16 bytes (fp32 with an fp32 gradient), 10 (bf16) or about 8 (int8) with a 16-bit gradient; `offload estimate` shows what each takes on every tier and on the disk per step."""
    gradient_precision: str = "auto"
    """How the gradient the step reads is stored: `auto` keeps it in its 16-bit arrival dtype (2 bytes per param instead of 4; exact, since nothing is added into it) when the compute `precision` is bf16 or fp16 and each optimizer step has one micro-batch (`gradient_accumulation_steps` 1), else fp32; `fp32` always stores it in fp32 (4 bytes per param)."""
    rounding_seed: int = 0
    """With `state_precision` bf16 or int8: which stream of random bits the stochastic rounding of the moments draws (an int >= 0). The bits are a pure function of this seed, the unit, the rank, the step and the element's place, so one seed trains the same bits on every thread count, instruction set and tier, and a resume continues the stream (keep the seed across a resume for a bitwise one). Other seeds give other, equally unbiased roundings: what the run-to-run spread of compact state is measured over (`benchmarks/bench_quality.py --rounding-seeds`)."""
    threads: int = 0
    """Threads of the C++ CPU Adam; 0 means every CPU this process may use."""


@dataclass
class OffloadConfig(ReadOnlyOnceFrozen):
    param: str = "none"
    """Where 16-bit weights live between uses: `none` (on the accelerator), `cpu`, `nvme`."""
    optimizer: str = "auto"
    """Where the optimizer state (fp32 master weights, Adam moments and gradients) lives: `auto` (per unit: the device's spare memory, then host RAM while it lasts, then NVMe; see `max_device_memory`, `max_host_memory`), `device` (all on the accelerator, stepped there), `cpu`, `nvme`."""
    max_device_memory: int | str | None = None
    """`auto`: device memory the optimizer state may take, bytes or a size like `"40GB"`; default on CUDA: the memory free at start less the engine's 16-bit weights and gradient buffers and a quarter of the device for activations; on the CPU standing in for the device: none (it is the host's RAM)."""
    max_host_memory: int | str | None = None
    """`auto`: RAM the optimizer state may take, bytes or a size like `"40GB"` / `"40GiB"`; default: the RAM available at start less 10% and the engine's other host buffers."""
    speculation_memory: int | str | None = None
    """`overlap: auto` (the default), and `backward` with clipping or fp16: RAM the spare states of the speculative steps may take (the master and moments once more: 12 bytes per param of each unit whose state is in RAM with fp32 moments, 8 with bf16, about 6 with int8; last units first), bytes or a size like `"8GiB"`; `0` turns speculation off (units step once the global norm is known: `auto` then steps as `forward`); default: what `max_host_memory` (or the RAM available at start less 10%) leaves after everything else."""
    gradient_memory: int | str | None = None
    """Optimizer state on NVMe: RAM the gradients of those units may take instead of their swap files (4 bytes per param, 2 for a 16-bit gradient: `optimizer.gradient_precision`; first units first), so that the step reads and writes only the master and moments (with fp32 moments 24 bytes per param on the disk instead of 32), bytes or a size like `"4GiB"`; `0` keeps every such gradient on NVMe; default: what `max_host_memory` (or the RAM available at start less 10%) leaves after everything else."""
    nvme_path: str | list[str] = "./offload-swap"
    """Directory for swap files (must exist and be writable); a list spreads ranks over disks."""
    pin_memory: bool = True
    """Pin host buffers when CUDA is present (faster copies; counts against locked RAM)."""
    buffer_count: int | None = None
    """Host slots that stream NVMe-resident optimizer state, a piece per slot (master, moments and gradient: 16 bytes per element with fp32 moments and gradient, fewer with `optimizer.state_precision` bf16 / int8) read ahead, stepped and written back, at least 2; default: as many as fit in the RAM of 3 slots of the largest piece (at most 32)."""
    sub_group_size: int | None = None
    """Elements of one unit's optimizer state streamed from NVMe and stepped as one piece (DeepSpeed's `zero_optimization.sub_group_size`), at least 1024; a piece smaller than the unit's state is cut down to whole blocks of 1024 elements (so that an int8 moment's block never spans two pieces, and the gradient norm summed piece by piece is the whole unit's, bit for bit), a larger one holds the whole state; default: a typical streamed unit, so most units are one piece (at most 2^26 elements, 1 GiB of fp32 state)."""


@dataclass
class PrefetchConfig(ReadOnlyOnceFrozen):
    depth: int = 2
    """How many units ahead of use are fetched (0 fetches on demand)."""


@dataclass
class IOConfig(ReadOnlyOnceFrozen):
    block_size: int = 1 << 20
    """Bytes per swap I/O request (a multiple of 4096)."""
    queue_depth: int = 8
    """Swap I/O requests in flight."""
    threads: int = 4
    """Swap I/O worker threads."""
    background_depth: int = 0
    """Places among the swap requests in flight kept for I/O that nothing waits on yet (the optimizer state's write-back and reads ahead) while such I/O is queued in a direction with no urgent I/O queued (so the write-back runs beside urgent reads, while reads ahead never take the urgent reads' places), and above 0 both directions served at once within each queue (the one with fewer requests in flight first); 0: I/O that compute waits on (weights, a step's state reads) always goes first, and each queue in submission order. For a drive that reads and writes at once (`offload bench-io` says how much faster it serves both together, times the depths on your drive and puts the one to use in its io section): a place or two lets the write-back run beside the reads instead of after them (GPT-2 124M with its optimizer state on an emulated drive of 0.4 GB/s each way: 1.8x faster steps at 2 than at 0 with the weights in RAM, 1.4x with them on NVMe too). Less than min(threads, queue_depth)."""


@dataclass
class WrapConfig(ReadOnlyOnceFrozen):
    module_classes: list[str] = field(default_factory=list)
    """Module class names whose instances become units (outermost match wins)."""
    min_params: int = 0
    """When no classes are given: a module whose not-yet-wrapped parameters reach this count becomes a unit; 0 = automatic (each child of the largest nn.ModuleList, or without one of the largest nn.Sequential)."""


@dataclass
class LossScaleConfig(ReadOnlyOnceFrozen):
    initial: float = 2.0**16
    """Initial loss scale (fp16 only)."""
    growth_interval: int = 1000
    """Clean steps after which the scale doubles."""
    backoff_factor: float = 0.5
    """Factor applied to the scale after an overflow."""
    growth_factor: float = 2.0
    """Factor applied after `growth_interval` clean steps."""
    min_scale: float = 1.0
    """The scale never goes below this."""


@dataclass
class SchedulerConfig(ReadOnlyOnceFrozen):
    """A learning-rate schedule, DeepSpeed's schedules with DeepSpeed's parameter names.

    `lr_at(step, scheduler, base_lr)` gives the learning rate of each optimizer step."""

    type: str = "none"
    """`none` (the optimizer's lr throughout), `warmup` (DeepSpeed WarmupLR), `warmup_decay` (WarmupDecayLR: warmup, then linear decay to 0), `warmup_cosine` (WarmupCosineLR), `one_cycle` (OneCycle), `lr_range_test` (LRRangeTest)."""
    warmup_min_lr: float = 0.0
    """warmup, warmup_decay: the learning rate at the start of the warmup."""
    warmup_max_lr: float | None = None
    """warmup, warmup_decay: the learning rate at the end of the warmup; null: the optimizer's lr."""
    warmup_num_steps: int = 1000
    """warmup, warmup_decay, warmup_cosine: optimizer steps of the warmup (at least 2 are used, as in DeepSpeed)."""
    warmup_type: str = "log"
    """warmup, warmup_decay, warmup_cosine: how the warmup rises, `log` (DeepSpeed's default) or `linear`."""
    total_num_steps: int | None = None
    """warmup_decay, warmup_cosine: optimizer steps of the whole run (the decay ends there); must be set before training."""
    warmup_min_ratio: float = 0.0
    """warmup_cosine: the start of the warmup as a fraction of the optimizer's lr."""
    cos_min_ratio: float = 0.0001
    """warmup_cosine: the end of the cosine decay as a fraction of the optimizer's lr."""
    cycle_min_lr: float | None = None
    """one_cycle: the lowest learning rate of the cycle (required for one_cycle)."""
    cycle_max_lr: float | None = None
    """one_cycle: the highest learning rate of the cycle (required for one_cycle)."""
    decay_lr_rate: float = 0.0
    """one_cycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size); 0 keeps cycle_min_lr."""
    cycle_first_step_size: int = 2000
    """one_cycle: optimizer steps of the rising half of the cycle."""
    cycle_second_step_size: int | None = None
    """one_cycle: optimizer steps of the falling half; null: as many as the rising half."""
    cycle_first_stair_count: int = 0
    """one_cycle: stairs of the rising half (the lr moves in this many flat steps); 0: continuous."""
    cycle_second_stair_count: int | None = None
    """one_cycle: stairs of the falling half; null: as many as the rising half."""
    decay_step_size: int = 0
    """one_cycle: optimizer steps per unit of the post-cycle decay; 0: no decay."""
    cycle_momentum: bool = True
    """one_cycle: cycle Adam's beta1 inversely to the lr between cycle_max_mom and cycle_min_mom (beta2 is 0.99 then, as in DeepSpeed)."""
    cycle_min_mom: float = 0.8
    """one_cycle: the lowest beta1 of the cycle."""
    cycle_max_mom: float = 0.9
    """one_cycle: the highest beta1 of the cycle."""
    decay_mom_rate: float = 0.0
    """one_cycle: after the cycle, beta1 = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""
    lr_range_test_min_lr: float = 1e-3
    """lr_range_test: the learning rate at step 0."""
    lr_range_test_step_size: int = 2000
    """lr_range_test: optimizer steps per unit of increase."""
    lr_range_test_step_rate: float = 1.0
    """lr_range_test: lr = min_lr * (1 + step_rate * steps / step_size)."""
    lr_range_test_staircase: bool = False
    """lr_range_test: increase in whole units of step_size (a staircase) instead of continuously."""


@dataclass
class Config(ReadOnlyOnceFrozen):
    precision: str = "bf16"
    """Compute precision: `bf16`, `fp16` (dynamic loss scaling, an overflow skips the step) or `fp32`."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer (CPU Adam/AdamW on fp32 master weights)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; `step()` updates the weights on every k-th call."""
    gradient_clipping: float = 0.0
    """Maximum global gradient norm (over all units, tiers and ranks); 0 turns clipping off."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Where each kind of state lives."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """Fetching parameters ahead of use."""
    overlap: str = "auto"
    """When the CPU step runs: `auto` (the default; the best exact schedule: units step during backward as their gradients are final, speculatively into spare buffers where RAM allows, while the CPU keeps up, and the rest during the next forward in its order; exact, clipping and fp16 included), `none` (after backward), `forward` (unit by unit during the next forward), `backward` (as each unit's gradients are final; with clipping or fp16 the step is speculative: units with their state in RAM step into spare buffers (the master and moments once more) where RAM allows, and step() commits them, or steps again from the old state when clipping acts or skips on an fp16 overflow; exact either way)."""
    io: IOConfig = field(default_factory=IOConfig)
    """Swap I/O settings (`offload bench-io` prints the best for a disk)."""
    wrap: WrapConfig = field(default_factory=WrapConfig)
    """How the model is cut into units."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The learning-rate schedule (translated from a DeepSpeed `scheduler` section, or written here)."""
    seed: int | None = None
    """If set, torch's RNG is seeded with it at initialize."""
    collective_timeout: float | None = None
    """Several ranks: seconds a rank waits for the others at the engine's host collectives (the agreement before each backward and each unit's collective, norms, checkpoint agreement); past it every rank raises, naming the ranks that did not arrive. Default: the process group's timeout (`OFFLOAD_DIST_TIMEOUT_S`, 600 s, where offload starts the group)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_docs(cls) -> dict[str, str]:
    """The docstring of each field of a config dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)  # `cls` is a config dataclass: its source is one class statement
    body = class_def.body
    docs = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"config key '{path}': {message}", key=path)


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the annotation `hint`; returns it converted (list -> tuple...)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        assert isinstance(hint, type)  # an annotation names the dataclass itself, never an instance of it
        if isinstance(value, hint):
            return _from_mapping(path, dataclasses.asdict(value), hint)
        if not isinstance(value, dict):
            raise _fail(path, f"expected an object with keys {sorted(f.name for f in dataclasses.fields(hint))}, got {value!r}")
        return _from_mapping(path, value, hint)
    if origin is Union or origin is types.UnionType:  # `int | None` (PEP 604) as well as Optional[int]
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except ConfigError as error:
                errors.append(str(error))
        raise _fail(path, f"{value!r} matches none of the accepted types ({'; '.join(errors)})")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _fail(path, f"expected a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", item, arg) for i, (item, arg) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, f"expected a list, got {value!r}")
        return [_coerce(f"{path}[{i}]", item, args[0]) for i, item in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise _fail(path, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _fail(path, f"expected a string, got {value!r}")
        return value
    raise _fail(path, f"unsupported annotation {hint!r}")


@functools.cache
def key_sections() -> types.MappingProxyType[str, tuple[str, ...]]:
    """Every section of the config and its keys: "" is the top level (whose keys include the
    sections' names), "optimizer", "offload", ... (what `key_hints.unknown_key_hint` searches)."""
    sections: dict[str, tuple[str, ...]] = {}

    def walk(prefix: str, section_cls) -> None:
        sections[prefix] = tuple(f.name for f in dataclasses.fields(section_cls))
        for name, hint in _type_hints(section_cls).items():
            if dataclasses.is_dataclass(hint):
                walk(f"{prefix}.{name}" if prefix else name, hint)

    walk("", Config)
    return types.MappingProxyType(sections)


def _from_mapping(prefix: str, mapping: dict, cls):
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in mapping.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            hint = unknown_key_hint(prefix, str(key), key_sections())
            raise ConfigError(f"unknown config key '{path}'{hint}", key=path)
        kwargs[key] = _coerce(path, value, hints[key])
    return cls(**kwargs)


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> str:
    """`value` in `allowed`, compared case-insensitively (`AdamW` is `adamw`); the canonical spelling."""
    lowered = value.lower()
    if lowered in allowed:
        return lowered
    alias = VALUE_ALIASES.get(lowered)
    nearest = [alias] if alias in allowed else difflib.get_close_matches(lowered, allowed, n=1)
    hint = f" (did you mean '{nearest[0]}'?)" if nearest else ""
    raise _fail(path, f"{value!r} is not one of {', '.join(allowed)}{hint}")


def _validate_scheduler(s: SchedulerConfig) -> None:
    s.type = _choice("scheduler.type", s.type, SCHEDULER_TYPES)
    s.warmup_type = _choice("scheduler.warmup_type", s.warmup_type, WARMUP_TYPES)
    for key in (
        "warmup_min_lr",
        "warmup_max_lr",
        "cycle_min_lr",
        "cycle_max_lr",
        "lr_range_test_min_lr",
        "warmup_min_ratio",
        "cos_min_ratio",
        "decay_lr_rate",
        "decay_mom_rate",
        "decay_step_size",
        "warmup_num_steps",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
    ):
        value = getattr(s, key)
        if value is not None and not value >= 0:
            raise _fail(f"scheduler.{key}", f"must be >= 0, got {value}")
    for key in ("total_num_steps", "cycle_first_step_size", "cycle_second_step_size", "lr_range_test_step_size"):
        value = getattr(s, key)
        if value is not None and value < 1:
            raise _fail(f"scheduler.{key}", f"must be >= 1, got {value}")
    for key in ("cycle_min_mom", "cycle_max_mom"):
        if not 0.0 <= getattr(s, key) < 1.0:
            raise _fail(f"scheduler.{key}", f"must be in [0, 1) (it is Adam's beta1), got {getattr(s, key)}")
    if s.type == "one_cycle":
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if getattr(s, key) is None:
                raise _fail(f"scheduler.{key}", "one_cycle needs it; give the cycle's learning rate bounds")


def _validate_nvme_path(nvme_path: str | list[str]) -> None:
    """An empty swap directory is refused: "" joined to the run's directory is a path relative to
    the current directory, so the swap files would land wherever the script was started."""
    if isinstance(nvme_path, list) and not nvme_path:
        raise _fail("offload.nvme_path", "an empty list; give a directory or a list of directories")
    for index, path in enumerate(nvme_path if isinstance(nvme_path, list) else [nvme_path]):
        if not path.strip():
            key = f"offload.nvme_path[{index}]" if isinstance(nvme_path, list) else "offload.nvme_path"
            raise _fail(
                key,
                f"{path!r} names no directory: the swap files would land under the current directory, wherever the "
                'script runs. Write the swap directory on a fast local disk, e.g. "/mnt/nvme/offload-swap" ("." if the '
                "current directory is meant), or leave the key out for ./offload-swap",
            )


def validate(config: Config) -> Config:
    """Checks ranges and combinations; raises ConfigError naming the key and the fix. Choices are
    read case-insensitively and stored in their canonical (lower-case) spelling."""
    config.precision = _choice("precision", config.precision, PRECISIONS)
    config.offload.param = _choice("offload.param", config.offload.param, PARAM_TIERS)
    config.offload.optimizer = _choice("offload.optimizer", config.offload.optimizer, OPTIMIZER_TIERS)
    for key in ("max_device_memory", "max_host_memory", "speculation_memory", "gradient_memory"):
        value = getattr(config.offload, key)
        try:
            size = parse_size(value)
        except ValueError as error:
            raise _fail(f"offload.{key}", str(error)) from None
        if size is not None and size < 0:
            raise _fail(f"offload.{key}", f"must be >= 0 bytes, got {value!r}")
    config.overlap = _choice("overlap", config.overlap, OVERLAPS)
    config.optimizer.type = _choice("optimizer.type", config.optimizer.type, OPTIMIZER_TYPES)
    opt = config.optimizer
    opt.state_precision = _choice("optimizer.state_precision", opt.state_precision, STATE_PRECISIONS)
    if opt.gradient_precision.lower() in ("bf16", "fp16", "bfloat16", "float16"):
        raise _fail(
            "optimizer.gradient_precision",
            f"{opt.gradient_precision!r} is not one of {', '.join(GRADIENT_PRECISIONS)}: `auto` keeps the gradient in "
            "its 16-bit compute dtype wherever that is exact (one micro-batch per optimizer step), fp32 otherwise",
        )
    opt.gradient_precision = _choice("optimizer.gradient_precision", opt.gradient_precision, GRADIENT_PRECISIONS)
    if not opt.lr >= 0:
        raise _fail("optimizer.lr", f"must be >= 0, got {opt.lr}")
    for i, beta in enumerate(opt.betas):
        if not 0.0 <= beta < 1.0:
            raise _fail(f"optimizer.betas[{i}]", f"must be in [0, 1), got {beta}")
    if not opt.eps > 0:
        raise _fail("optimizer.eps", f"must be > 0, got {opt.eps}")
    if not opt.weight_decay >= 0:
        raise _fail("optimizer.weight_decay", f"must be >= 0, got {opt.weight_decay}")
    if opt.threads < 0:
        raise _fail("optimizer.threads", f"must be >= 0 (0 = all CPUs), got {opt.threads}")
    if isinstance(opt.rounding_seed, bool) or not isinstance(opt.rounding_seed, int) or not 0 <= opt.rounding_seed < 2**32:
        raise _fail("optimizer.rounding_seed", f"must be an int in [0, 2^32), got {opt.rounding_seed!r}")
    if config.gradient_accumulation_steps < 1:
        raise _fail("gradient_accumulation_steps", f"must be >= 1, got {config.gradient_accumulation_steps}")
    if config.collective_timeout is not None and not 0 < config.collective_timeout < math.inf:
        raise _fail("collective_timeout", f"must be a positive number of seconds, got {config.collective_timeout}")
    if not config.gradient_clipping >= 0:
        raise _fail("gradient_clipping", f"must be >= 0 (0 turns clipping off), got {config.gradient_clipping}")
    if config.prefetch.depth < 0:
        raise _fail("prefetch.depth", f"must be >= 0, got {config.prefetch.depth}")
    if config.offload.buffer_count is not None and config.offload.buffer_count < 2:
        raise _fail("offload.buffer_count", f"must be >= 2, got {config.offload.buffer_count}")
    if config.offload.sub_group_size is not None and config.offload.sub_group_size < MIN_SUB_GROUP_SIZE:
        raise _fail("offload.sub_group_size", f"must be >= {MIN_SUB_GROUP_SIZE} elements, got {config.offload.sub_group_size}")
    io = config.io
    if io.block_size <= 0 or io.block_size % 4096:
        raise _fail("io.block_size", f"must be a positive multiple of 4096, got {io.block_size}")
    if io.queue_depth < 1:
        raise _fail("io.queue_depth", f"must be >= 1, got {io.queue_depth}")
    if io.threads < 1:
        raise _fail("io.threads", f"must be >= 1, got {io.threads}")
    if not 0 <= io.background_depth < min(io.threads, io.queue_depth):
        raise _fail(
            "io.background_depth",
            f"must be >= 0 and less than min(io.threads, io.queue_depth) = {min(io.threads, io.queue_depth)} "
            f"(the requests in flight), got {io.background_depth}",
        )
    if config.wrap.min_params < 0:
        raise _fail("wrap.min_params", f"must be >= 0, got {config.wrap.min_params}")
    _validate_nvme_path(config.offload.nvme_path)
    scale = config.loss_scale
    if not scale.initial > 0 or not scale.min_scale > 0:
        raise _fail("loss_scale", "initial and min_scale must be > 0")
    if not 0 < scale.backoff_factor < 1 or not scale.growth_factor >= 1 or scale.growth_interval < 1:
        raise _fail("loss_scale", "needs 0 < backoff_factor < 1, growth_factor >= 1, growth_interval >= 1")
    _validate_scheduler(config.scheduler)
    return config


def is_deepspeed_config(mapping: dict) -> bool:
    """A DeepSpeed config is recognised by keys only DeepSpeed uses."""
    markers = {
        "zero_optimization",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "bf16",
        "bfloat16",
        "fp16",
        "aio",
        "zero_allow_untested_optimizer",
        "steps_per_print",
    }
    if any(key in markers for key in mapping):
        return True
    # DeepSpeed's optimizer and scheduler sections are {"type": ..., "params": {...}}; offload's are flat
    return any(
        isinstance(mapping.get(key), dict) and "params" in mapping[key] and "type" in mapping[key]
        for key in ("optimizer", "scheduler")
    )


def _build(mapping: dict, translation=None) -> Config:
    """Validates a mapping of offload keys once. An error in a translated config names the
    user's own key it came from (`ConfigError.key` is that key)."""
    try:
        return validate(_from_mapping("", mapping, Config))
    except ConfigError as error:
        if translation is None or error.key is None:
            raise
        base = error.key.split("[")[0]
        sources = sorted(
            {
                src
                for ours, src in translation.sources.items()
                if ours == base or ours.startswith(base + ".") or base.startswith(ours + ".")
            }
        )
        if not sources:
            raise
        shown = ", ".join(repr(src) for src in sources)
        # the message holds the first error whole: the chain would only repeat it
        raise ConfigError(f"{error} (translated from {translation.kind} key {shown}; fix it there)", key=sources[0]) from None


@raised_at_users_call
def load_config(source: Config | dict | str | os.PathLike | None = None, *, strict: bool = True) -> Config:
    """A validated Config from a Config, a dict, or a path to a JSON file (offload's or
    DeepSpeed's) or an accelerate YAML.

    DeepSpeed and accelerate keys that only tune or log are accepted and listed in one INFO
    line; keys offload cannot honour are one ConfigError, or with `strict=False` one WARNING
    (and dropped). See `offload.config.deepspeed`. An error about a key in a file names the file.
    """
    if isinstance(source, (str, os.PathLike)):
        try:
            return _load_config_file(Path(source), strict)
        except ConfigError as error:
            name_config_file(error, source)
            raise
    return _load_config(source, strict)


def _load_config_file(path: Path, strict: bool) -> Config:
    from offload.config import deepspeed as deepspeed_config

    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a dict, an offload.Config or the path of a JSON file")
    if path.suffix.lower() in (".yaml", ".yml"):
        translation = deepspeed_config.translate_accelerate(path)
        deepspeed_config.report(translation, strict)
        return _build(translation.config, translation)
    try:
        source = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {error}") from None
    return _load_config(source, strict)


def _load_config(source: Config | dict | None, strict: bool) -> Config:
    from offload.config import deepspeed as deepspeed_config

    if source is None:
        return validate(Config())
    if isinstance(source, Config):
        return validate(_from_mapping("", dataclasses.asdict(source), Config))
    if not isinstance(source, dict):
        raise ConfigError(f"config must be a dict, a JSON path or an offload.Config, got {type(source).__name__}")
    if is_deepspeed_config(source):
        translation = deepspeed_config.translate_deepspeed(source)
        deepspeed_config.report(translation, strict)
        return _build(translation.config, translation)
    return _build(source)


# ---- the learning-rate schedule, as plain arithmetic ----------------------------------------
def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far through the warmup DeepSpeed's schedules are at `iteration` (0 at its start)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


def _needs_total(s: SchedulerConfig) -> int:
    if s.total_num_steps is None:
        raise ConfigError(
            f"config key 'scheduler.total_num_steps': the {s.type} schedule needs the number of optimizer "
            "steps of the run; set it (a DeepSpeed 'auto' cannot be resolved without the Trainer)",
            key="scheduler.total_num_steps",
        )
    return s.total_num_steps


def _one_cycle_scale(s: SchedulerConfig, batch: int) -> float:
    """Where in the cycle `batch` is: 0 at cycle_min_lr, 1 at cycle_max_lr (DeepSpeed's OneCycle)."""
    first = float(s.cycle_first_step_size)
    second = float(s.cycle_second_step_size if s.cycle_second_step_size is not None else s.cycle_first_step_size)
    total = first + second
    ratio = first / total
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    if x <= ratio:
        scale, stairs = x / ratio, s.cycle_first_stair_count
    else:
        scale = (x - 1) / (ratio - 1)
        stairs = s.cycle_second_stair_count if s.cycle_second_stair_count is not None else s.cycle_first_stair_count
    if stairs > 0:
        position = batch % total
        position = position * stairs / first if position <= first else (total - position) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def _one_cycle_total(s: SchedulerConfig) -> int:
    return s.cycle_first_step_size + (
        s.cycle_second_step_size if s.cycle_second_step_size is not None else s.cycle_first_step_size
    )


def lr_at(step: int, scheduler: SchedulerConfig, base_lr: float) -> float:
    """The learning rate of optimizer step `step` (0 = the first update) under `scheduler`, as
    DeepSpeed's schedule of the same name gives it. `base_lr` is the optimizer's lr.

    DeepSpeed advances its schedule after each applied update (not after a skipped fp16
    overflow step), so update `step` uses its state `last_batch_iteration = step - 1`; that is
    why the first update of `warmup` runs at warmup_min_lr, and of `warmup_cosine` at 0.
    """
    s = scheduler
    it = step - 1  # DeepSpeed's last_batch_iteration
    if s.type == "none":
        return base_lr
    if s.type in ("warmup", "warmup_decay"):
        low = s.warmup_min_lr
        high = base_lr if s.warmup_max_lr is None else s.warmup_max_lr
        total = _needs_total(s) if s.type == "warmup_decay" else None
        if it < 0:
            return low
        warmup = max(2, s.warmup_num_steps)
        if it < warmup:
            gamma = _warmup_fraction(it, warmup, s.warmup_type)
        elif total is None:
            gamma = 1.0
        else:
            gamma = max(0.0, (total - it) / max(1.0, total - warmup))
        return low + (high - low) * gamma
    if s.type == "warmup_cosine":
        total = _needs_total(s)
        if it < 0:
            return 0.0
        warmup = max(2, s.warmup_num_steps)
        if it < warmup:
            ratio = s.warmup_min_ratio + _warmup_fraction(it, warmup, s.warmup_type) * (1.0 - s.warmup_min_ratio)
        else:
            progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
            ratio = max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
        return base_lr * ratio
    if s.type == "one_cycle":
        # validate() refuses a one_cycle schedule without both bounds
        assert s.cycle_min_lr is not None and s.cycle_max_lr is not None
        low, high = s.cycle_min_lr, s.cycle_max_lr
        total = _one_cycle_total(s)
        if it < total:
            return low + (high - low) * _one_cycle_scale(s, it + 1)
        if s.decay_step_size == 0 or s.decay_lr_rate == 0:
            return low
        return low / (1 + s.decay_lr_rate * (it - total + 1) / s.decay_step_size)
    if s.type == "lr_range_test":
        interval = (it + 1) / s.lr_range_test_step_size
        if s.lr_range_test_staircase:
            interval = math.floor(interval)
        return s.lr_range_test_min_lr * (1 + s.lr_range_test_step_rate * interval)
    raise ConfigError(f"config key 'scheduler.type': {s.type!r} is not one of {', '.join(SCHEDULER_TYPES)}", key="scheduler.type")


def betas_at(step: int, scheduler: SchedulerConfig, betas: tuple[float, float]) -> tuple[float, float]:
    """Adam's (beta1, beta2) for optimizer step `step` (see `lr_at`): `betas` unless a
    `one_cycle` schedule cycles the momentum. Then, as DeepSpeed's OneCycle does, beta1 runs
    inversely to the lr and beta2 is 0.99; before the first advance (step 0) beta1 is
    cycle_min_mom, which is what DeepSpeed's constructor writes into the optimizer."""
    s = scheduler
    if s.type != "one_cycle" or not s.cycle_momentum:
        # tuple() keeps the two betas (it only turns a list from a param group into a tuple); mypy loses the length
        return typing.cast(tuple[float, float], tuple(betas))
    it = step - 1
    if it < 0:
        return (s.cycle_min_mom, 0.99)
    total = _one_cycle_total(s)
    if it < total:
        return (s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * _one_cycle_scale(s, it + 1), 0.99)
    if s.decay_step_size == 0 or s.decay_mom_rate == 0:
        return (s.cycle_max_mom, 0.99)
    return (s.cycle_max_mom * (1 + s.decay_mom_rate * (it - total + 1) / s.decay_step_size), 0.99)
