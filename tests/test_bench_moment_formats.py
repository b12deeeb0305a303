"""benchmarks/bench_moment_formats.py: its generic block format is the engine's int8 format where
they share a shape, and the study runs end to end at bench_quality's tiny setting."""

from __future__ import annotations

import math

import pytest
import torch
from bench_script import loaded

from offload.optim import moments


@pytest.fixture(scope="module")
def bench():
    yield from loaded("bench_moment_formats")


def test_the_generic_e3m4_and_e4m4_grids_are_the_engines(bench):
    # values the engine's int8 format decodes to lie on the generic format's grid: rounding them
    # again (any random bits) gives them back. The first moment's from 2^-11 of its block's scale
    # on: below it the engine keeps powers of two (E3M4T's tail), the generic E3M4 only zero.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32 * 64, generator=gen) * torch.exp2(torch.randint(-20, 20, (32 * 64,), generator=gen).float())
    m = bench.shipped("exp_avg", x, moments.rounding_key(0, 0, 1))
    scale = torch.exp2(torch.floor(torch.log2(m.view(-1, 32).abs().amax(1))) + 1).repeat_interleave(32)
    on_grid = m.abs() >= scale * 2.0**-11
    assert (~on_grid & (m != 0)).any()  # the tail is there
    assert torch.equal(bench.block_rounded(m, 3, 4, gen)[on_grid], m[on_grid])
    root = bench.shipped("exp_avg_sq", x.square(), moments.rounding_key(0, 0, 1)).sqrt()
    assert torch.equal(bench.block_rounded(root, 4, 4, gen), root)
    # and off the grid it rounds to a neighbour: within one code
    rounded = bench.block_rounded(x, 3, 4, gen)
    assert ((rounded - x).abs() <= x.abs() / 16 + x.abs().view(-1, 32).amax(1).repeat_interleave(32) * 2.0**-9).all()


def test_the_study_runs_at_the_tiny_setting(bench, capsys):
    results = bench.main(["--small", "--steps", "3", "--formats", "m:int8,v:E4M4", "--streams", "2", "--threads", "1"])
    assert set(results) == {"m:int8", "v:E4M4"}
    for spec, rows in results.items():
        assert len(rows) == 2 and all(math.isfinite(value) for row in rows for value in row), spec
    out = capsys.readouterr().out
    assert "m:int8   over 2 streams: train" in out
    with pytest.raises(SystemExit, match="--formats"):
        bench.rounder("x:E3M4")
