"""MkDocs hooks of the documentation build (mkdocs.yml): before anything is built, every generated
table in the pages and the README must be what docs/generate.py renders today, so that a change
to the schema's docstrings, the DeepSpeed key tables or the estimate fails `make docs` until the
pages are regenerated."""

from __future__ import annotations

import importlib.util
import re
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


# benchmarks/RESULTS.md links each figure to its record (`[commit](results/<record>.json)`,
# relative to benchmarks/). The results page (docs/results.md) includes the file whole; here the
# include is done before the page is converted, each of those links keeping its text (the commit,
# or the benchmark's name: the record is found under benchmarks/results/ by it), since on the
# site the records' paths lead nowhere.
_RESULTS_INCLUDE = '--8<-- "benchmarks/RESULTS.md"'
_RECORD_LINK = re.compile(r"\[([^\]]+)\]\(results/[^)\s]+\.json\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if _RESULTS_INCLUDE not in markdown:
        return markdown
    results = (Path(config["docs_dir"]).parent / "benchmarks" / "RESULTS.md").read_text()
    return markdown.replace(_RESULTS_INCLUDE, _RECORD_LINK.sub(r"\1", results))
