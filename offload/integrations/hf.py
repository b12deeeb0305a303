"""The Hugging Face `Trainer` on the offload engine: `OffloadTrainer`.

(Over 600 lines because the Trainer's hooks it overrides (optimizer, scheduler, model wrapping,
training step, checkpoint save and resume, model save) only make sense read together against
one transformers version's training loop.)

One change turns a Trainer script into an offloaded one::

    from offload.integrations.hf import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=training_args, train_dataset=ds,
                             offload_config="examples/configs/7b_on_24gb.json")  # was: Trainer(...)

Why a `Trainer` subclass (and not a `TrainingArguments` field): transformers' own DeepSpeed and
FSDP integrations are branches inside `Trainer` keyed on `TrainingArguments(deepspeed=...,
fsdp=...)` and on accelerate's plugins; a third party cannot add such a branch without patching
transformers. What transformers documents for that is subclassing: `create_optimizer`,
`training_step`, `save_model` and the checkpoint hooks are the methods its docs say to
override, and they are exactly where its DeepSpeed branch differs from the plain path. So:

- `create_optimizer` builds the engine (transformers' usual no-decay split as parameter groups;
  lr, betas, eps, weight decay, clipping and precision from `TrainingArguments`) and returns
  `engine.optimizer`; the Trainer's own `create_scheduler` attaches its schedule to it.
- `_wrap_model` hands the Trainer a thin module whose forward is the engine's, so accelerate
  neither moves the model nor wraps it in DDP (the engine shards and reduces across ranks).
- `training_step` runs the Trainer's loss and the engine's backward; the Trainer keeps its
  gradient accumulation (its loss normalisation, its window, a short last window) and calls
  `optimizer.step()` once per window; clipping is the engine's, on the global norm.
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler` write and read the engine's
  checkpoint inside the Trainer's `checkpoint-N/` (`offload_engine/`), beside the scheduler,
  RNG and trainer state the Trainer writes as usual; `save_model` writes the fp32 weights with
  `engine.save_pretrained` (streamed, unit by unit), so `from_pretrained` loads them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

try:
    from transformers import Trainer, TrainerCallback
except ImportError as error:  # pragma: no cover - transformers is in the test extras
    raise ImportError("offload.integrations.hf needs transformers and accelerate: pip install transformers accelerate") from error

import offload
from offload.errors import ConfigError, OffloadError
from offload.integrations.pretrained import check_from_pretrained_fits
from offload.integrations.trainer_config import _scheduler_name, split_offload_config, trainer_config

if TYPE_CHECKING:
    from offload.engine import Engine

logger = logging.getLogger(__name__)

ENGINE_CHECKPOINT_DIR = "offload_engine"
"""The engine's checkpoint, inside each of the Trainer's `checkpoint-N/` directories."""
SCHEDULER_NAME = "scheduler.pt"


# ---- what the Trainer sees as the model --------------------------------------------------------
class OffloadedModel(nn.Module):
    """The model as the Trainer drives it: `forward` is the engine's (`engine(**inputs)`), so
    accelerate neither moves it nor wraps it in DDP. `module` is the Hugging Face model."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.module = engine.model
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is no nn.Module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        # the Trainer's label smoother picks causal-LM shifting by the model's class name
        return self.module._get_name()


class ConfigScheduleView:
    """What the Trainer holds as its `lr_scheduler` when the config's `scheduler` section (offload's,
    or a DeepSpeed WarmupLR / WarmupDecayLR / WarmupCosineLR / OneCycle) drives the learning rate:
    the engine sets every group's lr from its step count, so `step()` has nothing to do, and a
    checkpoint needs nothing beyond the engine's (its step count). `get_last_lr()` is the lr the
    last step used, as a torch scheduler's is when the Trainer logs it."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.last_lr = [float(group["lr"]) for group in optimizer.param_groups]

    def before_step(self) -> None:
        self.last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.last_lr)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class _SkipAwareScheduler:
    """The Trainer's scheduler, not stepped after an optimizer step the engine skipped (an fp16
    overflow), as the Trainer itself does when accelerate's GradScaler skips one: the schedule
    counts the steps that updated the weights. Everything else is the scheduler's own."""

    def __init__(self, scheduler, trainer: OffloadTrainer) -> None:
        self.scheduler = scheduler
        self.trainer = trainer
        self.seen_skipped = self._skipped()

    def _skipped(self) -> int:
        engine = self.trainer.offload_engine
        return 0 if engine is None else engine.skipped_steps

    def step(self, *args, **kwargs):
        skipped = self._skipped()
        if skipped != self.seen_skipped:
            self.seen_skipped = skipped
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str):
        if name in ("scheduler", "trainer", "seen_skipped"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class _GradNormAfterStep(TrainerCallback):
    """Fills the Trainer's logged gradient norm once the engine has computed it: the engine
    computes the global norm inside its step, after the Trainer asked for it. Also notes the lr a
    step uses when the config's schedule drives it (ConfigScheduleView)."""

    def __init__(self, trainer: OffloadTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if isinstance(self.trainer.lr_scheduler, ConfigScheduleView):
            self.trainer.lr_scheduler.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        engine = self.trainer.offload_engine
        norm = None if engine is None else engine.last_grad_norm
        self.trainer._grad_norm.fill_(float("nan") if norm is None else norm)

    def on_train_end(self, args, state, control, **kwargs):
        # train() returns with the last step applied: `trainer.model` read from any thread (or
        # copied out without torch calls) is final. Reads between steps wait per unit
        # (offload/runtime/param_reads.py), so on_step_end keeps the step overlapped.
        if self.trainer.offload_engine is not None:
            self.trainer.offload_engine.window.drain()


# ---- the Trainer ---------------------------------------------------------------------------------
class OffloadTrainer(Trainer):
    """`transformers.Trainer` on the offload engine. Takes every argument `Trainer` takes, plus
    `offload_config` (what `offload.initialize` takes: an offload config dict / JSON path /
    `offload.Config`, a DeepSpeed JSON or dict, or an accelerate YAML). TrainingArguments drive
    precision (bf16 / fp16 / neither: fp32), AdamW's lr, betas, eps and weight decay (no decay on
    biases and norms), clipping (max_grad_norm), accumulation and the schedule.

    The engine is built by the first `train()` (`trainer.offload_engine`) and stays open for
    `evaluate`, `save_model` and more training; `trainer.end()` closes it (the model then holds
    the final fp32 weights on the CPU).

    `offload_weights`: pretrained weights the engine streams into its tiers (what
    `offload.initialize(weights=)` takes: a .safetensors file or a model directory), for a `model`
    built on the meta device, never whole in RAM (docs/pretrained.md); `offload_weights_strict`
    as `initialize`'s `weights_strict`. A TRL trainer given a model directory by name, which it
    would load with from_pretrained, is refused when that would not fit in RAM, naming this route."""

    def __init__(self, *args, offload_config=None, offload_weights=None, offload_weights_strict=True, **kwargs) -> None:
        self.offload_config = offload_config
        self.offload_weights, self.offload_weights_strict = offload_weights, offload_weights_strict
        named = kwargs.get("model", args[0] if args else None)
        if isinstance(named, str):  # TRL loads it with from_pretrained in its __init__
            init_kwargs = getattr(kwargs.get("args", args[1] if len(args) > 1 else None), "model_init_kwargs", None) or {}
            check_from_pretrained_fits(named, init_kwargs.get("dtype", "float32"))
        self.offload_engine: Engine | None = None
        self._offloaded_model: OffloadedModel | None = None
        super().__init__(*args, **kwargs)
        self._check_supported()
        self._grad_norm = torch.zeros((), dtype=torch.float64)
        self.add_callback(_GradNormAfterStep(self))

    def train(self, *args, **kwargs):
        """`Trainer.train`; with `model_init` (a hyperparameter search's trials), each call builds a
        fresh model and so a fresh engine: the previous trial's engine is closed first (its swap
        files removed), as the plain Trainer drops the previous trial's optimizer."""
        if self.model_init is not None and self.offload_engine is not None:
            logger.info("offload: model_init builds a new model for this run: closing the previous run's engine")
            self._close_engine()
        return super().train(*args, **kwargs)

    def _check_supported(self) -> None:
        args = self.args
        if self.is_deepspeed_enabled or getattr(args, "deepspeed", None):
            raise ConfigError(
                "OffloadTrainer replaces the DeepSpeed integration: remove TrainingArguments(deepspeed=...) "
                "and pass that DeepSpeed config as OffloadTrainer(offload_config=...), which translates it"
            )
        if self.is_fsdp_enabled or getattr(args, "fsdp", None):
            raise ConfigError("OffloadTrainer shards and offloads the model itself: remove TrainingArguments(fsdp=...)")
        if self.optimizer is not None or self.lr_scheduler is not None or self.optimizer_cls_and_kwargs is not None:
            raise ConfigError(
                "OffloadTrainer builds its own optimizer (engine.optimizer, AdamW on the CPU) and the "
                "Trainer's scheduler on it: don't pass optimizers= or optimizer_cls_and_kwargs=; set "
                "learning_rate, weight_decay, adam_* and lr_scheduler_type in TrainingArguments"
            )
        if args.n_gpu > 1:
            raise ConfigError(
                f"OffloadTrainer runs one GPU per process ({args.n_gpu} visible, which the Trainer would "
                "drive with DataParallel): launch with torchrun --nproc-per-node N, or set CUDA_VISIBLE_DEVICES"
            )
        if getattr(args, "torch_compile", False):
            raise ConfigError(
                "OffloadTrainer does not torch.compile the model (offload's hooks run per unit): "
                "set TrainingArguments(torch_compile=False)"
            )
        # fails here rather than at train(): a contradiction between offload_config and the arguments
        known_steps = args.max_steps if args.max_steps > 0 else None
        self._engine_config = trainer_config(args, self.offload_config, max_steps=known_steps)

    # -- construction: the engine is the optimizer, the offloaded model is the wrapped model --
    def create_accelerator_and_postprocess(self) -> None:
        _release_accelerator_precision()
        super().create_accelerator_and_postprocess()

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        # the engine computes in the precision TrainingArguments ask for and scales the fp16 loss
        # itself; accelerate's autocast or GradScaler on top would do it twice
        accelerator_args["mixed_precision"] = "no"
        # nothing for accelerate to place: the engine places the model and its optimizer state (no
        # state_dict round trip of engine.optimizer at prepare), and the Trainer moves each batch
        # to args.device itself (_prepare_inputs)
        accelerator_args["device_placement"] = False
        return accelerator_args

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # the engine places every unit itself: moving the whole model to the GPU first is what
        # offloading exists to avoid
        return None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.offload_engine is None:
            self.offload_engine = self._build_engine()
            self._offloaded_model = OffloadedModel(self.offload_engine)
        self.optimizer = self.offload_engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler (lr_scheduler_type, warmup) on `engine.optimizer`; or, when the
        config has a `scheduler` section, a view of the engine's own schedule."""
        if self.lr_scheduler is None and self._schedule_in_config():
            kind = _scheduler_name(self.args)
            logger.log(
                logging.WARNING if kind != "linear" else logging.INFO,
                "offload: the config's scheduler section (type %r) drives the learning rate; "
                "TrainingArguments.lr_scheduler_type %r and warmup_steps are not used (except to fill its "
                '"auto" values)',
                self._engine_config.scheduler.type,
                kind,
            )
            # transformers annotates lr_scheduler as its optimizers= argument (LambdaLR); the Trainer only
            # calls step / get_last_lr / state_dict / load_state_dict on it, which this view has
            self.lr_scheduler = ConfigScheduleView(optimizer if optimizer is not None else self.optimizer)  # type: ignore[assignment]
            self._created_lr_scheduler = True
            return self.lr_scheduler
        scheduler: torch.optim.lr_scheduler.LRScheduler | _SkipAwareScheduler
        scheduler = super().create_scheduler(num_training_steps, optimizer=optimizer)
        if self._created_lr_scheduler and not isinstance(
            scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, _SkipAwareScheduler)
        ):
            # a stand-in for the Trainer's scheduler (see ConfigScheduleView above for the annotation)
            scheduler = self.lr_scheduler = _SkipAwareScheduler(scheduler, self)  # type: ignore[assignment]
        return scheduler

    def _schedule_in_config(self) -> bool:
        return self._engine_config.scheduler.type != "none"

    def _build_engine(self) -> Engine:
        model = self.model
        assert model is not None  # the Trainer has its model by now (model=, or model_init at train())
        # read again from the arguments as they are now (a hyperparameter search's trial sets them
        # after __init__), with the run's length, known now, for a config schedule's "auto" / missing
        # step counts (the config was read and reported once already, in _check_supported)
        config = self._engine_config = trainer_config(
            self.args, self.offload_config, max_steps=self.state.max_steps, report=False
        )
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [
            {"params": [name for name, _ in trainable if name in decay], "weight_decay": float(self.args.weight_decay)},
            {"params": [name for name, _ in trainable if name not in decay], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
        logger.info(
            "offload: OffloadTrainer builds the engine: precision %s, %d parameter group(s) (%s with weight "
            "decay %g, %s without), clipping %g, the Trainer accumulating %d micro-batch(es) per step",
            config.precision,
            len(groups),
            len(groups[0]["params"]) if groups else 0,
            self.args.weight_decay,
            len(groups[-1]["params"]) if len(groups) > 1 else 0,
            config.gradient_clipping,
            self.args.gradient_accumulation_steps,
        )
        return offload.initialize(
            model, config, param_groups=groups, device=self.args.device, weights=self.offload_weights,
            weights_strict=self.offload_weights_strict,
        )  # fmt: skip

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        # training and evaluation both run through the engine; an evaluate() before train()
        # builds it (the model never sits on the device whole)
        if self._offloaded_model is None:
            self.create_optimizer()
        assert self._offloaded_model is not None  # create_optimizer built it with the engine
        return self._offloaded_model

    # -- one micro-batch: the Trainer's loss, the engine's backward --------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        engine = self.offload_engine
        if engine is None:
            raise OffloadError("OffloadTrainer.training_step ran before the engine was built; call trainer.train()")
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        assert isinstance(loss, torch.Tensor)  # return_outputs=False: the loss alone, not (loss, outputs)
        del inputs
        # as Trainer.training_step: a loss the model (or compute_loss_func) normalised over the
        # whole accumulated batch is used as is, a per-batch mean is divided by the window
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
                getattr(self, "compute_loss_func", None) is not None
            )
        if not scaled_for_ga:
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        engine.backward(loss)  # the engine's window is 1: no further division
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module):
        # the engine clips (gradient_clipping = max_grad_norm) on the global norm inside its step;
        # the value logged is filled once it is known (_GradNormAfterStep)
        return self._grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return self._grad_norm

    # -- checkpoints: the engine's inside the Trainer's --------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.offload_engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        assert self.optimizer is not None  # engine.optimizer, set with the engine (create_optimizer); end() clears both
        client_state = {"param_groups": [_group_hyper(group) for group in self.optimizer.param_groups]}
        path = os.path.join(output_dir, ENGINE_CHECKPOINT_DIR)
        # the Trainer writes checkpoint-N/ again when a run resumed before step N saves it anew;
        # the engine never overwrites a checkpoint in place: a new tag, and the old one goes
        # once the new one is complete
        tag, count = f"global_step{self.offload_engine.global_steps}", 0
        while os.path.exists(os.path.join(path, tag if count == 0 else f"{tag}-{count}")):
            count += 1
        tag = tag if count == 0 else f"{tag}-{count}"
        self.offload_engine.save_checkpoint(path, client_state=client_state, tag=tag, keep_last=1)
        if self.args.should_save:
            assert self.lr_scheduler is not None  # the Trainer saves checkpoints while training, after create_scheduler
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # the weights come back with the engine's checkpoint (_load_optimizer_and_scheduler): the fp32
        # master weights, exactly, not the model file written beside them
        _engine_checkpoint(resume_from_checkpoint)
        logger.info(
            "offload: resuming from %s: weights, optimizer state and counters from its %s/",
            resume_from_checkpoint,
            ENGINE_CHECKPOINT_DIR,
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        # the Trainer calls this inside train(), after create_optimizer_and_scheduler built the engine
        # (resuming) or at its end (the best model); end() has not closed the engine yet
        assert self.offload_engine is not None
        # the Trainer restores the RNG states itself (after skipping the batches already seen)
        client_state = self.offload_engine.load_checkpoint(_engine_checkpoint(checkpoint), load_rng=False) or {}
        saved = client_state.get("param_groups")
        if saved is not None and not self._schedule_in_config():  # else the engine set them from its step
            assert self.optimizer is not None  # engine.optimizer, set with the engine
            if len(saved) != len(self.optimizer.param_groups):
                raise OffloadError(
                    f"checkpoint {checkpoint!r} has {len(saved)} parameter groups, this run "
                    f"{len(self.optimizer.param_groups)}: was weight_decay changed from or to 0?"
                )
            for group, hyper in zip(self.optimizer.param_groups, saved):
                group.update({key: tuple(value) if isinstance(value, list) else value for key, value in hyper.items()})
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            assert self.lr_scheduler is not None  # created with the optimizer, before this
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        else:
            logger.warning(
                "offload: %s has no %s: the learning-rate schedule starts from the beginning", checkpoint, SCHEDULER_NAME
            )

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("offload: loading the best model from %s (score %s)", best, self.state.best_metric)
        self._load_optimizer_and_scheduler(best)

    # -- the trained model out -----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes the trained model where `from_pretrained(output_dir)` loads it: the fp32 weights
        with `engine.save_pretrained` (transformers' layout, config.json saying float32, streamed
        unit by unit), then the tokenizer and the training arguments as the Trainer's own save
        does. A PEFT model's adapter goes through PEFT's save, given only the weights PEFT picks
        (`_adapter_state_dict`). Every rank must call it."""
        if self.offload_engine is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.offload_engine
        if getattr(engine.model, "peft_config", None):
            # adapter_model.safetensors and adapter_config.json (no config.json); a collective: every rank
            state_dict = _adapter_state_dict(engine)
            if state_dict is None:
                logger.info("offload: PEFT's choice of weights could not be made from their names: reading them all")
                state_dict = engine.consolidated_state_dict()
            self._save(output_dir, state_dict=state_dict)  # save_pretrained empties state_dict as it writes
        else:
            assert output_dir is not None  # TrainingArguments' output_dir has a default
            engine.save_pretrained(output_dir)  # a collective: every rank; rank 0 writes
            if self.args.should_save:
                self._save_beside_weights(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _save_beside_weights(self, output_dir: str) -> None:
        """What `Trainer._save` writes after the model: the tokenizer (or processor) and the
        training arguments."""
        from transformers.trainer import TRAINING_ARGS_NAME

        collator_tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif collator_tokenizer is not None:
            collator_tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def end(self) -> None:
        """Closes the engine (the model keeps the final fp32 weights, on the CPU), then what
        `Trainer.end` does."""
        self._close_engine()
        super().end()

    def _close_engine(self) -> None:
        if self.offload_engine is not None:
            self.offload_engine.close()
            self._offloaded_model = None
            self.offload_engine = None
            self.optimizer = None


def _release_accelerator_precision() -> None:
    """A Trainer built before in this process (a plain one with bf16=True, in a notebook) left
    accelerate's process-wide AcceleratorState at its mixed precision, which accelerate refuses to
    change; OffloadTrainer runs accelerate with mixed_precision 'no' (the engine computes in the
    precision the arguments ask for). The state is reset as the Trainer's own hyperparameter
    search resets it between trials; the process group (PartialState) stays."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", "no") != "no":
        logger.info(
            "offload: accelerate's state was set up by an earlier Trainer with mixed precision %r: reset for "
            "OffloadTrainer (the engine computes in the TrainingArguments' precision itself)",
            state.get("_mixed_precision"),
        )
        AcceleratorState._reset_state()


def _adapter_state_dict(engine: Engine) -> dict[str, torch.Tensor] | None:
    """The entries PEFT's save picks out of a state dict (every adapter's weights), read alone:
    PEFT picks among stand-ins (meta tensors of each entry's shape), and only what it picked is
    read from the engine, one unit's weights at a time, never the frozen base in fp32. None when
    PEFT's choice cannot be made so (it picked something not given, or picks otherwise from the
    entries it picked): the caller reads them all. The same reads on every rank (a collective)."""
    import warnings

    from peft.utils import get_peft_model_state_dict

    model = engine.model
    adapters = list(getattr(model, "peft_config", {}))
    entries = model.state_dict(keep_vars=True)
    stand_ins = {
        key: torch.empty(value.shape, dtype=value.dtype, device="meta")
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    }
    key_of = {id(tensor): key for key, tensor in stand_ins.items()}

    def picked(state: dict) -> dict:
        chosen: dict = {}
        with warnings.catch_warnings():  # PEFT's notes are for the real save, which follows
            warnings.simplefilter("ignore")
            for adapter in adapters:
                chosen.update({f"{adapter}/{k}": v for k, v in get_peft_model_state_dict(model, state, adapter).items()})
        return chosen

    chosen = picked(stand_ins)
    keys = {key_of.get(id(value)) for value in chosen.values()}
    if None in keys or picked({key: stand_ins[key] for key in stand_ins if key in keys}).keys() != chosen.keys():
        return None
    return {
        key: engine.weights.param_weight(value) if isinstance(value, nn.Parameter) else value.detach().cpu()
        for key, value in entries.items()
        if key in keys
    }


def _group_hyper(group: dict) -> dict:
    """A parameter group's hyper-parameters (what a scheduler may have changed), without its params."""
    return {
        key: (list(value) if isinstance(value, tuple) else value)
        for key, value in group.items()
        if key != "params" and isinstance(value, (int, float, bool, str, tuple, list, type(None)))
    }


def _engine_checkpoint(checkpoint: str) -> str:
    if not os.path.isdir(checkpoint):
        raise OffloadError(
            f"resume_from_checkpoint {checkpoint!r} does not exist{' (it is a file)' if os.path.exists(checkpoint) else ''}: "
            "pass a checkpoint-N directory OffloadTrainer saved (resume_from_checkpoint=True takes the last one "
            "in output_dir)"
        )
    path = os.path.join(checkpoint, ENGINE_CHECKPOINT_DIR)
    if not os.path.isdir(path):
        raise OffloadError(
            f"{checkpoint!r} has no offload engine checkpoint ({ENGINE_CHECKPOINT_DIR}/): it was not saved by "
            "OffloadTrainer (or with save_only_model=True). To start from its weights, load the model with "
            "from_pretrained on that directory and train without resume_from_checkpoint"
        )
    return path


__all__ = [
    "ENGINE_CHECKPOINT_DIR",
    "ConfigScheduleView",
    "OffloadTrainer",
    "OffloadedModel",
    "split_offload_config",
    "trainer_config",
]
