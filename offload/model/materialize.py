"""Real values for a model built on the meta device, one unit at a time.

A model too big for RAM is built under `with torch.device("meta"):` (shapes only, no storage).
The engine then calls `materialize_unit_params(model, unit.spec)` for each unit in turn, just
before copying that unit's values into its flat buffer and onto its tiers; once adopted, the
unit's params become views of its device buffer and the storage given here is dropped. So at
most one unit's fp32 values exist in RAM at a time, never the whole model.

What a unit materialises (its *territory*): the modules under its own module whose subtrees
hold at least one of its params or no params at all, stopping at subtrees that hold only other
units' params. For the root unit (the whole model) that is everything outside the other units.

How values are made:
- Params: the unit's own meta params get zero-filled CPU storage in place
  (`torch.utils.swap_tensors`, so the Parameter objects, their ids and any attributes set on
  them stay the same), then each module in the territory that owns one of them is
  initialised the way the model would have been:
  - Hugging Face `PreTrainedModel`s: the nearest enclosing PreTrainedModel's
    `_init_weights(module)` (what `from_config` / `post_init` run), module by module;
  - other modules: `module.reset_parameters()` (torch's own modules all have it).
  A module whose direct params are not all this unit's (a weight tied to another unit) is
  initialised on a shallow copy that holds fresh storage for all of its params, and only
  this unit's params take the copy's values: another unit's weights are never written.
  A module reached a second time through a tied weight already initialised is skipped.
  PEFT's LoRA layers initialise their adapters themselves (`reset_lora_parameters`: B zero),
  before the modules inside them are visited.
  With pretrained weights (`initialize(..., weights=)`), only the params the file does not
  fill are materialised here (`params=`); the others get their values from the file.
- Buffers: buffers left on the meta device (e.g. a Hugging Face rotary `inv_freq`, computed
  in `__init__` and therefore meta too) get CPU storage and are recomputed by the same
  init call (Hugging Face's `_init_weights` recomputes rotary frequencies; torch modules'
  `reset_parameters` resets e.g. BatchNorm running stats). Buffers registered on the CPU
  explicitly (`torch.arange(..., device="cpu")` inside a meta context) are left as they are:
  that is the way for a custom module to keep a buffer that no init method recomputes.

Every meta param and buffer a unit takes on must be written by one of those calls (checked
with the tensor's version counter); one that was not raises `MaterializeError` naming it and
what to do, instead of training from zeros.
"""

from __future__ import annotations

import copy
import logging
import mmap
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from offload.errors import OffloadError
from offload.model.units import UnitSpec

logger = logging.getLogger(__name__)


class MaterializeError(OffloadError):
    """A model built on the meta device has a param or buffer offload cannot give values to."""


def has_meta_state(model: nn.Module, spec: UnitSpec, params: list[nn.Parameter] | None = None) -> bool:
    """Whether the unit has a meta param (of `params`, by default all of its own), or a meta
    buffer in its territory, to materialise."""
    if any(param.is_meta for param in (spec.params if params is None else params)):
        return True
    owned = {id(param) for param in spec.params}
    return any(
        buffer is not None and buffer.is_meta for module in territory(spec.module, owned) for buffer in module._buffers.values()
    )


def territory(top: nn.Module, owned: set[int]) -> list[nn.Module]:
    """Modules under `top` (itself included) that a unit owning `owned` (param ids) initialises:
    descends into every child except those whose subtree holds params, none of them owned."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [top]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        children = []
        for child in module.children():
            ids = [id(p) for p in child.parameters()]
            if ids and not any(i in owned for i in ids):
                continue  # another unit's subtree
            children.append(child)
        stack.extend(reversed(children))  # registration order, depth first (the order modules() gives)
    return found


def init_owner(model: nn.Module, module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module | None:
    """The Hugging Face PreTrainedModel whose `_init_weights` initialises `module` (the nearest
    enclosing one, as transformers' `initialize_weights` dispatches), or None for plain torch."""
    current: nn.Module | None = module
    while current is not None:
        if _is_pretrained(current):
            return current
        current = parents.get(id(current))
    return None


def _is_pretrained(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers") for cls in type(module).__mro__
    )


def _parent_map(model: nn.Module) -> dict[int, nn.Module]:
    parents: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    return parents


def mapped_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor in its own anonymous memory map, returned to the OS as soon
    as the last tensor viewing it is gone.

    Per-unit temporaries (a unit's fresh params, its fp32 flat copy) come from here rather than
    from malloc: glibc serves blocks below its (self-raising, up to 32 MiB) mmap threshold
    from the heap and keeps them after free, so one short-lived block per unit, over many
    units, grew the process by about the whole fp32 model even though each was freed."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    buffer = mmap.mmap(-1, numel * itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)


def _real_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu")


def give_storage(param: nn.Parameter, storage: torch.Tensor) -> None:
    """Swaps `storage` (a tensor of the param's numel, any device) into a meta param, keeping the
    Python object (and its id); `param.data = ...` refuses to turn a meta tensor into a real one."""
    real = nn.Parameter(storage.view(param.shape), requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)  # swap_tensors swaps __dict__ too: keep the attributes
    torch.utils.swap_tensors(param, real)


def _run_init(module: nn.Module, owner) -> bool:
    """Initialises `module`'s own params and buffers; False when nothing knows how."""
    if owner is not None:
        owner._init_weights(module)
        return True
    for method in ("reset_parameters", "_reset_parameters"):  # the second: nn.MultiheadAttention
        reset = getattr(module, method, None)
        if callable(reset):
            reset()
            return True
    return False


def _init_on_copy(module: nn.Module, owner, targets: dict[str, torch.Tensor]) -> bool:
    """Initialises a shallow copy of `module` with fresh storage for all its params and buffers,
    then copies the values of `targets` (name -> this unit's tensor) from it."""
    shadow = copy.copy(module)
    shadow._parameters = {
        name: None if p is None else nn.Parameter(_real_like(p), requires_grad=p.requires_grad)
        for name, p in module._parameters.items()
    }
    shadow._buffers = {name: None if b is None else _real_like(b) for name, b in module._buffers.items()}
    if not _run_init(shadow, owner):
        return False
    with torch.no_grad():
        for name, target in targets.items():
            source = shadow._parameters[name] if name in shadow._parameters else shadow._buffers[name]
            # the shadow's tensor of a target is not None: the targets are tensors of `module`
            # under the same name, and the shadow has fresh storage for each of them
            assert source is not None
            target.copy_(source)
    return True


def _padded(numel: int) -> int:
    return (numel + 15) // 16 * 16  # 64-byte starts for fp32 (vector loads in init kernels)


def _describe(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


@torch.no_grad()
def materialize_unit_params(model: nn.Module, spec: UnitSpec, params: list[nn.Parameter] | None = None) -> None:
    """Gives the unit's meta params (those of `params`, by default all; pretrained weights fill
    the others) and the meta buffers in its territory real CPU storage and initialises them as
    the model would; see the module docstring for the rules."""
    owned = {id(param) for param in spec.params}
    modules = territory(spec.module, owned)
    parents, names = _model_maps(model)
    pending_params = {id(p): p for p in (spec.params if params is None else params) if p.is_meta}
    versions: dict[int, tuple[str, torch.Tensor, int]] = {}  # id -> (name, tensor, version after allocation)
    for dtype in {p.dtype for p in pending_params.values()}:
        # one mapping per dtype for the whole unit (see mapped_zeros); it is unmapped once the
        # engine has pointed every param at the unit's device buffer
        group = [p for p in pending_params.values() if p.dtype == dtype]
        block = mapped_zeros(sum(_padded(p.numel()) for p in group), dtype)
        offset = 0
        for param in group:
            give_storage(param, block[offset : offset + param.numel()])
            offset += _padded(param.numel())
    for param in pending_params.values():
        versions[id(param)] = (names.get(id(param), "<param>"), param, param._version)
    meta_buffers: dict[int, list[str]] = {}
    for module in modules:
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                real = _real_like(buffer)
                module._buffers[name] = real
                meta_buffers.setdefault(id(module), []).append(name)
                versions[id(real)] = (f"{names.get(id(module), '<module>')}.{name} (buffer)", real, real._version)
    if not versions:
        return

    # ids of params already initialised by this call (PEFT's adapters first, by their layer)
    initialised: set[int] = _init_adapters(model, modules, pending_params)
    uncovered: list[str] = []
    for module in modules:
        direct = {name: p for name, p in module._parameters.items() if p is not None}
        mine = {name: p for name, p in direct.items() if id(p) in pending_params}
        fresh = {name: p for name, p in mine.items() if id(p) not in initialised}
        buffers = meta_buffers.get(id(module), [])
        if not fresh and not buffers:
            continue  # nothing of this unit's to create here (or a tied weight done already)
        owner = init_owner(model, module, parents)
        # with pretrained weights, the module's real buffers hold the file's values: its init
        # (which resets every buffer it has) runs on a copy, and only what is created here is kept
        loaded = params is not None and any(b is not None and name not in buffers for name, b in module._buffers.items())
        if len(mine) == len(direct) and not (set(mine) - set(fresh)) and not loaded:
            ok = _run_init(module, owner)
        else:
            targets: dict[str, torch.Tensor] = {name: p for name, p in fresh.items()}
            for name in buffers:
                buffer = module._buffers[name]
                assert buffer is not None  # a real tensor took the meta buffer's place above
                targets[name] = buffer
            ok = _init_on_copy(module, owner, targets)
        if not ok:
            prefix = names.get(id(module), type(module).__name__)
            uncovered.extend(f"{prefix}.{name}" for name in [*fresh, *buffers])
        initialised.update(id(p) for p in fresh.values())

    unwritten = [name for name, tensor, version in versions.values() if tensor._version == version]
    missing = sorted(set(uncovered) | set(unwritten))
    if missing:
        raise MaterializeError(
            f"unit {spec.name}: {_describe(missing)} were built on the meta device and no init method gave them "
            "values (a plain module needs reset_parameters() that fills its params and buffers; a Hugging Face "
            "model's _init_weights must cover them); add one, register such buffers with an explicit "
            "device='cpu', or build the model on the CPU"
        )
    logger.debug(
        "offload: materialised %d params and %d buffers of unit %s",
        len(pending_params),
        sum(len(v) for v in meta_buffers.values()),
        spec.name,
    )


def _init_adapters(model: nn.Module, modules: list[nn.Module], pending: dict[int, nn.Parameter]) -> set[int]:
    """PEFT's LoRA layers initialise their adapters as PEFT does (`reset_lora_parameters`:
    A as torch's Linear, B zero, so a new adapter changes nothing), not by the enclosing model's
    `_init_weights` (which would draw B at random). Returns the ids of the params initialised."""
    done: set[int] = set()
    configs = getattr(model, "peft_config", None)
    for layer in modules:
        reset = getattr(layer, "reset_lora_parameters", None)
        adapters = getattr(layer, "lora_A", None)
        if not callable(reset) or not isinstance(adapters, nn.ModuleDict):
            continue
        for adapter in list(adapters.keys()) + list(getattr(layer, "lora_embedding_A", {}).keys()):
            owned = [p for name, p in layer.named_parameters() if adapter in name.split(".") and id(p) in pending]
            if not owned:
                continue
            config = configs.get(adapter) if isinstance(configs, dict) else None
            kind = getattr(config, "init_lora_weights", True)
            if kind is not True and kind != "gaussian":
                raise MaterializeError(
                    f"LoRA adapter {adapter!r}: init_lora_weights={kind!r} derives the adapter from the base weights, "
                    "which a model built on the meta device does not have at that point; use init_lora_weights=True or "
                    "'gaussian', or build the adapter on a loaded model"
                )
            reset(adapter, kind)
            done.update(id(p) for p in owned)
    return done


_MAPS: weakref.WeakKeyDictionary[nn.Module, tuple[dict, dict]] = weakref.WeakKeyDictionary()


def _model_maps(model: nn.Module) -> tuple[dict[int, nn.Module], dict[int, str]]:
    """(parent of each module, qualified name of each module and param), computed once per model:
    the engine materialises unit after unit, and a walk of the whole model per unit is quadratic."""
    maps = _MAPS.get(model)
    if maps is None:
        maps = _MAPS[model] = (_parent_map(model), _qualified_names(model))
    return maps


def _qualified_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name or "<root>")
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            names.setdefault(id(param), f"{name}.{param_name}" if name else param_name)
    return names


def iter_meta(model: nn.Module) -> Iterator[str]:
    """Names of params and buffers still on the meta device."""
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if tensor.is_meta:
            yield name
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer is not None and buffer.is_meta:
            yield name


def check_has_storage(name: str, param: torch.Tensor) -> None:
    """A parameter whose storage is smaller than its view (freed by an engine, resized by
    hand) would be read out of bounds: an error instead."""
    if param.is_meta:
        return
    needed = (param.storage_offset() + param.numel()) * param.element_size() if param.numel() else 0
    if param.untyped_storage().nbytes() < needed:
        raise OffloadError(
            f"parameter {name!r} has {param.untyped_storage().nbytes()} bytes of storage for a view of {needed}: its "
            "memory was freed (by an offload engine that owned it, or its storage resized); rebuild or reload the model"
        )
