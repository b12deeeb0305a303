"""`param: nvme`: a fetch right after a unit's step borrows the new 16-bit weights from the
staging buffer the step wrote them to, instead of reading back the file being written.

`FreshWeights` directly (lending, versions, a withdraw that waits for the borrows out), then the
engine: the fetches do borrow, and training equals plain PyTorch AdamW bit for bit against the
same run with every weight read back from its swap file. Then the 16-bit home with a stand-in
swap store: the weights stay lent after their write-back settled, until the ring hands their
buffer to another use, which waits for the borrow out.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, reference_run

import offload
from offload.storage.buffers import FreshWeights


class FakeUnit:
    def __init__(self, index: int) -> None:
        self.index = index
        self.weights_version = 1


def test_a_copy_is_lent_for_its_version_only_until_withdrawn():
    fresh = FreshWeights()
    unit, other = FakeUnit(3), FakeUnit(4)
    buffer = torch.arange(8.0)
    assert fresh.borrow(unit) is None
    fresh.offer(unit, buffer)
    assert fresh.borrow(other) is None
    lent = fresh.borrow(unit)
    assert lent is buffer and fresh.borrowed == 1
    assert fresh.give_back(lent)
    assert not fresh.give_back(lent)  # no borrow of it is out any more
    unit.weights_version += 1  # another step was scheduled: the copy is of the old weights
    assert fresh.borrow(unit) is None
    unit.weights_version -= 1
    fresh.withdraw(buffer)
    assert fresh.borrow(unit) is None


def test_withdraw_waits_for_the_borrows_out():
    fresh = FreshWeights()
    unit = FakeUnit(0)
    buffer = torch.zeros(4)
    fresh.offer(unit, buffer)
    lent = fresh.borrow(unit)
    assert lent is not None
    withdrawn = threading.Event()

    def withdraw():
        fresh.withdraw(buffer)
        withdrawn.set()

    thread = threading.Thread(target=withdraw)
    thread.start()
    deadline = time.monotonic() + 30
    while (again := fresh.borrow(unit)) is not None:  # until the withdraw has begun
        fresh.give_back(again)
        assert time.monotonic() < deadline, "the withdraw never began"
        time.sleep(0.001)
    assert fresh.borrow(unit) is None  # from then on nobody new may borrow it
    time.sleep(0.05)
    assert not withdrawn.is_set()  # the first borrow is still out: the buffer must not be reused yet
    assert fresh.give_back(lent)
    thread.join(timeout=5)
    assert withdrawn.is_set()


def test_a_copy_ended_by_two_threads_at_once_leaves_the_next_offer_lent():
    """The next step's `offer` and a `withdraw` of the old buffer (taken from the ring) may end
    one copy at once: both wait for the borrow out, and the new copy stays lent."""
    fresh = FreshWeights()
    unit = FakeUnit(0)
    old, new = torch.zeros(4), torch.ones(4)
    fresh.offer(unit, old)
    lent = fresh.borrow(unit)
    unit.weights_version += 1  # the unit's next step
    threads = [
        threading.Thread(target=fresh.withdraw, args=(old,), daemon=True),
        threading.Thread(target=fresh.offer, args=(unit, new), daemon=True),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    assert all(thread.is_alive() for thread in threads)  # both wait for the borrow of `old`
    assert fresh.give_back(lent)
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    again = fresh.borrow(unit)
    assert again is new
    assert fresh.give_back(again)


class _SlowHandle:
    def __init__(self, handle) -> None:
        self.handle = handle

    def wait(self):
        time.sleep(0.02)
        return self.handle.wait()


def slow_writes(write_from):
    return lambda *args, **kwargs: _SlowHandle(write_from(*args, **kwargs))


def _config(swap_dir, overlap):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": "nvme", "optimizer": "cpu", "nvme_path": swap_dir},
        "overlap": overlap,
    }


@pytest.mark.parametrize("overlap", ["forward", "none"])
def test_fetches_borrow_the_new_weights_and_train_exactly(swap_dir, overlap, monkeypatch):
    torch.manual_seed(0)
    model = TinyNet(depth=6)
    data = batches(4)
    reference, _ = reference_run(model, data)

    def train(borrow: bool):
        engine = offload.initialize(copy.deepcopy(model), _config(swap_dir, overlap))
        try:
            # every write-back settles 20 ms late, so that the forward's fetch, woken by the
            # step's end, finds the staging buffer still offered however loaded the machine is
            monkeypatch.setattr(engine.store.swap, "write_from", slow_writes(engine.store.swap.write_from))
            if not borrow:
                monkeypatch.setattr(engine.store._param16.fresh, "borrow", lambda unit: None)
            engine_run(engine, data)
            return engine.consolidated_state_dict(), engine.store._param16.fresh.borrowed, fp32_weight_tolerance(engine)
        finally:
            engine.close(restore_weights=False)
            monkeypatch.undo()

    borrowed_state, borrowed, tolerance = train(borrow=True)
    read_state, not_borrowed, _ = train(borrow=False)
    if overlap == "forward":
        # the forward fetches units right after their steps, while the write-backs are in flight:
        # 7 units fetched right after their steps in each of 3 forwards: 21 here, a bound with room
        # for a loaded machine where a woken fetch is late for some
        assert borrowed >= 6
    assert not_borrowed == 0
    assert all(torch.equal(borrowed_state[k], read_state[k]) for k in read_state)
    assert max_weight_difference(borrowed_state, reference) <= tolerance


class _Done:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error


class _FakeSwap:
    """Records the param16 files read; writes succeed unless `fail_writes`."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.fail_writes = False

    def write_from(self, name, tensor, urgent=False):
        return _Done(OSError("disk full") if self.fail_writes else None)

    def read_into(self, name, tensor, urgent=False):
        self.reads.append(name)
        tensor.fill_(-1.0)
        return _Done()


class _Unit(FakeUnit):
    def __init__(self, index: int, numel: int = 4) -> None:
        super().__init__(index)
        self.shard_numel = numel

    def swap_name(self, kind: str) -> str:
        return f"unit{self.index}.{kind}"


def _stepped(home, unit, value: float):
    """A step of `unit`: its new weights (all `value`) written into a staging buffer and
    published; returns the write-back, not yet settled."""
    unit.weights_version += 1
    out = home.target(unit)
    out.fill_(value)
    return home.publish(unit, out)


def test_settled_weights_stay_lent_until_the_ring_hands_their_buffer_out():
    """After its write-back settled, a unit's new weights are still borrowed, not read back
    from the file, until the ring (oldest free buffer first) gives that buffer to another
    use; a write that failed withdraws them at once."""
    from offload.storage.param16 import NvmeParam16

    swap = _FakeSwap()
    home = NvmeParam16([torch.zeros(4), torch.zeros(4)], lambda: swap)
    a, b, c = _Unit(0), _Unit(1), _Unit(2)
    _stepped(home, a, 1.0).wait()  # a's buffer back in the ring, behind the other one
    weights, staged = home.read(a)
    assert staged and torch.equal(weights, torch.full((4,), 1.0)) and swap.reads == []
    home.give_back(weights)
    _stepped(home, b, 2.0).wait()  # takes the other buffer: a's stays lent
    weights, _ = home.read(a)
    assert torch.equal(weights, torch.full((4,), 1.0)) and swap.reads == []
    home.give_back(weights)
    write_c = _stepped(home, c, 3.0)  # the ring's oldest free buffer is a's: no longer lent
    weights, _ = home.read(a)  # read from the file into the other buffer, b's: b's lent no more
    assert swap.reads == ["unit0.param16"]
    home.give_back(weights)
    write_c.wait()
    weights, _ = home.read(c)
    assert torch.equal(weights, torch.full((4,), 3.0)) and swap.reads == ["unit0.param16"]
    home.give_back(weights)
    home.give_back(home.read(b)[0])
    assert swap.reads == ["unit0.param16", "unit1.param16"]
    swap.fail_writes = True
    failed = _stepped(home, a, 4.0)
    with pytest.raises(OSError, match="disk full"):
        failed.wait()
    home.read(a)  # the file may hold anything: read, not lent
    assert swap.reads == ["unit0.param16", "unit1.param16", "unit0.param16"]


def test_taking_a_lent_buffer_from_the_ring_waits_for_its_borrow():
    """A buffer back in the ring but still lent is handed to another use only once the borrow
    out has ended (the borrower's device copy may still read it)."""
    from offload.storage.param16 import NvmeParam16

    swap = _FakeSwap()
    home = NvmeParam16([torch.zeros(4)], lambda: swap)
    a, b = _Unit(0), _Unit(1)
    _stepped(home, a, 1.0).wait()
    lent, _ = home.read(a)
    taken = threading.Event()
    thread = threading.Thread(target=lambda: (home.target(b), taken.set()), daemon=True)
    thread.start()
    time.sleep(0.05)
    assert not taken.is_set()  # the only buffer is still borrowed
    assert torch.equal(lent, torch.full((4,), 1.0))
    home.give_back(lent)
    thread.join(timeout=5)
    assert taken.is_set()


@pytest.mark.parametrize("overlap", ["forward", "none"])
def test_a_checkpoint_loaded_mid_run_replaces_the_lent_weights(swap_dir, tmp_path, overlap):
    """param nvme: steps leave their new weights lent from the staging ring; loading a checkpoint
    into the same engine afterwards must train from the loaded weights, not the lent ones: 4
    steps, save, 2 more steps, load, 4 steps == 8 straight steps, losses and weights bit for bit."""
    torch.manual_seed(0)
    model = TinyNet(depth=2)  # fewer units than staging buffers: the load's own takes leave some lent
    data = batches(8)
    straight = offload.initialize(copy.deepcopy(model), _config(swap_dir, overlap))
    try:
        straight_losses = engine_run(straight, data)
        straight_state = straight.consolidated_state_dict()
    finally:
        straight.close()
    engine = offload.initialize(copy.deepcopy(model), _config(swap_dir, overlap))
    try:
        losses = engine_run(engine, data[:4])
        engine.save_checkpoint(tmp_path / "ckpt")
        engine_run(engine, data[4:6])  # weights of later steps, lent until the ring reuses them
        assert engine.store._param16.fresh.borrowed > 0 or overlap == "none"
        engine.load_checkpoint(tmp_path / "ckpt")
        losses += engine_run(engine, data[4:])
        state = engine.consolidated_state_dict()
    finally:
        engine.close()
    assert losses == straight_losses
    assert all(torch.equal(state[key], straight_state[key]) for key in straight_state)
