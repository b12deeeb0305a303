"""TRL's trainers on the offload engine: `OffloadSFTTrainer`, `OffloadDPOTrainer` (with a PEFT
adapter), and `offload_trainer(cls)` for others.

One change turns a TRL SFT script into an offloaded one::

    from offload.integrations.trl import OffloadSFTTrainer
    trainer = OffloadSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                peft_config=LoraConfig(...),                 # optional
                                offload_config={"offload": {"param": "cpu", "optimizer": "cpu"}})
                                # was: SFTTrainer(...)

TRL's trainers are `transformers.Trainer` subclasses that change the data (tokenising, packing,
completion masks) and the loss (`compute_loss`); the optimizer, the backward, clipping,
accumulation, checkpoints and saving are the Trainer's, which is what `OffloadTrainer` replaces.
So the offloaded trainer is the mix-in `class OffloadSFTTrainer(OffloadTrainer, SFTTrainer)`:
TRL's data and loss, the engine's optimizer, backward, clipping (`max_grad_norm`, on the global
norm), checkpoints and `save_model`. With a PEFT `peft_config`, TRL wraps the model before the
engine is built, so the engine sees only the adapter's parameters as trainable and keeps
optimizer state for them alone (the frozen base weights stay as they are, bit for bit);
`save_model` writes the adapter (`adapter_model.safetensors`, `adapter_config.json`), which
`PeftModel.from_pretrained(base, out)` loads.

`offload_trainer(cls)` builds the same mix-in for another Trainer subclass (the order matters:
`OffloadTrainer` first, so that its optimizer, training step and saving are the ones that run).
"""

from __future__ import annotations

import functools
from typing import Any

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as error:  # pragma: no cover - trl is in the trl and test extras
    raise ImportError("offload.integrations.trl needs TRL: pip install 'offload[trl]'") from error

from transformers import Trainer

from offload.errors import ConfigError
from offload.integrations.hf import OffloadTrainer

_ENGINE_METHODS = ("training_step", "create_optimizer", "create_optimizer_and_scheduler", "_wrap_model", "save_model")
"""The Trainer methods OffloadTrainer overrides to run the engine."""


class _ActivationOffloadStep(OffloadTrainer):
    """TRL's SFT and DPO trainers override `training_step` only to enter their activation-offload
    context (`activation_offloading=True` in their config) around the Trainer's step:
    OffloadTrainer's step (the engine's backward) runs inside that context instead."""

    maybe_activation_offload_context: Any

    def training_step(self, *args, **kwargs):
        with self.maybe_activation_offload_context:
            return OffloadTrainer.training_step(self, *args, **kwargs)


class OffloadSFTTrainer(_ActivationOffloadStep, SFTTrainer):
    """`trl.SFTTrainer` on the offload engine: takes every argument `SFTTrainer` takes (an
    `SFTConfig`, `peft_config`, `processing_class`...), plus `offload_config` (as
    `OffloadTrainer`). `trainer.end()` closes the engine."""


class OffloadDPOTrainer(_ActivationOffloadStep, DPOTrainer):
    """`trl.DPOTrainer` on the offload engine, with a PEFT `peft_config` (the reference model is
    the base with the adapter disabled, run through the engine like the policy). Without one,
    DPOTrainer keeps a second whole model as the reference, which the engine does not offload:
    refused, as a model on the device whole is what offloading exists to avoid."""

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("peft_config") is None and not _is_peft_model(kwargs.get("model", args[0] if args else None)):
            raise ConfigError(
                "OffloadDPOTrainer needs a PEFT adapter (peft_config=LoraConfig(...), or a PeftModel): without one "
                "DPOTrainer keeps a whole second model as the reference, outside the engine; with one, the reference "
                "is the base with the adapter disabled, offloaded with the policy"
            )
        super().__init__(*args, **kwargs)


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is in the trl extra
        return False
    return isinstance(model, PeftModel)


@functools.cache
def offload_trainer(trainer_class: type) -> type:
    """`class Offload<Name>(OffloadTrainer, trainer_class)`: a Trainer subclass (TRL's or your own)
    on the offload engine. Its data, loss and evaluation are `trainer_class`'s; the optimizer,
    backward, clipping, checkpoints and saving are the engine's. A ConfigError where `trainer_class`
    overrides one of the methods OffloadTrainer runs the engine in (`training_step`,
    `create_optimizer`...): its override would be skipped."""
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, Trainer):
        raise TypeError(f"offload_trainer takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, OffloadTrainer):
        return trainer_class
    known = {SFTTrainer: OffloadSFTTrainer, DPOTrainer: OffloadDPOTrainer}
    if trainer_class in known:
        return known[trainer_class]
    replaced = [
        f"{klass.__name__}.{name}"
        for klass in trainer_class.__mro__[: trainer_class.__mro__.index(Trainer)]
        for name in _ENGINE_METHODS
        if name in vars(klass)
    ]
    if replaced:
        raise ConfigError(
            f"{trainer_class.__name__} overrides {', '.join(replaced)}, which the offloaded trainer replaces with the "
            "engine's (OffloadTrainer's), so its own would not run: subclass OffloadTrainer and port that override "
            "onto it (keep OffloadTrainer's engine.backward in training_step)"
        )
    return type(f"Offload{trainer_class.__name__}", (OffloadTrainer, trainer_class), {"__module__": trainer_class.__module__})


__all__ = ["OffloadDPOTrainer", "OffloadSFTTrainer", "offload_trainer"]
