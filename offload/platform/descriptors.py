"""Room for open file descriptors. Each swap file is held open for the run (it has no name, so
its descriptor is the file), and a 70B model's NVMe state is thousands of files (a file per
state kind and piece), past the soft limit of 1024 that many shells start processes with. The
process may raise its own soft limit up to the hard one; when even that is too low, the store
says so before it creates a file, instead of failing with EMFILE part way through reserving swap."""

from __future__ import annotations

import errno
import logging
import os
import resource

log = logging.getLogger(__name__)

SPARE_DESCRIPTORS = 256
"""Descriptors kept free beside the swap files: data loaders, checkpoints, logs, sockets."""


class DescriptorLimitError(OSError):
    """The hard limit on open descriptors leaves no room for the files asked for; `wanted` is
    the limit that would hold them (the `ulimit -n` to give)."""

    def __init__(self, message: str, wanted: int) -> None:
        super().__init__(errno.EMFILE, message)
        self.wanted = wanted


def soft_limit_for(open_now: int, needed: int, soft: int, hard: int, *, spare: int = SPARE_DESCRIPTORS) -> int:
    """The soft RLIMIT_NOFILE under which `needed` more descriptors fit beside `open_now` with
    `spare` left: `soft` itself when they fit, else the least limit that holds them (at most
    `hard`; `hard` < 0 is unlimited). Raises DescriptorLimitError when `hard` is too low."""
    want = open_now + needed + spare
    if want <= soft:
        return soft
    if 0 <= hard < want:
        raise DescriptorLimitError(
            f"{needed} more open files are needed beside the {open_now} this process holds, but its hard limit "
            f"on open files is {hard}",
            want,
        )
    return want


def open_descriptor_count() -> int:
    """Descriptors this process has open now (/proc/self/fd; 0 where there is no /proc)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _limits_for(needed: int) -> tuple[int, int, int]:
    """This process's (soft, hard) limit on open files and the soft one `needed` more
    descriptors want (`soft_limit_for`, which raises when the hard one cannot hold them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard, soft_limit_for(open_descriptor_count(), needed, soft, hard)


def hard_limit_shortfall(needed: int) -> str | None:
    """What to do when this process's hard limit on open files cannot hold `needed` more
    descriptors (`offload estimate`'s advice, in words); None when it can."""
    try:
        _limits_for(needed)
    except DescriptorLimitError as e:
        return f"{e.strerror}: raise it (ulimit -n {e.wanted}) before the run"
    return None


def make_room_for_descriptors(needed: int) -> None:
    """Raises this process's soft limit on open files (RLIMIT_NOFILE) so that `needed` more
    descriptors fit, logging the change; raises DescriptorLimitError (the reason in `strerror`,
    what to do after it) when the hard limit does not allow it."""
    try:
        soft, hard, limit = _limits_for(needed)
    except DescriptorLimitError as e:
        raise DescriptorLimitError(
            f"{e.strerror}: raise it before starting the run (ulimit -n {e.wanted}, or LimitNOFILE= in a systemd "
            "unit, nofile in /etc/security/limits.conf), or give offload.sub_group_size a larger piece so that "
            "fewer swap files are made",
            e.wanted,
        ) from None
    if limit != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        log.info("raised this process's soft limit on open files from %d to %d for swap files", soft, limit)
