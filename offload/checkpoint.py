"""Checkpoints: save / resume on any world size and placement, and export to safetensors.

Format. A checkpoint is a directory `<root>/<tag>/`:

    index.json              format, engine counters, every parameter (canonical name, shape,
                            aliases, Adam step count), the list of small files with their size
                            and CRC-32C, and a CRC-32C of the index itself
    rank<r>.safetensors     rank r's fp32 state: for every parameter slice inside rank r's
                            shard, keys `<param>/master`, `<param>/exp_avg`, `<param>/exp_avg_sq`
                            (1-D, the element range [start, end) of the flattened parameter)
    rank<r>.json            where each slice lives in rank<r>.safetensors (byte offset), its
                            element range, a CRC-32C per 16 MiB of data, the file's size and
                            header checksum, and rank r's RNG states
    buffers.safetensors     the model's persistent buffers (state_dict keys)
    client_state.pt         the caller's `client_state` (loaded with torch.load(weights_only=True))
    hf_config.json          the model's Hugging Face config, when it has one

Because slices are keyed by parameter name and element range, not by unit or shard, a
checkpoint saved by N ranks with NVMe offload loads on M ranks with CPU offload (or another
wrap): each rank reads the ranges that intersect its new shard from whichever files hold them.
torch.distributed.checkpoint is not used: its chunks must be rectangular boxes of a tensor
(a flat shard cuts a 2-D weight mid-row), and its metadata file is a pickle, executed on load.

The rank files are valid safetensors files written by a streaming writer (the header is known
before any data, so the data goes out unit by unit); with the optimizer state on NVMe, each
unit's state is read from its swap files into a slot buffer and written on, never gathered
whole in RAM. Every byte read back is checked: size, header checksum, per-chunk checksums, and
a mismatch names the file and the tensor.

Atomicity. Files are written into `<root>/.tmp-<tag>-<pid>/`, each fsynced, the directory
fsynced and renamed to `<root>/<tag>`, and only then is `<root>/latest` replaced (temp file
made with O_EXCL, fsync, rename). A process killed at any moment, or a full disk, leaves the
previous checkpoint and `latest` as they were; a save that fails removes its temporary
directory, and a later save removes those left by dead saves. A save in progress holds a
flock on its temporary directory (and on its `latest` temp file), so "dead" is judged by the
lock (which the kernel drops with the process), not by whether a pid is alive on this host. `keep_last=N` removes older checkpoints after `latest`
points to the new one (renamed to `.trash-*` first, so a half-removed one is never taken for
a checkpoint). With several ranks the root must be a filesystem every rank sees.

Reading a checkpoint trusts nothing in it: checksums catch damage, not crafting. Only the file
names the format writes are read (`index.json`, `latest`, `rank<r>.json`,
`rank<r>.safetensors`, and the three small files above), each opened relative to the
checkpoint directory without following a symlink, and only if it is a regular file; a file
is read up to its declared size and no further; every offset, size and count in the index
and the rank files is checked before it is used. `client_state` is loaded with
`torch.load(weights_only=True)`, which needs torch >= 2.6 (pyproject's floor: earlier
versions could execute code from a crafted file).
"""
from __future__ import annotations

import base64
import errno
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.aio import crc32c
from offload.errors import InsufficientSpaceError, OffloadError

logger = logging.getLogger(__name__)

FORMAT = "offload-checkpoint"
FORMAT_VERSION = 1
KINDS = ("master", "exp_avg", "exp_avg_sq")
INDEX = "index.json"
LATEST = "latest"
BUFFERS = "buffers.safetensors"
CLIENT_STATE = "client_state.pt"
HF_CONFIG = "hf_config.json"
CHUNK_BYTES = 16 << 20  # one CRC-32C per this many bytes of a slice
CHUNK_ELEMENTS = CHUNK_BYTES // 4
DATA_ALIGN = 4096  # the data of a rank file starts at a multiple of this
RANK_JSON = re.compile(r"rank(\d+)\.json")
RANK_STATE = re.compile(r"rank(\d+)\.safetensors")
SMALL_FILES = (BUFFERS, CLIENT_STATE, HF_CONFIG)
MAX_INDEX_BYTES = 256 << 20  # index.json has no declared size: a cap instead (a 70B model's is ~1 MB)
MAX_LATEST_BYTES = 4096


class CheckpointError(OffloadError):
    """A checkpoint cannot be saved or loaded (missing, incompatible); the message says which."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, edited or damaged; the message names the file."""


# ---- plain functions (tested directly) -----------------------------------------------------
def shard_pieces(offsets, numels, shard_start: int, shard_end: int) -> list[tuple[int, int, int, int]]:
    """(param index, start, end, position in shard): the element range [start, end) of each
    flattened param that lies in the flat-buffer range [shard_start, shard_end)."""
    pieces = []
    for index, (offset, numel) in enumerate(zip(offsets, numels)):
        low, high = max(offset, shard_start), min(offset + numel, shard_end)
        if low < high:
            pieces.append((index, low - offset, high - offset, low - shard_start))
    return pieces


def chunk_bounds(numel: int, chunk: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) of each checksummed chunk of a slice of `numel` elements."""
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def checkpoints_to_remove(saved: dict[str, int], keep_last: int, keep: str) -> list[str]:
    """Tags to delete so that `keep_last` checkpoints remain: the oldest by save time (ns),
    never `keep` (the one `latest` names)."""
    if keep_last is None or keep_last <= 0:
        return []
    newest_first = sorted(saved, key=lambda tag: (saved[tag], tag), reverse=True)
    kept = [keep] + [tag for tag in newest_first if tag != keep][: max(0, keep_last - 1)]
    return [tag for tag in newest_first if tag not in kept]


def check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or os.sep in tag or tag == LATEST or (os.altsep and os.altsep in tag):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name, not starting with '.', not {LATEST!r}")
    return tag


def safetensors_header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str], align: int = 8) -> tuple[bytes, list[int]]:
    """The safetensors prefix (8-byte length + JSON header, space-padded so data starts at a
    multiple of `align`) for `entries` (key, dtype e.g. "F32", shape, nbytes) stored back to back;
    returns (prefix, data offset of each entry relative to the start of the data)."""
    header: dict = {"__metadata__": dict(metadata)}
    offsets, cursor = [], 0
    for key, dtype, shape, nbytes in entries:
        if key in header:
            raise ValueError(f"duplicate safetensors key {key!r}")
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        offsets.append(cursor)
        cursor += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    total = -(-(8 + len(body)) // align) * align
    body = body + b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body, offsets


SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


# ---- small file helpers ----------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return memoryview(tensor.numpy()).cast("B")


def _write_all(fd: int, data, path: str) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    while len(view):
        written = os.write(fd, view)
        view = view[written:]


def _space_error(path: str, err: OSError, needed: int | None = None) -> OffloadError:
    free = shutil.disk_usage(os.path.dirname(path) or ".").free
    what = "the disk is full" if err.errno == errno.ENOSPC else f"the file size limit was reached ({err.strerror})"
    need = f" ({needed} bytes needed)" if needed is not None else ""
    return InsufficientSpaceError(
        err.errno, f"checkpoint write failed: {what} while writing {path}{need}, {free} bytes free; the previous "
                   "checkpoint is untouched; free space or save to another directory", path)


def _write_small(path: str, data: bytes) -> dict:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data, path)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise _space_error(path, e, len(data)) from None
        raise
    return {"bytes": len(data), "crc32c": crc32c(data)}


def _checked_name(name, directory: str) -> str:
    """`name` if it is a file name the format writes, else a CheckpointCorruptError."""
    if not isinstance(name, str) or not (name in SMALL_FILES or RANK_JSON.fullmatch(name)
                                         or RANK_STATE.fullmatch(name)):
        raise CheckpointCorruptError(
            f"checkpoint {directory} names a file {name!r} that the format never writes: refusing to read it "
            "(the index or a rank file was crafted or damaged)")
    return name


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}: it does not exist") from None
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint directory {path}: {e.strerror}") from None


def _open_regular(dir_fd: int, name: str, path: str) -> tuple[int, int]:
    """Opens `name` under `dir_fd` for reading, never through a symlink, only if it is a regular
    file (not a device such as /dev/zero, not a FIFO); returns (fd, size)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorruptError(f"checkpoint file {path} is a symbolic link: refusing to follow it "
                                         "(a checkpoint holds only regular files)") from None
        raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"checkpoint file {path} is not a regular file: refusing to read it "
                                     "(a checkpoint holds only regular files)")
    return fd, st.st_size


def _read_exactly(fd: int, size: int, path: str) -> bytes:
    """`size` bytes from the start of `fd`, never more."""
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 64 << 20), done)
        if not chunk:
            raise CheckpointCorruptError(f"checkpoint file {path} ends early (short read at byte {done}): truncated")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _read_small(dir_fd: int, directory: str, name: str, *, limit: int) -> bytes:
    """A whole small file of at most `limit` bytes (for files without a declared size)."""
    path = os.path.join(directory, name)
    fd, size = _open_regular(dir_fd, name, path)
    try:
        if size > limit:
            raise CheckpointCorruptError(f"checkpoint file {path} is {size} bytes, more than the {limit} such a file "
                                         "can have: refusing to read it (crafted or damaged)")
        return _read_exactly(fd, size, path)
    finally:
        os.close(fd)


def _read_verified(dir_fd: int, directory: str, name: str, info) -> bytes:
    """A file the index lists, checked against its declared size (read no further) and checksum."""
    path = os.path.join(directory, _checked_name(name, directory))
    if not (isinstance(info, dict) and _is_count(info.get("bytes")) and _is_count(info.get("crc32c"))):
        raise CheckpointCorruptError(f"checkpoint {directory}: the index's entry for {name} is malformed")
    fd, size = _open_regular(dir_fd, name, path)
    try:
        if size != info["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {path} is {size} bytes, the index says {info['bytes']}: "
                                         "it was truncated or replaced")
        data = _read_exactly(fd, info["bytes"], path)
    finally:
        os.close(fd)
    if crc32c(data) != info["crc32c"]:
        raise CheckpointCorruptError(f"checkpoint file {path} fails its checksum: it was edited or damaged")
    return data


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_with_checksum(body: dict) -> bytes:
    canonical = json.dumps(body, sort_keys=True).encode()
    return json.dumps({**body, "checksum": crc32c(canonical)}, sort_keys=True, indent=1).encode()


def _parse_json_with_checksum(dir_fd: int, directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    raw = _read_small(dir_fd, directory, name, limit=MAX_INDEX_BYTES)
    try:
        data = json.loads(raw)
        checksum = data.pop("checksum")
    except (ValueError, KeyError, AttributeError, TypeError):
        raise CheckpointCorruptError(f"checkpoint file {path} is not a valid index (truncated or edited)") from None
    if crc32c(json.dumps(data, sort_keys=True).encode()) != checksum:
        raise CheckpointCorruptError(f"checkpoint file {path} fails its checksum: it was edited or damaged")
    return data


# ---- RNG -------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        for device, encoded in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8), device)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


# ---- the model's names -----------------------------------------------------------------------
def _model_names(model) -> tuple[dict[int, str], dict[str, list[str]], list[tuple[str, str]]]:
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


# ---- saving ----------------------------------------------------------------------------------
@dataclass
class _Slice:
    key: str  # "<param>/<kind>"
    param: str
    kind: str
    start: int
    end: int
    shard_pos: int
    unit: int


def _rank_slices(engine, rank: int, canonical: dict[int, str]) -> list[_Slice]:
    slices = []
    for unit in engine.units:
        start, end = unit.layout.shard_range(rank)
        for index, a, b, pos in shard_pieces(unit.layout.offsets, unit.layout.numels, start, end):
            name = canonical[id(unit.spec.params[index])]
            for kind in KINDS:
                slices.append(_Slice(f"{name}/{kind}", name, kind, a, b, pos, unit.index))
    return slices


def _write_rank_file(engine, directory: str, rank: int, canonical, progress) -> dict:
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
            errno.ENOSPC, f"checkpoint needs {total} bytes ({total / 2**30:.2f} GiB) for {path} but only {free} bytes are "
                          "free; nothing was written and the previous checkpoint is untouched; free space or save elsewhere", path)
    by_unit: dict[int, list[tuple[_Slice, int]]] = {}
    for s, offset in zip(slices, offsets):
        by_unit.setdefault(s.unit, []).append((s, offset))
    records = []
    done = len(prefix)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            _write_all(fd, prefix, path)
            # the units' order matches the slices' order, so the file is written sequentially
            for unit, views, _ in engine.store.stream_optimizer_states(engine.units, include_grad=False):
                for s, offset in by_unit.get(unit.index, []):
                    data = views[s.kind][s.shard_pos : s.shard_pos + s.end - s.start]
                    crcs = []
                    for c0, c1 in chunk_bounds(s.end - s.start):
                        chunk = data[c0:c1]
                        _write_all(fd, _tensor_bytes(chunk), path)
                        crcs.append(crc32c(chunk))
                        done += 4 * (c1 - c0)
                        if progress is not None:
                            progress(done, total)
                    records.append({"key": s.key, "param": s.param, "kind": s.kind, "start": s.start, "end": s.end,
                                    "offset": len(prefix) + offset, "crc32c": crcs})
            os.fsync(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise _space_error(path, e, total) from None
            raise CheckpointError(f"checkpoint write of {path} failed: {e.strerror}; the previous checkpoint is untouched") from e
    finally:
        os.close(fd)
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


def _shared_pid(engine) -> int:
    pid = os.getpid() if engine.collectives.rank == 0 else 0
    return round(engine.collectives.sum_host([float(pid)])[0])


def _agree_on_failure(engine, error: BaseException | None, cleanup: Callable[[], None]) -> None:
    """Every rank learns whether any rank failed; all of them raise, rank 0 cleans up."""
    failed = engine.collectives.max_host(1.0 if error is not None else 0.0) > 0
    if not failed:
        return
    if engine.collectives.rank == 0:
        cleanup()
    if error is not None:
        raise error
    raise CheckpointError("saving the checkpoint failed on another rank (see its log); the previous checkpoint is untouched")


def _lock_held(fd: int) -> None:
    """Marks a save's temporary file or directory as in use: a shared-nothing flock that the
    kernel drops when the saving process dies, wherever it ran (flock is coherent over NFSv4)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _remove_stale(root: str) -> None:
    """Removes `.tmp-*` / `.trash-*` entries no live save holds the lock of (a killed save)."""
    root_fd = _open_dir(root)
    try:
        for entry in os.listdir(root_fd):
            if not entry.startswith((".tmp-", ".trash-")):
                continue
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
            except OSError:
                continue  # gone meanwhile, or a symlink: not ours to follow
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a save in progress (this or another process, on any host)
                stale = os.path.join(root, entry)
                logger.info("offload: removing %s left by an interrupted save", stale)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    shutil.rmtree(entry, dir_fd=root_fd, ignore_errors=True)
                else:
                    os.unlink(entry, dir_fd=root_fd)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def _save_error(error: BaseException, root: str) -> BaseException:
    """An OSError of a save as an error that names the path and says what to do."""
    if isinstance(error, OffloadError) or not isinstance(error, OSError):
        return error
    where = error.filename or root
    if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return _space_error(where, error)
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and os.path.exists(root) and not os.path.isdir(root):
        return CheckpointError(f"cannot save a checkpoint to {root}: it is a file, not a directory; pass a directory "
                               "path (it is created if missing)")
    return CheckpointError(f"cannot save a checkpoint to {root}: {error.strerror} ({where}); choose a directory "
                           "you can write to, or fix its permissions; the previous checkpoint is untouched")


def _hf_config(model) -> bytes | None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        try:
            return to_json().encode()
        except Exception as e:  # noqa: BLE001  (an exotic config: the checkpoint is still complete without it)
            logger.warning("offload: the model's config could not be saved (%s); export will not write config.json", e)
    return None


def save(engine, path, client_state: dict | None = None, *, tag: str | None = None, keep_last: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> str:
    """Saves the engine's full training state as checkpoint `<path>/<tag>` and points
    `<path>/latest` at it; returns the checkpoint's directory.

    tag: defaults to `global_step<N>`; an existing tag is an error (checkpoints are never
    overwritten in place). keep_last: afterwards keep only the newest N checkpoints under
    `path`. progress(bytes_done, bytes_total): called as this rank's state file is written.
    client_state: any dict of tensors, numbers, strings, lists, tuples and dicts (returned by
    `load`); rank 0's is saved.
    """
    if any(unit.window_started for unit in engine.units):
        raise CheckpointError("save_checkpoint in the middle of a gradient accumulation window: the accumulated "
                              "gradients are not part of a checkpoint; save after engine.step() returned True")
    rank = engine.collectives.rank
    root = os.path.abspath(os.fspath(path))
    tag = check_tag(tag or f"global_step{engine.global_steps}")
    final = os.path.join(root, tag)
    started = time.perf_counter()
    error: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(final):
                raise CheckpointError(f"checkpoint {final} already exists; pass another tag or remove it first")
            _remove_stale(root)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = _save_error(e, root)
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
            os.mkdir(temp, 0o700)
            lock_fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            _lock_held(lock_fd)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = _save_error(e, root)
    _agree_on_failure(engine, error, cleanup)

    canonical, aliases, keys = _model_names(engine.model)
    try:
        part = _write_rank_file(engine, temp, rank, canonical, progress)
        _write_small(os.path.join(temp, f"rank{rank}.json"), json.dumps(part, sort_keys=True).encode())
        if rank == 0:
            files = _write_rank0_files(engine, temp, client_state, keys)
    except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
        error = _save_error(e, root)
    _agree_on_failure(engine, error, cleanup)

    if rank == 0:
        try:
            _finish(engine, root, temp, final, tag, files, canonical, aliases, keys, keep_last)
        except BaseException as e:  # noqa: BLE001  (every rank must learn of any failure, Ctrl-C included)
            error = _save_error(e, root)
        finally:
            os.close(lock_fd)  # the directory is `final` now, or removed by cleanup below
            lock_fd = None
    _agree_on_failure(engine, error, cleanup)
    logger.info("offload: saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
    return final


def _write_rank0_files(engine, temp: str, client_state, keys) -> dict:
    from safetensors.torch import save as safetensors_save

    files = {}
    state = engine.model.state_dict(keep_vars=True)
    buffers = {key: state[key].detach().to("cpu").contiguous() for key, what in keys if what == "buffer"}
    files[BUFFERS] = _write_small(os.path.join(temp, BUFFERS), safetensors_save(buffers, metadata={"format": "pt"}))
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
                f"tensors, numbers, strings, lists, tuples and dicts ({e})") from None
        files[CLIENT_STATE] = _write_small(os.path.join(temp, CLIENT_STATE), data)
    hf = _hf_config(engine.model)
    if hf is not None:
        files[HF_CONFIG] = _write_small(os.path.join(temp, HF_CONFIG), hf)
    return files


def _finish(engine, root, temp, final, tag, files, canonical, aliases, keys, keep_last) -> None:
    world = engine.collectives.world_size
    temp_fd = _open_dir(temp)
    try:
        for r in range(world):
            name = f"rank{r}.json"
            data = _read_small(temp_fd, temp, name, limit=MAX_INDEX_BYTES)
            files[name] = {"bytes": len(data), "crc32c": crc32c(data)}
    finally:
        os.close(temp_fd)
    params = {}
    trainable = {}
    for unit in engine.units:
        for param in unit.spec.params:
            name = canonical[id(param)]
            params[name] = {"shape": list(param.shape), "numel": param.numel(), "aliases": aliases[name],
                            "step": unit.step_count, "requires_grad": bool(param.requires_grad)}
            trainable[name] = bool(param.requires_grad)
    scaler = engine.scaler.state_dict()
    norm = engine.last_grad_norm
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "saved_at_ns": time.time_ns(),
        "world_size": world,
        "placement": {"param": engine.config.offload.param, "optimizer": engine.config.offload.optimizer},
        "precision": engine.config.precision,
        "optimizer": engine.config.optimizer.type,
        "engine": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "stepped_at_micro": engine._stepped_at_micro,
            "lr": engine.lr,
            "loss_scaler": scaler,
            "last_grad_norm": norm if norm is None or math.isfinite(norm) else None,
        },
        "params": params,
        "state_dict_keys": [[key, what] for key, what in keys],
        "ranks": [f"rank{r}.json" for r in range(world)],
        "files": files,
    }
    _write_small(os.path.join(temp, INDEX), _json_with_checksum(index))
    _fsync_dir(temp)
    os.rename(temp, final)
    _fsync_dir(root)
    latest_temp = os.path.join(root, f".tmp-latest-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(latest_temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _lock_held(fd)  # a concurrent save's sweep leaves it alone
        _write_all(fd, (tag + "\n").encode(), latest_temp)
        os.fsync(fd)
        os.replace(latest_temp, os.path.join(root, LATEST))
    except BaseException:
        try:
            os.unlink(latest_temp)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
    _fsync_dir(root)
    if keep_last:
        _rotate(root, keep_last, tag)


def list_checkpoints(root: str) -> dict[str, int]:
    """Tag -> save time (ns) of every complete checkpoint directly under `root`."""
    found = {}
    for entry in os.listdir(root):
        if entry.startswith("."):
            continue
        directory = os.path.join(root, entry)
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            try:
                dir_fd = _open_dir(directory)
                try:
                    found[entry] = int(json.loads(_read_small(dir_fd, directory, INDEX, limit=MAX_INDEX_BYTES))["saved_at_ns"])
                finally:
                    os.close(dir_fd)
            except (ValueError, KeyError, TypeError, OSError, CheckpointError):
                logger.warning("offload: %s is not a readable checkpoint index; left alone by rotation", index)
    return found


def _rotate(root: str, keep_last: int, keep: str) -> None:
    for tag in checkpoints_to_remove(list_checkpoints(root), keep_last, keep):
        trash = os.path.join(root, f".trash-{tag}-{os.getpid()}")
        os.rename(os.path.join(root, tag), trash)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("offload: removed old checkpoint %s (keep_last=%d)", os.path.join(root, tag), keep_last)


# ---- reading ---------------------------------------------------------------------------------
def resolve(path, tag: str | None = None) -> str:
    """The checkpoint directory: `path` itself when it holds index.json, else `path/<tag>`,
    else the tag named by `path/latest`."""
    root = os.path.abspath(os.fspath(path))
    if tag is not None:
        directory = os.path.join(root, check_tag(tag))
    elif os.path.isfile(os.path.join(root, INDEX)):
        return root
    elif os.path.lexists(os.path.join(root, LATEST)):
        root_fd = _open_dir(root)
        try:
            raw = _read_small(root_fd, root, LATEST, limit=MAX_LATEST_BYTES)
        finally:
            os.close(root_fd)
        try:
            named = raw.decode().strip()
        except UnicodeDecodeError:
            raise CheckpointCorruptError(f"{os.path.join(root, LATEST)} does not hold a checkpoint tag") from None
        try:
            directory = os.path.join(root, check_tag(named))
        except CheckpointError:
            raise CheckpointCorruptError(f"{os.path.join(root, LATEST)} names {named[:80]!r}, which is not a "
                                         "checkpoint tag (a plain directory name)") from None
        if not os.path.isdir(directory):
            raise CheckpointError(f"{os.path.join(root, LATEST)} names checkpoint {named!r}, but {directory} does not exist")
    else:
        raise CheckpointError(f"no checkpoint at {root}: it has neither {INDEX} nor a {LATEST} file")
    if not os.path.isfile(os.path.join(directory, INDEX)):
        raise CheckpointError(f"no checkpoint at {directory}: {INDEX} is missing (not a checkpoint, or an incomplete one)")
    return directory


@dataclass
class _Stored:
    start: int
    end: int
    path: str
    fd: int
    offset: int
    crcs: list[int]
    key: str


def _malformed(where: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {what} is malformed (the file was crafted or damaged); the checkpoint "
                                  "cannot be loaded")


class CheckpointReader:
    """A verified view of a checkpoint: its index, and reads of any element range of any
    parameter's state, checked chunk by chunk against the recorded checksums.

    Every file is opened once, relative to the checkpoint directory (see the module docstring
    on what is trusted); the rank files stay open until close()."""

    def __init__(self, path, tag: str | None = None) -> None:
        self.directory = resolve(path, tag)
        self._dir_fd = _open_dir(self.directory)
        self._fds: dict[str, int] = {}
        self._bounce: torch.Tensor | None = None
        try:
            self._load_index()
        except BaseException:
            self.close()
            raise

    def _load_index(self) -> None:
        index_path = os.path.join(self.directory, INDEX)
        self.index = _parse_json_with_checksum(self._dir_fd, self.directory, INDEX)
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{index_path} is not an offload checkpoint index")
        if self.index.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {self.directory} has format version {self.index.get('version')}; this "
                                  f"offload reads version {FORMAT_VERSION}")
        self.files = self.index.get("files")
        ranks = self.index.get("ranks")
        params = self.index.get("params")
        if not isinstance(self.files, dict) or not isinstance(ranks, list) or not ranks or not isinstance(params, dict):
            raise _malformed(index_path, "its list of files, ranks or parameters")
        for name, info in params.items():
            if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
                    and all(_is_count(d) for d in info["shape"]) and _is_count(info.get("numel"))
                    and info["numel"] == math.prod(info["shape"])):
                raise _malformed(index_path, f"the entry of parameter {name!r}")
        self.parts = []
        self.stored: dict[tuple[str, str], list[_Stored]] = {}
        for name in ranks:
            if not isinstance(name, str) or not RANK_JSON.fullmatch(name) or name not in self.files:
                raise _malformed(index_path, f"its rank file entry {name!r}")
            try:
                part = json.loads(_read_verified(self._dir_fd, self.directory, name, self.files[name]))
            except ValueError:
                raise _malformed(os.path.join(self.directory, name), "its content") from None
            self.parts.append(part)
            self._add_rank_file(name, part)
        for pieces in self.stored.values():
            pieces.sort(key=lambda p: p.start)

    def _add_rank_file(self, json_name: str, part) -> None:
        where = os.path.join(self.directory, json_name)
        if not isinstance(part, dict) or not isinstance(part.get("file"), str) or not RANK_STATE.fullmatch(part["file"]):
            raise _malformed(where, "the name of its state file")
        file_bytes, header_bytes = part.get("file_bytes"), part.get("header_bytes")
        if not (_is_count(file_bytes) and _is_count(header_bytes) and 8 <= header_bytes <= file_bytes
                and _is_count(part.get("header_crc32c")) and isinstance(part.get("slices"), list)):
            raise _malformed(where, "the sizes of its state file")
        path = os.path.join(self.directory, part["file"])
        fd = self._open_rank_file(part["file"], path, file_bytes, header_bytes, part["header_crc32c"])
        for record in part["slices"]:
            try:
                start, end, offset, crcs = record["start"], record["end"], record["offset"], record["crc32c"]
                param, kind, key = record["param"], record["kind"], record["key"]
                ok = (all(_is_count(v) for v in (start, end, offset)) and start <= end
                      and offset >= header_bytes and offset + 4 * (end - start) <= file_bytes
                      and isinstance(crcs, list) and len(crcs) == len(chunk_bounds(end - start))
                      and all(_is_count(c) for c in crcs) and kind in KINDS and isinstance(key, str)
                      and isinstance(param, str))
            except (KeyError, TypeError):
                ok = False
            if not ok:
                raise _malformed(where, f"slice record {str(record)[:120]}")
            self.stored.setdefault((param, kind), []).append(_Stored(start, end, path, fd, offset, crcs, key))

    def _open_rank_file(self, name: str, path: str, file_bytes: int, header_bytes: int, header_crc: int) -> int:
        if name in self._fds:
            raise CheckpointCorruptError(f"checkpoint {self.directory}: two rank files name the state file {path}")
        fd, size = _open_regular(self._dir_fd, name, path)
        self._fds[name] = fd
        if size != file_bytes:
            raise CheckpointCorruptError(f"checkpoint file {path} is {size} bytes, expected {file_bytes}: it was "
                                         "truncated or replaced")
        if crc32c(_read_exactly(fd, header_bytes, path)) != header_crc:
            raise CheckpointCorruptError(f"checkpoint file {path}: its safetensors header fails its checksum (edited or damaged)")
        return fd

    @staticmethod
    def _pread(piece: _Stored, target: torch.Tensor, offset: int) -> None:
        view = _tensor_bytes(target) if target.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(piece.fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointCorruptError(f"checkpoint file {piece.path} ends early (short read at byte "
                                             f"{offset + done}): truncated")
            done += n

    def read_range(self, param: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        """Fills `out` (fp32, end - start elements) with elements [start, end) of `param`'s `kind`."""
        pieces = self.stored.get((param, kind))
        if not pieces:
            raise CheckpointCorruptError(f"checkpoint {self.directory} holds no {kind} for parameter {param!r}")
        cursor = start
        for piece in pieces:
            if piece.end <= cursor or piece.start >= end:
                continue
            if piece.start > cursor:
                break
            high = min(piece.end, end)
            for c0, c1 in chunk_bounds(piece.end - piece.start):
                g0, g1 = piece.start + c0, piece.start + c1  # the chunk, in param elements
                if g1 <= cursor or g0 >= high:
                    continue
                whole = cursor <= g0 and g1 <= high
                if whole:
                    target = out[g0 - start : g1 - start]
                else:
                    if self._bounce is None:
                        self._bounce = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
                    target = self._bounce[: c1 - c0]
                self._pread(piece, target, piece.offset + 4 * c0)
                if crc32c(target) != piece.crcs[c0 // CHUNK_ELEMENTS]:
                    raise CheckpointCorruptError(
                        f"checkpoint file {piece.path}: tensor {piece.key!r} (bytes {piece.offset + 4 * c0}.."
                        f"{piece.offset + 4 * c1}) fails its checksum: the file was edited or damaged")
                if not whole:
                    low, top = max(g0, cursor), min(g1, high)
                    out[low - start : top - start].copy_(target[low - g0 : top - g0])
            cursor = high
            if cursor >= end:
                break
        if cursor < end:
            raise CheckpointCorruptError(f"checkpoint {self.directory} lacks elements {cursor}..{end} of {param!r} {kind}")

    def read_param(self, param: str, kind: str = "master") -> torch.Tensor:
        info = self.index["params"][param]
        stored = sum(p.end - p.start for p in self.stored.get((param, kind), []))
        if stored < info["numel"]:  # before allocating what the index claims
            raise CheckpointCorruptError(f"checkpoint {self.directory} holds {stored} elements of {param!r} {kind}, "
                                         f"its index says {info['numel']}")
        out = torch.empty(info["numel"], dtype=torch.float32)
        self.read_range(param, kind, 0, info["numel"], out)
        return out.view(info["shape"])

    def buffers(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as safetensors_load

        if BUFFERS not in self.files:
            raise CheckpointCorruptError(f"checkpoint {self.directory}: its index lists no {BUFFERS}")
        data = _read_verified(self._dir_fd, self.directory, BUFFERS, self.files[BUFFERS])
        try:
            return safetensors_load(data)
        except Exception as e:  # noqa: BLE001  (safetensors' own parse errors: a crafted file that passes its checksum)
            raise _malformed(os.path.join(self.directory, BUFFERS), f"its content ({e})") from None

    def client_state(self) -> dict:
        if CLIENT_STATE not in self.files:
            return {}
        import io

        data = _read_verified(self._dir_fd, self.directory, CLIENT_STATE, self.files[CLIENT_STATE])
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # noqa: BLE001  (weights_only refuses anything but plain data: report, never run it)
            raise CheckpointCorruptError(f"checkpoint file {os.path.join(self.directory, CLIENT_STATE)} cannot be "
                                         f"loaded as plain data ({type(e).__name__}: {str(e)[:200]}); it was crafted "
                                         "or written by something else") from None

    def hf_config(self) -> bytes | None:
        if HF_CONFIG not in self.files:
            return None
        return _read_verified(self._dir_fd, self.directory, HF_CONFIG, self.files[HF_CONFIG])

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- loading into an engine ------------------------------------------------------------------
def _check_compatible(reader: CheckpointReader, engine, canonical) -> None:
    saved = reader.index["params"]
    mine = {canonical[id(p)]: p for unit in engine.units for p in unit.spec.params}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {reader.directory} does not fit this model: parameters missing from the checkpoint "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, parameters the model lacks {extra[:5]}"
            f"{'...' if len(extra) > 5 else ''}")
    wrong = [f"{name}: checkpoint {saved[name]['shape']}, model {list(p.shape)}" for name, p in mine.items()
             if saved[name]["shape"] != list(p.shape)]
    if wrong:
        raise CheckpointError(f"checkpoint {reader.directory} has other shapes than this model: {'; '.join(wrong[:5])}")


def _unit_step_count(unit, saved_params, canonical) -> int:
    counts = {saved_params[canonical[id(p)]]["step"] for p in unit.spec.params if p.requires_grad}
    if len(counts) > 1:
        raise CheckpointError(
            f"unit {unit.spec.name} mixes parameters saved with different Adam step counts {sorted(counts)}: load "
            "with the wrap settings the checkpoint was saved with")
    if not counts:
        counts = {max((saved_params[canonical[id(p)]]["step"] for p in unit.spec.params), default=0)}
    return counts.pop()


def _quiesce_residency(engine) -> None:
    """No offloaded unit may keep (or be fetching) old weights on the device."""
    residency = engine.residency
    if not residency.offloaded:
        return
    for unit in engine.units:
        if unit.holders:
            raise CheckpointError(f"load_checkpoint while unit {unit.spec.name} is in use (inside a forward or "
                                  "backward); load between steps")
        if unit.fetch_future is not None:
            try:
                residency._complete_fetch(unit)
            except Exception as e:  # noqa: BLE001  (the weights it fetched are replaced below: recovery after an I/O error)
                logger.warning("offload: load_checkpoint discards a failed fetch of unit %s: %s", unit.spec.name, e)
                if unit.fetch_target is not None and unit.fetch_target is not unit.device_flat:
                    residency.ledger.release("device", unit.shard_numel * residency.element_size, "param_shard")
                unit.fetch_target = None
        residency.free(unit)


def load(engine, path, *, tag: str | None = None, load_rng: bool = True) -> dict:
    """Restores weights, optimizer states, counters, loss scale and (with `load_rng`) RNG
    states from a checkpoint saved by any world size and placement; returns its client_state."""
    started = time.perf_counter()
    rank, world = engine.collectives.rank, engine.collectives.world_size
    canonical, _, keys = _model_names(engine.model)
    with CheckpointReader(path, tag) as reader:
        _check_compatible(reader, engine, canonical)
        _quiesce_residency(engine)
        saved_params = reader.index["params"]
        store = engine.store
        if store.swap is not None:
            # recovery after a swap I/O error: what a failed step left in flight or in wait lists
            # must not fail the load that replaces it (every state it touched is rewritten below)
            for failure in store.swap.settle():
                logger.warning("offload: load_checkpoint discards a failed swap operation: %s", failure)
        slots = getattr(store, "slots", None)
        for position, unit in enumerate(engine.units):
            n = unit.shard_numel
            if store.optimizer_tier == "cpu":
                targets = {kind: unit.host[kind] for kind in KINDS}
            else:
                slot = slots[position % len(slots)]
                slot.wait_writes()
                targets = {kind: getattr(slot, kind)[:n] for kind in KINDS}
            start, end = unit.layout.shard_range(rank)
            pieces = shard_pieces(unit.layout.offsets, unit.layout.numels, start, end)
            for kind, target in targets.items():
                target.zero_()
                for index, a, b, pos in pieces:
                    reader.read_range(canonical[id(unit.spec.params[index])], kind, a, b, target[pos : pos + b - a])
            if store.optimizer_tier == "nvme":
                for kind in KINDS:
                    slot.pending_writes.append(store.swap.write_from(unit.swap_name(kind), targets[kind]))
            store.store_param16_values(unit, targets["master"])
            if engine.residency.offloaded is False:
                unit.device_flat[start:end].copy_(targets["master"])
                unit.device_update_event = None
                unit.needs_gather = world > 1
            unit.step_count = _unit_step_count(unit, saved_params, canonical)
            unit.window_started = False
            unit.grads_in_window.clear()
            unit.grads_pending.clear()
            unit.grad_sq_norm = None
        if slots is not None and store.optimizer_tier == "nvme":
            for slot in slots:
                slot.wait_writes()
        _load_buffers(engine, reader.buffers(), keys, reader.directory)
        counters = reader.index["engine"]
        engine.global_steps = counters["global_steps"]
        engine.micro_steps = counters["micro_steps"]
        engine.skipped_steps = counters["skipped_steps"]
        engine._stepped_at_micro = counters["stepped_at_micro"]
        engine.lr = counters["lr"]
        engine.scaler.load_state_dict(counters["loss_scaler"])
        engine.last_grad_norm = counters["last_grad_norm"]
        if load_rng:
            parts = reader.parts
            if len(parts) != world:
                logger.info("offload: checkpoint saved by %d ranks, loading on %d: rank %d takes the RNG state of saved rank %d",
                            len(parts), world, rank, rank % len(parts))
            set_rng_state(parts[rank % len(parts)]["rng"])
        client_state = reader.client_state()
        logger.info("offload: loaded checkpoint %s (saved by %d ranks, %s/%s) in %.2f s", reader.directory,
                    reader.index["world_size"], reader.index["placement"]["param"], reader.index["placement"]["optimizer"],
                    time.perf_counter() - started)
    return client_state


def _load_buffers(engine, buffers: dict[str, torch.Tensor], keys, directory: str) -> None:
    state = engine.model.state_dict(keep_vars=True)
    wanted = [key for key, what in keys if what == "buffer"]
    missing = [key for key in wanted if key not in buffers]
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks the model buffers {missing[:5]}")
    with torch.no_grad():
        for key in wanted:
            state[key].copy_(buffers[key])


# ---- export ----------------------------------------------------------------------------------
def export(checkpoint, out_dir, *, dtype: torch.dtype = torch.float32, tag: str | None = None) -> str:
    """Writes `out_dir/model.safetensors`: the full weights (fp32 master, cast to `dtype`) and
    buffers under the model's state_dict keys (tied weights under every key), streamed one
    tensor at a time, plus `config.json` when the checkpoint recorded a Hugging Face config.
    Each file is written to a new temporary file (O_EXCL), fsynced and renamed into place.
    Returns the safetensors path."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"cannot export to {out_dir}: it is a file, not a directory; pass a directory path "
                              "(it is created if missing; model.safetensors goes inside)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the export directory {out_dir}: {e.strerror}; choose a directory you "
                              "can write to") from None
    with CheckpointReader(checkpoint, tag) as reader:
        buffers = reader.buffers()
        params = reader.index["params"]
        entries, sources = [], []
        for key, what in reader.index["state_dict_keys"]:
            if what == "buffer":
                tensor = buffers[key]
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                entries.append((key, SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), tensor.numel() * tensor.element_size()))
                sources.append(tensor)
            else:
                name = what.split(":", 1)[1]
                info = params[name]
                entries.append((key, SAFETENSORS_DTYPES[dtype], info["shape"], info["numel"] * torch.empty(0, dtype=dtype).element_size()))
                sources.append(name)
        prefix, _ = safetensors_header(entries, {"format": "pt"})

        def tensors():
            yield prefix
            for source in sources:
                tensor = source if isinstance(source, torch.Tensor) else reader.read_param(source).to(dtype)
                yield _tensor_bytes(tensor)

        path = _write_replacing(os.path.join(out_dir, "model.safetensors"), tensors())
        config = reader.hf_config()
        if config is not None:
            _write_replacing(os.path.join(out_dir, "config.json"), [config])
        _fsync_dir(out_dir)
    logger.info("offload: exported %s (%s)", path, dtype)
    return path


def _write_replacing(path: str, pieces) -> str:
    """Writes `pieces` (bytes-like) to a new temporary file next to `path` (O_EXCL, never through
    a symlink), fsyncs it and renames it over `path`; on any failure the temporary file goes."""
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror} ({temp}); choose a directory you can write to") from None
    try:
        try:
            for piece in pieces:
                _write_all(fd, piece, temp)
            os.fsync(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise _space_error(temp, e) from None
            raise CheckpointError(f"cannot write {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    return path
