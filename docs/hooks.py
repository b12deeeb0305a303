"""MkDocs hooks of the documentation build (mkdocs.yml): before anything is built, every generated
table in the pages and the README must be what docs/generate.py renders today, so that a change
to the schema's docstrings, the DeepSpeed key tables or the estimate fails `make docs` until the
pages are regenerated."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError


def _generate_module():
    spec = importlib.util.spec_from_file_location("offload_docs_generate", Path(__file__).with_name("generate.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_pre_build(config) -> None:
    stale = _generate_module().stale_blocks()
    if stale:
        raise PluginError("stale generated tables (run python docs/generate.py): " + "; ".join(stale))
