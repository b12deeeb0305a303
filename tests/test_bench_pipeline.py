"""benchmarks/bench_pipeline.py: a step recorded on the checked device, its op graph, and the
replay of it at the target shape. A tiny target (2 layers) keeps each recording under a second;
the predicted times are not checked, only that the lines and the graph are well formed."""

from __future__ import annotations

import json
import re

import pytest
from bench_script import loaded

from offload.plan.pipeline_model import MACHINES, replay


@pytest.fixture(scope="module")
def bench():
    yield from loaded("bench_pipeline")


LINE = re.compile(
    r"^tiny (\S+) (?:auto|forward): step ([0-9.e+-]+) s, floor ([0-9.e+-]+) s \((\w+)\), ([0-9.]+)x floor; hidden .*; critical path "
)


def test_main_prints_a_line_per_placement_and_writes_traces(bench, tmp_path, capsys):
    trace = tmp_path / "replay.json"
    argv = ["--sizes", "tiny", "--placements", "cpu/cpu,nvme/nvme", "--batch", "2", "--seq", "32", "--host-unit-ms", "0"]
    lines = bench.main([*argv, "--machine", "this-cpu", "--trace", str(trace), "--nvme-path", str(tmp_path)])
    assert lines == capsys.readouterr().out.splitlines()
    found = {m.group(1): m for m in map(LINE.match, lines) if m}
    assert set(found) == {"cpu/cpu", "nvme/nvme"}, lines
    for m in found.values():
        step, floor = float(m.group(2)), float(m.group(3))
        assert 0 < floor <= step, m.group(0)
    assert found["nvme/nvme"].group(4).startswith("nvme")  # the drive sets the floor there
    assert any(line.startswith("tiny: ") and "plain PyTorch (compute only)" in line for line in lines)
    for placement in ("cpu-cpu", "nvme-nvme"):
        events = json.loads((tmp_path / f"replay.tiny.{placement}.json").read_text())["traceEvents"]
        assert any(e["ph"] == "X" and e["cat"] == "cpu_adam" for e in events)
    assert not any(p.name.startswith("bench-pipeline-") for p in tmp_path.iterdir())  # swap dirs removed


def ancestors(ops) -> dict[int, set[int]]:
    """Every op's transitive dependencies (the list has dependencies first)."""
    found: dict[int, set[int]] = {}
    for op in ops:
        found[op.id] = set(op.deps).union(*(found[d] for d in op.deps))
    return found


def test_graph_orders_fetches_after_steps_and_copies_after_backward(bench, tmp_path):
    """param cpu, overlap forward: a unit's fetch waits for its previous CPU Adam (the transfer
    worker waits on step_done), its gradient copy for its backward (a compute event)."""
    target = bench.Shape.named("tiny")
    rec = bench.record(target, "cpu/cpu", "forward", nvme_path=str(tmp_path), steps=3)
    graph = bench.build_graph(rec, bench.Workload(target, 2, 32))
    ops = graph.ops
    assert [op.id for op in ops] == list(range(len(ops)))  # dependencies first (replay checks it too)
    before = ancestors(ops)
    units = len(rec.unit_numel)
    kinds = {(op.kind, op.unit) for op in ops}
    assert {("adam", u) for u in range(units)} <= kinds and {("grad_copy", u) for u in range(units)} <= kinds

    checked_fetches = 0
    for op in ops:
        earlier = ops[: op.id]
        if op.kind == "fetch":
            steps = [o.id for o in earlier if o.kind == "adam" and o.unit == op.unit]
            if steps:  # the first recorded step's fetches follow the warm-up's steps, left out
                assert steps[-1] in before[op.id], f"fetch {op} does not wait for the step {steps[-1]} of its unit"
                checked_fetches += 1
        if op.kind == "grad_copy":
            backward = [o.id for o in earlier if o.resource == "compute" and o.unit == op.unit and o.kind.startswith("backward")]
            assert backward and backward[-1] in before[op.id], f"gradient copy {op} does not wait for its backward"
    # two steps after the first, each fetching every layer in forward and backward, the root once
    assert checked_fetches >= 2 * (2 * (units - 1) + 1)

    r = replay(ops, MACHINES["this-cpu"])
    prediction = bench.predict(graph, MACHINES["this-cpu"])
    assert 0 < prediction.floor <= prediction.step <= r.step_time
    # the critical path of the period covers it: its shares add up to the step
    assert sum(prediction.path.values()) == pytest.approx(prediction.step, rel=1e-9)


def test_recording_shape_and_flops(bench):
    """The recording keeps the target's layer count and its root/layer proportion; 6ND plus
    attention at the 1.3b shape (the calibration in the module docstring)."""
    target = bench.Shape.named("1.3b")
    small = bench.recording_shape(target)
    assert small.layers == target.layers == 24
    assert small.root_params() / small.layer_params() == pytest.approx(target.root_params() / target.layer_params(), rel=0.01)
    assert target.total_params() == 1_364_297_728
    work = bench.Workload(target, 8, 1024)
    attention = 12 * 1024 * 2048 * 24 * 8192
    matmul_params = target.total_params() - target.vocab * target.hidden - target.hidden  # no embedding, no final norm
    assert work.step_flops() == pytest.approx(6 * matmul_params * 8192 + attention)


def test_state_precisions_record_each_and_mark_urgent_io(bench, tmp_path, capsys):
    """--state-precisions fp32,int8: a line per precision, int8's NVMe bytes below fp32's, the
    predicted speed-up line; the graph's weight fetches are urgent and the state write-back is not.
    The graph is 1.3b's (25 units, recorded narrow): tiny's 3 units fit the staging ring, whose
    buffers keep lending every unit's new weights, so nothing reads a weights file there."""
    argv = ["--sizes", "tiny", "--placements", "nvme/nvme", "--batch", "2", "--seq", "32", "--machine", "h100-pcie5"]
    lines = bench.main([*argv, "--state-precisions", "fp32,int8", "--nvme-path", str(tmp_path), "--host-unit-ms", "0"])
    assert lines == capsys.readouterr().out.splitlines()
    found = [line for line in lines if re.match(r"^tiny nvme/nvme state=(fp32|int8) auto: step ", line)]
    assert [line.split()[2] for line in found] == ["state=fp32", "state=int8"], lines
    written = [float(g) for g in re.findall(r"nvme_w [0-9.e+-]+ s \(([0-9.e+-]+) GB\)", "\n".join(lines))]
    assert len(written) == 2 and written[1] < 0.7 * written[0], lines  # int8: 6 state bytes per param against 12
    ratio = [line for line in lines if "state int8 against fp32, predicted step" in line]
    assert len(ratio) == 1 and float(re.search(r"([0-9.]+)x$", ratio[0]).group(1)) > 1.0, lines
    _, graph, _ = bench.run(
        "1.3b",
        "nvme/nvme",
        overlap="forward",
        machine=MACHINES["h100-pcie5"],
        batch=2,
        seq=32,
        steps=3,
        nvme_path=str(tmp_path),
        state_precision="int8",
    )
    kinds = {(op.kind, op.urgent) for op in graph.ops if op.resource.startswith("nvme")}
    assert ("read_weights", True) in kinds and ("write_weights", True) in kinds and ("write_state", False) in kinds
    assert ("write_state", True) not in kinds and ("read_weights", False) not in kinds


def test_nvme_duplex_no_replays_one_queue_for_the_drive(bench, tmp_path, capsys):
    argv = ["--sizes", "tiny", "--placements", "nvme/nvme", "--batch", "2", "--seq", "32", "--machine", "h100-pcie5"]
    lines = bench.main([*argv, "--nvme-duplex", "no", "--nvme-path", str(tmp_path), "--host-unit-ms", "0"])
    capsys.readouterr()
    assert "NVMe 6/5 GB/s read/write (one queue for both)" in lines[0], lines[0]
    found = [m for m in map(LINE.match, lines) if m]
    assert len(found) == 1 and found[0].group(4) == "nvme", lines  # reads and writes add up on one queue


def test_background_depths_replay_each_recording_at_each_depth(bench, tmp_path, capsys):
    """--background-depths 0,2: the table at 0, the engine's default, and a line with each depth's
    step and its speed-up over the first (a bad list is refused)."""
    argv = ["--sizes", "tiny", "--placements", "cpu/nvme", "--batch", "2", "--seq", "32", "--machine", "h100-pcie5"]
    lines = bench.main([*argv, "--background-depths", "0,2", "--nvme-path", str(tmp_path)])
    capsys.readouterr()
    table = [m for m in map(LINE.match, lines) if m]
    depth = [line for line in lines if line.startswith("    io.background_depth: ")]
    assert len(table) == 1 and len(depth) == 1, lines
    found = re.match(r"^    io\.background_depth: 0: ([0-9.e+-]+) s, 2: ([0-9.e+-]+) s \(([0-9.]+)x\)$", depth[0])
    assert found, depth[0]
    at_0, at_2 = float(found.group(1)), float(found.group(2))
    assert at_0 == pytest.approx(float(table[0].group(2)), rel=1e-3) and at_2 > 0
    assert float(found.group(3)) == pytest.approx(at_0 / at_2, abs=0.006)
    with pytest.raises(SystemExit):
        bench.main([*argv, "--background-depths", "0,-1", "--nvme-path", str(tmp_path)])


def test_host_time_per_unit_is_replayed_before_each_compute_op(bench, tmp_path, capsys):
    """The host's own time per unit: printed with where it came from, a host op before every
    compute op (a unit's shares adding up to 1 per step), and the step's pace where the
    workload's compute is smaller (tiny at 2 x 32 tokens: the host sets the floor)."""
    argv = ["--sizes", "tiny", "--placements", "none/cpu", "--batch", "2", "--seq", "32", "--machine", "h100-pcie5"]
    lines = bench.main([*argv, "--host-unit-ms", "3", "--nvme-path", str(tmp_path)])
    capsys.readouterr()
    assert lines[1].startswith("host's own time per unit per step: 3 ms (given)"), lines[1]
    found = [m for m in map(LINE.match, lines) if m]
    assert len(found) == 1 and found[0].group(4) == "host", lines
    _, graph, rec = bench.run(
        "tiny", "none/cpu", overlap="default", machine=MACHINES["h100-pcie5"], batch=2, seq=32, steps=3, nvme_path=str(tmp_path)
    )
    assert rec.overlap == "auto"  # the engine's own schedule, as recorded
    by_id = {op.id: op for op in graph.ops}
    shares: dict = {}
    for op in graph.ops:
        if op.resource == "compute":
            hosts = [by_id[d] for d in op.deps if by_id[d].resource == "host"]
            assert len(hosts) == 1 and hosts[0].unit == op.unit, op
            step = op.label.split(",")[0]
            shares[(op.unit, step)] = shares.get((op.unit, step), 0.0) + hosts[0].share
    assert shares and all(total == pytest.approx(1.0) for total in shares.values())


def test_overlap_auto_records_its_split_and_the_device_lane(bench, tmp_path):
    """The engine's default schedule records as it would run on the machine: its split (the
    units whose gradients land last, the root first, step on the device), and the device lane's
    ops in the graph (gradients up, the exact step on the optimizer stream, the new state down),
    priced at the machine's rates."""
    machine = MACHINES["h100-pcie5"]
    prediction, graph, rec = bench.run(
        "1.3b", "none/cpu", overlap="default", machine=machine, batch=8, seq=1024, steps=3, nvme_path=str(tmp_path)
    )
    assert rec.overlap == "auto" and rec.unit_on_device[0] and not all(rec.unit_on_device)
    kinds = {(op.kind, op.resource) for op in graph.ops}
    assert {("device_adam_exact", "optimizer"), ("grad_up", "host_to_device"), ("state_down", "device_to_host")} <= kinds
    exact = [op for op in graph.ops if op.kind == "device_adam_exact"]
    assert all(op.elements > 0 for op in exact)
    assert prediction.busy["optimizer"] > 0 and prediction.floor <= prediction.step


def test_a_clipping_run_is_recorded_as_a_case_of_its_own(bench, tmp_path, capsys, monkeypatch):
    """`--clip` changes the schedule (clipping that acts redoes the speculative steps): its record
    names the clip, so that RESULTS.md keeps the unclipped step beside it instead of replacing it."""
    argv = ["--sizes", "tiny", "--placements", "cpu/cpu", "--batch", "2", "--seq", "32", "--host-unit-ms", "0"]
    folder = tmp_path / "records"
    folder.mkdir()
    monkeypatch.setenv("OFFLOAD_RESULTS_DIR", str(folder))
    bench.main([*argv, "--machine", "this-cpu", "--clip", "0.5", "--nvme-path", str(tmp_path)])
    capsys.readouterr()
    (record,) = [json.loads(path.read_text()) for path in folder.iterdir()]
    assert [row["case"] for row in record["rows"]] == ["tiny b2x32 cpu/cpu@default clip 0.5, this-cpu"]
