"""Reading the weights back out of the tiers: fp32 per unit, per parameter, whole model.

The model's parameters hold no weights between steps (their storage is the unit's flat device
buffer, resized to zero when not resident); the truth is this rank's shard in the tier store:
the fp32 master of the trainable elements (host memory, or a swap file when the optimizer
state is streamed) and the 16-bit weights of the frozen ones, which have no master.
`WeightsReader` reads those shards, gathers them from every rank, and serves

- `full_weights(unit)`: a unit's whole flat fp32 buffer (checkpoints, `close`);
- `param_weight(param)`: one parameter's fp32 weights, for the model's own `state_dict()`
  while the engine is open. The unit's buffer is read once and kept while a walk over the
  params stays in that unit; a step (the unit's `weights_version`) or `invalidate()` drops it;
- `state_dict(model)`: every weight and buffer under `model.state_dict()`'s keys.

All of it runs on the main thread, after the caller has waited for the steps in flight
(`settle`, given at construction): a read never races a step writing the same master.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from offload.config.placement import ParamTier
from offload.model.unit_state import UnitState
from offload.platform.collectives import Collectives
from offload.storage.tiers import TierStore


class WeightsReader:
    """See the module docstring. `settle` waits for every transfer and step in flight."""

    def __init__(self, units: list[UnitState], store: TierStore, collectives: Collectives, settle: Callable[[], None]) -> None:
        self.units = units
        self.store = store
        self.collectives = collectives
        self.settle = settle
        self.home = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.spec.params)}
        # (unit index, weights version) and that unit's full fp32 buffer; filled by
        # param_weight, dropped by invalidate() and whenever the key no longer matches
        self._cache: tuple[tuple[int, int], torch.Tensor] | None = None

    def invalidate(self) -> None:
        """A step was scheduled or weights were replaced: a kept copy is stale."""
        self._cache = None

    def master_shard(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's fp32 master shard of `unit` (its `optimizer_numel` elements)."""
        return self.store.read_master(unit)

    def param16_shard(self, unit: UnitState) -> torch.Tensor:
        """A host copy of this rank's 16-bit shard of `unit`, wherever its home is."""
        if self.store.param_tier is ParamTier.DEVICE and unit.param16 is None:
            # `none` on the CPU: the device buffer is host memory, and the home
            assert unit.device_flat is not None  # param none keeps every unit resident
            start, end = unit.layout.shard_range(self.collectives.rank)
            return unit.device_flat[start:end].clone()
        source, staged = self.store.read_param16(unit)
        try:
            return source.clone()
        finally:
            if staged:
                self.store.give_back_staging(source)

    def weights_shard(self, unit: UnitState) -> torch.Tensor:
        """This rank's shard of `unit`'s weights in fp32: the master where the shard has one, the
        16-bit weights of the frozen params (which have no master) elsewhere."""
        n = unit.optimizer_numel
        if n == unit.shard_numel:
            return self.master_shard(unit)
        shard = self.param16_shard(unit).float()
        shard[:n].copy_(self.master_shard(unit))
        return shard

    def full_weights(self, unit: UnitState) -> torch.Tensor:
        """`unit`'s whole flat buffer of fp32 weights (gathered from every rank)."""
        shard = self.weights_shard(unit)
        if not self.collectives.is_distributed:
            return shard
        full = torch.empty(unit.layout.padded_numel, dtype=torch.float32)
        self.collectives.all_gather_host(full, shard, what=f"fp32 weights of unit {unit.spec.name}")
        return full

    def param_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 weights of one parameter, a CPU tensor of its own."""
        unit, index = self.home[id(param)]
        key = (unit.index, unit.weights_version)
        if self._cache is None or self._cache[0] != key:
            self._cache = None
            self.settle()
            self._cache = (key, self.full_weights(unit))
        offset = unit.layout.offsets[index]
        return self._cache[1][offset : offset + param.numel()].view(param.shape).clone()

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and the model's buffers) under model.state_dict()'s keys, on the CPU."""
        self.settle()
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            full = self.full_weights(unit)
            for param, offset in zip(unit.spec.params, unit.layout.offsets):
                values[id(param)] = full[offset : offset + param.numel()].view(param.shape).clone()
        result: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in values:
                # a tied weight appears under each of its names as its own tensor (safetensors
                # refuses shared storage)
                value = values[id(tensor)]
                result[name] = value.clone() if any(v is value for v in result.values()) else value
            else:
                result[name] = tensor.detach().to("cpu", copy=True)
        return result
