"""Pretrained weights on disk: safetensors files, opened read-only and checked whole before use.

`open_weight_files(path)` takes what `initialize(..., weights=path)` names: one `.safetensors`
file, or a directory holding `model.safetensors` or the Hugging Face sharded layout
(`model.safetensors.index.json` naming `*.safetensors` shards beside it), the order
transformers' `from_pretrained` looks for them in. Every file's header is read and checked
before the caller places anything (a header is a few KB; at 70B, 30 shards: milliseconds):

- the 8-byte header length fits the file and safetensors' own 100 MB limit; the header is a
  JSON object of tensors, each with a known dtype, a shape of non-negative integers and
  `data_offsets` whose length is dtype size x elements;
- every tensor lies inside the file (a file cut short is named as truncated), no two overlap;
- the index is a JSON object with a `weight_map` of key -> file name; each name is a plain
  relative path inside the directory (no `..`, not absolute) and no symlink, except the
  Hugging Face hub cache's (a snapshot's files are links into the repository's `blobs/`: a link
  whose target lies there is followed, any other is refused); each file exists and holds the
  keys the index gives it; no key is in two files.

Each file is opened once (O_NOFOLLOW) and kept open until `close()`, so replacing a file after
the check cannot change what is read. Reads (`read_segments`, waited with `PendingRead.wait`)
take byte ranges of tensors, merged where they touch, through the C++ I/O engine
(offload.storage.aio: `threads` workers with `queue_depth` pieces of `block_size` bytes in
flight, GIL released), buffered (a tensor's offset in a safetensors file is not 4 KiB-aligned,
which O_DIRECT needs). Safetensors files
carry no checksum: a flipped bit inside a tensor's bytes cannot be seen here; a file whose
structure is damaged or cut short can.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from offload.errors import SwapError, WeightsError
from offload.model.materialize import mapped_zeros
from offload.storage.aio import AioEngine

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors refuses larger headers (its own guard against a length that is garbage)
MAX_HEADER_BYTES = 100_000_000
# each merged read starts at this alignment in the read buffer
_BUFFER_ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are (`start`: absolute file offset)."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


@dataclass(frozen=True)
class Segment:
    """Elements [first, last) of a tensor, flattened in row-major order (contiguous bytes)."""

    tensor: StoredTensor
    first: int
    last: int

    @property
    def file_range(self) -> tuple[int, int]:
        size = self.tensor.itemsize
        return self.tensor.start + self.first * size, self.tensor.start + self.last * size


def _fail(file: str, what: str, key: str | None = None) -> WeightsError:
    where = f"{file}, key {key!r}" if key is not None else file
    return WeightsError(f"weights file {where}: {what}")


def parse_header(file: str, header: bytes, data_start: int, file_size: int) -> dict[str, StoredTensor]:
    """The tensors a safetensors header describes, checked against the file's size; a
    WeightsError naming `file` and the key for anything that does not hold."""
    try:
        table = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _fail(file, f"the header is not valid JSON ({error}): the file is damaged or not safetensors") from None
    if not isinstance(table, dict):
        raise _fail(file, "the header is not a JSON object: the file is damaged or not safetensors")
    metadata = table.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail(file, "the header's __metadata__ is not an object: the file is damaged")
    data_bytes = file_size - data_start
    tensors: dict[str, StoredTensor] = {}
    for key, entry in table.items():
        tensors[key] = _entry(file, key, entry, data_start, data_bytes)
    _check_overlaps(file, list(tensors.values()))
    return tensors


def _entry(file: str, key: str, entry, data_start: int, data_bytes: int) -> StoredTensor:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _fail(file, "the header entry lacks dtype, shape or data_offsets: the file is damaged", key)
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise _fail(file, f"unknown dtype {entry['dtype']!r} (offload reads {', '.join(DTYPES)})", key)
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _fail(file, f"shape {shape!r} is not a list of non-negative integers: the file is damaged", key)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(file, f"data_offsets {offsets!r} are not two increasing non-negative integers: the file is damaged", key)
    tensor = StoredTensor(key, file, dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    expected = tensor.numel * tensor.itemsize
    if tensor.nbytes != expected:
        raise _fail(
            file,
            f"its data_offsets span {tensor.nbytes} bytes, but {entry['dtype']} x {list(shape)} needs {expected}: "
            "the header lies about where the tensor is",
            key,
        )
    if offsets[1] > data_bytes:
        raise _fail(
            file,
            f"the header places its bytes up to byte {offsets[1]} of the data, which holds {data_bytes}: the file is "
            "truncated (an interrupted download or copy?) or its header lies; download or save it again",
            key,
        )
    return tensor


def _check_overlaps(file: str, tensors: list[StoredTensor]) -> None:
    placed = sorted((t for t in tensors if t.nbytes), key=lambda t: t.start)
    for before, after in zip(placed, placed[1:]):
        if after.start < before.start + before.nbytes:
            raise _fail(
                file,
                f"its bytes overlap those of {before.key!r} (data offsets {before.start}..{before.start + before.nbytes} and "
                f"{after.start}..{after.start + after.nbytes}): the header lies; the file is damaged",
                after.key,
            )


def read_header(fd: int, file: str) -> dict[str, StoredTensor]:
    """Reads and checks the header of the safetensors file open as `fd`."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise _fail(file, f"{size} bytes, shorter than a safetensors header: the file is truncated or not safetensors")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise _fail(
            file,
            f"the header claims {length} bytes, the file has {size}: the file is truncated, damaged or not safetensors",
        )
    header = os.pread(fd, length, 8)
    if len(header) != length:
        raise _fail(file, f"read {len(header)} of the header's {length} bytes: the file is truncated")
    return parse_header(file, header, 8 + length, size)


def check_index_name(name) -> str | None:
    """Why a file name from an index is refused (None when it is a plain relative path)."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if os.path.isabs(name) or "\\" in name or "\0" in name:
        return f"{name!r} is not a relative path inside the directory"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return f"{name!r} leaves the directory or is not a plain path (it has an empty, '.' or '..' component)"
    return None


def hub_blobs(directory: str) -> str | None:
    """The Hugging Face hub cache's `blobs/` directory when `directory` is one of its snapshots
    (`models--org--name/snapshots/<revision>`): the only place index-named links may point to."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    if os.path.basename(parent) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    return blobs if os.path.isdir(blobs) else None


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _open_named(directory: str, name: str, blobs: str | None, named_by: str = "") -> int:
    """Opens `directory/name` for reading: no component may be a symlink, except (in a hub
    snapshot) one that resolves into the repository's blobs. `named_by` ends the file's name in
    messages (which index named it, for which key)."""
    root = os.path.realpath(directory)
    path = os.path.join(root, name)
    shown = os.path.join(directory, name) + named_by
    if os.path.islink(path) or os.path.realpath(path) != os.path.normpath(path):
        target = os.path.realpath(path)
        if blobs is None or not _inside(target, os.path.realpath(blobs)):
            raise _fail(
                shown,
                f"is a symlink (or lies under one) to {target}, outside {directory}: refused (a weights directory "
                "names only files inside it; copy the file in)",
            )
        path = target
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(shown, "does not exist (an incomplete download or copy?)") from None
    except OSError as error:
        raise _fail(shown, f"cannot be opened: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _fail(shown, "is not a regular file")
    return fd


@dataclass
class PendingRead:
    """Reads in flight into `buffer` (WeightFiles.read_segments): `wait()` gives the buffer and
    where each segment's bytes are in it. The buffer is the I/O engine's until then."""

    buffer: torch.Tensor
    positions: list[int]
    handles: list = field(default_factory=list)  # (file, AioHandle)

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        for file, handle in self.handles:
            try:
                handle.wait()
            except SwapError as error:
                raise _fail(file, f"reading it failed: {error} (was the file changed or cut during the load?)") from None
        return self.buffer, self.positions


class WeightFiles:
    """The tensors of one `weights=` source, every header checked (see the module docstring).
    `tensors`: key -> StoredTensor. Open until `close()` (also a context manager)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tensors: dict[str, StoredTensor] = {}
        self._fds: dict[str, int] = {}
        self._engine: AioEngine | None = None

    def _add_file(self, fd: int, shown: str, expected_keys: Sequence[str] | None = None) -> None:
        self._fds[shown] = fd
        tensors = read_header(fd, shown)
        for key in expected_keys or ():
            if key not in tensors:
                raise _fail(shown, f"is named for key {key!r} by {INDEX_FILE}, but its header does not hold that key")
        for key, tensor in tensors.items():
            if key in self.tensors:
                raise _fail(shown, f"also in {self.tensors[key].file}: a key must be in one file only", key)
            self.tensors[key] = tensor

    @property
    def files(self) -> list[str]:
        return list(self._fds)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read_segments(
        self, segments: Sequence[Segment], block_size: int, queue_depth: int, threads: int, buffer: torch.Tensor | None = None
    ) -> PendingRead:
        """Starts reading the segments' bytes into `buffer` (a uint8 tensor, used when large
        enough; else a new one); `wait()` on the result gives (the buffer, offset of each
        segment's bytes in it, in `segments`' order). Segments that touch in a file are read by
        one request; the requests run on the I/O engine's workers at once, the caller meanwhile."""
        order = sorted(range(len(segments)), key=lambda i: (segments[i].tensor.file, segments[i].file_range))
        requests: list[list[int]] = []  # [file index of the first, file start, file end, buffer start]
        positions = [0] * len(segments)
        cursor = 0
        for i in order:
            start, end = segments[i].file_range
            last = requests[-1] if requests else None
            if last is not None and segments[last[0]].tensor.file == segments[i].tensor.file and last[2] == start:
                positions[i] = last[3] + (start - last[1])
                last[2] = end
                cursor = last[3] + (end - last[1])
                continue
            cursor = (cursor + _BUFFER_ALIGN - 1) // _BUFFER_ALIGN * _BUFFER_ALIGN
            requests.append([i, start, end, cursor])
            positions[i] = cursor
            cursor += end - start
        if buffer is None or buffer.numel() < cursor:
            buffer = mapped_zeros(cursor, torch.uint8)
        engine = self._io(block_size, queue_depth, threads)
        pending = PendingRead(buffer, positions)
        for first, start, end, at in requests:
            if end > start:
                file = segments[first].tensor.file
                pending.handles.append(
                    (file, engine.submit_read(self._fds[file], buffer[at : at + end - start], start, path=file, urgent=True))
                )
        return pending

    def _io(self, block_size: int, queue_depth: int, threads: int) -> AioEngine:
        if self._engine is None:
            self._engine = AioEngine(block_size=block_size, queue_depth=queue_depth, threads=threads)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_weight_files(path: str | os.PathLike) -> WeightFiles:
    """The `weights=` source at `path`, every header checked (module docstring)."""
    source = os.fspath(path)
    files = WeightFiles(source)
    try:
        if os.path.isdir(source):
            _open_directory(files, source)
        elif os.path.isfile(source):
            if source.endswith((".bin", ".pt", ".pth", ".ckpt")):
                raise _fail(source, "is a pickle checkpoint: weights= reads safetensors (save it with save_pretrained)")
            files._add_file(_open_user_file(source), source)
        else:
            raise WeightsError(f"weights={source!r}: no such file or directory")
    except BaseException:
        files.close()
        raise
    return files


def _open_user_file(path: str) -> int:
    """The file the user named: it may be a link (their choice), but must be a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise _fail(path, f"cannot be opened: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _fail(path, "is not a regular file")
    return fd


def _open_directory(files: WeightFiles, directory: str) -> None:
    blobs = hub_blobs(directory)
    if os.path.lexists(os.path.join(directory, SINGLE_FILE)):
        files._add_file(_open_named(directory, SINGLE_FILE, blobs), os.path.join(directory, SINGLE_FILE))
        return
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.lexists(index_path):
        present = sorted(os.listdir(directory))
        pickles = [name for name in present if name.endswith(".bin")]
        hint = (
            f"it has {', '.join(pickles[:3])}: pickle checkpoints are not read; load and save_pretrained it once as safetensors"
            if pickles
            else f"it holds {', '.join(present[:8]) or 'nothing'}"
        )
        raise WeightsError(f"weights={directory!r}: no {SINGLE_FILE} or {INDEX_FILE} in the directory; {hint}")
    index_fd = _open_named(directory, INDEX_FILE, blobs)
    try:
        with os.fdopen(os.dup(index_fd), "rb") as handle:
            weight_map = _read_index(index_path, handle.read())
    finally:
        os.close(index_fd)
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        refused = check_index_name(name)
        if refused is not None:
            raise _fail(index_path, f"names a file for key {key!r} that is refused: {refused}", key)
        by_file.setdefault(name, []).append(key)
    for name, keys in by_file.items():
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        fd = _open_named(directory, name, blobs, f" (named by {INDEX_FILE} for key {keys[0]!r}{more})")
        files._add_file(fd, os.path.join(directory, name), keys)


def _read_index(index_path: str, text: bytes) -> dict[str, str]:
    try:
        index = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _fail(index_path, f"is not valid JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(index_path, "has no weight_map object (key -> shard file name)")
    return weight_map
