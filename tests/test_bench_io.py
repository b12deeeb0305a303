import argparse
import json
import os

import pytest

from offload.cli import bench_io, main
from offload.plan.disk_time import background_depths_to_try, pick_background_depth


def run_cli(capsys, *argv):
    rc = main(["bench-io", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


SMALL = ["--size", "1M", "--block-sizes", "64K,256K", "--queue-depths", "2,4", "--threads", "1,2"]


def test_json_result_shape_and_cleanup(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--path", str(tmp_path), "--json", *SMALL)
    assert rc == 0
    res = json.loads(out)
    # threads <= depth only: (1,2),(2,2),(1,4),(2,4) per block size, x2 ops
    assert len(res["rows"]) == 2 * 4 * 2
    for row in res["rows"]:
        assert set(row) == {"op", "block_size", "queue_depth", "threads", "gbps"}
        assert row["gbps"] > 0 and row["threads"] <= row["queue_depth"]
    for op in ("read", "write"):
        best = res["best"][op]
        assert best["op"] == op
        assert best["gbps"] == max(r["gbps"] for r in res["rows"] if r["op"] == op)
    assert set(res["io"]) == {"block_size", "queue_depth", "threads", "background_depth"}
    assert res["size"] == 1 << 20
    # then half the file read while the other half is written, at the io setting
    together = res["together"]
    setting = {k: together[k] for k in ("block_size", "queue_depth", "threads")}
    assert {**setting, "background_depth": together["background_depth"]} == res["io"]
    # and with the reads urgent at each depth worth trying: the fastest's, or 0 within 10% of it
    places = min(setting["threads"], setting["queue_depth"])
    timed = {row["background_depth"]: row["seconds"] for row in together["urgent_reads"]}
    assert list(timed) == background_depths_to_try(places)
    assert together["background_depth"] == pick_background_depth(timed)
    assert together["read_bytes"] == together["written_bytes"] == 1 << 19
    assert together["seconds"] > 0 and together["gbps"] == pytest.approx((1 << 20) / together["seconds"] / 1e9, rel=0.01)
    assert 1.0 <= together["overlap"] <= together["largest_overlap"] <= 2.0
    assert res["step_advice"]["overlap"] == together["overlap"]
    assert "[17/17] both " in err  # progress on stderr, the pass of both directions last
    assert os.listdir(tmp_path) == []


def test_together_pass_reads_one_half_and_writes_the_other(tmp_path):
    """The pass of both directions reads back what the file's first half holds and leaves its
    second half holding the written buffer."""
    import torch

    from offload.storage.aio import AioEngine

    size = 1 << 20
    path = tmp_path / "f"
    first = torch.arange(size // 2, dtype=torch.int64).remainder(251).to(torch.uint8)
    path.write_bytes(first.numpy().tobytes() + bytes(size // 2))
    read_buf = torch.zeros(size // 2, dtype=torch.uint8)  # one request per half (the engine splits it in blocks)
    write_buf = torch.full((size // 2,), 7, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR)
    try:
        with AioEngine(65536, 4, 2) as engine:
            assert bench_io._together_pass(engine, fd, read_buf, write_buf, size, direct=False) > 0
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[size // 2 :] == bytes([7]) * (size // 2)
    assert torch.equal(read_buf, first)


def test_table_and_pasteable_io_section(tmp_path, capsys):
    rc, out, _ = run_cli(
        capsys,
        "--path",
        str(tmp_path),
        "--quiet",
        "--size",
        "256K",
        "--block-sizes",
        "64K",
        "--queue-depths",
        "2",
        "--threads",
        "2",
    )
    assert rc == 0
    assert "GB/s" in out and "write" in out and "read" in out
    section = json.loads(out[out.index("{") :])
    depth = section["io"].pop("background_depth")
    assert section == {"io": {"block_size": 65536, "queue_depth": 2, "threads": 2}} and depth in (0, 1)
    assert "by io.background_depth" in out
    assert os.listdir(tmp_path) == []


def test_interrupt_removes_scratch(tmp_path, monkeypatch):
    seen = []

    def progress(done, total, row):
        seen.extend(os.listdir(tmp_path))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench_io.run_sweep(str(tmp_path), 1 << 20, [65536], [2], [2], progress=progress)
    assert any(name.startswith(".offload-bench-io-") for name in seen)  # it existed mid-run
    assert os.listdir(tmp_path) == []


def test_missing_path_is_clear(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "--path", str(tmp_path / "nope"), *SMALL)
    assert rc == 1 and "not an existing directory" in err


def test_tmpfs_warning(caplog):
    if bench_io.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    _, warnings = bench_io.path_warnings("/dev/shm", True)
    assert any("tmpfs" in w and "RAM" in w for w in warnings)
    _, warnings = bench_io.path_warnings("/dev/shm", False)
    assert any("refuses O_DIRECT" in w for w in warnings)


def test_parse_size():
    assert bench_io.parse_size("4M") == 4 << 20
    assert bench_io.parse_size("512KiB") == 512 << 10
    assert bench_io.parse_size("2G") == 2 << 30
    assert bench_io.parse_size("1048576") == 1 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        bench_io.parse_size("lots")


def test_bad_block_size_rejected(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "--path", str(tmp_path), "--block-sizes", "1000", "--size", "64K")
    assert rc == 2 and "multiple of 4096" in err


def test_step_seconds_count_the_states_bytes():
    """The advice converts the best speeds into an optimizer step per billion params with the
    state streamed from the disk: fp32 moments and gradient move 16 bytes per param each way
    (12 with the gradient in RAM); compact state moves less."""
    from offload.config.state_layout import FP32_STATE, StateBytes, StatePrecision

    fp32 = bench_io.step_seconds(2.0, 1.0, FP32_STATE)
    # each kind's file in whole pages: 16 bytes per param, to a page
    assert fp32["gradient_on_disk"]["read"] == fp32["gradient_on_disk"]["written"] == pytest.approx(16 * 10**9, abs=4 * 4096)
    assert fp32["gradient_on_disk"]["seconds"] == pytest.approx(16 / 2 + 16 / 1)
    assert fp32["gradient_in_ram"]["seconds"] == pytest.approx(12 / 2 + 12 / 1)
    int8 = bench_io.step_seconds(2.0, 1.0, StateBytes(StatePrecision.INT8, 2))
    assert int8["gradient_on_disk"]["read"] == pytest.approx((4 + 2 * (1 + 1 / 32) + 2) * 10**9, rel=1e-4)
    assert (
        int8["gradient_on_disk"]["seconds"]
        < bench_io.step_seconds(2.0, 1.0, StateBytes(StatePrecision.BF16, 2))["gradient_on_disk"]["seconds"]
        < fp32["gradient_on_disk"]["seconds"]
    )


def test_step_seconds_at_the_drives_overlap():
    """A drive that served reads and writes at once gets the step's seconds of `disk_time`: less
    than reads then writes, never less than its longer direction."""
    from offload.config.state_layout import FP32_STATE

    serial = bench_io.step_seconds(2.0, 1.0, FP32_STATE)["gradient_on_disk"]["seconds"]
    assert bench_io.step_seconds(2.0, 1.0, FP32_STATE, overlap=1.0)["gradient_on_disk"]["seconds"] == serial
    assert bench_io.step_seconds(2.0, 1.0, FP32_STATE, overlap=1.2)["gradient_on_disk"]["seconds"] == pytest.approx(
        serial / 1.2, rel=1e-3
    )
    assert bench_io.step_seconds(2.0, 1.0, FP32_STATE, overlap=2.0)["gradient_on_disk"]["seconds"] == pytest.approx(
        16 / 1, rel=1e-3
    )
    advice = {"params": 10**9, "config_precision": "fp32", "gradient_bytes": 2, "by_precision": {}}
    assert "reads then writes;" in bench_io.advice_lines({**advice, "overlap": None})[0]
    assert "1.60x as fast as one after the other" in bench_io.advice_lines({**advice, "overlap": 1.6})[0]
    assert "no faster together" in bench_io.advice_lines({**advice, "overlap": 1.0})[0]


def test_advice_marks_the_configs_precision(tmp_path, capsys):
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"optimizer": {"state_precision": "int8"}}))
    rc, out, _ = run_cli(capsys, "--path", str(tmp_path), "--json", "--quiet", *SMALL[:2], "--config", str(config))
    assert rc == 0
    advice = json.loads(out)["step_advice"]
    assert advice["config_precision"] == "int8" and advice["gradient_bytes"] == 2  # bf16 compute, one micro-batch
    assert list(advice["by_precision"]) == ["fp32", "bf16", "int8"]
    assert bench_io.advice_lines(advice)[3].startswith("  int8 (your config): ")
    assert "served them" in bench_io.advice_lines(advice)[0]  # the drive's overlap, as measured
    rc, _, err = run_cli(capsys, "--path", str(tmp_path), "--config", str(tmp_path / "missing.json"), *SMALL)
    assert rc == 2 and "missing.json" in err
