"""Optimizer state streamed from NVMe in pieces of `offload.sub_group_size` elements.

A streamed unit's state is read, stepped, accumulated into, saved and loaded one piece at a time
(`UnitState.state_pieces`, swap files `unit{i}.{kind}.p{j}`), through host slots of one piece
each. Adam is elementwise and the gradient is accumulated elementwise, so training in pieces must
give bit for bit what training whole units gives, and both what torch AdamW gives.

Every engine built with pieces is checked to really cut its blocks into several pieces
(`assert_streamed_in_pieces`): a test here cannot pass because the units happened to fit one piece.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from distributed_worker import launch, local_half, rank_swap_dirs
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, mse, reference_run

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.checkpoint import format as checkpoint_format
from offload.checkpoint.engine_state import CheckpointCorruptError, CheckpointReader
from offload.errors import ConfigError
from offload.model.units import build_units, plan_flat_layout
from offload.plan.budgets import host_bytes_beside_optimizer_state
from offload.plan.optimizer_plan import SlotShape, piece_bounds, shape_slots, slot_bytes_for, whole_blocks

# A block of TinyNet(width=48) has 9456 params, its shard 10240 elements: 10 pieces of 1024, the
# input/output "<root>" unit 2 pieces. (TinyNet's default width 32 gives blocks of ~4k elements.)
WIDTH = 48
DEPTH = 2
PIECE = 1024  # the smallest sub_group_size allowed
WHOLE = 1 << 30  # a sub_group_size above every unit's state: each unit streams whole
STEPS = 4
PAGE = 4096


def make_config(
    swap_dir,
    *,
    param="cpu",
    optimizer="nvme",
    overlap="forward",
    precision="fp32",
    sub_group_size=PIECE,
    gradient_memory=0,
    **extra,
) -> dict:
    """sub_group_size WHOLE: every unit streams whole; None: unset, the engine shapes the slots
    (plan.shape_slots). gradient_memory 0: the fp32 gradients stream in pieces too (None: the
    default, kept in RAM)."""
    section = {"param": param, "optimizer": optimizer, "nvme_path": swap_dir}
    if gradient_memory is not None:
        section["gradient_memory"] = gradient_memory
    if sub_group_size is not None:
        section["sub_group_size"] = sub_group_size
    config = {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": section,
        "overlap": overlap,
    }
    config.update(extra)
    return config


def blocks_of(engine):
    blocks = [unit for unit in engine.units if unit.spec.name.startswith("blocks.")]
    assert blocks, [unit.spec.name for unit in engine.units]
    return blocks


def assert_streamed_in_pieces(engine, sub_group_size: int = PIECE) -> None:
    """Streamed units are cut by piece_bounds, resident ones whole, and every block (streamed) in
    more than one piece."""
    for unit in engine.units:
        if unit.optimizer_tier.streamed:
            # a piece is a whole number of int8 moment blocks (config.state_layout.INT8_BLOCK)
            assert unit.state_pieces == piece_bounds(unit.optimizer_numel, whole_blocks(sub_group_size, unit.optimizer_numel))
        else:
            assert unit.state_pieces == [(0, unit.optimizer_numel)]
    for unit in blocks_of(engine):
        assert unit.optimizer_tier.streamed
        assert len(unit.state_pieces) > 1, (unit.spec.name, unit.optimizer_numel, unit.state_pieces)


def assert_whole_units(engine) -> None:
    for unit in engine.units:
        assert unit.state_pieces == [(0, unit.optimizer_numel)]


def assert_same_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not different, f"not bit-identical: {different}"


def train(model, config, data, check=None):
    """(losses, consolidated state dict, last grad norm) of a fresh engine on a copy of `model`;
    `check(engine)` runs before training."""
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        if check is not None:
            check(engine)
        losses = engine_run(engine, data)
        return losses, engine.consolidated_state_dict(), engine.last_grad_norm, fp32_weight_tolerance(engine)
    finally:
        engine.close()


def pages(nbytes: int) -> int:
    """Host bytes the pool allocates for a buffer of `nbytes` (whole 4 KiB pages, at least one)."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


# ---- 1. fp32: every param tier and overlap mode ------------------------------------------------
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_pieces_train_like_adamw_and_bit_identical_to_whole_units(swap_dir, param, overlap):
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(STEPS)
    reference, reference_losses = reference_run(model, data)
    losses, state, _, tolerance = train(
        model, make_config(swap_dir, param=param, overlap=overlap), data, check=assert_streamed_in_pieces
    )
    assert max_weight_difference(state, reference) <= tolerance
    assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    whole_losses, whole_state, _, _ = train(
        model, make_config(swap_dir, param=param, overlap=overlap, sub_group_size=WHOLE), data, check=assert_whole_units
    )
    assert losses == whole_losses
    assert_same_state(state, whole_state)


# ---- 2. gradient accumulation and clipping ---------------------------------------------------
CLIP = 0.05  # the gradient norms of these steps are 2..5: every step clips


@pytest.mark.parametrize("param,overlap", [("nvme", "none"), ("cpu", "forward"), ("cpu", "backward")])
def test_accumulation_and_clipping_in_pieces_equal_whole_units(swap_dir, param, overlap):
    """Two micro-batches per step (the second is read, added to and written back piece by piece)
    and the global norm, summed over the pieces' squared norms. Overlap 'backward' with clipping
    steps NVMe units after the norm (only units with their state in RAM speculate).

    Tolerance: none, by construction. Pieces are whole norm blocks (NORM_BLOCK elements) and each
    piece's squared norm continues the previous piece's sum in the kernel's canonical block order
    (offload.optim.kernels.sq_norm), so the norm in pieces is the whole unit's, bit for bit, on
    any CPU (before, per-piece sums added afterwards differed in the last fp64 bit on an AMX Xeon,
    whose gradients differ from ours). Against AdamW with clip_grad_norm_ the usual fp32
    tolerance."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(2 * STEPS, batch=8)
    extra = {"gradient_accumulation_steps": 2, "gradient_clipping": CLIP}
    reference, _ = reference_run(model, data, clip=CLIP, accumulation=2)
    losses, state, norm, tolerance = train(
        model, make_config(swap_dir, param=param, overlap=overlap, **extra), data, check=assert_streamed_in_pieces
    )
    assert norm > CLIP  # clipping was active
    assert max_weight_difference(state, reference) <= tolerance
    whole_losses, whole_state, whole_norm, _ = train(
        model, make_config(swap_dir, param=param, overlap=overlap, sub_group_size=WHOLE, **extra), data, check=assert_whole_units
    )
    assert norm == whole_norm
    assert losses == whole_losses
    assert_same_state(state, whole_state)
    # the gradients kept in RAM (the second micro-batch adds into them instead of reading the
    # swap files back; the norm is taken from them): the same bits (tests/test_nvme_step_io.py)
    ram_losses, ram_state, ram_norm, _ = train(
        model, make_config(swap_dir, param=param, overlap=overlap, gradient_memory=None, **extra), data
    )
    assert ram_norm == norm
    assert ram_losses == losses
    assert_same_state(ram_state, state)


# ---- 3. frozen parameters --------------------------------------------------------------------
FROZEN = ("blocks.0.up.weight", "blocks.0.up.bias", "blocks.1.norm.weight")


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_frozen_params_with_pieces_and_param_nvme(swap_dir, overlap):
    """A unit whose optimizer state covers only its trainable part (optimizer_numel < shard_numel):
    the pieces cut that part, the frozen params keep their 16-bit values in the param16 file."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    for name, param in model.named_parameters():
        if name in FROZEN:
            param.requires_grad_(False)
    data = batches(STEPS)
    reference, reference_losses = reference_run(model, data)

    def check(engine):
        assert_streamed_in_pieces(engine)
        for unit in blocks_of(engine):
            assert unit.optimizer_numel < unit.shard_numel, unit.spec.name

    losses, state, _, tolerance = train(model, make_config(swap_dir, param="nvme", overlap=overlap), data, check=check)
    assert max_weight_difference(state, reference) <= tolerance
    assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    initial = model.state_dict()
    for name in FROZEN:
        assert torch.equal(state[name], initial[name]), name
    _, whole_state, _, _ = train(
        model, make_config(swap_dir, param="nvme", overlap=overlap, sub_group_size=WHOLE), data, check=assert_whole_units
    )
    assert_same_state(state, whole_state)


# ---- 4. bf16 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_bf16_in_pieces_is_bit_identical_to_whole_units(swap_dir, param):
    """The kernel writes the new bf16 weights piece by piece beside the fp32 masters."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(STEPS)
    losses, state, _, _ = train(
        model, make_config(swap_dir, param=param, precision="bf16"), data, check=assert_streamed_in_pieces
    )
    whole_losses, whole_state, _, _ = train(
        model, make_config(swap_dir, param=param, precision="bf16", sub_group_size=WHOLE), data, check=assert_whole_units
    )
    assert losses[-1] < losses[0]
    assert losses == whole_losses
    assert_same_state(state, whole_state)


# ---- 5. checkpoints --------------------------------------------------------------------------
PIECES_NVME = {"param": "nvme", "optimizer": "nvme", "sub_group_size": PIECE}
WHOLE_CPU = {"param": "cpu", "optimizer": "cpu", "sub_group_size": WHOLE}


@pytest.mark.parametrize(
    "saved_on,loaded_on", [(PIECES_NVME, WHOLE_CPU), (WHOLE_CPU, PIECES_NVME)], ids=["pieces-to-whole", "whole-to-pieces"]
)
def test_checkpoint_between_pieces_and_whole_units_resumes_exactly(tmp_path, swap_dir, saved_on, loaded_on):
    """4 steps, save, load into a fresh engine (another init, the other layout), 4 more steps ==
    8 straight steps of the loading engine: the same losses and torch.equal weights."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(2 * STEPS)
    straight_losses, straight_state, _, _ = train(model, make_config(swap_dir, **loaded_on), data)

    first = offload.initialize(copy.deepcopy(model), make_config(swap_dir, **saved_on))
    try:
        if saved_on is PIECES_NVME:
            assert_streamed_in_pieces(first)
        losses = engine_run(first, data[:STEPS])
        first.save_checkpoint(tmp_path / "ckpt")
    finally:
        first.close()

    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    second = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, **loaded_on))
    try:
        if loaded_on is PIECES_NVME:
            assert_streamed_in_pieces(second)
        second.load_checkpoint(tmp_path / "ckpt")
        assert second.global_steps == STEPS
        losses += engine_run(second, data[STEPS:])
        state = second.consolidated_state_dict()
    finally:
        second.close()
    assert losses == straight_losses
    assert_same_state(state, straight_state)


# a block's params: 4050, 90, 4050, 45, 45, 45 elements (at 0, 4056, 4152, 8208, 8256, 8304 of
# its 10240-element shard); pieces of 1100 end at 1100, 2200, ..., 9900, 10240: past 0 no piece
# boundary meets a param's, and the last piece of each unit is shorter
ODD_WIDTH = 45
ODD_PIECE = 1100


def _save(model, config, data, path):
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        if config["offload"].get("sub_group_size") == ODD_PIECE:
            assert_streamed_in_pieces(engine, ODD_PIECE)
            assert all(unit.state_pieces[-1][1] - unit.state_pieces[-1][0] < ODD_PIECE for unit in blocks_of(engine))
        engine_run(engine, data)
        return engine.save_checkpoint(path), engine.consolidated_state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("chunk", [None, 700], ids=["default-chunks", "700-element-chunks"])
def test_checkpoint_saved_in_uneven_pieces_reads_back_verified(tmp_path, swap_dir, monkeypatch, chunk):
    """A save in pieces that cut slices (and CRC blocks) anywhere: every slice's CRC-32C is
    continued across the pieces, so every value reads back through the checksums, equal to what
    a save of whole units wrote, and a damaged byte inside a piece-spanning slice is caught.

    The CRC block is 16 MiB, one block per slice of this small model: with `chunk` 700 the blocks
    are made 700 elements (the writer's and the reader's CHUNK_ELEMENTS and chunk_bounds' default),
    so blocks also end inside pieces and pieces inside blocks."""
    if chunk is not None:
        monkeypatch.setattr(checkpoint, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(checkpoint_format, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(checkpoint_format.chunk_bounds, "__defaults__", (chunk,))
    torch.manual_seed(0)
    model = TinyNet(width=ODD_WIDTH, depth=DEPTH)
    data = batches(3)
    pieced_path, pieced_state = _save(
        model, make_config(swap_dir, param="nvme", sub_group_size=ODD_PIECE), data, tmp_path / "pieces"
    )
    whole_path, whole_state = _save(model, make_config(swap_dir, param="nvme", sub_group_size=WHOLE), data, tmp_path / "whole")
    assert_same_state(pieced_state, whole_state)

    with CheckpointReader(pieced_path) as pieced, CheckpointReader(whole_path) as whole:
        assert pieced.stored.keys() == whole.stored.keys()
        if chunk is not None:
            assert len(pieced.stored[("blocks.0.up.weight", "exp_avg")][0].crcs) == -(-4050 // chunk)
        for param, kind in pieced.stored:
            assert torch.equal(pieced.read_param(param, kind), whole.read_param(param, kind)), (param, kind)
        assert pieced.read_param("blocks.1.down.weight", "exp_avg_sq").abs().sum() > 0
        stored = pieced.stored[("blocks.1.down.weight", "exp_avg")][0]
        # the slice starts at 4152 of the shard, in piece 3 ([3300, 4400)): its element 2500
        # (6652 of the shard) is in piece 6, four piece boundaries further
        damaged_at = stored.offset + 4 * 2500

    # a fresh engine cut in the same uneven pieces loads it (the load verifies every block too)
    engine = offload.initialize(
        TinyNet(width=ODD_WIDTH, depth=DEPTH), make_config(swap_dir, param="nvme", sub_group_size=ODD_PIECE)
    )
    try:
        engine.load_checkpoint(pieced_path)
        assert_same_state(engine.consolidated_state_dict(), pieced_state)
    finally:
        engine.close()

    damaged = tmp_path / "damaged"
    shutil.copytree(pieced_path, damaged)
    with open(damaged / stored.path.rsplit(os.sep, 1)[-1], "r+b") as handle:
        handle.seek(damaged_at)
        byte = handle.read(1)
        handle.seek(damaged_at)
        handle.write(bytes([byte[0] ^ 0x01]))
    with CheckpointReader(damaged) as reader, pytest.raises(CheckpointCorruptError, match="fails its checksum"):
        reader.read_param("blocks.1.down.weight", "exp_avg")


# ---- 6. sizing -------------------------------------------------------------------------------
@pytest.mark.parametrize("sub_group_size,buffer_count", [(PIECE, 3), (1100, 2), (1 << 20, 2)])
def test_slots_hold_one_piece(swap_dir, sub_group_size, buffer_count):
    """The host slots: buffer_count sets of four fp32 buffers (master, exp_avg, exp_avg_sq,
    grad32) of one piece each, plus one fp32 gradient piece; each buffer rounded up to whole
    4 KiB pages as the pool allocates them. A sub_group_size above every unit's state: the
    largest unit's state."""
    model = TinyNet(width=WIDTH, depth=DEPTH)
    config = make_config(swap_dir, param="nvme", sub_group_size=sub_group_size)
    config["offload"]["buffer_count"] = buffer_count
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        largest = max(unit.optimizer_numel for unit in engine.units)
        numel = whole_blocks(sub_group_size, largest)
        if sub_group_size < largest:
            assert_streamed_in_pieces(engine, sub_group_size)
        else:
            assert_whole_units(engine)
        assert engine.store.slot_shape == SlotShape(piece=numel, count=buffer_count)
        assert len(engine.store._slots) == buffer_count
        for slot in engine.store._slots:
            assert all(buffer.numel() == numel for buffer in slot.tensors().values())
        host = engine.memory_report()["host"]["by_category"]
        slots = host["optimizer_slots"]["current"]
        assert slots == buffer_count * 4 * pages(4 * numel)
        assert buffer_count * 16 * numel <= slots < buffer_count * 16 * numel + buffer_count * 4 * PAGE
        assert host["grad_slot"]["current"] == pages(4 * numel)
        assert slot_bytes_for(largest, buffer_count, sub_group_size) == buffer_count * 16 * numel + 4 * numel
    finally:
        engine.close()

    whole_config = make_config(swap_dir, param="nvme", sub_group_size=WHOLE)
    whole_config["offload"]["buffer_count"] = buffer_count
    whole = offload.initialize(copy.deepcopy(model), whole_config)
    try:
        whole_host = whole.memory_report()["host"]["by_category"]
        assert whole.store.slot_shape.piece == largest
        assert whole_host["optimizer_slots"]["current"] == buffer_count * 4 * pages(4 * largest)
        if sub_group_size < largest:
            assert slots < whole_host["optimizer_slots"]["current"]
            assert host["grad_slot"]["current"] < whole_host["grad_slot"]["current"]
        else:
            assert slots == whole_host["optimizer_slots"]["current"]
    finally:
        whole.close()


def test_unset_keys_shape_more_slots_of_a_block_and_train_bit_for_bit(swap_dir):
    """Neither offload.buffer_count nor offload.sub_group_size set, a root unit ten times a block
    (a wide input layer): the slots are plan.shape_slots of the streamed units, a block's size
    each and many more than three, in the RAM that three root-sized slots took; the root is cut
    into pieces, the blocks are whole, and training equals whole-unit slots bit for bit."""
    torch.manual_seed(0)
    inputs = 2000
    model = TinyNet(width=WIDTH, depth=12, inputs=inputs)
    data = batches(STEPS, inputs=inputs)

    def check(engine):
        root, *blocks = engine.units
        shape = shape_slots([unit.optimizer_numel for unit in engine.units], buffer_count=None, sub_group_size=None)
        assert engine.store.slot_shape == shape and len(engine.store._slots) == shape.count
        assert shape.piece == blocks[0].optimizer_numel and shape.count > 3
        assert shape.count * shape.piece <= 3 * root.optimizer_numel
        assert len(root.state_pieces) > 1 and all(len(unit.state_pieces) == 1 for unit in blocks)
        host = engine.memory_report()["host"]["by_category"]
        assert host["optimizer_slots"]["current"] == shape.count * 4 * pages(4 * shape.piece)

    losses, state, _, _ = train(model, make_config(swap_dir, param="nvme", sub_group_size=None), data, check=check)
    whole_losses, whole_state, _, _ = train(model, make_config(swap_dir, param="nvme", sub_group_size=WHOLE), data)
    assert losses == whole_losses
    assert_same_state(state, whole_state)


def test_resident_state_has_one_piece_and_no_slots(swap_dir):
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, optimizer="cpu"))
    try:
        assert_whole_units(engine)
        assert engine.store._slots == []
        assert "optimizer_slots" not in engine.memory_report()["host"]["by_category"]
    finally:
        engine.close()


@pytest.mark.parametrize("size", [0, 1, 1023])
def test_a_sub_group_size_below_1024_is_a_config_error(swap_dir, size):
    with pytest.raises(ConfigError, match=r"offload\.sub_group_size"):
        offload.initialize(TinyNet(), make_config(swap_dir, sub_group_size=size))


def test_a_sub_group_size_of_1024_is_accepted(swap_dir):
    offload.initialize(TinyNet(), make_config(swap_dir, sub_group_size=1024)).close()


# ---- optimizer auto: the NVMe units in pieces, the RAM ones whole ------------------------------
def test_auto_streams_only_its_nvme_units_in_pieces(swap_dir):
    """A host cap for the first unit's state (the "<root>" unit) beside the slots of one piece:
    the blocks go to NVMe and stream in pieces; training equals AdamW and, bit for bit, the
    same run with every unit on NVMe."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(STEPS)
    shards = [plan_flat_layout([p.numel() for p in spec.params]).shard_numel for spec in build_units(model, [], 0)]
    buffer_count = 2
    others = host_bytes_beside_optimizer_state(
        shards, param_tier="cpu", compute_bytes=4, prefetch_depth=2, staged_device_copies=torch.cuda.is_available()
    )
    # room for the first unit's state and half of the next one's
    cap = others + slot_bytes_for(max(shards[1:]), buffer_count, PIECE) + 16 * shards[0] + 8 * shards[1]
    config = make_config(swap_dir, param="cpu", optimizer="auto")
    config["offload"].update(max_host_memory=cap, max_device_memory=0, buffer_count=buffer_count)

    def check(engine):
        tiers = [unit.optimizer_tier.value for unit in engine.units]
        assert tiers == ["cpu"] + ["nvme"] * DEPTH, tiers
        assert_streamed_in_pieces(engine)
        assert engine.units[0].state_pieces == [(0, engine.units[0].optimizer_numel)]

    reference, _ = reference_run(model, data)
    losses, state, _, tolerance = train(model, config, data, check=check)
    assert max_weight_difference(state, reference) <= tolerance
    nvme_losses, nvme_state, _, _ = train(model, make_config(swap_dir, param="cpu"), data)
    assert losses == nvme_losses
    assert_same_state(state, nvme_state)


# ---- 7. two ranks ----------------------------------------------------------------------------
def _train_two_ranks(rank: int, world_size: int, config: dict) -> dict:
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    with offload.initialize(copy.deepcopy(model), config, device="cpu") as engine:
        pieces = {unit.spec.name: list(unit.state_pieces) for unit in engine.units}
        numels = {unit.spec.name: unit.optimizer_numel for unit in engine.units}
        for batch in batches(STEPS):
            x, y = local_half(batch, rank, world_size)
            engine.backward(mse(engine, x, y))
            engine.step()
        return {
            "weights": engine.consolidated_state_dict(),
            "pieces": pieces,
            "numels": numels,
            "slot_numel": engine.store.slot_shape.piece,
        }


def test_two_ranks_with_pieces_train_like_one_process(tmp_path):
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    swaps = rank_swap_dirs(tmp_path, 2)
    config = make_config(swaps, param="nvme", overlap="forward")
    config["optimizer"]["threads"] = 1  # the ranks share the machine's cores
    results = launch(_train_two_ranks, 2, config, timeout_s=30, deadline_s=150)
    for result in results:
        assert result["ok"], result.get("traceback") or result
        value = result["value"]
        assert value["slot_numel"] == PIECE
        for name, pieces in value["pieces"].items():
            assert pieces == piece_bounds(value["numels"][name], PIECE)
            if name.startswith("blocks."):
                assert len(pieces) > 1, (name, pieces)  # each rank's half of a block, in pieces
    reference, _ = reference_run(model, batches(STEPS))
    assert max_weight_difference(results[0]["value"]["weights"], reference) <= 1e-5
    assert_same_state(results[1]["value"]["weights"], results[0]["value"]["weights"])


# ---- 8. swap files ---------------------------------------------------------------------------
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_one_swap_file_per_piece_and_kind(swap_dir, param):
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, param=param))
    try:
        assert_streamed_in_pieces(engine)
        swap = engine.store.swap
        expected = set()
        for unit in engine.units:
            for j in range(len(unit.state_pieces)):
                for kind in ("master", "exp_avg", "exp_avg_sq", "grad32"):
                    assert unit.swap_name(kind, j) == f"unit{unit.index}.{kind}.p{j}"
                    expected.add(f"unit{unit.index}.{kind}.p{j}")
            if param == "nvme":
                assert unit.swap_name("param16") == f"unit{unit.index}.param16"
                expected.add(f"unit{unit.index}.param16")
        assert set(swap.names()) == expected
        exp_avg = [unit.swap_name("exp_avg", j) for unit in engine.units for j in range(len(unit.state_pieces))]
        # nothing stepped yet: the moments are still implicit zeros
        assert all(swap.never_written(name) for name in exp_avg)
        # the masters were written at start, every piece
        assert not any(
            swap.never_written(unit.swap_name("master", j)) for unit in engine.units for j in range(len(unit.state_pieces))
        )
        engine_run(engine, batches(2))
        engine.stepping.wait()
        never = [name for name in exp_avg if swap.never_written(name)]
        assert not never, f"pieces whose moments were never written back: {never}"
    finally:
        engine.close()
