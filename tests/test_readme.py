"""The README and the documentation pages as a new user reads them: the quick start runs as
written, the `offload estimate` commands the pages show work, and the config-key table of the
config reference (docs/reference/config.md) is the one generated from the config dataclasses."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import marked_block, pages, shell_lines

from offload.cli import main as cli_main
from offload.config import docs as config_docs

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIG_REFERENCE = (ROOT / "docs" / "reference" / "config.md").read_text()


def quick_start() -> str:
    return marked_block("quick-start")


def test_quick_start_is_ten_lines_and_runs_as_written(tmp_path):
    snippet = quick_start()
    assert len(snippet.strip().splitlines()) <= 10
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # each number printed with its label and unit
    printed = re.fullmatch(r"loss ([0-9.]+), host RAM peak ([0-9,]+) bytes\n", result.stdout)
    assert printed, result.stdout
    assert float(printed.group(1)) >= 0 and int(printed.group(2).replace(",", "")) > 0


def test_config_key_table_is_current():
    start, end = CONFIG_REFERENCE.index(config_docs.BEGIN), CONFIG_REFERENCE.index(config_docs.END) + len(config_docs.END)
    assert CONFIG_REFERENCE[start:end] == config_docs.render_block(), "regenerate it: python docs/generate.py"


def test_config_key_table_covers_every_key():
    keys = {row[0] for row in config_docs.config_rows()}
    assert {"precision", "offload.param", "offload.nvme_path", "io.block_size", "wrap.min_params", "loss_scale.initial"} <= keys
    assert all(doc for _, _, doc in config_docs.config_rows())


def test_the_two_commands_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert "make demo" in README and "make test" in README


def test_the_gpu_machine_command_uses_the_python_at_hand():
    """`make test-here` (documented for GPU machines without a registry) installs only the
    package, into the interpreter it is given, and runs the whole suite with that interpreter."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    python = "/opt/python-at-hand/bin/python3"
    dry_run = subprocess.run(
        ["make", "-n", "-s", "test-here", f"PYTHON={python}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert dry_run.returncode == 0, dry_run.stderr
    install, run, checked_run = dry_run.stdout.splitlines()
    assert install.startswith(f"{python} -m pip install") and {"--no-deps", "--no-build-isolation", "-e", "."} <= set(
        install.split()
    )
    assert run.startswith(f"{python} -m pytest") and run.split()[-1] == "tests"
    # then the engine-equivalence tests again, on the checked stand-in device
    assert checked_run.startswith("OFFLOAD_DEVICE=checked ") and f"{python} -m pytest" in checked_run
    assert ".venv" not in dry_run.stdout and "torch" not in dry_run.stdout
    assert "make test-here" in README and "make test-here" in (ROOT / "docs" / "guides" / "gpu-machine.md").read_text()


def test_the_pages_estimate_commands_work(tmp_path, capsys):
    llama = tmp_path / "config.json"
    llama.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "intermediate_size": 1376,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "vocab_size": 32000,
            }
        )
    )
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
            }
        )
    )
    commands = shell_lines("offload estimate") + [
        line.removeprefix(".venv/bin/") for line in shell_lines(".venv/bin/offload estimate")
    ]
    assert len(commands) >= 6
    for command in commands:
        command = command.replace("path/to/config.json", str(llama)).replace("ds_config.json", str(ds))
        command = command.replace("/local_nvme", str(tmp_path))
        argv = shlex.split(command.split("#")[0])[1:]
        assert cli_main(argv) == 0, command
        assert "recommended" in capsys.readouterr().out


def test_the_pages_name_existing_example_files():
    for page in pages():
        for path in re.findall(r"(examples/[\w/.-]+\.(?:py|json))", page.read_text()):
            assert (ROOT / path).is_file(), (page, path)
