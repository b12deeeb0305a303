"""What a newcomer finds without reading the source: `help(offload.initialize)` describes every
argument, `dir(offload)` and `offload.__all__` list the public API, the `offload export` commands
the pages show are ones the command accepts, and the examples pass no deprecated arguments."""

from __future__ import annotations

import argparse
import inspect
import pydoc
import re
import shlex
from pathlib import Path

import pytest
from doc_blocks import shell_lines

import offload
from offload.cli import export as export_command

ROOT = Path(__file__).resolve().parent.parent
INITIALIZE_ARGUMENTS = [
    "model",
    "config",
    "param_groups",
    "device",
    "process_group",
    "run_name",
    "strict",
    "weights",
    "weights_strict",
]


def test_initialize_takes_every_argument_by_name():
    parameters = inspect.signature(offload.initialize).parameters
    assert list(parameters) == INITIALIZE_ARGUMENTS
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@pytest.mark.parametrize("name", INITIALIZE_ARGUMENTS)
def test_help_of_initialize_describes_each_argument(name):
    text = pydoc.render_doc(offload.initialize, renderer=pydoc.plaintext)
    # a line of its own, `name: what it is`, in the docstring
    assert re.search(rf"^\s+{name}: \S", text, flags=re.M), text


def test_all_lists_the_public_api_and_dir_shows_it():
    public = {"initialize", "Engine", "Config", "load_config", "CPUAdamW", "param_groups_no_decay", "OffloadError", "ConfigError"}
    assert public <= set(offload.__all__)
    assert set(offload.__all__) <= set(dir(offload))
    for name in offload.__all__:
        assert getattr(offload, name) is not None, name
    namespace: dict = {}
    exec("from offload import *", namespace)
    assert {"initialize", "CPUAdamW", "OffloadError"} <= set(namespace)


def test_the_export_commands_of_the_pages_parse():
    commands = [line.split("#")[0] for line in shell_lines("offload export")]
    assert len(commands) >= 2
    parser = argparse.ArgumentParser(prog="offload export", exit_on_error=False)
    export_command.add_arguments(parser)
    for command in commands:
        args = parser.parse_args(shlex.split(command)[2:])
        assert args.checkpoint and args.out, command


def test_examples_pass_no_deprecated_arguments():
    # transformers 5: `dtype=` (torch_dtype= warns); Trainer(processing_class=) (tokenizer= is gone)
    deprecated = re.compile(r"\btorch_dtype=|\bevaluation_strategy=|Trainer\([^)]*\btokenizer=")
    paths = sorted((ROOT / "examples").glob("*.py"))
    assert paths
    for path in paths:
        assert not deprecated.search(path.read_text()), path
