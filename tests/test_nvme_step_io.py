"""What crosses the disk in a step with the optimizer state on NVMe, and when.

1. The fp32 gradients kept in RAM (`offload.gradient_memory`). A unit whose master and moments stream from NVMe keeps its fp32 gradient in a host buffer when
the RAM left allows it: backward adds into it there, and the step reads it in place of a slot's
gradient. Nothing about the arithmetic changes (the same fp32 additions in the same order), so
training must be bit for bit what it is with the gradients on NVMe, in every overlap mode, with
accumulation, clipping and pieces; and the disk must see 24 bytes per param and step instead of 32.

2. The next step's first pieces read during backward (`TierStore.prefetch_optimizer_states`): the
master and moments do not change between two steps, so the window's last backward starts reading
those the step will stream first, one per slot; the step uses the reads that match its own first
pieces, waits out the others, and anything else that uses the slots (a checkpoint's load) drops them.
"""

from __future__ import annotations

import copy
import errno
import logging
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, mse, reference_run
from test_state_pieces import DEPTH, PIECE, WIDTH, assert_same_state, make_config, pages, train

import offload
from offload.config.placement import OptimizerTier
from offload.config.schema import load_config
from offload.errors import ConfigError
from offload.plan.optimizer_plan import gradient_bytes, plan_gradients_in_ram
from offload.runtime.prefetch import step_order

STEPS = 4


def grads_in_ram(engine) -> list[bool]:
    return [unit.gradient_in_ram for unit in engine.units]


def grad_swap_files(engine) -> list[str]:
    return sorted(name for name in engine.store.swap.names() if ".grad32." in name)


def check_all_in_ram(engine) -> None:
    assert all(grads_in_ram(engine)), grads_in_ram(engine)
    assert grad_swap_files(engine) == []
    host = engine.memory_report()["host"]["by_category"]
    assert host["gradient"]["current"] == sum(pages(4 * unit.optimizer_numel) for unit in engine.units)
    assert "grad_slot" not in host  # no gradient left on NVMe: the read-add-write buffer is not made


def check_all_on_nvme(engine) -> None:
    assert not any(grads_in_ram(engine))
    assert grad_swap_files(engine)
    assert "gradient" not in engine.memory_report()["host"]["by_category"]


# ---- training is bit-identical ------------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_gradients_in_ram_train_bit_identical_to_gradients_on_nvme(swap_dir, param, overlap):
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(STEPS)
    reference, _ = reference_run(model, data)
    losses, state, _, tolerance = train(
        model, make_config(swap_dir, param=param, overlap=overlap, gradient_memory=None), data, check=check_all_in_ram
    )
    assert max_weight_difference(state, reference) <= tolerance
    nvme_losses, nvme_state, _, _ = train(
        model, make_config(swap_dir, param=param, overlap=overlap, gradient_memory=0), data, check=check_all_on_nvme
    )
    assert losses == nvme_losses
    assert_same_state(state, nvme_state)


def test_a_gradient_memory_cap_keeps_the_first_units_gradients_in_ram(swap_dir):
    """Room for the root unit's gradient and not one more: the root keeps it in RAM, the blocks
    on NVMe; the mixed run trains as both others do."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(STEPS)
    probe = offload.initialize(copy.deepcopy(model), make_config(swap_dir, gradient_memory=0))
    try:
        numels = [unit.optimizer_numel for unit in probe.units]
    finally:
        probe.close()
    cap = gradient_bytes(numels[0])
    assert cap < gradient_bytes(numels[0]) + min(gradient_bytes(n) for n in numels[1:])

    def check_mixed(engine):
        assert grads_in_ram(engine) == [True] + [False] * (len(numels) - 1)
        assert not any("unit0.grad32." in name for name in grad_swap_files(engine))
        assert len(grad_swap_files(engine)) == sum(len(unit.state_pieces) for unit in engine.units[1:])
        host = engine.memory_report()["host"]["by_category"]
        assert host["gradient"]["current"] == cap
        assert "grad_slot" in host  # the blocks' gradients still pass through it

    losses, state, _, _ = train(model, make_config(swap_dir, gradient_memory=cap), data, check=check_mixed)
    nvme_losses, nvme_state, _, _ = train(model, make_config(swap_dir, gradient_memory=0), data, check=check_all_on_nvme)
    ram_losses, ram_state, _, _ = train(model, make_config(swap_dir, gradient_memory=None), data, check=check_all_in_ram)
    assert losses == nvme_losses == ram_losses
    assert_same_state(state, nvme_state)
    assert_same_state(state, ram_state)


# ---- what crosses the disk --------------------------------------------------------------------
def _steady_step_bytes(swap_dir, gradient_memory) -> tuple[int, int]:
    """(bytes read, bytes written) by the swap store over steps 2 and 3 (step 1 reads the moments
    as implicit zeros, without I/O); param cpu, so only optimizer state crosses the disk."""
    torch.manual_seed(0)
    engine = offload.initialize(
        TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, overlap="none", gradient_memory=gradient_memory)
    )
    try:
        data = batches(3)
        engine_run(engine, data[:1])
        engine.stepping.wait()  # step() returns before the state's write-back is done
        swap = engine.store.swap
        read, written = swap.bytes_read, swap.bytes_written
        engine_run(engine, data[1:])
        engine.stepping.wait()
        return swap.bytes_read - read, swap.bytes_written - written
    finally:
        engine.close()


def test_the_disk_sees_the_master_and_moments_only(swap_dir):
    """With the gradients in RAM a step reads and writes the three fp32 states (as many bytes each
    way); with them on NVMe, backward also writes each gradient and the step reads it back: a
    quarter more each way. Every piece's four files have the same size, so the gradient's share
    is exactly a third of the other three."""
    ram_read, ram_written = _steady_step_bytes(swap_dir, None)
    nvme_read, nvme_written = _steady_step_bytes(swap_dir, 0)
    assert ram_read == ram_written > 0
    gradient = nvme_read - ram_read
    assert gradient > 0
    assert nvme_written - ram_written == gradient
    assert 3 * gradient == ram_read


# ---- the plan (plain logic) --------------------------------------------------------------------
NVME, HOST = OptimizerTier.NVME, OptimizerTier.HOST


def test_plan_takes_streamed_units_from_the_first_while_they_fit():
    numels = [1000, 3000, 1000, 1000]
    tiers = [NVME, NVME, HOST, NVME]
    each = [gradient_bytes(n) for n in numels]
    assert plan_gradients_in_ram(numels, tiers, 0) == [False] * 4
    assert plan_gradients_in_ram(numels, tiers, each[0]) == [True, False, False, False]
    # unit 1 does not fit beside unit 0; unit 3 does (passed over, not stopped at)
    assert plan_gradients_in_ram(numels, tiers, each[0] + each[3]) == [True, False, False, True]
    assert plan_gradients_in_ram(numels, tiers, 10**9) == [True, True, False, True]
    # a unit with only frozen params has no gradient to keep
    assert plan_gradients_in_ram([0, 1000], [NVME, NVME], 10**9) == [False, True]


@given(
    units=st.lists(st.tuples(st.integers(0, 10**7), st.sampled_from(list(OptimizerTier))), max_size=12),
    room=st.integers(0, 2 * 10**8),
)
def test_plan_properties(units, room):
    numels = [n for n, _ in units]
    tiers = [tier for _, tier in units]
    chosen = plan_gradients_in_ram(numels, tiers, room)
    assert len(chosen) == len(units)
    assert sum(gradient_bytes(n) for n, c in zip(numels, chosen) if c) <= room
    for (numel, tier), taken in zip(units, chosen):
        if taken:
            assert tier.streamed and numel > 0
    eligible = [gradient_bytes(n) for n, tier in units if tier.streamed and n]
    if sum(eligible) <= room:
        assert sum(chosen) == len(eligible)
    # greedy in unit order: a unit passed over did not fit beside the ones taken before it
    used = 0
    for (numel, tier), taken in zip(units, chosen):
        if taken:
            used += gradient_bytes(numel)
        elif tier.streamed and numel:
            assert used + gradient_bytes(numel) > room


# ---- config ----------------------------------------------------------------------------------
def test_gradient_memory_is_checked_and_parsed(swap_dir):
    with pytest.raises(ConfigError, match="offload.gradient_memory"):
        load_config(make_config(swap_dir, gradient_memory=-1))
    with pytest.raises(ConfigError, match="offload.gradient_memory"):
        load_config(make_config(swap_dir, gradient_memory="lots"))
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, gradient_memory="1GiB"))
    try:
        check_all_in_ram(engine)
    finally:
        engine.close()


def test_pieces_of_a_ram_gradient_are_its_slices(swap_dir):
    """Pieces (sub_group_size 1024): each piece the step sees takes its gradient from the unit's
    RAM buffer at the piece's offset, not from the slot."""
    torch.manual_seed(0)
    engine = offload.initialize(
        TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, sub_group_size=PIECE, gradient_memory=None)
    )
    try:
        engine_run(engine, batches(1))
        engine.stepping.wait()
        seen = []
        for piece in engine.store.stream_optimizer_states(engine.units, include_grad=True):
            gradient = piece.unit.resident_state["grad32"]
            assert piece.views["grad32"].data_ptr() == gradient[piece.start :].data_ptr()
            assert piece.views["grad32"].numel() == piece.end - piece.start
            seen.append((piece.unit.index, piece.index))
        assert len(seen) > len(engine.units)  # really in pieces
    finally:
        engine.close()


# ---- 2. the next step's first pieces, read during backward ---------------------------------------
def _store_values(engine) -> dict:
    """Every streamed piece's master and moments as the stream gives them (a copy per piece)."""
    values = {}
    for piece in engine.store.stream_optimizer_states(engine.units, include_grad=False):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            values[(piece.unit.index, piece.index, kind)] = piece.views[kind].clone()
    return values


def _first_pieces(engine) -> list[tuple]:
    """(unit, piece index) of the pieces the next step streams first, one per slot, in its order."""
    order = [engine.units[i] for i in step_order(engine.forward_order.recorded, len(engine.units))]
    pieces = [(unit, j) for unit in order for j in range(len(unit.state_pieces))]
    assert len(pieces) > len(engine.store._slots)
    return pieces


def _prefetched(store) -> list[tuple]:
    with store._slots_lock:
        return [(unit, j) for unit, j, _ in store._prefetched]


def _assert_matches_adamw(model, data, state, losses, tolerance) -> None:
    reference, reference_losses = reference_run(model, data)
    assert max_weight_difference(state, reference) <= tolerance
    assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)


def _tiny_engine(swap_dir, overlap: str):
    """A TinyNet (seed 0) and an engine over a copy of it, optimizer state on NVMe in pieces,
    gradients in RAM."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    return model, offload.initialize(copy.deepcopy(model), make_config(swap_dir, overlap=overlap, gradient_memory=None))


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("dropped", [False, True], ids=["read-by-the-last-step", "read-in-backward"])
def test_the_next_steps_first_pieces_are_read_before_it(swap_dir, overlap, dropped):
    """One piece per slot (the first the step streams, in its order), master and moments, is read
    before the step: by the previous step's end, each as its slot's write-back completes, or,
    where something else used the slots since (`dropped`: a read of the masters), during the
    window's last backward. Exactly those bytes; the step then reads only the rest, and the run
    is exact."""
    model, engine = _tiny_engine(swap_dir, overlap)
    data = batches(3)
    try:
        tolerance = fp32_weight_tolerance(engine)
        losses = engine_run(engine, data[:2])  # the forward order is recorded; the moments are on disk
        x, y = data[2]
        loss = mse(engine, x, y)
        engine.stepping.wait()  # overlap forward: the last step is done before the backward begins
        store = engine.store
        pieces = _first_pieces(engine)
        first = pieces[: len(store._slots)]
        assert _prefetched(store) == first  # read by the last step's end
        if dropped:
            store.read_master(engine.units[0])  # uses slot 0: the reads ahead are dropped
            assert _prefetched(store) == []
        before_backward = store.swap.bytes_read
        engine.backward(loss)
        engine.optimizer_worker.submit(lambda: None).result()  # the prefetch task has run
        assert _prefetched(store) == first

        def state_bytes(chosen):
            return sum(3 * pages(4 * (unit.state_pieces[j][1] - unit.state_pieces[j][0])) for unit, j in chosen)

        assert store.swap.bytes_read - before_backward == (state_bytes(first) if dropped else 0)
        before_step = store.swap.bytes_read
        engine.step()
        engine.stepping.wait()
        assert _prefetched(store) == first  # taken by the step's stream, and read again at its end
        assert store.swap.bytes_read - before_step == state_bytes(pieces[len(store._slots) :]) + state_bytes(first)
        losses.append(loss.item())
        state = engine.consolidated_state_dict()
    finally:
        engine.close()
    _assert_matches_adamw(model, data, state, losses, tolerance)


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_the_write_back_runs_beside_the_next_forward_and_backward_and_the_run_is_exact(swap_dir, overlap):
    """step() and the next backward wait for the steps (the gradients read), not for the state's
    write-back: with every swap write slowed, step() returns while a slot's writes are still in
    flight, and the training that goes on meanwhile matches AdamW. (Seen after any of three
    steps: a stall of this thread longer than a write on a loaded machine makes one look
    finished; before, a single look failed once in a full suite.)"""
    model, engine = _tiny_engine(swap_dir, overlap)
    data = batches(4)
    try:
        tolerance = fp32_weight_tolerance(engine)
        losses = engine_run(engine, data[:1])
        engine.stepping.wait()
        engine.store.swap.engine.set_delay(0.02, op="write")
        still_writing = []
        for x, y in data[1:]:
            loss = mse(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            engine.stepping.wait_steps()
            slots = engine.store._slots
            still_writing.append(any(not handle.done() for slot in slots for handle in slot.pending_writes))
        engine.store.swap.engine.set_delay(0)
        assert any(still_writing), still_writing
        state = engine.consolidated_state_dict()
    finally:
        engine.close()
    _assert_matches_adamw(model, data, state, losses, tolerance)


def test_overlap_backward_reads_nothing_ahead_at_a_steps_end(swap_dir):
    """With overlap 'backward' units step one by one as their gradients land, in no fixed
    order of whole steps: a step's end reads nothing ahead."""
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, overlap="backward"))
    try:
        engine_run(engine, batches(2))
        engine.stepping.wait()
        assert _prefetched(engine.store) == []
    finally:
        engine.close()


@pytest.fixture
def stepped(swap_dir):
    """An engine with its optimizer state on NVMe after two steps, and that state (_store_values)."""
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, gradient_memory=None))
    try:
        engine_run(engine, batches(2))
        engine.stepping.wait()
        yield engine, _store_values(engine)
    finally:
        engine.close()


def test_a_prefetch_in_another_order_is_waited_out_and_the_stream_reads_its_own(stepped):
    """Pieces prefetched for an order the stream does not follow are not used: every value the
    stream gives is the one on disk."""
    engine, expected = stepped
    engine.store.prefetch_optimizer_states(list(reversed(engine.units)))
    assert engine.store._prefetched
    got = _store_values(engine)
    assert engine.store._prefetched == []
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    # and in the same order: used, with the same values
    engine.store.prefetch_optimizer_states(engine.units)
    got = _store_values(engine)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_the_stream_gives_its_first_piece_while_later_pieces_still_read(stepped):
    """The reads ahead are waited for piece by piece as the stream reaches them, not all before
    the first: the step works (and queues its write-back) while the later ones still read."""
    engine, expected = stepped
    store = engine.store
    order = [engine.units[i] for i in step_order(engine.forward_order.recorded, len(engine.units))]
    store.read_master(engine.units[0])  # drops the reads the last step's end made
    store.swap.engine.set_delay(0.2)  # each read piece takes 0.2 s; 4 I/O threads
    try:
        store.prefetch_optimizer_states(order)
        with store._slots_lock:
            handles = [handle for _, _, piece_handles in store._prefetched for handle in piece_handles]
        assert len(handles) > 4  # more reads than threads: the last start after the first end
        stream = store.stream_optimizer_states(order, include_grad=False)
        first = next(stream)
        assert not all(handle.done() for handle in handles)
        got = {(first.unit.index, first.index, kind): first.views[kind].clone() for kind in expected_kinds()}
        for piece in stream:
            for kind in expected_kinds():
                got[(piece.unit.index, piece.index, kind)] = piece.views[kind].clone()
    finally:
        store.swap.engine.set_delay(0)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def expected_kinds() -> tuple[str, ...]:
    return ("master", "exp_avg", "exp_avg_sq")


def test_a_failed_read_ahead_is_read_again_when_its_piece_is_reached(stepped, caplog):
    engine, expected = stepped
    store = engine.store
    order = [engine.units[i] for i in step_order(engine.forward_order.recorded, len(engine.units))]
    store.read_master(engine.units[0])
    store.swap.engine.set_fault("read", errno.EIO, count=1)  # the first read ahead fails
    try:
        store.prefetch_optimizer_states(order)
        assert _prefetched(store)
    finally:
        store.swap.engine.clear_fault()
    with caplog.at_level(logging.WARNING, logger="offload"):
        got = {}
        for piece in store.stream_optimizer_states(order, include_grad=False):
            for kind in expected_kinds():
                got[(piece.unit.index, piece.index, kind)] = piece.views[kind].clone()
    assert "ahead of the step failed; it is read again" in caplog.text
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_checkpoint_load_drops_the_prefetched_pieces(tmp_path, swap_dir):
    """Prefetched states read before a load are the old ones: the load drops them, and the next
    step streams the loaded state (the run resumes exactly as from the checkpoint)."""
    torch.manual_seed(0)
    model = TinyNet(width=WIDTH, depth=DEPTH)
    data = batches(4)
    config = make_config(swap_dir, gradient_memory=None)
    engine = offload.initialize(copy.deepcopy(model), config)
    try:
        engine_run(engine, data[:2])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = _store_values(engine)
        engine_run(engine, data[2:3])  # the state moves on
        engine.stepping.wait()
        engine.store.prefetch_optimizer_states(engine.units)  # reads of the moved-on state
        assert engine.store._prefetched
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.store._prefetched == []
        loaded = _store_values(engine)
        assert all(torch.equal(loaded[key], saved[key]) for key in saved)
        resumed = engine_run(engine, data[2:])
        resumed_state = engine.consolidated_state_dict()
    finally:
        engine.close()
    straight = offload.initialize(copy.deepcopy(model), config)
    try:
        straight_losses = engine_run(straight, data)
        assert resumed == straight_losses[2:]
        assert_same_state(resumed_state, straight.consolidated_state_dict())
    finally:
        straight.close()


def test_reading_the_weights_between_backward_and_step_drops_the_prefetched_pieces(swap_dir):
    """A read of the masters (the model's weights) after the window's last backward, before
    step(), goes through slot 0, where the step's first piece was read ahead: it drops the
    prefetched pieces first, and the step trains exactly as without the read."""

    def run(read_between: bool) -> dict:
        torch.manual_seed(0)
        model = TinyNet(width=WIDTH, depth=DEPTH)
        data = batches(3)
        engine = offload.initialize(model, make_config(swap_dir, overlap="none", gradient_memory=None))
        try:
            engine_run(engine, data[:2])
            x, y = data[2]
            loss = mse(engine, x, y)
            engine.backward(loss)
            engine.optimizer_worker.submit(lambda: None).result()  # the prefetch task has run
            assert engine.store._prefetched
            if read_between:
                engine.consolidated_state_dict()
                assert engine.store._prefetched == []
            engine.step()
            return engine.consolidated_state_dict()
        finally:
            engine.close()

    assert_same_state(run(read_between=True), run(read_between=False))


def test_a_failed_prefetch_read_is_read_again_by_the_step(stepped, caplog):
    """An I/O error on a read ahead of the step is not the step's failure: the step reads the
    piece again, says so, and gives the values on disk."""
    engine, expected = stepped
    engine.store.swap.engine.set_fault("read", errno.EIO, count=1)
    engine.store.prefetch_optimizer_states(engine.units)
    with caplog.at_level(logging.WARNING, logger="offload.storage.tiers"):
        got = _store_values(engine)
    assert "ahead of the step failed; it is read again" in caplog.text
    assert all(torch.equal(got[key], expected[key]) for key in expected)


@pytest.mark.parametrize("gradient_memory", [None, 0], ids=["grads-in-ram", "grads-on-nvme"])
def test_what_compute_waits_on_is_urgent_and_the_state_write_back_is_not(swap_dir, gradient_memory):
    """The I/O engine's two queues (AioEngine): the 16-bit weights a fetch reads and a step writes
    back, and the state pieces a step's stream reads, go ahead of the state written back and of
    the pieces prefetched during backward, which nothing waits on yet. One step of a trained engine
    with both tiers on NVMe: every param16 transfer is urgent, and so is every gradient landing's
    read and write when the gradients are on NVMe (backward waits for them); every other state
    write is not, and of the state reads exactly the prefetched pieces' (master and moments, one
    piece per slot) are not."""
    torch.manual_seed(0)
    engine = offload.initialize(
        TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, param="nvme", gradient_memory=gradient_memory)
    )
    try:
        data = batches(3)
        engine_run(engine, data[:2])
        engine.stepping.wait()
        swap, slots = engine.store.swap, len(engine.store._slots)
        seen: list[tuple[str, str, bool]] = []
        read_into, write_from = swap.read_into, swap.write_from

        def recording_read(name, tensor, *, urgent=False):
            seen.append(("read", name, urgent))
            return read_into(name, tensor, urgent=urgent)

        def recording_write(name, tensor, *, urgent=False):
            seen.append(("write", name, urgent))
            return write_from(name, tensor, urgent=urgent)

        swap.read_into, swap.write_from = recording_read, recording_write
        x, y = data[2]
        engine.backward(mse(engine, x, y))
        engine.step()
        engine.stepping.wait()
        # the new weights stay lent from their staging buffers until the ring hands those out
        # again (FreshWeights): drop the copies, as a long model's ring turns do, so that the next
        # forward reads every unit's file
        for unit in engine.units:
            engine.store._param16.fresh.clear(unit)
        engine_run(engine, [data[0]])  # the next forward fetches the new weights
        engine.stepping.wait()
        swap.read_into, swap.write_from = read_into, write_from
    finally:
        engine.close()
    weights = [(op, urgent) for op, name, urgent in seen if name.endswith(".param16")]
    gradients = [(op, urgent) for op, name, urgent in seen if ".grad32." in name]
    state = [(op, name, urgent) for op, name, urgent in seen if not name.endswith(".param16") and ".grad32." not in name]
    assert {op for op, _ in weights} == {"read", "write"}
    assert all(urgent for _, urgent in weights)
    if gradient_memory == 0:
        assert {op for op, _ in gradients} == {"read", "write"}  # landed, then read by the step
        assert all(urgent for _, urgent in gradients)
    else:
        assert gradients == []
    assert state and not any(urgent for op, _, urgent in state if op == "write")
    background_reads = [name for op, name, urgent in state if op == "read" and not urgent]
    stepped_kinds = 3  # master, exp_avg, exp_avg_sq
    assert len(background_reads) == 2 * stepped_kinds * slots  # two boundary backwards
    assert any(urgent for op, _, urgent in state if op == "read")  # the stream's own reads


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_background_depth_trains_bit_for_bit_as_urgent_first(swap_dir, overlap):
    """`io.background_depth` changes which queued swap request the I/O engine starts next, never
    what is read or written: weights and state on NVMe, two steps with a place kept for the state's
    write-back are bit for bit the steps without, and the swap store's engine carries the setting."""
    torch.manual_seed(0)
    model, data = TinyNet(width=WIDTH, depth=DEPTH), batches(STEPS)
    io = {"block_size": 4096, "queue_depth": 4, "threads": 4}

    def check(depth):
        def carries_the_setting(engine):
            assert engine.store.swap.engine.background_depth == depth

        return carries_the_setting

    base = make_config(swap_dir, param="nvme", overlap=overlap, io=io)
    kept = make_config(swap_dir, param="nvme", overlap=overlap, io={**io, "background_depth": 2})
    losses, state, norm, _ = train(model, base, data, check(0))
    kept_losses, kept_state, kept_norm, _ = train(model, kept, data, check(2))
    assert kept_losses == losses and kept_norm == norm
    assert_same_state(kept_state, state)


# ---- a step that fails part way ---------------------------------------------------------------
def test_a_step_failing_part_way_through_its_stream_leaves_the_engine_closable(swap_dir, monkeypatch):
    """The kernel fails on a streamed unit's first piece: the failure is raised by the next wait,
    and close() returns. The stream holds the slots' lock while it yields; left to the garbage
    collector (the failure's traceback kept it alive) it never let go, and close() waited for the
    lock forever. The worker that ran it closes it now."""
    from offload.runtime import stepper

    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=WIDTH, depth=DEPTH), make_config(swap_dir, overlap="forward"))

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(stepper.kernels, "adam_step", broken)
    x, y = batches(1)[0]
    engine.backward(mse(engine, x, y))
    engine.step()  # returns at once: the units step during the next forward
    with pytest.raises(RuntimeError, match="the kernel failed"):
        engine.stepping.wait_steps()
    closed: list[BaseException | None] = []

    def close() -> None:
        try:
            engine.close(restore_weights=False)
            closed.append(None)
        except BaseException as error:  # noqa: BLE001 (reported below)
            closed.append(error)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close() waits for the slots' lock the failed stream holds"
