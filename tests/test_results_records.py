"""Benchmark results as records (benchmarks/records.py) and RESULTS.md generated from them
(benchmarks/make_results.py): the committed RESULTS.md is what the committed records give, every
record follows the schema, a run's record is written as it goes, and the current tables keep
the newest row of each case, peer and machine."""

from __future__ import annotations

import copy
import json
import os

import pytest
from bench_script import BENCHMARKS
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.host_only


@pytest.fixture(scope="module")
def records_module():
    import sys

    sys.path.insert(0, BENCHMARKS)
    import make_results
    import records

    yield records, make_results


def test_results_md_is_generated_from_the_committed_records(records_module):
    """Stale = fail: a record added (or RESULTS.md edited by hand) without regenerating."""
    records, make_results = records_module
    expected = make_results.render(records.load_all())
    with open(make_results.OUTPUT) as handle:
        assert handle.read() == expected, "benchmarks/RESULTS.md is stale: run python benchmarks/make_results.py"


def test_every_committed_record_follows_the_schema_and_names_its_origin(records_module):
    records, _ = records_module
    loaded = records.load_all()
    assert loaded, "no records in benchmarks/results"
    for name, record in loaded:
        assert name.endswith(".json") and record["commit"] in name, name
        if record["source"] == records.Source.IMPORTED.value:
            assert record["imported_from"], name
    # the GPU evidence the diary held is among them (the H100 runs)
    assert any(record["machine"]["gpu"] for _, record in loaded)


def test_a_run_writes_its_record_as_it_goes(records_module, tmp_path):
    records, _ = records_module
    recorder = records.Recorder("bench_demo", {"steps": 3}, command="bench_demo --steps 3", directory=str(tmp_path))
    assert recorder.path is not None and not os.path.exists(recorder.path)
    recorder.add("tiny none/cpu", "s/step", 0.5, peer="plain PyTorch", peer_value=0.4, figures={"forward": 0.1})
    partial = json.loads(open(recorder.path).read())
    assert partial["complete"] is False and len(partial["rows"]) == 1
    recorder.add("tiny cpu/cpu", "s/step", 0.6)
    assert recorder.finish() == recorder.path
    record = records.load(recorder.path)
    assert record["complete"] is True and [row["case"] for row in record["rows"]] == ["tiny none/cpu", "tiny cpu/cpu"]
    assert record["settings"] == {"steps": 3} and record["source"] == "run"
    assert record["commit"] == records.current_commit()[0] != ""
    assert record["machine"]["label"] and record["machine"]["cores"] == os.cpu_count()
    assert record["versions"]["python"] and "torch" in record["versions"]
    assert os.listdir(tmp_path) == [os.path.basename(recorder.path)]  # no temporary file left


def test_records_go_where_the_environment_says(records_module, tmp_path, monkeypatch):
    records, _ = records_module
    monkeypatch.setenv(records.ENV_DIR, "off")
    assert records.Recorder("bench_demo", command="x").path is None
    monkeypatch.setenv(records.ENV_DIR, str(tmp_path))
    assert os.path.dirname(records.Recorder("bench_demo", command="x").path) == str(tmp_path)


def a_record(records, **changes):
    record = {
        "schema": 1,
        "benchmark": "bench_demo",
        "source": "run",
        "commit": "abc1234",
        "dirty": False,
        "date": "2026-11-28T09:00:00Z",
        "machine": {"label": "m", "cpu": "c", "cores": 2, "ram_gib": 1.0, "gpu": None, "isa": "avx2"},
        "versions": {"python": "3.12"},
        "command": "bench_demo",
        "settings": {},
        "complete": True,
        "rows": [records.make_row("tiny", "s/step", 1.0)],
        "notes": "",
    }
    record.update(changes)
    return record


@pytest.mark.parametrize(
    "change, key",
    [
        ({"schema": 2}, "schema"),
        ({"date": "2026-11-28 09:00"}, "date"),
        ({"source": "diary"}, "source"),
        ({"source": "imported"}, "imported_from"),
        ({"colour": "red"}, "colour"),
        ({"machine": {"cpu": "c"}}, "machine.label"),
        ({"rows": [{"case": "tiny", "metric": "s/step", "value": float("nan")}]}, "rows[0]"),
    ],
)
def test_a_broken_record_is_refused_naming_the_file_and_key(records_module, change, key):
    records, _ = records_module
    records.validate(a_record(records), "ok.json")
    with pytest.raises(records.RecordError) as info:
        records.validate(a_record(records, **change), "bad.json")
    assert "bad.json" in str(info.value) and key in str(info.value)
    with pytest.raises(records.RecordError, match=r"rows\[0\]\.peer`"):
        row = records.make_row("tiny", "s/step", 1.0)
        records.validate(a_record(records, rows=[{**row, "peer_value": 2.0}]), "bad.json")


def test_ahead_is_how_many_times_better_than_the_peer(records_module):
    records, _ = records_module
    make = records.make_row
    assert records.ahead(make("a", "s/step", 0.5, peer="p", peer_value=1.0)) == 2.0
    assert records.ahead(make("a", "Gparam/s", 6.0, better="higher", peer="p", peer_value=4.0)) == 1.5
    assert records.ahead(make("a", "speed-up", 1.3, better="higher", peer="p", ratio=1.3)) == 1.3
    assert records.ahead(make("a", "s/step", 0.5)) is None


DATES = st.sampled_from([f"2026-11-2{d}T0{h}:00:00Z" for d in range(1, 4) for h in range(3)])
ROWS = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([None, "p"]), st.floats(0.1, 10)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(DATES, st.sampled_from(["m1", "m2"]), ROWS), min_size=1, max_size=6))
def test_current_tables_hold_the_newest_row_of_each_case_peer_and_machine(records_module, runs):
    records, make_results = records_module
    named = []
    for i, (date, machine, rows) in enumerate(runs):
        record = a_record(records, date=date, machine={"label": machine}, rows=[])
        for case, peer, value in rows:
            record["rows"].append(records.make_row(case, "s/step", value, peer=peer, peer_value=1.0 if peer else None))
        named.append((f"{i:02d}.json", record))
    tables = make_results.current_rows(copy.deepcopy(named))
    shown = tables.get("bench_demo", [])
    keys = [(row["case"], row["peer"], record["machine"]["label"]) for _, record, row in shown]
    assert len(keys) == len(set(keys))  # one row per key
    every = {(row["case"], row["peer"], record["machine"]["label"]) for _, record in named for row in record["rows"]}
    assert set(keys) == every
    for name, record, row in shown:  # and it is the newest: no later record has a row of its key
        key = (row["case"], row["peer"], record["machine"]["label"])
        later = [
            n
            for n, r in named
            if (r["date"], n) > (record["date"], name)
            and any((x["case"], x["peer"], r["machine"]["label"]) == key for x in r["rows"])
        ]
        assert not later, (key, name, later)
    text = make_results.render(named)
    assert text.count("\n| ") == 2 + len(keys) + 2 + len({m for _, m, _ in runs})  # headers, rows, machine rows
