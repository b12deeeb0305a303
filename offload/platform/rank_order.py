"""The order in which several ranks issue the collectives of their units (plain logic, no torch).

Collectives pair up by order alone: if rank 0 reduce-scatters unit 3 while rank 1
reduce-scatters unit 4, the two are summed into each other silently (same sizes) or both wait
for the timeout. Ranks run different units when the model branches on the data, so the engine
never lets the backward's order decide:

- At the start of each backward the ranks agree on which units their forwards used, and how
  often (`Op.BACKWARD`).
- Gradients are reduced in one fixed order, the same on every rank (`ReduceOrder`): the used
  units by descending index, which is the order a backward finishes them in an ordinary
  stack of blocks. A unit reduces when its gradients are final and every unit before it in the
  order has reduced; a unit this rank did not use contributes zeros; units used more than once
  on some rank reduce at the end of backward; units whose gradients showed up unannounced (a
  parameter used outside the model's forward) reduce after those, in an order agreed then.
- Before every collective of a unit the ranks state what they are about to do (`Op`, unit) in
  one small host all_gather; a difference is an error that names what each rank was doing,
  before any tensor is mixed. The same exchange carries which parameters of the unit have a
  gradient on any rank, so every rank steps the same parameters.
"""

from __future__ import annotations

import enum


class Op(enum.IntEnum):
    """What a rank is about to do, as stated in the agreement before it."""

    BACKWARD = 1  # start of a backward: which units the forward used
    REDUCE = 2  # reduce-scatter of a unit's gradients
    GATHER = 3  # all-gather of a unit's 16-bit weights
    EXTRAS = 4  # end of backward: units with gradients nobody announced


_DESCRIPTIONS = {
    Op.BACKWARD: "the start of backward (non-finite loss check, units used)",
    Op.REDUCE: "the reduce-scatter of the gradients of unit {}",
    Op.GATHER: "the all-gather of the weights of unit {}",
    Op.EXTRAS: "the end of backward (gradients of units not announced)",
}


def describe(key: tuple[int, int], unit_names: list[str]) -> str:
    """What a rank stating `key` was about to do, in words."""
    op, unit = key
    if op not in Op.__members__.values():
        return f"operation {op} (unknown)"
    if op == Op.BACKWARD:
        # its second number: the training forwards the rank had started through engine(...)
        return f"the start of backward after training forward number {unit} (non-finite loss check, units used)"
    name = unit_names[unit] if 0 <= unit < len(unit_names) else f"#{unit}"
    return _DESCRIPTIONS[Op(op)].format(name)


MISMATCH_HINT = (
    "Every rank must run the same units in forward when offload.param is cpu or nvme (their weights are "
    "gathered from all ranks at each use); with offload.param none, ranks may skip units, as DDP allows "
    "unused parameters. And every rank runs the same number of training forwards (engine(...) with grad "
    "enabled) before each backward: a batch whose forward failed on one rank and was skipped there puts the "
    "ranks a micro-batch apart; skip it on every rank (agree on it, e.g. with torch.distributed.all_reduce of a flag)."
)


class ReduceOrder:
    """Which units' gradients to reduce next, in a sequence every rank produces identically.

    `used_anywhere`: units with trainable parameters that some rank's forward used;
    `used_here`: those this rank's forward used; `used_twice_anywhere`: those some rank used more
    than once (their gradients are final only at the end of backward)."""

    def __init__(self, used_anywhere: set[int], used_here: set[int], used_twice_anywhere: set[int]) -> None:
        self.order = sorted(used_anywhere, reverse=True)
        self.position = 0
        self.final: set[int] = {unit for unit in used_anywhere if unit not in used_here}
        self.deferred = set(used_twice_anywhere)
        self.reduced: set[int] = set()

    def _advance(self) -> list[int]:
        due = []
        while self.position < len(self.order) and self.order[self.position] in self.final:
            due.append(self.order[self.position])
            self.position += 1
        self.reduced.update(due)
        return due

    def start(self) -> list[int]:
        """Units to reduce before any gradient exists (those leading the order unused here)."""
        return self._advance()

    def grads_final(self, unit: int) -> list[int]:
        """`unit`'s gradients are final on this rank; returns the units due now, in order."""
        if unit not in self.order or unit in self.deferred or unit in self.reduced:
            return []
        self.final.add(unit)
        return self._advance()

    def expects(self, unit: int) -> bool:
        return unit in self.order

    def finish(self) -> list[int]:
        """End of backward: every unit of the order not reduced yet, in order."""
        rest = self.order[self.position :]
        self.position = len(self.order)
        self.reduced.update(rest)
        return rest
