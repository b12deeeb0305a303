"""An accelerate training loop on the offload engine, with one change to the script.

```python
from offload.integrations.accelerate import OffloadAccelerator

accelerator = OffloadAccelerator(offload_config="offload.json")   # was: Accelerator()
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
for batch in loader:
    loss = model(**batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); scheduler.step(); optimizer.zero_grad()
accelerator.save_state("ckpt")    # and accelerator.load_state("ckpt") to resume
```

`prepare` builds the engine from the model, with the parameter groups of the optimizer the
script built (torch.optim.AdamW, or Adam: the engine's C++ Adam takes over their lr, betas, eps,
weight_decay; the torch optimizer's own step never runs and it allocates no state). What it
returns in place of each object:

- the model: `model(**batch)` is `engine(**batch)`; `model.parameters()` are the model's;
- the optimizer: accelerate's `AcceleratedOptimizer` whose `step()` is `engine.step()` (at
  accelerate's sync steps, as for any optimizer) and whose `param_groups` stay the script's
  optimizer's: a scheduler attached to it drives them, and the engine reads them before each
  backward and step. `step_was_skipped` is true when the engine applied no update (an fp16
  overflow, or the middle of the config's accumulation window), so accelerate's scheduler
  wrapper steps only with the weights;
- the scheduler and the data loaders: accelerate's own.

The engine computes in accelerate's precision (its `mixed_precision`: fp32 unless the script or
`accelerate launch` asks for bf16 or fp16), as the plain script would, unless the offload config
names a `precision`; the two named differently are refused (`engine_precision`).

Accumulation runs through accelerate: the config's `gradient_accumulation_steps` becomes
accelerate's (the script's `with accelerator.accumulate(model):` decides the sync steps, where it
clips and the engine steps; a backward outside it is refused then). `backward(loss)` divides by
it (as accelerate does) and calls `engine.backward`; `clip_grad_norm_` is `engine.clip_grad_norm_` (the global norm over
all units, tiers and ranks); `save_state` / `load_state` write and read the engine's
checkpoint (weights, moments, counters) beside accelerate's files (optimizer groups, scheduler,
RNG, data loader positions; a plain accelerate save_state is refused by load_state, saying how
to start from its weights); `save_model(model, dir)` writes the weights with
`engine.save_pretrained` (streamed, unit by unit), and `unwrap_model(model)` is the Hugging Face
model (its `state_dict` and `save_pretrained` give the fp32 weights while the engine is open, but
build them whole in RAM). Under
`accelerate launch` with several processes the engine shards its state over the ranks and
reduces the gradients itself (no DDP). `accelerator.end_training()` closes the engine.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

import offload
from offload.config.schema import load_config
from offload.engine import Engine
from offload.errors import ConfigError, OffloadError
from offload.integrations.trainer_config import keys_set

logger = logging.getLogger(__name__)

ENGINE_CHECKPOINT_DIR = "offload_engine"
# accelerate's mixed_precision against the engine's precision
_PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
# the hyperparameters the engine reads from each of the script optimizer's groups
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


class OffloadedModule(nn.Module):
    """The model as the script calls it: `forward` is the engine's, which fetches each unit's
    weights as it runs. `module` is the model itself."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.model
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is no nn.Module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)


class OffloadedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper over the script's optimizer (its groups, its state_dict),
    stepping the engine instead (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def sync_hyperparameters(self) -> None:
        """The script's groups (as its scheduler left them) become the engine's."""
        for theirs, mine in zip(self.optimizer.param_groups, self.engine.optimizer.param_groups):
            for key in _GROUP_KEYS:
                mine[key] = float(theirs[key]) if key != "betas" else tuple(float(b) for b in theirs[key])

    def step(self, closure=None):
        if closure is not None:
            raise OffloadError("optimizer.step(closure) on the offload engine: call the closure's forward and backward first")
        if self.gradient_state.sync_gradients:
            self.sync_hyperparameters()
            self._is_overflow = not self.engine.step()
            # what torch's LR schedulers look for to know the optimizer stepped before them
            self.optimizer._opt_called = True

    def zero_grad(self, set_to_none=None) -> None:
        """The engine's gradients are its own: each .grad goes back to None at step()."""


def _engine_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[str, list[dict]]:
    """The optimizer type and groups the engine takes from the script's optimizer; anything the
    engine cannot do as that optimizer would is refused, naming it."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ConfigError(
            f"OffloadAccelerator.prepare got a {type(optimizer).__name__}: the engine steps with its own Adam / AdamW "
            "(C++ on the CPU). Build torch.optim.AdamW (or Adam) over the model's parameters with the hyperparameters "
            "you want; the engine takes them over"
        )
    kind = "adamw" if isinstance(optimizer, torch.optim.AdamW) else "adam"
    groups = []
    listed: set[int] = set()
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(f"optimizer.param_groups[{index}] sets {flag}, which the engine's Adam does not have")
        groups.append({"params": list(group["params"]), **{key: group[key] for key in _GROUP_KEYS}})
        listed.update(id(p) for p in group["params"])
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
    if missing:
        raise ConfigError(
            f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''} require grad but are in no group of the optimizer: "
            "torch would not train them, the engine would. Freeze them (requires_grad_(False)) before prepare, or "
            "give them to the optimizer"
        )
    return kind, groups


def engine_precision(named: str | None, argument: str | None, environment: str | None) -> str:
    """The engine's precision under OffloadAccelerator: the offload config's `precision` where it
    names one (`named`), else accelerate's own, as accelerate resolves its mixed_precision: the
    accelerator's `argument`, else `environment` (ACCELERATE_MIXED_PRECISION, which `accelerate
    launch` always sets, to "no" unless its config or flag says otherwise), else "no": fp32, as
    the plain script trains. A mixed_precision the script passes, or a bf16 / fp16 the launcher
    sets, that differs from a named precision is refused; the launcher's "no" may be its default
    and gives way to the config."""
    asked = argument if argument is not None else environment
    theirs = "no" if asked is None else str(asked).lower()
    if theirs not in _PRECISION_OF:
        raise ConfigError(
            f"mixed_precision {asked!r}: the offload engine computes in bf16, fp16 or fp32 (accelerate's 'no'); "
            "choose one of those",
            key="precision",
        )
    if named is None:
        return _PRECISION_OF[theirs]
    if _PRECISION_OF[theirs] != named and (argument is not None or theirs != "no"):
        source = "the accelerator's argument" if argument is not None else "ACCELERATE_MIXED_PRECISION, from accelerate launch"
        raise ConfigError(
            f"mixed_precision {asked!r} ({source}) and the offload config's precision {named!r} differ: the engine "
            "computes in one precision. Drop the config's precision (the engine then follows accelerate's), or make "
            "the two equal",
            key="precision",
        )
    return named


class OffloadAccelerator(Accelerator):
    """`accelerate.Accelerator` whose `prepare` puts the model and optimizer on the offload
    engine (see the module docstring). `offload_config`: the engine's config (dict, path, or
    offload.Config); every other argument is accelerate's. The engine computes in accelerate's
    mixed_precision (the argument, or `accelerate launch`'s; fp32 for "no" or unset, as the plain
    script) unless the config names a `precision` (`engine_precision`); it scales the fp16 loss
    itself, so accelerate's autocast and GradScaler stay off. `offload_weights`,
    `offload_weights_strict`: pretrained weights `prepare` streams into the engine for a model
    built on the meta device (`offload.initialize`'s `weights`, `weights_strict`)."""

    def __init__(self, *args, offload_config=None, offload_weights=None, offload_weights_strict=True, **kwargs) -> None:
        self.offload_weights, self.offload_weights_strict = offload_weights, offload_weights_strict
        # a copy: prepare writes into it (the precision, the optimizer type, the accumulation moved to accelerate)
        self.offload_config = copy.deepcopy(load_config(offload_config))
        named = self.offload_config.precision if "precision" in keys_set(offload_config) else None
        self.offload_config.precision = engine_precision(
            named, kwargs.get("mixed_precision"), os.environ.get("ACCELERATE_MIXED_PRECISION")
        )
        logger.info(
            "offload: the engine computes in %s (%s)",
            self.offload_config.precision,
            "the offload config's precision" if named else "accelerate's mixed_precision; the offload config names none",
        )
        kwargs["mixed_precision"] = "no"
        # accumulation runs through accelerate (accumulate(), sync_gradients), so that a script's
        # clipping and stepping at its sync steps meet the end of the engine's window
        window = self.offload_config.gradient_accumulation_steps
        asked_steps = kwargs.get("gradient_accumulation_steps", 1)
        if window > 1:
            if asked_steps not in (1, window):
                raise ConfigError(
                    f"gradient_accumulation_steps {asked_steps} and the offload config's {window} differ: set one",
                    key="gradient_accumulation_steps",
                )
            kwargs["gradient_accumulation_steps"] = window
            self.offload_config.gradient_accumulation_steps = 1
            logger.info("offload: the config's gradient_accumulation_steps %d runs through accelerate's accumulate()", window)
        if kwargs.get("gradient_accumulation_steps", 1) > 1 and self.offload_config.optimizer.gradient_precision == "auto":
            # the engine's window is 1 while accelerate adds micro-batches into the gradient: fp32
            self.offload_config.optimizer.gradient_precision = "fp32"
        super().__init__(*args, **kwargs)
        self.engine: Engine | None = None
        self._offloaded_optimizer: OffloadedOptimizer | None = None
        self._syncs = 0  # accumulate() entries (accelerate's _do_sync)
        self._syncs_at_backward = 0

    # ---- prepare -----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        models = [arg for arg in args if isinstance(arg, nn.Module) and not isinstance(arg, OffloadedModule)]
        optimizers = [arg for arg in args if isinstance(arg, torch.optim.Optimizer) and not isinstance(arg, OffloadedOptimizer)]
        if len(models) > 1 or len(optimizers) > 1 or (self.engine is not None and (models or optimizers)):
            raise OffloadError("OffloadAccelerator.prepare takes one model and its optimizer, once")
        if models and not optimizers or optimizers and not models:
            raise OffloadError(
                "OffloadAccelerator.prepare needs the model and its optimizer in the same call (the engine is built "
                "from both): accelerator.prepare(model, optimizer, ...)"
            )
        replaced: dict[int, Any] = {}
        if models:
            model, optimizer = models[0], optimizers[0]
            self._build_engine(model, optimizer)
            assert self.engine is not None and self._offloaded_optimizer is not None
            replaced[id(model)] = OffloadedModule(self.engine)
            replaced[id(optimizer)] = self._offloaded_optimizer
        rest = [arg for arg in args if id(arg) not in replaced]
        done = super().prepare(*rest) if rest else ()
        prepared = iter(done if len(rest) != 1 else (done,))
        result = tuple(replaced[id(arg)] if id(arg) in replaced else next(prepared) for arg in args)
        return result[0] if len(result) == 1 else result

    def _build_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        kind, groups = _engine_groups(optimizer, model)
        config = self.offload_config
        if config.optimizer.type != kind:
            logger.info(
                "offload: the script's %s sets the engine's optimizer type (the config said %r)", kind, config.optimizer.type
            )
            config.optimizer.type = kind
        device = self.device if self.device.type == "cuda" else None
        self.engine = offload.initialize(
            model, config, param_groups=groups, device=device, weights=self.offload_weights,
            weights_strict=self.offload_weights_strict,
        )  # fmt: skip
        self._offloaded_optimizer = OffloadedOptimizer(optimizer, self.engine)
        self._optimizers.append(self._offloaded_optimizer)

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise OffloadError("OffloadAccelerator: call accelerator.prepare(model, optimizer, ...) first")
        return self.engine

    # ---- the loop ----------------------------------------------------------------------------
    def backward(self, loss, **kwargs) -> None:
        engine = self._require_engine()
        if kwargs:
            raise OffloadError(f"accelerator.backward({', '.join(kwargs)}=...) is not supported on the offload engine")
        assert self._offloaded_optimizer is not None
        if self.gradient_accumulation_steps > 1 and self._syncs == self._syncs_at_backward:
            raise OffloadError(
                f"gradient accumulation ({self.gradient_accumulation_steps} micro-batches) runs through accelerate: "
                "wrap each micro-batch in `with accelerator.accumulate(model):` (without it every micro-batch would "
                "step); nothing was run"
            )
        self._syncs_at_backward = self._syncs
        # a scheduler stepped since the last step: the steps taken during this backward use its values
        self._offloaded_optimizer.sync_hyperparameters()
        engine.backward(loss / self.gradient_accumulation_steps)

    def _do_sync(self):
        # accelerate's step counter inside accumulate() (an underscore method of accelerate 1.15)
        self._syncs += 1
        super()._do_sync()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine's global norm (all units, tiers, ranks), and the coming step clips by
        torch's factor; for only some of the parameters, torch's clip_grad_norm_ on their
        gradient handles (which the step refuses unless every gradient got the same factor)."""
        engine = self._require_engine()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        given = {id(p) for p in params}
        if all(id(p) in given for p in engine.model.parameters() if p.requires_grad):
            return engine.clip_grad_norm_(max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, OffloadedModule):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def save_model(self, model, save_directory, max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """`engine.save_pretrained`: the fp32 weights in accelerate's (and transformers') layout,
        plus config.json for a transformers model, streamed unit by unit where accelerate would
        build the whole state dict. Every process calls it; the main one writes."""
        engine = self._require_engine()
        if model is not engine.model and not (isinstance(model, OffloadedModule) and model.engine is engine):
            return super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        if not safe_serialization:
            raise OffloadError("OffloadAccelerator.save_model writes safetensors only: drop safe_serialization=False")
        engine.save_pretrained(save_directory, max_shard_size=max_shard_size)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's files (optimizer groups, schedulers, RNG, data loaders) and, in
        `offload_engine/` beside them, the engine's checkpoint. Every process calls it."""
        engine = self._require_engine()
        location = super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        root = os.path.join(location, ENGINE_CHECKPOINT_DIR)
        # as accelerate's files, the directory's state is replaced: a new tag (rank 0's choice),
        # and the older ones removed once it is written (keep_last=1; never before)
        tag = base = f"global_step{engine.global_steps}"
        number = 0
        while os.path.exists(os.path.join(root, tag)):
            number += 1
            tag = f"{base}-{number}"
        tag = engine.collectives.broadcast_object(tag, what="the checkpoint tag")
        engine.save_checkpoint(root, tag=tag, keep_last=1)
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        """What `save_state` wrote: the engine's checkpoint (any world size and placement), then
        accelerate's files. Every process calls it."""
        engine = self._require_engine()
        if input_dir is None:
            raise OffloadError("OffloadAccelerator.load_state needs the directory save_state wrote")
        if not os.path.isdir(os.path.join(input_dir, ENGINE_CHECKPOINT_DIR)):
            raise OffloadError(_not_offload_state(os.fspath(input_dir)))
        engine.load_checkpoint(os.path.join(input_dir, ENGINE_CHECKPOINT_DIR))
        super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)

    def end_training(self) -> None:
        super().end_training()
        if self.engine is not None:
            self.engine.close()


def _not_offload_state(input_dir: str) -> str:
    """load_state's error for a directory without the engine's checkpoint: none at all, or a
    plain accelerate save_state's (its model weights beside its optimizer, scheduler and RNG)."""
    if not os.path.isdir(input_dir):
        kind = " (it is a file)" if os.path.exists(input_dir) else ""
        return f"OffloadAccelerator.load_state: {input_dir!r} does not exist{kind}; pass the directory save_state wrote"
    weights = sorted(
        name
        for name in os.listdir(input_dir)
        if name.startswith(("model", "pytorch_model")) and name.endswith((".safetensors", ".bin"))
    )
    found = f" (its {', '.join(weights)}: a plain accelerate save_state's model weights)" if weights else ""
    return (
        f"OffloadAccelerator.load_state: {input_dir!r} has no offload engine checkpoint ({ENGINE_CHECKPOINT_DIR}/): "
        f"OffloadAccelerator.save_state did not write it{found}. Nothing was loaded. To start from its weights, load "
        "them into the model before accelerator.prepare (model.load_state_dict(safetensors.torch.load_file(path)) "
        "for a .safetensors file) and train without load_state; the optimizer moments and the scheduler of that "
        "run do not carry over"
    )
