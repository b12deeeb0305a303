"""benchmarks/gpu_session.sh, the one call of a lent GPU machine, in its dry mode (tiny sizes, the
CPU as the device, no DeepSpeed): the whole plan runs end to end and brings back what a GPU call
would, so that the script cannot rot between GPU runs. And its decision logic, directly: time
boxes, the session's sizes, test counts from a report or a log cut short, a part stopped at its
box."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
from bench_script import BENCHMARKS, loaded

REPO = os.path.dirname(BENCHMARKS)
pytestmark = pytest.mark.host_only


@pytest.fixture(scope="module")
def session():
    yield from loaded("gpu_session")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`bash benchmarks/gpu_session.sh --dry`, as the GPU call but here: (its output, OUT)."""
    root = tmp_path_factory.mktemp("gpu-session")
    env = {**os.environ, "OUT": str(root / "out"), "WORK": str(root / "work"), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", os.path.join(BENCHMARKS, "gpu_session.sh"), "--dry"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, root / "out"


def records_in(out) -> list[dict]:
    with tarfile.open(out / "records.tar") as archive:
        return [json.load(archive.extractfile(member)) for member in archive.getmembers() if member.name.endswith(".json")]


def test_dry_run_brings_back_three_files_and_a_record_per_part(session, dry_run):
    import records

    output, out = dry_run
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "records.tar", "summary.txt"]  # the device tool brings back 8 at most
    found = records_in(out)
    for record in found:
        records.validate(record, record["benchmark"])
        assert record["complete"] and record["source"] == "run"
    by_kind = {}
    for record in found:
        by_kind.setdefault(record["benchmark"], []).append(record)
    assert sorted(by_kind) == ["bench_gpu", "bench_pipeline", "gpu_session.sanitizer", "gpu_session.suite"]
    # the host's time per unit, and the replay taking it
    host, replay = sorted(by_kind["bench_pipeline"], key=lambda r: "--measure-host" not in r["command"])
    assert host["rows"][0]["metric"] == "ms" and host["rows"][0]["value"] > 0
    assert replay["settings"]["host_unit_ms"] == pytest.approx(host["rows"][0]["value"], abs=1e-3)
    assert {row["case"].split()[2].rstrip(",") for row in replay["rows"]} == {"none/cpu@default", "cpu/cpu@default"}
    # the step beside plain PyTorch; DeepSpeed's runs skipped with the reason; the big run
    step, big = sorted(by_kind["bench_gpu"], key=lambda r: r["settings"]["checkpointing"])
    cases = {row["case"].split()[-1] for row in step["rows"] if row["metric"] == "s/step"}
    assert cases == {"plain", "none/cpu@default", "cpu/cpu@default"}
    assert step["settings"]["clip"] == 1.0 and step["notes"].count("deepspeed not installed") == 2  # ds2, superoffload
    assert big["settings"]["checkpointing"] and [row["metric"] for row in big["rows"]][0] == "s/step"
    suite = by_kind["gpu_session.suite"][0]["rows"][0]
    assert suite["value"] == suite["peer_value"] == 1 and suite["figures"]["failing"] == []
    summary = (out / "summary.txt").read_text()
    assert summary in output  # also the call's last output
    assert "zenflow    skipped" in summary and "deepspeed not installed" in summary
    # the replay's prediction beside the step's offload runs (not the big run: it checkpoints, the replay does not)
    assert [line.split()[1] for line in summary.splitlines() if "; replay " in line] == ["none/cpu@default", "cpu/cpu@default"]
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = archive.getnames()
    assert {"suite.log", "suite.xml", "sanitizer.log", "host.log", "replay.log", "step.log", "big.log"} <= set(names)


def test_time_box_leaves_the_later_parts_their_time(session):
    assert session.time_box(now=100, deadline=670, cap=240, reserve=330) == 240
    assert session.time_box(now=200, deadline=670, cap=240, reserve=330) == 140
    assert session.time_box(now=400, deadline=670, cap=240, reserve=330) <= 0  # not started


def test_sizes_follow_the_gpu(session):
    h200 = session.sizes_for(False, 139.8, "NVIDIA H200", 16)
    assert (h200.step, h200.big, h200.replay_machine, h200.workers) == ("1.3b", "13b", "h200-pcie5", 12)
    h100 = session.sizes_for(False, 79.6, "NVIDIA H100 80GB HBM3", 16)
    assert (h100.big, h100.replay_machine) == ("7b", "h100-pcie5")
    dry = session.sizes_for(True, None, "", 2)
    assert (dry.step, dry.big, dry.replay_machine, dry.workers) == ("tiny", "tiny", "this-cpu", 0) and "--in-process" in dry.extra


def test_counts_from_a_log_cut_short_and_from_a_report(session):
    log = "\n".join(
        [
            "[gw0] [  1%] PASSED tests/test_a.py::test_one",
            "[gw1] [  2%] FAILED tests/test_a.py::test_two[cpu-1]",
            "tests/test_b.py::test_three SKIPPED (needs a CUDA device)",
            "tests/test_b.py::test_four PASSED",
            "tests/test_b.py::test_four ERROR",  # its teardown failed: counted once, as an error
            "FAILED tests/test_a.py::test_two[cpu-1] - AssertionError",  # the short summary: not counted again
        ]
    )
    counts = session.count_log(log)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["failing"] == ["tests/test_a.py::test_two[cpu-1]", "tests/test_b.py::test_four"]
    report = (
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_one"/>'
        '<testcase classname="tests.test_a" name="test_two"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_three"><skipped/></testcase></testsuite></testsuites>'
    )
    counts = session.count_junit(report)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["failing"]) == (1, 1, 1, ["tests/test_a.py::test_two"])


def test_a_part_past_its_box_is_stopped_and_the_next_one_still_runs(session, tmp_path):
    args = argparse.Namespace(
        dry=True,
        work=str(tmp_path / "work"),
        out=str(tmp_path / "out"),
        deadline=time.time() + 60,
        started=time.time(),
        python=sys.executable,
        deepspeed_status="",
    )
    run = session.Session(args)
    began = time.time()
    run.run(session.Part("slow", ["sleep", "30"], cap=1))
    run.run(session.Part("quick", ["true"], cap=10))
    run.run(session.Part("late", ["true"], cap=10, reserve=59))  # the reserve leaves it no time
    assert time.time() - began < 10
    assert [(p.name, p.status) for p in run.parts] == [
        ("slow", session.Status.STOPPED),
        ("quick", session.Status.DONE),
        ("late", session.Status.SKIPPED),
    ]
    assert "stopped at its box" in (tmp_path / "work" / "logs" / "slow.log").read_text()
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "records.tar"]
