"""Checkpoints: exact resume across placements and world sizes, atomicity under SIGKILL and a
full disk, detection of damaged files, and export to safetensors / Hugging Face."""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from reference import TinyNet, batches, engine_run, mse

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.checkpoint.engine_state import CheckpointCorruptError, CheckpointError
from offload.errors import InsufficientSpaceError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_config(swap, param="cpu", optimizer="cpu", precision="fp32", overlap="forward"):
    return {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
        "overlap": overlap,
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"not bit-identical: {different}"


# ---- the plain functions -------------------------------------------------------------------
def test_shard_pieces_cover_every_param_exactly_once_across_ranks():
    from offload.model.units import plan_flat_layout

    numels = [5, 3000, 17, 4100, 1]
    for world in (1, 2, 3, 5):
        layout = plan_flat_layout(numels, world)
        covered = {i: [] for i in range(len(numels))}
        for rank in range(world):
            start, end = layout.shard_range(rank)
            for index, a, b, pos in checkpoint.shard_pieces(layout.offsets, layout.numels, start, end):
                assert 0 <= pos and pos + b - a <= layout.shard_numel
                assert layout.offsets[index] + a == start + pos  # the same element of the flat buffer
                covered[index].append((a, b))
        for index, ranges in covered.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == numels[index]
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))


def test_rotation_keeps_the_newest_and_never_the_latest():
    saved = {"a": 1, "b": 2, "c": 3, "d": 4}
    assert checkpoints_sorted(checkpoint.checkpoints_to_remove(saved, 2, "d")) == ["a", "b"]
    assert checkpoints_sorted(checkpoint.checkpoints_to_remove(saved, 1, "b")) == ["a", "c", "d"]
    assert checkpoint.checkpoints_to_remove(saved, 0, "d") == []
    assert checkpoint.checkpoints_to_remove(saved, 10, "d") == []


def checkpoints_sorted(tags):
    return sorted(tags)


def test_streamed_safetensors_header_is_read_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"w/master": torch.randn(7), "b/exp_avg": torch.randn(3, 2)}
    entries = [(k, "F32", list(v.shape), v.numel() * 4) for k, v in tensors.items()]
    prefix, offsets = checkpoint.safetensors_header(entries, {"format": "pt"}, align=4096)
    assert len(prefix) % 4096 == 0 and offsets == [0, 28]
    path = tmp_path / "x.safetensors"
    path.write_bytes(prefix + b"".join(v.numpy().tobytes() for v in tensors.values()))
    loaded = load_file(str(path))
    assert_same_state(loaded, tensors)


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "latest"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(CheckpointError, match="tag"):
        checkpoint.check_tag(tag)


# ---- exact resume --------------------------------------------------------------------------
RESUME_CASES = [
    ("fp32", ("none", "cpu"), ("none", "cpu")),
    ("fp32", ("cpu", "cpu"), ("cpu", "cpu")),
    ("fp32", ("nvme", "nvme"), ("nvme", "nvme")),
    ("fp32", ("nvme", "nvme"), ("cpu", "cpu")),
    ("fp32", ("cpu", "cpu"), ("nvme", "nvme")),
    ("bf16", ("nvme", "nvme"), ("nvme", "nvme")),
    ("bf16", ("nvme", "nvme"), ("none", "cpu")),
    ("bf16", ("cpu", "cpu"), ("nvme", "nvme")),
]


@pytest.mark.parametrize("precision,saved_on,loaded_on", RESUME_CASES)
def test_resume_is_bit_identical_to_straight_training(tmp_path, swap_dir, precision, saved_on, loaded_on):
    """4 steps, save, load into a fresh engine (another init, maybe another placement), 4 more
    steps == 8 straight steps: the same losses and torch.equal weights."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(8)
    straight = offload.initialize(copy.deepcopy(model), make_config(swap_dir, *loaded_on, precision))
    straight_losses = engine_run(straight, data)
    straight_state = straight.consolidated_state_dict()
    straight.close()

    first = offload.initialize(copy.deepcopy(model), make_config(swap_dir, *saved_on, precision))
    losses = engine_run(first, data[:4])
    first.save_checkpoint(tmp_path / "ckpt", client_state={"position": 4})
    first.close()

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    second = offload.initialize(TinyNet(), make_config(swap_dir, *loaded_on, precision))
    client_state = second.load_checkpoint(tmp_path / "ckpt")
    assert second.global_steps == 4 and second.micro_steps == 4
    losses += engine_run(second, data[client_state["position"] :])
    assert losses == straight_losses
    assert_same_state(second.consolidated_state_dict(), straight_state)
    second.close()


def test_fp16_loss_scale_and_counters_resume(tmp_path, swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(6)
    config = make_config(swap_dir, "cpu", "cpu", "fp16")
    config["loss_scale"] = {"initial": 2.0**20, "growth_interval": 2}
    straight = offload.initialize(copy.deepcopy(model), config)
    straight_losses = engine_run(straight, data)
    straight_state = straight.consolidated_state_dict()
    scale, skipped = straight.scaler.scale, straight.skipped_steps
    straight.close()

    first = offload.initialize(copy.deepcopy(model), config)
    losses = engine_run(first, data[:3])
    first.save_checkpoint(tmp_path)
    first.close()
    second = offload.initialize(TinyNet(), config)
    second.load_checkpoint(tmp_path)
    losses += engine_run(second, data[3:])
    assert losses == straight_losses
    assert (second.scaler.scale, second.skipped_steps) == (scale, skipped)
    assert_same_state(second.consolidated_state_dict(), straight_state)
    second.close()


def test_client_state_rng_and_data_position_round_trip(tmp_path, swap_dir):
    import numpy as np

    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    engine_run(engine, batches(2))
    client = {"epoch": 3, "position": 17, "name": "run-a", "history": [1.5, 2.5], "tensor": torch.arange(4)}
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    engine.save_checkpoint(tmp_path, client_state=client)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    got_client = engine.load_checkpoint(tmp_path)
    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected[1:]
    assert got_client["tensor"].tolist() == [0, 1, 2, 3]
    assert {k: v for k, v in got_client.items() if k != "tensor"} == {k: v for k, v in client.items() if k != "tensor"}
    # load_rng=False leaves the caller's RNG alone
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    engine.load_checkpoint(tmp_path, load_rng=False)
    assert torch.equal(torch.rand(3), want)
    engine.close()


def test_client_state_that_needs_pickle_is_refused_at_save(tmp_path, swap_dir):
    class Custom:
        pass

    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointError, match="client_state"):
        engine.save_checkpoint(root, client_state={"x": Custom()})
    assert os.listdir(root) == []  # nothing left behind, no temporary directory
    engine.close()


def test_latest_pointer_tags_rotation_and_refusals(tmp_path, swap_dir):
    tmp_path = tmp_path / "ckpts"
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    data = batches(4)
    for x, y in data:
        engine.backward(mse(engine, x, y))
        engine.step()
        engine.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(e for e in os.listdir(tmp_path)) == ["global_step3", "global_step4", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "global_step4"
    with pytest.raises(CheckpointError, match="already exists"):
        engine.save_checkpoint(tmp_path)
    engine.save_checkpoint(tmp_path, tag="named")
    assert checkpoint.resolve(tmp_path).endswith("named")
    assert checkpoint.resolve(tmp_path, "global_step3").endswith("global_step3")
    assert checkpoint.resolve(tmp_path / "global_step3").endswith("global_step3")
    engine.close()
    # the middle of an accumulation window holds gradients a checkpoint does not keep (the
    # config is read-only once the engine is built: a new engine accumulates two micro-batches)
    engine = offload.initialize(TinyNet(), {**make_config(swap_dir), "gradient_accumulation_steps": 2})
    engine.backward(mse(engine, *data[0]))
    assert engine.step() is False
    with pytest.raises(CheckpointError, match="accumulation window"):
        engine.save_checkpoint(tmp_path)
    engine.close()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.resolve(tmp_path / "nowhere")


def test_wrong_model_is_refused_with_the_parameter_named(tmp_path, swap_dir):
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    engine.save_checkpoint(tmp_path)
    engine.close()
    other = offload.initialize(TinyNet(width=16), make_config(swap_dir))
    with pytest.raises(CheckpointError, match=r"inp\.weight: checkpoint \[32, 8\], model \[16, 8\]"):
        other.load_checkpoint(tmp_path)
    other.close()
    deeper = offload.initialize(TinyNet(depth=5), make_config(swap_dir))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['blocks\.4\.down\.bias'"):
        deeper.load_checkpoint(tmp_path)
    deeper.close()


def test_state_streamed_from_nvme_is_the_engines_state(tmp_path, swap_dir):
    """With the optimizer on NVMe, a save reads unit after unit from swap through the slots:
    what lands in the file is the engine's weights and moments."""
    engine = offload.initialize(TinyNet(width=64), make_config(swap_dir, "nvme", "nvme"))
    engine_run(engine, batches(2))
    path = engine.save_checkpoint(tmp_path)
    with checkpoint.CheckpointReader(path) as reader:
        state = engine.consolidated_state_dict()
        for name in ("inp.weight", "blocks.2.down.bias"):
            assert torch.equal(reader.read_param(name), state[name])
        assert reader.read_param("out.weight", "exp_avg_sq").abs().sum() > 0
    engine.close()


# ---- damaged checkpoints -------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("saved")
    swap = base / "swap"
    swap.mkdir()
    engine = offload.initialize(TinyNet(), make_config(str(swap)))
    engine_run(engine, batches(2))
    path = engine.save_checkpoint(base / "ckpt", client_state={"position": 2})
    engine.close()
    return path


def damaged_copy(saved, tmp_path, name, damage):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    file = target / name
    data = bytearray(file.read_bytes())
    file.write_bytes(bytes(damage(data)))
    return target, str(file)


def flip(position):
    def damage(data):
        data[position if position >= 0 else len(data) + position] ^= 0x01
        return data

    return damage


@pytest.mark.parametrize(
    "name,damage,message",
    [
        ("rank0.safetensors", lambda d: d[:-100], r"rank0\.safetensors is \d+ bytes, expected \d+: it was truncated"),
        (
            "rank0.safetensors",
            flip(-4),
            r"rank0\.safetensors: tensor '[\w.]+/exp_avg_sq' \(bytes \d+\.\.\d+\) fails its checksum",
        ),
        ("rank0.safetensors", flip(20), r"rank0\.safetensors: its safetensors header fails its checksum"),
        ("index.json", lambda d: d.replace(b'"global_steps": 2', b'"global_steps": 3'), r"index\.json fails its checksum"),
        ("index.json", lambda d: d[: len(d) // 2], r"index\.json is not a valid index"),
        ("rank0.json", lambda d: d.replace(b'"rank": 0', b'"rank": 1'), r"rank0\.json fails its checksum"),
        ("client_state.pt", flip(40), r"client_state\.pt fails its checksum"),
        ("buffers.safetensors", lambda d: d + b"x", r"buffers\.safetensors is \d+ bytes"),
    ],
)
def test_damaged_file_is_detected_and_named(saved_checkpoint, tmp_path, swap_dir, name, damage, message):
    target, _ = damaged_copy(saved_checkpoint, tmp_path, name, damage)
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    with pytest.raises(CheckpointCorruptError, match=message):
        engine.load_checkpoint(target)
    engine.close()


def test_missing_file_is_named(saved_checkpoint, tmp_path, swap_dir):
    target, path = damaged_copy(saved_checkpoint, tmp_path, "rank0.safetensors", lambda d: d)
    os.remove(path)
    with pytest.raises(CheckpointCorruptError, match=r"rank0\.safetensors is missing"):
        checkpoint.CheckpointReader(target)


def test_undamaged_copy_loads(saved_checkpoint, tmp_path, swap_dir):
    target, _ = damaged_copy(saved_checkpoint, tmp_path, "rank0.json", lambda d: d)
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    assert engine.load_checkpoint(target) == {"position": 2}
    engine.close()


# ---- atomicity: SIGKILL and a full disk ----------------------------------------------------
KILLED_SAVER = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {here!r})
    import offload
    from safetensors.torch import save_file
    from reference import TinyNet, batches, engine_run
    root, swap, marker = sys.argv[1:4]
    config = {{"precision": "fp32", "offload": {{"param": "nvme", "optimizer": "nvme", "nvme_path": swap}}}}
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=256), config)
    engine_run(engine, batches(2))
    engine.save_checkpoint(root, tag="good")
    save_file(engine.consolidated_state_dict(), os.path.join(root, "..", "expected.safetensors"))
    engine_run(engine, batches(2, seed=5))

    def progress(done, total):
        if done > total // 3:
            open(marker, "w").close()
            time.sleep(600)  # the parent kills us here, a third of the way into the file

    engine.save_checkpoint(root, tag="doomed", progress=progress)
    """
)


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path, swap_dir):
    from safetensors.torch import load_file

    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER.format(here=HERE))
    root, marker = tmp_path / "ckpts", tmp_path / "marker"
    child_swap = tmp_path / "child-swap"
    child_swap.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, str(script), str(root), str(child_swap), str(marker)], env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, f"the saver exited early with {child.returncode}"
        assert time.monotonic() < deadline, "the saver never reached the middle of its save"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    entries = os.listdir(root)
    temp = [e for e in entries if e.startswith(".tmp-doomed-")]
    assert temp and "doomed" not in entries, entries  # killed mid-save, not after
    assert 0 < os.path.getsize(root / temp[0] / "rank0.safetensors")
    assert (root / "latest").read_text().strip() == "good"

    torch.manual_seed(1)
    engine = offload.initialize(TinyNet(width=256), make_config(swap_dir, "nvme", "nvme"))
    engine.load_checkpoint(root)
    assert_same_state(engine.consolidated_state_dict(), load_file(str(tmp_path / "expected.safetensors")))
    engine.save_checkpoint(root, tag="next")  # removes what the killed save left
    assert sorted(os.listdir(root)) == ["good", "latest", "next"]
    engine.close()


def test_file_size_limit_mid_write_is_a_clear_error_and_previous_stays(tmp_path, swap_dir):
    """RLIMIT_FSIZE makes the kernel fail a write half way (EFBIG), as a full disk would."""
    tmp_path = tmp_path / "ckpts"
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    engine_run(engine, batches(2))
    engine.save_checkpoint(tmp_path, tag="good")
    engine_run(engine, batches(1, seed=4))
    size = os.path.getsize(tmp_path / "good" / "rank0.safetensors")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
    try:
        with pytest.raises(InsufficientSpaceError, match=r"rank0\.safetensors .*previous checkpoint is untouched"):
            engine.save_checkpoint(tmp_path, tag="bad")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]  # temp dir removed
    assert (tmp_path / "latest").read_text().strip() == "good"
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 2
    engine.close()


def test_enospc_on_a_full_disk_is_a_clear_error_and_previous_stays(small_tmpfs, swap_dir):
    """A real full filesystem: once with too little space for the state file (refused before
    writing), once with room for the state file but not for what follows it (ENOSPC mid-save)."""
    root = small_tmpfs / "ckpts"
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    engine_run(engine, batches(2))
    engine.save_checkpoint(root, tag="good")
    engine_run(engine, batches(1, seed=4))
    state_bytes = os.path.getsize(root / "good" / "rank0.safetensors")
    page = 4096
    filler = small_tmpfs / "filler"
    for room, message in [
        (state_bytes // 2, "only .* bytes are free"),
        (-(-state_bytes // page) * page + page, "the disk is full"),
    ]:
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\0" * (free - room))
        with pytest.raises(InsufficientSpaceError, match=message):
            engine.save_checkpoint(root, tag="bad")
        os.remove(filler)
        assert sorted(os.listdir(root)) == ["good", "latest"]
    engine.load_checkpoint(root)
    assert engine.global_steps == 2
    engine.close()


# ---- export ------------------------------------------------------------------------------
def test_export_loads_with_load_state_dict_fp32_and_bf16(tmp_path, swap_dir):
    from safetensors.torch import load_file

    engine = offload.initialize(TinyNet(), make_config(swap_dir, "nvme", "nvme"))
    engine_run(engine, batches(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    state = engine.consolidated_state_dict()
    engine.close()
    from offload.cli import main

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "fp32")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    exported = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert_same_state(exported, state)
    model = TinyNet()
    model.load_state_dict(exported)  # strict
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in half.values())
    assert_same_state(half, {k: v.to(torch.bfloat16) for k, v in state.items()})
    assert not (tmp_path / "fp32" / "config.json").exists()  # TinyNet has no HF config


def test_exported_gpt2_loads_with_from_pretrained_and_gives_the_engines_logits(tmp_path, swap_dir):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    engine = offload.initialize(transformers.GPT2LMHeadModel(config), make_config(swap_dir, "cpu", "cpu"))
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    probe = torch.randint(0, 96, (2, 16), generator=generator)
    with torch.no_grad():
        engine_logits = engine(input_ids=probe).logits.float().cpu()
    computed_on = engine.device.torch_device.type
    engine.close()
    checkpoint.export(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_embd"] == 32
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=probe).logits
    if computed_on == "cpu":
        assert torch.equal(logits, engine_logits)  # the same kernels on the same weights
    else:
        # the same weights, but CUDA's kernels reduce in another order: fp32 rounding apart
        torch.testing.assert_close(logits, engine_logits)


# ---- two ranks and resharding ----------------------------------------------------------------
def _two_rank_train_save_continue(rank, world_size, swap, root):
    """2 ranks: 4 steps, save (nvme placement), 4 more; returns losses and the final weights."""
    from distributed_worker import RANK_DEVICE, local_half

    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), make_config(swap, "nvme", "nvme"), device=RANK_DEVICE)
    losses = []
    data = batches(8)
    for i, batch in enumerate(data):
        x, y = local_half(batch, rank, world_size)
        loss = mse(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i == 3:
            engine.save_checkpoint(root, client_state={"position": 4})
    state = engine.consolidated_state_dict()
    engine.close(restore_weights=False)
    return {"losses": losses, "state": state if rank == 0 else None}


def _two_rank_load_continue(rank, world_size, swap, root):
    """2 ranks: load (cpu placement, another init), 4 more steps."""
    from distributed_worker import RANK_DEVICE, local_half

    torch.manual_seed(5)
    engine = offload.initialize(TinyNet(), make_config(swap, "none", "cpu"), device=RANK_DEVICE)
    position = engine.load_checkpoint(root)["position"]
    losses = []
    for batch in batches(8)[position:]:
        x, y = local_half(batch, rank, world_size)
        loss = mse(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_state_dict()
    engine.close(restore_weights=False)
    return {"losses": losses, "state": state if rank == 0 else None}


def _ok(results):
    for result in results:
        assert result.get("ok"), result.get("traceback") or result
    return [result["value"] for result in results]


def test_reshard_two_ranks_to_one_and_back(tmp_path, swap_dir):
    """2 ranks (nvme) save A; 1 rank (cpu) loads A exactly and saves B (nvme); 2 ranks (param
    none, optimizer cpu) load B and train on: bit-identical to the 2-rank run that never stopped."""
    from distributed_worker import launch

    two_a = tmp_path / "two-a"
    straight = _ok(launch(_two_rank_train_save_continue, 2, swap_dir, str(tmp_path / "A"), deadline_s=240))
    with checkpoint.CheckpointReader(tmp_path / "A") as reader:
        assert reader.index["world_size"] == 2 and len(reader.parts) == 2
        saved = {name: {kind: reader.read_param(name, kind) for kind in checkpoint.KINDS} for name in reader.index["params"]}

    torch.manual_seed(9)
    one = offload.initialize(TinyNet(), make_config(swap_dir, "nvme", "nvme"))
    assert one.load_checkpoint(tmp_path / "A") == {"position": 4}
    state = one.consolidated_state_dict()
    assert all(torch.equal(state[name], saved[name]["master"]) for name in saved)
    one.save_checkpoint(tmp_path / "B", client_state={"position": 4})
    one.close()
    with checkpoint.CheckpointReader(tmp_path / "B") as reader:
        assert reader.index["world_size"] == 1
        for name in saved:
            for kind in checkpoint.KINDS:
                assert torch.equal(reader.read_param(name, kind), saved[name][kind]), (name, kind)

    resumed = _ok(launch(_two_rank_load_continue, 2, swap_dir, str(tmp_path / "B"), deadline_s=240))
    assert resumed[0]["losses"] == straight[0]["losses"][4:]
    assert resumed[1]["losses"] == straight[1]["losses"][4:]
    assert_same_state(resumed[0]["state"], straight[0]["state"])
    assert not two_a.exists()


def test_saving_to_an_existing_tag_writes_nothing_or_replaces_it_whole(tmp_path, swap_dir):
    """A resumed loop re-saves its first tag: refused before anything is written, or, with
    overwrite=True, replaced atomically, the script's own files in it carried over."""
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    data = batches(2)
    engine_run(engine, data[:1])
    root = tmp_path / "ckpt"
    engine.save_checkpoint(str(root), tag="t")
    (root / "t" / "notes.txt").write_text("the script's own file")
    before = {p.name: p.read_bytes() for p in (root / "t").iterdir()}
    engine_run(engine, data[1:])
    with pytest.raises(CheckpointError, match="already exists; nothing was written.*overwrite=True"):
        engine.save_checkpoint(str(root), tag="t")
    assert {p.name: p.read_bytes() for p in (root / "t").iterdir()} == before
    assert sorted(os.listdir(root)) == ["latest", "t"]
    engine.save_checkpoint(str(root), tag="t", overwrite=True)
    assert sorted(os.listdir(root)) == ["latest", "t"]
    assert (root / "t" / "notes.txt").read_text() == "the script's own file"
    expected = engine.consolidated_state_dict()
    engine.close()
    torch.manual_seed(0)
    fresh = offload.initialize(TinyNet(), make_config(swap_dir))
    fresh.load_checkpoint(str(root))
    assert fresh.global_steps == 2
    assert_same_state(fresh.consolidated_state_dict(), expected)
    fresh.close()


def test_the_guides_checkpoint_snippet_runs_as_written(tmp_path, swap_dir, monkeypatch):
    from doc_blocks import marked_block

    snippet = marked_block("checkpoint-snippet")
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), make_config(swap_dir))
    engine_run(engine, batches(1))
    monkeypatch.chdir(tmp_path)
    namespace = {"engine": engine}
    exec(snippet, namespace)
    assert namespace["client_state"] == {}  # latest names "best", saved without one
    assert engine.global_steps == 1
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["best", "global_step1", "latest"]
    engine.close()
