"""Pretrained weights that cannot be loaded as they are (issue 48, item 4): each case is a
`WeightsError` naming the file and the key, raised by `initialize(..., weights=)` before the
engine made anything (the model's parameters still on the meta device, no swap file); a missing
key is one warning and the model's own init. Files are written here byte by byte where the
case is a lie safetensors' own writer would not tell."""

from __future__ import annotations

import json
import logging
import os
import struct

import pytest
import torch
from reference import TinyNet
from safetensors.torch import save_file

import offload
from offload.errors import WeightsError
from offload.storage.weight_files import INDEX_FILE, check_index_name, hub_blobs, open_weight_files, parse_header

pytestmark = pytest.mark.host_only  # no engine is built: the checked device would run them again unchanged


def tiny():
    torch.manual_seed(0)
    return TinyNet(width=8, depth=2)


def meta_tiny():
    with torch.device("meta"):
        return TinyNet(width=8, depth=2)


def state():
    return {k: v.contiguous() for k, v in tiny().state_dict().items()}


def config(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return {"precision": "fp32", "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": str(swap)}}


def raw_file(path, header: dict, data: bytes, length: int | None = None) -> None:
    """A safetensors file with exactly this header and data (no check of either)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def sharded(directory, tensors: dict, split: int = 3) -> dict[str, str]:
    """`tensors` in shards of `split` keys plus an index; returns the weight map."""
    directory.mkdir(exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for number, start in enumerate(range(0, len(keys), split)):
        name = f"model-{number:05d}.safetensors"
        save_file({k: tensors[k] for k in keys[start : start + split]}, str(directory / name))
        weight_map.update(dict.fromkeys(keys[start : start + split], name))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def refused(tmp_path, weights, *fragments, **kwargs) -> WeightsError:
    """initialize refuses `weights` with a message holding every fragment, and changed nothing."""
    model = meta_tiny()
    cfg = config(tmp_path)
    with pytest.raises(WeightsError) as caught:
        offload.initialize(model, cfg, weights=weights, **kwargs)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert all(p.is_meta for p in model.parameters())
    assert os.listdir(cfg["offload"]["nvme_path"]) == []  # no run directory: nothing was made
    return caught.value


# ---- keys --------------------------------------------------------------------------------
def test_a_missing_key_is_one_warning_and_the_models_own_init(tmp_path, caplog):
    values = state()
    del values["blocks.1.up.weight"]
    save_file(values, str(tmp_path / "w.safetensors"))
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine = offload.initialize(meta_tiny(), config(tmp_path), weights=tmp_path / "w.safetensors")
    warnings = [r.getMessage() for r in caplog.records if "take the model's own init" in r.getMessage()]
    assert len(warnings) == 1 and "'blocks.1.up.weight'" in warnings[0]
    loaded = engine.consolidated_state_dict()
    engine.close(restore_weights=False)
    for key, value in values.items():
        assert torch.equal(loaded[key], value), key
    up = loaded["blocks.1.up.weight"]  # nn.Linear's own init: U(-1/sqrt(8), 1/sqrt(8)), drawn
    assert 0 < up.abs().max() <= 8**-0.5


def test_an_unexpected_key_is_refused_or_with_weights_strict_false_dropped(tmp_path, caplog):
    values = {**state(), "blocks.0.extra.weight": torch.ones(3)}
    save_file(values, str(tmp_path / "w.safetensors"))
    path = tmp_path / "w.safetensors"
    refused(tmp_path, path, str(path), "'blocks.0.extra.weight'", "weights_strict=False")
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine = offload.initialize(meta_tiny(), config(tmp_path), weights=path, weights_strict=False)
    engine.close(restore_weights=False)
    assert any("dropped" in r.getMessage() and "blocks.0.extra.weight" in r.getMessage() for r in caplog.records)


def test_a_shape_mismatch_is_refused(tmp_path):
    values = state()
    values["out.weight"] = torch.zeros(1, 9)
    save_file(values, str(tmp_path / "w.safetensors"))
    refused(tmp_path, tmp_path / "w.safetensors", "'out.weight'", "shape [1, 9]", "[1, 8]")


@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.float64, "F64"), (torch.float8_e4m3fn, "F8_E4M3")])
def test_a_parameter_dtype_fp32_cannot_hold_exactly_is_refused(tmp_path, dtype, name):
    values = state()
    values["inp.bias"] = values["inp.bias"].to(dtype)
    save_file(values, str(tmp_path / "w.safetensors"))
    refused(tmp_path, tmp_path / "w.safetensors", "'inp.bias'", f"dtype {name}")


# ---- damaged files -----------------------------------------------------------------------
def test_a_truncated_shard_is_refused(tmp_path):
    sharded(tmp_path / "w", state())
    shard = tmp_path / "w" / "model-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    refused(tmp_path, tmp_path / "w", str(shard), "truncated")


def test_a_header_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + bytes(64))
    refused(tmp_path, path, str(path), "not valid JSON")


def test_a_header_length_beyond_the_file_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    raw_file(path, {"inp.bias": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, bytes(32), length=1 << 40)
    refused(tmp_path, path, str(path), "the header claims")


@pytest.mark.parametrize(
    "entries, fragment",
    [
        ({"inp.bias": [0, 32], "out.bias": [16, 20]}, "overlap"),
        ({"inp.bias": [0, 32], "out.bias": [32, 36], "blocks.0.up.bias": [36, 90]}, "needs 64"),
        ({"inp.bias": [0, 32], "out.bias": [4096, 4100]}, "truncated"),
    ],
    ids=["overlap", "offsets-not-dtype-times-shape", "out-of-file"],
)
def test_a_header_whose_offsets_lie_is_refused(tmp_path, entries, fragment):
    shapes = {"inp.bias": [8], "out.bias": [1], "blocks.0.up.bias": [16]}
    header = {key: {"dtype": "F32", "shape": shapes[key], "data_offsets": offsets} for key, offsets in entries.items()}
    path = tmp_path / "w.safetensors"
    raw_file(path, header, bytes(100))
    error = refused(tmp_path, path, str(path), fragment)
    assert "key '" in str(error)


def test_parse_header_checks_each_field():
    def parse(entry):
        return parse_header("f", json.dumps({"k": entry}).encode(), 8, 8 + 64)

    assert parse({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]})["k"].start == 8
    for entry, fragment in [
        ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "increasing"),
        ({"dtype": "F32", "shape": [1]}, "lacks"),
    ]:
        with pytest.raises(WeightsError, match=fragment):
            parse(entry)


# ---- the index ---------------------------------------------------------------------------
def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    weight_map = sharded(tmp_path / "w", state())
    os.unlink(tmp_path / "w" / "model-00002.safetensors")
    key = next(k for k, f in sorted(weight_map.items()) if f == "model-00002.safetensors")
    refused(tmp_path, tmp_path / "w", "model-00002.safetensors", "does not exist", repr(key))


def test_an_index_naming_a_key_its_file_lacks_is_refused(tmp_path):
    weight_map = sharded(tmp_path / "w", state())
    weight_map["ghost.weight"] = "model-00000.safetensors"
    (tmp_path / "w" / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path, tmp_path / "w", "model-00000.safetensors", "'ghost.weight'")


def test_a_key_in_two_files_is_refused(tmp_path):
    values = state()
    sharded(tmp_path / "w", values)
    save_file({"inp.bias": values["inp.bias"], "zzz": torch.ones(1)}, str(tmp_path / "w" / "extra.safetensors"))
    index = json.loads((tmp_path / "w" / INDEX_FILE).read_text())
    index["weight_map"]["zzz"] = "extra.safetensors"
    (tmp_path / "w" / INDEX_FILE).write_text(json.dumps(index))
    refused(tmp_path, tmp_path / "w", "'inp.bias'", "one file only")


def test_an_index_pointing_outside_its_directory_is_refused(tmp_path):
    values = state()
    outside = tmp_path / "outside.safetensors"
    save_file(values, str(outside))
    (tmp_path / "w").mkdir()
    for name, fragment in [("../outside.safetensors", "leaves the directory"), (str(outside), "not a relative path")]:
        (tmp_path / "w" / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(values, name)}))
        refused(tmp_path, tmp_path / "w", INDEX_FILE, fragment, "refused")


def test_a_symlink_in_the_index_is_refused(tmp_path):
    values = state()
    outside = tmp_path / "outside.safetensors"
    save_file(values, str(outside))
    (tmp_path / "w").mkdir()
    os.symlink(outside, tmp_path / "w" / "model.linked.safetensors")
    (tmp_path / "w" / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(values, "model.linked.safetensors")}))
    refused(tmp_path, tmp_path / "w", "model.linked.safetensors", "symlink", "refused")


def test_the_hub_caches_links_into_its_blobs_are_followed(tmp_path):
    """transformers' cache: snapshots/<rev>/ holds links into the repository's blobs/."""
    values = state()
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file(values, str(repo / "blobs" / "f00d"))
    os.symlink("../../blobs/f00d", snapshot / "model.safetensors")
    assert hub_blobs(str(snapshot)) is not None
    with open_weight_files(snapshot) as files:
        assert set(files.tensors) == set(values)


def test_index_names_are_plain_relative_paths():
    assert check_index_name("model-00001-of-00002.safetensors") is None
    assert check_index_name("sub/model.safetensors") is None
    for bad in ("../x", "/etc/passwd", "a/../../x", "./x", "", 3, "a\\b"):
        assert check_index_name(bad) is not None, bad


def test_a_directory_without_safetensors_says_what_it_holds(tmp_path):
    (tmp_path / "w").mkdir()
    torch.save(state(), tmp_path / "w" / "pytorch_model.bin")
    refused(tmp_path, tmp_path / "w", "pytorch_model.bin", "safetensors")
    refused(tmp_path, tmp_path / "w" / "pytorch_model.bin", "pickle")
