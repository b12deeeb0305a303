"""Pretrained weights in: `initialize(model, config, weights=path)`, streamed unit by unit.

`open_pretrained` runs first, before the engine makes any buffer, swap file or thread: every
header of the files is read and checked (offload.storage.weight_files), the file's keys are
matched to the model's (offload.model.pretrained_keys), and each matched tensor's shape and
dtype are checked against the model's. Anything wrong is a `WeightsError` naming the file and
the key; missing keys (the model's own init fills them) are one warning listing them;
unexpected keys are an error, or with `weights_strict=False` one warning listing what is dropped.

Then construction (offload.runtime.build) asks, for each unit in turn, on its materialize
thread, for `unit_values(unit)`: this rank's shard of the unit's flat buffer in fp32 (the
master's start values), read from the files while the main thread places the previous unit on
its tiers. Only the bytes of this rank's shard are read (the byte ranges of the elements of
each parameter that fall in the shard, merged where they touch), and converted exactly
(bf16, fp16 and fp32 all widen to fp32 without rounding). Parameters the file does not hold
are materialised by the model's own init (offload.model.materialize, `params=` those only) or
keep the values they have; with several ranks, rank 0's values of those are broadcast
(`ShardValues.agree`, on the main thread), so that several ranks start from what one process
seeded as rank 0 starts from: each rank's shard of its own draw would mix draws within a tensor,
harmless for elementwise inits, wrong for one drawn per tensor (orthogonal). A
parameter the file fills keeps no storage of its own: it becomes a view of the unit's device
buffer when the unit is adopted.

Why each rank reads its own shard (and not rank 0 reading and broadcasting as for the model's
own init): the disk bytes are the same (the model once, split over the ranks), but nothing
crosses between ranks (a broadcast of fp32 unit values is 4 bytes per parameter per rank over
gloo, twice the bf16 file's size, and rank 0's single stream bounds it), and each rank holds
only its shard. With `param: none` every rank needs the whole unit on its device: the shards
are all-gathered there, as a fetch gathers them.

Module buffers the file holds (persistent buffers) are read once, whole, before the units
(`load_buffers`); the others are computed as the model computes them (materialize).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.config.schema import IOConfig
from offload.config.sizes import format_bytes
from offload.errors import WeightsError
from offload.model.materialize import has_meta_state, mapped_zeros, materialize_unit_params
from offload.model.pretrained_keys import KeyMatch, key_rules, match_keys
from offload.model.unit_state import UnitState
from offload.model.units import shard_pieces
from offload.platform.collectives import Collectives
from offload.storage.weight_files import PendingRead, Segment, StoredTensor, WeightFiles, open_weight_files

logger = logging.getLogger(__name__)

# fp32 holds every value of these exactly: a parameter's master is their widening
EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)
PROGRESS_EVERY_S = 10.0


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@dataclass
class LoadStats:
    """What one rank's load read: bytes, seconds the load waited for its reads (reads run ahead,
    beside the conversion and the placing: a load bound by its disk waits most of its time), and
    seconds from the check to the last unit placed."""

    bytes: int = 0
    read_seconds: float = 0.0
    seconds: float = 0.0


@dataclass
class ShardValues:
    """One unit's start values on this rank: `shard32`, its shard of the flat buffer in fp32;
    `initialised`, indices (in the unit's params) of the params the model's init filled."""

    shard32: torch.Tensor
    initialised: list[int] = field(default_factory=list)

    def agree(self, unit: UnitState, collectives: Collectives) -> None:
        """Main thread, several ranks: the params the model initialised take rank 0's values
        (each rank drew its own), broadcast, and this rank's shard of them is written again."""
        if not self.initialised or not collectives.is_distributed:
            return
        params = [unit.spec.params[i] for i in self.initialised]
        values = mapped_zeros(sum(p.numel() for p in params), torch.float32)
        at = 0
        for param in params:
            values[at : at + param.numel()].copy_(param.detach().reshape(-1))
            at += param.numel()
        collectives.broadcast_host(values, src=0, what=f"initialised weights of unit {unit.spec.name}")
        starts = {}
        at = 0
        for index, param in zip(self.initialised, params):
            starts[index] = at
            at += param.numel()
        start, end = unit.layout.shard_range(collectives.rank)
        for index, low, high, position in shard_pieces(unit.layout.offsets, unit.layout.numels, start, end):
            if index in starts:
                self.shard32[position : position + high - low].copy_(values[starts[index] + low : starts[index] + high])


@dataclass
class _UnitRead:
    """What one unit's shard takes from the files: each param's stored tensor (None: the file
    lacks it), those params' indices, the shard's pieces (units.shard_pieces), the pieces read
    and their segments."""

    stored: list[StoredTensor | None]
    initialised: list[int]
    pieces: list[tuple[int, int, int, int]]
    read: list[tuple[int, int, int, int]]
    segments: list[Segment]


class PretrainedWeights:
    """An open, checked `weights=` source matched to one model (see the module docstring)."""

    def __init__(self, files: WeightFiles, model: nn.Module, match: KeyMatch, io: IOConfig) -> None:
        self.files = files
        self.io = io
        self.match = match
        tensors, params = _model_tensors(model), _param_names(model)
        # id of each param or buffer the file fills -> its stored tensor
        self.source: dict[int, StoredTensor] = {id(tensors[name]): files.tensors[key] for name, key in match.sources.items()}
        self._buffers = [(name, files.tensors[key]) for name, key in match.sources.items() if name not in params]
        # reused from unit to unit (a fresh mapping per unit is a page fault per 4 KiB, again and
        # again), all filled and read by the materialize thread: two read buffers (the disk reads
        # unit i + 1 into one while unit i is converted from the other) and two shard buffers (one
        # filled while the main thread places the other: construction asks for unit i + 1's
        # values only after unit i is placed)
        self._raws: list[torch.Tensor | None] = [None, None]
        self._raw_turn = 0
        self._ahead: tuple[UnitState, PendingRead] | None = None
        self._shards: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.stats = LoadStats()
        self.started = time.perf_counter()
        self._logged = self.started

    def frozen_dtypes(self, model: nn.Module) -> dict[str, torch.dtype]:
        """The file's dtype of each frozen parameter it fills: what `close()` hands them back in."""
        return {
            name: self.source[id(param)].dtype
            for name, param in model.named_parameters(remove_duplicate=False)
            if not param.requires_grad and id(param) in self.source
        }

    def load_buffers(self, model: nn.Module) -> None:
        """The persistent buffers the file holds, read whole and set on their modules (in the
        buffer's dtype, on the CPU; construction moves them to the device with the others)."""
        if not self._buffers:
            return
        raw, offsets = self._read([Segment(tensor, 0, tensor.numel) for _, tensor in self._buffers])
        homes = _buffer_homes(model)
        for (name, stored), offset in zip(self._buffers, offsets):
            value = _as_dtype(raw, offset, stored).reshape(stored.shape).clone()
            for module, leaf in homes[name]:
                module._buffers[leaf] = value.to(_buffer_dtype(module, leaf, value.dtype))

    def unit_values(self, model: nn.Module, unit: UnitState, rank: int, upcoming: UnitState | None = None) -> ShardValues:
        """The materialize thread: this rank's shard of the unit's start values (module docstring).
        `upcoming`: the unit asked for next, whose reads start before this one's conversion, so
        the disk reads on while this thread converts and the main thread places."""
        plan = self._plan(unit, rank)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is not unit:
            ahead[1].wait()  # read ahead for another unit: its buffer is free once it landed
            ahead = None
        pending = ahead[1] if ahead is not None else self._submit(plan)
        spec = unit.spec
        if has_meta_state(model, spec, [spec.params[i] for i in plan.initialised]):
            materialize_unit_params(model, spec, [spec.params[i] for i in plan.initialised])
        waited = time.perf_counter()
        raw, offsets = pending.wait()
        self.stats.read_seconds += time.perf_counter() - waited
        if upcoming is not None:
            self._ahead = (upcoming, self._submit(self._plan(upcoming, rank)))
        shard32 = self._shard_buffer(unit.layout.shard_numel)
        with torch.no_grad():
            for (_, low, high, at), segment, offset in zip(plan.read, plan.segments, offsets):
                shard32[at : at + high - low].copy_(_as_dtype(raw, offset, segment.tensor, high - low))
            for i, low, high, at in plan.pieces:
                if plan.stored[i] is None:
                    shard32[at : at + high - low].copy_(spec.params[i].detach().reshape(-1)[low:high])
            covered = 0  # the padding between and after params is zero, as a fresh buffer's
            for _, low, high, at in sorted(plan.pieces, key=lambda piece: piece[3]):
                shard32[covered:at].zero_()
                covered = at + high - low
            shard32[covered:].zero_()
        self._progress(unit)
        return ShardValues(shard32, plan.initialised)

    def _plan(self, unit: UnitState, rank: int) -> _UnitRead:
        layout = unit.layout
        stored = [self.source.get(id(param)) for param in unit.spec.params]
        pieces = shard_pieces(layout.offsets, layout.numels, *layout.shard_range(rank))
        read = [(i, low, high, at) for i, low, high, at in pieces if stored[i] is not None]
        segments = []
        for i, low, high, _ in read:
            tensor = stored[i]
            assert tensor is not None  # `read` keeps the pieces of params the file fills
            segments.append(Segment(tensor, low, high))
        return _UnitRead(stored, [i for i, tensor in enumerate(stored) if tensor is None], pieces, read, segments)

    def _submit(self, plan: _UnitRead) -> PendingRead:
        """Starts the plan's reads into the read buffer whose turn it is (two: one being read
        ahead while the other is converted)."""
        io = self.io
        pending = self.files.read_segments(plan.segments, io.block_size, io.queue_depth, io.threads, self._raws[self._raw_turn])
        self._raws[self._raw_turn] = pending.buffer
        self._raw_turn = 1 - self._raw_turn
        self.stats.bytes += sum(s.file_range[1] - s.file_range[0] for s in plan.segments)
        return pending

    def _shard_buffer(self, numel: int) -> torch.Tensor:
        buffer = self._shards[self._turn]
        if buffer is None or buffer.numel() < numel:
            buffer = self._shards[self._turn] = mapped_zeros(numel, torch.float32)
        self._turn = 1 - self._turn
        return buffer[:numel]

    def _read(self, segments: list[Segment]) -> tuple[torch.Tensor, list[int]]:
        """Reads `segments` at once (the buffers, before the units)."""
        io = self.io
        started = time.perf_counter()
        raw, offsets = self.files.read_segments(segments, io.block_size, io.queue_depth, io.threads).wait()
        self.stats.read_seconds += time.perf_counter() - started
        self.stats.bytes += sum(s.file_range[1] - s.file_range[0] for s in segments)
        return raw, offsets

    def _progress(self, unit: UnitState) -> None:
        now = time.perf_counter()
        if now - self._logged >= PROGRESS_EVERY_S:
            self._logged = now
            logger.info(
                "offload: loading weights: unit %d (%s), %s read, %.2f GB/s",
                unit.index,
                unit.spec.name,
                format_bytes(self.stats.bytes),
                self.stats.bytes / max(now - self.started, 1e-9) / 1e9,
            )

    def close(self) -> LoadStats:
        """Closes the files; logs and returns what the load read, how fast."""
        self.stats.seconds = time.perf_counter() - self.started
        if self.files.files:
            logger.info(
                "offload: read %s of weights from %s in %.1f s (%.2f GB/s; %.1f s of it waiting for the disk) on this rank",
                format_bytes(self.stats.bytes),
                self.files.source,
                self.stats.seconds,
                self.stats.bytes / max(self.stats.seconds, 1e-9) / 1e9,
                self.stats.read_seconds,
            )
        self.files.close()
        return self.stats


def _as_dtype(raw: torch.Tensor, offset: int, tensor: StoredTensor, count: int | None = None) -> torch.Tensor:
    """`count` elements (default all) of `tensor`'s dtype at `offset` of the read buffer (copied
    to an aligned buffer first when the file placed them at an offset their size does not divide)."""
    count = tensor.numel if count is None else count
    chunk = raw[offset : offset + count * tensor.itemsize]
    if offset % tensor.itemsize:
        chunk = chunk.clone()
    return chunk.view(tensor.dtype)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update((name, b) for name, b in model.named_buffers(remove_duplicate=False) if b is not None)
    return tensors


def _param_names(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters(remove_duplicate=False)}


def _buffer_homes(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each buffer's (module, attribute) places, under the first name of its tensor (a buffer
    registered in two modules is one tensor: both places get the loaded value)."""
    first: dict[int, str] = {}
    homes: dict[str, list[tuple[nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, buffer in module._buffers.items():
            if buffer is None:
                continue
            name = first.setdefault(id(buffer), f"{prefix}.{leaf}" if prefix else leaf)
            homes.setdefault(name, []).append((module, leaf))
    return homes


def _buffer_dtype(module: nn.Module, leaf: str, fallback: torch.dtype) -> torch.dtype:
    buffer = module._buffers.get(leaf)
    return buffer.dtype if buffer is not None else fallback


def open_pretrained(weights: str | os.PathLike, model: nn.Module, *, strict: bool, io: IOConfig) -> PretrainedWeights:
    """Opens and checks `weights` against `model` (module docstring); changes nothing."""
    files = open_weight_files(weights)
    try:
        match = match_keys(files.tensors, key_rules(model))
        check_match(files, match, model, strict=strict)
        check_tensors(files, match, _model_tensors(model), _param_names(model))
        logger.info(
            "offload: weights from %s: %d tensors in %d file(s), %s; %d renamed (e.g. %s), %d skipped as transformers "
            "skips them, %d of the model's missing, %d adapter tensors (PEFT's init)",
            files.source,
            len(match.sources),
            len(files.files),
            format_bytes(files.nbytes),
            len(match.renamed),
            next((f"{k!r} -> {v!r}" for k, v in match.renamed.items()), "none"),
            len(match.skipped),
            len(match.missing),
            len(match.adapters),
        )
        return PretrainedWeights(files, model, match, io)
    except BaseException:
        files.close()
        raise


def check_match(files: WeightFiles, match: KeyMatch, model: nn.Module, *, strict: bool) -> None:
    """Converted keys and (with `strict`) unexpected keys are errors; the rest is logged once."""
    name = type(model).__name__
    if match.converted:
        key, converter = next(iter(match.converted.items()))
        raise WeightsError(
            f"weights file {files.tensors[key].file}, key {key!r}: transformers loads {len(match.converted)} key(s) of this "
            f"checkpoint into {name} through its converter {converter} (tensors merged or split: {_listed(list(match.converted))}), "
            "which weights= does not stream; load the model once with from_pretrained and save_pretrained it in "
            "the layout the model class has"
        )
    if match.unexpected:
        key = match.unexpected[0]
        if strict:
            raise WeightsError(
                f"weights file {files.tensors[key].file}, key {key!r}: fills nothing in {name} ({len(match.unexpected)} "
                f"such key(s): {_listed(match.unexpected)}); was the checkpoint saved from another model class or "
                "config? Pass weights_strict=False to drop them with a warning"
            )
        logger.warning(
            "offload: %d key(s) of %s fill nothing in %s and are dropped (weights_strict=False): %s",
            len(match.unexpected),
            files.source,
            name,
            _listed(match.unexpected, 20),
        )
    if match.missing:
        logger.warning(
            "offload: %d tensor(s) of %s are not in %s and take the model's own init (newly initialised, as "
            "from_pretrained does): %s",
            len(match.missing),
            name,
            files.source,
            _listed(match.missing, 20),
        )


def check_tensors(files: WeightFiles, match: KeyMatch, tensors: dict[str, torch.Tensor], params: set[str]) -> None:
    """Each matched stored tensor has the shape of the model's tensor, and a dtype that converts:
    a parameter's exactly to fp32 (F32, BF16, F16), a buffer's of the same kind (float, integer,
    bool)."""
    for name, key in match.sources.items():
        stored, target = files.tensors[key], tensors[name]
        where = f"weights file {stored.file}, key {key!r}"
        if tuple(stored.shape) != tuple(target.shape):
            raise WeightsError(
                f"{where}: shape {list(stored.shape)}, but {name!r} of the model is {list(target.shape)}: a checkpoint of "
                "another size or config? Build the model from the config.json saved with these weights"
            )
        if name in params and stored.dtype not in EXACT_IN_FP32:
            raise WeightsError(
                f"{where}: dtype {stored.dtype_name}, which the fp32 master cannot hold exactly (parameters load from "
                "F32, BF16 or F16; a quantized checkpoint needs its own loader): convert the file, e.g. "
                "from_pretrained(dtype=torch.float32) then save_pretrained"
            )
        if name not in params and _kind(stored.dtype) != _kind(target.dtype):
            raise WeightsError(
                f"{where}: dtype {stored.dtype_name}, but the model's buffer {name!r} is {target.dtype}: the file's "
                "tensor is not that buffer"
            )


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "integer"
