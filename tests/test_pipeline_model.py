"""offload.plan.pipeline_model: the replay of a recorded step schedule under a machine cost model."""

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.plan.pipeline_model import (
    MACHINES,
    RESOURCES,
    SHARED_NVME,
    Machine,
    Op,
    chrome_trace,
    duration,
    floor_of,
    machine_from_args,
    queue_of,
    replay,
    summary_lines,
    write_chrome_trace,
)

# Round rates: 1 TFLOPS, 1 GB/s each way, 1 Gparams/s of Adam, no latency, 1 s of host time per
# unit, so that 1e12 flops, 1e9 bytes, 1e9 elements and a share of 1 each take exactly one second.
ROUND = Machine(
    device_tflops=1.0,
    h2d_gbps=1.0,
    d2h_gbps=1.0,
    cpu_adam_gparams=1.0,
    device_adam_gparams=1.0,
    nvme_read_gbps=1.0,
    nvme_write_gbps=1.0,
    latency_us=0.0,
    host_unit_us=1e6,
)
T, G = 1e12, 10**9  # one second of compute, one second of copy / Adam under ROUND


def fetch(id_, unit, seconds=1, deps=()):
    return Op(id_, "host_to_device", "fetch", unit, nbytes=seconds * G, deps=deps)


def compute(id_, kind, unit, seconds, deps=()):
    return Op(id_, "compute", kind, unit, flops=seconds * T, deps=deps)


def three_units():
    """Forward x3 with fetches ahead, backward x3, each gradient copied out and stepped by the
    CPU Adam. Ids are 100 + position, so an id/position mix-up shows.

    Hand schedule under ROUND (seconds):
      100 fetch 0        h2d      [0, 1]
      101 forward 0      compute  [1, 3]    waits for 100
      102 fetch 1        h2d      [1, 2]    queued behind 100
      103 forward 1      compute  [3, 5]    waits for 102 (ended 2) and compute (free at 3)
      104 fetch 2        h2d      [3, 4]    waits for 101 (buffer of unit 0 freed)
      105 forward 2      compute  [5, 7]    waits for 104 (ended 4) and compute (free at 5)
      106 backward 2     compute  [7, 11]
      107 grad_copy 2    d2h      [11, 13]  waits for 106
      108 cpu_adam 2     cpu_adam [13, 16]  waits for 107
      109 backward 1     compute  [11, 15]
      110 grad_copy 1    d2h      [15, 17]
      111 cpu_adam 1     cpu_adam [17, 20]  waits for 110 (17) and for 108 (16)
      112 backward 0     compute  [15, 19]
      113 grad_copy 0    d2h      [19, 21]
      114 cpu_adam 0     cpu_adam [21, 24]
    """
    return [
        fetch(100, 0),
        compute(101, "forward", 0, 2, deps=(100,)),
        fetch(102, 1),
        compute(103, "forward", 1, 2, deps=(102,)),
        fetch(104, 2, deps=(101,)),
        compute(105, "forward", 2, 2, deps=(104,)),
        compute(106, "backward", 2, 4, deps=(105,)),
        Op(107, "device_to_host", "grad_copy", 2, nbytes=2 * G, deps=(106,)),
        Op(108, "cpu_adam", "adam", 2, elements=3 * G, deps=(107,)),
        compute(109, "backward", 1, 4),
        Op(110, "device_to_host", "grad_copy", 1, nbytes=2 * G, deps=(109,)),
        Op(111, "cpu_adam", "adam", 1, elements=3 * G, deps=(110,)),
        compute(112, "backward", 0, 4),
        Op(113, "device_to_host", "grad_copy", 0, nbytes=2 * G, deps=(112,)),
        Op(114, "cpu_adam", "adam", 0, elements=3 * G, deps=(113,)),
    ]


def test_three_units_exact_times():
    r = replay(three_units(), ROUND)
    expected = {
        100: (0, 1),
        101: (1, 3),
        102: (1, 2),
        103: (3, 5),
        104: (3, 4),
        105: (5, 7),
        106: (7, 11),
        107: (11, 13),
        108: (13, 16),
        109: (11, 15),
        110: (15, 17),
        111: (17, 20),
        112: (15, 19),
        113: (19, 21),
        114: (21, 24),
    }
    assert r.spans == {k: (float(s), float(e)) for k, (s, e) in expected.items()}
    assert r.step_time == 24.0
    assert r.busy == {
        "compute": 18.0,
        "host_to_device": 3.0,
        "device_to_host": 6.0,
        "optimizer": 0.0,
        "cpu_adam": 9.0,
        "nvme_read": 0.0,
        "nvme_write": 0.0,
        "host": 0.0,
    }
    assert r.floor == 18.0
    assert r.floor_resource == "compute"
    # compute is busy over [1, 19]: fetches [0,1] [1,2] [3,4] hide 2 of 3 s,
    # grad copies [11,13] [15,17] [19,21] hide 4 of 6 s, Adam [13,16] [17,20] [21,24] 5 of 9 s
    assert r.hidden_share("host_to_device") == pytest.approx(2 / 3)
    assert r.exposed("host_to_device") == pytest.approx(1.0)
    assert r.hidden_share("device_to_host") == pytest.approx(2 / 3)
    assert r.exposed("device_to_host") == pytest.approx(2.0)
    assert r.hidden_share("cpu_adam") == pytest.approx(5 / 9)
    assert r.exposed("cpu_adam") == pytest.approx(4.0)
    assert r.hidden_share("compute") == 1.0 and r.exposed("compute") == 0.0
    assert r.hidden_share("nvme_read") == 1.0 and r.exposed("nvme_read") == 0.0


def test_three_units_critical_path():
    r = replay(three_units(), ROUND)
    # 114 <- dep 113 <- dep 112 <- compute queue 109 <- 106 <- dep 105 <- compute queue 103 (105's
    # dep 104 ended at 4, not 5) <- compute queue 101 (103's dep 102 ended at 2) <- dep 100
    assert [op.id for op in r.critical_path()] == [100, 101, 103, 105, 106, 109, 112, 113, 114]


def test_among_and_critical_path_from_an_op():
    """One step of several: `among` picks the ops counted as the resource's (hidden under any
    compute), `critical_path(end)` walks back from the op given instead of the last to end."""
    r = replay(three_units(), ROUND)
    # only unit 2's and unit 0's grad copies: [11, 13] (2 of 2 s hidden) and [19, 21] (0 of 2 s)
    assert r.hidden_share("device_to_host", among={107, 113}) == pytest.approx(1 / 2)
    assert r.exposed("device_to_host", among={107, 113}) == pytest.approx(2.0)
    assert r.hidden_share("device_to_host", among={107}) == 1.0 and r.exposed("device_to_host", among={107}) == 0.0
    # no op of the resource among them: nothing to hide
    assert r.hidden_share("cpu_adam", among={107}) == 1.0 and r.exposed("cpu_adam", among={107}) == 0.0
    # 108 (Adam of unit 2) <- dep 107 <- dep 106 <- compute queue 105 <- 103 <- 101 <- dep 100
    assert [op.id for op in r.critical_path(end=108)] == [100, 101, 103, 105, 106, 107, 108]
    assert r.critical_path(end=None) == r.critical_path()
    with pytest.raises(ValueError, match="op 999 is not in the replay"):
        r.critical_path(end=999)


def test_critical_path_prefers_the_dependency_on_a_tie():
    ops = [compute(0, "forward", 0, 1), fetch(1, 1), compute(2, "forward", 1, 1, deps=(1,))]
    r = replay(ops, ROUND)
    assert r.spans[2] == (1.0, 2.0)
    assert [op.id for op in r.critical_path()] == [1, 2]


def test_hidden_share_full_and_none():
    hidden = replay([compute(0, "forward", 0, 2), fetch(1, 1)], ROUND)
    assert hidden.hidden_share("host_to_device") == 1.0
    assert hidden.exposed("host_to_device") == 0.0
    assert hidden.step_time == 2.0

    waited_for = replay([fetch(0, 0), compute(1, "forward", 0, 2, deps=(0,))], ROUND)
    assert waited_for.hidden_share("host_to_device") == 0.0
    assert waited_for.exposed("host_to_device") == 1.0
    assert waited_for.step_time == 3.0
    assert waited_for.floor == 2.0 and waited_for.floor_resource == "compute"
    assert [op.id for op in waited_for.critical_path()] == [0, 1]


def test_floor_resource_and_empty_schedule():
    r = replay([compute(0, "forward", 0, 1), Op(1, "nvme_write", "swap_write", 0, nbytes=5 * G)], ROUND)
    assert (r.floor, r.floor_resource, r.step_time) == (5.0, "nvme_write", 5.0)
    empty = replay([], ROUND)
    assert (empty.step_time, empty.floor, empty.critical_path()) == (0.0, 0.0, [])
    assert empty.hidden_share("cpu_adam") == 1.0


def test_duration_per_resource():
    m = dataclasses.replace(
        ROUND, latency_us=10.0, h2d_gbps=2.0, nvme_read_gbps=4.0, device_adam_gparams=5.0, cpu_adam_gparams=0.5
    )
    assert duration(compute(0, "forward", 0, 3), m) == pytest.approx(3.0)
    assert duration(fetch(0, 0, seconds=1), m) == pytest.approx(1e-5 + 0.5)
    assert duration(Op(0, "device_to_host", "grad_copy", 0, nbytes=G), m) == pytest.approx(1e-5 + 1.0)
    assert duration(Op(0, "nvme_read", "swap_read", 0, nbytes=G), m) == pytest.approx(1e-5 + 0.25)
    assert duration(Op(0, "nvme_write", "swap_write", 0, nbytes=G), m) == pytest.approx(1e-5 + 1.0)
    assert duration(Op(0, "cpu_adam", "adam", 0, elements=G), m) == pytest.approx(2.0)
    assert duration(Op(0, "optimizer", "adam", 0, elements=G), m) == pytest.approx(0.2)
    assert duration(Op(0, "optimizer", "adam", 0, flops=T), m) == pytest.approx(1.0)
    assert duration(Op(0, "host", "host", 0, share=0.25), m) == pytest.approx(0.25)  # a quarter of the unit's 1 s


def test_host_time_before_compute_sets_the_step_when_it_is_the_longer():
    """The host's work before each compute op: hidden while the device is busier, the step's
    pace when the host is slower (each unit's host op 2 s, its compute 1 s)."""
    ops = []
    for unit in range(3):
        host = Op(2 * unit, "host", "host", unit, share=2.0, deps=(2 * unit - 2,) if unit else ())
        ops += [host, Op(2 * unit + 1, "compute", "forward", unit, flops=T, deps=(host.id,))]
    r = replay(ops, ROUND)
    assert r.step_time == 7.0 and (r.floor, r.floor_resource) == (6.0, "host")
    fast_host = dataclasses.replace(ROUND, host_unit_us=1e5)  # 0.2 s: hidden behind compute
    assert replay(ops, fast_host).step_time == pytest.approx(3.2)


@pytest.mark.parametrize(
    "ops, words",
    [
        ([Op(7, "gpu", "forward", 0, flops=1.0)], ["op 7", "gpu"]),
        (
            [Op(1, "compute", "forward", 0), Op(2, "compute", "backward", 0, deps=(3,)), Op(3, "compute", "x", 0)],
            ["op 2", "op 3", "later"],
        ),
        ([Op(4, "compute", "forward", 0, deps=(9,))], ["op 4", "op 9", "not in"]),
        ([Op(5, "host_to_device", "fetch", 0, nbytes=-1)], ["op 5", "nbytes"]),
        ([Op(6, "compute", "forward", 0, flops=math.nan)], ["op 6", "flops"]),
        ([Op(8, "compute", "", 0)], ["op 8", "kind"]),
        ([Op(1, "compute", "a", 0), Op(1, "compute", "b", 0)], ["op 1", "duplicate"]),
        ([Op(3, "compute", "a", 0, deps=(3,))], ["op 3", "itself"]),
    ],
)
def test_validation_errors_name_the_op(ops, words):
    with pytest.raises(ValueError) as info:
        replay(ops, ROUND)
    for word in words:
        assert word in str(info.value)


def test_machine_validation_and_presets():
    for name, m in MACHINES.items():
        for f in dataclasses.fields(m):
            if f.name != "nvme_duplex" and getattr(m, f.name) is not None:
                assert getattr(m, f.name) > 0 or f.name == "latency_us", (name, f.name)
    assert not MACHINES["this-cpu"].nvme_duplex and MACHINES["h100-pcie5"].nvme_duplex
    with pytest.raises(ValueError, match="nvme_duplex must be True or False"):
        dataclasses.replace(ROUND, nvme_duplex=1)
    assert {"h100-pcie5", "h100-pcie4", "h200-pcie5", "a100-pcie4", "this-cpu"} <= set(MACHINES)
    with pytest.raises(ValueError, match="h2d_gbps"):
        dataclasses.replace(ROUND, h2d_gbps=0.0)
    with pytest.raises(ValueError, match="latency_us"):
        dataclasses.replace(ROUND, latency_us=-1.0)
    with pytest.raises(ValueError, match="cpu_adam_int8_gparams"):
        dataclasses.replace(ROUND, cpu_adam_int8_gparams=0.0)
    assert dataclasses.replace(ROUND, host_unit_us=0.0).host_unit_us == 0.0


def test_cpu_adam_rate_per_state_precision():
    m = dataclasses.replace(ROUND, cpu_adam_gparams=5.0, cpu_adam_int8_gparams=6.5)
    assert m.for_state_precision("fp32") == m and m.for_state_precision("int8").cpu_adam_gparams == 6.5
    assert m.for_state_precision("bf16").cpu_adam_gparams == 5.0  # none given: the fp32 rate
    with pytest.raises(ValueError, match="fp8"):
        m.for_state_precision("fp8")


def test_h100_preset_matches_the_measured_plain_step():
    # 6 * params * tokens of training compute for a 1.35B Llama at 8 x 1024 tokens: ~0.247 s measured
    step = replay([Op(0, "compute", "train", None, flops=6 * 1.35e9 * 8192)], MACHINES["h100-pcie5"]).step_time
    assert step == pytest.approx(0.247, rel=0.01)


def test_machine_from_args_overrides_exactly_the_given_fields():
    base = MACHINES["h100-pcie5"]
    m = machine_from_args("h100-pcie5", h2d_gbps=12.5, nvme_write_gbps=None, latency_us=3.0)
    assert m.h2d_gbps == 12.5 and m.latency_us == 3.0
    changed = {f.name for f in dataclasses.fields(m) if getattr(m, f.name) != getattr(base, f.name)}
    assert changed == {"h2d_gbps", "latency_us"}
    assert machine_from_args("a100-pcie4") == MACHINES["a100-pcie4"]
    with pytest.raises(ValueError) as info:
        machine_from_args("tpu-v9")
    for name in MACHINES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="h2d_gb"):
        machine_from_args("h100-pcie5", h2d_gb=1.0)


def test_chrome_trace(tmp_path):
    ops = three_units()
    m = MACHINES["h100-pcie5"]
    r = replay(ops, m)
    trace = chrome_trace(r, ops)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(RESOURCES)
    sort_index = {names[e["tid"]]: e["args"]["sort_index"] for e in events if e["ph"] == "M" and e["name"] == "thread_sort_index"}
    assert sorted(sort_index, key=sort_index.__getitem__) == list(RESOURCES)
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted(e["args"]["id"] for e in complete) == [op.id for op in ops]
    by_id = {op.id: op for op in ops}
    for e in complete:
        op = by_id[e["args"]["id"]]
        assert names[e["tid"]] == op.resource
        assert e["dur"] == pytest.approx(duration(op, m) * 1e6, rel=1e-9)
        assert e["ts"] == pytest.approx(r.spans[op.id][0] * 1e6, rel=1e-9, abs=1e-9)
        assert e["name"] == f"{op.kind} {op.unit}"
        assert e["args"]["bytes"] == op.nbytes and e["args"]["elements"] == op.elements
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == finishes.keys()
    crossing = sum(1 for op in ops for d in op.deps if by_id[d].resource != op.resource)
    assert len(starts) == crossing == 10
    assert all(f["bp"] == "e" for f in finishes.values())
    json.dumps(trace)
    path = tmp_path / "step.json"
    write_chrome_trace(path, r, ops)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_summary_lines():
    lines = summary_lines("three units", replay(three_units(), ROUND))
    text = "\n".join(lines)
    assert lines[0].startswith("three units: predicted step 24000.000 ms, floor 18000.000 ms (compute), step/floor 1.33x")
    assert "host_to_device" in text and "66.7 %" in text and "nvme_read" not in text
    assert "critical path: 9 ops" in text


@st.composite
def schedules(draw):
    """Random DAGs in issue order: random resources and work, distinct shuffled ids, deps only
    to earlier ops."""
    n = draw(st.integers(0, 20))
    ids = draw(st.permutations(range(1000, 1000 + n)))
    ops = []
    for i, id_ in enumerate(ids):
        resource = draw(st.sampled_from(RESOURCES))
        work = draw(st.integers(0, 5))
        deps = tuple(draw(st.sets(st.sampled_from(ids[:i]), max_size=3))) if i else ()
        ops.append(
            Op(
                id_,
                resource,
                "k",
                draw(st.none() | st.integers(0, 3)),
                flops=work * 1e11,
                nbytes=work * 10**8,
                elements=work * 10**8,
                share=work * 0.1,
                deps=deps,
            )
        )
    return ops


@settings(max_examples=150, deadline=None)
@given(ops=schedules(), latency=st.sampled_from([0.0, 10.0]))
def test_replay_properties(ops, latency):
    m = dataclasses.replace(ROUND, latency_us=latency, h2d_gbps=2.0, cpu_adam_gparams=0.5)
    r = replay(ops, m)
    durations = {op.id: duration(op, m) for op in ops}
    assert r.step_time >= r.floor - 1e-12
    assert r.step_time <= sum(durations.values()) + 1e-9
    last_on: dict[str, float] = {}
    for op in ops:
        start, end = r.spans[op.id]
        assert end - start == pytest.approx(durations[op.id], abs=1e-12)
        for d in op.deps:
            assert start >= r.spans[d][1]
        assert start >= last_on.get(op.resource, 0.0)  # no overlap on one resource, list order kept
        last_on[op.resource] = end
    for resource in RESOURCES:
        assert 0.0 <= r.hidden_share(resource) <= 1.0
        assert -1e-12 <= r.exposed(resource) <= r.busy[resource] + 1e-12
        assert r.busy[resource] == pytest.approx(sum(durations[op.id] for op in ops if op.resource == resource))
    path = r.critical_path()
    if ops:
        # the path runs without gaps from time 0 to the step's end
        assert r.spans[path[0].id][0] == 0.0 and r.spans[path[-1].id][1] == r.step_time
        for a, b in zip(path, path[1:]):
            assert r.spans[a.id][1] == r.spans[b.id][0]
    assert replay(ops, m) == r


@settings(max_examples=150, deadline=None)
@given(ops=schedules())
def test_replay_without_urgent_ops_is_the_plain_list_schedule(ops):
    """Each op starts exactly when the op before it on its resource (in list order) and all its
    deps have ended: the schedule the replay made before it had an urgent queue."""
    r = replay(ops, ROUND)
    free_at: dict[str, float] = {}
    for op in ops:
        assert r.spans[op.id][0] == max([free_at.get(op.resource, 0.0), *(r.spans[d][1] for d in op.deps)])
        free_at[op.resource] = r.spans[op.id][1]


def nvme_read(id_, seconds, *, urgent, deps=()):
    return Op(id_, "nvme_read", "read", 0, nbytes=seconds * G, deps=deps, urgent=urgent)


def test_urgent_read_overtakes_an_earlier_waiting_one():
    """A prefetch read issued first and a fetch's urgent read, both ready at 0: the urgent one
    goes first, then the prefetch; the forward waiting on the fetch starts at 1, not 3."""
    ops = [
        nvme_read(1, 2, urgent=False),
        nvme_read(2, 1, urgent=True),
        compute(3, "forward", 0, 1, deps=(2,)),
    ]
    r = replay(ops, ROUND)
    assert r.spans == {2: (0.0, 1.0), 1: (1.0, 3.0), 3: (1.0, 2.0)}
    assert [op.id for op in r.critical_path()] == [2, 1]  # the prefetch ran after the fetch on the drive
    plain = replay([dataclasses.replace(op, urgent=False) for op in ops], ROUND)
    assert plain.spans[3] == (3.0, 4.0)


def test_urgent_op_does_not_preempt_and_classes_keep_their_order():
    """A non-urgent read already running finishes; the urgent read ready meanwhile goes next,
    before a non-urgent one that was waiting; within each class, list order."""
    ops = [
        compute(1, "forward", 0, 0.5),
        nvme_read(2, 2, urgent=False),  # [0, 2]
        nvme_read(3, 1, urgent=False),  # waits behind 2, then behind the urgent ones
        nvme_read(4, 1, urgent=True, deps=(1,)),  # ready at 0.5: runs when 2 ends
        nvme_read(5, 1, urgent=True),  # ready at 0, but behind 4 in its queue
    ]
    r = replay(ops, ROUND)
    assert r.spans[2] == (0.0, 2.0)
    assert r.spans[4] == (2.0, 3.0) and r.spans[5] == (3.0, 4.0) and r.spans[3] == (4.0, 5.0)


@st.composite
def schedules_with_urgent_io(draw):
    """Random DAGs whose NVMe ops are urgent or not; every op does some work (positive
    durations: an op never becomes ready at the very instant a choice is made)."""
    ops = draw(schedules())
    return [
        dataclasses.replace(
            op,
            flops=op.flops + 1e11,
            nbytes=op.nbytes + 10**8,
            elements=op.elements + 10**8,
            share=op.share + 0.1,
            urgent=op.resource.startswith("nvme") and draw(st.booleans()),
        )
        for op in ops
    ]


OTHER_DIRECTION = {"nvme_read": "nvme_write", "nvme_write": "nvme_read"}


@settings(max_examples=200, deadline=None)
@given(ops=schedules_with_urgent_io(), background_depth=st.sampled_from([0, 2]))
def test_replay_with_urgent_io_properties(ops, background_depth):
    r = replay(ops, ROUND, background_depth=background_depth)
    assert r.background_depth == background_depth
    ready = {op.id: max([0.0, *(r.spans[d][1] for d in op.deps)]) for op in ops}
    for resource in RESOURCES:
        ran = sorted((op for op in ops if op.resource == resource), key=lambda o: r.spans[o.id][0])
        previous_end = 0.0
        for op in ran:
            start, end = r.spans[op.id]
            assert start >= ready[op.id] and start >= previous_end  # deps first; one at a time
            # never idle while this op, the first of its class, could run: it starts as soon as
            # it is ready and the resource is free, or, with background_depth 0, a non-urgent
            # NVMe op as soon as no urgent op of the other direction runs
            earliest = max(ready[op.id], previous_end)
            if background_depth == 0 and not op.urgent and resource in OTHER_DIRECTION:
                others = [r.spans[u.id] for u in ops if u.resource == OTHER_DIRECTION[resource] and u.urgent]
                assert not any(s <= start < e for s, e in others)
                assert start == earliest or any(e == start and e > earliest for _, e in others)
            else:
                assert start == earliest
            previous_end = end
        for urgent in (True, False):
            mine = [op.id for op in ops if op.resource == resource and op.urgent == urgent]
            assert mine == sorted(mine, key=lambda i: r.spans[i][0])  # each class in list order
        # a non-urgent op starts only when the urgent queue's first op is not ready then
        urgent_ops = [op for op in ops if op.resource == resource and op.urgent]
        for op in ran:
            if op.urgent:
                continue
            start = r.spans[op.id][0]
            waiting = [u for u in urgent_ops if r.spans[u.id][0] > start]
            if waiting:
                assert ready[waiting[0].id] > start
    path = r.critical_path()
    if ops:
        assert r.spans[path[0].id][0] == 0.0 and r.spans[path[-1].id][1] == r.step_time
        for a, b in zip(path, path[1:]):
            assert r.spans[a.id][1] == r.spans[b.id][0]


SHARED = dataclasses.replace(ROUND, nvme_duplex=False)


def nvme_write(id_, seconds, *, urgent, deps=()):
    return Op(id_, "nvme_write", "write", 0, nbytes=seconds * G, deps=deps, urgent=urgent)


def test_a_drive_that_is_not_duplex_serves_reads_and_writes_from_one_queue():
    """A state write-back and a weight read, both ready at 0: a duplex drive runs them together
    where the engine keeps places for the write-back (background_depth 2), else the write waits
    for the urgent read; one queue runs the urgent read first, then the write, and the floor is
    their sum."""
    ops = [nvme_write(1, 2, urgent=False), nvme_read(2, 1, urgent=True), compute(3, "forward", 0, 1, deps=(2,))]
    duplex = replay(ops, ROUND, background_depth=2)
    assert duplex.spans[1] == (0.0, 2.0) and duplex.spans[2] == (0.0, 1.0)
    assert (duplex.floor, duplex.floor_resource) == (2.0, "nvme_write")
    # the engine's default, urgent pieces first from one pool of places: the write waits for
    # the read although the drive could serve both, and the critical path says so
    urgent_first = replay(ops, ROUND)
    assert urgent_first.spans == {2: (0.0, 1.0), 1: (1.0, 3.0), 3: (1.0, 2.0)}
    assert (urgent_first.floor, urgent_first.floor_resource) == (2.0, "nvme_write")
    assert [op.id for op in urgent_first.critical_path()] == [2, 1]
    shared = replay(ops, SHARED)
    assert shared.spans == {2: (0.0, 1.0), 1: (1.0, 3.0), 3: (1.0, 2.0)}
    assert (shared.floor, shared.floor_resource) == (3.0, SHARED_NVME)
    assert shared.busy["nvme_read"] == 1.0 and shared.busy["nvme_write"] == 2.0  # each direction still counted
    assert [op.id for op in shared.critical_path()] == [2, 1]  # the write waited for the read's queue
    assert queue_of("nvme_write", False) == queue_of("nvme_read", False) == SHARED_NVME
    assert queue_of("nvme_write", True) == "nvme_write" and queue_of("compute", False) == "compute"
    assert floor_of({"compute": 2.5, "nvme_read": 1.0, "nvme_write": 2.0}, True) == (2.5, "compute")
    assert floor_of({"compute": 2.5, "nvme_read": 1.0, "nvme_write": 2.0}, False) == (3.0, SHARED_NVME)


@settings(max_examples=150, deadline=None)
@given(ops=schedules_with_urgent_io())
def test_one_nvme_queue_properties(ops):
    """With one queue for the drive no two NVMe ops overlap, and each op starts as soon as it is
    ready and its queue is free (queues in the order they ran)."""
    r = replay(ops, SHARED)
    ready = {op.id: max([0.0, *(r.spans[d][1] for d in op.deps)]) for op in ops}
    for queue in {queue_of(res, False) for res in RESOURCES}:
        ran = sorted((op for op in ops if queue_of(op.resource, False) == queue), key=lambda o: r.spans[o.id][0])
        previous_end = 0.0
        for op in ran:
            assert r.spans[op.id][0] == max(ready[op.id], previous_end)
            previous_end = r.spans[op.id][1]
    assert r.floor == pytest.approx(floor_of(r.busy, False)[0])
    assert r.step_time >= r.floor - 1e-9
    assert r.step_time >= replay(ops, ROUND).floor - 1e-9  # never below the duplex drive's floor


def test_background_depth_must_be_a_whole_number_at_least_0():
    ops = [nvme_write(1, 1, urgent=False)]
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="background_depth must be a whole number >= 0"):
            replay(ops, ROUND, background_depth=bad)
    assert replay(ops, ROUND, background_depth=3).background_depth == 3
