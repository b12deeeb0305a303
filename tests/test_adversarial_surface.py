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

import difflib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config.schema import load_config
from offload.errors import ConfigError


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
