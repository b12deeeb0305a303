"""Asynchronous reads and writes of host tensors to file offsets (wrapper over `offload._aio_ext`).

The C++ engine (csrc/aio) splits each request into `block_size` pieces, keeps at most
`queue_depth` pieces in flight on a pool of `threads` workers doing pread/pwrite, and can
checksum (CRC-32C) each piece in the worker that moves it. Waiting releases the GIL.

Two queues: a request submitted `urgent` (I/O that compute is waiting on, such as the 16-bit
weights a fetch reads or a step writes back) goes ahead of every request that is not (the
optimizer state streaming behind it), which keeps its order among its own class; with
`background_depth` > 0 that many places among the pieces in flight stay with the other queue
while it has pieces (for a drive that reads and writes at once: the state's write-back beside
the urgent reads), and within each queue the direction with fewer pieces in flight goes first
while both have pieces queued (the write-back beside reads ahead queued before it). The engine
orders nothing else: a caller that needs one request after another waits for the first.

Who owns what: from `submit_*` until the request completes, the tensor belongs to the
engine (do not resize or write it). The engine keeps the tensor (and any fd it opened) in
its table of requests in flight until the request is done, not merely until the handle is
dropped: a handle dropped mid-read cannot let a worker write into freed memory. The table
is pruned, with the GIL held, on every submit and at close; the C++ workers never touch
Python objects. An fd passed in stays the caller's and must stay open until completion; a
path passed in is opened by the engine and closed when the request completes.

Waiting: `AioHandle.wait()` sleeps in slices so that Ctrl-C is handled while I/O runs; an
interrupt (any exception raised while waiting) leaves the request pending, and a later
`wait()` gives its real result.

O_DIRECT needs the buffer address, file offset and transfer length 4 KiB-aligned. A path
target uses O_DIRECT when all three are aligned and the filesystem accepts it
(`probe_o_direct`), else buffered I/O; the first refusal on a filesystem is logged once.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import logging
import mmap
import os
import threading
import uuid
import weakref

import torch

from offload import _aio_ext
from offload.errors import SwapError

log = logging.getLogger(__name__)

ALIGN = 4096
_WAIT_SLICE_S = 0.2  # wait() wakes this often so Ctrl-C is handled while I/O runs

_probe_lock = threading.Lock()
_probe_cache: dict[int, bool] = {}  # st_dev -> O_DIRECT accepted
_warned_devices: set[int] = set()


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of bytes-like `data` or of a tensor's bytes, continuing `crc`."""
    if isinstance(data, torch.Tensor):
        t = data.contiguous()
        return _aio_ext.crc32c(t.data_ptr(), t.numel() * t.element_size(), crc)
    return _aio_ext.crc32c_bytes(bytes(data), crc)


def _warn_buffered(path: str, dev: int, reason: str) -> None:
    with _probe_lock:
        if dev in _warned_devices:
            return
        _warned_devices.add(dev)
    log.warning(
        "%s does not accept O_DIRECT (%s): using buffered I/O there; throughput will depend on the "
        "page cache. Put nvme_path on a local ext4/xfs filesystem for direct I/O.",
        path,
        reason,
    )


def probe_o_direct(path: str | os.PathLike, *, dir_fd: int | None = None) -> bool:
    """Whether the filesystem holding `path` (a directory or a file) accepts O_DIRECT I/O.

    Writes and reads back one aligned 4 KiB block in a temporary file (open alone is not
    enough: some filesystems accept the flag and fail the I/O). With `dir_fd` (an open
    directory; `path` then only names it in messages) the probe file is made relative to
    that descriptor, as an unnamed O_TMPFILE where the filesystem has them, so no path is
    ever followed. Logs once per filesystem when refused. The result is cached per device.
    """
    path = os.fspath(path)
    if dir_fd is not None:
        directory = path
        dev = os.fstat(dir_fd).st_dev
    else:
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        dev = os.stat(directory).st_dev
    with _probe_lock:
        if dev in _probe_cache:
            return _probe_cache[dev]
    name = f".offload-odirect-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    probe = name if dir_fd is not None else os.path.join(directory, name)
    ok, reason = True, ""
    linked = False
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = None
        direct = getattr(os, "O_DIRECT", 0)
        if dir_fd is not None and hasattr(os, "O_TMPFILE"):
            try:
                fd = os.open(".", os.O_RDWR | os.O_TMPFILE | direct, 0o600, dir_fd=dir_fd)
            except OSError as e:
                if e.errno not in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.ENOENT):
                    raise  # EINVAL: O_DIRECT refused, handled below
        if fd is None:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | direct, 0o600, dir_fd=dir_fd)
            linked = True
        try:
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (_errno.EINVAL, _errno.EOPNOTSUPP, _errno.ENOTSUP):
            ok, reason = False, os.strerror(e.errno)
        else:
            raise SwapError(
                e.errno,
                f"cannot create a probe file in {directory}: {e.strerror}; check the path exists and is writable",
                directory,
            ) from None
    finally:
        buf.close()
        if linked or dir_fd is None:
            try:
                os.unlink(probe, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
    if not hasattr(os, "O_DIRECT"):
        ok, reason = False, "O_DIRECT not available on this platform"
    with _probe_lock:
        _probe_cache[dev] = ok
    if not ok:
        _warn_buffered(directory, dev, reason)
    return ok


def storage_capacity(tensor: torch.Tensor) -> int:
    """Bytes available from the tensor's first element to the end of its storage."""
    # storage_offset() is typed int | SymInt (symbolic under tracing); a host tensor's is an int
    return tensor.untyped_storage().nbytes() - int(tensor.storage_offset()) * tensor.element_size()


def direct_ok(tensor: torch.Tensor, offset: int, io_nbytes: int) -> bool:
    """Whether a transfer of io_nbytes at `offset` from/to this tensor satisfies O_DIRECT alignment."""
    return (
        tensor.data_ptr() % ALIGN == 0
        and offset % ALIGN == 0
        and io_nbytes % ALIGN == 0
        and storage_capacity(tensor) >= io_nbytes
    )


class _Flight:
    """What a request in flight needs alive until it completes: the buffer's owner, and the
    fd the engine opened for it. Held by the engine's table; the handle only points at it."""

    __slots__ = ("handle", "owned_fd", "request", "tensor")

    def __init__(self, request, tensor: torch.Tensor, owned_fd: int | None):
        self.request = request
        self.tensor: torch.Tensor | None = tensor  # None once released
        self.owned_fd = owned_fd
        self.handle: weakref.ref[AioHandle] | None = None  # set right after the handle is made

    def release(self) -> None:
        if self.owned_fd is not None:
            fd, self.owned_fd = self.owned_fd, None
            try:
                os.close(fd)
            except OSError:
                pass
        self.tensor = None


class AioHandle:
    """One submitted request. `wait()` blocks (GIL released), raises SwapError on failure."""

    def __init__(self, engine: AioEngine, flight: _Flight, path: str, on_done=None):
        self._engine = engine
        self._flight = flight
        self._request = flight.request
        self._tensor: torch.Tensor | None = flight.tensor  # the buffer, kept alive until completion
        self._path = path
        self._on_done = on_done
        self._finished = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished or self._request.done()

    @property
    def checksum(self) -> int:
        """CRC-32C of the checksummed bytes (valid after wait(); 0 if no checksum was asked)."""
        return self._request.checksum

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for completion; True when done, False when `timeout` seconds passed first.

        Raises SwapError (errno, message naming op, offset and file) if any piece failed; the
        same error again on every later call. An exception raised while waiting (Ctrl-C's
        KeyboardInterrupt) propagates and leaves the request pending: wait again for its result.
        """
        if self._finished:
            if self._error is not None:
                raise self._error
            return True
        remaining = timeout
        while True:
            slice_s = _WAIT_SLICE_S if remaining is None else min(_WAIT_SLICE_S, max(remaining, 0.0))
            try:
                if self._request.wait(slice_s):
                    break
            except OSError as e:
                self._error = SwapError(e.errno, e.strerror, e.filename)
                self._complete()
                raise self._error from None
            if remaining is not None:
                remaining -= slice_s
                if remaining <= 0:
                    return False
        self._complete()
        return True

    def _complete(self) -> None:
        self._finished = True
        self._engine._landed(self._flight)
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb(self)
        self._tensor = None


class AioEngine:
    """Asynchronous file I/O on host tensors; see the module docstring for ownership rules.

    Thread-safe: submits and waits may come from several threads (the table of requests in
    flight has its own lock)."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 4, background_depth: int = 0):
        self._closed = True  # until the C++ engine exists (a refused setting leaves nothing to close)
        self._owner_pid = os.getpid()  # its worker threads exist only in this process, not in a fork
        self._flights_lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}  # id(flight) -> flight, until the request is done
        try:
            self._engine = _aio_ext.Engine(int(block_size), int(queue_depth), int(threads), int(background_depth))
        except ValueError as e:
            raise ValueError(f"io settings: {e}") from None
        self.block_size, self.queue_depth, self.threads = int(block_size), int(queue_depth), int(threads)
        self.background_depth = int(background_depth)
        self._closed = False

    def in_flight(self) -> int:
        """Requests whose buffers the engine still holds (submitted, not yet known complete)."""
        self._reap()
        with self._flights_lock:
            return len(self._flights)

    def _landed(self, flight: _Flight) -> None:
        """The handle saw its request complete: the engine lets go of the buffer and fd."""
        with self._flights_lock:
            self._flights.pop(id(flight), None)
        flight.release()

    def _reap(self, everything: bool = False) -> None:
        """Drops the table's hold on completed requests whose handle is gone (dropped mid-I/O)."""
        with self._flights_lock:
            gone = [
                f for f in self._flights.values() if (everything or f.request.done()) and (f.handle is None or f.handle() is None)
            ]
            for f in gone:
                del self._flights[id(f)]
        for f in gone:
            f.release()

    def _submit(
        self,
        op,
        target,
        tensor: torch.Tensor,
        offset: int,
        nbytes: int | None,
        io_nbytes: int | None,
        checksum: bool,
        piece_size: int,
        path: str | None,
        urgent: bool,
    ) -> AioHandle:
        if self._closed:
            raise SwapError(_errno.EBADF, "the I/O engine is closed; create a new AioEngine", path or str(target))
        if not tensor.is_contiguous():
            raise ValueError("aio needs a contiguous host tensor")
        if tensor.device.type != "cpu":
            raise ValueError(f"aio needs a host (cpu) tensor, got one on {tensor.device}")
        self._reap()
        size = tensor.numel() * tensor.element_size()
        nbytes = size if nbytes is None else int(nbytes)
        io_nbytes = nbytes if io_nbytes is None else int(io_nbytes)
        if nbytes > size:
            raise ValueError(f"nbytes {nbytes} exceeds the tensor's {size} bytes")
        if io_nbytes < nbytes or io_nbytes > storage_capacity(tensor):
            raise ValueError(
                f"io_nbytes {io_nbytes} must lie between nbytes {nbytes} and the buffer capacity {storage_capacity(tensor)}"
            )
        owned = None
        if isinstance(target, int):
            fd, name = target, path or f"<fd {target}>"
        else:
            name = os.fspath(target)
            flags = os.O_RDONLY if op == _aio_ext.Op.READ else (os.O_WRONLY | os.O_CREAT)
            direct = direct_ok(tensor, offset, io_nbytes) and probe_o_direct(name)
            if not direct:
                io_nbytes = nbytes  # buffered: move exactly the data bytes
            try:
                fd = os.open(name, flags | (os.O_DIRECT if direct else 0), 0o600)
            except OSError as e:
                raise SwapError(
                    e.errno, f"cannot open {name} for {'reading' if op == _aio_ext.Op.READ else 'writing'}: {e.strerror}", name
                ) from None
            owned = fd
        try:
            req = self._engine.submit(
                op,
                fd,
                tensor.data_ptr(),
                int(offset),
                io_nbytes,
                nbytes if checksum else 0,
                bool(checksum),
                int(piece_size),
                name,
                bool(urgent),
            )
        except BaseException:
            if owned is not None:
                os.close(owned)
            raise
        # from here the table holds the buffer until the request is done (see the module docstring)
        flight = _Flight(req, tensor, owned)
        handle = AioHandle(self, flight, name)
        flight.handle = weakref.ref(handle)
        with self._flights_lock:
            self._flights[id(flight)] = flight
        return handle

    def submit_read(
        self,
        target,
        tensor: torch.Tensor,
        offset: int = 0,
        *,
        nbytes: int | None = None,
        io_nbytes: int | None = None,
        checksum: bool = False,
        piece_size: int = 0,
        path: str | None = None,
        urgent: bool = False,
    ) -> AioHandle:
        """Read `io_nbytes` (default: the tensor's size) at `offset` of fd or path into the tensor.
        `urgent`: compute waits on it; queued ahead of every request that is not (see AioEngine)."""
        return self._submit(_aio_ext.Op.READ, target, tensor, offset, nbytes, io_nbytes, checksum, piece_size, path, urgent)

    def submit_write(
        self,
        target,
        tensor: torch.Tensor,
        offset: int = 0,
        *,
        nbytes: int | None = None,
        io_nbytes: int | None = None,
        checksum: bool = False,
        piece_size: int = 0,
        path: str | None = None,
        urgent: bool = False,
    ) -> AioHandle:
        """Write the tensor's bytes (or `io_nbytes` of its buffer, padding included) at `offset`.
        `urgent`: compute waits on it; queued ahead of every request that is not (see AioEngine)."""
        return self._submit(_aio_ext.Op.WRITE, target, tensor, offset, nbytes, io_nbytes, checksum, piece_size, path, urgent)

    def set_fault(self, op: str, err: int, after_offset: int = 0, count: int | None = None) -> None:
        """Test hook: make every `op` ("read"/"write") piece ending past `after_offset` fail with
        errno `err`; with `count`, only the next `count` such pieces fail."""
        self._engine.set_fault(0 if op == "read" else 1, int(err), int(after_offset), -1 if count is None else int(count))

    def clear_fault(self) -> None:
        self._engine.clear_fault()

    def set_delay(self, seconds: float, op: str | None = None) -> None:
        """Test hook: every piece (of `op`, "read"/"write", if given) sleeps this long before its
        I/O (0 turns it off)."""
        self._engine.set_delay_us(int(seconds * 1e6), -1 if op is None else 0 if op == "read" else 1)

    def close(self) -> None:
        """Finish every queued piece, then stop the workers (idempotent). Handles still held
        can be waited afterwards (their requests are complete)."""
        if not self._closed:
            self._closed = True
            if os.getpid() == self._owner_pid:
                self._engine.close()
            else:
                # a forked child has the engine's memory but none of its threads, and its mutex and
                # condition variable as they were at the fork: destroying them can hang, so the
                # child never does (a leaked reference; the child's memory goes when it exits)
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._engine))
        self._reap(everything=True)

    def __del__(self):
        try:
            self.close()  # before the table goes: no worker may outlive the buffers it writes
        except (OSError, RuntimeError) as e:
            log.debug("closing a dropped AioEngine failed: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
