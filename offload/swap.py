"""The swap store: named tensors <-> files under `nvme_path/<run>/rank<r>/`.

Layout of one swap file (all offsets 4 KiB-aligned so the data moves with O_DIRECT):

    [0, 4096)            header: magic, format version, state, dtype, shape, data bytes,
                         CRC-32C of the data, CRC-32C of the header itself
    [4096, 4096 + pad)   the tensor's bytes, padded to a multiple of 4096

Space for every file is reserved when the tensor is created (posix_fallocate), so a full
disk fails at start with needed vs free bytes, not in the middle of a step.

A write moves the data first; the header (with the new checksum, computed by the I/O
workers as they write) is written when the write's handle is waited on. A write that dies
half way leaves the old header, whose checksum no longer matches: the next read raises
SwapCorruptError naming the file, as it does for a truncated file, a flipped byte or a
foreign header. A write that fails with an errno marks the header "failed".

Concurrency: the store is driven from one thread (the engine's). Operations on one name are
ordered: a read or write of a name first waits for that name's previous operation, so a
read submitted after a write returns the written data even if the write is still in
flight (the read's submit then blocks until the write is done). Operations on different
names run concurrently in the I/O engine. Every handle must be waited on; `close()` waits
for those still pending. A created but never written tensor reads as zeros.
"""
from __future__ import annotations

import errno as _errno
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
import uuid
from urllib.parse import quote

import torch

from offload.aio import ALIGN, AioEngine, AioHandle, direct_ok, probe_o_direct, round_up
from offload.errors import InsufficientSpaceError, SwapCorruptError, SwapError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
HEADER_SIZE = ALIGN
_MAGIC = b"OFLDSWAP"
_MAX_DIMS = 8
# magic, version, state, dtype name, ndim, shape[8], data nbytes, data crc32c
_HEADER = struct.Struct(f"<8sII32sI{_MAX_DIMS}QQI")
_STATE_EMPTY, _STATE_VALID, _STATE_FAILED = 0, 1, 2

from offload import _aio_ext  # noqa: E402  (after constants: used for header checksums)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _dtype_from_name(name: str) -> torch.dtype | None:
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else None


def _pack_header(state: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, crc: int) -> bytes:
    dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    body = _HEADER.pack(_MAGIC, FORMAT_VERSION, state, _dtype_name(dtype).encode(), len(shape), *dims, nbytes, crc)
    return body + struct.pack("<I", _aio_ext.crc32c_bytes(body))


def _dtype_nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


class _Entry:
    """One swap file. `pending` is the last handle not yet waited on (ordering per name)."""

    __slots__ = ("name", "path", "fd", "buffered_fd", "numel", "dtype", "nbytes", "padded", "pending", "written",
                 "write_submitted")

    def __init__(self, name, path, fd, numel, dtype):
        self.name, self.path, self.fd, self.numel, self.dtype = name, path, fd, numel, dtype
        self.buffered_fd: int | None = None
        self.nbytes = _dtype_nbytes(numel, dtype)
        self.padded = round_up(self.nbytes)
        self.pending: SwapHandle | None = None
        self.written = False
        self.write_submitted = False  # any write ever started (even one that failed)

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.padded


class SwapHandle:
    """An in-flight swap read or write. `wait()` completes it and raises its error, if any."""

    def __init__(self, store: "SwapStore", entry: _Entry, op: str, tensor: torch.Tensor,
                 aio: AioHandle | None, expected_crc: int | None = None):
        self._store, self._entry, self.op, self._tensor = store, entry, op, tensor
        self._aio = aio
        self._expected_crc = expected_crc
        self._done = aio is None
        self._error: BaseException | None = None
        # wait() may be called from two threads at once (the optimizer worker draining a slot's
        # writes, the transfer worker ordering its read of the same name behind the write)
        self._wait_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._entry.name

    def done(self) -> bool:
        return self._done or (self._aio is not None and self._aio.done())

    def wait(self) -> None:
        with self._wait_lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            try:
                self._finish()
            except BaseException as e:
                self._error = e
                raise
            finally:
                self._done = True
                with self._store._lock:
                    if self._entry.pending is self:
                        self._entry.pending = None
                self._tensor = None

    def _finish(self) -> None:
        entry = self._entry
        try:
            self._aio.wait()
        except SwapError as e:
            if self.op == "write":
                self._store._write_header(entry, _STATE_FAILED, 0, best_effort=True)
                raise SwapError(e.errno, f"swap write of {entry.name!r} failed: {e.strerror}; other swap files are "
                                         "unaffected; free disk space or fix the device and retry", e.filename) from None
            raise SwapError(e.errno, f"swap read of {entry.name!r} failed: {e.strerror}", e.filename) from None
        crc = self._aio.checksum
        if self.op == "write":
            self._store._write_header(entry, _STATE_VALID, crc)
            entry.written = True
        elif crc != self._expected_crc:
            raise SwapCorruptError(
                _errno.EIO, f"swap file for {entry.name!r} is corrupt: data checksum {crc:#010x} does not match "
                            f"the header's {self._expected_crc:#010x} (torn write or damaged disk); the tensor "
                            "must be restored from a checkpoint", entry.path)


class SwapStore:
    """Named tensors in swap files; see the module docstring for layout and ordering rules."""

    def __init__(self, nvme_path: str | os.PathLike, *, run_name: str | None = None, rank: int = 0,
                 block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 4, ledger=None):
        root = os.path.abspath(os.fspath(nvme_path))
        _validate_root(root)
        self.run_name = run_name or f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if os.sep in self.run_name or self.run_name in ("", ".", ".."):
            raise ValueError(f"run_name {self.run_name!r} must be a plain directory name")
        self.rank = int(rank)
        self.run_dir = os.path.join(root, self.run_name)
        self.path = os.path.join(self.run_dir, f"rank{self.rank}")
        self._created_run_dir = False
        try:
            try:
                os.mkdir(self.run_dir, 0o700)
                self._created_run_dir = True
                os.chmod(self.run_dir, 0o700)  # umask may have narrowed it; never widened
            except FileExistsError:
                pass  # another rank of the same run made it
            os.mkdir(self.path, 0o700)
            os.chmod(self.path, 0o700)
        except FileExistsError:
            raise SwapError(_errno.EEXIST, f"swap directory {self.path} already exists: another run with the same "
                                           "run name and rank is using it, or a crashed run left it; remove it or "
                                           "choose another run name", self.path) from None
        except OSError as e:
            raise SwapError(e.errno, f"cannot create swap directory {self.path}: {e.strerror}", self.path) from None
        self.direct = probe_o_direct(self.path)
        self.engine = AioEngine(block_size, queue_depth, threads)
        self.ledger = ledger
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._header_buf = mmap.mmap(-1, HEADER_SIZE)  # aligned staging for header I/O; used under _lock
        self._closed = False
        # data bytes submitted to the disk so far (padding included, headers not): benchmarks
        # compare them with the disk's bandwidth
        self.bytes_read = 0
        self.bytes_written = 0
        log.debug("swap store at %s (O_DIRECT: %s)", self.path, self.direct)

    # ---------------------------------------------------------------- creation
    def _file_path(self, name: str) -> str:
        fname = quote(name, safe="") + ".swp"
        if len(fname) > 240:
            raise ValueError(f"swap tensor name too long for a file name ({len(name)} chars): {name[:60]}...")
        return os.path.join(self.path, fname)

    def reserve(self, specs: dict[str, tuple[int, torch.dtype]]) -> None:
        """Create many swap tensors: checks free disk for the total first, then reserves each file."""
        self._check_open()
        new = {}
        for name, (numel, dtype) in specs.items():
            if name in self._entries or name in new:
                raise ValueError(f"swap tensor {name!r} already exists in {self.path}")
            if int(numel) < 0:
                raise ValueError(f"swap tensor {name!r}: numel must be >= 0, got {numel}")
            new[name] = (int(numel), dtype)
        needed = sum(HEADER_SIZE + round_up(_dtype_nbytes(n, d)) for n, d in new.values())
        free = shutil.disk_usage(self.path).free
        if needed > free:
            raise InsufficientSpaceError(
                _errno.ENOSPC, f"swap needs {needed} bytes ({needed / 2**30:.2f} GiB) for {len(new)} tensors but "
                               f"only {free} bytes ({free / 2**30:.2f} GiB) are free; free space or set "
                               "offload.nvme_path to a larger disk", self.path)
        made = []
        try:
            for name, (numel, dtype) in new.items():
                made.append(self._create_file(name, numel, dtype))
        except BaseException:
            for entry in made:
                self._remove_entry(entry)
            raise
        with self._lock:
            for entry in made:
                self._entries[entry.name] = entry
        if self.ledger is not None:
            for entry in made:
                self.ledger.allocate("nvme", entry.file_size, "swap")

    def create(self, name: str, numel: int, dtype: torch.dtype) -> None:
        self.reserve({name: (numel, dtype)})

    def _create_file(self, name: str, numel: int, dtype: torch.dtype) -> _Entry:
        path = self._file_path(name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise SwapError(e.errno, f"cannot create swap file for {name!r}: {e.strerror}", path) from None
        entry = _Entry(name, path, fd, numel, dtype)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, entry.file_size)
            except OSError as e:
                if e.errno in (_errno.EOPNOTSUPP, _errno.EINVAL):
                    log.warning("%s cannot preallocate (%s): a full disk may only show up mid-run", self.path,
                                e.strerror)
                    os.ftruncate(fd, entry.file_size)
                elif e.errno == _errno.ENOSPC:
                    raise InsufficientSpaceError(
                        _errno.ENOSPC, f"no space to reserve {entry.file_size} bytes for swap tensor {name!r} "
                                       f"({shutil.disk_usage(self.path).free} bytes free); free space or set "
                                       "offload.nvme_path to a larger disk", path) from None
                else:
                    raise
            self._write_header(entry, _STATE_EMPTY, 0, locked=False)
        except OSError as e:
            self._remove_entry(entry)
            if isinstance(e, SwapError):
                raise
            raise SwapError(e.errno, f"cannot reserve swap file for {name!r}: {e.strerror}", path) from None
        except BaseException:
            self._remove_entry(entry)
            raise
        return entry

    # ---------------------------------------------------------------- headers
    def _write_header(self, entry: _Entry, state: int, crc: int, *, best_effort: bool = False,
                      locked: bool = True) -> None:
        header = _pack_header(state, entry.dtype, (entry.numel,), entry.nbytes, crc)
        try:
            with self._lock:
                self._header_buf[:] = header.ljust(HEADER_SIZE, b"\0")
                n = os.pwritev(entry.fd, [self._header_buf], 0)
            if n != HEADER_SIZE:
                raise OSError(_errno.EIO, f"short header write ({n} of {HEADER_SIZE} bytes)")
        except OSError as e:
            if best_effort:
                log.error("could not mark swap file %s as failed: %s", entry.path, e)
                return
            raise SwapError(e.errno, f"cannot write the header of swap file for {entry.name!r}: {e.strerror}",
                            entry.path) from None

    def _read_header(self, entry: _Entry) -> tuple[int, int]:
        """Validate the on-disk header against the entry; returns (state, data crc)."""
        size = os.fstat(entry.fd).st_size
        if size < entry.file_size:
            raise SwapCorruptError(_errno.EIO, f"swap file for {entry.name!r} is truncated: {size} bytes, expected "
                                               f"{entry.file_size}", entry.path)
        with self._lock:
            n = os.preadv(entry.fd, [self._header_buf], 0)
            raw = bytes(self._header_buf[: _HEADER.size + 4])
        if n != HEADER_SIZE:
            raise SwapCorruptError(_errno.EIO, f"swap file for {entry.name!r}: short header read ({n} bytes)",
                                   entry.path)
        body, (hcrc,) = raw[: _HEADER.size], struct.unpack("<I", raw[_HEADER.size:])
        fields = _HEADER.unpack(body)
        magic, version, state, dname, ndim = fields[:5]
        shape = tuple(fields[5:5 + ndim]) if ndim <= _MAX_DIMS else ()
        nbytes, crc = fields[5 + _MAX_DIMS:]

        def bad(what: str) -> SwapCorruptError:
            return SwapCorruptError(_errno.EIO, f"swap file for {entry.name!r} has a wrong header: {what}; the file "
                                                "was damaged or replaced", entry.path)

        if magic != _MAGIC:
            raise bad(f"magic {magic!r} is not {_MAGIC!r}")
        if _aio_ext.crc32c_bytes(body) != hcrc:
            raise bad("header checksum mismatch")
        if version != FORMAT_VERSION:
            raise bad(f"format version {version}, this offload reads version {FORMAT_VERSION}")
        dtype = _dtype_from_name(dname.rstrip(b"\0").decode(errors="replace"))
        if dtype != entry.dtype or shape != (entry.numel,) or nbytes != entry.nbytes:
            raise bad(f"holds {dname.rstrip(bytes(1)).decode(errors='replace')} {list(shape)} ({nbytes} bytes), "
                      f"expected {_dtype_name(entry.dtype)} [{entry.numel}] ({entry.nbytes} bytes)")
        if state == _STATE_FAILED:
            raise SwapCorruptError(_errno.EIO, f"swap file for {entry.name!r}: its last write failed, the data is "
                                               "not valid; write it again or restore from a checkpoint", entry.path)
        if state not in (_STATE_EMPTY, _STATE_VALID):
            raise bad(f"unknown state {state}")
        return state, crc

    # ---------------------------------------------------------------- I/O
    def _entry_for(self, name: str, tensor: torch.Tensor) -> _Entry:
        self._check_open()
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"no swap tensor named {name!r} in {self.path}; create() or reserve() it first")
        if tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
            raise ValueError(f"swap tensor {name!r} is {_dtype_name(entry.dtype)}[{entry.numel}], the buffer is "
                             f"{_dtype_name(tensor.dtype)}[{tensor.numel()}]")
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"swap I/O of {name!r} needs a contiguous host tensor (use HostBufferPool.alloc)")
        if entry.pending is not None:  # order against the previous operation on this name
            entry.pending.wait()
        return entry

    def _fd_and_length(self, entry: _Entry, tensor: torch.Tensor) -> tuple[int, int]:
        if self.direct and direct_ok(tensor, HEADER_SIZE, entry.padded):
            return entry.fd, entry.padded
        if not self.direct:
            return entry.fd, entry.nbytes
        # An unaligned buffer on an O_DIRECT store: move exactly the data bytes through the page cache.
        if entry.buffered_fd is None:
            entry.buffered_fd = os.open(entry.path, os.O_RDWR)
        return entry.buffered_fd, entry.nbytes

    def write_from(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing `tensor` (a HostBufferPool buffer for O_DIRECT) to swap tensor `name`."""
        entry = self._entry_for(name, tensor)
        fd, io_len = self._fd_and_length(entry, tensor)
        aio = self.engine.submit_write(fd, tensor, HEADER_SIZE, nbytes=entry.nbytes, io_nbytes=io_len,
                                       checksum=True, path=entry.path)
        with self._lock:
            self.bytes_written += io_len
        handle = SwapHandle(self, entry, "write", tensor, aio)
        with self._lock:
            entry.pending = handle
        entry.write_submitted = True
        return handle

    def read_into(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        """Start reading swap tensor `name` into `tensor`; the handle's wait() verifies the checksum."""
        entry = self._entry_for(name, tensor)
        state, crc = self._read_header(entry)
        if state == _STATE_EMPTY:
            tensor.zero_()
            return SwapHandle(self, entry, "read", tensor, None)
        fd, io_len = self._fd_and_length(entry, tensor)
        aio = self.engine.submit_read(fd, tensor, HEADER_SIZE, nbytes=entry.nbytes, io_nbytes=io_len,
                                      checksum=True, path=entry.path)
        with self._lock:
            self.bytes_read += io_len
        handle = SwapHandle(self, entry, "read", tensor, aio, expected_crc=crc)
        with self._lock:
            entry.pending = handle
        return handle

    # ---------------------------------------------------------------- bookkeeping
    def names(self) -> list[str]:
        return list(self._entries)

    def never_written(self, name: str) -> bool:
        """True while no write of `name` was ever started: it still reads as zeros, without I/O."""
        return not self._entries[name].write_submitted

    def file_path(self, name: str) -> str:
        return self._entries[name].path

    def nbytes_on_disk(self) -> int:
        """Bytes of the swap files (headers and padding included), as reserved."""
        return sum(e.file_size for e in self._entries.values())

    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(_errno.EBADF, f"swap store at {self.path} is closed", self.path)

    def _remove_entry(self, entry: _Entry) -> None:
        for fd in (entry.fd, entry.buffered_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        entry.fd = entry.buffered_fd = None
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Wait for pending I/O, then remove the run's swap files and directories (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for entry in list(self._entries.values()):
            if entry.pending is not None:
                try:
                    entry.pending.wait()
                except Exception as e:  # the file is being removed; report but keep cleaning
                    errors.append(e)
        self.engine.close()
        for entry in self._entries.values():
            self._remove_entry(entry)
            if self.ledger is not None:
                self.ledger.release("nvme", entry.file_size, "swap")
        self._entries.clear()
        shutil.rmtree(self.path, ignore_errors=True)
        if self._created_run_dir:
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass  # other ranks' directories are still there; the last rank removes it
        else:
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass
        self._header_buf.close()
        for e in errors:
            log.error("swap I/O pending at close failed: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


def _validate_root(root: str) -> None:
    if not os.path.exists(root):
        raise SwapError(_errno.ENOENT, f"nvme_path {root} does not exist; create it (mkdir -p {root}) or set "
                                       "offload.nvme_path to an existing directory on a fast local disk", root)
    if not os.path.isdir(root):
        raise SwapError(_errno.ENOTDIR, f"nvme_path {root} is not a directory; set offload.nvme_path to a directory",
                        root)
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-write-test-", dir=root)
    except OSError as e:
        raise SwapError(e.errno, f"nvme_path {root} is not writable ({e.strerror}); fix its permissions or set "
                                 "offload.nvme_path to a writable directory", root) from None
    os.close(fd)
    os.unlink(probe)
