"""The engine's config for a Hugging Face Trainer run (`OffloadTrainer`, and TRL's trainers on it):
`TrainingArguments` drive what the Trainer owns (precision, AdamW's hyper-parameters, clipping,
accumulation, the schedule's "auto" values); the user's offload / DeepSpeed / accelerate config
gives the rest (placement, prefetch, I/O, overlap, wrapping). Plain functions of the arguments'
values: no transformers import, tested directly.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

from offload.config.schema import Config, is_deepspeed_config, load_config
from offload.errors import ConfigError

logger = logging.getLogger(__name__)

# TrainingArguments.optim values that mean AdamW (what the engine's CPU Adam computes); the state
# precision is offload_config's (optimizer.state_precision, fp32 by default).
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "paged_adamw_32bit")
# AdamW with 8-bit moments (torchao's, bitsandbytes'): the engine's AdamW with int8 moments
# (optimizer.state_precision int8, docs/compact_state.md; its own blockwise format).
ADAMW_8BIT_OPTIMS = ("adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
# bitsandbytes' AdamWs whose state pages between GPU and CPU memory (QLoRA's recipes use them):
# the same AdamW, the paging being what the engine's placement does (offload.optimizer).
PAGED_ADAMW_OPTIMS = ("paged_adamw_32bit", "paged_adamw_8bit")


# ---- the config: TrainingArguments decide what the Trainer owns ------------------------------
def _precision(args) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def _trainer_values(args) -> dict[str, tuple[Any, str]]:
    """offload key -> (the value the Trainer's arguments give, where it comes from)."""
    optim = _optim_name(args)
    state = {}
    if optim in ADAMW_8BIT_OPTIMS:
        state["optimizer.state_precision"] = ("int8", f"TrainingArguments.optim={optim!r}")
    return {
        **state,
        "precision": (_precision(args), f"TrainingArguments.bf16={bool(args.bf16)} / fp16={bool(args.fp16)} (neither: fp32)"),
        "optimizer.type": ("adamw", f"TrainingArguments.optim={_optim_name(args)!r}"),
        "optimizer.lr": (float(args.learning_rate), "TrainingArguments.learning_rate"),
        "optimizer.betas": ((float(args.adam_beta1), float(args.adam_beta2)), "TrainingArguments.adam_beta1 / adam_beta2"),
        "optimizer.eps": (float(args.adam_epsilon), "TrainingArguments.adam_epsilon"),
        "optimizer.weight_decay": (float(args.weight_decay), "TrainingArguments.weight_decay"),
        "gradient_clipping": (float(args.max_grad_norm or 0.0), "TrainingArguments.max_grad_norm"),
        "gradient_accumulation_steps": (int(args.gradient_accumulation_steps), "TrainingArguments.gradient_accumulation_steps"),
    }


_TRAINER_KEYS = (
    "precision",
    "optimizer.type",
    "optimizer.lr",
    "optimizer.betas",
    "optimizer.eps",
    "optimizer.weight_decay",
    "gradient_clipping",
    "gradient_accumulation_steps",
)


def _scheduler_name(args) -> str:
    kind = getattr(args, "lr_scheduler_type", "linear")
    return getattr(kind, "value", kind)


def _optim_name(args) -> str:
    optim = getattr(args, "optim", "adamw_torch")
    return getattr(optim, "value", optim)


def _get(mapping: dict, dotted: str) -> Any:
    node: Any = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(mapping: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = mapping
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


_MISSING = object()


def _fill_deepspeed_auto(ds: dict, args, max_steps: int | None = None) -> dict:
    """A DeepSpeed config with its `"auto"` values filled from TrainingArguments, as the Trainer's own
    DeepSpeed integration fills them (the schedule's step counts once `max_steps` is known)."""
    ds = copy.deepcopy(ds)
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    fills = {
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "gradient_clipping": args.max_grad_norm,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
        "bf16.enabled": bool(args.bf16),
        "bfloat16.enabled": bool(args.bf16),
        "fp16.enabled": bool(args.fp16),
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": args.learning_rate,
    }
    if max_steps:
        fills["scheduler.params.warmup_num_steps"] = int(args.get_warmup_steps(max_steps))
        fills["scheduler.params.total_num_steps"] = int(max_steps)
    for key, value in fills.items():
        if _get(ds, key) == "auto":
            _set(ds, key, value)
    return ds


_FILLED_AT_TRAIN = ("scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps")


def _deepspeed_mismatches(ds: dict, args) -> list[str]:
    """Every value a DeepSpeed config writes (not "auto") that differs from what the
    TrainingArguments give, each as "<DeepSpeed key>=<value> but TrainingArguments.<field>=<value>",
    as the Trainer's own DeepSpeed integration lists them."""
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    checks: list[tuple[str, Any, str]] = [
        (
            "train_micro_batch_size_per_gpu",
            args.per_device_train_batch_size,
            f"per_device_train_batch_size={args.per_device_train_batch_size!r}",
        ),
        (
            "train_batch_size",
            batch,
            f"per_device_train_batch_size={args.per_device_train_batch_size!r} * gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps!r} * world size {world} = {batch!r}",
        ),
        (
            "gradient_accumulation_steps",
            args.gradient_accumulation_steps,
            f"gradient_accumulation_steps={args.gradient_accumulation_steps!r}",
        ),
        ("gradient_clipping", float(args.max_grad_norm or 0.0), f"max_grad_norm={args.max_grad_norm!r}"),
        ("optimizer.params.lr", float(args.learning_rate), f"learning_rate={args.learning_rate!r}"),
        ("optimizer.params.eps", float(args.adam_epsilon), f"adam_epsilon={args.adam_epsilon!r}"),
        ("optimizer.params.weight_decay", float(args.weight_decay), f"weight_decay={args.weight_decay!r}"),
        ("bf16.enabled", bool(args.bf16), f"bf16={bool(args.bf16)!r}"),
        ("bfloat16.enabled", bool(args.bf16), f"bf16={bool(args.bf16)!r}"),
        ("fp16.enabled", bool(args.fp16), f"fp16={bool(args.fp16)!r}"),
    ]
    mismatches = []
    for key, value, theirs in checks:
        have = _get(ds, key)
        if have in (_MISSING, "auto") or isinstance(have, (dict, list)):
            continue
        if have != value:
            mismatches.append(f"{key}={have!r} but TrainingArguments.{theirs}")
    betas = _get(ds, "optimizer.params.betas")
    wanted = (float(args.adam_beta1), float(args.adam_beta2))
    if isinstance(betas, (list, tuple)) and tuple(float(b) for b in betas) != wanted:
        mismatches.append(
            f"optimizer.params.betas={list(betas)!r} but TrainingArguments.adam_beta1 / adam_beta2={list(wanted)!r}"
        )
    return mismatches


def _user_mapping(offload_config, args=None, report: bool = True, max_steps: int | None = None) -> tuple[dict, dict[str, str]]:
    """The keys the user's config sets, as an offload-format mapping, and for a translated config,
    which of the user's keys each offload key came from. With `args`, DeepSpeed `"auto"` values are
    filled from them; without, they count as not set. An `offload.Config` sets what differs from
    `offload.Config()`."""
    from offload.config import deepspeed as deepspeed_config

    if offload_config is None:
        return {}, {}
    if isinstance(offload_config, Config):
        return _differences(offload_config.to_dict(), Config().to_dict()), {}
    source = offload_config
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"offload_config {str(path)!r} does not exist; pass a dict, an offload.Config or the "
                "path of an offload or DeepSpeed JSON (or an accelerate YAML)"
            )
        if path.suffix.lower() in (".yaml", ".yml"):
            translation = deepspeed_config.translate_accelerate(path)
            if report:
                deepspeed_config.report(translation)
            return translation.config, dict(translation.sources)
        try:
            source = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"offload_config {str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(source, dict):
        raise ConfigError(f"offload_config must be a dict, a JSON path or an offload.Config, got {type(source).__name__}")
    if not is_deepspeed_config(source):
        return copy.deepcopy(source), {}
    if args is not None:
        mismatches = _deepspeed_mismatches(source, args)
        if mismatches:
            raise _contradiction(
                "the DeepSpeed config",
                mismatches,
                'Set each to "auto" in the DeepSpeed config (the Trainer fills it in), or make the two equal',
            )
    filled = _fill_deepspeed_auto(source, args, max_steps) if args is not None else source
    translation = deepspeed_config.translate_deepspeed(filled)
    if args is not None and not max_steps:
        # the schedule's step counts are filled once the run's length is known (at train()); a
        # WARNING now would name a value that is never used
        translation.auto = [(key, value) for key, value in translation.auto if key not in _FILLED_AT_TRAIN]
    if report:
        deepspeed_config.report(translation)
    mapping = translation.config
    # a translated key counts as the user's only if they wrote its DeepSpeed key, not as "auto"
    # (the translator also writes DeepSpeed's defaults for absent ones, and fp32 when no
    # precision section exists)
    sources = {}
    for ours, theirs in translation.sources.items():
        written = _get(filled, theirs) not in (_MISSING, "auto")
        if ours == "precision":
            written = any(_get(filled, f"{key}.enabled") not in (_MISSING, "auto") for key in ("bf16", "bfloat16", "fp16"))
        if written:
            sources[ours] = theirs
        elif ours in _TRAINER_KEYS:
            _drop(mapping, ours)
    return mapping, sources


def keys_set(offload_config) -> dict:
    """The keys the user's config sets, as an offload-format mapping (logging nothing): a
    DeepSpeed config's translated, where a key written "auto" or a precision section left out
    sets nothing; an `offload.Config` sets what differs from `offload.Config()`. What a route
    that takes the rest from its framework (OffloadAccelerator: the precision) leaves to it."""
    return _user_mapping(offload_config, report=False)[0]


def _differences(values: dict, defaults: dict) -> dict:
    result = {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            nested = _differences(value, defaults[key])
            if nested:
                result[key] = nested
        elif value != defaults.get(key, _MISSING):
            result[key] = value
    return result


def _drop(mapping: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node = mapping
    for part in parents:
        node = node.get(part, {})
    if isinstance(node, dict):
        node.pop(last, None)


def split_offload_config(offload_config) -> tuple[dict[str, Any], dict]:
    """Splits a config written for the engine alone (offload's, DeepSpeed's or accelerate's) into
    `TrainingArguments` keyword arguments for what the Trainer drives under OffloadTrainer
    (precision, AdamW's lr / betas / eps / weight decay, clipping, accumulation) and the rest, an
    offload config mapping for `OffloadTrainer(offload_config=...)`::

        arguments, engine_config = split_offload_config("examples/configs/7b_on_24gb.json")
        args = TrainingArguments(output_dir="out", **arguments)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=ds, offload_config=engine_config)

    DeepSpeed `"auto"` values are left to the arguments' own defaults."""
    mapping, _sources = _user_mapping(offload_config)
    names = {
        "optimizer.lr": "learning_rate",
        "optimizer.eps": "adam_epsilon",
        "optimizer.weight_decay": "weight_decay",
        "gradient_clipping": "max_grad_norm",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
    }
    arguments: dict[str, Any] = {}
    for key, name in names.items():
        value = _get(mapping, key)
        if value is not _MISSING:
            arguments[name] = value
    betas = _get(mapping, "optimizer.betas")
    if betas is not _MISSING:
        arguments["adam_beta1"], arguments["adam_beta2"] = (float(b) for b in betas)
    precision = _get(mapping, "precision")
    if precision in ("bf16", "fp16"):
        arguments[precision] = True
    if _get(mapping, "optimizer.type") not in (_MISSING, "adamw"):
        raise ConfigError(
            f"optimizer.type {_get(mapping, 'optimizer.type')!r} has no TrainingArguments counterpart: "
            "the Trainer's optimizer is AdamW; use type 'adamw'",
            key="optimizer.type",
        )
    rest = copy.deepcopy(mapping)
    for key in _TRAINER_KEYS:
        _drop(rest, key)
    if rest.get("optimizer") == {}:
        del rest["optimizer"]
    return arguments, rest


def trainer_config(args, offload_config=None, max_steps: int | None = None, report: bool = True) -> Config:
    """The engine's config for a Trainer run: placement, prefetch, I/O, overlap and wrapping from
    `offload_config` (offload's JSON / dict / Config, a DeepSpeed JSON or dict, an accelerate YAML);
    precision, AdamW hyper-parameters, clipping and accumulation from `TrainingArguments`.

    A value the user's config sets that contradicts TrainingArguments is a ConfigError naming both
    (as the Trainer's DeepSpeed integration refuses mismatched values); DeepSpeed `"auto"` values
    are filled from TrainingArguments. The engine's own window is 1: the Trainer accumulates, and
    calls `optimizer.step()` at the end of each of its windows. `report`: log what a DeepSpeed or
    accelerate config had ignored or resolved (once per run: False when building it again)."""
    optim = _optim_name(args)
    if optim not in ADAMW_OPTIMS + ADAMW_8BIT_OPTIMS:
        raise ConfigError(
            f"TrainingArguments.optim={optim!r} cannot run on offload: its CPU optimizer is AdamW; "
            f"use optim one of {', '.join(ADAMW_OPTIMS + ADAMW_8BIT_OPTIMS)} (the default adamw_torch; the 8-bit ones "
            "store the moments in int8)"
        )
    mapping, sources = _user_mapping(offload_config, args, report=report, max_steps=max_steps)
    wanted = _trainer_values(args)
    conflicts = []
    for key, (value, origin) in wanted.items():
        have = _get(mapping, key)
        if have is _MISSING:
            continue
        same = (
            (tuple(float(v) for v in have) == value)
            if key == "optimizer.betas" and isinstance(have, (list, tuple))
            else (have == value)
        )
        if not same:
            theirs = f" (from {sources[key]!r})" if key in sources else ""
            conflicts.append(f"{key}={have!r}{theirs} but {origin} gives {value!r}")
    seed = mapping.pop("seed", None)
    if seed is not None and seed != args.seed:
        conflicts.append(
            f"seed={seed!r} but TrainingArguments.seed={args.seed!r} (the Trainer seeds the run before the model is built)"
        )
    if conflicts:
        raise _contradiction(
            "offload_config",
            conflicts,
            'Remove each key from offload_config (or set it to "auto" in a DeepSpeed config), or make the two equal',
        )
    # a schedule in the config drives the lr (as a DeepSpeed scheduler section does under the
    # Trainer's DeepSpeed integration) and the Trainer's own scheduler is not built; the run's
    # length is its total when the config leaves it open
    schedule = _get(mapping, "scheduler.type")
    if schedule not in (_MISSING, "none") and max_steps and _get(mapping, "scheduler.total_num_steps") in (_MISSING, None):
        _set(mapping, "scheduler.total_num_steps", int(max_steps))
    for key, (value, _origin) in wanted.items():
        _set(mapping, key, list(value) if key == "optimizer.betas" else value)
    # the Trainer owns the window (its loss normalisation, a short last window of an epoch): the
    # engine accumulates every backward until the Trainer's optimizer.step()
    mapping["gradient_accumulation_steps"] = 1
    gradient_precision = _get(mapping, "optimizer.gradient_precision")
    if args.gradient_accumulation_steps > 1 and (gradient_precision is _MISSING or str(gradient_precision).lower() == "auto"):
        # the engine's window is 1, yet gradients are added into across the Trainer's micro-batches:
        # what `auto` means then (state_layout.gradient_bytes_for) is an fp32 gradient
        _set(mapping, "optimizer.gradient_precision", "fp32")
    config = load_config(mapping)
    if optim in PAGED_ADAMW_OPTIMS and report:
        logger.info(
            "offload: TrainingArguments.optim=%r runs as the engine's AdamW; its state is paged by the engine's placement "
            "(offload.optimizer %s), not by bitsandbytes",
            optim,
            config.offload.optimizer,
        )
    if optim in ADAMW_8BIT_OPTIMS and report:
        logger.info(
            "offload: TrainingArguments.optim=%r -> optimizer.state_precision int8: the engine's AdamW keeps the Adam "
            "moments in int8 (blockwise, rounded stochastically; docs/compact_state.md), the master weights in fp32",
            optim,
        )
    if config.overlap == "backward" and args.gradient_accumulation_steps > 1:
        written = sources.get("overlap", "overlap")  # a DeepSpeed super_offload: true asks for it too
        raise ConfigError(
            f"{'overlap' if written == 'overlap' else repr(written) + ' (overlap'} 'backward'{'' if written == 'overlap' else ')'} "
            "steps each unit during the backward that ends the engine's window, but the Trainer accumulates "
            f"{args.gradient_accumulation_steps} micro-batches per step: use overlap 'forward' (exact, the default"
            f"{'' if written == 'overlap' else ': remove ' + repr(written)}) or gradient_accumulation_steps 1",
            key=written,
        )
    return config


def _contradiction(source: str, lines: list[str], advice: str) -> ConfigError:
    """One error listing every value of `source` that contradicts the TrainingArguments."""
    return ConfigError(
        f"{source} contradicts the TrainingArguments in {len(lines)} value(s), which the Trainer drives under "
        "OffloadTrainer:\n" + "\n".join(f"  - {line}" for line in lines) + f"\n{advice}",
        key=lines[0].split("=", 1)[0],
    )
