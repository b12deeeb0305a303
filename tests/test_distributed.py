"""Sharding over 2 CPU processes (gloo) against the single-process run and plain PyTorch AdamW.

The ranks compute on the CPU on every machine (distributed_worker.RANK_DEVICE: two ranks may
share one GPU, and gloo cannot reduce-scatter CUDA tensors), so the single-process runs they are
compared with are pinned to the CPU too.

Each rank sees its half of every batch (mean loss over its half); the engine averages the
gradients over ranks, so 2 ranks must train exactly like 1 process on the full batch, which
trains like torch.optim.AdamW. The training cases all run inside one spawned pair of
processes (starting processes is the expensive part); each test below checks one case.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from distributed_worker import RANK_DEVICE, fail_mid_step, freeze, launch, make_config, train_cases
from processes import run_process_group
from reference import TinyNet, batches, max_weight_difference, reference_run

import offload
from offload.model.units import plan_flat_layout
from offload.platform.collectives import (
    CollectiveError,
    cuda_index_for_local_rank,
    describe_failed_ranks,
    should_init_from_env,
    timeout_from_env,
)

WORLD = 2
PLACEMENTS = list(itertools.product(["none", "cpu", "nvme"], ["cpu", "nvme"]))
STEPS = 10


def _cases(swap_dirs: list[str]) -> list[dict]:
    cases = []
    for param, optimizer in PLACEMENTS:
        cases.append({"name": f"{param}-{optimizer}", "config": make_config(swap_dirs, param, optimizer, "forward")})
    cases += [
        {
            "name": "clip-none-cpu",
            "config": make_config(swap_dirs, "none", "cpu", "forward", gradient_clipping=0.05),
            "clip": 0.05,
        },
        {
            "name": "clip-nvme-nvme",
            "config": make_config(swap_dirs, "nvme", "nvme", "none", gradient_clipping=0.05),
            "clip": 0.05,
        },
        {
            "name": "accumulate-cpu-cpu",
            "config": make_config(swap_dirs, "cpu", "cpu", "forward", gradient_accumulation_steps=3),
            "micro": 3,
            "steps": 4,
            "batch": 8,
        },
        # frozen params keep their 16-bit values when the 16-bit home is a shared NVMe slot
        {"name": "frozen-nvme-nvme", "config": make_config(swap_dirs, "nvme", "nvme", "forward"), "freeze": "blocks.1.up"},
        {"name": "overlap-backward-none-cpu", "config": make_config(swap_dirs, "none", "cpu", "backward")},
        # speculative: every step clips, so every window's speculative steps are taken back and redone
        {
            "name": "clip-backward-cpu-cpu",
            "config": make_config(swap_dirs, "cpu", "cpu", "backward", gradient_clipping=0.05),
            "clip": 0.05,
        },
        {
            "name": "fp16-overflow-backward",
            "config": make_config(
                swap_dirs, "none", "cpu", "backward", precision="fp16", loss_scale={"initial": 1024.0, "growth_interval": 1000}
            ),
            "overflow_at": 2,
            "steps": 5,
        },
        {
            "name": "fp16-overflow-on-rank1",
            "config": make_config(
                swap_dirs, "cpu", "cpu", "forward", precision="fp16", loss_scale={"initial": 1024.0, "growth_interval": 1000}
            ),
            "overflow_at": 2,
            "steps": 5,
        },
        {"name": "memory-cpu-cpu", "config": make_config(swap_dirs, "cpu", "cpu"), "width": 128, "report_only": True},
        {"name": "memory-nvme-nvme", "config": make_config(swap_dirs, "nvme", "nvme"), "width": 128, "report_only": True},
    ]
    return cases


@pytest.fixture(scope="module")
def swap_dirs(tmp_path_factory):
    # a list: local rank r uses swap_dirs[r % 2], so each rank has "its own disk"
    return [str(tmp_path_factory.mktemp(f"disk{i}")) for i in range(2)]


@pytest.fixture(scope="module")
def two_ranks(swap_dirs):
    cases = _cases(swap_dirs)
    results = launch(train_cases, WORLD, cases, timeout_s=30.0, deadline_s=240.0)
    for rank, outcome in enumerate(results):
        assert outcome["ok"], f"rank {rank}: {outcome.get('traceback') or outcome}"
    by_case = {}
    for index, case in enumerate(cases):
        by_case[case["name"]] = (case, [results[rank]["value"][index] for rank in range(WORLD)])
    return by_case


def _reference(case):
    torch.manual_seed(0)
    model = TinyNet(width=case.get("width", 32))
    freeze(model, case.get("freeze"))
    micro = case.get("micro", 1)
    data = batches(case.get("steps", STEPS) * micro, batch=case.get("batch", 16))
    if micro > 1:
        data = [
            (torch.cat([b[0] for b in data[i : i + micro]]), torch.cat([b[1] for b in data[i : i + micro]]))
            for i in range(0, len(data), micro)
        ]
    return reference_run(model, data, clip=case.get("clip", 0.0))


@pytest.mark.parametrize(
    "name",
    [f"{p}-{o}" for p, o in PLACEMENTS]
    + ["clip-none-cpu", "clip-nvme-nvme", "frozen-nvme-nvme", "overlap-backward-none-cpu", "clip-backward-cpu-cpu"],
)
def test_two_ranks_equal_plain_pytorch(two_ranks, name):
    case, ranks = two_ranks[name]
    reference, reference_losses = _reference(case)
    # rank 0's gathered fp32 weights equal torch AdamW on the full batch (and so the 1-process run)
    assert max_weight_difference(ranks[0]["state"], reference) <= 1e-5
    # every rank gathers the same weights, and reads them whole inside params_on_device
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert [r["read_differs"] for r in ranks] == [[], []]
    # the mean of the two halves' losses is the full batch's loss, step by step
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean_losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    assert all(r["stepped"] == [True] * STEPS for r in ranks)
    if "clip" in case:
        # the clip was active, with the global norm over both ranks' shards on both ranks
        assert ranks[0]["last_grad_norm"] > case["clip"]
        assert ranks[0]["last_grad_norm"] == ranks[1]["last_grad_norm"]
    if case["config"]["overlap"] == "backward" and "clip" in case:
        assert all(r["speculation"]["redone"] == STEPS for r in ranks)


def test_two_ranks_accumulation_equals_larger_batch(two_ranks):
    case, ranks = two_ranks["accumulate-cpu-cpu"]
    reference, _ = _reference(case)
    assert all(r["stepped"] == [False, False, True] * 4 for r in ranks)
    assert max_weight_difference(ranks[0]["state"], reference) <= 1e-5


@pytest.mark.parametrize("name", ["fp16-overflow-on-rank1", "fp16-overflow-backward"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(two_ranks, name):
    _, ranks = two_ranks[name]
    for r in ranks:
        assert r["stepped"] == [True, True, False, True, True]
        assert r["skipped_steps"] == 1
        assert r["loss_scale"] == 512.0
    assert ranks[0]["digest"] == ranks[1]["digest"]
    # the fp16 device weights read whole are the fp32 master weights rounded to fp16
    assert [r["read_differs"] for r in ranks] == [[], []]


def test_fp16_speculative_run_equals_the_run_stepped_after_the_norm(two_ranks):
    """The same weights, bitwise, whether the units stepped speculatively during backward (and
    were taken back at the overflow) or only once the norm was known."""
    _, speculative = two_ranks["fp16-overflow-backward"]
    _, plain = two_ranks["fp16-overflow-on-rank1"]
    assert speculative[0]["digest"] == plain[0]["digest"]
    assert speculative[0]["losses"] == plain[0]["losses"]


def test_swap_files_per_rank_on_its_own_path_under_one_run(two_ranks, swap_dirs):
    _, ranks = two_ranks["nvme-nvme"]
    run = ranks[0]["run_name"]
    assert ranks[1]["run_name"] == run  # one run directory name for every rank
    for rank, r in enumerate(ranks):
        assert r["swap_path"] == os.path.join(swap_dirs[rank % len(swap_dirs)], run, f"rank{rank}")
        assert not r["swap_left"]
    for directory in swap_dirs:  # close() removed every rank's files and the run directories
        assert os.listdir(directory) == []


def _single_process_memory(config: dict) -> dict:
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(width=128), copy.deepcopy(config), device=RANK_DEVICE)
    report = engine.memory_report()
    engine.close(restore_weights=False)
    return report


@pytest.mark.parametrize(
    "name,tier,category", [("memory-cpu-cpu", "host", "optimizer_state"), ("memory-nvme-nvme", "nvme", "swap")]
)
def test_each_rank_holds_about_half_the_optimizer_state(two_ranks, tmp_path, name, tier, category):
    case, ranks = two_ranks[name]
    config = copy.deepcopy(case["config"])
    config["offload"]["nvme_path"] = str(tmp_path)
    single = _single_process_memory(config)[tier]["by_category"][category]["current"]
    # exact: the units' shards at world 2 against world 1, padding to the shard alignment included
    model = TinyNet(width=128)
    from offload.model.units import build_units

    units = build_units(model)
    numels = [[p.numel() for p in u.params] for u in units]
    ratio = sum(plan_flat_layout(n, WORLD).shard_numel for n in numels) / sum(plan_flat_layout(n, 1).shard_numel for n in numels)
    for r in ranks:
        held = r["memory"][tier]["by_category"][category]["current"]
        assert held == pytest.approx(single * ratio, rel=0.03)  # swap files add a 4 KiB header each
        assert 0.45 * single <= held <= 0.55 * single


# ---- a failing rank -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raise", "exit", "hang"])
def test_a_failing_rank_stops_the_other_with_an_error_naming_it(tmp_path, mode):
    timeout = 8.0 if mode == "hang" else 30.0
    release = str(tmp_path / "release")
    results = launch(fail_mid_step, WORLD, str(tmp_path), mode, release, timeout_s=timeout, deadline_s=90.0)
    survivor, failed = results
    assert not survivor["ok"], survivor
    assert survivor["type"] == CollectiveError.__name__, survivor.get("traceback")
    message = survivor["message"]
    if mode == "exit":  # rank 1 died inside its backward: rank 0 fails in a hook of its backward
        assert "the all-gather of the weights of unit blocks.3 failed on rank 0 of 2" in message
    else:  # rank 1 never reached backward: rank 0 fails in the first collective of its backward
        assert "the start of backward after training forward number" in message and "failed on rank 0 of 2" in message
    if mode == "raise":
        assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 3" in message
        assert failed["type"] == "RuntimeError" and "injected failure" in failed["message"]
    else:
        assert "rank 1 did not answer" in message
    if mode == "exit":
        assert failed == {"ok": False, "exitcode": 7, "seconds": failed["seconds"]}
    # the survivor gave up within the group's timeout plus the few seconds it waits for notes
    seconds = float(message.rsplit("[raised ", 1)[1].split("s after")[0])
    assert seconds <= timeout + 6.0


# ---- plain decisions ---------------------------------------------------------------------------
def test_describe_failed_ranks():
    assert describe_failed_ranks([1], set(), {1: "ValueError: x"}, True) == "rank 1 failed: ValueError: x"
    assert "ranks 2, 3 did not answer" in describe_failed_ranks([1, 2, 3], {1}, {}, True)
    assert "rank 0" in describe_failed_ranks([0], set(), {}, False)
    assert "every rank is alive" in describe_failed_ranks([1], {1}, {}, True)


def test_process_group_from_environment_decision():
    assert should_init_from_env(False, {"WORLD_SIZE": "2"})
    assert not should_init_from_env(True, {"WORLD_SIZE": "2"})
    assert not should_init_from_env(False, {"WORLD_SIZE": "1"})
    assert not should_init_from_env(False, {})
    assert timeout_from_env({}) == 600.0
    assert timeout_from_env({"OFFLOAD_DIST_TIMEOUT_S": "20"}) == 20.0
    with pytest.raises(offload.OffloadError, match="OFFLOAD_DIST_TIMEOUT_S"):
        timeout_from_env({"OFFLOAD_DIST_TIMEOUT_S": "soon"})


def test_each_local_rank_needs_its_own_gpu():
    assert cuda_index_for_local_rank({"LOCAL_RANK": "1"}, gpu_count=2) == 1
    assert cuda_index_for_local_rank({}, gpu_count=1) == 0
    # more ranks than GPUs: the error names LOCAL_RANK, the GPU count and the two ways out
    with pytest.raises(offload.OffloadError) as raised:
        cuda_index_for_local_rank({"LOCAL_RANK": "1"}, gpu_count=1)
    message = str(raised.value)
    assert "LOCAL_RANK=1" in message and "1 GPU" in message
    assert "--nproc-per-node 1" in message and "--device cpu" in message and "gloo" in message
    with pytest.raises(offload.OffloadError, match="LOCAL_RANK='x' is not an integer"):
        cuda_index_for_local_rank({"LOCAL_RANK": "x"}, gpu_count=4)


# ---- the torchrun example ----------------------------------------------------------------------
def test_torchrun_example_two_ranks_nvme_path_per_rank(tmp_path):
    """examples/torchrun_tiny.py under torchrun: the engine starts the group from the environment
    (on the CPU, with gloo: two ranks need not have two GPUs)."""
    import shutil
    import sys
    from pathlib import Path

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    disks = [tmp_path / "d0", tmp_path / "d1"]
    for disk in disks:
        disk.mkdir()
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OFFLOAD_DIST_TIMEOUT_S": "60",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    completed = run_process_group(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            str(root / "examples" / "torchrun_tiny.py"),
            "--steps",
            "3",
            "--param",
            "nvme",
            "--optimizer",
            "nvme",
            "--device",
            "cpu",
            "--nvme",
            *map(str, disks),
        ],
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "initialised the gloo process group from the environment: rank 1 of 2" in completed.stderr
    assert "rank 1/2: host" in completed.stderr
    assert all(list(disk.iterdir()) == [] for disk in disks)  # swap files removed at close
