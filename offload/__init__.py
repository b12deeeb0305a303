"""offload: a heterogeneous offload engine for PyTorch training.

Public surface (the project's DESIGN page; the inside in docs/design.md), listed in `__all__`: `initialize`, `Config`, `CPUAdamW`, `Engine`,
`param_groups_no_decay`.
"""

from offload.errors import (  # noqa: F401
    ConfigError,
    InsufficientMemoryError,
    InsufficientSpaceError,
    NonFiniteError,
    OffloadError,
    SwapCorruptError,
    SwapError,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("offload")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.1.0"


__version__ = _version()

# the public API: what `from offload import *` gives and `dir(offload)` shows (the lazy names too)
__all__ = [
    "initialize",
    "Engine",
    "Config",
    "load_config",
    "CPUAdamW",
    "param_groups_no_decay",
    "OffloadError",
    "ConfigError",
    "InsufficientMemoryError",
    "InsufficientSpaceError",
    "NonFiniteError",
    "SwapError",
    "SwapCorruptError",
]


def __getattr__(name):
    # Imported lazily so that `import offload` stays cheap and a CLI subcommand loads only what it uses.
    if name == "CPUAdamW":
        from offload.optim import CPUAdamW

        return CPUAdamW
    if name in ("Config", "load_config"):
        from offload.config import schema as config

        return getattr(config, name)
    if name in ("initialize", "Engine"):
        from offload import engine

        return getattr(engine, name)
    if name == "param_groups_no_decay":
        from offload.config.param_groups import param_groups_no_decay

        return param_groups_no_decay
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
