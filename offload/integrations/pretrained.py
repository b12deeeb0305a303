"""Before `from_pretrained` loads a model that will not fit in RAM: say what to do instead.

transformers' `from_pretrained` holds the whole model in RAM (4 bytes per parameter in fp32; a
70B model is 280 GB) before offload ever sees it, and then the process is killed, with no
message. Where offload is the one that would call it (TRL's trainers given a model name or
directory: `OffloadSFTTrainer(model="path")`), `check_from_pretrained_fits` first counts the
model's bytes from its safetensors headers (a local directory; a few KB read) and, when they
exceed the RAM available, refuses with the route that streams the weights instead: the model
built on the meta device and `offload_weights=` (docs/pretrained.md).
"""

from __future__ import annotations

import logging
import os

import torch

from offload.config.sizes import format_bytes
from offload.errors import ConfigError, OffloadError
from offload.storage.weight_files import open_weight_files

logger = logging.getLogger(__name__)

# RAM that from_pretrained's process needs beyond the weights (Python, torch, the tokenizer, the
# dataset): a model within this share of the available RAM is left to load
RAM_SHARE = 0.8


def loaded_bytes(stored: dict[str, tuple[int, int]], dtype: torch.dtype | str | None) -> int:
    """Bytes `from_pretrained(dtype=dtype)` holds for tensors given as key -> (elements, bytes
    in the file): `dtype` "auto" (or None) keeps each file dtype."""
    if dtype in (None, "auto"):
        return sum(nbytes for _, nbytes in stored.values())
    size = (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize
    return sum(count * size for count, _ in stored.values())


def too_big_message(model_id: str, needed: int, available: int) -> str | None:
    """What to do instead, when `needed` bytes exceed RAM_SHARE of `available` (else None)."""
    if needed <= RAM_SHARE * available:
        return None
    return (
        f"from_pretrained({model_id!r}) would hold the whole model in RAM ({format_bytes(needed)}), and "
        f"{format_bytes(available)} is available: it would be killed for lack of memory. Build the model on the meta "
        "device and let the engine stream the weights into its tiers:\n"
        "    with torch.device('meta'):\n"
        f"        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({model_id!r}))\n"
        f"    trainer = OffloadSFTTrainer(model=model, ..., offload_weights={model_id!r})\n"
        "(offload.initialize(model, config, weights=...) in your own loop; docs/pretrained.md)"
    )


def available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_from_pretrained_fits(model_id: str, dtype: torch.dtype | str | None) -> None:
    """A ConfigError naming the streamed route when the local model directory `model_id` would
    not fit in RAM through `from_pretrained(dtype=dtype)`; nothing when it fits or cannot be
    counted (a hub name not on disk: its size is unknown here)."""
    if not os.path.isdir(model_id):
        return
    try:
        with open_weight_files(model_id) as files:
            stored = {key: (t.numel, t.nbytes) for key, t in files.tensors.items()}
    except OffloadError as error:  # the load itself will say what is wrong with the files
        logger.debug("offload: %s not counted before from_pretrained: %s", model_id, error)
        return
    message = too_big_message(model_id, loaded_bytes(stored, dtype), available_ram())
    if message is not None:
        raise ConfigError(message)
