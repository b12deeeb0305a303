"""Which ranks log at INFO: rank 0 only, unless the user asks for every rank.

With several ranks every rank runs the same engine, so every INFO line (the placement chosen,
the progress lines) would print once per rank. Once the engine knows its rank (its process
group, `Collectives`), it sets the `offload` logger to WARNING on ranks other than 0, so
warnings and errors still come from every rank. It does so only where the user has not set that
logger's level: a level set on `logging.getLogger("offload")` is kept, and
`OFFLOAD_LOG_ALL_RANKS=1` keeps INFO on every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

ALL_RANKS_ENV = "OFFLOAD_LOG_ALL_RANKS"
PACKAGE_LOGGER = "offload"


def logs_info(rank: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a rank logs at INFO: rank 0, or every rank with OFFLOAD_LOG_ALL_RANKS set to 1,
    true or yes (plain decision, tested directly)."""
    return rank <= 0 or environ.get(ALL_RANKS_ENV, "").strip().lower() in ("1", "true", "yes")


def quiet_info_off_rank_zero(rank: int, environ: Mapping[str, str] = os.environ) -> None:
    """Sets the `offload` logger to WARNING on a rank that does not log INFO, unless its level was
    set by the user (see the module docstring)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.level == logging.NOTSET and not logs_info(rank, environ):
        package.setLevel(logging.WARNING)
