"""The swap store: named tensors <-> swap files of a private run directory under `nvme_path`.

Where the files live: a private run directory under `nvme_path`, made, checked and removed
through descriptors by `offload.storage.swap_layout` (which also sweeps what dead runs left).

Nothing left behind. A swap file has no name: it is an O_TMPFILE in the rank directory (or,
where the filesystem has no O_TMPFILE, a file unlinked right after it is opened) and lives
only as long as its descriptor, so the kernel reclaims the space on any death: SIGKILL, an
uncaught exception, an exit without close(), a store dropped by the garbage collector. Each
store holds a shared flock on its run directory; what a dead run can leave (its empty
directories) is removed by the next store made under the same `nvme_path` (`sweep_dead_runs`),
and `close()`, garbage collection and interpreter exit (atexit) remove the store's own.
`file_path(name)` is the name the file would have, used in messages; `proc_path(name)` opens
the unnamed file (tests, debugging).

Each swap file is a 4 KiB header (`offload.storage.swap_layout`) and the tensor's bytes,
padded to a multiple of 4096.

Space for every file is reserved when the tensor is created (posix_fallocate), so a full
disk fails at start with needed vs free bytes, not in the middle of a step.

Each file is held open for the run (its descriptor is the file): `reserve` raises the process's
soft limit on open files when the new ones would not fit under it (a 70B model's state is
thousands of files; many shells start processes with a limit of 1024), or, when the hard limit
is too low, says which limit to raise before it makes any (`offload.platform.descriptors`).

Identity. The store remembers, per name, the header it last wrote (state, data checksum,
generation); a read checks the on-disk header against it: another tensor's file copied over
(wrong name), another run's (wrong run id), or an older self-consistent copy of the same file
(older generation) is a SwapCorruptError naming the file, as are a torn write (data checksum),
a truncated file, a flipped byte or a foreign header.

A write moves the data first; the header (the next generation, with the new checksum computed
by the I/O workers as they write) is written when the write completes. A write that fails
with an errno marks the name failed (in memory, and in its header): reads of it raise until
it is written again.

Concurrency and waiting. The store is driven from the engine's threads; its own state is
guarded by one lock. Operations on one name are ordered: a read or write of a name first
completes that name's previous operation, so a read submitted after a write returns the
written data even if the write is still in flight (the read's submit then blocks until the
write is done). Operations on different names run concurrently in the I/O engine.
`SwapHandle.wait()` is safe from several threads and interrupt-safe: an exception raised while
waiting (Ctrl-C's KeyboardInterrupt) leaves the operation pending and remembered (the next
operation on the name, or close(), completes it, header included); waiting again gives the
real result. A failed operation raises its error on the first wait() that completes it (the
owner learns of it once) and later waits return: a failed handle left in a wait list does
not re-raise forever, and the name stays failed until rewritten, so nothing can read what
the failed write left. A created but never written tensor reads as zeros.
"""

from __future__ import annotations

import atexit
import errno as _errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import uuid
import weakref
from urllib.parse import quote

import torch

from offload import _aio_ext
from offload.config.sizes import format_bytes
from offload.errors import InsufficientSpaceError, SwapCorruptError, SwapError
from offload.platform.descriptors import DescriptorLimitError, make_room_for_descriptors
from offload.storage.aio import AioEngine, AioHandle, direct_ok, probe_o_direct, round_up
from offload.storage.swap_layout import (
    _HEADER,
    _MAGIC,
    _MAX_DIMS,
    _MAX_NAME,
    _STATE_EMPTY,
    _STATE_FAILED,
    _STATE_NAMES,
    _STATE_VALID,
    _SWAP_SUFFIX,
    FORMAT_VERSION,
    HEADER_SIZE,
    _dtype_from_name,
    _dtype_name,
    _not_writable,
    _open_private_dir,
    _open_root,
    _pack_header,
    _rmdir_if_same,
    sweep_dead_runs,
)

log = logging.getLogger(__name__)


def _dtype_nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


class _Entry:
    """One swap file, and what the store last wrote to its header (state, crc, generation).

    `pending` is the last operation not yet completed (ordering per name)."""

    __slots__ = (
        "buffered_fd",
        "crc",
        "dtype",
        "fd",
        "generation",
        "name",
        "nbytes",
        "numel",
        "padded",
        "path",
        "pending",
        "state",
        "write_submitted",
    )

    def __init__(self, name: str, path: str, fd: int, numel: int, dtype: torch.dtype) -> None:
        self.name, self.path, self.numel, self.dtype = name, path, numel, dtype
        self.fd: int | None = fd  # None once the file is freed (_remove_entry)
        self.buffered_fd: int | None = None
        self.nbytes = _dtype_nbytes(numel, dtype)
        self.padded = round_up(self.nbytes)
        self.pending: SwapHandle | None = None
        self.write_submitted = False  # any write ever started (even one that failed)
        self.state = _STATE_EMPTY
        self.crc = 0
        self.generation = 0

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.padded


class SwapHandle:
    """An in-flight swap read or write. `wait()` completes it and raises its error, if any.

    Who completes it: whichever thread first waits on it after the I/O is done (its owner, the
    next operation on the same name, or close()); completion writes a write's header. See the
    module docstring for interrupts and for errors being raised once."""

    def __init__(
        self,
        store: SwapStore,
        entry: _Entry,
        op: str,
        tensor: torch.Tensor,
        aio: AioHandle | None,
        *,
        generation: int = 0,
        expected_crc: int | None = None,
    ):
        self._store, self._entry, self.op = store, entry, op
        self._tensor: torch.Tensor | None = tensor  # the buffer, kept alive until completion
        self._aio = aio
        self._generation = generation
        self._expected_crc = expected_crc
        self._done = aio is None
        self._error: BaseException | None = None
        self._reported = False
        # wait() may be called from two threads at once (the optimizer worker draining a slot's
        # writes, the transfer worker ordering its read of the same name behind the write)
        self._wait_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._entry.name

    @property
    def error(self) -> BaseException | None:
        """The operation's error once it completed (None while pending or after success)."""
        return self._error

    def done(self) -> bool:
        return self._done or (self._aio is not None and self._aio.done())

    def wait(self) -> None:
        """Completes the operation; raises its error if it failed and no wait() raised it before."""
        error = self._complete()
        if error is not None and self._mark_reported():
            raise error

    def _complete(self) -> BaseException | None:
        """Completes the operation (idempotent; an interrupt leaves it pending); returns its error."""
        with self._wait_lock:
            if not self._done:
                self._error = self._finish()  # an exception from here is an interrupt: still pending
                self._done = True
                self._tensor = None
                with self._store._lock:
                    if self._entry.pending is self:
                        self._entry.pending = None
                    if self._error is not None:
                        self._store._unreported.add(self)
            return self._error

    def _mark_reported(self) -> bool:
        """Whether this call is the one that reports the error (False if reported before)."""
        with self._wait_lock:
            first, self._reported = not self._reported, True
        with self._store._lock:
            self._store._unreported.discard(self)
        return first

    def _finish(self) -> BaseException | None:
        """Waits for the I/O and records its outcome. Every step may run again after an
        interrupt (the header rewritten is the same), so a retry finishes the job."""
        entry, store = self._entry, self._store
        aio = self._aio
        assert aio is not None  # a handle without I/O (a read of a never written name) starts done
        try:
            aio.wait()
        except SwapError as e:
            if self.op == "write":
                store._record_write(entry, _STATE_FAILED, 0, self._generation, best_effort=True)
                return SwapError(
                    e.errno,
                    f"swap write of {entry.name!r} failed: {e.strerror}; other swap files are "
                    "unaffected; free disk space or fix the device, then write it again or "
                    "load a checkpoint",
                    e.filename,
                )
            return SwapError(e.errno, f"swap read of {entry.name!r} failed: {e.strerror}", e.filename)
        crc = aio.checksum
        if self.op == "write":
            try:
                store._record_write(entry, _STATE_VALID, crc, self._generation)
            except SwapError as e:
                return e
            return None
        if crc != self._expected_crc:
            return SwapCorruptError(
                _errno.EIO,
                f"swap file for {entry.name!r} is corrupt: data checksum {crc:#010x} does not match "
                f"the header's {self._expected_crc:#010x} (torn write or damaged disk); the tensor "
                "must be restored from a checkpoint",
                entry.path,
            )
        return None


_live_stores: weakref.WeakSet[SwapStore] = weakref.WeakSet()


@atexit.register
def _close_live_stores() -> None:
    """Interpreter exit without close(): remove the stores' directories (their files' space is
    reclaimed by the kernel in any case)."""
    for store in list(_live_stores):
        try:
            store.close()
        except BaseException:  # exiting: nothing more to do than log
            log.debug("closing swap store %s at exit failed", getattr(store, "path", "?"), exc_info=True)


class SwapStore:
    """Named tensors in swap files; see the module docstring for layout and ordering rules."""

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        *,
        run_name: str | None = None,
        rank: int = 0,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 4,
        background_depth: int = 0,
        ledger=None,
    ):
        self._closed = True  # until fully made: close() and __del__ then only release descriptors
        self._owner_pid = os.getpid()  # a forked child (a data loader worker) must not close it
        self._root_fd = self._run_fd = self._rank_fd = None
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._unreported: weakref.WeakSet[SwapHandle] = weakref.WeakSet()  # failed, not yet raised to anyone
        root = os.path.abspath(os.fspath(nvme_path))
        self.run_name = run_name or f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if (
            not isinstance(self.run_name, str)
            or self.run_name in ("", ".", "..")
            or self.run_name.startswith(".")
            or os.sep in self.run_name
            or "\0" in self.run_name
        ):
            raise ValueError(f"run_name {self.run_name!r} must be a plain directory name, not starting with '.'")
        self.rank = int(rank)
        self.root = root
        self.run_dir = os.path.join(root, self.run_name)
        self.path = os.path.join(self.run_dir, f"rank{self.rank}")
        self.run_id = uuid.uuid4().bytes  # in every header: a file from another store is foreign
        try:
            self._root_fd = _open_root(root)
            self.other_runs = sweep_dead_runs(root, dir_fd=self._root_fd, keep=self.run_name)
            self._run_fd, self._rank_fd = self._make_directories()
            self.direct = probe_o_direct(self.path, dir_fd=self._rank_fd)
            self.engine = AioEngine(block_size, queue_depth, threads, background_depth)
        except BaseException:
            self._release_directories()
            raise
        self._tmpfile = hasattr(os, "O_TMPFILE")  # cleared at the first refusal
        self.ledger = ledger
        self._header_buf = mmap.mmap(-1, HEADER_SIZE)  # aligned staging for header I/O; used under _lock
        self._closed = False
        # data bytes submitted to the disk so far (padding included, headers not): benchmarks
        # compare them with the disk's bandwidth
        self.bytes_read = 0
        self.bytes_written = 0
        _live_stores.add(self)
        log.debug("swap store at %s (O_DIRECT: %s)", self.path, self.direct)

    # ---------------------------------------------------------------- directories
    def _make_directories(self) -> tuple[int, int]:
        """Creates (or, for another rank of the run, joins) the run directory and creates this
        rank's; returns their descriptors, the run's holding a shared flock."""
        root, name, rank_name = self.root, self.run_name, f"rank{self.rank}"
        root_fd = self._root_fd
        assert root_fd is not None  # __init__ opens nvme_path before making the directories
        for _ in range(10):  # a concurrent sweep may remove a run directory not yet locked: retry
            created = False
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)
                created = True
            except FileExistsError:
                pass  # another rank of the same run made it; checked below like any existing one
            except OSError as e:
                raise _not_writable(root, e) from None
            run_fd = _open_private_dir(name, root_fd, self.run_dir, fresh=created)
            try:
                fcntl.flock(run_fd, fcntl.LOCK_SH)  # a sweep takes it exclusively, briefly
                if os.fstat(run_fd).st_nlink == 0:
                    os.close(run_fd)
                    continue  # swept between mkdir and flock
                try:
                    os.mkdir(rank_name, 0o700, dir_fd=run_fd)
                except FileNotFoundError:
                    os.close(run_fd)
                    continue
                except FileExistsError:
                    raise SwapError(
                        _errno.EEXIST,
                        f"swap directory {self.path} already exists: another run with the "
                        "same run name and rank is using it; choose another run name",
                        self.path,
                    ) from None
                except OSError as e:
                    raise SwapError(e.errno, f"cannot create swap directory {self.path}: {e.strerror}", self.path) from None
                return run_fd, _open_private_dir(rank_name, run_fd, self.path, fresh=True)
            except BaseException:
                os.close(run_fd)
                raise
        raise SwapError(
            _errno.EAGAIN,
            f"cannot create swap directory {self.path}: it keeps being removed (another process sweeping this nvme_path?)",
            self.path,
        )

    def _release_directories(self) -> None:
        """Removes this rank's directory and, when no other rank's is left, the run's; closes the
        descriptors. Only ever removes the directories this store made (checked by inode)."""
        if self._rank_fd is not None:
            # the run's and the rank's descriptors are set together (_make_directories) and the
            # root's before them; they are released rank, run, root
            assert self._run_fd is not None
            _rmdir_if_same(f"rank{self.rank}", self._run_fd, self._rank_fd, self.path)
            os.close(self._rank_fd)
            self._rank_fd = None
        if self._run_fd is not None:
            # still under our shared lock: a sweep cannot race; a rank of this run joining right
            # now retries on ENOENT
            assert self._root_fd is not None
            _rmdir_if_same(self.run_name, self._root_fd, self._run_fd, self.run_dir, quiet_if_busy=True)
            os.close(self._run_fd)
            self._run_fd = None
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    # ---------------------------------------------------------------- creation
    def _file_path(self, name: str) -> str:
        fname = quote(name, safe="") + _SWAP_SUFFIX
        if len(fname) > 240 or len(name.encode()) > _MAX_NAME:
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
        free = self._free_bytes()
        if needed > free:
            raise InsufficientSpaceError(
                _errno.ENOSPC,
                f"swap needs {needed} bytes ({format_bytes(needed)}) for {len(new)} tensors but "
                f"only {free} bytes ({format_bytes(free)}) are free in {self.root}"
                f"{self._other_runs_note()}; free space or set offload.nvme_path to a larger disk",
                self.path,
            )
        try:
            make_room_for_descriptors(len(new))
        except DescriptorLimitError as e:
            raise SwapError(
                e.errno, f"cannot hold {len(new)} more swap files open in {self.path}: {e.strerror}", self.path
            ) from None
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

    def _free_bytes(self) -> int:
        assert self._rank_fd is not None  # the store is open (its directory exists while it is)
        st = os.statvfs(self._rank_fd)
        return st.f_bavail * st.f_frsize

    def _other_runs_note(self) -> str:
        if not self.other_runs:
            return ""
        shown = ", ".join(self.other_runs[:5]) + (" ..." if len(self.other_runs) > 5 else "")
        return f" (other runs still alive hold swap there: {shown})"

    def _open_unnamed(self, path: str) -> int:
        """A new swap file without a name in the rank directory (see the module docstring)."""
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        if self._tmpfile:
            try:
                return os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=self._rank_fd)
            except OSError as e:
                if e.errno not in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.EINVAL):
                    raise
                self._tmpfile = False
                log.debug("%s has no O_TMPFILE (%s): swap files are unlinked right after creation", self.path, e.strerror)
        fname = os.path.basename(path)
        fd = os.open(fname, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=self._rank_fd)
        try:
            os.unlink(fname, dir_fd=self._rank_fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _create_file(self, name: str, numel: int, dtype: torch.dtype) -> _Entry:
        path = self._file_path(name)
        try:
            fd = self._open_unnamed(path)
        except OSError as e:
            raise SwapError(e.errno, f"cannot create swap file for {name!r}: {e.strerror}", path) from None
        entry = _Entry(name, path, fd, numel, dtype)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, entry.file_size)
            except OSError as e:
                if e.errno in (_errno.EOPNOTSUPP, _errno.EINVAL):
                    log.warning("%s cannot preallocate (%s): a full disk may only show up mid-run", self.path, e.strerror)
                    os.ftruncate(fd, entry.file_size)
                elif e.errno == _errno.ENOSPC:
                    raise InsufficientSpaceError(
                        _errno.ENOSPC,
                        f"no space to reserve {entry.file_size} bytes for swap tensor {name!r} "
                        f"({self._free_bytes()} bytes free){self._other_runs_note()}; free space or "
                        "set offload.nvme_path to a larger disk",
                        path,
                    ) from None
                else:
                    raise
            self._write_header(entry, _STATE_EMPTY, 0, 0)
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
    def _write_header(self, entry: _Entry, state: int, crc: int, generation: int) -> None:
        fd = entry.fd
        assert fd is not None  # callers write the header of a file still open (_record_write checks)
        header = _pack_header(state, entry.dtype, (entry.numel,), entry.nbytes, crc, generation, self.run_id, entry.name.encode())
        try:
            with self._lock:
                self._header_buf[:] = header.ljust(HEADER_SIZE, b"\0")
                n = os.pwritev(fd, [self._header_buf], 0)
            if n != HEADER_SIZE:
                raise OSError(_errno.EIO, f"short header write ({n} of {HEADER_SIZE} bytes)")
        except OSError as e:
            raise SwapError(
                e.errno, f"cannot write the header of swap file for {entry.name!r}: {e.strerror}", entry.path
            ) from None

    def _record_write(self, entry: _Entry, state: int, crc: int, generation: int, *, best_effort: bool = False) -> None:
        """A write of generation `generation` completed (state VALID) or failed (FAILED): the
        header says so on disk and the entry remembers it. Idempotent (re-run after an interrupt)."""
        try:
            if entry.fd is not None:
                self._write_header(entry, state, crc, generation)
        except SwapError as e:
            state = _STATE_FAILED  # the data is there but its header is not: unreadable
            if not best_effort:
                entry.state, entry.crc, entry.generation = state, 0, generation
                raise
            log.error("could not mark swap file %s as failed: %s", entry.path, e)
        entry.state, entry.crc, entry.generation = state, crc, generation

    def _check_header(self, entry: _Entry) -> None:
        """The on-disk header must be the one this store last wrote for `entry`."""
        if entry.state == _STATE_FAILED:
            raise SwapCorruptError(
                _errno.EIO,
                f"swap file for {entry.name!r}: its last write failed, the data is "
                "not valid; write it again or restore from a checkpoint",
                entry.path,
            )
        fd = entry.fd
        assert fd is not None  # an entry of an open store (_entry_for checked): its file is open
        size = os.fstat(fd).st_size
        if size < entry.file_size:
            raise SwapCorruptError(
                _errno.EIO, f"swap file for {entry.name!r} is truncated: {size} bytes, expected {entry.file_size}", entry.path
            )
        with self._lock:
            n = os.preadv(fd, [self._header_buf], 0)
            raw = bytes(self._header_buf)
        if n != HEADER_SIZE:
            raise SwapCorruptError(_errno.EIO, f"swap file for {entry.name!r}: short header read ({n} bytes)", entry.path)

        def bad(what: str) -> SwapCorruptError:
            return SwapCorruptError(
                _errno.EIO,
                f"swap file for {entry.name!r} has a wrong header: {what}; the file "
                "was damaged or replaced; restore the tensor from a checkpoint",
                entry.path,
            )

        fields = _HEADER.unpack(raw[: _HEADER.size])
        magic, version, state, dname, ndim = fields[:5]
        if magic != _MAGIC:
            raise bad(f"magic {magic!r} is not {_MAGIC!r}")
        nbytes, crc, generation, run_id, name_len = fields[5 + _MAX_DIMS :]
        if version != FORMAT_VERSION:
            raise bad(f"format version {version}, this offload reads version {FORMAT_VERSION}")
        if name_len > _MAX_NAME:
            raise bad(f"name length {name_len}")
        end = _HEADER.size + name_len
        (hcrc,) = struct.unpack("<I", raw[end : end + 4])
        if _aio_ext.crc32c_bytes(raw[:end]) != hcrc:
            raise bad("header checksum mismatch")
        shape = tuple(fields[5 : 5 + ndim]) if ndim <= _MAX_DIMS else ()
        dtype_name = dname.rstrip(b"\0").decode(errors="replace")
        if _dtype_from_name(dtype_name) != entry.dtype or shape != (entry.numel,) or nbytes != entry.nbytes:
            raise bad(
                f"holds {dtype_name} {list(shape)} ({nbytes} bytes), "
                f"expected {_dtype_name(entry.dtype)} [{entry.numel}] ({entry.nbytes} bytes)"
            )
        name = raw[_HEADER.size : end].decode(errors="replace")
        if name != entry.name:
            raise bad(f"it is the file of {name!r} (another tensor's file was copied over it)")
        if run_id != self.run_id:
            raise bad(f"it was written by another run (run id {run_id.hex()}, this store is {self.run_id.hex()})")
        if generation != entry.generation:
            raise bad(
                f"generation {generation}, but this store last wrote generation {entry.generation} "
                "(an older or newer copy of the file)"
            )
        if state != entry.state or crc != entry.crc:
            raise bad(
                f"state {_STATE_NAMES.get(state, state)} with data checksum {crc:#010x}, but this store last "
                f"wrote {_STATE_NAMES[entry.state]} with {entry.crc:#010x}"
            )

    # ---------------------------------------------------------------- I/O
    def _entry_for(self, name: str, tensor: torch.Tensor) -> _Entry:
        self._check_open()
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"no swap tensor named {name!r} in {self.path}; create() or reserve() it first")
        if tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
            raise ValueError(
                f"swap tensor {name!r} is {_dtype_name(entry.dtype)}[{entry.numel}], the buffer is "
                f"{_dtype_name(tensor.dtype)}[{tensor.numel()}]"
            )
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"swap I/O of {name!r} needs a contiguous host tensor (use HostBufferPool.alloc)")
        pending = entry.pending
        if pending is not None:
            # order against the previous operation on this name; its error belongs to its owner
            # (a failed write leaves the name failed, which the read below reports itself)
            pending._complete()
        return entry

    def _fd_and_length(self, entry: _Entry, tensor: torch.Tensor) -> tuple[int, int]:
        fd = entry.fd
        assert fd is not None  # an entry of an open store (_entry_for checked): its file is open
        if self.direct and direct_ok(tensor, HEADER_SIZE, entry.padded):
            return fd, entry.padded
        if not self.direct:
            return fd, entry.nbytes
        # An unaligned buffer on an O_DIRECT store: move exactly the data bytes through the page
        # cache, on a second, buffered, open of the same (unnamed) file.
        if entry.buffered_fd is None:
            try:
                entry.buffered_fd = os.open(f"/proc/self/fd/{entry.fd}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise SwapError(
                    e.errno,
                    f"cannot reopen swap file for {entry.name!r} for buffered I/O through "
                    f"/proc/self/fd ({e.strerror}); pass buffers from HostBufferPool.alloc "
                    "(4 KiB-aligned)",
                    entry.path,
                ) from None
        return entry.buffered_fd, entry.nbytes

    def write_from(self, name: str, tensor: torch.Tensor, *, urgent: bool = False) -> SwapHandle:
        """Start writing `tensor` (a HostBufferPool buffer for O_DIRECT) to swap tensor `name`;
        `urgent`: ahead of the engine's other I/O (AioEngine)."""
        entry = self._entry_for(name, tensor)
        fd, io_len = self._fd_and_length(entry, tensor)
        aio = self.engine.submit_write(
            fd, tensor, HEADER_SIZE, nbytes=entry.nbytes, io_nbytes=io_len, checksum=True, path=entry.path, urgent=urgent
        )
        handle = SwapHandle(self, entry, "write", tensor, aio, generation=entry.generation + 1)
        with self._lock:
            self.bytes_written += io_len
            entry.pending = handle
        entry.write_submitted = True
        return handle

    def read_into(self, name: str, tensor: torch.Tensor, *, urgent: bool = False) -> SwapHandle:
        """Start reading swap tensor `name` into `tensor`; the handle's wait() verifies the checksum.
        `urgent`: ahead of the engine's other I/O (AioEngine)."""
        entry = self._entry_for(name, tensor)
        self._check_header(entry)
        if entry.state == _STATE_EMPTY:
            tensor.zero_()
            return SwapHandle(self, entry, "read", tensor, None)
        fd, io_len = self._fd_and_length(entry, tensor)
        aio = self.engine.submit_read(
            fd, tensor, HEADER_SIZE, nbytes=entry.nbytes, io_nbytes=io_len, checksum=True, path=entry.path, urgent=urgent
        )
        handle = SwapHandle(self, entry, "read", tensor, aio, expected_crc=entry.crc)
        with self._lock:
            self.bytes_read += io_len
            entry.pending = handle
        return handle

    # ---------------------------------------------------------------- bookkeeping
    def names(self) -> list[str]:
        return list(self._entries)

    def never_written(self, name: str) -> bool:
        """True while no write of `name` was ever started: it still reads as zeros, without I/O."""
        return not self._entries[name].write_submitted

    def file_path(self, name: str) -> str:
        """The name the swap file of `name` would have (it has none on disk): used in messages."""
        return self._entries[name].path

    def proc_path(self, name: str) -> str:
        """A path that opens the (unnamed) swap file of `name` from this process: for tests and debugging."""
        return f"/proc/self/fd/{self._entries[name].fd}"

    def nbytes_on_disk(self) -> int:
        """Bytes of the swap files (headers and padding included), as reserved."""
        return sum(e.file_size for e in self._entries.values())

    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(_errno.EBADF, f"swap store at {self.path} is closed", self.path)

    def _remove_entry(self, entry: _Entry) -> None:
        """Closing the last descriptor of an unnamed file frees its space."""
        for fd in (entry.fd, entry.buffered_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        entry.fd = entry.buffered_fd = None

    def settle(self) -> list[BaseException]:
        """Completes every pending operation and takes every failure not yet raised to anyone off
        the books (later waits on those handles return); returns those errors, for the log.

        For recovery after an I/O error (load_checkpoint, which rewrites the state): the handles
        a failed step left in wait lists then no longer fail the load. Names whose write failed
        stay failed (reads of them raise) until written again."""
        self._check_open()
        for entry in list(self._entries.values()):
            pending = entry.pending
            if pending is not None:
                pending._complete()
        with self._lock:
            failed = list(self._unreported)
        # only failed handles are ever in `_unreported` (SwapHandle._complete): their error is set
        return [h._error for h in failed if h._mark_reported() and h._error is not None]

    def close(self) -> None:
        """Complete pending I/O, free the swap files and remove the run's directories (idempotent).

        An interrupt while waiting for pending I/O leaves the store open: call close() again.
        In a forked child it does nothing: the store, its I/O threads and directories are the
        parent's (the child's copies of the descriptors close when it exits)."""
        if os.getpid() != self._owner_pid:
            self._closed = True
            _live_stores.discard(self)
            return
        if self._closed:
            self._release_directories()  # a store whose construction failed half way
            return
        for entry in list(self._entries.values()):
            pending = entry.pending
            if pending is not None:
                pending._complete()
        with self._lock:
            errors = [h._error for h in self._unreported if not h._reported]  # the files go; report, keep cleaning
            self._unreported.clear()
        self._closed = True
        _live_stores.discard(self)
        self.engine.close()
        for entry in self._entries.values():
            self._remove_entry(entry)
            if self.ledger is not None:
                self.ledger.release("nvme", entry.file_size, "swap")
        self._entries.clear()
        self._release_directories()
        self._header_buf.close()
        for e in errors:
            log.error("swap I/O pending at close failed: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self, _log=log):  # the logger bound here: at interpreter teardown the module's globals may be None
        try:
            self.close()
        except (OSError, RuntimeError, AttributeError) as e:  # a half-made store, or interpreter teardown
            _log.debug("closing a dropped swap store failed: %s", e)
