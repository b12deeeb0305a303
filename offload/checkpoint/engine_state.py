"""Checkpoints of an engine: save / resume on any world size and placement.

The file format (directory layout, atomic writes, verified reads) is
offload.checkpoint.format; this module is the engine's side: which slices of which parameters
each rank writes from wherever its optimizer state lives (host buffers, or NVMe swap files
streamed through the slots), and how a rank reads the ranges of its new shard back into any
placement, world size or wrap. The names of the format that callers use are re-exported here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from offload.checkpoint.files import (  # noqa: F401 (re-exported: the format's public names)
    CheckpointCorruptError,
    CheckpointError,
    created_file,
    exchange_paths,
    fsync_dir,
    lock_held,
    open_dir,
    pwrite_all,
    read_small,
    remove_stale,
    save_error,
    write_all,
    write_replacing,
    write_small,
)
from offload.checkpoint.format import (  # noqa: F401 (re-exported: the format's public names)
    BUFFERS,
    CHUNK_ELEMENTS,
    CLIENT_STATE,
    DATA_ALIGN,
    FORMAT,
    FORMAT_VERSION,
    GENERATION,
    HF_CONFIG,
    INDEX,
    KINDS,
    LATEST,
    MAX_INDEX_BYTES,
    CheckpointReader,
    Slice,
    check_tag,
    checkpoints_to_remove,
    chunk_bounds,
    is_format_file,
    json_with_checksum,
    list_checkpoints,
    resolve,
    rng_state,
    rotate,
    safetensors_header,
    set_rng_state,
    tensor_bytes,
)
from offload.checkpoint.pretrained_out import export, save_pretrained  # noqa: F401 (re-exported: the engine's one import)
from offload.checkpoint.root import Latest, generations, index_generation, latest_of
from offload.checkpoint.verify import VerifiedCheckpoint, frozen_piece, model_names, verify
from offload.config.schema import Config
from offload.config.sizes import format_bytes
from offload.config.state_layout import INT8_CODES, INT8_CODES_BEFORE
from offload.errors import InsufficientSpaceError, OffloadError
from offload.model.unit_state import UnitState
from offload.model.units import shard_pieces
from offload.optim.moment_limits import SaturationReport
from offload.platform.collectives import Collectives
from offload.storage.aio import crc32c
from offload.storage.state_codec import RoundingTally
from offload.storage.tiers import TierStore

logger = logging.getLogger(__name__)


class CheckpointedEngine(Protocol):
    """What a checkpoint saves and loads of an engine, and all it reaches: the engine's parts
    (offload.runtime.build.Runtime is one) named here, not its attributes at large."""

    model: nn.Module
    config: Config
    units: list[UnitState]
    store: TierStore
    collectives: Collectives

    @property
    def global_steps(self) -> int: ...

    def training_state(self) -> dict: ...

    def load_training_state(self, state: dict) -> None: ...

    def check_training_state(self, state: dict) -> None:
        """Raises ValueError naming the key and what is wrong when `state` (as `training_state()`
        gives it, from a file) could not be loaded exactly; changes nothing."""
        ...

    def before_load(self) -> None:
        """A checkpoint passed its checks and is about to be applied: work in flight is settled."""
        ...

    def after_load(self) -> None:
        """A checkpoint was applied whole."""
        ...

    def load_failed(self, reason: str) -> None:
        """A checkpoint was applied in part: the engine refuses to train until a load succeeds."""
        ...

    def param16_shard(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's 16-bit shard of `unit`, wherever its home is."""
        ...

    def drop_device_copies(self) -> None:
        """Between steps: no unit keeps, or is fetching, a device copy of its weights."""
        ...

    def replace_device_weights(self, unit: UnitState, shard32: torch.Tensor) -> None:
        """Param tier none: this rank's shard of the device weights takes `shard32`."""
        ...


# ---- saving ----------------------------------------------------------------------------------
def _rank_slices(engine: CheckpointedEngine, rank: int, canonical: dict[int, str]) -> list[Slice]:
    slices = []
    for unit in engine.units:
        start, end = unit.layout.shard_range(rank)
        for index, a, b, pos in shard_pieces(unit.layout.offsets, unit.layout.numels, start, end):
            name = canonical[id(unit.spec.params[index])]
            # a frozen param's weights are saved as its "master" (from the 16-bit weights), no moments
            for kind in ("master",) if frozen_piece(unit, pos) else KINDS:
                slices.append(Slice(f"{name}/{kind}", name, kind, a, b, pos, unit.index))
    return slices


def _write_rank_file(engine: CheckpointedEngine, directory: str, rank: int, canonical, progress) -> dict:
    """Writes rank<r>.safetensors (streamed unit by unit) and returns rank<r>.json's content."""
    slices = _rank_slices(engine, rank, canonical)
    entries = [(s.key, "F32", [s.end - s.start], 4 * (s.end - s.start)) for s in slices]
    prefix, offsets = safetensors_header(entries, {"format": FORMAT, "rank": str(rank)}, align=DATA_ALIGN)
    total = len(prefix) + sum(e[3] for e in entries)
    name = f"rank{rank}.safetensors"
    path = os.path.join(directory, name)
    free = shutil.disk_usage(directory).free
    if total > free:
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"checkpoint needs {format_bytes(total)} ({total} bytes) for {path} but only {free} bytes are free "
            f"({format_bytes(free)}); nothing was written and the previous checkpoint is untouched; free space or save elsewhere",
            path,
        )
    by_unit: dict[int, list[tuple[Slice, int]]] = {}
    for s, offset in zip(slices, offsets):
        by_unit.setdefault(s.unit, []).append((s, offset))
    writer = _SliceWriter(len(prefix), progress, total)
    with created_file(path, needed=total, advice="the previous checkpoint is untouched") as fd:
        write_all(fd, prefix, path)
        # pieces come in the slices' order (a unit's in increasing shard position), so a
        # slice's bytes, and their checksums, are produced in order
        # the moments as fp32 values whatever their stored precision (decoded chunk by chunk):
        # one format for every precision, and a compact state's values are exact fp32 numbers
        for piece in engine.store.fp32_states(engine.units):
            unit = piece.unit
            unit_slices = by_unit.get(unit.index, [])
            for s, offset in unit_slices:
                if frozen_piece(unit, s.shard_pos):
                    continue
                low = max(s.shard_pos, piece.start)
                high = min(s.shard_pos + s.end - s.start, piece.end)
                if low < high:
                    data = piece.views[s.kind][low - piece.start : high - piece.start]
                    writer.write(fd, path, s, offset, low - s.shard_pos, data)
            if piece.last and any(frozen_piece(unit, s.shard_pos) for s, _ in unit_slices):
                frozen = engine.param16_shard(unit).float()
                for s, offset in unit_slices:
                    if frozen_piece(unit, s.shard_pos):
                        writer.write(fd, path, s, offset, 0, frozen[s.shard_pos : s.shard_pos + s.end - s.start])
        records = [
            {
                "key": s.key,
                "param": s.param,
                "kind": s.kind,
                "start": s.start,
                "end": s.end,
                "offset": len(prefix) + offset,
                "crc32c": writer.checksums(s),
            }
            for s, offset in zip(slices, offsets)
        ]
    return {
        "rank": rank,
        "world_size": engine.collectives.world_size,
        "file": name,
        "file_bytes": total,
        "header_crc32c": crc32c(prefix),
        "header_bytes": len(prefix),
        "slices": records,
        "rng": rng_state(),
    }


class _SliceWriter:
    """Writes a rank file's slices as their pieces arrive, each at its place in the file, and
    keeps each slice's CRC-32C per CHUNK_ELEMENTS block (checkpoint_format.chunk_bounds): a
    unit's state streamed in pieces can end a piece inside a block."""

    def __init__(self, data_start: int, progress, total: int) -> None:
        self.data_start = data_start
        self.progress = progress
        self.total = total
        self.done = data_start
        # per slice key: (the finished blocks' checksums, the open block's checksum, its elements)
        self._crcs: dict[str, tuple[list[int], int, int]] = {}

    def write(self, fd: int, path: str, s: Slice, offset: int, at: int, data: torch.Tensor) -> None:
        """`data`: the slice's elements [at, at + len(data)), following what was written of it."""
        crcs, crc, filled = self._crcs.get(s.key, ([], 0, 0))
        if at != len(crcs) * CHUNK_ELEMENTS + filled:
            raise AssertionError(f"slice {s.key} written out of order")
        position = 0
        while position < data.numel():
            take = min(CHUNK_ELEMENTS - filled, data.numel() - position)
            block = data[position : position + take]
            pwrite_all(fd, tensor_bytes(block), self.data_start + offset + 4 * (at + position), path)
            crc = crc32c(block, crc)
            filled += take
            position += take
            if filled == CHUNK_ELEMENTS:
                crcs.append(crc)
                crc, filled = 0, 0
            self.done += 4 * take
            if self.progress is not None:
                self.progress(self.done, self.total)
        self._crcs[s.key] = (crcs, crc, filled)

    def checksums(self, s: Slice) -> list[int]:
        crcs, crc, filled = self._crcs.get(s.key, ([], 0, 0))
        if len(crcs) * CHUNK_ELEMENTS + filled != s.end - s.start:
            raise AssertionError(f"slice {s.key} was not written whole")
        return crcs + [crc] if filled else list(crcs)


def _shared_pid(engine: CheckpointedEngine) -> int:
    pid = os.getpid() if engine.collectives.rank == 0 else 0
    return round(engine.collectives.sum_host([float(pid)])[0])


def _agree_on_failure(engine: CheckpointedEngine, error: BaseException | None, cleanup: Callable[[], None]) -> None:
    """Every rank learns whether any rank failed; all of them raise, rank 0 cleans up."""
    failed = engine.collectives.max_host(1.0 if error is not None else 0.0) > 0
    if not failed:
        return
    if engine.collectives.rank == 0:
        cleanup()
    if error is not None:
        raise error
    raise CheckpointError("saving the checkpoint failed on another rank (see its log); the previous checkpoint is untouched")


def _hf_config(model) -> bytes | None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        try:
            return to_json().encode()
        except Exception as e:  # noqa: BLE001  (an exotic config: the checkpoint is still complete without it)
            logger.warning("offload: the model's config could not be saved (%s); export will not write config.json", e)
    return None


def save(
    engine: CheckpointedEngine,
    path,
    client_state: dict | None = None,
    *,
    tag: str | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Saves the engine's full training state as checkpoint `<path>/<tag>` and points
    `<path>/latest` at it; returns the checkpoint's directory.

    tag: defaults to `global_step<N>`; an existing tag is an error, raised before anything is
    written, unless `overwrite`, or unless that checkpoint was left by a save that did not
    complete (the commit rule, offload.checkpoint.format): then the new checkpoint is written
    beside the old one and takes its place in one atomic exchange (the old one stays whole until
    then); files in the old directory that the format never writes (a script's own) are carried
    over. The save is complete once `latest` names it; one that fails before then takes its
    directory back. keep_last: afterwards keep only the newest N checkpoints under `path`.
    progress(bytes_done, bytes_total): called as this rank's state file is written.
    client_state: any dict of tensors, numbers, strings, lists, tuples and dicts (returned by
    `load`); rank 0's is saved.
    """
    if any(unit.window_started for unit in engine.units):
        raise CheckpointError(
            "save_checkpoint in the middle of a gradient accumulation window: the accumulated "
            "gradients are not part of a checkpoint; save after engine.step() returned True"
        )
    rank = engine.collectives.rank
    root = os.path.abspath(os.fspath(path))
    tag = check_tag(tag or f"global_step{engine.global_steps}")
    final = os.path.join(root, tag)
    started = time.perf_counter()
    error: BaseException | None = None
    replacing, generation = False, 0  # rank 0's: whether `final` exists and is replaced; the index's generation
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            latest = latest_of(root)
            replacing = _replaces(final, tag, overwrite, latest)
            generation = latest.next_generation(() if latest.generation is not None else generations(root).values())
            remove_stale(root)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = save_error(e, root)
    _agree_on_failure(engine, error, lambda: None)
    pid = _shared_pid(engine)
    temp = os.path.join(root, f".tmp-{tag}-{pid}")
    lock_fd: int | None = None  # rank 0 holds the temp directory's lock for the whole save

    def cleanup() -> None:
        shutil.rmtree(temp, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)

    if rank == 0:
        try:
            os.mkdir(temp)  # the umask's permissions, as every file and directory of a checkpoint
            lock_fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            lock_held(lock_fd)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = save_error(e, root)
    _agree_on_failure(engine, error, cleanup)

    canonical, aliases, keys = model_names(engine.model)
    try:
        part = _write_rank_file(engine, temp, rank, canonical, progress)
        write_small(os.path.join(temp, f"rank{rank}.json"), json.dumps(part, sort_keys=True).encode())
        if rank == 0:
            files = _write_rank0_files(engine, temp, client_state, keys)
    except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
        error = save_error(e, root)
    _agree_on_failure(engine, error, cleanup)

    if rank == 0:
        assert lock_fd is not None  # rank 0 opened it above, or _agree_on_failure raised
        try:
            write_small(os.path.join(temp, INDEX), _index(engine, temp, tag, generation, files, canonical, aliases, keys))
            fsync_dir(temp)
            _commit(root, temp, final, tag, replacing, keep_last)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = save_error(e, root)
        finally:
            os.close(lock_fd)  # the directory is `final` now, or removed by cleanup below
            lock_fd = None
    _agree_on_failure(engine, error, cleanup)
    logger.info("offload: saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
    return final


def _write_rank0_files(engine: CheckpointedEngine, temp: str, client_state, keys) -> dict:
    from safetensors.torch import save as safetensors_save

    files = {}
    state = engine.model.state_dict(keep_vars=True)
    buffers = {key: state[key].detach().to("cpu").contiguous() for key, what in keys if what == "buffer"}
    files[BUFFERS] = write_small(os.path.join(temp, BUFFERS), safetensors_save(buffers, metadata={"format": "pt"}))
    if client_state is not None:
        if not isinstance(client_state, dict):
            raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
        import io

        buffer = io.BytesIO()
        try:  # fail now, not at resume, if it will not load without executing pickle code
            torch.save(client_state, buffer)
            data = buffer.getvalue()
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # noqa: BLE001  (pickling and weights_only refusals have many types)
            raise CheckpointError(
                "client_state holds objects that cannot be loaded safely (torch.load weights_only): keep it to "
                f"tensors, numbers, strings, lists, tuples and dicts ({e})"
            ) from None
        files[CLIENT_STATE] = write_small(os.path.join(temp, CLIENT_STATE), data)
    hf = _hf_config(engine.model)
    if hf is not None:
        files[HF_CONFIG] = write_small(os.path.join(temp, HF_CONFIG), hf)
    return files


def _replaces(final: str, tag: str, overwrite: bool, latest: Latest) -> bool:
    """Whether the save replaces an existing checkpoint directory at `final` (`overwrite`, or one
    left by a save that did not complete); False where there is none; else the refusal."""
    if not os.path.lexists(final):
        return False
    if os.path.isdir(final) and not os.path.islink(final):
        if overwrite:
            return True
        if latest.unfinished(tag, index_generation(final)):
            logger.warning(
                "offload: %s was left by a save that did not complete (%s names %s): this save replaces it",
                final,
                LATEST,
                latest.tag,
            )
            return True
    raise CheckpointError(
        f"checkpoint {final} already exists; nothing was written. Pass another tag, or overwrite=True to "
        "replace it (atomically: the old one stays whole until the new one is complete)"
    )


def _index(engine: CheckpointedEngine, temp: str, tag: str, generation: int, files: dict, canonical, aliases, keys) -> bytes:
    """index.json's content, once every rank's files are in `temp` (it lists their sizes and checksums)."""
    world = engine.collectives.world_size
    temp_fd = open_dir(temp)
    try:
        for r in range(world):
            name = f"rank{r}.json"
            data = read_small(temp_fd, temp, name, limit=MAX_INDEX_BYTES)
            files[name] = {"bytes": len(data), "crc32c": crc32c(data)}
    finally:
        os.close(temp_fd)
    params = {}
    for unit in engine.units:
        for param in unit.spec.params:
            name = canonical[id(param)]
            params[name] = {
                "shape": list(param.shape),
                "numel": param.numel(),
                "aliases": aliases[name],
                "step": unit.step_count,
                "requires_grad": bool(param.requires_grad),
            }
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        GENERATION: generation,
        "saved_at_ns": time.time_ns(),
        "world_size": world,
        "placement": {"param": engine.config.offload.param, "optimizer": engine.config.offload.optimizer},
        "precision": engine.config.precision,
        "optimizer": engine.config.optimizer.type,
        # how the engine stored the moments (the files hold their fp32 values in every precision)
        "state_precision": engine.store.codec.precision.value,
        "int8_codes": INT8_CODES,
        "engine": engine.training_state(),
        "params": params,
        "state_dict_keys": [[key, what] for key, what in keys],
        "ranks": [f"rank{r}.json" for r in range(world)],
        "files": files,
    }
    return json_with_checksum(index)


def _commit(root: str, temp: str, final: str, tag: str, replacing: bool, keep_last: int | None) -> None:
    """`temp` (complete: its files and itself fsynced) becomes checkpoint `final`, and `latest`
    names it: the commit (the format's commit rule). A failure before `latest` is replaced takes
    the new directory back (and puts a replaced one back); after it, only tidying is left, whose
    failure is a warning: the checkpoint is saved."""
    old = _swap_in(temp, final) if replacing else None
    try:
        if old is None:
            os.rename(temp, final)
        try:
            fsync_dir(root)
            write_replacing(os.path.join(root, LATEST), [(tag + "\n").encode()], hold_lock=True)
        except BaseException:
            _take_back(root, final, tag, old)
            raise
        try:
            fsync_dir(root)
            if old is not None:
                shutil.rmtree(old[0], ignore_errors=True)
            if keep_last:
                rotate(root, keep_last, tag)
        except OSError as error:
            logger.warning(
                "offload: saved checkpoint %s (%s names it), but tidying up after it failed: %s; a later save "
                "removes what is left",
                final,
                LATEST,
                error,
            )
    finally:
        if old is not None:
            os.close(old[1])


def _swap_in(new: str, old: str) -> tuple[str, int]:
    """`new` (a complete checkpoint directory) takes the place of the checkpoint `old`: the old
    one's files the format never writes are hard-linked into it first (the old one keeps them
    until it is removed, so a kill at any point loses none; moved where links fail), then the two
    directories are exchanged atomically (renameat2 RENAME_EXCHANGE; where the file system lacks
    it, two renames; the caller makes them durable). Returns where the old one is now, and a
    descriptor holding its lock (a concurrent save's sweep of dead saves' `.tmp-*` leaves it
    alone) until the caller closes it."""
    for entry in os.listdir(old):
        if not is_format_file(entry) and not os.path.lexists(os.path.join(new, entry)):
            _carry(os.path.join(old, entry), os.path.join(new, entry))
    fsync_dir(new)
    fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        lock_held(fd)
        aside = new
        if not exchange_paths(new, old):
            aside = f"{new}.old"
            os.rename(old, aside)
            try:
                os.rename(new, old)
            except BaseException:
                os.rename(aside, old)
                raise
    except BaseException:
        os.close(fd)
        raise
    return aside, fd


def _carry(source: str, target: str) -> None:
    """A file or directory of the user's, from a checkpoint being replaced into its replacement:
    hard links (a directory's tree of them), or a move where the file system refuses links."""
    try:
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True, copy_function=os.link)
        else:
            os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        os.rename(source, target)


def _take_back(root: str, final: str, tag: str, old: tuple[str, int] | None) -> None:
    """After a failure before the commit: the new checkpoint at `final` goes (and the one it
    replaced, at `old`, comes back), so that the failed save leaves the root as it found it. What
    cannot be undone is logged: a later save to this tag replaces what is left."""
    trash = os.path.join(root, f".trash-{tag}-{os.getpid()}")
    try:
        if old is None:
            os.rename(final, trash)
        elif exchange_paths(final, old[0]):
            trash = old[0]
        else:
            os.rename(final, trash)
            os.rename(old[0], final)
        fsync_dir(root)
    except OSError as error:
        logger.warning(
            "offload: the failed save of %s could not be taken back (%s); a later save to %r replaces it", final, error, tag
        )
        return
    shutil.rmtree(trash, ignore_errors=True)


def load(engine: CheckpointedEngine, path, *, tag: str | None = None, load_rng: bool = True) -> dict:
    """Restores weights, optimizer states, counters, loss scale and (with `load_rng`) RNG
    states from a checkpoint saved by any world size and placement; returns its client_state.

    All or nothing: the whole checkpoint is checked first (offload.checkpoint.verify), every
    rank agrees that its part passed, and only then does anything of the engine change. A
    checkpoint that fails leaves the engine bitwise as it was, on every rank, and the error
    names the file, the key and what is wrong (another rank's, with its rank)."""
    started = time.perf_counter()
    with contextlib.ExitStack() as opened:
        error: BaseException | None = None
        verified: VerifiedCheckpoint | None = None
        try:
            reader = opened.enter_context(CheckpointReader(path, tag))
            verified = verify(engine, reader, load_rng=load_rng)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = e
        _agree_on_verification(engine, error)
        assert verified is not None  # or _agree_on_verification raised
        checked = time.perf_counter()
        engine.before_load()
        try:
            _apply(engine, verified)
        except BaseException as e:  # noqa: BLE001  (the engine is part loaded: it must say so, and refuse to train)
            error = e
        failed = engine.collectives.ranks_with(error is not None, "whether the checkpoint was applied")
        if failed:
            if error is None:
                reason = f"on rank(s) {failed} (see their log)"
            elif isinstance(error, Exception):
                reason = (
                    f"load_checkpoint: {reader.directory} passed every check, but applying it failed on rank(s) {failed} "
                    f"({type(error).__name__}: {error})"
                )
            else:  # Ctrl-C or SystemExit: it reaches the caller as itself, the engine part loaded as after a failure
                reason = f"load_checkpoint: applying {reader.directory} was interrupted ({type(error).__name__})"
                engine.load_failed(f"{reason}; the engine's state is part loaded")
                raise error
            engine.load_failed(f"{reason}; the engine's state is part loaded")
            if error is not None:
                raise CheckpointError(
                    f"{reason}. The files changed under the load, or the disk failed a read; "
                    "load a checkpoint again before training"
                ) from error
            raise CheckpointError(
                f"load_checkpoint: applying the checkpoint failed {reason}; load a checkpoint again before training"
            )
        engine.after_load()
        logger.info(
            "offload: loaded checkpoint %s (saved by %d ranks, %s/%s) in %.2f s (checked in %.2f s, applied in %.2f s)",
            reader.directory,
            reader.index["world_size"],
            reader.index["placement"]["param"],
            reader.index["placement"]["optimizer"],
            time.perf_counter() - started,
            checked - started,
            time.perf_counter() - checked,
        )
    return verified.client_state


def _agree_on_verification(engine: CheckpointedEngine, error: BaseException | None) -> None:
    """Every rank learns whether any rank's part failed its checks; all of them raise, each with
    the first failed rank's reason, before any rank changes anything."""
    collectives = engine.collectives
    failed = collectives.ranks_with(error is not None, "whether the checkpoint passed its checks")
    if not failed:
        return
    reason = collectives.broadcast_object(
        f"{type(error).__name__}: {error}" if error is not None else "", src=failed[0], what="why the checkpoint was refused"
    )
    # this rank's own error: Ctrl-C or a bug (not the checkpoint's fault) as itself, after the
    # broadcast every other rank waits in
    if error is not None and (collectives.rank == failed[0] or not isinstance(error, CheckpointError)):
        raise error
    raise CheckpointError(
        f"load_checkpoint refused on every rank: rank {failed[0]}'s part failed its checks ({reason}); nothing was loaded"
    )


def _apply(engine: CheckpointedEngine, verified: VerifiedCheckpoint) -> None:
    """The second pass: the checked state into the engine's tiers (read and checked again)."""
    reader, canonical = verified.reader, verified.canonical
    rank = engine.collectives.rank
    try:
        engine.drop_device_copies()
    except OffloadError as error:
        raise CheckpointError(f"load_checkpoint: {error}") from None
    store = engine.store
    # per unit, from its first piece to its last: the shard's param pieces, and its fp32
    # weights (the masters, then the frozen params' with no optimizer state)
    param_pieces: list[tuple[int, int, int, int]] = []
    weights = torch.empty(0)
    precision = store.codec.precision.value
    conversion = precision_change(reader.index, precision, reader.index["world_size"], engine.collectives.world_size)
    # a conversion into compact moments is measured (what each value became), and values beyond
    # what they hold are named
    tally = RoundingTally() if conversion is not None and store.codec.compact else None
    saturated = SaturationReport(precision)
    # fp32 moments for the files' values, encoded into the engine's precision as each chunk is
    # done, rounded with the key of the saved step (not the engine's count, which changes below)
    for piece in store.overwrite_fp32_states(engine.units, verified.step_counts, tally):
        unit, targets = piece.unit, piece.views
        if piece.start == 0:
            start, end = unit.layout.shard_range(rank)
            param_pieces = shard_pieces(unit.layout.offsets, unit.layout.numels, start, end)
            whole = piece.last and unit.optimizer_numel == unit.shard_numel
            weights = targets["master"] if whole else torch.zeros(unit.shard_numel, dtype=torch.float32)
        for target in targets.values():
            target.zero_()
        for index, a, b, pos in param_pieces:
            name = canonical[id(unit.spec.params[index])]
            if frozen_piece(unit, pos):
                if piece.last:
                    reader.read_range(name, "master", a, b, weights[pos : pos + b - a])
                continue
            low, high = max(pos, piece.start), min(pos + b - a, piece.end)
            if low >= high:
                continue
            for kind, target in targets.items():
                # a param saved frozen has no moments: they start at zero, as for a new one
                if kind == "master" or (name, kind) in reader.stored:
                    values = target[low - piece.start : high - piece.start]
                    reader.read_range(name, kind, a + low - pos, a + high - pos, values)
                    if kind != "master":
                        saturated.check(name, kind, values)
        if weights.data_ptr() != targets["master"].data_ptr():
            weights[piece.start : piece.end].copy_(targets["master"])
        if not piece.last:
            continue
        store.store_param16_values(unit, weights)
        engine.replace_device_weights(unit, weights)
        unit.step_count = verified.step_counts[unit.index]
        unit.end_window()
        unit.grads_pending.clear()
        for param in unit.spec.params:
            # a backward interrupted (Ctrl-C) or failed before these gradients left the device
            # leaves them in .grad, where the next backward would add to them
            param.grad = None
    if conversion is not None:
        measured = tally.summary() if tally is not None else "fp32 moments hold every value: converted exactly"
        logger.info("offload: %s: %s", conversion, measured)
    message = saturated.message(f"load_checkpoint {reader.directory}")
    if message is not None:
        logger.warning("offload: %s", message)
    _load_buffers(engine, verified.buffers, verified.keys)
    engine.load_training_state(verified.training_state)
    if verified.rng is not None:
        parts = reader.parts
        if len(parts) != engine.collectives.world_size:
            logger.info(
                "offload: checkpoint saved by %d ranks, loading on %d: rank %d takes the RNG state of saved rank %d",
                len(parts),
                engine.collectives.world_size,
                rank,
                rank % len(parts),
            )
        set_rng_state(verified.rng)


def precision_change(index: dict, precision: str, saved_world: int, world: int) -> str | None:
    """What a load does to the moments on the way in, or None when the files hold the values
    of this engine's own stored form (the same precision and int8 codes, and for int8 the same
    blocks: as many ranks), which re-encode to themselves. The load measures the others
    (state_codec.RoundingTally) and logs this with what it measured: whether a conversion is
    exact depends on the values (a bf16 value fits int8 codes only if few of its bits are set,
    an int8 second moment root^2 has up to 10 significant bits, bf16 keeps 8)."""
    saved = index.get("state_precision", "fp32")
    codes = index.get("int8_codes", INT8_CODES_BEFORE) if saved == "int8" else None
    if saved == precision and (codes is None or codes == INT8_CODES) and (precision != "int8" or saved_world == world):
        return None
    if codes is not None and codes != INT8_CODES and precision == "int8":
        return f"the checkpoint's int8 Adam moments were stored in other codes ({codes}; this engine: {INT8_CODES}): re-encoded"
    return (
        f"the checkpoint's Adam moments were stored in {saved} (by {saved_world} ranks), this engine stores them in "
        f"{precision} (optimizer.state_precision, on {world} ranks)"
    )


def _load_buffers(engine: CheckpointedEngine, buffers: dict[str, torch.Tensor], keys) -> None:
    state = engine.model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, what in keys:
            if what == "buffer":
                state[key].copy_(buffers[key])


# ---- export ----------------------------------------------------------------------------------
