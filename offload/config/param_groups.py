"""Parameter groups: torch-style groups resolved against a model, and the usual no-decay split.

`offload.initialize(model, config, param_groups=[...])` takes what `torch.optim.AdamW` takes as
its first argument, a list of dicts, each with "params" (parameters, or their names in
`model.named_parameters()`) and any of lr, weight_decay, betas, eps. `resolve_param_groups`
checks it whole (an unknown name or key, a parameter of another model, one listed twice are
errors that name it) and returns the groups with every hyperparameter filled in; the
parameters no group lists form one more group, last, with the config's values.

`param_groups_no_decay(model, weight_decay)` is the split Hugging Face recipes use (transformers'
`get_parameter_names(model, ALL_LAYERNORM_LAYERS)` / `Trainer.get_decay_parameter_names`):
weight decay on the weight matrices, none on biases, norm weights and other 1-D parameters.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import torch
from torch import nn

from offload.config.key_hints import KEY_ALIASES
from offload.errors import ConfigError

# The hyperparameters a group may set (the engine's CPU Adam reads them at every step).
GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")
# "name": a label some recipes give their groups; kept, never read
ALLOWED_KEYS = ("params", *GROUP_KEYS, "name")

# Module classes whose parameters are normalisation weights (no decay), besides names with "norm".
NORM_CLASSES = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


def is_no_decay(name: str, param: torch.Tensor, module: nn.Module | None = None) -> bool:
    """Whether the usual recipe exempts this parameter from weight decay: a bias, a norm weight
    (a norm module's, or a name with "norm" in it, as RMSNorm classes of every model family are
    named), or any other parameter with fewer than two dimensions."""
    lowered = name.lower()
    return param.ndim < 2 or "bias" in lowered or "norm" in lowered or (module is not None and isinstance(module, NORM_CLASSES))


def param_groups_no_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups of `model`'s trainable parameters: the weight matrices with
    `weight_decay`, and biases, norm weights and other 1-D parameters with none. Pass the result
    to `offload.initialize(..., param_groups=...)` (or to `torch.optim.AdamW`). An empty group
    is left out."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (f"{module_name}.{param_name}" if module_name else param_name, module))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        _, module = owners[id(param)]
        (no_decay if is_no_decay(name, param, module) else decay).append(param)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def check_group_value(where: str, key: str, value):
    """`value` of hyperparameter `key` as the engine uses it, or a ConfigError naming `where`."""
    if key == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"{where}['betas'] must be a pair (beta1, beta2), got {value!r}")
        betas = tuple(check_group_value(where, "betas[i]", v) for v in value)
        if not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"{where}['betas'] must each be in [0, 1), got {value!r}")
        return betas
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}[{key!r}] must be a finite number, got {value!r}")
    value = float(value)
    if key == "eps" and not value > 0:
        raise ConfigError(f"{where}['eps'] must be > 0, got {value}")
    if key in ("lr", "weight_decay") and not value >= 0:
        raise ConfigError(f"{where}[{key!r}] must be >= 0, got {value}")
    return value


def _group_params(where: str, params, by_name: dict[str, nn.Parameter], names_of: dict[int, str]) -> list[nn.Parameter]:
    if isinstance(params, (torch.Tensor, str)):
        params = [params]
    elif isinstance(params, dict) or not isinstance(params, Iterable):
        raise ConfigError(
            f"{where}['params'] must be parameters or parameter names (a list of them), got {type(params).__name__}"
        )
    found: list[nn.Parameter] = []
    for item in params:
        if isinstance(item, str):
            if item not in by_name:
                nearest = difflib.get_close_matches(item, list(by_name), n=1, cutoff=0.6)
                hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
                raise ConfigError(f"{where}['params'] names {item!r}, which is not a parameter of the model{hint}")
            param = by_name[item]
        elif isinstance(item, torch.Tensor):
            if id(item) not in names_of:
                raise ConfigError(
                    f"{where}['params'] holds a tensor of shape {list(item.shape)} that is not a "
                    "parameter of the model given to offload.initialize"
                )
            param = by_name[names_of[id(item)]]  # `item` itself: the parameter with its id, both alive
        else:
            raise ConfigError(f"{where}['params'] holds {type(item).__name__} {item!r}: give parameters or their names")
        if all(param is not other for other in found):  # a tied weight listed under both names
            found.append(param)
    return found


def resolve_param_groups(model: nn.Module, param_groups, defaults: dict) -> list[dict]:
    """The groups as the engine uses them: each {"params": [Parameter, ...], "lr", "weight_decay",
    "betas", "eps"} (plus "name" if given), every parameter of the model in exactly one; the
    parameters no group lists (trainable or not) form a last group with `defaults`.

    `defaults` gives each of GROUP_KEYS (the config's optimizer values)."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, str] = {}
    for name, param in by_name.items():
        names_of.setdefault(id(param), name)
    if param_groups is None:
        param_groups = []
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise ConfigError(
            "param_groups must be a list of dicts, each with 'params' and any of "
            f"{', '.join(GROUP_KEYS)} (as torch.optim.AdamW takes them), got {type(param_groups).__name__}"
        )
    resolved = []
    owner: dict[int, int] = {}
    for index, group in enumerate(param_groups):
        where = f"param_groups[{index}]"
        if not isinstance(group, dict):
            raise ConfigError(
                f"{where} must be a dict with 'params' and any of {', '.join(GROUP_KEYS)}, got "
                f"{type(group).__name__} (a plain list of parameters is one group: wrap it as "
                "[{'params': [...]}])"
            )
        for key in group:
            if key not in ALLOWED_KEYS:
                alias = KEY_ALIASES.get(str(key).lower())
                nearest = (
                    [alias] if alias in ALLOWED_KEYS else difflib.get_close_matches(str(key), list(ALLOWED_KEYS), n=1, cutoff=0.5)
                )
                hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
                raise ConfigError(
                    f"{where} has the key {key!r}, which the engine's AdamW does not read{hint}; "
                    f"a group takes {', '.join(ALLOWED_KEYS)}"
                )
        if "params" not in group:
            raise ConfigError(f"{where} has no 'params'")
        params = _group_params(where, group["params"], by_name, names_of)
        for param in params:
            if id(param) in owner:
                raise ConfigError(
                    f"parameter {names_of[id(param)]!r} is in param_groups[{owner[id(param)]}] and "
                    f"{where}: each parameter may be in one group only"
                )
            owner[id(param)] = index
        entry = {"params": params}
        for key in GROUP_KEYS:
            entry[key] = check_group_value(where, key, group[key]) if key in group else defaults[key]
        if "name" in group:
            entry["name"] = group["name"]
        resolved.append(entry)
    rest: list[nn.Parameter] = []
    for param in by_name.values():
        if id(param) not in owner and all(param is not other for other in rest):
            rest.append(param)
    if rest or not resolved:
        resolved.append({"params": rest, **{key: defaults[key] for key in GROUP_KEYS}})
    return resolved
