"""Ranks that run different units (a data-dependent branch) never mix their collectives.

With param none, each rank skips the blocks its branch skips, and training equals plain PyTorch
AdamW on the mean of the ranks' losses (a block no rank ran is not stepped, as torch skips a
parameter without gradient). With params offloaded, whose weights are gathered from every
rank at each use, the ranks stop at once with an error naming what each was about to do,
instead of gathering one unit's shards into another or waiting for the timeout.
"""

from __future__ import annotations

import pytest
from branch_worker import reference, train
from distributed_worker import launch, make_config, rank_swap_dirs
from reference import max_weight_difference

from offload.platform.rank_order import Op, ReduceOrder, describe

WORLD = 2


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_ranks_skipping_different_units_train_like_plain_pytorch(tmp_path, optimizer, overlap):
    swaps = rank_swap_dirs(tmp_path, WORLD)
    config = make_config(swaps, "none", optimizer, overlap)
    results = launch(train, WORLD, config, timeout_s=30, deadline_s=150)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback') or result}"
    expected, _ = reference(WORLD)
    assert max_weight_difference(results[0]["value"]["weights"], expected) <= 1e-5


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_ranks_skipping_different_offloaded_units_fail_at_once(tmp_path, param):
    swaps = rank_swap_dirs(tmp_path, WORLD)
    config = make_config(swaps, param, "cpu", "forward")
    results = launch(train, WORLD, config, timeout_s=60, deadline_s=150)
    for result in results:
        assert not result["ok"] and result.get("type") == "RankMismatchError", result
        assert "the ranks are out of step" in result["message"]
        assert "rank 0: the all-gather of the weights of unit blocks." in result["message"]
        assert "offload.param none" in result["message"]
        assert result["seconds"] < 50, "the mismatch waited for the group timeout"


# Rank 1 of the test below stays silent until rank 0 has its error, and at most this long.
SILENT_S = 15


def _one_rank_stops_answering(rank: int, world_size: int, config: dict, release_path: str) -> dict:
    """Rank 1 stops after its forward (a hang elsewhere) until rank 0 has given up, or SILENT_S;
    rank 0 goes on to backward."""
    import os
    import time

    import torch
    from distributed_worker import RANK_DEVICE
    from reference import TinyNet, batches, mse

    import offload

    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config, device=RANK_DEVICE)
    x, y = batches(1)[0]
    loss = mse(engine, x, y)
    started = time.perf_counter()
    if rank == 1:
        while not os.path.exists(release_path) and time.perf_counter() - started < SILENT_S:
            time.sleep(0.05)
        return {"seconds": time.perf_counter() - started}
    try:
        engine.backward(loss)
    except Exception as error:  # noqa: BLE001 (reported to the test)
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - started}
    finally:
        open(release_path, "w").close()
    return {"error": None, "seconds": time.perf_counter() - started}


def test_a_rank_that_stops_answering_fails_the_others_within_the_configured_timeout(tmp_path):
    """Rank 0 gives up after the config's 3 s (plus the few seconds it waits for the others'
    notes), long before rank 1 speaks again: with the group's 600 s timeout instead, rank 0 would
    wait until rank 1 ends its silence after SILENT_S and exits."""
    swaps = rank_swap_dirs(tmp_path, WORLD)
    config = make_config(swaps, "cpu", "cpu", "forward", collective_timeout=3)
    release = str(tmp_path / "release")
    results = launch(_one_rank_stops_answering, WORLD, config, release, timeout_s=600, deadline_s=150)
    assert results[0]["ok"], results[0]
    waited = results[0]["value"]
    assert waited["error"] and waited["error"].startswith("CollectiveError"), waited
    assert "rank 1" in waited["error"], waited
    assert waited["seconds"] < SILENT_S - 1, (
        f"waited {waited['seconds']:.1f} s: the process group's 600 s timeout, not the config's 3 s"
    )
    assert results[1]["ok"] and results[1]["value"]["seconds"] < SILENT_S - 1, results[1]  # released by rank 0


# ---- the order itself (plain logic) --------------------------------------------------------
def test_reduce_order_streams_in_descending_order_and_defers_what_it_must():
    order = ReduceOrder(used_anywhere={0, 1, 2, 3, 4}, used_here={0, 1, 3, 4}, used_twice_anywhere={1})
    assert order.start() == []  # unit 4 leads and is used here: wait for its gradients
    assert order.grads_final(3) == []  # 4 first
    assert order.grads_final(4) == [4, 3, 2]  # 2 is not used here: it contributes zeros in turn
    assert order.grads_final(1) == []  # used twice on some rank: final only at the end
    assert order.grads_final(0) == []
    assert order.finish() == [1, 0]
    assert order.grads_final(4) == []  # never twice


@pytest.mark.parametrize("seed", range(20))
def test_every_rank_reduces_the_same_sequence_whatever_order_its_gradients_arrive_in(seed):
    """Property: for any units each rank used (once or twice) and any order in which their
    gradients become final, every rank reduces each used unit exactly once, in one sequence."""
    import random

    rng = random.Random(seed)
    units = range(8)
    used = [{u for u in units if rng.random() < 0.7} for _ in range(3)]
    twice = [{u for u in used[r] if rng.random() < 0.2} for r in range(3)]
    anywhere = set().union(*used)
    twice_anywhere = set().union(*twice)
    sequences = []
    for rank in range(3):
        order = ReduceOrder(anywhere, used[rank], twice_anywhere)
        sequence = order.start()
        arrivals = list(used[rank]) * 2
        rng.shuffle(arrivals)
        for unit in arrivals:
            sequence += order.grads_final(unit)
        sequence += order.finish()
        sequences.append(sequence)
    assert all(sequence == sequences[0] for sequence in sequences)
    assert sorted(sequences[0]) == sorted(anywhere)


def test_describe_names_the_operation_and_the_unit():
    names = ["<root>", "blocks.0"]
    assert describe((Op.GATHER, 1), names) == "the all-gather of the weights of unit blocks.0"
    assert describe((Op.REDUCE, 0), names) == "the reduce-scatter of the gradients of unit <root>"
    assert "unknown" in describe((99, 0), names)


def test_mismatch_message_names_what_each_rank_was_doing():
    from offload.platform.collectives import mismatch_message

    names = ["<root>", "blocks.0", "blocks.1"]
    assert mismatch_message([(Op.GATHER, 1), (Op.GATHER, 1)], lambda key: describe(key, names)) is None
    message = mismatch_message([(Op.GATHER, 1), (Op.REDUCE, 2)], lambda key: describe(key, names))
    assert message == (
        "the ranks are out of step (rank 0: the all-gather of the weights of unit blocks.0; "
        "rank 1: the reduce-scatter of the gradients of unit blocks.1)"
    )


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_rank_that_skips_a_backward_makes_every_rank_fail_at_once(tmp_path, param):
    """With param none nothing else would notice: the ranks' reductions would pair micro-batch
    k of one with micro-batch k + 1 of the other, silently. The start of each backward states its
    number, so the ranks stop at the next one, each naming where every rank was."""
    from distributed_worker import skip_one_backward

    swaps = rank_swap_dirs(tmp_path, WORLD)
    results = launch(skip_one_backward, WORLD, swaps, param, timeout_s=60, deadline_s=150)
    for result in results:
        assert not result["ok"] and result.get("type") == "RankMismatchError", result
        assert "the ranks are out of step" in result["message"]
        if param == "none":  # nothing else is gathered: the start of backward notices
            assert "rank 0: the start of backward after training forward number 2" in result["message"]
            assert "rank 1: the start of backward after training forward number 3" in result["message"]
            assert "skip it on every rank" in result["message"]
        assert result["seconds"] < 50, "the mismatch waited for the group timeout"
