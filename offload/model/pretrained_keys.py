"""Which key of a pretrained weights file fills which tensor of the model.

A file's keys are a model's `state_dict()` keys as some model class saved them; the model being
loaded may be another class of the same family, wrapped, or older. The renames are those
transformers applies when `from_pretrained` loads that model class, so a directory that
`from_pretrained` loads is loaded the same way here (docs/pretrained.md lists them):

1. transformers' own conversion renames for the model's classes (`get_model_conversion_mapping`:
   the model-type-specific `WeightRenaming`s, scoped to their sub-model), when transformers is
   installed; a key that needs one of its `WeightConverter`s (tensors merged or split, e.g. a
   mixture of experts' per-expert weights) is refused: that is not a copy that can be streamed;
2. the legacy names: `LayerNorm.gamma` / `LayerNorm.beta` -> `.weight` / `.bias`, and weight
   norm's `weight_g` / `weight_v` -> `parametrizations.weight.original0` / `original1`;
3. the base-model prefix (`base_model_prefix`, e.g. `bert`, `model`, `transformer`), added or
   stripped: a checkpoint saved from `BertModel` loads into `BertForMaskedLM` and the reverse;
4. PEFT's wrapping: the model's keys are compared without `base_model.model.` and without the
   `.base_layer` that LoRA inserts (a `modules_to_save` copy reads the same key as its original),
   so base weights load into a PEFT-wrapped meta model; the adapters' tensors are not in a base
   checkpoint and PEFT's own init fills them (not reported as missing);
5. tied weights: names of one tensor are one target, read once (a file storing only one of
   them fills all; a file storing both is read under the first name the model registers).

File keys naming one of the model's non-persistent buffers (a rotary `inv_freq`, BERT's
`position_ids`), or matching the model's `_keys_to_ignore_on_load_unexpected` (and
transformers' own `rotary_emb.inv_freq` and `position_ids` patterns), are skipped as
transformers skips them: those buffers are computed by the model. Any other file key that fills
nothing is unexpected. Model keys no file key fills are missing, except those matching
`_keys_to_ignore_on_load_missing` (silently initialised).

`key_rules(model)` gathers what the matching needs from a model (names, tied groups, the HF
attributes, duck-typed: any nn.Module works); `match_keys` is the decision, plain Python over
names, tested directly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
# transformers' legacy renames (conversion_mapping "legacy"), as (pattern, replacement)
LEGACY_RENAMES = (
    (re.compile(r"LayerNorm\.gamma"), "LayerNorm.weight"),
    (re.compile(r"LayerNorm\.beta"), "LayerNorm.bias"),
    (re.compile(r"\.weight_g$"), ".parametrizations.weight.original0"),
    (re.compile(r"\.weight_v$"), ".parametrizations.weight.original1"),
)
# file keys transformers drops when the model has such buffers (_adjust_missing_and_unexpected_keys)
BUFFER_PATTERNS = ((r"rotary_emb\.inv_freq", "rotary_emb.inv_freq"), (r"(^|\.)position_ids$", "position_ids"))
_PEFT_WRAPPED = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


@dataclass(frozen=True)
class KeyRules:
    """What matching needs from a model, as plain data.

    groups: the model's tensors that the file may fill, each the tuple of its names (a tied
    weight has several; the first, in registration order, is the one read), params and
    persistent buffers. `renames`: functions from a file key to the key transformers would load
    it as (its conversion renames), applied before the legacy ones; `converted`: a predicate
    telling file keys that need one of transformers' tensor converters."""

    groups: tuple[tuple[str, ...], ...]
    non_persistent: frozenset[str] = frozenset()
    base_model_prefix: str = ""
    peft: bool = False
    ignore_unexpected: tuple[str, ...] = ()
    ignore_missing: tuple[str, ...] = ()
    renames: tuple[Callable[[str], str], ...] = ()
    converted: Callable[[str], str | None] | None = None
    # PEFT's adapter tensors (their first names): never in a base checkpoint, so not "missing"
    adapters: frozenset[str] = frozenset()


@dataclass
class KeyMatch:
    """The decision. `sources`: for each group (by its first name), the file key read into it;
    `missing`: groups no file key fills (their first names); `unexpected`: file keys that fill
    nothing; `skipped`: file keys dropped as transformers drops them (named buffers, patterns,
    a second copy of a tied weight); `renamed`: file key -> the model name it was matched to,
    where they differ; `converted`: file key -> the transformers converter it needs;
    `adapters`: PEFT adapter tensors the file does not fill (PEFT's init fills them)."""

    sources: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    converted: dict[str, str] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)


def canonical(name: str, peft: bool) -> str:
    """A model key as the base model's checkpoint names it: PEFT's wrapping taken off."""
    if not peft:
        return name
    name = name.removeprefix(PEFT_PREFIX)
    return _PEFT_WRAPPED.sub("", name)


def legacy(key: str) -> str:
    for pattern, replacement in LEGACY_RENAMES:
        key = pattern.sub(replacement, key)
    return key


def _with_prefix(key: str, known: dict[str, str], prefix: str) -> str | None:
    """`key` as a known name: itself, without the base-model prefix, or with it."""
    if key in known:
        return key
    if prefix:
        if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in known:
            return key[len(prefix) + 1 :]
        if f"{prefix}.{key}" in known:
            return f"{prefix}.{key}"
    return None


def _resolve(key: str, rules: KeyRules, known: dict[str, str]) -> str | None:
    """The canonical model name `key` fills, trying the renamed key first, then the key as it
    is (transformers' order), each with the prefix added or stripped."""
    renamed = key
    for rename in rules.renames:
        renamed = rename(renamed)
    renamed = legacy(renamed)
    for candidate in (renamed, key):
        found = _with_prefix(candidate, known, rules.base_model_prefix)
        if found is not None:
            return found
    return None


def _ignored(key: str, patterns: Iterable[str]) -> bool:
    return any(re.search(pattern, key) for pattern in patterns)


def match_keys(file_keys: Iterable[str], rules: KeyRules) -> KeyMatch:
    """Which file key fills which of the model's tensors (see the module docstring)."""
    # canonical name -> the group's first name; several groups may share one canonical name
    # (PEFT's original and modules_to_save copies)
    known: dict[str, list[str]] = {}
    for group in rules.groups:
        for name in group:
            known.setdefault(canonical(name, rules.peft), []).append(group[0])
    lookup = {name: name for name in known}
    non_persistent = {canonical(name, rules.peft) for name in rules.non_persistent}
    match = KeyMatch()
    claimed: dict[str, tuple[str, str]] = {}  # group -> (file key, model name it matched)
    for key in sorted(file_keys):
        found = _resolve(key, rules, lookup)
        if found is None:
            converter = rules.converted(key) if rules.converted is not None else None
            if converter is not None:
                match.converted[key] = converter
            elif _resolve(key, rules, {n: n for n in non_persistent}) is not None or _ignored(key, rules.ignore_unexpected):
                match.skipped.append(key)
            else:
                match.unexpected.append(key)
            continue
        if found != key:
            match.renamed[key] = found
        for first in dict.fromkeys(known[found]):
            previous = claimed.get(first)
            if previous is None or _reads_first(found, previous[1], first, rules.peft):
                if previous is not None:
                    match.skipped.append(previous[0])
                claimed[first] = (key, found)
            else:
                match.skipped.append(key)
    match.sources = {first: key for first, (key, _) in claimed.items()}
    unfilled = [group[0] for group in rules.groups if group[0] not in claimed]
    match.adapters = [name for name in unfilled if name in rules.adapters]
    match.missing = [name for name in unfilled if name not in rules.adapters and not _ignored(name, rules.ignore_missing)]
    match.skipped = sorted(set(match.skipped) - set(match.sources.values()))
    return match


def _reads_first(name: str, other: str, group: str, peft: bool) -> bool:
    """Two file keys fill one group (a tied weight stored under both names, or a key stored with
    and without the prefix): the one matching the group's first name wins."""
    return canonical(group, peft) == name and canonical(group, peft) != other


def key_rules(model: nn.Module) -> KeyRules:
    """The matching rules for `model` (see the module docstring); duck-typed on the Hugging
    Face attributes, so any nn.Module works (a plain one gets only the legacy renames)."""
    state_keys = set(model.state_dict(keep_vars=True).keys())
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    non_persistent: set[str] = set()
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer is None:
            continue
        if name in state_keys:
            groups.setdefault(id(buffer), []).append(name)
        else:
            non_persistent.add(name)
    peft = isinstance(getattr(model, "peft_config", None), dict) and any(n.startswith(PEFT_PREFIX) for n in state_keys)
    inner = _hf_model(model)
    ignore_unexpected = set(getattr(inner, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignore_missing = set(getattr(inner, "_keys_to_ignore_on_load_missing", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    for pattern, suffix in BUFFER_PATTERNS:
        if inner is not None and any(name.endswith(suffix) for name in buffers):
            ignore_unexpected.add(pattern)
    renames, converted = _transformers_conversions(inner)
    adapter_names = set(model.peft_config) if peft else set()  # type: ignore[arg-type]
    firsts = [names[0] for names in groups.values()]
    return KeyRules(
        groups=tuple(tuple(names) for names in groups.values()),
        non_persistent=frozenset(non_persistent),
        base_model_prefix=str(getattr(inner, "base_model_prefix", "") or "") if inner is not None else "",
        peft=peft,
        ignore_unexpected=tuple(sorted(ignore_unexpected)),
        ignore_missing=tuple(sorted(ignore_missing)),
        renames=renames,
        converted=converted,
        adapters=frozenset(name for name in firsts if adapter_names & set(name.split("."))),
    )


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face PreTrainedModel inside `model` (itself, or the one PEFT wraps)."""
    for module in (model, getattr(getattr(model, "base_model", None), "model", None)):
        if module is not None and any(
            cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers") for cls in type(module).__mro__
        ):
            return module
    return None


def _transformers_conversions(model: nn.Module | None):
    """transformers' conversion renames for `model`'s classes, as functions on a key, and a
    predicate naming the converter a key would need (None: no transformers, or nothing)."""
    if model is None:
        return (), None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers before 5: its renames were the legacy ones and the prefix
        return (), None
    transforms = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(key: str, renaming=None) -> str:
        return renaming.rename_source_key(key)[0]

    renames = tuple(lambda key, r=r: rename(key, r) for r in renamings)

    def converted(key: str) -> str | None:
        for converter in converters:
            _, pattern = converter.rename_source_key(key)
            if pattern is not None:
                return f"{type(converter).__name__}({', '.join(converter.source_patterns)})"
        return None

    return renames, (converted if converters else None)
