"""The first pass of a checkpoint load: the whole checkpoint read and checked, the engine untouched.

`load_checkpoint` is all-or-nothing. `verify` reads everything this rank will apply and checks
it before any byte of the engine's state changes: the index and rank files (the reader checks
their structure and checksums), every other field of the index the second pass reads, by type
(world size, placement, how the moments were stored), that the checkpoint fits this model
(every parameter, its shape and element count), each state kind's slices covering `[0, numel)`
of its parameter exactly once (a parameter saved trainable has all three kinds; moments come
both or neither), the Adam step counts (integers, at most the engine's step count, one per
unit), the engine's counters, hyperparameters and loss scale (their owners check them:
`CheckpointedEngine.check_training_state`), the model's buffers (every key, nothing extra, each
of the model's shape and kind), this rank's RNG state (set on scratch generators, never the
process's), `client_state` (plain data only), and every element this rank reads: its chunks'
checksums, and values in range (finite; the second moment not negative).

Without doubling memory: the tensor data is streamed through one chunk of 16 MiB
(`CheckpointReader.scan_range`) and forgotten; what the second pass applies is read again
(and checked again). So a load needs 16 MiB of RAM beyond the engine's and no disk, and reads
the checkpoint's state twice (the second time mostly from the page cache when RAM allows). The
small parts (buffers, counters, RNG, client_state) are kept from this pass to the next.

A checkpoint that passes here can fail in the second pass only if its files change under the
load (they are held open, so a rename or a replacement does not count; a write into them does)
or the disk fails a read; the engine then says so and refuses to train until a load succeeds.
An interrupt (Ctrl-C: KeyboardInterrupt, or SystemExit) leaves the engine as a failure would,
part loaded if it came in the second pass, and reaches the caller as itself.
"""

from __future__ import annotations

import base64
import math
import os
import random
from dataclasses import dataclass

import torch
from torch import nn

from offload.checkpoint.files import CheckpointCorruptError, CheckpointError
from offload.checkpoint.format import INDEX, KINDS, CheckpointReader
from offload.config.state_layout import StatePrecision
from offload.model.units import shard_pieces
from offload.optim import kernels

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_PRECISIONS = tuple(precision.value for precision in StatePrecision)


def model_names(model: nn.Module) -> tuple[dict[int, str], dict[str, list[str]], list[tuple[str, str]]]:
    """(id(param) -> canonical name, canonical -> every alias, [(state_dict key, "param:<canonical>"
    or "buffer")])."""
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(param), name)
        aliases.setdefault(first, []).append(name)
    keys = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys.append((key, f"param:{canonical[id(tensor)]}" if id(tensor) in canonical else "buffer"))
    return canonical, aliases, keys


def frozen_piece(unit, shard_pos: int) -> bool:
    """A piece of the shard past its optimizer state: a param that did not require grad at
    initialize, which has its (16-bit) weights and no master or moments (units.FlatLayout)."""
    return shard_pos >= unit.optimizer_numel


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class VerifiedCheckpoint:
    """What the first pass found good, for the second to apply: the open reader (its files held
    open between the passes), the model's names, each unit's Adam step count, and the small
    parts read whole."""

    reader: CheckpointReader
    canonical: dict[int, str]
    keys: list[tuple[str, str]]
    step_counts: list[int]
    training_state: dict
    buffers: dict[str, torch.Tensor]
    rng: dict | None
    client_state: dict


def verify(engine, reader: CheckpointReader, *, load_rng: bool) -> VerifiedCheckpoint:
    """Checks everything this rank will apply from `reader` (see the module docstring); raises a
    CheckpointError naming the file, the key and what is wrong. Changes nothing of the engine."""
    canonical, _, keys = model_names(engine.model)
    index_path = os.path.join(reader.directory, INDEX)
    state = reader.index.get("engine")
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"checkpoint file {index_path}: 'engine' is {_shown(state)}, not the engine's counters")
    try:
        engine.check_training_state(state)
    except ValueError as error:
        raise CheckpointCorruptError(f"checkpoint file {index_path}: engine.{error}") from None
    _check_index_fields(reader.index, index_path)
    _check_params(reader, engine, canonical, index_path)
    faults = reader.slice_faults()
    if faults:
        raise CheckpointCorruptError(
            f"checkpoint {reader.directory}: {'; '.join(faults[:3])}{' …' if len(faults) > 3 else ''} "
            "(a rank file was crafted or damaged); the checkpoint cannot be loaded"
        )
    _check_kinds(reader, engine, canonical)
    step_counts = [
        _unit_step_count(unit, reader.index["params"], canonical, state["global_steps"], index_path) for unit in engine.units
    ]
    buffers = _checked_buffers(reader, engine.model, keys)
    rng = None
    if load_rng:
        part = reader.parts[engine.collectives.rank % len(reader.parts)]
        rng = part.get("rng") if isinstance(part, dict) else None
        check_rng_state(rng, os.path.join(reader.directory, f"rank{engine.collectives.rank % len(reader.parts)}.json"))
    client_state = reader.client_state()
    _scan_values(reader, engine, canonical)
    return VerifiedCheckpoint(reader, canonical, keys, step_counts, state, buffers, rng, client_state)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_index_fields(index: dict, index_path: str) -> None:
    """The index's fields the apply pass reads that no other check covers (the reader checks the
    files, ranks and parameters; `_check_params` the parameters' step counts; the engine's owners
    its counters), each by type: the number of ranks that saved it, their placement, and how they
    stored the moments (absent from checkpoints older than compact state: fp32)."""
    world_size, ranks = index.get("world_size"), index["ranks"]
    if not (is_count(world_size) and world_size == len(ranks)):
        raise CheckpointCorruptError(
            f"checkpoint file {index_path}: world_size is {_shown(world_size)}, not the number of its rank files ({len(ranks)})"
        )
    placement = index.get("placement")
    if not (isinstance(placement, dict) and all(isinstance(placement.get(key), str) for key in ("param", "optimizer"))):
        raise CheckpointCorruptError(
            f"checkpoint file {index_path}: placement is {_shown(placement)}, not a dict with 'param' and 'optimizer' tiers"
        )
    precision = index.get("state_precision", StatePrecision.FP32.value)
    if precision not in STATE_PRECISIONS:
        raise CheckpointCorruptError(
            f"checkpoint file {index_path}: state_precision is {_shown(precision)}, not one of {list(STATE_PRECISIONS)}"
        )
    if not isinstance(index.get("int8_codes", ""), str):
        raise CheckpointCorruptError(
            f"checkpoint file {index_path}: int8_codes is {_shown(index['int8_codes'])}, not the name of int8 moment codes"
        )


def _check_params(reader: CheckpointReader, engine, canonical: dict[int, str], index_path: str) -> None:
    saved = reader.index["params"]
    mine = {canonical[id(p)]: p for unit in engine.units for p in unit.spec.params}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {reader.directory} does not fit this model: parameters missing from the checkpoint "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, parameters the model lacks {extra[:5]}"
            f"{'...' if len(extra) > 5 else ''}"
        )
    wrong = [
        f"{name}: checkpoint {saved[name]['shape']}, model {list(p.shape)}"
        for name, p in mine.items()
        if saved[name]["shape"] != list(p.shape)
    ]
    if wrong:
        raise CheckpointError(f"checkpoint {reader.directory} has other shapes than this model: {'; '.join(wrong[:5])}")
    for name, info in saved.items():
        if not is_count(info.get("step")):
            raise CheckpointCorruptError(
                f"checkpoint file {index_path}: params.{name}.step is {_shown(info.get('step'))}, not an Adam step count "
                "(a non-negative integer)"
            )
        if not isinstance(info.get("requires_grad"), bool):
            raise CheckpointCorruptError(
                f"checkpoint file {index_path}: params.{name}.requires_grad is {_shown(info.get('requires_grad'))}, not true or false"
            )


def _check_kinds(reader: CheckpointReader, engine, canonical: dict[int, str]) -> None:
    """Every parameter has its master; moments come both or neither, and a parameter saved
    trainable has them (one saved frozen has none: made trainable now, its moments start at
    zero, as a new parameter's)."""
    for unit in engine.units:
        for param in unit.spec.params:
            name = canonical[id(param)]
            has = {kind for kind in KINDS if (name, kind) in reader.stored}
            lacking = [kind for kind in KINDS if kind not in has]
            if "master" not in has or (len(has) == 2 or (reader.index["params"][name]["requires_grad"] and lacking)):
                raise CheckpointCorruptError(
                    f"checkpoint {reader.directory} holds no {', '.join(lacking)} of parameter {name!r}"
                    f"{', saved trainable' if reader.index['params'][name]['requires_grad'] else ''} (a rank file was "
                    "crafted or damaged); the checkpoint cannot be loaded"
                )


def _unit_step_count(unit, saved_params: dict, canonical: dict[int, str], global_steps: int, index_path: str) -> int:
    """The unit's Adam step count: its trainable parameters' (which must agree), or, for a unit
    with none, the largest of its parameters'; never more than the engine's steps."""
    trainable = {saved_params[canonical[id(p)]]["step"] for p in unit.spec.params if p.requires_grad}
    if len(trainable) > 1:
        raise CheckpointError(
            f"checkpoint file {index_path}: unit {unit.spec.name} mixes parameters saved with different Adam step counts {sorted(trainable)}: load "
            "with the wrap settings the checkpoint was saved with"
        )
    count = trainable.pop() if trainable else max((saved_params[canonical[id(p)]]["step"] for p in unit.spec.params), default=0)
    if count > global_steps:
        raise CheckpointCorruptError(
            f"checkpoint file {index_path}: unit {unit.spec.name}'s parameters were stepped {count} times, more than the engine's "
            f"{global_steps} optimizer steps (the index was crafted or damaged); the checkpoint cannot be loaded"
        )
    return count


def _checked_buffers(reader: CheckpointReader, model: nn.Module, keys: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    buffers = reader.buffers()
    where = os.path.join(reader.directory, "buffers.safetensors")
    state = model.state_dict(keep_vars=True)
    wanted = {key for key, what in keys if what == "buffer"}
    missing, extra = sorted(wanted - set(buffers)), sorted(set(buffers) - wanted)
    if missing or extra:
        raise CheckpointError(
            f"checkpoint file {where} does not fit this model: buffers missing {missing[:5]}, buffers the model lacks {extra[:5]}"
        )
    for key in sorted(wanted):
        saved, mine = buffers[key], state[key]
        same_kind = saved.dtype == mine.dtype or (saved.is_floating_point() and mine.is_floating_point())
        if saved.shape != mine.shape or not same_kind:
            raise CheckpointError(
                f"checkpoint file {where}: buffer {key!r} is {saved.dtype} {list(saved.shape)}, the model's is "
                f"{mine.dtype} {list(mine.shape)}"
            )
    return buffers


def check_rng_state(state, where: str) -> None:
    """`state` (what offload.checkpoint.format.rng_state saved) can be set: each generator's state
    is set on a scratch generator of its kind, never the process's."""

    def refuse(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint file {where}: its RNG state {what} (crafted or damaged); load with load_rng=False to keep "
            "this process's random state"
        )

    if not isinstance(state, dict) or not isinstance(state.get("torch"), str) or not isinstance(state.get("python"), list):
        raise refuse("is not a dict with 'torch' and 'python' entries")
    try:
        torch.Generator().set_state(
            torch.frombuffer(bytearray(base64.b64decode(state["torch"], validate=True)), dtype=torch.uint8)
        )
    except (ValueError, RuntimeError, TypeError):
        raise refuse("'torch' is not a torch generator state") from None
    python = state["python"]
    try:
        version, internal, gauss = python
        if not (isinstance(internal, list) and all(is_count(v) for v in internal)):
            raise TypeError
        if gauss is not None and not (isinstance(gauss, float) and math.isfinite(gauss)):
            raise TypeError
        random.Random().setstate((version, tuple(internal), gauss))
    except (ValueError, TypeError, OverflowError):
        raise refuse("'python' is not a state of Python's random module") from None
    if "numpy" in state:
        try:
            import numpy as np

            name, numpy_keys, pos, has_gauss, cached = state["numpy"]
            if not (isinstance(numpy_keys, list) and all(is_count(v) and v < 2**32 for v in numpy_keys)):
                raise TypeError
            np.random.RandomState().set_state((name, np.array(numpy_keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
        except (ValueError, TypeError, OverflowError):
            raise refuse("'numpy' is not a state of numpy's global generator") from None
    cuda = state.get("cuda", [])
    if not (isinstance(cuda, list) and all(isinstance(s, str) for s in cuda)):
        raise refuse("'cuda' is not a list of generator states")
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        size = torch.cuda.get_rng_state().numel()
        try:
            sizes = {len(base64.b64decode(s, validate=True)) for s in cuda}
        except ValueError:
            raise refuse("'cuda' holds text that is not base64") from None
        if sizes != {size}:
            raise refuse(f"'cuda' holds states of {sorted(sizes)} bytes, this torch's are {size}")


def reads_of_rank(engine, reader: CheckpointReader, canonical: dict[int, str]):
    """(unit, param name, kind, start, end): every range of saved state this rank's shards take."""
    rank = engine.collectives.rank
    for unit in engine.units:
        start, end = unit.layout.shard_range(rank)
        for index, a, b, pos in shard_pieces(unit.layout.offsets, unit.layout.numels, start, end):
            name = canonical[id(unit.spec.params[index])]
            kinds = ("master",) if frozen_piece(unit, pos) else [k for k in KINDS if (name, k) in reader.stored]
            for kind in kinds:
                yield unit, name, kind, a, b


def _scan_values(reader: CheckpointReader, engine, canonical: dict[int, str]) -> None:
    """Every element this rank will read: its chunk's checksum, and a value in range. The checks
    are single passes (the C++ kernels' finiteness scan; one minimum for the second moment);
    only a chunk that fails is searched for the element to name."""
    for _unit, name, kind, a, b in reads_of_rank(engine, reader, canonical):
        for low, _high, values in reader.scan_range(name, kind, a, b):
            if not values.numel():
                continue
            negative = kind == "exp_avg_sq" and bool(torch.amin(values) < 0)
            if kernels.has_nonfinite(values) or negative:
                bad = ~torch.isfinite(values) | (values < 0 if kind == "exp_avg_sq" else False)
                at = low + int(bad.nonzero()[0])
                raise CheckpointCorruptError(
                    f"checkpoint {reader.directory}: element {at} of {name!r} {kind} is {float(values[at - low])!r}"
                    f"{', and a second moment is never negative' if kind == 'exp_avg_sq' else ''} (crafted, or saved "
                    "from a run that had diverged); the checkpoint cannot be loaded"
                )
