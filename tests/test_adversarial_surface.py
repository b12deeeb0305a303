"""Issue 51, the user-facing surface, tried as an adversarial user would (findings 11, 12, 14):

- a config key whose value would put swap files in the current directory, or that sits in the
  wrong section, is refused with the fix: the key's real place, never a far-fetched spelling;
- `offload estimate` of an absurd model returns at once: what is per piece is counted in closed
  form, a model of more units than any real one (or a count that overflows) is refused;
- a model with nothing to train says so at its backward (and at a step() with no backward),
  instead of guessing at torch.no_grad.

(Finding 15, the accelerate route's precision and resume, is in tests/test_accelerate_route.py.)
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import re
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import TinyNet, batches, mse

import offload
from offload.cli import main as cli_main
from offload.config.schema import load_config
from offload.config.sizes import round_up
from offload.config.state_layout import FP32_STATE, STATE_KINDS, STEPPED_KINDS
from offload.errors import ConfigError, OffloadError
from offload.plan.optimizer_plan import PAGE, piece_bounds, step_disk_traffic, swap_bytes_for_state, swap_file_bytes


# ---- 11: the config ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nvme_path, key",
    [("", "offload.nvme_path"), ("  ", "offload.nvme_path"), (["/tmp", ""], "offload.nvme_path[1]")],
)
def test_an_empty_nvme_path_is_refused_naming_the_key(nvme_path, key):
    """An empty path would put the swap files under whatever directory the script runs in."""
    with pytest.raises(ConfigError) as error:
        load_config({"offload": {"optimizer": "nvme", "nvme_path": nvme_path}})
    assert error.value.key == key
    assert f"config key '{key}'" in str(error.value) and "current directory" in str(error.value)


@pytest.mark.parametrize(
    "mapping, key, meant",
    [
        ({"offload": {"state_precision": "int8"}}, "offload.state_precision", "optimizer.state_precision"),
        ({"state_precision": "int8"}, "state_precision", "optimizer.state_precision"),
        ({"offload": {"precision": "fp32"}}, "offload.precision", "precision"),
        ({"offload": {"state_precison": "int8"}}, "offload.state_precison", "optimizer.state_precision"),
        ({"learning_rate": 1e-3}, "learning_rate", "optimizer.lr"),
    ],
)
def test_a_key_in_the_wrong_section_is_pointed_to_where_it_lives(mapping, key, meant):
    """Before: 'did you mean speculation_memory' and 'did you mean precision'."""
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert str(error.value).startswith(f"unknown config key '{key}'; did you mean '{meant}'? ")


def test_no_far_fetched_spelling_is_suggested():
    """Nothing close: the section's keys are listed instead of a guess (before: 'speculation_memory'
    for a key it shares two syllables with)."""
    with pytest.raises(ConfigError) as error:
        load_config({"offload": {"moments": "int8"}})
    assert str(error.value).startswith("unknown config key 'offload.moments'; valid keys here: param, optimizer")


def test_every_key_written_in_another_section_is_pointed_home():
    from offload.config.key_hints import dotted, unknown_key_hint
    from offload.config.schema import key_sections

    sections = key_sections()
    for home, keys in sections.items():
        for key in keys:
            for section, present in sections.items():
                if key in present:
                    continue
                hint = unknown_key_hint(section, key, sections)
                assert f"'{dotted(home, key)}'" in hint, (section, key, hint)


@settings(max_examples=100, deadline=None)
@given(key=st.text(alphabet="abcdeilmnoprstuy_", min_size=1, max_size=20), section=st.sampled_from(["", "offload", "io"]))
def test_a_suggestion_is_an_alias_a_misplaced_key_or_spelt_close(key, section):
    from offload.config.key_hints import KEY_ALIASES, OTHER_SECTION_CUTOFF, SAME_SECTION_CUTOFF, unknown_key_hint
    from offload.config.schema import key_sections

    sections = key_sections()
    hint = unknown_key_hint(section, key, sections)
    for suggested in re.findall(r"'([a-z_.]+)'(?: or |\?)", hint):
        name = suggested.rpartition(".")[2]
        if name in (key.lower(), KEY_ALIASES.get(key.lower())):
            continue
        ratio = difflib.SequenceMatcher(None, key, name).ratio()
        same = name in sections[section] and suggested == name
        assert ratio >= (SAME_SECTION_CUTOFF if same else OTHER_SECTION_CUTOFF), (key, section, hint)


# ---- 12: offload estimate of an absurd model ----------------------------------------------------
@contextlib.contextmanager
def time_limit(seconds: int):
    """Raises TimeoutError in the main thread after `seconds` (the estimate is pure Python: the
    signal lands between two of its bytecodes)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


MACHINE = ["--ram", "128GB", "--disk", "2TB", "--gpu-memory", "80GB"]


def test_estimate_of_1e15_parameters_returns(capsys):
    """Before: a loop over every piece of every unit's state, 15 million per NVMe placement and
    state precision (1e13, a hundredth of them, took 22 s). Now about half a second of work (a
    minute allowed on a loaded machine)."""
    with time_limit(60):
        assert cli_main(["estimate", "1e15", "--json", *MACHINE]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["params"] == pytest.approx(1e15, rel=1e-6) and report["recommended"] is None


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(0, 20_000), piece=st.integers(1, 5_000), in_ram=st.booleans(), accumulation=st.integers(1, 4))
def test_the_closed_forms_count_what_the_pieces_hold(numel, piece, in_ram, accumulation):
    """The swap bytes and the step's disk traffic of a unit, as they were summed piece by piece."""
    pieces = piece_bounds(numel, piece)
    listed = sum(swap_file_bytes(FP32_STATE.kind_bytes(kind, end - start)) for start, end in pieces for kind in STATE_KINDS)
    assert swap_bytes_for_state(numel, piece) == listed
    traffic = step_disk_traffic(numel, piece, gradient_in_ram=in_ram, accumulation_steps=accumulation)
    each_way = sum(
        sum(round_up(FP32_STATE.kind_bytes(kind, end - start), PAGE) for kind in STEPPED_KINDS)
        + (0 if in_ram else accumulation * round_up(FP32_STATE.kind_bytes("grad32", end - start), PAGE))
        for start, end in pieces
    )
    assert traffic.read == traffic.written == each_way


@pytest.mark.parametrize(
    "model, extra, said",
    [
        ("1e17", [], "7,983 units"),  # the guessed depth of 1e17 parameters
        ("7B", ["--layers", "100000"], "100,001 units"),
        ("1e19", [], "at most 1e+18"),
        ("1e400", [], "neither a parameter count"),
        ("1.2.3", [], "neither a parameter count"),
    ],
)
def test_estimate_refuses_an_absurd_model_at_once(capsys, model, extra, said):
    with time_limit(60):
        assert cli_main(["estimate", model, *extra, *MACHINE]) == 2
    assert said in capsys.readouterr().err


def test_estimate_refuses_a_config_json_of_a_billion_layers_before_listing_them(tmp_path, capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9, "vocab_size": 300}))
    with time_limit(60):
        assert cli_main(["estimate", str(tmp_path / "config.json"), *MACHINE]) == 2
    assert "1,000,000,001 units" in capsys.readouterr().err


# ---- 14: nothing to train -------------------------------------------------------------------
@pytest.mark.parametrize("frozen_at", ["initialize", "later"])
def test_a_model_with_nothing_to_train_says_so(swap_dir, caplog, frozen_at):
    """Before: 'was the forward run under torch.no_grad?' for a forward that was not."""
    torch.manual_seed(0)
    model = TinyNet()
    if frozen_at == "initialize":
        model.requires_grad_(False)
    (x, y), config = batches(1)[0], {"precision": "fp32", "offload": {"nvme_path": swap_dir}}
    with offload.initialize(model, config) as engine:
        model.requires_grad_(False)
        with pytest.raises(OffloadError, match=r"no parameter of the model requires grad \(\d+ parameters, ") as error:
            engine.backward(mse(engine, x, y))
        said = str(error.value)
        assert "no_grad?" not in said and ("since offload.initialize" in said) == (frozen_at == "later")
        assert engine.micro_steps == 0
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert engine.step() is False
        assert "nothing to apply and returns False: no parameter of the model requires grad" in caplog.text
