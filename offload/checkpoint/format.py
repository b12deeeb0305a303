"""The checkpoint file format: writing, reading and checking a checkpoint directory, with no
engine in sight (offload.checkpoint.engine_state is the engine's side: what each rank saves and loads).
Writing and reading single files safely, and the checkpoint errors, are offload.checkpoint.files;
the root the checkpoints are in (tags, `latest`, which checkpoints are complete, rotation,
which directory a path means) is offload.checkpoint.root.

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

Atomicity: a save is complete when `latest` names it. Files are written into
`<root>/.tmp-<tag>-<pid>/`, each fsynced, the index last (it records the save's `generation`:
one more than that of the checkpoint `latest` named when the save began), the directory
fsynced and renamed to `<root>/<tag>`, and only then is `<root>/latest` replaced (temp file made
with O_EXCL, fsync, rename): that rename is the commit. A save that fails before it (a full
disk, an error, Ctrl-C) takes its directory back, leaving the root as it was. A process killed
before it leaves the previous checkpoint and `latest` as they were, and perhaps a complete
directory `latest` does not name, of a higher generation than `latest`'s checkpoint: an
unfinished save (so is one left newer by a `latest` set back by hand). A load through `latest`
loads `latest`'s checkpoint and warns of each unfinished one it passes over (which loads by its
tag); a save to an unfinished one's tag replaces it, as `overwrite` would, where another
existing tag is refused. A later save removes the temporary directories and files of dead saves.
A save in progress holds a flock on its temporary directory (and on its `latest` temp file), so
"dead" is judged by the lock (which the kernel drops with the process), not by whether a pid is
alive on this host. `overwrite` (and the replacement of an unfinished save) writes the new
checkpoint beside the old one, hard-links the old one's files the format never writes into it,
exchanges the two directories atomically and removes the old one once `latest` is replaced: a
kill leaves the old or the new one at the tag, with those files. `keep_last=N` removes older
checkpoints after `latest` points to the new one (renamed to `.trash-*` first, so a half-removed
one is never taken for a checkpoint); a failure of that tidying is a warning, the save being
complete. With several ranks the root must be a filesystem every rank sees.

Permissions. Checkpoints are the user's output: every file and directory of one (and `latest`)
is created with the umask's permissions (files 0666, directories 0777, less the umask), like
any file the user writes; swap files stay private (0600 in a 0700 directory: offload.storage).

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
import json
import logging
import math
import os
import random
import re
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from offload.checkpoint.files import (
    CheckpointCorruptError,
    CheckpointError,
    _open_regular,
    _read_exactly,
    open_dir,
)
from offload.checkpoint.root import (  # noqa: F401 (re-exported: the format's names, kept where they were)
    GENERATION,
    INDEX,
    LATEST,
    MAX_INDEX_BYTES,
    MAX_LATEST_BYTES,
    check_tag,
    checkpoints_to_remove,
    json_with_checksum,
    list_checkpoints,
    read_json_with_checksum,
    resolve,
    rotate,
)
from offload.storage.aio import crc32c

logger = logging.getLogger(__name__)

FORMAT = "offload-checkpoint"
FORMAT_VERSION = 1
KINDS = ("master", "exp_avg", "exp_avg_sq")
BUFFERS = "buffers.safetensors"
CLIENT_STATE = "client_state.pt"
HF_CONFIG = "hf_config.json"
CHUNK_BYTES = 16 << 20  # one CRC-32C per this many bytes of a slice
CHUNK_ELEMENTS = CHUNK_BYTES // 4
DATA_ALIGN = 4096  # the data of a rank file starts at a multiple of this
RANK_JSON = re.compile(r"rank(\d+)\.json")
RANK_STATE = re.compile(r"rank(\d+)\.safetensors")
SMALL_FILES = (BUFFERS, CLIENT_STATE, HF_CONFIG)


# ---- plain functions (tested directly) -----------------------------------------------------
def is_format_file(name: str) -> bool:
    """Whether a checkpoint directory's entry `name` is one the format writes."""
    return name == INDEX or name in SMALL_FILES or bool(RANK_JSON.fullmatch(name) or RANK_STATE.fullmatch(name))


def chunk_bounds(numel: int, chunk: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) of each checksummed chunk of a slice of `numel` elements."""
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def coverage_fault(ranges: list[tuple[int, int]], numel: int) -> str | None:
    """None when the [start, end) `ranges` (in any order) cover [0, numel) exactly once, else
    what is wrong with them ("has a gap at elements 4..8", "overlaps itself at 2..6")."""
    cursor = 0
    for start, end in sorted(ranges):
        if start > cursor:
            return f"has a gap at elements {cursor}..{start}"
        if start < cursor:
            return f"overlaps itself at elements {start}..{min(cursor, end)}"
        cursor = end
    if cursor != numel:
        return f"has a gap at elements {cursor}..{numel}" if cursor < numel else f"runs past its {numel} elements"
    return None


def safetensors_header(
    entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str], align: int = 8
) -> tuple[bytes, list[int]]:
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
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# ---- small file helpers ----------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    # ndarray.data is memoryview(array), typed as one (numpy's stubs make ndarray a buffer on Python >= 3.12 only)
    return tensor.numpy().data.cast("B")


def _checked_name(name, directory: str) -> str:
    """`name` if it is a file name the format writes, else a CheckpointCorruptError."""
    if not isinstance(name, str) or not (name in SMALL_FILES or RANK_JSON.fullmatch(name) or RANK_STATE.fullmatch(name)):
        raise CheckpointCorruptError(
            f"checkpoint {directory} names a file {name!r} that the format never writes: refusing to read it "
            "(the index or a rank file was crafted or damaged)"
        )
    return name


def _read_verified(dir_fd: int, directory: str, name: str, info) -> bytes:
    """A file the index lists, checked against its declared size (read no further) and checksum."""
    path = os.path.join(directory, _checked_name(name, directory))
    if not (isinstance(info, dict) and _is_count(info.get("bytes")) and _is_count(info.get("crc32c"))):
        raise CheckpointCorruptError(f"checkpoint {directory}: the index's entry for {name} is malformed")
    fd, size = _open_regular(dir_fd, name, path)
    try:
        if size != info["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint file {path} is {size} bytes, the index says {info['bytes']}: it was truncated or replaced"
            )
        data = _read_exactly(fd, info["bytes"], path)
    finally:
        os.close(fd)
    if crc32c(data) != info["crc32c"]:
        raise CheckpointCorruptError(f"checkpoint file {path} fails its checksum: it was edited or damaged")
    return data


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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

        legacy = np.random.get_state(legacy=True)
        # the tuple form: the global RandomState is MT19937 (a dict only after np.random.set_bit_generator)
        assert isinstance(legacy, tuple)
        name, keys, pos, has_gauss, cached = legacy
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
@dataclass
class Slice:
    key: str  # "<param>/<kind>"
    param: str
    kind: str
    start: int
    end: int
    shard_pos: int
    unit: int


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
    return CheckpointCorruptError(
        f"{where}: {what} is malformed (the file was crafted or damaged); the checkpoint cannot be loaded"
    )


class CheckpointReader:
    """A verified view of a checkpoint: its index, and reads of any element range of any
    parameter's state, checked chunk by chunk against the recorded checksums.

    Every file is opened once, relative to the checkpoint directory (see the module docstring
    on what is trusted); the rank files stay open until close()."""

    def __init__(self, path, tag: str | None = None) -> None:
        self.directory = resolve(path, tag)
        self._dir_fd: int | None = open_dir(self.directory)
        self._fds: dict[str, int] = {}
        self._bounce: torch.Tensor | None = None
        try:
            self._load_index()
        except BaseException:
            self.close()
            raise

    @property
    def _dir(self) -> int:
        """The checkpoint directory's descriptor: open from __init__ until close()."""
        assert self._dir_fd is not None, "CheckpointReader read after close()"
        return self._dir_fd

    def _load_index(self) -> None:
        index_path = os.path.join(self.directory, INDEX)
        self.index = read_json_with_checksum(self._dir, self.directory, INDEX)
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{index_path} is not an offload checkpoint index")
        if self.index.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {self.directory} has format version {self.index.get('version')}; this "
                f"offload reads version {FORMAT_VERSION}"
            )
        files = self.index.get("files")
        ranks = self.index.get("ranks")
        params = self.index.get("params")
        if not isinstance(files, dict) or not isinstance(ranks, list) or not ranks or not isinstance(params, dict):
            raise _malformed(index_path, "its list of files, ranks or parameters")
        self.files: dict[str, Any] = files
        for name, info in params.items():
            if not (
                isinstance(info, dict)
                and isinstance(info.get("shape"), list)
                and all(_is_count(d) for d in info["shape"])
                and _is_count(info.get("numel"))
                and info["numel"] == math.prod(info["shape"])
            ):
                raise _malformed(index_path, f"the entry of parameter {name!r}")
        self.parts = []
        self.stored: dict[tuple[str, str], list[_Stored]] = {}
        for name in ranks:
            if not isinstance(name, str) or not RANK_JSON.fullmatch(name) or name not in self.files:
                raise _malformed(index_path, f"its rank file entry {name!r}")
            try:
                part = json.loads(_read_verified(self._dir, self.directory, name, self.files[name]))
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
        if not (
            _is_count(file_bytes)
            and _is_count(header_bytes)
            and 8 <= header_bytes <= file_bytes
            and _is_count(part.get("header_crc32c"))
            and isinstance(part.get("slices"), list)
        ):
            raise _malformed(where, "the sizes of its state file")
        path = os.path.join(self.directory, part["file"])
        fd = self._open_rank_file(part["file"], path, file_bytes, header_bytes, part["header_crc32c"])
        for record in part["slices"]:
            try:
                start, end, offset, crcs = record["start"], record["end"], record["offset"], record["crc32c"]
                param, kind, key = record["param"], record["kind"], record["key"]
                ok = (
                    all(_is_count(v) for v in (start, end, offset))
                    and start <= end
                    and offset >= header_bytes
                    and offset + 4 * (end - start) <= file_bytes
                    and isinstance(crcs, list)
                    and len(crcs) == len(chunk_bounds(end - start))
                    and all(_is_count(c) for c in crcs)
                    and kind in KINDS
                    and isinstance(key, str)
                    and isinstance(param, str)
                )
            except (KeyError, TypeError):
                ok = False
            if not ok:
                raise _malformed(where, f"slice record {str(record)[:120]}")
            self.stored.setdefault((param, kind), []).append(_Stored(start, end, path, fd, offset, crcs, key))

    def _open_rank_file(self, name: str, path: str, file_bytes: int, header_bytes: int, header_crc: int) -> int:
        if name in self._fds:
            raise CheckpointCorruptError(f"checkpoint {self.directory}: two rank files name the state file {path}")
        fd, size = _open_regular(self._dir, name, path)
        self._fds[name] = fd
        if size != file_bytes:
            raise CheckpointCorruptError(
                f"checkpoint file {path} is {size} bytes, expected {file_bytes}: it was truncated or replaced"
            )
        if crc32c(_read_exactly(fd, header_bytes, path)) != header_crc:
            raise CheckpointCorruptError(f"checkpoint file {path}: its safetensors header fails its checksum (edited or damaged)")
        return fd

    @staticmethod
    def _pread(piece: _Stored, target: torch.Tensor, offset: int) -> None:
        view = tensor_bytes(target) if target.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(piece.fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointCorruptError(
                    f"checkpoint file {piece.path} ends early (short read at byte {offset + done}): truncated"
                )
            done += n

    def _verified_chunks(self, param: str, kind: str, start: int, end: int, out: torch.Tensor | None):
        """Elements [start, end) of `param`'s `kind`, chunk by checksummed chunk: yields (low,
        high, values) in order, `values` holding elements [low, high) once their chunk passed its
        checksum. Each stored chunk is read once: into `out` (fp32, end - start elements, when
        given) where the chunk lies wholly inside the range, else into a bounce buffer of one
        chunk (16 MiB), whose values are valid until the next one is yielded."""
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
                whole = out is not None and cursor <= g0 and g1 <= high
                if whole:
                    assert out is not None
                    target = out[g0 - start : g1 - start]
                else:
                    if self._bounce is None:
                        self._bounce = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
                    target = self._bounce[: c1 - c0]
                self._pread(piece, target, piece.offset + 4 * c0)
                if crc32c(target) != piece.crcs[c0 // CHUNK_ELEMENTS]:
                    raise CheckpointCorruptError(
                        f"checkpoint file {piece.path}: tensor {piece.key!r} (bytes {piece.offset + 4 * c0}.."
                        f"{piece.offset + 4 * c1}) fails its checksum: the file was edited or damaged"
                    )
                low, top = max(g0, cursor), min(g1, high)
                yield low, top, target[low - g0 : top - g0]
            cursor = high
            if cursor >= end:
                break
        if cursor < end:
            raise CheckpointCorruptError(f"checkpoint {self.directory} lacks elements {cursor}..{end} of {param!r} {kind}")

    def read_range(self, param: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        """Fills `out` (fp32, end - start elements) with elements [start, end) of `param`'s `kind`."""
        for low, high, values in self._verified_chunks(param, kind, start, end, out):
            destination = out[low - start : high - start]
            if values.data_ptr() != destination.data_ptr():
                destination.copy_(values)

    def scan_range(self, param: str, kind: str, start: int, end: int):
        """Elements [start, end) of `param`'s `kind`, read and checked chunk by chunk into one
        bounce buffer and yielded as (low, high, values): a pass over any amount of state in
        16 MiB of RAM (values are valid until the next chunk is yielded)."""
        yield from self._verified_chunks(param, kind, start, end, None)

    def slice_faults(self) -> list[str]:
        """What is wrong with the rank files' slices as a whole, each a sentence: a slice of a
        parameter the index does not list, a key that is not `<param>/<kind>`, or a state kind
        whose slices leave a gap in [0, numel) or overlap (`coverage_fault`)."""
        params = self.index["params"]
        faults = []
        for (param, kind), pieces in sorted(self.stored.items()):
            if param not in params:
                faults.append(f"it holds {kind} slices of {param!r}, a parameter its index does not list")
                continue
            wrong_keys = sorted({p.key for p in pieces if p.key != f"{param}/{kind}"})
            if wrong_keys:
                faults.append(f"slice keys {wrong_keys[:3]} do not name {param}/{kind}")
            fault = coverage_fault([(p.start, p.end) for p in pieces], params[param]["numel"])
            if fault is not None:
                faults.append(f"the {kind} of {param!r} {fault}")
        return faults

    def read_param(self, param: str, kind: str = "master") -> torch.Tensor:
        info = self.index["params"][param]
        stored = sum(p.end - p.start for p in self.stored.get((param, kind), []))
        if stored < info["numel"]:  # before allocating what the index claims
            raise CheckpointCorruptError(
                f"checkpoint {self.directory} holds {stored} elements of {param!r} {kind}, its index says {info['numel']}"
            )
        out = torch.empty(info["numel"], dtype=torch.float32)
        self.read_range(param, kind, 0, info["numel"], out)
        return out.view(info["shape"])

    def buffers(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as safetensors_load

        if BUFFERS not in self.files:
            raise CheckpointCorruptError(f"checkpoint {self.directory}: its index lists no {BUFFERS}")
        data = _read_verified(self._dir, self.directory, BUFFERS, self.files[BUFFERS])
        try:
            return safetensors_load(data)
        except Exception as e:  # noqa: BLE001  (safetensors' own parse errors: a crafted file that passes its checksum)
            raise _malformed(os.path.join(self.directory, BUFFERS), f"its content ({e})") from None

    def client_state(self) -> dict:
        if CLIENT_STATE not in self.files:
            return {}
        import io

        data = _read_verified(self._dir, self.directory, CLIENT_STATE, self.files[CLIENT_STATE])
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # noqa: BLE001  (weights_only refuses anything but plain data: report, never run it)
            raise CheckpointCorruptError(
                f"checkpoint file {os.path.join(self.directory, CLIENT_STATE)} cannot be "
                f"loaded as plain data ({type(e).__name__}: {str(e)[:200]}); it was crafted "
                "or written by something else"
            ) from None

    def hf_config(self) -> bytes | None:
        if HF_CONFIG not in self.files:
            return None
        return _read_verified(self._dir, self.directory, HF_CONFIG, self.files[HF_CONFIG])

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
