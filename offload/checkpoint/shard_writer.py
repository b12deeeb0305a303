"""Weights out in the Hugging Face sharded layout, written tensor by tensor: the plan of the
shards, and a writer that never leaves a set `from_pretrained` would take half written. No
engine and no model here (offload.checkpoint.pretrained_out says which tensors, from where).

Layout (what transformers' `save_pretrained` writes): one `model.safetensors` when the tensors
fit in one shard; else `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`
(`{"metadata": {"total_parameters": ..., "total_size": ...}, "weight_map": {key: file}}`),
each safetensors header with metadata `{"format": "pt"}`, plus any small files given
(`config.json`, `generation_config.json`). Tensors go into shards in the order given, by
huggingface_hub's rule (`split_into_shards`), so the files are the ones transformers would write.

Streamed. The plan needs names, dtypes and shapes only, so every shard's header is known before
any data: the writer creates every shard file at its final size with its header, and each
tensor's bytes go straight to their place (`pwrite`) whenever the caller has them, in any order
(an engine reads its weights unit by unit; a unit's tensors may sit in several shards). Nothing
is held beyond the tensor being written.

Safe. Everything is written into a temporary directory inside `out_dir`
(`.tmp-offload-save-<pid>-<random>`, flock'ed while in use; inside rather than beside it, so that
the moves are renames on one filesystem even where `out_dir` is a mount point, and a sweep for
dead saves looks only into the directory being saved to), each file fsynced. A save that fails removes it; one killed leaves it, and the next
save into that directory removes it (its lock died with the process). `commit` then, in order:
removes the files `from_pretrained` looks for (`model.safetensors`, the index), so that from
here until the end the directory holds no set it would load; removes shards of an earlier save
that the new index does not name; moves in the small files and the shards; moves in last the
file that makes the set loadable (the index, or the single `model.safetensors`); fsyncs the
directory. A kill or a full disk before that last rename leaves the earlier set as it was (or,
during the few renames of the commit, no loadable set), never a mixture. Files follow the
umask: these are the user's outputs, not private swap.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass, field

import torch

from offload.checkpoint.files import (
    SPACE_ERRNOS,
    CheckpointError,
    created_file,
    fsync_dir,
    lock_held,
    pwrite_all,
    space_error,
    write_all,
)
from offload.checkpoint.format import SAFETENSORS_DTYPES, safetensors_header, tensor_bytes
from offload.config.sizes import format_bytes, parse_bytes
from offload.errors import ConfigError, InsufficientSpaceError, OffloadError

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
TEMP_PREFIX = ".tmp-offload-save-"
TEMP = re.compile(re.escape(TEMP_PREFIX) + r"\d+-[0-9a-f]{8}")
METADATA = {"format": "pt"}


# ---- plain functions (tested directly) -----------------------------------------------------
def shard_size(value: object) -> int:
    """`max_shard_size` in bytes: a positive int, or text such as "5GB" (10^9, as transformers
    reads it) or "500MiB" (offload.config.sizes); a ConfigError naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(
            f"max_shard_size must be bytes as an int or a size such as '5GB' or '500MiB', got {value!r}", key="max_shard_size"
        )
    try:
        size = value if isinstance(value, int) else parse_bytes(value)
    except ValueError as e:
        raise ConfigError(f"max_shard_size: {e}", key="max_shard_size") from None
    if size <= 0:
        raise ConfigError(f"max_shard_size must be more than 0 bytes, got {value!r}", key="max_shard_size")
    return size


def split_into_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """The indices of `sizes` in each shard, by huggingface_hub's `split_torch_state_dict_into_shards`
    rule: in order, a shard is closed when the next tensor would take it past `max_bytes`; a
    tensor larger than `max_bytes` gets a shard of its own, placed when it is met (before the
    shard being filled). No tensor is split; at least one shard, possibly empty."""
    shards: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, size in enumerate(sizes):
        if size > max_bytes:
            shards.append([index])
            continue
        if current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of `count` shards, as transformers names them."""
    if count == 1:
        return [WEIGHTS]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the set: its key, dtype and shape, known before its values."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Place:
    """Where a tensor's bytes go: shard file `shard` (an index into `ShardPlan.files`), at `offset`."""

    shard: int
    offset: int
    spec: TensorSpec


@dataclass
class ShardPlan:
    """The files of the set and where every tensor goes in them."""

    files: list[str]
    headers: list[bytes]  # each shard's safetensors prefix (length + JSON header)
    file_bytes: list[int]
    places: dict[str, Place]
    weight_map: dict[str, str]
    total_size: int  # bytes of tensor data, as transformers' index counts them

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    @property
    def entry(self) -> str:
        """The file `from_pretrained` opens: the index, or the single file."""
        return INDEX if self.sharded else WEIGHTS


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> ShardPlan:
    """Shards for `specs` (in the order given) of at most `max_bytes` of data each."""
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{spec.key!r} is a {spec.dtype} tensor, which safetensors cannot store")
    members = split_into_shards([spec.nbytes for spec in specs], max_bytes)
    files = shard_names(len(members))
    headers, file_bytes, places, weight_map = [], [], {}, {}
    for shard, indices in enumerate(members):
        entries = [(specs[i].key, SAFETENSORS_DTYPES[specs[i].dtype], list(specs[i].shape), specs[i].nbytes) for i in indices]
        prefix, offsets = safetensors_header(entries, METADATA)
        headers.append(prefix)
        file_bytes.append(len(prefix) + sum(entry[3] for entry in entries))
        for i, offset in zip(indices, offsets):
            places[specs[i].key] = Place(shard, len(prefix) + offset, specs[i])
            weight_map[specs[i].key] = files[shard]
    return ShardPlan(files, headers, file_bytes, places, weight_map, sum(spec.nbytes for spec in specs))


def index_json(plan: ShardPlan, total_parameters: int | None) -> bytes:
    """`model.safetensors.index.json` as transformers writes it."""
    metadata: dict[str, int] = {"total_size": plan.total_size}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    body = {"metadata": metadata, "weight_map": plan.weight_map}
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def config_json(config: bytes, dtype: torch.dtype, architecture: str | None = None) -> bytes:
    """A Hugging Face config.json (as `to_json_string` gave it) saying the weights are `dtype`
    (and, when given, which class wrote them), as `save_pretrained` writes it."""
    body = json.loads(config)
    body["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in body:  # the name before transformers 4.56: keep the two in agreement
        body["torch_dtype"] = body["dtype"]
    if architecture is not None:
        body["architectures"] = [architecture]
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


# ---- the writer --------------------------------------------------------------------------------
@dataclass
class ShardSetWriter:
    """Writes the set `plan` describes into `out_dir` (see the module docstring): `open()`,
    `write(key, tensor)` for every tensor in any order, `commit()`; `abort()` (also on leaving a
    `with` block) removes what was written unless it was committed. `extra`: small files that go
    with the weights, by name (config.json)."""

    out_dir: str
    plan: ShardPlan
    extra: dict[str, bytes] = field(default_factory=dict)
    total_parameters: int | None = None
    temp: str | None = None
    _fds: list[int] = field(default_factory=list)  # the shards' descriptors, in plan order
    _lock_fd: int | None = None
    _written: set[str] = field(default_factory=set)
    _created_out_dir: bool = False
    _committed: bool = False

    def __enter__(self) -> ShardSetWriter:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def open(self) -> None:
        """Makes `out_dir` if needed, removes what dead saves left in it, checks the room, and
        creates every file of the set in a temporary directory (shards at full size with their
        headers, the index, the small files). Nothing that was in `out_dir` changes."""
        try:
            self._open()
        except BaseException:
            self.abort()
            raise

    def _open(self) -> None:
        out = self.out_dir
        if os.path.exists(out) and not os.path.isdir(out):
            raise CheckpointError(f"cannot save the weights to {out}: it is a file, not a directory; pass a directory path")
        try:
            if not os.path.isdir(out):
                os.makedirs(out)
                self._created_out_dir = True
            remove_dead_saves(out)
        except OSError as e:
            raise CheckpointError(
                f"cannot save the weights to {out}: {e.strerror}; choose a directory you can write to"
            ) from None
        small = {**self.extra, **({INDEX: index_json(self.plan, self.total_parameters)} if self.plan.sharded else {})}
        needed = sum(self.plan.file_bytes) + sum(len(data) for data in small.values())
        free = shutil.disk_usage(out).free
        if needed > free:
            raise InsufficientSpaceError(
                errno.ENOSPC,
                f"cannot save the weights to {out}: they need {format_bytes(needed)} and {format_bytes(free)} is free "
                "there (an earlier save in that directory is replaced only once the new one is complete, so both must "
                "fit for a moment); free space or save to another directory",
                out,
            )
        self.temp = os.path.join(out, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.mkdir(self.temp, 0o777)
            self._lock_fd = os.open(self.temp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            lock_held(self._lock_fd)
        except OSError as e:
            raise CheckpointError(
                f"cannot save the weights to {out}: {e.strerror}; choose a directory you can write to"
            ) from None
        advice = "choose a directory you can write to"
        for name, data in small.items():
            with created_file(os.path.join(self.temp, name), mode=0o666, needed=len(data), advice=advice) as fd:
                write_all(fd, data, name)
        for name, header, size in zip(self.plan.files, self.plan.headers, self.plan.file_bytes):
            self._create_shard(os.path.join(self.temp, name), header, size)

    def _create_shard(self, path: str, header: bytes, size: int) -> None:
        """A shard file at its full size with its header, held open until the commit (created_file
        is one file at a time): O_EXCL, never through a link, the umask's mode."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            self._fds.append(fd)
            _reserve(fd, size)
            pwrite_all(fd, header, 0, path)
        except OSError as e:
            raise _write_failure(path, e, size) from None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """`tensor`'s bytes at `key`'s place; its dtype and shape must be the plan's."""
        place = self.plan.places.get(key)
        if place is None or key in self._written:
            raise CheckpointError(f"{key!r} is {'written twice' if place else 'not in the plan'}: an offload bug")
        if tensor.dtype != place.spec.dtype or tuple(tensor.shape) != place.spec.shape:
            raise CheckpointError(
                f"{key!r} is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, planned as {place.spec.dtype} "
                f"{place.spec.shape}: an offload bug"
            )
        assert self.temp is not None, "open() first"
        path = os.path.join(self.temp, self.plan.files[place.shard])
        data = tensor_bytes(tensor.detach().cpu()) if tensor.numel() else memoryview(b"")
        try:
            pwrite_all(self._fds[place.shard], data, place.offset, path)
        except OSError as e:
            raise _write_failure(path, e, place.spec.nbytes) from None
        self._written.add(key)

    def commit(self) -> str:
        """Moves the complete set into `out_dir` (the order in the module docstring); returns the
        path of the file from_pretrained opens (the index, or model.safetensors)."""
        missing = [key for key in self.plan.places if key not in self._written]
        if missing:
            raise CheckpointError(f"{len(missing)} tensors were never written ({missing[:3]}): an offload bug")
        assert self.temp is not None, "open() first"
        for name, size, fd in zip(self.plan.files, self.plan.file_bytes, self._fds):
            try:
                os.fsync(fd)
            except OSError as e:
                raise _write_failure(os.path.join(self.temp, name), e, size) from None
        fsync_dir(self.temp)
        out, entry = self.out_dir, self.plan.entry
        try:
            for name in (WEIGHTS, INDEX):  # from here on the directory holds no set from_pretrained would load
                _remove_file(out, name)
            fsync_dir(out)
            for name in os.listdir(out):
                if SHARD.fullmatch(name) and name not in self.plan.files:
                    _remove_file(out, name)
            for name in sorted(os.listdir(self.temp), key=lambda name: name == entry):  # the entry last
                os.replace(os.path.join(self.temp, name), os.path.join(out, name))
            fsync_dir(out)
        except OSError as e:
            raise CheckpointError(
                f"cannot move the saved weights into {out}: {e.strerror} ({e.filename}); the directory may hold no "
                "loadable set now (never a mixture of two saves): fix that and save again"
            ) from None
        self._committed = True
        self.abort()
        logger.info(
            "offload: saved %s of weights to %s (%d files)", format_bytes(self.plan.total_size), out, len(self.plan.files)
        )
        return os.path.join(out, entry)

    def abort(self) -> None:
        """Removes the temporary directory (and `out_dir` if this save made it and it is empty)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._created_out_dir and not self._committed:
            with contextlib.suppress(OSError):
                os.rmdir(self.out_dir)
            self._created_out_dir = False


def _write_failure(path: str, error: OSError, needed: int) -> OffloadError:
    """A full disk, quota or size limit is the `space_error` naming `path`; another failure a
    CheckpointError naming it."""
    if error.errno in SPACE_ERRNOS:
        return space_error(path, error, needed)
    return CheckpointError(f"cannot write {path}: {error.strerror}; choose a directory you can write to")


def _reserve(fd: int, size: int) -> None:
    """The file's blocks, taken now: a full disk fails here, before any data is written."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, size)  # a filesystem without fallocate: the size only
        else:
            raise


def _remove_file(directory: str, name: str) -> None:
    path = os.path.join(directory, name)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory stands where a weights file goes", path)
        os.unlink(path)


def remove_dead_saves(out_dir: str) -> None:
    """Removes the temporary directories of saves into `out_dir` that were killed (their flock
    died with them); a save in progress holds its lock and is left alone."""
    for name in os.listdir(out_dir):
        if not TEMP.fullmatch(name):
            continue
        try:
            fd = os.open(os.path.join(out_dir, name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or not a directory of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a save in progress
        finally:
            os.close(fd)
        logger.info("offload: removing %s left by an interrupted save", os.path.join(out_dir, name))
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
