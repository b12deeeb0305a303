"""Issue 30: a checkpoint load is all or nothing.

Each variant below damages or crafts a copy of a good checkpoint (crafted ones with every
checksum recomputed: checksums catch damage, not crafting) and loads it into an engine that
trained two steps. The load must raise the named error, leave the engine bitwise as it was
(weights, moments, step counts, counters, loss scale, RNG), and the engine's next two steps must
equal those of an engine that never tried the load. On the optimizer's cpu and nvme tiers, and
on two ranks (rank 1's part damaged, or the shared index crafted: both ranks refuse with the
reason). A checkpoint whose files change between the check and the apply says so and the engine
refuses to train until a load succeeds."""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import shutil
import struct

import numpy as np
import pytest
import torch
from distributed_worker import RANK_DEVICE, launch
from reference import TinyNet, batches, mse
from reference import engine_run as train

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.checkpoint.engine_state import CheckpointCorruptError, CheckpointError
from offload.errors import OffloadError
from offload.storage.aio import crc32c

PLACEMENTS = {"cpu": ("cpu", "cpu"), "nvme": ("nvme", "nvme")}


class BufferedNet(TinyNet):
    """TinyNet with a persistent buffer, so that buffers are checked too."""

    def __init__(self, width: int = 32) -> None:
        super().__init__(width=width)
        self.register_buffer("gain", torch.full((1,), 1.5))

    def forward(self, x):
        return super().forward(x) * self.gain


def config(swap, placement="cpu"):
    param, optimizer = PLACEMENTS[placement]
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": str(swap)},
    }


def new_engine(swap, placement, width=32):
    torch.manual_seed(0)
    return offload.initialize(BufferedNet(width), config(swap, placement), device=RANK_DEVICE)


def fingerprint(engine) -> dict:
    """Everything a load could change: weights, moments, step counts, counters, RNG."""
    engine.window.drain()
    state = {f"weights/{k}": v.clone() for k, v in engine.consolidated_state_dict().items()}
    for piece in engine.store.stream_optimizer_states_on_host(engine.units):
        for kind, view in piece.views.items():
            state[f"{kind}/{piece.unit.index}/{piece.start}"] = view.clone()
    return {
        "tensors": state,
        "steps": [unit.step_count for unit in engine.units],
        "training": engine.training_state(),
        "rng": (torch.get_rng_state().clone(), random.getstate(), np.random.get_state(legacy=True)[1].copy()),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    changed = [k for k in a["tensors"] if not torch.equal(a["tensors"][k], b["tensors"][k])]
    assert not changed, f"the failed load changed {changed[:5]}"
    assert a["steps"] == b["steps"] and a["training"] == b["training"]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert np.array_equal(a["rng"][2], b["rng"][2])


# ---- crafting: edit a copy of a checkpoint, recomputing every checksum -----------------------------
class Crafted:
    def __init__(self, directory) -> None:
        self.dir = directory

    def index(self) -> dict:
        data = json.loads((self.dir / "index.json").read_bytes())
        data.pop("checksum")
        return data

    def write_index(self, index: dict) -> None:
        (self.dir / "index.json").write_bytes(checkpoint.json_with_checksum(index))

    def rank(self, r: int = 0) -> dict:
        return json.loads((self.dir / f"rank{r}.json").read_bytes())

    def write_rank(self, part: dict, r: int = 0) -> None:
        data = json.dumps(part, sort_keys=True).encode()
        (self.dir / f"rank{r}.json").write_bytes(data)
        self.refile(f"rank{r}.json", data)

    def refile(self, name: str, data: bytes) -> None:
        index = self.index()
        index["files"][name] = {"bytes": len(data), "crc32c": crc32c(data)}
        self.write_index(index)

    def replace_file(self, name: str, data: bytes) -> None:
        (self.dir / name).write_bytes(data)
        self.refile(name, data)

    def set_value(self, kind: str, value: float, r: int = 0) -> None:
        """Element 0 of the first slice of `kind` takes `value`, its chunk's checksum recomputed."""
        part = self.rank(r)
        record = next(s for s in part["slices"] if s["kind"] == kind and s["end"] > s["start"])
        path = self.dir / part["file"]
        data = bytearray(path.read_bytes())
        data[record["offset"] : record["offset"] + 4] = struct.pack("<f", value)
        path.write_bytes(bytes(data))
        chunk = data[record["offset"] : record["offset"] + 4 * min(record["end"] - record["start"], checkpoint.CHUNK_ELEMENTS)]
        record["crc32c"][0] = crc32c(bytes(chunk))
        self.write_rank(part, r)


def edit_index(edit):
    def craft(c: Crafted) -> None:
        index = c.index()
        edit(index)
        c.write_index(index)

    return craft


def edit_rank(edit, r: int = 0):
    def craft(c: Crafted) -> None:
        part = c.rank(r)
        edit(part)
        c.write_rank(part, r)

    return craft


def flip_last_tensor_byte(c: Crafted) -> None:
    path = c.dir / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def truncate_state(c: Crafted) -> None:
    path = c.dir / "rank0.safetensors"
    os.truncate(path, path.stat().st_size - 100)


def first_param(index: dict) -> str:
    return next(iter(index["params"]))


def every_step(value):
    def edit(index):
        for info in index["params"].values():
            info["step"] = value

    return edit


def drop_slice(kind):
    def edit(part):
        part["slices"] = [s for s in part["slices"] if not (s["kind"] == kind and s["param"] == part["slices"][0]["param"])]

    return edit


def duplicate_first_slice(part):
    part["slices"].append(dict(part["slices"][0]))


def shorten_first_slice(part):
    part["slices"][0]["end"] -= 1


def slice_of_unknown_param(part):
    part["slices"].append({**part["slices"][0], "param": "ghost.weight", "key": "ghost.weight/master"})


def reshape_first(index):
    info = index["params"][first_param(index)]
    info["shape"] = [info["numel"]] if len(info["shape"]) > 1 else [1, info["numel"]]


def evil_pickle(c: Crafted) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/offload-evil-pickle-ran",))

    c.replace_file("client_state.pt", pickle.dumps({"epoch": Evil()}))


def junk_rng(part):
    part["rng"]["torch"] = base64.b64encode(b"not a generator state").decode()


def buffer_of_another_shape(c: Crafted) -> None:
    from safetensors.torch import save

    c.replace_file("buffers.safetensors", save({"gain": torch.ones(3)}, metadata={"format": "pt"}))


# (id, craft, the error's type, words the message must hold)
VARIANTS = [
    ("flipped-byte-in-last-tensor", flip_last_tensor_byte, CheckpointCorruptError, "fails its checksum"),
    ("truncated-state-file", truncate_state, CheckpointCorruptError, "truncated"),
    (
        "global-steps-lots",
        edit_index(lambda i: i["engine"].update(global_steps="lots")),
        CheckpointCorruptError,
        "global_steps is 'lots'",
    ),
    (
        "param-step-1e30",
        edit_index(lambda i: i["params"][first_param(i)].update(step=1e30)),
        CheckpointCorruptError,
        "step is 1e+30",
    ),
    ("steps-beyond-the-engine", edit_index(every_step(10**6)), CheckpointCorruptError, "more than the engine's"),
    ("exp-avg-sq-slice-removed", edit_rank(drop_slice("exp_avg_sq")), CheckpointCorruptError, "exp_avg_sq"),
    ("overlapping-slices", edit_rank(duplicate_first_slice), CheckpointCorruptError, "overlaps itself"),
    ("slice-with-a-gap", edit_rank(shorten_first_slice), CheckpointCorruptError, "has a gap"),
    ("slice-of-an-unknown-param", edit_rank(slice_of_unknown_param), CheckpointCorruptError, "ghost.weight"),
    ("extra-engine-key", edit_index(lambda i: i["engine"].update(surprise=1)), CheckpointCorruptError, "never writes: surprise"),
    ("engine-empty", edit_index(lambda i: i.update(engine={})), CheckpointCorruptError, "lacks global_steps"),
    ("lr-nan", edit_index(lambda i: i["engine"]["param_groups"][0].update(lr=float("nan"))), CheckpointCorruptError, "finite"),
    (
        "betas-out-of-range",
        edit_index(lambda i: i["engine"]["param_groups"][0].update(betas=[0.9, 1.5])),
        CheckpointCorruptError,
        "betas",
    ),
    (
        "loss-scale-zero",
        edit_index(lambda i: i["engine"]["loss_scaler"].update(scale=0)),
        CheckpointCorruptError,
        "loss_scaler.scale",
    ),
    ("counters-disagree", edit_index(lambda i: i["engine"].update(micro_steps=0)), CheckpointCorruptError, "counters disagree"),
    ("shape-mismatch", edit_index(reshape_first), CheckpointError, "other shapes"),
    ("evil-pickle", evil_pickle, CheckpointCorruptError, "plain data"),
    ("garbage-buffers", lambda c: c.replace_file("buffers.safetensors", os.urandom(200)), CheckpointCorruptError, "malformed"),
    ("buffer-of-another-shape", buffer_of_another_shape, CheckpointError, "buffer 'gain'"),
    ("junk-rng", edit_rank(junk_rng), CheckpointCorruptError, "RNG state"),
    ("nan-in-exp-avg-sq", lambda c: c.set_value("exp_avg_sq", float("nan")), CheckpointCorruptError, "is nan"),
    ("negative-exp-avg-sq", lambda c: c.set_value("exp_avg_sq", -1.0), CheckpointCorruptError, "never negative"),
    ("inf-master", lambda c: c.set_value("master", float("inf")), CheckpointCorruptError, "is inf"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per placement: a good checkpoint of an engine three steps in (other data than the engines
    that load it, so a partial load would show), one of a wider model, and the run every engine
    that refuses a load must follow: two steps, then two more."""
    out = {}
    for placement in PLACEMENTS:
        base = tmp_path_factory.mktemp(f"saved-{placement}")
        (base / "swap").mkdir()
        engine = new_engine(base / "swap", placement)
        train(engine, batches(3, seed=7))
        engine.save_checkpoint(str(base / "ckpt"), client_state={"epoch": 3}, tag="t")
        engine.close()
        engine = new_engine(base / "swap", placement, width=16)
        train(engine, batches(1, seed=7))
        engine.save_checkpoint(str(base / "ckpt"), tag="wider")
        engine.close()
        engine = new_engine(base / "swap", placement)
        losses = train(engine, batches(4))
        out[placement] = (base / "ckpt", losses[2:], engine.consolidated_state_dict())
        engine.close()
    return out


def refused_load_leaves_engine_as_it_was(tmp_path, saved, placement, directory, error_type, words):
    _, later_losses, later_state = saved[placement]
    swap = tmp_path / "swap"
    swap.mkdir()
    data = batches(4)
    engine = new_engine(swap, placement)
    train(engine, data[:2])
    before = fingerprint(engine)
    with pytest.raises(error_type) as caught:
        engine.load_checkpoint(str(directory))
    assert words in str(caught.value), str(caught.value)
    assert_same(before, fingerprint(engine))
    assert train(engine, data[2:]) == later_losses
    after = engine.consolidated_state_dict()
    assert all(torch.equal(after[k], later_state[k]) for k in later_state)
    engine.close()
    return caught.value


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name,craft,error_type,words", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_refused_checkpoint_changes_nothing(tmp_path, saved, placement, name, craft, error_type, words):
    directory = tmp_path / "t"
    shutil.copytree(saved[placement][0] / "t", directory)
    craft(Crafted(directory))
    error = refused_load_leaves_engine_as_it_was(tmp_path, saved, placement, directory, error_type, words)
    assert str(directory) in str(error) or "index.json" in str(error) or "rank0" in str(error), str(error)
    assert not os.path.exists("/tmp/offload-evil-pickle-ran")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_checkpoint_of_another_model_changes_nothing(tmp_path, saved, placement):
    refused_load_leaves_engine_as_it_was(
        tmp_path, saved, placement, saved[placement][0] / "wider", CheckpointError, "other shapes"
    )


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_untouched_checkpoint_still_loads_exactly(tmp_path, saved, placement):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = new_engine(swap, placement)
    train(engine, batches(2))
    assert engine.load_checkpoint(str(saved[placement][0] / "t")) == {"epoch": 3}
    assert engine.global_steps == 3
    with checkpoint.CheckpointReader(str(saved[placement][0] / "t")) as reader:
        loaded = engine.consolidated_state_dict()
        for name in reader.index["params"]:
            assert torch.equal(loaded[name], reader.read_param(name))
    engine.close()


def test_files_changed_between_check_and_apply_leave_the_engine_refusing(tmp_path, saved, monkeypatch):
    """The second pass reads again; a write into the files in between is caught there: the engine
    is part loaded, says so, refuses to train, and a good load brings it back."""
    directory = tmp_path / "t"
    shutil.copytree(saved["cpu"][0] / "t", directory)
    real_verify = checkpoint.verify

    def verify_then_damage(*args, **kwargs):
        verified = real_verify(*args, **kwargs)
        flip_last_tensor_byte(Crafted(directory))
        return verified

    monkeypatch.setattr(checkpoint, "verify", verify_then_damage)
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = new_engine(swap, "cpu")
    train(engine, batches(2))
    with pytest.raises(CheckpointError, match="passed every check, but applying it failed"):
        engine.load_checkpoint(str(directory))
    x, y = batches(1)[0]
    with pytest.raises(OffloadError, match="part loaded"):
        engine.backward(mse(engine, x, y))
    monkeypatch.setattr(checkpoint, "verify", real_verify)
    engine.load_checkpoint(str(saved["cpu"][0] / "t"))
    train(engine, batches(1))
    engine.close()


# ---- two ranks: one rank's failure fails both, before either changes anything ----------------------
def _two_rank_save(rank, world, root):
    swap = os.path.join(root, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    engine = offload.initialize(BufferedNet(), config(swap, "cpu"), device=RANK_DEVICE)
    train(engine, batches(3, seed=7))
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    engine.close()
    return True


def _two_rank_refusals(rank, world, good, bad_checkpoints, swap_root):
    """Each of `bad_checkpoints` refused by an engine two steps in, which stays as it was."""
    swap = os.path.join(swap_root, f"r{rank}")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    engine = offload.initialize(BufferedNet(), config(swap, "cpu"), device=RANK_DEVICE)
    data = batches(4)
    train(engine, data[:2])
    outcomes = []
    for bad in bad_checkpoints:
        before = fingerprint(engine)
        try:
            engine.load_checkpoint(bad)
            outcome = "loaded"
        except CheckpointError as error:
            outcome = f"{type(error).__name__}: {error}"
        after = fingerprint(engine)
        unchanged = all(torch.equal(before["tensors"][k], after["tensors"][k]) for k in before["tensors"])
        outcomes.append((outcome, unchanged and before["steps"] == after["steps"] and before["training"] == after["training"]))
    losses = train(engine, data[2:])
    engine.load_checkpoint(good)  # and a good one still loads on both
    engine.close()
    return {"outcomes": outcomes, "losses": losses}


@pytest.fixture(scope="module")
def saved_two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("two-ranks")
    results = launch(_two_rank_save, 2, str(base), deadline_s=120)
    assert all(r["ok"] for r in results), results
    return base / "ckpt" / "t"


# (craft, the words each rank's error holds)
TWO_RANK_VARIANTS = {
    # rank 1's state file: every rank opens every rank file, so both find it
    "rank1-state-file-damaged": (lambda c: (c.dir / "rank1.safetensors").write_bytes(b"x" * 10), [["truncated"], ["truncated"]]),
    # only rank 1 reads rank 1's slices: rank 0 refuses with rank 1's reason
    "rank1-nan-moment": (lambda c: c.set_value("exp_avg_sq", float("nan"), r=1), [["rank 1's part", "is nan"], ["is nan"]]),
    "index-crafted": (edit_index(lambda i: i["engine"].update(global_steps=-4)), [["global_steps is -4"]] * 2),
}


def test_two_ranks_refuse_together_and_change_nothing(tmp_path, saved_two_ranks):
    bad = []
    for name, (craft, _) in TWO_RANK_VARIANTS.items():
        shutil.copytree(saved_two_ranks, tmp_path / name)
        craft(Crafted(tmp_path / name))
        bad.append(str(tmp_path / name))
    results = launch(_two_rank_refusals, 2, str(saved_two_ranks), bad, str(tmp_path), deadline_s=180)
    assert all(r["ok"] for r in results), results
    values = [r["value"] for r in results]
    for rank, value in enumerate(values):
        for (name, (_, words)), (outcome, unchanged) in zip(TWO_RANK_VARIANTS.items(), value["outcomes"]):
            assert outcome.startswith("Checkpoint"), (name, rank, outcome)
            assert all(w in outcome for w in words[rank]), (name, rank, outcome)
            assert unchanged, (name, rank, outcome)
    assert values[0]["losses"] == values[1]["losses"]


def test_estimate_states_what_a_load_needs():
    from offload.checkpoint.format import CHUNK_BYTES
    from offload.plan.estimate import LOAD_CHUNK_BYTES, checkpoint_costs

    assert LOAD_CHUNK_BYTES == CHUNK_BYTES
    costs = checkpoint_costs(7_000_000_000, 1)
    assert costs["bytes"] == 84_000_000_000 and costs["load_extra_disk"] == 0
    assert costs["load_extra_ram_per_rank"] == 16 << 20 and costs["load_bytes_read"] == 2 * costs["bytes"]


def test_counters_are_checked_as_plain_data():
    from offload.runtime.counters import check_counters

    good = {"global_steps": 3, "micro_steps": 6, "skipped_steps": 1, "stepped_at_micro": 6, "last_grad_norm": 0.5, "lr": 0.1}
    check_counters(good, set(good))
    check_counters({**good, "stepped_at_micro": -1, "global_steps": 0, "skipped_steps": 0, "last_grad_norm": None}, set(good))
    for change, words in [
        ({"micro_steps": 3}, "counters disagree"),
        ({"stepped_at_micro": 7}, "counters disagree"),
        ({"global_steps": True}, "global_steps is True"),
        ({"skipped_steps": -1}, "skipped_steps is -1"),
        ({"last_grad_norm": float("inf")}, "last_grad_norm is inf"),
        ({"last_grad_norm": -0.5}, "last_grad_norm is -0.5"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_counters({**good, **change}, set(good))
    with pytest.raises(ValueError, match="lacks lr and has keys offload never writes: extra"):
        check_counters({**{k: v for k, v in good.items() if k != "lr"}, "extra": 1}, set(good))
