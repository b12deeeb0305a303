"""The consolidated weights out as a Hugging Face model directory, streamed: from an engine
(`save_pretrained`, behind `engine.save_pretrained`) and from a checkpoint (`export`, behind
`offload export`). Which tensors go under which keys, and where each one's values come from;
the files themselves are offload.checkpoint.shard_writer's.

Keys. The model's `state_dict` keys (persistent buffers included), in its order. A Hugging Face
model's tied weights are stored once, as transformers' `save_pretrained` stores them: of the
keys that hold one tensor, those matching the model's `_tied_weights_keys` (every submodule's,
as regular expressions) are dropped while another key of the tensor remains, and
`_keys_to_ignore_on_save` are left out; `from_pretrained` ties them again. Another model keeps
every key (each its own copy), so that `model.load_state_dict(safetensors.torch.load_file(...))`
loads it strictly. A checkpoint does not record the model's tied keys: a Hugging Face one keeps
the first key of each tied parameter in state_dict order (the embedding, registered before the
head in transformers' models). Weights transformers converts on load (MoE experts, fused since
transformers 5) are written under the model's own keys, not converted back: from_pretrained
takes those as they are (a test saves a Mixtral).

Values. Parameters in `dtype` (fp32 by default, the fp32 master weights; bf16 or fp16 cast from
them), floating-point buffers likewise, other buffers as they are. config.json says `dtype`.

From an engine: after the steps in flight settle (as `consolidated_state_dict`), unit by unit:
`WeightsReader.full_weights(unit)` gathers the unit's fp32 weights from every rank (every rank
calls it, in unit order), rank 0 writes that unit's tensors to their places, and the unit's
buffer goes before the next is read. Peak memory beyond the engine's: one unit's fp32 weights and
one tensor cast to `dtype`. Ranks agree after each unit whether rank 0's writes succeeded, so a
full disk on rank 0 stops every rank at once with its error. From a checkpoint: one tensor at a
time, each read (and checked) by `CheckpointReader`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from offload.checkpoint.files import CheckpointError
from offload.checkpoint.format import CheckpointReader
from offload.checkpoint.shard_writer import (
    CONFIG,
    GENERATION_CONFIG,
    ShardSetWriter,
    TensorSpec,
    config_json,
    plan_shards,
    shard_size,
)
from offload.config.sizes import format_bytes
from offload.errors import ConfigError, OffloadError
from offload.model.unit_state import UnitState
from offload.platform.collectives import Collectives

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = "5GB"
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
PROGRESS_SECONDS = 10.0  # an INFO line at most this often while a save runs


class _Weights(Protocol):
    settle: Callable[[], None]

    def full_weights(self, unit: UnitState) -> torch.Tensor: ...


class WeightsSource(Protocol):
    """What a save reaches of an engine (offload.runtime.build.Runtime is one)."""

    model: nn.Module
    units: list[UnitState]
    collectives: Collectives

    @property
    def weights(self) -> _Weights: ...


# ---- plain functions (tested directly) -----------------------------------------------------
def weights_dtype(value: object) -> torch.dtype:
    """The `dtype` argument: None (fp32), a torch dtype or its name ("bf16", "bfloat16", ...)."""
    if value is None:
        return torch.float32
    dtype = DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(
            f"dtype {value!r} is not one the weights can be saved in: use None or torch.float32 (the fp32 master "
            "weights), torch.bfloat16 or torch.float16 (or 'fp32', 'bf16', 'fp16')",
            key="dtype",
        )
    assert isinstance(dtype, torch.dtype)
    return dtype


def tied_keys_to_drop(groups: list[list[str]], patterns: list[str]) -> set[str]:
    """Of each group of keys that hold one tensor, the keys transformers' `save_pretrained` drops:
    in sorted order, those matching a tied-weights pattern (re.search), while a key remains."""
    dropped: set[str] = set()
    for names in groups:
        found = 0
        for name in sorted(names):
            if any(re.search(pattern, name) for pattern in patterns):
                found += 1
                if found < len(names):
                    dropped.add(name)
    return dropped


def first_of_each(keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Of a checkpoint's (key, "param:<name>" / "buffer") list, the first key of each parameter."""
    seen: set[str] = set()
    kept = []
    for key, what in keys:
        if what != "buffer":
            if what in seen:
                continue
            seen.add(what)
        kept.append((key, what))
    return kept


# ---- a model's keys ----------------------------------------------------------------------------
def tied_weight_patterns(model: nn.Module) -> list[str]:
    """Every submodule's `_tied_weights_keys` (a dict of target -> source since transformers 5, a
    list before), prefixed with the submodule's name, as transformers collects them."""
    patterns: list[str] = []
    for name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        patterns.extend(f"{name}.{key}" if name else key for key in tied)
    return patterns


def _hf_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "to_json_string", None)) else None


def saved_keys(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for each key the save writes, in state_dict order (see the module docstring)."""
    entries = list(model.state_dict(keep_vars=True).items())
    if _hf_config(model) is None:
        return entries
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    groups: dict[int, list[str]] = {}
    for key, tensor in entries:
        groups.setdefault(id(tensor), []).append(key)
    dropped = tied_keys_to_drop([names for names in groups.values() if len(names) > 1], tied_weight_patterns(model))
    return [(key, tensor) for key, tensor in entries if key not in dropped and key not in ignored]


def model_files(model: nn.Module, dtype: torch.dtype) -> dict[str, bytes]:
    """config.json (saying `dtype` and the model's class) and generation_config.json, for a
    Hugging Face model; nothing for another."""
    config = _hf_config(model)
    if config is None:
        return {}
    files = {CONFIG: config_json(config.to_json_string().encode(), dtype, type(model).__name__)}
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        files[GENERATION_CONFIG] = generation.to_json_string(use_diff=True).encode()
    return files


def _saved_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating-point tensors are saved in `dtype`, others (integer buffers) as they are."""
    return dtype if tensor.is_floating_point() else tensor.dtype


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(_saved_dtype(tensor, dtype))


class _Progress:
    """Counts a save's steps (units, or tensors); calls the caller's `progress(done, total)` after
    each, and logs an INFO line at most every PROGRESS_SECONDS (long saves show they move)."""

    def __init__(self, what: str, total: int, callback: Callable[[int, int], None] | None) -> None:
        self.what, self.total, self.callback = what, total, callback
        self.done = 0
        self.logged = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total)
        if time.monotonic() - self.logged > PROGRESS_SECONDS:
            self.logged = time.monotonic()
            logger.info("offload: %d of %d %s written", self.done, self.total, self.what)


# ---- from an engine --------------------------------------------------------------------------
def save_pretrained(
    engine: WeightsSource,
    out_dir,
    *,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Writes the engine's consolidated weights to `out_dir` as a Hugging Face model directory
    (see the module docstring); every rank calls it, rank 0 writes. Returns the path of the file
    `from_pretrained` opens (model.safetensors, or model.safetensors.index.json when sharded).
    `progress(units done, units)` is called after each unit."""
    limit, dtype = shard_size(max_shard_size), weights_dtype(dtype)
    model, collectives = engine.model, engine.collectives
    if getattr(model, "peft_config", None):
        raise OffloadError(
            f"engine.save_pretrained writes a whole model, and {type(model).__name__} carries PEFT adapters: save the "
            "adapter with model.save_pretrained(dir) (PEFT writes only the adapter's weights), or save the base model "
            "without adapters"
        )
    home = {id(param): (unit, index) for unit in engine.units for index, param in enumerate(unit.spec.params)}
    specs, buffers = [], {}
    per_unit: dict[int, list[tuple[str, int]]] = {}
    for key, tensor in saved_keys(model):
        if not isinstance(tensor, torch.Tensor):
            raise OffloadError(
                f"the model's state_dict holds {key!r}, a {type(tensor).__name__} (a module's extra state), which "
                "safetensors cannot store: save it yourself, or save the weights with engine.consolidated_state_dict()"
            )
        specs.append(TensorSpec(key, _saved_dtype(tensor, dtype), tuple(tensor.shape)))
        if id(tensor) in home:
            unit, index = home[id(tensor)]
            per_unit.setdefault(unit.index, []).append((key, index))
        else:
            buffers[key] = tensor
    plan = plan_shards(specs, limit)
    writer = None
    if collectives.rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        writer = ShardSetWriter(os.path.abspath(os.fspath(out_dir)), plan, model_files(model, dtype), parameters)
        logger.info(
            "offload: saving %s of weights (%s) to %s in %d files", format_bytes(plan.total_size), dtype, out_dir, len(plan.files)
        )
    try:
        _on_rank0(collectives, writer, lambda w: _open_with_buffers(w, buffers, dtype), "opening the save")
        engine.weights.settle()
        _stream_units(engine, writer, per_unit, dtype, progress)
        entry = collectives.broadcast_object(_on_rank0(collectives, writer, ShardSetWriter.commit, "the commit"))
    finally:
        if writer is not None:
            writer.abort()
    return entry


def _open_with_buffers(writer: ShardSetWriter, buffers: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    writer.open()
    for key, tensor in buffers.items():
        writer.write(key, _cast(tensor.detach().cpu(), dtype))


def _stream_units(engine: WeightsSource, writer, per_unit, dtype, progress) -> None:
    """Each unit's weights gathered (every rank) and written (rank 0), one unit at a time."""
    units = [unit for unit in engine.units if unit.index in per_unit]
    counter = _Progress("units", len(units), progress)
    for unit in units:
        full = engine.weights.full_weights(unit)

        def write(w: ShardSetWriter, unit=unit, full=full) -> None:
            for key, index in per_unit[unit.index]:
                param, offset = unit.spec.params[index], unit.layout.offsets[index]
                w.write(key, full[offset : offset + param.numel()].view(param.shape).to(dtype))

        _on_rank0(engine.collectives, writer, write, f"the weights of unit {unit.spec.name}")
        del full, write
        counter.advance()


def _on_rank0(collectives: Collectives, writer: ShardSetWriter | None, action, what: str):
    """Runs `action(writer)` on rank 0; every rank learns whether it failed, and then raises (rank
    0 its own error)."""
    error, result = None, None
    if writer is not None:
        try:
            result = action(writer)
        except Exception as e:  # noqa: BLE001  (any failure: the other ranks must hear of it)
            error = e
    failed = error is not None
    if collectives.is_distributed:
        failed = collectives.max_host(1.0 if failed else 0.0, what=f"whether rank 0 failed {what}") > 0
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"save_pretrained failed on rank 0 at {what} (its log says why); nothing was replaced")
    return result


# ---- from a checkpoint -----------------------------------------------------------------------
def export(
    checkpoint,
    out_dir,
    *,
    dtype: torch.dtype = torch.float32,
    tag: str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Writes a checkpoint's weights to `out_dir` in the layout `save_pretrained` writes (with
    config.json when the checkpoint recorded a Hugging Face config), one tensor at a time; needs
    neither the model nor a GPU. Returns the path of the file `from_pretrained` opens."""
    limit, dtype = shard_size(max_shard_size), weights_dtype(dtype)
    with CheckpointReader(checkpoint, tag) as reader:
        config = reader.hf_config()
        buffers = reader.buffers()
        params = reader.index["params"]
        keys = [(key, what) for key, what in reader.index["state_dict_keys"]]
        if config is not None:
            keys = first_of_each(keys)
        specs = []
        for key, what in keys:
            if what == "buffer":
                specs.append(TensorSpec(key, _saved_dtype(buffers[key], dtype), tuple(buffers[key].shape)))
            else:
                specs.append(TensorSpec(key, dtype, tuple(params[what.split(":", 1)[1]]["shape"])))
        plan = plan_shards(specs, limit)
        files = {CONFIG: config_json(config, dtype)} if config is not None else {}
        total = sum(info["numel"] for info in params.values())
        with ShardSetWriter(os.path.abspath(os.fspath(out_dir)), plan, files, total) as writer:
            read: tuple[str | None, torch.Tensor | None] = (None, None)
            counter = _Progress("tensors", len(keys), progress)
            for key, what in keys:
                if what == "buffer":
                    writer.write(key, _cast(buffers[key], dtype))
                else:
                    if read[0] != what:  # an alias of the parameter just read reuses it
                        read = (what, reader.read_param(what.split(":", 1)[1]).to(dtype))
                    assert read[1] is not None
                    writer.write(key, read[1])
                counter.advance()
            entry = writer.commit()
    logger.info("offload: exported %s (%s)", entry, dtype)
    return entry
