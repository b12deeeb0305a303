"""Sizes written as text, read as bytes: one grammar for config caps, `offload estimate` and
`offload bench-io` (plain logic, no torch).

A number (`1048576`, `1.5`, `1e9`), then a unit: none or `B` (bytes), `K`/`M`/`G`/`T` and
`KiB`/`MiB`/`GiB`/`TiB` (powers of 2), `KB`/`MB`/`GB`/`TB` (powers of 10, as disks are sold; with
`binary=True` powers of 2, as RAM and GPU makers mean them). Case and spaces do not matter.
"""

from __future__ import annotations

import re

UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
# the units whose meaning depends on who wrote them, and their binary reading
DECIMAL_TO_BINARY = {"kb": "kib", "mb": "mib", "gb": "gib", "tb": "tib"}
HOW_TO_WRITE = "write bytes as an integer, or like 40GB, 40GiB, 512M or 1e9"


def parse_bytes(text: str, *, binary: bool = False) -> int:
    """Bytes from `text` (see the module docstring); ValueError naming the text otherwise."""
    match = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)([a-z]*)", str(text).strip().lower().replace(" ", ""))
    if not match or match.group(2) not in UNITS:
        raise ValueError(f"{text!r} is not a size; {HOW_TO_WRITE}")
    unit = match.group(2)
    if binary:
        unit = DECIMAL_TO_BINARY.get(unit, unit)
    try:
        return int(float(match.group(1)) * UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size; {HOW_TO_WRITE}") from None


def unit_of(text: str) -> str:
    """The unit part of a size as text, lower case (`"24 GB"` -> `"gb"`)."""
    return re.sub(r"[0-9.e\s]", "", str(text)).lower()


# The smallest `offload.sub_group_size` (elements): below it a piece's swap files are mostly
# headers.
MIN_SUB_GROUP_SIZE = 1024


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return (value + multiple - 1) // multiple * multiple


def parse_size(value: int | str | None) -> int | None:
    """Bytes from a cap as a user writes it: an int, or text like "40GB" (10^9), "40GiB" or "40G"
    (2^30), "512MB", "1e9" (sizes.parse_bytes); None stays None."""
    if value is None or isinstance(value, int):
        return value
    return parse_bytes(value)


BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(nbytes: float | None) -> str:
    """Bytes as a person reads them, in the largest binary unit that keeps the number at least 1,
    with three significant digits: `512 B`, `1.50 KiB`, `27.4 MiB`, `123 GiB`, `2.00 TiB` (never
    `0.00 GiB`). Every size offload prints goes through here; None is `-`."""
    if nbytes is None:
        return "-"
    if nbytes < 0:
        return "-" + format_bytes(-nbytes)
    for unit, size in BINARY_UNITS:
        if nbytes >= size * 0.9995:  # what would print as 1024 of the unit below prints as 1.00 of this one
            value = nbytes / size
            # the precision that keeps three significant digits after rounding (9.996 -> "10.0")
            for digits, below in ((2, 9.995), (1, 99.95)):
                if value < below:
                    return f"{value:.{digits}f} {unit}"
            return f"{value:.0f} {unit}"
    return f"{int(nbytes)} B"
