"""The checkpoint's file handling, with no format in sight: creating, writing and reading single
files and directories safely, and the errors a checkpoint raises (offload.checkpoint.format
builds the checkpoint directory from these).

Writing. `created_file` creates a file with O_EXCL, never through a symlink, with the umask's
permissions (checkpoints and exports are the user's output), and fsyncs it when done; a full
disk, quota or file size limit at any point becomes an InsufficientSpaceError naming the file
and the free bytes (`space_error`); `write_all` / `pwrite_all` write until done; `write_small`
writes a small file and returns its size and CRC-32C; `write_replacing` writes a temporary file
next to the target and renames it over it; `fsync_dir` makes a rename durable.
`save_error` turns any other OSError of a save into a CheckpointError that names the path and
says what to do.

Reading. `open_dir` opens a checkpoint directory; `read_small` reads a whole file under it of at
most a given size, opened relative to the directory without following a symlink and only if it
is a regular file (`_open_regular`), and never past its size (`_read_exactly`).

Saves in progress. A save marks its temporary directory or file with a flock (`lock_held`) that
the kernel drops when the saving process dies, so `remove_stale` removes the `.tmp-*` and
`.trash-*` entries of dead saves only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat

from offload.errors import InsufficientSpaceError, OffloadError
from offload.storage.aio import crc32c

logger = logging.getLogger(__name__)


class CheckpointError(OffloadError):
    """A checkpoint cannot be saved or loaded (missing, incompatible); the message says which."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, edited or damaged; the message names the file."""


# ---- writing ---------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data, path: str) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    while len(view):
        written = os.write(fd, view)
        view = view[written:]


def pwrite_all(fd: int, data, offset: int, path: str) -> None:
    """Writes all of `data` at `offset` of the file (pwrite until done)."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    while len(view):
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def space_error(path: str, err: OSError, needed: int | None = None) -> OffloadError:
    free = shutil.disk_usage(os.path.dirname(path) or ".").free
    what = "the disk is full" if err.errno == errno.ENOSPC else f"the file size limit was reached ({err.strerror})"
    need = f" ({needed} bytes needed)" if needed is not None else ""
    return InsufficientSpaceError(
        err.errno,
        f"checkpoint write failed: {what} while writing {path}{need}, {free} bytes free; the previous "
        "checkpoint is untouched; free space or save to another directory",
        path,
    )


SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # the disk, a quota or the file size limit is full


@contextlib.contextmanager
def created_file(path: str, *, mode: int = 0o666, needed: int | None = None, advice: str | None = None):
    """Creates `path` (O_EXCL, never through a symlink; `mode` less the umask, by default the
    umask's permissions, as for any file the user writes) and yields its descriptor; fsyncs and
    closes it when the block ends. A full disk, quota or size limit, at any point, becomes the
    `space_error` naming `path`. Another OSError: with `advice`, a CheckpointError naming `path`
    and ending with the advice; without, it passes through (the save's `save_error` names it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        raise _write_error(path, e, needed, advice) from None
    try:
        yield fd
        os.fsync(fd)
    except OffloadError:
        raise
    except OSError as e:
        raise _write_error(path, e, needed, advice) from None
    finally:
        os.close(fd)


def _write_error(path: str, error: OSError, needed: int | None, advice: str | None) -> OSError | OffloadError:
    if error.errno in SPACE_ERRNOS:
        return space_error(path, error, needed)
    if advice is None:
        return error
    return CheckpointError(f"cannot write {path}: {error.strerror}; {advice}")


def write_small(path: str, data: bytes) -> dict:
    with created_file(path, needed=len(data)) as fd:
        write_all(fd, data, path)
    return {"bytes": len(data), "crc32c": crc32c(data)}


def write_replacing(path: str, pieces, *, hold_lock: bool = False) -> str:
    """Writes `pieces` (bytes-like) to a new temporary file next to `path` (O_EXCL, never through
    a symlink), fsyncs it and renames it over `path`; on any failure the temporary file goes.
    `hold_lock`: the temporary file is flock'ed while written (a concurrent save's sweep of
    stale temporary files leaves it alone)."""
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with created_file(temp, advice="choose a directory you can write to") as fd:
            if hold_lock:
                lock_held(fd)
            for piece in pieces:
                write_all(fd, piece, temp)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    return path


# ---- reading ---------------------------------------------------------------------------------
def open_dir(path: str) -> int:
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
            raise CheckpointCorruptError(
                f"checkpoint file {path} is a symbolic link: refusing to follow it (a checkpoint holds only regular files)"
            ) from None
        raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(
            f"checkpoint file {path} is not a regular file: refusing to read it (a checkpoint holds only regular files)"
        )
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


def read_small(dir_fd: int, directory: str, name: str, *, limit: int) -> bytes:
    """A whole small file of at most `limit` bytes (for files without a declared size)."""
    path = os.path.join(directory, name)
    fd, size = _open_regular(dir_fd, name, path)
    try:
        if size > limit:
            raise CheckpointCorruptError(
                f"checkpoint file {path} is {size} bytes, more than the {limit} such a file "
                "can have: refusing to read it (crafted or damaged)"
            )
        return _read_exactly(fd, size, path)
    finally:
        os.close(fd)


# ---- saves in progress -----------------------------------------------------------------------
def lock_held(fd: int) -> None:
    """Marks a save's temporary file or directory as in use: a shared-nothing flock that the
    kernel drops when the saving process dies, wherever it ran (flock is coherent over NFSv4)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def exchange_paths(a: str, b: str) -> bool:
    """Atomically swaps the directory entries `a` and `b` (Linux renameat2 with RENAME_EXCHANGE);
    False where the system or file system cannot, and nothing was changed."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def remove_stale(root: str) -> None:
    """Removes `.tmp-*` / `.trash-*` entries no live save holds the lock of (a killed save)."""
    root_fd = open_dir(root)
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


def save_error(error: BaseException, root: str) -> BaseException:
    """An OSError of a save as an error that names the path and says what to do."""
    if isinstance(error, OffloadError) or not isinstance(error, OSError):
        return error
    where = error.filename or root
    if error.errno in SPACE_ERRNOS:
        return space_error(where, error)
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and os.path.exists(root) and not os.path.isdir(root):
        return CheckpointError(
            f"cannot save a checkpoint to {root}: it is a file, not a directory; pass a directory path (it is created if missing)"
        )
    return CheckpointError(
        f"cannot save a checkpoint to {root}: {error.strerror} ({where}); choose a directory "
        "you can write to, or fix its permissions; the previous checkpoint is untouched"
    )
