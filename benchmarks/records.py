"""Benchmark results as records: each run of a benchmark writes one JSON file under
benchmarks/results/ that says what was measured, on which code and machine, and every figure.

benchmarks/RESULTS.md is generated from these files (benchmarks/make_results.py), so a figure
is never separated from its commit, date and machine. The schema is below and, for readers
of the folder, in benchmarks/results/README.md.

    recorder = Recorder("bench_step", settings=vars(args))
    recorder.add("GPT-2 124M b4x256 fp32 none/cpu", "s/step", 3.335, peer="plain PyTorch", peer_value=3.236)
    recorder.finish()                       # the file is complete; until then it says so

The file is written again after every `add`, marked `"complete": false` until `finish`, so a
run stopped part way (a GPU lease's time box) keeps what it measured.

Where records go: `OFFLOAD_RESULTS_DIR` when set (the test suite points it at a temporary
folder; `off` writes nothing), else benchmarks/results/. A record names its commit from git;
where the checkout has no .git (a copy of the tree on a lent GPU machine) from
`OFFLOAD_COMMIT`, else "unknown".

Schema (version 1), one JSON object:

| key | meaning |
| --- | --- |
| schema | 1 |
| benchmark | the script (`bench_step`), or a part of gpu_session (`gpu_session.suite`) |
| source | `run` (written by the benchmark) or `imported` (read off earlier prose: the diary) |
| imported_from | for `imported`: where the figures were read (file and section) |
| commit | the commit measured (short hash), "unknown" where it could not be told |
| dirty | whether the tree had uncommitted changes (null: unknown) |
| date | when the run started, UTC, `YYYY-MM-DDTHH:MM:SSZ` |
| machine | `label` (how tables name it), `cpu`, `cores`, `ram_gib`, `gpu` (null: none), `isa` |
| versions | package versions: python, torch, transformers, deepspeed, ... (null: not installed) |
| command | the command line, as run |
| settings | the run's options (the parsed arguments) |
| complete | false while the run is still going (or was stopped before its end) |
| rows | the figures, below |
| notes | free text (what the run found, why a part was skipped) |

A row: `case` (what was measured, with its workload, so that the rows of one benchmark on one
machine are told apart), `metric` (the unit: `s/step`, `Gparam/s`, `GB/s`, `loss`, ...),
`value`, `better` (`lower` or `higher`: which way is better for this metric), optionally
`peer` (what offload is compared with) and `peer_value` (the peer's figure in the same run and
unit), `ratio` (when the benchmark computes its own comparison, such as a median of per-round
ratios; in the same sense as `ahead`) and `figures` (every other number of the row: the
breakdown, each round, bytes per tier).

`ahead(row)`: how many times better than its peer the row is, >1 when offload is ahead:
peer / value for `lower`, value / peer for `higher`, or the row's own `ratio`.
"""

from __future__ import annotations

import datetime
import enum
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload.errors import OffloadError  # noqa: E402

SCHEMA = 1
BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
RESULTS = os.path.join(BENCHMARKS, "results")
ENV_DIR = "OFFLOAD_RESULTS_DIR"
ENV_COMMIT = "OFFLOAD_COMMIT"
# the packages whose versions a record keeps (None where not installed)
PACKAGES = ("torch", "transformers", "deepspeed", "accelerate", "bitsandbytes", "offload")


class Source(enum.Enum):
    """Where a record's figures come from."""

    RUN = "run"  # written by the benchmark as it ran
    IMPORTED = "imported"  # read off earlier prose (the diary, benchmarks/results/history.md) by hand


class Better(enum.Enum):
    """Which way a metric is better."""

    LOWER = "lower"
    HIGHER = "higher"


class RecordError(OffloadError, ValueError):
    """A record that does not follow the schema; the message names the file and the key."""


# ---- what a record says about its run -------------------------------------------------------
def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def current_commit() -> tuple[str, bool | None]:
    """(short commit, whether the tree has uncommitted changes) of the checkout the benchmarks
    run from; without git there, `OFFLOAD_COMMIT` (dirty unknown), else ("unknown", None)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, timeout=10
            )
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
            return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(ENV_COMMIT, "").strip() or "unknown", None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _isa() -> str:
    """The widest vector instruction set the CPU reports (what the C++ kernels dispatch on)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "portable"


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpu_name() -> str | None:
    """The first CUDA device's name: through torch when it is already imported, else
    nvidia-smi; None without one."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return str(torch.cuda.get_device_name(0))
        except Exception:  # noqa: BLE001 - a broken CUDA setup: ask nvidia-smi instead
            pass
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = smi.stdout.strip().splitlines() if smi.returncode == 0 else []
    return names[0].strip() if names else None


def machine_label(cpu: str, cores: int, isa: str, gpu: str | None) -> str:
    """How tables name a machine: its GPU and host, or its host with no GPU."""
    host = f"{cores}-core {cpu} ({isa})"
    return f"{gpu}, {host}" if gpu else f"{host}, no GPU"


def probe_machine() -> dict[str, Any]:
    cpu, cores, isa, gpu = _cpu_model(), os.cpu_count() or 1, _isa(), _gpu_name()
    return {
        "label": machine_label(cpu, cores, isa, gpu),
        "cpu": cpu,
        "cores": cores,
        "ram_gib": _ram_gib(),
        "gpu": gpu,
        "isa": isa,
    }


def probe_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)  # the one imported (a local build may lack metadata)
    return versions


def results_dir() -> str | None:
    """Where records are written: `OFFLOAD_RESULTS_DIR` (None for `off`), else benchmarks/results."""
    chosen = os.environ.get(ENV_DIR, "").strip()
    if chosen.lower() == "off":
        return None
    return chosen or RESULTS


# ---- rows -------------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def ahead(row: Mapping[str, Any]) -> float | None:
    """How many times better than its peer `row` is (>1: offload ahead): its own `ratio` when it
    has one, else peer / value for a metric where lower is better and value / peer where higher
    is; None without a peer figure (or a zero to divide by)."""
    if row.get("ratio") is not None:
        return float(row["ratio"])
    value, peer = row.get("value"), row.get("peer_value")
    if not _number(value) or not _number(peer):
        return None
    if row.get("better") == Better.LOWER.value:
        return peer / value if value else None
    return value / peer if peer else None


def make_row(
    case: str,
    metric: str,
    value: float,
    *,
    better: Better | str = Better.LOWER,
    peer: str | None = None,
    peer_value: float | None = None,
    ratio: float | None = None,
    figures: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A row as the schema has it (validated: `validate_row`)."""
    row: dict[str, Any] = {
        "case": case,
        "metric": metric,
        "value": value,
        "better": Better(better).value,
        "peer": peer,
        "peer_value": peer_value,
        "ratio": ratio,
        "figures": dict(figures or {}),
    }
    validate_row(row, "a new row")
    return row


# ---- validation -------------------------------------------------------------------------------
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
_TOP = {
    "schema": int,
    "benchmark": str,
    "source": str,
    "commit": str,
    "date": str,
    "machine": dict,
    "versions": dict,
    "command": str,
    "settings": dict,
    "complete": bool,
    "rows": list,
    "notes": str,
}
_OPTIONAL_TOP = {"imported_from": str, "dirty": (bool, type(None))}
_ROW = {"case", "metric", "value", "better", "peer", "peer_value", "ratio", "figures"}


def _fail(where: str, key: str, what: str) -> RecordError:
    return RecordError(f"{where}: `{key}` {what}")


def validate_row(row: Any, where: str, index: int | None = None) -> None:
    at = "rows" if index is None else f"rows[{index}]"
    if not isinstance(row, dict):
        raise _fail(where, at, f"must be an object, got {type(row).__name__}")
    unknown = sorted(set(row) - _ROW)
    if unknown:
        raise _fail(where, f"{at}.{unknown[0]}", f"is not a row key (known: {', '.join(sorted(_ROW))})")
    missing = sorted(_ROW - set(row))
    if missing:
        raise _fail(where, f"{at}.{missing[0]}", "is missing")
    for key in ("case", "metric"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise _fail(where, f"{at}.{key}", "must be a non-empty string")
    if not _number(row["value"]):
        raise _fail(where, f"{at}.value", f"must be a finite number, got {row['value']!r}")
    if row["better"] not in {b.value for b in Better}:
        raise _fail(where, f"{at}.better", f"must be one of {', '.join(b.value for b in Better)}, got {row['better']!r}")
    if row["peer"] is not None and not isinstance(row["peer"], str):
        raise _fail(where, f"{at}.peer", "must be a string or null")
    for key in ("peer_value", "ratio"):
        if row[key] is not None and not _number(row[key]):
            raise _fail(where, f"{at}.{key}", f"must be a finite number or null, got {row[key]!r}")
    if row["peer_value"] is not None and row["peer"] is None:
        raise _fail(where, f"{at}.peer", "must name the peer whose figure peer_value is")
    if not isinstance(row["figures"], dict):
        raise _fail(where, f"{at}.figures", "must be an object")


def validate(record: Any, where: str) -> None:
    """Raises RecordError naming `where` (the file) and the key when `record` breaks the schema."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    known = set(_TOP) | set(_OPTIONAL_TOP)
    unknown = sorted(set(record) - known)
    if unknown:
        raise _fail(where, unknown[0], f"is not a record key (known: {', '.join(sorted(known))})")
    for key, kind in _TOP.items():
        if key not in record:
            raise _fail(where, key, "is missing")
        if not isinstance(record[key], kind) or (kind is int and isinstance(record[key], bool)):
            raise _fail(where, key, f"must be of type {kind.__name__}, got {type(record[key]).__name__}")
    for key, kinds in _OPTIONAL_TOP.items():
        if key in record and not isinstance(record[key], kinds):
            raise _fail(where, key, f"has the wrong type ({type(record[key]).__name__})")
    if record["schema"] != SCHEMA:
        raise _fail(where, "schema", f"is {record['schema']}; this reader knows version {SCHEMA}")
    if record["source"] not in {s.value for s in Source}:
        raise _fail(where, "source", f"must be one of {', '.join(s.value for s in Source)}, got {record['source']!r}")
    if record["source"] == Source.IMPORTED.value and not record.get("imported_from"):
        raise _fail(where, "imported_from", "must say where an imported record's figures were read")
    if not _DATE.match(record["date"]):
        raise _fail(where, "date", f"must be UTC as YYYY-MM-DDTHH:MM:SSZ, got {record['date']!r}")
    if not record["commit"].strip():
        raise _fail(where, "commit", 'must not be empty ("unknown" where it cannot be told)')
    label = record["machine"].get("label")
    if not isinstance(label, str) or not label.strip():
        raise _fail(where, "machine.label", "must name the machine")
    for index, row in enumerate(record["rows"]):
        validate_row(row, where, index)


def load(path: str) -> dict[str, Any]:
    """The record in `path`, validated (RecordError names the file)."""
    try:
        with open(path) as handle:
            record = json.load(handle)
    except json.JSONDecodeError as error:
        raise RecordError(f"{path}: not valid JSON ({error})") from error
    validate(record, path)
    return record


def load_all(directory: str = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of every *.json in `directory`, by name."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json")) if os.path.isdir(directory) else []
    return [(name, load(os.path.join(directory, name))) for name in names]


# ---- writing ----------------------------------------------------------------------------------
def file_name(benchmark: str, date: str, commit: str, tag: str = "") -> str:
    """`<date>-<benchmark>-<commit>[-<tag>].json`, the date as 20261127T133512Z (names sort by date)."""
    stamp = date.replace("-", "").replace(":", "")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{benchmark}-{commit}" + (f"-{tag}" if tag else ""))
    return f"{stamp}-{safe}.json"


def _plain(value: Any) -> Any:
    """JSON-ready: numbers, strings, lists and dicts of them; anything else as its str()."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    return str(value)


class Recorder:
    """One run's record, written to its file after every row (see the module docstring).

    `benchmark`: the script's name; `settings`: its options; `command`: the command line
    (default: this process's); `directory`: where to write (default: `results_dir()`; None
    there writes nothing); `tag`: added to the file name (a run with several records)."""

    def __init__(
        self,
        benchmark: str,
        settings: Mapping[str, Any] | None = None,
        *,
        command: str | None = None,
        directory: str | None = "",
        tag: str = "",
    ) -> None:
        commit, dirty = current_commit()
        self.record: dict[str, Any] = {
            "schema": SCHEMA,
            "benchmark": benchmark,
            "source": Source.RUN.value,
            "commit": commit,
            "dirty": dirty,
            "date": utc_now(),
            "machine": probe_machine(),
            "versions": probe_versions(),
            "command": command if command is not None else shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
            "settings": _plain(dict(settings or {})),
            "complete": False,
            "rows": [],
            "notes": "",
        }
        chosen = results_dir() if directory == "" else directory
        self.path = os.path.join(chosen, file_name(benchmark, self.record["date"], commit, tag)) if chosen else None

    def add(self, case: str, metric: str, value: float, **row: Any) -> dict[str, Any]:
        """Adds a row (`make_row`'s arguments) and writes the file."""
        made = make_row(case, metric, value, **row)
        made["figures"] = _plain(made["figures"])
        self.record["rows"].append(made)
        self.write()
        return made

    def note(self, text: str) -> None:
        self.record["notes"] = (self.record["notes"] + "\n" + text).strip()
        self.write()

    def update_machine(self, **fields: Any) -> None:
        """Fields the benchmark knows better than the probe (the device it really ran on)."""
        self.record["machine"].update(_plain(fields))
        self.write()

    def finish(self) -> str | None:
        """Marks the record complete and writes it; returns its path (None: not written)."""
        self.record["complete"] = True
        self.write()
        return self.path

    def write(self) -> None:
        if self.path is None:
            return
        validate(self.record, self.path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        partial = f"{self.path}.tmp"
        with open(partial, "w") as handle:
            json.dump(self.record, handle, indent=1, sort_keys=False)
            handle.write("\n")
        os.replace(partial, self.path)  # a reader never sees half a file
