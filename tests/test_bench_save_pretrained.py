"""benchmarks/bench_save_pretrained.py on a model small enough for a test: every kind of save
runs, the streamed one writes what the other writes, and the report reads the rounds."""

from __future__ import annotations

import argparse

import pytest
from bench_script import loaded

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    yield from loaded("bench_save_pretrained")


def test_one_round_on_a_tiny_model(bench, tmp_path, capsys):
    args = argparse.Namespace(
        path=str(tmp_path), layers=2, hidden=64, vocab=256, optimizer="cpu", max_shard_size="100KB", rounds=1
    )
    result = bench.run(args)
    assert len(result["streamed"]) == len(result["whole"]) == 1 and len(result["raw"]) == 2
    # the same weights in the same files, give or take the whole route's config.json
    assert abs(result["streamed"][0]["bytes"] - result["whole"][0]["bytes"]) < 200
    assert result["streamed"][0]["bytes"] > result["params"] * 4
    recorder = bench.Recorder("bench_save_pretrained", vars(args))
    bench.report(result, recorder)
    recorder.finish()
    out = capsys.readouterr().out
    assert "engine.save_pretrained (streamed)" in out and "of the raw write of random bytes" in out
    # the record: the streamed save's rate against the raw write, its RSS against the whole route's
    metrics = {row["metric"]: row for row in recorder.record["rows"]}
    assert metrics["GB/s"]["peer"].startswith("raw write") and metrics["GB/s"]["value"] > 0
    assert metrics["peak RSS growth MiB"]["peer"].startswith("model.save_pretrained")
    assert list(tmp_path.iterdir()) == []  # the benchmark's directory is removed
