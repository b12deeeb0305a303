"""How each kind of a unit's optimizer state is stored, and its fp32 face for those who read or
write it as numbers (checkpoints, `engine.optimizer.state_dict()`).

The tiers hold the Adam moments in the config's `optimizer.state_precision` (fp32, bf16, or
int8 blocks: docs/compact_state.md) and the gradient in its arrival dtype where that is exact
(config.state_layout). `StateCodec` is chosen once, at construction (`make_codec`): it tells the
store each kind's buffer (`storage`), and turns a stream of stored pieces into fp32 pieces
(`fp32_pieces`) for code that knows nothing of the formats. With fp32 moments the stored pieces
are the fp32 pieces; with compact ones each piece is cut into chunks of at most
`CHUNK_ELEMENTS` (whole 32-element blocks), whose moments are decoded into two scratch buffers
before the consumer sees them and, when asked, encoded back once it is done with them.

Threads: a codec's scratch buffers serve one stream at a time; the store runs its streams under
its slots lock or on the main thread with the steps waited for (as every consumer here does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import torch

from offload.config.state_layout import INT8_BLOCK, MOMENT_KINDS, StateBytes, StatePrecision
from offload.optim import moments
from offload.storage.buffers import StatePiece

# elements of a chunk decoded at a time: 2 x 16 MiB of fp32 scratch (a multiple of INT8_BLOCK)
CHUNK_ELEMENTS = 1 << 22


@dataclasses.dataclass
class _KindTally:
    nonzero: int = 0  # values given that are not zero (zeros are stored exactly in every format)
    changed: int = 0  # values whose stored value differs from the given one
    relative_sum: float = 0.0  # sum of |stored - given| / |given| over the changed values
    relative_max: float = 0.0


@dataclasses.dataclass
class RoundingTally:
    """What encoding given fp32 moments into the stored precision did to them, measured per kind
    by decoding what was stored: how many nonzero values changed, and by how much relative to
    themselves. A load that converts precision (or regroups int8 blocks) logs `summary()`."""

    kinds: dict[str, _KindTally] = dataclasses.field(default_factory=lambda: {kind: _KindTally() for kind in MOMENT_KINDS})

    def add(self, kind: str, given: torch.Tensor, stored: torch.Tensor) -> None:
        tally = self.kinds[kind]
        nonzero = given != 0
        tally.nonzero += int(nonzero.sum())
        changed = (stored != given) & nonzero
        count = int(changed.sum())
        if count:
            relative = ((stored[changed] - given[changed]).abs() / given[changed].abs()).double()
            tally.changed += count
            tally.relative_sum += float(relative.sum())
            tally.relative_max = max(tally.relative_max, float(relative.max()))

    @property
    def exact(self) -> bool:
        return not any(tally.changed for tally in self.kinds.values())

    def summary(self) -> str:
        parts = []
        for kind, tally in self.kinds.items():
            if tally.changed == 0:
                parts.append(f"{kind}: every one of {tally.nonzero:,} nonzero values kept exactly")
            else:
                parts.append(
                    f"{kind}: {tally.changed:,} of {tally.nonzero:,} nonzero values rounded, by {100 * tally.relative_sum / tally.changed:.3g}% "
                    f"of the value on average and at most {100 * tally.relative_max:.3g}%"
                )
        return "; ".join(parts)


class StateCodec:
    """fp32 moments: every stored kind is already its fp32 values (the gradient may be 16-bit)."""

    def __init__(self, state: StateBytes, compute_dtype: torch.dtype, rank: int, rounding_seed: int = 0) -> None:
        self.state = state
        self.rank = rank
        self.rounding_seed = rounding_seed
        self.grad_dtype = torch.float32 if state.gradient_bytes == 4 else compute_dtype

    @property
    def precision(self) -> StatePrecision:
        return self.state.precision

    @property
    def compact(self) -> bool:
        return False

    def storage(self, kind: str, numel: int) -> tuple[int, torch.dtype]:
        """(elements, dtype) of the buffer that holds `numel` elements of state kind `kind`."""
        if kind == "grad32":
            return numel, self.grad_dtype
        if kind in MOMENT_KINDS:
            return moments.moment_storage(self.precision.value, numel)
        return numel, torch.float32

    def storage_numel(self, kind: str, numel: int) -> int:
        return self.storage(kind, numel)[0]

    def rounding_key(self, unit_index: int, step_count: int) -> int:
        """The key of the stochastic rounding of unit `unit_index`'s step `step_count` on this
        rank, in the run's stream (`optimizer.rounding_seed`)."""
        return moments.rounding_key(unit_index, self.rank, step_count, self.rounding_seed)

    def moment_view(self, buffer: torch.Tensor, piece_numel: int, start: int, end: int) -> moments.MomentView:
        """The stored form of elements [start, end) of a piece of `piece_numel` elements held in
        `buffer` (a moment's buffer of that piece)."""
        return moments.moment_view(self.precision.value, buffer, piece_numel, start, end)

    def fp32_pieces(
        self,
        pieces: Iterator[StatePiece],
        *,
        decode: bool,
        encode_steps: Sequence[int] | Mapping[int, int] | None,
        tally: RoundingTally | None = None,
    ) -> Iterator[StatePiece]:
        """`pieces` as fp32 values: here the pieces themselves (fp32 stores every value exactly;
        `tally` stays empty)."""
        yield from pieces


class CompactCodec(StateCodec):
    """bf16 or int8 moments, decoded chunk by chunk for fp32 readers and writers."""

    def __init__(self, state: StateBytes, compute_dtype: torch.dtype, rank: int, rounding_seed: int = 0) -> None:
        super().__init__(state, compute_dtype, rank, rounding_seed)
        self._scratch: dict[str, torch.Tensor] = {}

    @property
    def compact(self) -> bool:
        return True

    def _scratch_for(self, kind: str, numel: int) -> torch.Tensor:
        buffer = self._scratch.get(kind)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[kind] = torch.empty(min(max(numel, 1), CHUNK_ELEMENTS), dtype=torch.float32)
        return buffer[:numel]

    def fp32_pieces(
        self,
        pieces: Iterator[StatePiece],
        *,
        decode: bool,
        encode_steps: Sequence[int] | Mapping[int, int] | None,
        tally: RoundingTally | None = None,
    ) -> Iterator[StatePiece]:
        """Each piece of `pieces` as chunks whose moments are fp32 scratch: decoded from the
        stored form first when `decode`, encoded into it after the consumer is done when
        `encode_steps` is given (before the next chunk, and so before the source stores the
        piece). The master is the stored fp32 view itself. A chunk is the piece's `last` only if
        it ends the piece.

        `encode_steps[u]` is the step count of unit u's state as written (a checkpoint's, a state
        dict's): its rounding key rounds the values, so that the stored bits depend only on the
        values and that step, not on the tier's pieces or on the engine's own count, which the
        caller updates at some point of the stream. With `tally`, each encoded chunk is decoded
        again and compared with what the consumer wrote (RoundingTally)."""
        for piece in pieces:
            numel = piece.end - piece.start
            for low in range(0, max(numel, 1), CHUNK_ELEMENTS):
                high = min(numel, low + CHUNK_ELEMENTS)
                views = {"master": piece.views["master"][low:high]}
                stored = {kind: self.moment_view(piece.views[kind], numel, low, high) for kind in MOMENT_KINDS}
                for kind in MOMENT_KINDS:
                    views[kind] = self._scratch_for(kind, high - low)
                    if decode:
                        moments.decode(self.precision.value, kind, stored[kind], out=views[kind])
                yield StatePiece(piece.unit, piece.index, piece.start + low, views, piece.slot, last=piece.last and high == numel)
                if encode_steps is not None:
                    key = self.rounding_key(piece.unit.index, encode_steps[piece.unit.index])
                    for kind in MOMENT_KINDS:
                        # values read back (a checkpoint, a state dict) re-encode to themselves
                        moments.encode(
                            self.precision.value,
                            kind,
                            views[kind],
                            stored[kind],
                            position=piece.start + low,
                            key=key,
                            reload=True,
                        )
                        if tally is not None:
                            check = self._scratch_for("check", high - low)
                            tally.add(kind, views[kind], moments.decode(self.precision.value, kind, stored[kind], out=check))


def make_codec(state: StateBytes, compute_dtype: torch.dtype, rank: int, rounding_seed: int = 0) -> StateCodec:
    """The codec of `state`'s moment precision; `rounding_seed` picks the stream of random bits
    its stochastic rounding draws (optimizer.rounding_seed)."""
    if state.precision is StatePrecision.FP32:
        return StateCodec(state, compute_dtype, rank, rounding_seed)
    return CompactCodec(state, compute_dtype, rank, rounding_seed)


def block_aligned_gaps(gaps: list[tuple[int, int]], precision: StatePrecision, end: int) -> list[tuple[int, int]]:
    """The parts of the unstepped `gaps` ([start, end) in a unit's shard, each ending at a stepped
    range's start or at `end`) whose stored moments a speculative step's carry-over copies: with
    int8 moments a gap's start is moved up to the next block (the block it starts in holds the
    stepped range before it, which the kernel wrote whole)."""
    if precision is not StatePrecision.INT8:
        return gaps
    aligned = []
    for start, stop in gaps:
        start = -(-start // INT8_BLOCK) * INT8_BLOCK
        if start < stop:
            aligned.append((start, stop))
    return aligned
