"""The one call of a lent GPU machine (`bash benchmarks/gpu_session.sh`, its default phase): the
parts, run in parallel where the machine allows, each in its time box, everything kept.

gpu_session.sh installs the project and starts DeepSpeed's install and op builds in the
background, then runs this with the call's deadline. Stages, in order (`plan`):

1. quiet (alone, before anything loads the host): the host's own time per unit per step
   (`bench_pipeline.py --measure-host`), which the replay below takes for this host.
2. host (in parallel, CPU work and small GPU work, no timing that the others could spoil):
   - suite: the whole suite on CUDA, on `--workers` pytest-xdist workers (each worker its own
     process and CUDA context on the one GPU: the tests' models are small, the GPU's memory
     far larger than the workers' need; the engine's `auto` placements read the free memory
     at their start, which the other workers move, so a test failing only here is suspect of
     that), with a JUnit report; the counts and the failing tests go to its record;
   - sanitizer: the CUDA tests (test_cuda.py, test_compact_state.py) under PyTorch's CUDA
     stream sanitizer (TORCH_CUDA_SANITIZER=1: a kernel touching memory another stream uses
     without an event between them is reported);
   - replay: the placement `offload estimate` recommends here for the big model, then
     bench_pipeline's prediction of the 1.35B step (none/cpu, cpu/cpu) and of the big model's
     at this host's time per unit, to print beside what stage 3 measures.
3. step (one after another, nothing else running: these are the timings):
   - bench_gpu at 1.35B, bf16, clipping 1.0: plain PyTorch, offload none/cpu and cpu/cpu at
     the engine's own schedule, DeepSpeed ZeRO-Offload and SuperOffload (each run its own
     process and time box; DeepSpeed's runs wait for its install and op builds);
   - bench_gpu at the big size (13B where the GPU has 120 GiB or more, else 7B), batch 4,
     checkpointing, in the recommended placement;
   - ZenFlow at 1.35B if time is left (its losses beside plain PyTorch's: it is not exact).

Each part writes its log under WORK/logs and its record (benchmarks/records.py) under
WORK/results; after every part both are packed into OUT (records.tar, logs.tar.gz) beside
summary.txt, so that the three files the device tool brings back always hold what was done,
however the call ends. `--dry` runs the same plan on this CPU with tiny sizes and without
DeepSpeed (its parts recorded as skipped, with the reason): tests/test_gpu_session.py runs it,
so that the script cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
sys.path.insert(0, BENCHMARKS)

from records import Recorder, load_all  # noqa: E402

# the CUDA tests the sanitizer runs (the host-only kernel tests did not finish under it in 120 s)
SANITIZER_TESTS = ("tests/test_cuda.py", "tests/test_compact_state.py")
# the dry run's stand-in for the suite: one fast test (not the suite itself, which runs this)
DRY_TESTS = ("tests/test_results_records.py::test_ahead_is_how_many_times_better_than_the_peer",)
BIG_GPU_GIB = 120  # a GPU with this much memory or more runs the 13B step, a smaller one 7B


class Status(enum.Enum):
    """How a part ended."""

    DONE = "done"  # exit 0
    FAILED = "failed"  # a non-zero exit (tests failing included)
    STOPPED = "stopped"  # at its time box or the deadline; what it wrote is kept
    SKIPPED = "skipped"  # never started: no time left, or what it needs is absent


@dataclasses.dataclass
class Part:
    """One command of the session: `cap` seconds at most, and never past the deadline less
    `reserve` (the time the parts after it are owed)."""

    name: str
    command: list[str]
    cap: float
    reserve: float = 0.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    needs: str | None = None  # a requirement checked when the part is due (`Session.ready`)
    deadline_less: float | None = None  # pass `--deadline` (the session's, less this) to the command
    status: Status | None = None
    seconds: float = 0.0
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workloads of a session: the real ones on a GPU, tiny ones for the dry run."""

    step: str  # bench_gpu's size for the step beside DeepSpeed
    big: str  # the big model's
    batch: int
    seq: int
    big_batch: int
    steps: int
    extra: tuple[str, ...]  # more bench_gpu arguments (the dry run's in-process, small limits)
    replay_machine: str
    workers: int  # pytest-xdist workers for the suite (0: none)


def sizes_for(dry: bool, gpu_gib: float | None, gpu_name: str, cores: int) -> Sizes:
    """The session's workloads: 1.35B at 8 x 1024, and 13B (a GPU of BIG_GPU_GIB or more) or 7B at
    4 x 1024 with the replay's preset for the GPU; tiny ones on the CPU for the dry run."""
    if dry:
        extra = ("--in-process", "--limits-elements", str(1 << 20))
        return Sizes("tiny", "tiny", 2, 32, 2, 1, extra, "this-cpu", 0)
    big = "13b" if (gpu_gib or 0) >= BIG_GPU_GIB else "7b"
    machine = "h200-pcie5" if "H200" in gpu_name.upper() else "h100-pcie5"
    return Sizes("1.3b", big, 8, 1024, 4, 5, (), machine, max(2, cores - 4))


def time_box(now: float, deadline: float, cap: float, reserve: float) -> float:
    """Seconds a part may run from `now`: its cap, cut to what the deadline leaves once the
    parts after it have their `reserve`; 0 or less: it is not started."""
    return min(cap, deadline - reserve - now)


# ---- test reports -------------------------------------------------------------------------------
OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
NODE = re.compile(r"(tests/\S+?\.py::\S+)")


def count_junit(text: str) -> dict:
    """Counts and failing test ids from a JUnit XML report (pytest's --junitxml)."""
    root = ElementTree.fromstring(text)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    for case in root.iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failing"].append(node)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failing"].append(node)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def count_log(text: str) -> dict:
    """Counts and failing test ids from a `pytest -v` log, for a run stopped before its report:
    each test's line (`[gw3] [ 12%] PASSED tests/x.py::t` under xdist, `tests/x.py::t PASSED`
    without), a test counted once (its last outcome: an error in teardown after a pass)."""
    outcome: dict[str, str] = {}
    for line in text.splitlines():
        found, node = OUTCOME.search(line), NODE.search(line)
        if found and node and not line.startswith(("FAILED ", "ERROR ")):  # not the short summary's lines
            outcome[node.group(1)] = found.group(1)
    kinds = {
        "PASSED": "passed",
        "XPASS": "passed",
        "FAILED": "failed",
        "ERROR": "errors",
        "SKIPPED": "skipped",
        "XFAIL": "skipped",
    }
    counts: dict = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for result in outcome.values():
        counts[kinds[result]] += 1
    counts["failing"] = sorted(node for node, result in outcome.items() if result in ("FAILED", "ERROR"))
    return counts


# ---- the session --------------------------------------------------------------------------------
class Session:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = os.path.abspath(args.work)
        self.logs = os.path.join(self.work, "logs")
        self.results = os.path.join(self.work, "results")
        for folder in (self.logs, self.results, args.out):
            os.makedirs(folder, exist_ok=True)
        self.deadline = args.deadline
        self.python = args.python
        self.parts: list[Part] = []
        self.summary: list[str] = []
        self.env = {**os.environ, "OFFLOAD_RESULTS_DIR": self.results, "PYTHONUNBUFFERED": "1"}
        self.gpu_name, self.gpu_gib = gpu_info(args.dry)
        self.sizes = sizes_for(args.dry, self.gpu_gib, self.gpu_name, os.cpu_count() or 1)
        self.placement: str | None = None
        self.host_unit_ms: float | None = None
        self.ram_gib = available_ram_gib()  # before the suite takes its share: what the big run will have

    # ---- running parts ----
    def ready(self, part: Part) -> str:
        """Why `part` cannot run now ("" when it can)."""
        if part.needs == "deepspeed":
            return self.deepspeed_ready(patience=time_box(time.time(), self.deadline, part.cap, part.reserve) - 30)
        if part.needs == "placement" and not self.placement:
            return "no placement: offload estimate recommended none, or its part did not finish"
        return ""

    def deepspeed_ready(self, patience: float) -> str:
        """ "" once DeepSpeed can run: gpu_session.sh's background install and op builds ended
        well (waited for up to `patience` seconds), or, without them, the module is there;
        else why not."""
        status = self.args.deepspeed_status
        if not status:
            if importlib.util.find_spec("deepspeed") is None:
                return "deepspeed not installed here (no peers folder given, and no module named deepspeed)"
            return ""
        end = time.time() + patience
        while not os.path.exists(status) and time.time() < end:
            time.sleep(2)
        if not os.path.exists(status):
            return "DeepSpeed's install and op builds had not finished"
        with open(status) as handle:
            code = handle.read().strip()
        return "" if code == "0" else f"DeepSpeed's install or op build failed (exit {code}; logs/deepspeed.log)"

    def start(self, part: Part) -> subprocess.Popen | None:
        why = self.ready(part)
        box = time_box(time.time(), self.deadline, part.cap, part.reserve)
        if not why and box < min(5.0, part.cap):
            why = f"no time left ({max(0.0, box):.0f} s of its box)"
        if why:
            part.status, part.reason = Status.SKIPPED, why
            self.log(part, f"skipped: {why}\n")
            return None
        part.seconds = box  # until it ends: its box
        if part.deadline_less is not None:
            part.command = [*part.command, "--deadline", f"{self.deadline - part.deadline_less:.0f}"]
        log = open(os.path.join(self.logs, f"{part.name}.log"), "w")
        log.write(f"$ {shlex.join(part.command)}\n")
        log.flush()
        print(f"[{self.elapsed():4.0f} s] {part.name}: started, box {box:.0f} s", flush=True)
        process = subprocess.Popen(
            part.command, cwd=REPO, env={**self.env, **part.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        process.began, process.box, process.log = time.time(), box, log  # type: ignore[attr-defined]
        return process

    def finish(self, part: Part, process: subprocess.Popen, stopped: bool) -> None:
        if stopped:
            with contextlib.suppress(ProcessLookupError):  # its whole group: the workers it started too
                os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
        part.seconds = time.time() - process.began  # type: ignore[attr-defined]
        process.log.write(f"\n[exit {code} after {part.seconds:.0f} s{', stopped at its box' if stopped else ''}]\n")  # type: ignore[attr-defined]
        process.log.close()  # type: ignore[attr-defined]
        part.status = Status.STOPPED if stopped else (Status.DONE if code == 0 else Status.FAILED)
        part.reason = "" if code == 0 else f"exit {code}"
        print(f"[{self.elapsed():4.0f} s] {part.name}: {part.status.value} after {part.seconds:.0f} s", flush=True)
        self.after(part)
        self.pack()

    def run_parallel(self, parts: list[Part]) -> None:
        """Starts `parts` together and waits for each, stopping it at its box."""
        running = [(part, self.start(part)) for part in parts]
        running = [(part, process) for part, process in running if process is not None]
        for part in parts:
            if part.status is Status.SKIPPED:
                self.after(part)
        while running:
            time.sleep(0.2)
            for part, process in list(running):
                over = time.time() - process.began > process.box  # type: ignore[attr-defined]
                if process.poll() is not None or over:
                    self.finish(part, process, stopped=process.poll() is None)
                    running.remove((part, process))
        self.pack()

    def run(self, part: Part) -> None:
        self.parts.append(part)
        self.run_parallel([part])

    def elapsed(self) -> float:
        return time.time() - self.args.started

    def log(self, part: Part, text: str) -> None:
        with open(os.path.join(self.logs, f"{part.name}.log"), "a") as handle:
            handle.write(text)

    def read_log(self, name: str) -> str:
        try:
            with open(os.path.join(self.logs, f"{name}.log")) as handle:
                return handle.read()
        except FileNotFoundError:
            return ""

    # ---- what each part leaves ----
    def after(self, part: Part) -> None:
        handler: Callable[[Part], None] | None = getattr(self, f"after_{part.name.split('-')[0]}", None)
        if handler is not None:
            handler(part)

    def after_host(self, part: Part) -> None:
        found = re.search(r"--host-unit-ms ([0-9.]+)", self.read_log(part.name))
        self.host_unit_ms = float(found.group(1)) if found else None

    def after_recommend(self, part: Part) -> None:
        for line in reversed(self.read_log(part.name).splitlines()):
            if line.startswith("{"):
                chosen = json.loads(line)
                self.placement = f"{chosen['param']}/{chosen['optimizer']}" if chosen.get("param") else None
                return

    def after_suite(self, part: Part) -> None:
        self.test_record(part, "gpu_session.suite", "the whole suite" if not self.args.dry else "the dry run's test")

    def after_sanitizer(self, part: Part) -> None:
        self.test_record(part, "gpu_session.sanitizer", "the CUDA tests under TORCH_CUDA_SANITIZER")

    def test_record(self, part: Part, benchmark: str, what: str) -> None:
        """The part's counts (its JUnit report, else its log) as a record."""
        report = os.path.join(self.logs, f"{part.name}.xml")
        if os.path.exists(report) and part.status is not Status.STOPPED:
            with open(report) as handle:
                counts = count_junit(handle.read())
        else:
            counts = count_log(self.read_log(part.name))
        recorder = Recorder(benchmark, {"tests": part.command}, command=shlex.join(part.command), directory=self.results)
        run = sum(counts[k] for k in ("passed", "failed", "errors"))
        device = "the CPU (dry run)" if self.args.dry else "CUDA"
        recorder.add(
            f"{what} on {device}",
            "tests passed",
            counts["passed"],
            better="higher",
            peer="tests run",
            peer_value=run,
            figures={**counts, "seconds": part.seconds, "status": part.status.value if part.status else None},
        )
        if part.status is not Status.DONE:
            recorder.note(f"{part.status.value if part.status else 'not run'}: {part.reason or 'see its log'}")
        recorder.finish()
        part.reason = part.reason or f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors"
        self.summary.append(
            f"{part.name}: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped ({part.status.value if part.status else '?'}, {part.seconds:.0f} s)"
        )
        self.summary += [f"    {node}" for node in counts["failing"][:40]]

    # ---- the plan ----
    def plan(self) -> None:
        s, py = self.sizes, self.python
        bench = [py, "benchmarks/bench_gpu.py"]
        pipeline = [py, "benchmarks/bench_pipeline.py"]
        big_run = ["--size", s.big, "--batch", str(s.big_batch), "--seq", str(s.seq), "--checkpointing", "--steps", str(s.steps)]
        # stage 1: alone
        host = ["--host-layers", "4", "--host-steps", "2"] if self.args.dry else []
        self.run(Part("host", [*pipeline, "--measure-host", *host], cap=90, reserve=420))
        # stage 2: together
        tests = list(DRY_TESTS) if self.args.dry else ["tests"]
        workers = ["-n", str(s.workers)] if s.workers else []
        suite = Part(
            "suite",
            [py, "-m", "pytest", *tests, "-v", "-p", "no:cacheprovider", *workers, f"--junitxml={self.logs}/suite.xml"],
            cap=240,
            reserve=330,
        )
        sanitized = list(DRY_TESTS) if self.args.dry else list(SANITIZER_TESTS)
        sanitizer = Part(
            "sanitizer",
            [py, "-m", "pytest", *sanitized, "-v", "-p", "no:cacheprovider", f"--junitxml={self.logs}/sanitizer.xml"],
            cap=240,
            reserve=330,
            env={"TORCH_CUDA_SANITIZER": "1"},
        )
        ram = ["--ram", f"{self.ram_gib:.0f}GiB"] if self.ram_gib else []
        recommend = Part("recommend", [*bench, *big_run, "--recommend", "--nvme-path", self.work, *ram], cap=60, reserve=330)
        self.parts += [suite, sanitizer, recommend]
        self.run_parallel_with_replay(suite, sanitizer, recommend)
        # stage 3: alone, one after another
        step = ["--size", s.step, "--batch", str(s.batch), "--seq", str(s.seq), "--steps", str(s.steps), "--clip", "1.0"]
        common = ["--nvme-path", self.work, "--min-run", "20" if self.args.dry else "45", *s.extra]
        # the step beside DeepSpeed: what the issue asks for first, cpu/cpu last (cut first)
        runs = "plain,none/cpu,ds2,superoffload,cpu/cpu"
        self.deepspeed_ready(patience=30)  # its runs are next but two: a little time for its builds
        step_part = Part("step", [*bench, *step, "--runs", runs, "--run-timeout", "150", *common], cap=400, reserve=130)
        step_part.deadline_less = step_part.reserve
        self.run(step_part)
        big = Part(
            "big", [*bench, *big_run, "--runs", self.placement or "", *common], cap=300, needs="placement", deadline_less=0
        )
        self.run(big)
        zenflow = Part("zenflow", [*bench, *step, "--runs", "zenflow", *common], cap=120, needs="deepspeed", deadline_less=0)
        self.run(zenflow)

    def run_parallel_with_replay(self, suite: Part, sanitizer: Part, recommend: Part) -> None:
        """Stage 2: the suite and the sanitizer run while the recommendation, then the replay, run
        beside them (the replay needs the recommended placement and this host's time)."""
        started = [(part, self.start(part)) for part in (suite, sanitizer, recommend)]
        running = [(part, process) for part, process in started if process is not None]
        for part, process in started:
            if process is None:
                self.after(part)
        replay: Part | None = None
        while running:
            time.sleep(0.2)
            for part, process in list(running):
                over = time.time() - process.began > process.box  # type: ignore[attr-defined]
                if process.poll() is None and not over:
                    continue
                self.finish(part, process, stopped=process.poll() is None)
                running.remove((part, process))
                if part is recommend:
                    replay = self.replay_part()
                    self.parts.append(replay)
                    launched = self.start(replay)
                    if launched is not None:
                        running.append((replay, launched))
                    else:
                        self.after(replay)
        if replay is None:
            replay = Part("replay", [], cap=0)
            replay.status, replay.reason = Status.SKIPPED, "the recommendation did not finish"
            self.parts.append(replay)

    def replay_part(self) -> Part:
        s = self.sizes
        placements = ["none/cpu", "cpu/cpu"]
        command = [self.python, "benchmarks/bench_pipeline.py", "--machine", s.replay_machine, "--batch", str(s.batch)]
        command += ["--seq", str(s.seq), "--sizes", s.step, "--placements", ",".join(placements), "--nvme-path", self.work]
        if self.host_unit_ms is not None:
            command += ["--host-unit-ms", f"{self.host_unit_ms:.4f}"]
        return Part("replay", command, cap=150, reserve=330)

    # ---- the end ----
    def pack(self) -> None:
        """records.tar and logs.tar.gz in OUT, replaced whole (a reader never sees half)."""
        for name, folder, mode in (("records.tar", self.results, "w"), ("logs.tar.gz", self.logs, "w:gz")):
            partial = os.path.join(self.args.out, f".{name}")
            with tarfile.open(partial, mode) as archive:
                for file in sorted(os.listdir(folder)):
                    archive.add(os.path.join(folder, file), arcname=file)
            os.replace(partial, os.path.join(self.args.out, name))

    def write_summary(self) -> str:
        lines = [
            f"gpu_session {'--dry ' if self.args.dry else ''}on {self.gpu_name or 'no GPU'}: {self.elapsed():.0f} s of "
            f"{self.deadline - self.args.started:.0f}; commit {os.environ.get('OFFLOAD_COMMIT') or 'from git'}",
            f"big model: {self.sizes.big}, placement {self.placement or '-'}; host's own time per unit "
            f"{self.host_unit_ms if self.host_unit_ms is not None else '-'} ms",
            "",
            "parts:",
        ]
        for part in self.parts:
            lines.append(
                f"  {part.name:<10} {part.status.value if part.status else 'not run':<8} {part.seconds:5.0f} s  {part.reason}"
            )
        lines += ["", *self.summary, "", *measured_beside_predicted(self.results)]
        text = "\n".join(lines) + "\n"
        partial = os.path.join(self.args.out, ".summary.txt")
        with open(partial, "w") as handle:
            handle.write(text)
        os.replace(partial, os.path.join(self.args.out, "summary.txt"))
        return text


def measured_beside_predicted(folder: str) -> list[str]:
    """bench_gpu's offload rows beside bench_pipeline's prediction of the same size, batch and
    placement (the replay's figure printed next to the GPU's), and each run's losses."""
    records = [record for _, record in load_all(folder)]
    predicted: dict[tuple[str, str, str], float] = {}  # (size, bBATCHxSEQ, placement): s/step
    for record in records:
        if record["benchmark"] == "bench_pipeline":
            for row in record["rows"]:
                found = re.match(r"^(\S+) (b\d+x\d+) (\S+?)@", row["case"])
                if found and row["metric"] == "s/step (predicted)":
                    predicted[found.groups()] = row["value"]
    lines = ["step (s/step; x peer: >1 offload ahead; replay: bench_pipeline's prediction here):"]
    for record in records:
        if record["benchmark"] != "bench_gpu":
            continue
        settings = record["settings"]
        size = settings.get("size", "")
        label = size + (f" b{settings.get('batch')} checkpointing" if settings.get("checkpointing") else "")
        for row in record["rows"]:
            if row["metric"] != "s/step":
                continue
            run = row["case"].split()[-1]
            placement = run.split("@")[0]
            ratio = f" x{(row['peer_value'] / row['value']):.2f} vs {row['peer']}" if row.get("peer_value") else ""
            # the replay models no activation checkpointing: no prediction for such a run
            workload = "" if settings.get("checkpointing") else f"b{settings.get('batch')}x{settings.get('seq')}"
            guess = predicted.get((size, workload, placement))
            beside = f"; replay {guess:.3f} ({guess / row['value']:.2f}x the measured)" if guess and "/" in placement else ""
            lines.append(f"  {label} {run:<22} {row['value']:.3f}{ratio}{beside}")
        for row in record["rows"]:
            losses = row["figures"].get("losses")
            if losses and row.get("peer") in (None, "plain PyTorch"):
                lines.append(f"  losses {label} {row['case'].split()[-1]}: " + " ".join(f"{v:.4f}" for v in losses))
        if record["notes"]:
            lines += [f"  {label}: {note}" for note in record["notes"].splitlines()]
    return lines


def available_ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def gpu_info(dry: bool) -> tuple[str, float | None]:
    """The GPU's name and memory in GiB (nvidia-smi); ("", None) without one or in the dry run."""
    if dry:
        return "", None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        name, mib = smi.stdout.strip().splitlines()[0].rsplit(",", 1)
        return name.strip(), float(mib) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return "", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="tiny sizes on this CPU, no DeepSpeed: the plan end to end")
    parser.add_argument("--deadline", type=float, required=True, help="seconds since the epoch by which everything ends")
    parser.add_argument("--started", type=float, default=None, help="when the call began (default: now)")
    parser.add_argument("--out", required=True, help="the folder the call's files come back from (records, logs, summary)")
    parser.add_argument("--work", default="/tmp/gpu-session", help="logs and records as they are written")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument(
        "--deepspeed-status", default="", help="the file gpu_session.sh writes the DeepSpeed build's exit code to"
    )
    args = parser.parse_args(argv)
    args.started = args.started or time.time()
    session = Session(args)
    try:
        session.plan()
    finally:
        session.pack()
        text = session.write_summary()
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
