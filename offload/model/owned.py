"""The model as its user sees it while an engine owns it, and after.

While an engine is open, the model's parameters are views into 16-bit device buffers that are
freed between uses (`param: cpu|nvme`) and never hold the fp32 weights. So that the model's own
`state_dict()` (and `torch.save(model.state_dict())`, Hugging Face `save_pretrained`) gives what
the user trains, `StateDictHooks` puts a post-hook on every module that owns parameters: each
of its parameters' entries is replaced by the fp32 weights from the engine (a CPU tensor of its
own). A `state_dict(keep_vars=True)` (the engine's and the checkpoint's own walks over the
model) is left alone: its entries are the parameters themselves.

`close(restore_weights=False)` leaves the parameters without storage; `ReleasedModels` marks
such a model: its forward and state_dict raise an error that says why, and `offload.initialize`
refuses it (instead of reading freed memory) until its parameters hold real values again.

`OpenEngines` knows which models open engines own: initializing a model (or a module of it)
that an open engine already wraps is an error naming that engine.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch import nn

from offload.errors import OffloadError


class StateDictHooks:
    """Post-hooks on `model`'s modules that fill its state_dict with `fp32_of(param)` for every
    parameter `fp32_of` knows; `done()` is called at the end of the model's own state_dict.

    A tied parameter (GPT-2's `wte.weight` as `lm_head.weight`) is one tensor under each of its
    names, as in plain PyTorch's state_dict (`torch.save` stores it once; loading keeps the two
    tied). `reads` (the engine's `ParamReads`, or None) is suspended while a module's own
    state_dict runs: torch's walk `detach()`es each parameter, a view that the post-hook replaces
    with fp32 weights, and must not count as a read of weights that are not on the device."""

    def __init__(
        self,
        model: nn.Module,
        owned: set[int],
        fp32_of: Callable[[nn.Parameter], torch.Tensor],
        done: Callable[[], None],
        reads=None,
    ) -> None:
        self.fp32_of = fp32_of
        self.done = done
        self.reads = reads
        # id(parameter) -> the key of its last entry and (weakly) its value: a tied parameter's
        # next entry in the same state_dict is that value, found there under that key
        self._filled: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self.handles = []
        for module in model.modules():
            names = [name for name, param in module._parameters.items() if param is not None and id(param) in owned]
            if names:
                if reads is not None:
                    self.handles.append(module.register_state_dict_pre_hook(_suspend(reads, module)))
                self.handles.append(module.register_state_dict_post_hook(self._fill_hook(names, module)))
        self.handles.append(model.register_state_dict_post_hook(self._at_end_hook(model)))
        self.handles.append(model.register_load_state_dict_pre_hook(_refuse_load(model)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._filled.clear()

    def _fill_hook(self, names: list[str], owner: nn.Module):
        def hook(module, state_dict, prefix, local_metadata) -> None:
            if module is not owner:
                return
            if self.reads is not None:
                self.reads.resume()
            for name in names:
                key = prefix + name
                value = state_dict.get(key)
                # keep_vars=True: the entry is the parameter itself, and the caller wants exactly that
                if value is None or isinstance(value, nn.Parameter):
                    continue
                param = module._parameters[name]
                assert param is not None  # `names` holds only parameters that are set
                earlier_key, earlier = self._filled.get(id(param), (None, None))
                tied = None if earlier is None else earlier()
                if tied is not None and state_dict.get(earlier_key) is tied:
                    state_dict[key] = tied
                    continue
                state_dict[key] = self.fp32_of(param)
                self._filled[id(param)] = (key, weakref.ref(state_dict[key]))

        return hook

    def _at_end_hook(self, owner: nn.Module):
        def hook(module, state_dict, prefix, local_metadata) -> None:
            if module is owner:
                self._filled.clear()
                self.done()

        return hook


# The hooks act only for the module they were registered on (`owner`): a copy of the model
# (copy.deepcopy, an EMA's AveragedModel) carries them, and its state_dict holds its own weights.


def _suspend(reads, owner: nn.Module):
    def hook(module, prefix, keep_vars) -> None:
        if module is owner:
            reads.suspend()

    return hook


def _refuse_load(owner: nn.Module):
    """`model.load_state_dict(...)` while the engine owns the model would copy into parameters
    that are views of the engine's 16-bit device buffers (freed between uses when offloaded),
    leaving the fp32 masters the engine trains untouched: refused before anything is copied."""

    def hook(module, state_dict, prefix, *args) -> None:
        if module is not owner:
            return
        raise OffloadError(
            f"{type(owner).__name__}.load_state_dict(...) while an offload engine owns the model: the engine keeps "
            "the weights it trains (fp32 masters on the optimizer tier), so copying into the model's parameters would "
            "be lost at the next step (or write freed memory). Load the weights before offload.initialize, or "
            "engine.load_checkpoint(...) for an offload checkpoint (offload export gives safetensors from one); "
            "or engine.close() first, load, and initialize again"
        )

    return hook


class ReleasedModels:
    """Models whose engine was closed with restore_weights=False (their parameters are on the
    meta device: shapes, no values)."""

    MESSAGE = (
        "{what}: the engine that trained this model was closed with close(restore_weights=False), which leaves its "
        "parameters without values (to save a full fp32 copy in RAM). Save the weights before closing "
        "(engine.consolidated_state_dict(), or model.state_dict() while the engine is open), close with "
        "restore_weights=True to keep them in the model, or load weights into it again "
        "(model.to_empty(device='cpu'); model.load_state_dict(...))"
    )

    def __init__(self) -> None:
        self._hooks: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()

    def mark(self, model: nn.Module) -> None:
        # new parameters on the meta device replace the old ones (views of freed storage, which
        # any read would take out of bounds), tied ones staying tied, as Module.to("meta") does
        replaced: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]
        self._hooks[model] = [
            model.register_forward_pre_hook(self._refuse_forward),
            model.register_state_dict_post_hook(functools.partial(ReleasedModels._refuse_state_dict, self)),
        ]

    @staticmethod
    def _still_empty(model: nn.Module) -> bool:
        return any(param.is_meta for param in model.parameters())

    def _refuse_forward(self, module, args) -> None:
        if self._still_empty(module):
            raise OffloadError(self.MESSAGE.format(what=f"{type(module).__name__}.forward"))
        self._forget(module)

    def _refuse_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        if self._still_empty(module):
            raise OffloadError(self.MESSAGE.format(what=f"{type(module).__name__}.state_dict"))

    def _forget(self, model: nn.Module) -> None:
        for handle in self._hooks.pop(model, []):
            handle.remove()

    def check(self, model: nn.Module) -> None:
        """Before initialize: a released model (or one containing one) whose parameters are still
        empty is refused; one that holds values again is forgotten."""
        for module in model.modules():
            if module in self._hooks:
                if self._still_empty(module):
                    raise OffloadError(self.MESSAGE.format(what=f"offload.initialize({type(module).__name__})"))
                self._forget(module)


class OpenEngines:
    """The engines not closed yet, to refuse a second engine over the same parameters."""

    def __init__(self) -> None:
        self._engines: weakref.WeakSet = weakref.WeakSet()

    def add(self, engine) -> None:
        self._engines.add(engine)

    def discard(self, engine) -> None:
        self._engines.discard(engine)

    def check(self, model: nn.Module) -> None:
        mine = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        for engine in list(self._engines):
            if engine._closed:
                continue
            shared = [mine[id(p)] for p in engine.model.parameters() if id(p) in mine]
            if shared:
                raise OffloadError(
                    f"offload.initialize: this {type(model).__name__} (its parameter {shared[0]!r}) is already wrapped "
                    f"by an open engine ({engine!r}); keep using that engine, or call its close() first "
                    "(close() puts the trained fp32 weights back into the model)"
                )


RELEASED = ReleasedModels()
OPEN_ENGINES = OpenEngines()
