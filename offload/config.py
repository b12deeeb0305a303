"""Config dataclasses, loading from a dict / JSON path / Config, and validation.

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
import inspect
import json
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from offload.errors import ConfigError

PRECISIONS = ("bf16", "fp16", "fp32")
PARAM_TIERS = ("none", "cpu", "nvme")
OPTIMIZER_TIERS = ("cpu", "nvme")
OVERLAPS = ("none", "forward", "backward")
OPTIMIZER_TYPES = ("adamw", "adam")


@dataclass
class OptimizerConfig:
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
    threads: int = 0
    """Threads of the C++ CPU Adam; 0 means every CPU this process may use."""


@dataclass
class OffloadConfig:
    param: str = "none"
    """Where 16-bit weights live between uses: `none` (on the accelerator), `cpu`, `nvme`."""
    optimizer: str = "cpu"
    """Where fp32 master weights, Adam states and fp32 gradients live: `cpu`, `nvme`."""
    nvme_path: Union[str, list[str]] = "./offload-swap"
    """Directory for swap files (must exist and be writable); a list spreads ranks over disks."""
    pin_memory: bool = True
    """Pin host buffers when CUDA is present (faster copies; counts against locked RAM)."""
    buffer_count: int = 3
    """Host buffers per state kind for streaming NVMe-resident units (read next, step this, write last)."""


@dataclass
class PrefetchConfig:
    depth: int = 2
    """How many units ahead of use are fetched (0 fetches on demand)."""


@dataclass
class IOConfig:
    block_size: int = 1 << 20
    """Bytes per swap I/O request (a multiple of 4096)."""
    queue_depth: int = 8
    """Swap I/O requests in flight."""
    threads: int = 4
    """Swap I/O worker threads."""


@dataclass
class WrapConfig:
    module_classes: list[str] = field(default_factory=list)
    """Module class names whose instances become units (outermost match wins)."""
    min_params: int = 0
    """When no classes are given: a module whose not-yet-wrapped parameters reach this count becomes a unit; 0 = automatic (each child of the largest nn.ModuleList)."""


@dataclass
class LossScaleConfig:
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
class Config:
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
    overlap: str = "forward"
    """When the CPU step runs: `none` (after backward), `forward` (unit by unit during the next forward), `backward` (as each unit's gradients are final; refused with clipping or fp16)."""
    io: IOConfig = field(default_factory=IOConfig)
    """Swap I/O settings (`offload bench-io` prints the best for a disk)."""
    wrap: WrapConfig = field(default_factory=WrapConfig)
    """How the model is cut into units."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    seed: int | None = None
    """If set, torch's RNG is seeded with it at initialize."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)




def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_docs(cls) -> dict[str, str]:
    """The docstring of each field of a config dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
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
    return ConfigError(f"config key '{path}': {message}")


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the annotation `hint`; returns it converted (list -> tuple...)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
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


# Names users bring from other libraries (torch.optim, transformers, DeepSpeed) for our keys.
KEY_ALIASES = {
    "learning_rate": "lr",
    "beta": "betas",
    "epsilon": "eps",
    "adam_epsilon": "eps",
    "decay": "weight_decay",
    "wd": "weight_decay",
    "clip_grad": "gradient_clipping",
    "max_grad_norm": "gradient_clipping",
    "grad_clip": "gradient_clipping",
    "gradient_accumulation": "gradient_accumulation_steps",
    "grad_accum": "gradient_accumulation_steps",
    "dtype": "precision",
    "mixed_precision": "precision",
    "path": "nvme_path",
    "swap_path": "nvme_path",
    "num_threads": "threads",
    "prefetch_depth": "depth",
}


def _nearest_key(key: str, names: list[str]) -> str | None:
    """The valid key a misspelt `key` most likely meant: a known alias first, then by spelling."""
    alias = KEY_ALIASES.get(key.lower())
    if alias in names:
        return alias
    nearest = difflib.get_close_matches(key, names, n=1, cutoff=0.4)
    return nearest[0] if nearest else None


def _from_mapping(prefix: str, mapping: dict, cls):
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in mapping.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            nearest = _nearest_key(str(key), names)
            hint = f"; did you mean '{nearest}'?" if nearest else f"; valid keys here: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = _coerce(path, value, hints[key])
    return cls(**kwargs)


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        nearest = difflib.get_close_matches(value, allowed, n=1)
        hint = f" (did you mean '{nearest[0]}'?)" if nearest else ""
        raise _fail(path, f"{value!r} is not one of {', '.join(allowed)}{hint}")


def validate(config: Config) -> Config:
    """Checks ranges and combinations; raises ConfigError naming the key and the fix."""
    _choice("precision", config.precision, PRECISIONS)
    _choice("offload.param", config.offload.param, PARAM_TIERS)
    _choice("offload.optimizer", config.offload.optimizer, OPTIMIZER_TIERS)
    _choice("overlap", config.overlap, OVERLAPS)
    _choice("optimizer.type", config.optimizer.type, OPTIMIZER_TYPES)
    opt = config.optimizer
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
    if config.gradient_accumulation_steps < 1:
        raise _fail("gradient_accumulation_steps", f"must be >= 1, got {config.gradient_accumulation_steps}")
    if not config.gradient_clipping >= 0:
        raise _fail("gradient_clipping", f"must be >= 0 (0 turns clipping off), got {config.gradient_clipping}")
    if config.prefetch.depth < 0:
        raise _fail("prefetch.depth", f"must be >= 0, got {config.prefetch.depth}")
    if config.offload.buffer_count < 2:
        raise _fail("offload.buffer_count", f"must be >= 2, got {config.offload.buffer_count}")
    io = config.io
    if io.block_size <= 0 or io.block_size % 4096:
        raise _fail("io.block_size", f"must be a positive multiple of 4096, got {io.block_size}")
    if io.queue_depth < 1:
        raise _fail("io.queue_depth", f"must be >= 1, got {io.queue_depth}")
    if io.threads < 1:
        raise _fail("io.threads", f"must be >= 1, got {io.threads}")
    if config.wrap.min_params < 0:
        raise _fail("wrap.min_params", f"must be >= 0, got {config.wrap.min_params}")
    if isinstance(config.offload.nvme_path, list) and not config.offload.nvme_path:
        raise _fail("offload.nvme_path", "an empty list; give a directory or a list of directories")
    scale = config.loss_scale
    if not scale.initial > 0 or not scale.min_scale > 0:
        raise _fail("loss_scale", "initial and min_scale must be > 0")
    if not 0 < scale.backoff_factor < 1 or not scale.growth_factor >= 1 or scale.growth_interval < 1:
        raise _fail("loss_scale", "needs 0 < backoff_factor < 1, growth_factor >= 1, growth_interval >= 1")
    if config.overlap == "backward":
        if config.gradient_clipping > 0:
            raise _fail(
                "overlap",
                "'backward' steps each unit before the global gradient norm is known, so it cannot clip; "
                "set gradient_clipping to 0 or use overlap 'forward' (exact, clipping allowed)",
            )
        if config.precision == "fp16":
            raise _fail(
                "overlap",
                "'backward' steps each unit before an fp16 overflow anywhere in the model is known; "
                "use overlap 'forward' or precision 'bf16'",
            )
    return config


def is_deepspeed_config(mapping: dict) -> bool:
    """A DeepSpeed config is recognised by keys only DeepSpeed uses."""
    markers = {
        "zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "bf16", "bfloat16", "fp16", "aio",
        "zero_allow_untested_optimizer", "scheduler", "steps_per_print",
    }
    if any(key in markers for key in mapping):
        return True
    # DeepSpeed's optimizer section is {"type": ..., "params": {...}}; offload's has no "params"
    optimizer = mapping.get("optimizer")
    return isinstance(optimizer, dict) and "params" in optimizer and "type" in optimizer


def load_config(source: Config | dict | str | os.PathLike | None = None, *, strict: bool = True) -> Config:
    """A validated Config from a Config, a dict, or a path to a JSON file (offload's or DeepSpeed's).

    `strict=False` turns DeepSpeed keys that have no meaning here into warnings instead of errors.
    """
    if source is None:
        return validate(Config())
    if isinstance(source, Config):
        return validate(_from_mapping("", dataclasses.asdict(source), Config))
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a dict, an offload.Config or the path of a JSON file")
        if path.suffix.lower() in (".yaml", ".yml"):
            from offload.deepspeed_config import load_accelerate_config

            return load_accelerate_config(path, strict=strict)
        try:
            mapping = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {error}") from error
        source = mapping
    if not isinstance(source, dict):
        raise ConfigError(f"config must be a dict, a JSON path or an offload.Config, got {type(source).__name__}")
    if is_deepspeed_config(source):
        from offload.deepspeed_config import translate

        source = translate(source, strict=strict)
    return validate(_from_mapping("", source, Config))
