"""The swap store's on-disk layout: where its files live and the header each one starts with.

Where the files live. `nvme_path/<run>/rank<r>/` is made fresh for each store: the run
directory (shared by the ranks of one run) and the rank directory are created 0700, checked
with fstat on a descriptor opened O_DIRECTORY|O_NOFOLLOW (a real directory, owned by this
user, mode 0700), and every later create, open or remove is relative to those descriptors,
so a symlink planted or swapped in under `nvme_path` is never followed and `close()` never
removes anything outside the run directory. A world-writable `nvme_path` without the
sticky bit gets a warning.

The directories are made, checked, removed and swept by the plain functions here, each working
relative to a directory descriptor: `_open_root` opens `nvme_path`, `_open_private_dir` opens
and checks a run or rank directory, `_rmdir_if_same` removes one only if it is still the one
opened, and `sweep_dead_runs` removes the directories a dead run left (see its docstring).
`offload.storage.swap.SwapStore` makes its run's and rank's directories with them.

Layout of one swap file (all offsets 4 KiB-aligned so the data moves with O_DIRECT):

    [0, 4096)            header: magic, format version, state, dtype, shape, data bytes,
                         CRC-32C of the data, generation, run id, the tensor's name,
                         CRC-32C of the header itself
    [4096, 4096 + pad)   the tensor's bytes, padded to a multiple of 4096

`_pack_header` writes a header; the store checks one on every read."""

from __future__ import annotations

import errno as _errno
import fcntl
import logging
import os
import re
import stat
import struct

import torch

from offload import _aio_ext
from offload.errors import SwapError
from offload.storage.aio import ALIGN

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
HEADER_SIZE = ALIGN
_MAGIC = b"OFLDSWAP"
_MAX_DIMS = 8
# magic, version, state, dtype name, ndim, shape[8], data nbytes, data crc32c, generation,
# run id, name length; then the name (utf-8), then the CRC-32C of all of it
_HEADER = struct.Struct(f"<8sII32sI{_MAX_DIMS}QQIQ16sI")
_MAX_NAME = HEADER_SIZE - _HEADER.size - 4
_STATE_EMPTY, _STATE_VALID, _STATE_FAILED = 0, 1, 2
_STATE_NAMES = {_STATE_EMPTY: "never written", _STATE_VALID: "valid", _STATE_FAILED: "failed"}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SWAP_SUFFIX = ".swp"
_RANK_DIR = re.compile(r"rank\d+")
_LEGACY_RUN = re.compile(r"run-(\d+)")  # offload before unique run names: run-<pid>


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _dtype_from_name(name: str) -> torch.dtype | None:
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else None


def _pack_header(
    state: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, crc: int, generation: int, run_id: bytes, name: bytes
) -> bytes:
    dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    body = (
        _HEADER.pack(
            _MAGIC,
            FORMAT_VERSION,
            state,
            _dtype_name(dtype).encode(),
            len(shape),
            *dims,
            nbytes,
            crc,
            generation,
            run_id,
            len(name),
        )
        + name
    )
    return body + struct.pack("<I", _aio_ext.crc32c_bytes(body))


# ---------------------------------------------------------------- directories (plain functions)
def _not_writable(root: str, e: OSError) -> SwapError:
    if e.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS, _errno.ENOENT):
        return SwapError(
            e.errno,
            f"nvme_path {root} is not writable ({e.strerror}); fix its permissions or set "
            "offload.nvme_path to a writable directory",
            root,
        )
    return SwapError(e.errno, f"cannot create a run directory in nvme_path {root}: {e.strerror}", root)


def _open_root(root: str) -> int:
    """Opens nvme_path (the user's own path: a symlink there is followed) as a directory fd."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SwapError(
            _errno.ENOENT,
            f"nvme_path {root} does not exist; create it (mkdir -p {root}) or set "
            "offload.nvme_path to an existing directory on a fast local disk",
            root,
        ) from None
    except NotADirectoryError:
        raise SwapError(
            _errno.ENOTDIR, f"nvme_path {root} is not a directory; set offload.nvme_path to a directory", root
        ) from None
    except OSError as e:
        raise SwapError(e.errno, f"cannot open nvme_path {root}: {e.strerror}", root) from None
    st = os.fstat(fd)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        log.warning(
            "nvme_path %s is writable by every user and has no sticky bit: others can rename or replace "
            "entries in it. offload only works through descriptors of its own run directory, so it never "
            "writes or deletes outside it, but use a private directory (chmod 700, or +t)",
            root,
        )
    return fd


def _open_private_dir(name: str, parent_fd: int, path: str, *, fresh: bool) -> int:
    """Opens `name` under `parent_fd` without following a symlink and checks it is a real
    directory owned by this user with mode 0700 (set it so when we just made it)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (_errno.ELOOP, _errno.ENOTDIR):
            raise SwapError(
                e.errno,
                f"{path} is not a directory this run created (a symbolic link or a file, "
                "perhaps planted by someone else): refusing to use it; remove it or choose "
                "another run name",
                path,
            ) from None
        raise SwapError(e.errno, f"cannot open swap directory {path}: {e.strerror}", path) from None
    try:
        if fresh:
            os.fchmod(fd, 0o700)  # umask may have narrowed it; never widened
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISDIR(st.st_mode):
            problem = "is not a directory"
        elif st.st_uid != os.geteuid():
            problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        elif stat.S_IMODE(st.st_mode) != 0o700:
            problem = f"has mode {stat.S_IMODE(st.st_mode):o}, not 700 (others could read or replace swap files)"
        if problem:
            raise SwapError(
                _errno.EPERM, f"swap directory {path} {problem}: refusing to use it; remove it or choose another run name", path
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmdir_if_same(name: str, parent_fd: int, fd: int, path: str, *, quiet_if_busy: bool = False) -> None:
    """rmdir `name` under `parent_fd` only if it is still the directory `fd` is open on."""
    try:
        st, mine = os.stat(name, dir_fd=parent_fd, follow_symlinks=False), os.fstat(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            log.warning("swap directory %s was replaced by something else while in use; left alone", path)
            return
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (_errno.ENOTEMPTY, _errno.EEXIST) and quiet_if_busy:
            return  # other ranks' directories are still there; the last rank removes it
        log.warning("could not remove swap directory %s: %s", path, e.strerror)


def _swap_leftover(name: str) -> bool:
    return name.endswith(_SWAP_SUFFIX) or name.startswith(".offload-odirect-probe-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_runs(root: str, *, dir_fd: int, keep: str | None = None) -> list[str]:
    """Removes run directories under `root` left by dead runs; returns the live runs' names.

    A run directory is a 0700 directory of this user holding only `rank<N>` directories,
    which hold only swap files (or nothing). It is dead when no process holds its flock (each
    store holds a shared one while alive). Swap files of current runs have no name, so what a
    dead run leaves is its empty directories (and, from older versions or a filesystem
    without O_TMPFILE, `*.swp` files). Everything is done relative to descriptors, without
    following links; anything unexpected leaves the directory alone."""
    live: list[str] = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return live
    for name in names:
        if name.startswith(".") or name == keep:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            continue
        legacy = _LEGACY_RUN.fullmatch(name)
        if legacy and int(legacy.group(1)) != os.getpid() and _pid_alive(int(legacy.group(1))):
            live.append(name)  # an older offload (no flock) whose pid is alive (ours: a past container's)
            continue
        try:
            run_fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            mine = os.fstat(run_fd)
            if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino):
                continue
            ranks = _run_layout(run_fd)
            if ranks is None or (not ranks and not name.startswith("run-")):
                continue  # not an offload run directory (an empty one counts only by its name)
            try:
                fcntl.flock(run_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(name)
                continue
            ranks = _run_layout(run_fd)  # again, under the lock
            if ranks is None:
                continue
            freed = 0
            for rank_name, files in ranks.items():
                rank_fd = os.open(rank_name, _DIR_FLAGS, dir_fd=run_fd)
                try:
                    for f in files:
                        freed += os.stat(f, dir_fd=rank_fd, follow_symlinks=False).st_blocks * 512
                        os.unlink(f, dir_fd=rank_fd)
                finally:
                    os.close(rank_fd)
                os.rmdir(rank_name, dir_fd=run_fd)
            _rmdir_if_same(name, dir_fd, run_fd, os.path.join(root, name))
            log.info(
                "removed swap directory %s left by a run that is gone%s",
                os.path.join(root, name),
                f" ({freed} bytes of swap files)" if freed else "",
            )
        except OSError as e:
            log.warning("could not remove the dead run's swap directory %s: %s", os.path.join(root, name), e)
        finally:
            os.close(run_fd)
    return live


def _run_layout(run_fd: int) -> dict[str, list[str]] | None:
    """{rank directory: its swap files} if the directory looks like an offload run, else None."""
    layout = {}
    for rank_name in os.listdir(run_fd):
        if not _RANK_DIR.fullmatch(rank_name):
            return None
        try:
            st = os.stat(rank_name, dir_fd=run_fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            rank_fd = os.open(rank_name, _DIR_FLAGS, dir_fd=run_fd)
        except OSError:
            return None
        try:
            files = os.listdir(rank_fd)
            for f in files:
                fst = os.stat(f, dir_fd=rank_fd, follow_symlinks=False)
                if not _swap_leftover(f) or not stat.S_ISREG(fst.st_mode):
                    return None
        finally:
            os.close(rank_fd)
        layout[rank_name] = files
    return layout
