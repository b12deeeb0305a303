"""engine.save_pretrained and `offload export`: the consolidated weights in the Hugging Face
layout (shards + index, or one model.safetensors), streamed unit by unit, written safely.

The layout is checked against transformers' own `save_pretrained` of the same weights (files,
index, headers, config), `from_pretrained` must load the engine's weights exactly, a non-HF
model loads with `load_state_dict`, an earlier save's shards never mix with a new one, and a
kill or a full disk leaves the earlier set loadable."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import TinyNet, batches, engine_run
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import offload
from offload.checkpoint.files import CheckpointError
from offload.checkpoint.pretrained_out import first_of_each, save_pretrained, tied_keys_to_drop, weights_dtype
from offload.checkpoint.shard_writer import TEMP_PREFIX, ShardSetWriter, TensorSpec, plan_shards, shard_size, split_into_shards
from offload.errors import ConfigError, InsufficientSpaceError, OffloadError

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def config(swap, param="cpu", optimizer="cpu", precision="fp32"):
    return {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
    }


def tiny_llama(tied: bool = True):
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(llama)


def trained(model, swap, steps=2, **placement):
    engine = offload.initialize(model, config(swap, **placement))
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 96, (2, 12), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine


def engine_run_llama(engine, steps=1):
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(11))
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def weight_files(directory) -> list[str]:
    """The files a save writes: weights, index, config files."""
    return sorted(name for name in os.listdir(directory) if name.startswith("model") or name.endswith("config.json"))


def headers(path) -> dict[str, tuple[str, list[int], dict]]:
    """Each shard's keys (in header order) with their dtype and shape, and its metadata."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out[name] = ([(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()], f.metadata())
    return out


def assert_equal_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    assert not [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]


# ---- plain functions -------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=30), limit=st.integers(1, 400))
def test_shards_split_as_huggingface_hub_splits_them(sizes, limit):
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    keys = [f"t{i}" for i in range(len(sizes))]
    hub = split_state_dict_into_shards_factory(
        dict(zip(keys, sizes)),
        get_storage_size=lambda size: size,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    ours = split_into_shards(sizes, limit)
    assert [[keys[i] for i in shard] for shard in ours] == list(hub.filename_to_tensors.values())


@pytest.mark.parametrize(
    ("value", "expected"), [(1000, 1000), ("5GB", 5 * 10**9), ("500MiB", 500 << 20), (" 2 kb ", 2000), ("1048576", 1 << 20)]
)
def test_max_shard_size_is_bytes_or_a_size(value, expected):
    assert shard_size(value) == expected


@pytest.mark.parametrize("value", [0, -5, "0GB", "5XB", "lots", 1.5, True, None])
def test_a_bad_max_shard_size_is_an_error_naming_it(value):
    with pytest.raises(ConfigError, match="max_shard_size"):
        shard_size(value)


def test_dtype_is_fp32_bf16_or_fp16():
    assert weights_dtype(None) is torch.float32 and weights_dtype("bf16") is torch.bfloat16
    assert weights_dtype(torch.float16) is torch.float16
    for bad in (torch.int8, "int8", torch.float64, 3):
        with pytest.raises(ConfigError, match="dtype"):
            weights_dtype(bad)


def test_tied_keys_are_dropped_as_transformers_drops_them():
    groups = [["lm_head.weight", "model.embed_tokens.weight"], ["a.w", "b.w", "c.w"], ["x.w", "y.w"]]
    # every name of a group may match: one is kept all the same (the last in sorted order)
    assert tied_keys_to_drop(groups, ["lm_head.weight", r"^[ab]\.w"]) == {"lm_head.weight", "a.w", "b.w"}
    assert tied_keys_to_drop(groups, ["x.w", "y.w"]) == {"x.w"}
    keys = [("e", "param:e"), ("buf", "buffer"), ("head", "param:e"), ("f", "param:f")]
    assert first_of_each(keys) == [("e", "param:e"), ("buf", "buffer"), ("f", "param:f")]


# ---- from an engine: the layout and the weights ---------------------------------------------------
def test_sharded_save_is_transformers_layout_and_loads_exactly(tmp_path, swap_dir):
    """param and optimizer on NVMe, tied embeddings, several shards: the same files, index,
    headers and config as transformers' save_pretrained of the same weights; from_pretrained
    loads the engine's weights bit for bit, fp32 and bf16."""
    engine = trained(tiny_llama(), swap_dir, param="nvme", optimizer="nvme")
    entry = engine.save_pretrained(tmp_path / "ours", max_shard_size="30KB")
    half = engine.save_pretrained(tmp_path / "bf16", max_shard_size=30_000, dtype=torch.bfloat16)
    state = engine.consolidated_state_dict()
    engine.close()  # the model now holds the final fp32 weights: transformers saves those
    model = engine.model
    model.save_pretrained(tmp_path / "theirs", max_shard_size="30KB")

    assert entry == str(tmp_path / "ours" / "model.safetensors.index.json")
    files = weight_files(tmp_path / "ours")
    assert len([name for name in files if name.startswith("model-")]) > 2
    assert files == weight_files(tmp_path / "theirs")
    for name in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        assert json.loads((tmp_path / "ours" / name).read_text()) == json.loads((tmp_path / "theirs" / name).read_text()), name
    assert headers(tmp_path / "ours") == headers(tmp_path / "theirs")
    assert "lm_head.weight" not in json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"]

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    assert loaded.dtype == torch.float32 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_equal_state(loaded.state_dict(), state)

    assert half == str(tmp_path / "bf16" / "model.safetensors.index.json")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    assert_equal_state(loaded.state_dict(), {k: v.to(torch.bfloat16) for k, v in state.items()})


def test_weights_transformers_converts_on_load_load_as_written(tmp_path, swap_dir):
    """Mixtral's experts are fused on load since transformers 5: written under the model's own
    (fused) keys, from_pretrained takes them as they are."""
    torch.manual_seed(0)
    mixtral = transformers.MixtralConfig(
        vocab_size=64, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2, max_position_embeddings=64,
    )  # fmt: skip
    engine = offload.initialize(transformers.MixtralForCausalLM(mixtral), config(swap_dir))
    engine.save_pretrained(tmp_path / "out")
    state = engine.consolidated_state_dict()
    engine.close()
    loaded, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_equal_state(loaded.state_dict(), state)


class TiedNet(nn.Module):
    """Not a Hugging Face model: a tied weight, a persistent and a non-persistent buffer, an
    integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("steps", torch.arange(4))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_plain_model_loads_with_load_state_dict(tmp_path, swap_dir):
    torch.manual_seed(0)
    engine = offload.initialize(TiedNet(), config(swap_dir, "nvme", "cpu"))
    ids = torch.randint(0, 16, (4, 5))
    engine.backward(engine(ids).float().pow(2).mean())
    engine.step()
    entry = engine.save_pretrained(tmp_path / "out")
    state = engine.consolidated_state_dict()
    engine.close()
    assert entry == str(tmp_path / "out" / "model.safetensors")
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]  # no config.json
    saved = load_file(entry)
    assert saved.keys() == {"embed.weight", "head.weight", "scale", "steps"} | {
        f"blocks.{i}.{w}" for i in range(3) for w in ("weight", "bias")
    }
    assert_equal_state(saved, state)
    fresh = TiedNet()
    fresh.load_state_dict(saved)  # strict
    assert fresh.head.weight is fresh.embed.weight


# ---- an earlier save, failures, kills -----------------------------------------------------------
def test_a_new_save_replaces_the_old_set_whole_and_keeps_other_files(tmp_path, swap_dir):
    """Sharded over single, single over sharded, fewer shards over more: no file of the earlier
    set is left to be mixed with the new one; the user's own files stay; the modes follow the umask."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    engine = trained(tiny_llama(tied=False), swap_dir)
    old_umask = os.umask(0o027)
    try:
        engine.save_pretrained(out, max_shard_size="10KB")
        many = weight_files(out)
        engine.save_pretrained(out, max_shard_size="40KB")
        fewer = weight_files(out)
        engine.save_pretrained(out)
        single = weight_files(out)
        engine.save_pretrained(out, max_shard_size="40KB")
    finally:
        os.umask(old_umask)
    assert len(many) > len(fewer) > len(single) == 3
    assert single == ["config.json", "generation_config.json", "model.safetensors"]
    assert weight_files(out) == fewer and "model.safetensors" not in fewer
    assert sorted(os.listdir(out)) == sorted(fewer + ["tokenizer.json"])  # no temporary directory either
    assert {oct(os.stat(out / name).st_mode & 0o777) for name in fewer} == {oct(0o640)}
    state = engine.consolidated_state_dict()
    engine.close()
    assert_equal_state(transformers.LlamaForCausalLM.from_pretrained(out).state_dict(), state)


def test_bad_arguments_change_nothing(tmp_path, swap_dir):
    engine = offload.initialize(TinyNet(), config(swap_dir))
    with pytest.raises(ConfigError, match="max_shard_size"):
        engine.save_pretrained(tmp_path / "a", max_shard_size="5 bananas")
    with pytest.raises(ConfigError, match="dtype"):
        engine.save_pretrained(tmp_path / "a", dtype=torch.int8)
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadError, match="is a file, not a directory"):
        engine.save_pretrained(tmp_path / "file")
    engine.close()


class WithExtraState(TinyNet):
    def get_extra_state(self):
        return {"version": 2}

    def set_extra_state(self, state) -> None:
        pass


def test_a_state_dict_entry_that_is_no_tensor_is_refused_naming_it(tmp_path, swap_dir):
    engine = offload.initialize(WithExtraState(), config(swap_dir))
    with pytest.raises(OffloadError, match="'_extra_state', a dict"):
        engine.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    engine.close(restore_weights=False)


def test_a_full_disk_leaves_the_earlier_set(tmp_path, swap_dir):
    """RLIMIT_FSIZE fails the write of a shard (EFBIG) as a full disk would: the error names
    the file, the earlier save is untouched and the temporary directory is gone."""
    out = tmp_path / "out"
    engine = trained(tiny_llama(), swap_dir)
    engine.save_pretrained(out, max_shard_size="30KB")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    engine_run_llama(engine)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(InsufficientSpaceError, match=r"model-0000\d-of-0000\d\.safetensors"):
            engine.save_pretrained(out, max_shard_size="30KB")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    engine.close()


def test_too_little_room_is_refused_before_writing(small_tmpfs, swap_dir):
    engine = offload.initialize(TinyNet(width=256, depth=2), config(swap_dir))  # ~2.1 MB of fp32 weights
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    with open(small_tmpfs / "filler", "wb") as f:
        f.write(b"\0" * (free - (1 << 20)))
    with pytest.raises(InsufficientSpaceError, match="they need .* is free there"):
        engine.save_pretrained(small_tmpfs / "out")
    assert sorted(os.listdir(small_tmpfs)) == ["filler"]
    engine.close()


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {here!r})
    import offload
    from reference import TinyNet, batches, engine_run
    from offload.checkpoint.pretrained_out import save_pretrained

    engine = offload.initialize(TinyNet(), {config!r})
    engine_run(engine, batches(1))
    engine.save_pretrained({out!r}, max_shard_size=2000)
    torch.save(engine.consolidated_state_dict(), {expected!r})
    engine_run(engine, batches(1, seed=4))
    def kill(done, units):
        if done == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    save_pretrained(engine._runtime, {out!r}, max_shard_size=2000, progress=kill)
""")


def load_set(directory) -> dict[str, torch.Tensor]:
    """What from_pretrained reads: the single file, or every shard the index names."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return load_file(os.path.join(directory, "model.safetensors"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(directory / name))
    assert state.keys() == index["weight_map"].keys()
    return state


def test_a_save_killed_half_way_leaves_the_earlier_set_loadable(tmp_path, swap_dir):
    out, expected = tmp_path / "out", tmp_path / "expected.pt"
    script = KILLED_SAVE.format(here=HERE, config=config(swap_dir, "nvme", "nvme"), out=str(out), expected=str(expected))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    left = [name for name in os.listdir(out) if name.startswith(TEMP_PREFIX)]
    assert len(left) == 1 and os.listdir(out / left[0])  # the killed save's shards, out of the way
    assert_equal_state(load_set(out), torch.load(expected))
    engine = offload.initialize(TinyNet(), config(swap_dir))
    engine.save_pretrained(out, max_shard_size=2000)  # removes what the killed save left
    assert_equal_state(load_set(out), engine.consolidated_state_dict())
    engine.close()
    assert not [name for name in os.listdir(out) if name.startswith(TEMP_PREFIX)]


def test_the_set_becomes_loadable_only_with_its_last_rename(tmp_path):
    """A commit that fails half way through its moves (here a directory stands where the second
    shard goes) leaves neither the old entry nor the new one: nothing from_pretrained would load."""
    tensors = {f"w{i}": torch.full((100,), float(i)) for i in range(3)}
    plan = plan_shards([TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], 400)
    assert plan.files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier single-file save")
    (out / plan.files[1]).mkdir()
    with ShardSetWriter(str(out), plan) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
        with pytest.raises(CheckpointError, match="may hold no loadable set"):
            writer.commit()
    assert not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert not [name for name in os.listdir(out) if name.startswith(TEMP_PREFIX)]
    os.rmdir(out / plan.files[1])
    with ShardSetWriter(str(out), plan) as writer:
        for key, value in reversed(tensors.items()):  # any order
            writer.write(key, value)
        assert writer.commit() == str(out / "model.safetensors.index.json")
    assert_equal_state(load_set(out), tensors)


# ---- streamed ----------------------------------------------------------------------------------
class OneUnitAtATime:
    """The engine's parts as a save reaches them, its weights reader watched: each unit's full
    weights must be gone before the next unit's are read."""

    def __init__(self, engine) -> None:
        runtime = engine._runtime
        self.model, self.units, self.collectives = runtime.model, runtime.units, runtime.collectives
        self.reader = runtime.weights
        self.settle = self.reader.settle
        self.alive: list[weakref.ref] = []
        self.reads = 0

    @property
    def weights(self):
        return self

    def full_weights(self, unit):
        assert all(ref() is None for ref in self.alive), "an earlier unit's weights are still held"
        full = self.reader.full_weights(unit)
        self.alive.append(weakref.ref(full))
        self.reads += 1
        return full


def test_weights_are_read_and_written_one_unit_at_a_time(tmp_path, swap_dir):
    engine = offload.initialize(TinyNet(), config(swap_dir, "nvme", "nvme"))
    engine_run(engine, batches(2))
    watched = OneUnitAtATime(engine)
    save_pretrained(watched, tmp_path / "out", max_shard_size=1000)
    assert watched.reads == len(engine.units)
    state = engine.consolidated_state_dict()
    engine.close()
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert_equal_state(load_set(tmp_path / "out"), state)


# ---- from a checkpoint -------------------------------------------------------------------------
def test_export_writes_the_files_save_pretrained_writes(tmp_path, swap_dir, monkeypatch, caplog):
    """Byte for byte (but config.json), and a long export says how far it is."""
    engine = trained(tiny_llama(), swap_dir)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_pretrained(tmp_path / "saved", max_shard_size="30KB", dtype="bf16")
    engine.close()
    from offload.checkpoint import pretrained_out as module
    from offload.cli import main

    monkeypatch.setattr(module, "PROGRESS_SECONDS", -1.0)  # every tensor is "long" here
    command = ["export", str(tmp_path / "ckpt"), str(tmp_path / "exported"), "--max-shard-size", "30KB", "--dtype", "bf16"]
    with caplog.at_level(logging.INFO, logger="offload"):
        assert main(command) == 0
    tensors = len(json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"])
    assert f"1 of {tensors} tensors written" in caplog.text and f"{tensors} of {tensors} tensors written" in caplog.text
    names = sorted(os.listdir(tmp_path / "exported"))
    assert names == sorted(set(os.listdir(tmp_path / "saved")) - {"generation_config.json"})  # a checkpoint has none
    for name in names:
        if name != "config.json":  # the checkpoint's config is the model's before save_pretrained names its class
            assert (tmp_path / "exported" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bad"), "--max-shard-size", "-1"]) == 1
    assert not (tmp_path / "bad").exists()


# ---- several ranks -----------------------------------------------------------------------------
def _two_ranks_save(rank, world_size, swap, out):
    from distributed_worker import RANK_DEVICE, local_half

    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap, "nvme", "nvme"), device=RANK_DEVICE)
    for batch in batches(2):
        x, y = local_half(batch, rank, world_size)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
    entry = engine.save_pretrained(out, max_shard_size=2000)
    state = engine.consolidated_state_dict()
    failure = None
    try:  # rank 0 cannot write there: every rank hears of it
        engine.save_pretrained(os.path.join(out, "model.safetensors.index.json"))
    except OffloadError as error:
        failure = str(error)
    engine.close(restore_weights=False)
    return {"entry": entry, "state": state if rank == 0 else None, "failure": failure}


def test_two_ranks_save_once_and_fail_together(tmp_path, swap_dir):
    from distributed_worker import launch

    results = launch(_two_ranks_save, 2, swap_dir, str(tmp_path / "out"), deadline_s=240)
    assert all(result.get("ok") for result in results), [result.get("traceback") for result in results]
    values = [result["value"] for result in results]
    assert values[0]["entry"] == values[1]["entry"] == str(tmp_path / "out" / "model.safetensors.index.json")
    assert "is a file, not a directory" in values[0]["failure"]
    assert "failed on rank 0" in values[1]["failure"]
    assert_equal_state(load_set(tmp_path / "out"), values[0]["state"])
