"""The README and the documentation pages (docs/) as a reader meets them: every Python block is run
by a named test, every JSON block is a valid config, every command names files that exist, the
generated tables and pictures are what their generators give today (docs/generate.py), the
DeepSpeed key table says what the translator does, and the README stays a front door."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from doc_blocks import ROOT, blocks, pages

import offload
from offload.config import docs as config_docs
from offload.config.deepspeed import translate_deepspeed
from offload.config.deepspeed_keys import KeyVerdict


def generate_module():
    spec = importlib.util.spec_from_file_location("offload_docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---- code blocks ------------------------------------------------------------------------------
def test_every_python_block_is_marked_with_the_test_that_runs_it():
    python = blocks("python")
    assert len(python) >= 8
    for block in python:
        where = f"{block.page.relative_to(ROOT)}: a python block starting {block.code[:60]!r}"
        assert block.marker, f"{where} has no '<!-- NAME: tests/test_x.py runs this block -->' line before it"
        test_file = ROOT / block.test_file
        assert test_file.is_file(), f"{where} names {block.test_file}, which does not exist"
        assert f'"{block.marker}"' in test_file.read_text(), f"{where}: {block.test_file} never asks for {block.marker!r}"


def test_a_block_shown_on_two_pages_is_one_block():
    seen: dict[str, str] = {}
    for block in blocks():
        if block.marker is None:
            continue
        assert seen.setdefault(block.marker, block.code) == block.code, f"{block.marker} differs in {block.page}"


@pytest.mark.parametrize("block", blocks("json"), ids=lambda b: b.marker or b.page.name)
def test_every_json_block_is_a_valid_config(block):
    assert block.marker, f"{block.page}: a json block without its marker line"
    config = offload.load_config(json.loads(block.code))
    assert config.precision in ("bf16", "fp16", "fp32")


def test_commands_name_example_files_that_exist():
    named = {path for page in pages() for path in re.findall(r"(examples/[\w/.-]+\.(?:py|json|yaml))", page.read_text())}
    assert len(named) >= 8
    for path in sorted(named):
        assert (ROOT / path).is_file(), path


# ---- generated tables and pictures ------------------------------------------------------------
def test_generated_tables_are_current():
    assert generate_module().stale_blocks() == [], "regenerate them: python docs/generate.py"


def test_the_machine_table_falls_back_to_checkpointing_where_nothing_else_fits():
    generate = generate_module()
    seventy_on_24 = next(row for row in generate.MACHINES if (row.model, row.gpu_memory) == ("70B", "24GB"))
    report = generate.estimate(seventy_on_24)
    assert report["recommended"] is None and report["with_checkpointing"] is not None
    placement, plan = generate.start_from(report)
    assert "checkpointing" in plan and placement.count("`") == 4


def test_pictures_are_what_the_generator_draws(tmp_path):
    pytest.importorskip("matplotlib", reason="the docs extra pins matplotlib (make test installs it)")
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import pictures
    finally:
        sys.path.remove(str(ROOT / "docs"))
    for path in pictures.draw_all(tmp_path):
        committed = pictures.ASSETS / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: python docs/generate.py"
    # every picture is shown: the README and the site
    shown = "".join(page.read_text() for page in pages())
    for name in pictures.PICTURES:
        assert f"assets/{name}" in shown, name


# ---- the DeepSpeed key table says what the translator does ---------------------------------------
def verdict_of(mapping: dict, key: str) -> str:
    result = translate_deepspeed(mapping)
    if any(name == key for name, _ in result.ignored):
        return "ignored"
    if any(name == key for name, _ in result.unsupported):
        return "refused"
    return "read"


@pytest.mark.parametrize("section", ["", "zero_optimization"])
def test_deepspeed_table_rows_are_what_the_translator_does(section):
    rows = [row for row in config_docs.deepspeed_rows() if row.section == section and row.verdict is not KeyVerdict.READ]
    assert len(rows) > 10
    for row in rows:
        path = f"{section}.{row.key}" if section else row.key
        for on in (True, False):
            value = {"grad_accum_dtype": "bf16" if on else "fp32"} if row.key == "data_types" else on  # its "off" is fp32
            mapping: dict = {"zero_optimization": {"stage": 2}}
            (mapping["zero_optimization"] if section else mapping)[row.key] = value
            expected = "refused" if on and row.verdict is KeyVerdict.REFUSED_UNLESS_OFF else "ignored"
            assert verdict_of(mapping, path) == expected, (path, value)


def test_deepspeed_table_names_the_keys_users_ask_about():
    rows = {(row.section, row.key): row for row in config_docs.deepspeed_rows()}
    assert rows[("zero_optimization.offload_optimizer", "super_offload")].verdict is KeyVerdict.READ
    assert rows[("zero_optimization", "zenflow")].verdict is KeyVerdict.REFUSED_UNLESS_OFF
    assert "not exact AdamW" in rows[("zero_optimization", "zenflow")].why
    assert rows[("zero_optimization", "stage3_prefetch_bucket_size")].verdict is KeyVerdict.IGNORED
    assert rows[("", "amp")].verdict is KeyVerdict.REFUSED_UNLESS_OFF


# ---- the README is the front door ---------------------------------------------------------------
def test_the_readme_is_short_and_its_first_screen_has_the_commands_and_the_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"the README has {len(lines)} lines; move a topic to a docs/ page"
    first_screen = "\n".join(lines[:60])
    assert "make demo" in first_screen and "make test" in first_screen and "<!-- quick-start" in first_screen


def test_the_readme_links_every_guide_and_reference_page():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*/*.md")):
        assert f"({page.relative_to(ROOT)})" in readme, f"the README does not link {page.relative_to(ROOT)}"
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
