"""A benchmark script of benchmarks/ loaded as a module, for the tests that drive its functions."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def loaded(name: str) -> Iterator:
    """Yields benchmarks/<name>.py as a module (registered while loaded: its dataclasses look
    their module up), then forgets it: the body of a module-scoped fixture."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
