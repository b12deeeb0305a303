"""Which key an unknown config key most likely meant, for the error that refuses it.

Plain functions over the schema's key names (`schema.key_sections` lists them; no dataclasses
here), tested directly. The order of the guesses, each tried only when the one before found
nothing:

1. a key of this section written in other letter case (`LR`), or a name users bring from torch,
   transformers or DeepSpeed for one (`KEY_ALIASES`: `learning_rate` for `lr`);
2. the key, or its alias, as a key of another section: `offload.state_precision` is
   `optimizer.state_precision`, a top-level `state_precision` too, `offload.precision` the
   top-level `precision` (a misplaced key is more likely than a misspelt one that happens to
   resemble a neighbour: `state_precision` spells close to `precision`);
3. a key of this section spelt alike (difflib's ratio at least `SAME_SECTION_CUTOFF`);
4. a key of another section spelt alike (at least `OTHER_SECTION_CUTOFF`: a key both misplaced
   and misspelt is rarer, and a loose match across every section finds something for anything).

Below the cutoffs nothing is suggested and the error lists the section's keys instead: a wrong
guess (`speculation_memory` for `state_precision`) sends the user the wrong way.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

# Names users bring from other libraries (torch.optim, transformers, DeepSpeed) for our keys.
KEY_ALIASES = {
    "learning_rate": "lr",
    "beta": "betas",
    "epsilon": "eps",
    "adam_epsilon": "eps",
    "decay": "weight_decay",
    "wd": "weight_decay",
    "clip_grad": "gradient_clipping",
    "max_grad_norm": "gradient_clipping",
    "grad_clip": "gradient_clipping",
    "gradient_accumulation": "gradient_accumulation_steps",
    "grad_accum": "gradient_accumulation_steps",
    "dtype": "precision",
    "mixed_precision": "precision",
    "path": "nvme_path",
    "swap_path": "nvme_path",
    "num_threads": "threads",
    "prefetch_depth": "depth",
}

# difflib.SequenceMatcher.ratio a spelling must reach to be suggested: within the section, the
# ratio difflib itself calls close (`parm` -> `param` 0.89, `nvme` -> `nvme_path` 0.62,
# `state_precision` -> `speculation_memory` 0.36 is not); across sections, stricter
# (`batch_size` -> `io.block_size` 0.70 is not suggested).
SAME_SECTION_CUTOFF = 0.6
OTHER_SECTION_CUTOFF = 0.8


def dotted(section: str, key: str) -> str:
    """`key` of `section` ("" is the top level) as the error writes it: `optimizer.lr`, `seed`."""
    return f"{section}.{key}" if section else key


def _elsewhere(section: str, names: Sequence[str], sections: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(section, key) for each of `names` that is a key of a section other than `section`
    (compared without case), in the schema's order."""
    wanted = {name.lower() for name in names}
    return [(other, key) for other, keys in sections.items() if other != section for key in keys if key.lower() in wanted]


def _misplaced(section: str, found: list[tuple[str, str]]) -> str:
    """The hint for a key that belongs in another section: `found` (section, key) pairs."""
    shown = " or ".join(f"'{dotted(other, name)}'" for other, name in found)
    homes = [other for other, _ in found if other]
    places = [f"a key of the {' and '.join(homes)} section{'s' if len(homes) > 1 else ''}"] if homes else []
    if len(homes) < len(found):
        places.insert(0, "a top-level key")
    here = f"not of the {section} section" if section else "not a top-level one"
    return f"; did you mean {shown}? ('{found[0][1]}' is {' and '.join(places)}, {here})"


def unknown_key_hint(section: str, key: str, sections: Mapping[str, Sequence[str]]) -> str:
    """The end of the error refusing `key` in `section` ("" is the top level): "; did you mean
    '<key>'?" (a key of the same section, by its bare name, as the user is writing that section),
    "; did you mean '<section>.<key>'? (...)" (a key of another section, by its full path), or
    "; valid keys here: ..." when nothing is close enough (see the module docstring).
    `sections`: every section's keys, "" for the top level (whose keys include the sections)."""
    names = list(sections[section])
    alias = KEY_ALIASES.get(key.lower())
    meant = [name for name in names if name.lower() in (key.lower(), alias)]
    if meant:
        return f"; did you mean '{meant[0]}'?"
    found = _elsewhere(section, [key] + ([alias] if alias else []), sections)
    if found:
        return _misplaced(section, found)
    close = difflib.get_close_matches(key, names, n=1, cutoff=SAME_SECTION_CUTOFF)
    if close:
        return f"; did you mean '{close[0]}'?"
    ranked = sorted(
        (
            (difflib.SequenceMatcher(None, key, name).ratio(), other, name)
            for other, keys in sections.items()
            if other != section
            for name in keys
        ),
        key=lambda item: -item[0],  # stable: the schema's order among equals
    )
    if ranked and ranked[0][0] >= OTHER_SECTION_CUTOFF:
        return _misplaced(section, [(ranked[0][1], ranked[0][2])])
    return f"; valid keys here: {', '.join(names)}"
