"""Issue 51, the checkpoint and load findings, tried as an adversary would.

- A save killed, or its disk full, at every file system step of its sequence (creating, writing,
  fsyncing, renaming, exchanging, linking, removing), including between the checkpoint
  directory's rename and the replacement of `latest`: `latest` names the old checkpoint or the
  new one, whole; a load finds what `latest` names and warns of an unfinished save it passes
  over; the same save, retried, succeeds and leaves the root tidy. The kill is simulated in
  process (`FileSystemSteps`: from the kill on, no file system change happens, so cleanup code
  that still runs changes nothing, as after a SIGKILL), and done for real once, in a child.
- Crafted indexes (checksums recomputed): every field, removed or of a wrong type, is loaded
  whole or refused before the engine changes, never half applied.
- Ctrl-C inside a load reaches the caller as KeyboardInterrupt, the engine part loaded and
  refusing to train until a load succeeds.
- Checkpoint files and directories follow the umask.
- A compact CPUAdamW refuses a bad state dict without changing.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import TinyNet, batches, engine_run

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.checkpoint.engine_state import CheckpointError, CheckpointReader
from offload.errors import OffloadError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = {"precision": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.01}, "overlap": "none"}


def config(swap) -> dict:
    return {**CONFIG, "offload": {"param": "cpu", "optimizer": "cpu", "nvme_path": str(swap)}}


def new_engine(swap):
    torch.manual_seed(0)
    return offload.initialize(TinyNet(), config(swap), device="cpu")


def masters(directory) -> dict[str, torch.Tensor]:
    with CheckpointReader(str(directory)) as reader:
        return {name: reader.read_param(name) for name in reader.index["params"]}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the commit rule as plain logic -------------------------------------------------------------
def test_the_commit_rule_judges_unfinished_saves():
    from offload.checkpoint.root import Latest

    latest = Latest(True, "global_step4", 3)
    assert latest.unfinished("global_step8", 4)  # saved after latest's, never named by it
    assert not latest.unfinished("best", 2)  # saved before: a finished checkpoint latest moved on from
    assert not latest.unfinished("global_step4", 3)  # the one latest names
    assert not latest.unfinished("global_step8", None)  # no readable index: never replaced unasked
    assert Latest(False).unfinished("start", 1)  # no latest: no save under the root ever completed
    assert not Latest(True, None, None).unfinished("x", 9)  # latest unreadable: nothing is judged
    assert not Latest(True, "a", None).unfinished("x", 9)
    assert latest.next_generation([99]) == 4  # one past latest's, whatever else is there
    assert Latest(True, "a", None).next_generation([2, None, 7]) == 8
    assert Latest(False).next_generation([]) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.booleans()), max_size=12))
def test_the_commit_rule_over_any_sequence_of_saves(saves):
    """A root modelled as tag -> generation and the tag `latest` names, under saves (tag,
    overwrite, completed) run as engine_state.save runs them: a save killed between its rename
    and `latest` is judged unfinished until a save completes (so the resumed run's save of that
    tag goes through), a completed one never is, and `latest`'s never is."""
    from offload.checkpoint.root import Latest

    generations: dict[str, int] = {}
    named: str | None = None
    killed: set[str] = set()  # tags whose last save was killed after its rename, none completed since
    for tag, overwrite, completed in saves:
        latest = Latest(named is not None, named, generations.get(named) if named else None)
        if tag in generations and not (overwrite or latest.unfinished(tag, generations[tag])):
            assert tag not in killed, "the retried save of an unfinished one was refused"
            continue  # refused: "already exists"
        generations[tag] = latest.next_generation(generations.values())
        if completed or tag == named:  # killed after replacing what `latest` names: that is complete too
            named, killed = tag, set()
        else:
            killed.add(tag)
        latest = Latest(named is not None, named, generations.get(named) if named else None)
        assert not latest.unfinished(named, generations[named]) if named else True
        for other, generation in generations.items():
            assert latest.unfinished(other, generation) == (other in killed), (other, saves)


# ---- kill points and full disks ---------------------------------------------------------------------
class Killed(BaseException):
    """The process died here (a simulated SIGKILL)."""


class FileSystemSteps:
    """Counts the file system changes the main thread makes while `armed` (a directory made, a
    file created, a file's first write, an fsync, a rename, an exchange, a link, an unlink, a
    directory removed), and at step `kill_at` "kills" the process: raises Killed, and from then
    on every change raises Killed without happening, so the disk stays as a SIGKILL there would
    leave it while the save's cleanup code runs. At step `fail_at`, that one change fails with
    ENOSPC instead (a full disk) and the others happen. fsync is counted, never run: a kill,
    unlike a power loss, loses nothing the kernel holds, and a save takes a few ms without it."""

    CHANGES = ("mkdir", "open", "write", "pwrite", "fsync", "rename", "replace", "link", "unlink", "rmdir")

    def __init__(self, monkeypatch) -> None:
        self.steps: list[str] = []
        self.kill_at = self.fail_at = -1
        self.armed = self.dead = False
        self._written: set[int] = set()
        self._open: set[int] = set()  # descriptors the save holds: the kernel closes them at a kill
        self._main = threading.get_ident()
        self._close = os.close
        self._names: dict[int, str] = {}
        for name in self.CHANGES:
            real = (lambda fd: None) if name == "fsync" else getattr(os, name)
            monkeypatch.setattr(os, name, self._hooked(name, real))
        monkeypatch.setattr(os, "close", self._closing)
        real_exchange = checkpoint.exchange_paths
        monkeypatch.setattr(checkpoint, "exchange_paths", self._hooked("exchange", real_exchange))

    def arm(self, *, kill_at: int = -1, fail_at: int = -1) -> None:
        self.steps, self._written, self._open = [], set(), set()
        self.kill_at, self.fail_at, self.armed, self.dead = kill_at, fail_at, True, False

    def disarm(self) -> None:
        """The save returned or raised: after a kill, what it held open is closed (its locks go)."""
        self.armed = False
        for fd in self._open:
            self._close(fd)
        self._open = set()

    def _closing(self, fd: int) -> None:
        self._open.discard(fd)
        self._close(fd)

    def _hooked(self, name: str, real):
        def change(*args, **kwargs):
            if not self.armed or threading.get_ident() != self._main:
                return real(*args, **kwargs)
            if name == "open" and not args[1] & os.O_CREAT:
                fd = real(*args, **kwargs)
                self._open.add(fd)
                self._names[fd] = os.path.basename(str(args[0]))
                return fd
            if name in ("write", "pwrite"):
                if args[0] in self._written:
                    return real(*args, **kwargs)
                self._written.add(args[0])
            step = len(self.steps)
            target = self._names.get(args[0], "?") if isinstance(args[0], int) else os.path.basename(str(args[0]))
            self.steps.append(f"{name} {target}")
            if self.dead or step == self.kill_at:
                self.dead = True
                raise Killed(self.steps[-1])
            if step == self.fail_at:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(args[0]))
            result = real(*args, **kwargs)
            if name == "open":
                self._written.discard(result)  # a new file: its first write is a step
                self._open.add(result)
                self._names[result] = os.path.basename(str(args[0]))
            return result

        return change


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A root template per scenario, the engine's masters at steps 0, 4 and 8, and an engine at
    step 8 that every kill point saves from (and saves again, as the retry)."""
    base = tmp_path_factory.mktemp("trained")
    (base / "swap").mkdir()
    engine = new_engine(base / "swap")
    data = batches(8)
    templates = {name: base / name for name in ("first", "overwrite", "rotate")}
    templates["first"].mkdir()
    engine.save_checkpoint(str(templates["rotate"]), tag="global_step0")
    engine_run(engine, data[:4])
    engine.save_checkpoint(str(templates["rotate"]))
    engine.save_checkpoint(str(templates["overwrite"]), tag="best")
    (templates["overwrite"] / "best" / "notes.txt").write_text("the script's own")
    (templates["overwrite"] / "best" / "extra").mkdir()
    (templates["overwrite"] / "best" / "extra" / "x.txt").write_text("its own folder")
    engine.save_checkpoint(str(templates["overwrite"]))
    engine_run(engine, data[4:])
    expected = {4: masters(templates["rotate"] / "global_step4")}
    yield engine, templates, expected
    engine.close()


# scenario: (the tag the save writes, its keyword arguments, the tags the root holds after it)
SCENARIOS = {
    "first": ("global_step8", {}, ["global_step8", "latest"]),
    "overwrite": ("best", {"overwrite": True}, ["best", "global_step4", "latest"]),
    "rotate": ("global_step8", {"keep_last": 2}, ["global_step4", "global_step8", "latest"]),
}


def check_after_interruption(root, scenario: str, tag: str, expected: dict, outcome: str) -> None:
    """What a resume finds after a save was killed (or failed) part way: `latest` names the
    previous checkpoint (or none, for a first save) or the new one, whole; a save that raised
    (not killed) left the root as it was."""
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    previous = {"first": None, "overwrite": "global_step4", "rotate": "global_step4"}[scenario]
    assert latest in (previous, tag), latest
    if outcome == "failed":
        assert latest == previous
        if scenario == "overwrite":
            assert same(masters(root / "best"), expected[4]), "a failed overwrite did not put the old checkpoint back"
        else:
            assert not (root / tag).exists(), "a failed save was not taken back"
    if latest is None:
        with pytest.raises(CheckpointError, match="no checkpoint") as refused:
            CheckpointReader(str(root))
        if (root / tag).exists():
            assert "left by a save killed before it wrote latest" in str(refused.value)
        return
    with CheckpointReader(str(root)) as reader:
        assert reader.directory == str(root / latest)
    if latest == tag:
        assert same(masters(root), expected[8])
    else:
        assert same(masters(root), expected[4])
    if scenario == "overwrite":
        # the tag holds the old checkpoint or the new one, whole, with the script's own files
        assert same(masters(root / "best"), expected[4]) or same(masters(root / "best"), expected[8])
        assert (root / "best" / "notes.txt").read_text() == "the script's own"
        assert (root / "best" / "extra" / "x.txt").read_text() == "its own folder"


def retry_and_check(engine, root, scenario: str, expected: dict) -> None:
    tag, kwargs, listing = SCENARIOS[scenario]
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    if latest == tag and scenario != "overwrite":  # the save was complete: the next one goes on
        listing = ["again", "global_step8", "latest"] if scenario == "rotate" else [*listing, "again"]
        tag = "again"
    engine.save_checkpoint(str(root), tag=tag, **kwargs)
    assert sorted(os.listdir(root)) == sorted(listing)
    assert (root / "latest").read_text() == f"{tag}\n"
    assert same(masters(root), expected[8])
    if scenario == "overwrite":
        assert (root / "best" / "notes.txt").read_text() == "the script's own"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_save_killed_or_out_of_space_at_any_step_resumes_and_retries(tmp_path, monkeypatch, trained, scenario):
    engine, templates, expected = trained
    tag, kwargs, _ = SCENARIOS[scenario]
    steps = FileSystemSteps(monkeypatch)
    dry = tmp_path / "dry"
    shutil.copytree(templates[scenario], dry)
    steps.arm()
    engine.save_checkpoint(str(dry), tag=tag, **kwargs)
    steps.disarm()
    expected = {**expected, 8: masters(dry / tag)}
    sequence = steps.steps
    assert any(s.startswith("replace .tmp-latest") for s in sequence), sequence
    unfinished = 0  # kills that left the new directory beside a `latest` naming the old one
    for at in range(len(sequence)):
        # a full disk fails what allocates (never an unlink or a rmdir); a kill can come anywhere
        for mode in ("kill",) if sequence[at].startswith(("unlink", "rmdir")) else ("kill", "fail"):
            root = tmp_path / f"{mode}{at}"
            shutil.copytree(templates[scenario], root)
            steps.arm(**{f"{mode}_at": at})
            outcome = "saved"
            try:
                engine.save_checkpoint(str(root), tag=tag, **kwargs)
            except Killed:
                outcome = "killed"
            except OffloadError:
                outcome = "failed"
            finally:
                steps.disarm()
            where = f"{mode} at step {at} ({sequence[at]}) of {sequence}: {outcome}"
            assert outcome == "killed" if mode == "kill" else outcome in ("failed", "saved"), where
            latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
            unfinished += mode == "kill" and latest != tag and os.path.exists(os.path.join(root, tag, "index.json"))
            try:
                check_after_interruption(root, scenario, tag, expected, outcome)
                retry_and_check(engine, root, scenario, expected)
            except AssertionError as error:
                raise AssertionError(f"{where}: {error}") from error
            shutil.rmtree(root)
    assert unfinished >= (1 if scenario == "overwrite" else 5), unfinished  # rename .. replace of latest


KILLED_SAVE = """
import os, signal, sys, torch, offload
from reference import TinyNet, batches, engine_run
from offload.checkpoint import engine_state
torch.set_num_threads({threads})  # the test process's: the same sums, bit for bit
torch.manual_seed(0)
engine = offload.initialize(TinyNet(), {config!r}, device="cpu")
data = batches(12)
engine_run(engine, data[:4])
engine.save_checkpoint(sys.argv[1])
engine_run(engine, data[4:8])
real = engine_state.write_replacing
def killed_before_latest(path, *args, **kwargs):
    if os.path.basename(path) == "latest":
        os.kill(os.getpid(), signal.SIGKILL)  # the checkpoint directory is renamed into place, latest not yet
    return real(path, *args, **kwargs)
engine_state.write_replacing = killed_before_latest
engine.save_checkpoint(sys.argv[1])
"""


def test_sigkill_between_the_rename_and_latest_resumes_and_saves_again(tmp_path, swap_dir, caplog):
    """The issue's run: killed for real after global_step8/ is renamed into place and before
    `latest` moves. The resume loads global_step4 (what `latest` names), says global_step8 is an
    unfinished save, saves global_step8 again (no "already exists") and ends bit-identical to a
    run never killed."""
    root = tmp_path / "ckpt"
    code = KILLED_SAVE.format(config=config(swap_dir), threads=torch.get_num_threads())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    child = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == -9, child.stderr[-3000:]
    assert sorted(e for e in os.listdir(root) if not e.startswith(".")) == ["global_step4", "global_step8", "latest"]
    data = batches(12)
    with new_engine(swap_dir) as straight:
        engine_run(straight, data)
        expected = straight.consolidated_state_dict()
    engine = new_engine(swap_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine.load_checkpoint(str(root))
    assert engine.global_steps == 4
    assert any("global_step8 is newer but was left by a save that did not complete" in r.message for r in caplog.records)
    engine_run(engine, data[4:8])
    engine.save_checkpoint(str(root))
    assert (root / "latest").read_text() == "global_step8\n"
    assert sorted(os.listdir(root)) == ["global_step4", "global_step8", "latest"]
    engine_run(engine, data[8:])
    got = engine.consolidated_state_dict()
    engine.close()
    assert same(got, expected)


# ---- crafted indexes --------------------------------------------------------------------------------
def field_paths(index: dict) -> list[tuple]:
    """Every field of the index down to the leaves: of `params` the first parameter's, of the
    engine's parameter groups the first group's, of lists their first item."""
    paths = []

    def walk(value, path):
        paths.append(path)
        if isinstance(value, dict):
            keys = list(value)[:1] if path in (("params",), ("files",)) else list(value)
            for key in keys:
                walk(value[key], (*path, key))
        elif isinstance(value, list) and value and isinstance(value[0], dict | list):
            walk(value[0], (*path, 0))

    for key in index:
        walk(index[key], (key,))
    return paths


def crafted(index: dict, path: tuple, how: str) -> dict:
    index = copy.deepcopy(index)
    parent = index
    for key in path[:-1]:
        parent = parent[key]
    if how == "removed" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = "x" if isinstance(parent[path[-1]], list) else ["x"]
    return index


def test_no_crafted_index_field_fails_while_applied(tmp_path, swap_dir):
    """A field of index.json removed, or of a wrong type, with the checksum recomputed: the load
    applies whole or is refused before the engine changes; never a failure while applied (a
    part-loaded engine, or a bare KeyError after a complete load)."""
    engine = new_engine(swap_dir)
    engine_run(engine, batches(2))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="good")
    good = tmp_path / "ckpt" / "good"
    index = json.loads((good / "index.json").read_bytes())
    index.pop("checksum")
    engine.load_checkpoint(str(good))
    loaded = engine.consolidated_state_dict()
    outcomes = {}
    for path in field_paths(index):
        for how in ("removed", "wrong type"):
            directory = tmp_path / "crafted"
            shutil.rmtree(directory, ignore_errors=True)
            shutil.copytree(good, directory)
            (directory / "index.json").write_bytes(checkpoint.json_with_checksum(crafted(index, path, how)))
            try:
                engine.load_checkpoint(str(directory))
                outcomes[(path, how)] = "loaded"
            except CheckpointError as error:
                assert "passed every check" not in str(error), (path, how, str(error))
                outcomes[(path, how)] = "refused"
            except Exception as error:  # noqa: BLE001  (what the test is after)
                raise AssertionError(f"index field {path} {how}: {type(error).__name__}: {error}") from error
            engine.window.refuse_partly_stepped()  # raises if the engine says it is part loaded
    assert same(engine.consolidated_state_dict(), loaded)
    for field in ("world_size", "placement", "state_precision"):
        assert outcomes[((field,), "wrong type")] == "refused"
    assert outcomes[(("world_size",), "removed")] == "refused" and outcomes[(("placement",), "removed")] == "refused"
    assert outcomes[(("state_precision",), "removed")] == "loaded"  # checkpoints before compact state: fp32
    engine_run(engine, batches(1))
    engine.close()


# ---- Ctrl-C during a load ---------------------------------------------------------------------------
def test_ctrl_c_during_a_load_reaches_the_caller_as_itself(tmp_path, swap_dir, monkeypatch):
    """Ctrl-C in the first pass: KeyboardInterrupt, the engine unchanged; in the second pass:
    KeyboardInterrupt, the engine part loaded (it refuses to train) until a load succeeds, after
    which it trains as if never interrupted."""
    data = batches(6)
    with new_engine(swap_dir) as straight:
        engine_run(straight, data)
        expected = straight.consolidated_state_dict()
    engine = new_engine(swap_dir)
    engine_run(engine, data[:2])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine_run(engine, data[2:3])
    before = engine.consolidated_state_dict()
    real_scan, real_read = CheckpointReader.scan_range, CheckpointReader.read_range
    reads = []

    def interrupted(real):
        def read(self, *args, **kwargs):
            reads.append(args)
            if len(reads) == 3:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(CheckpointReader, "scan_range", interrupted(real_scan))
    with pytest.raises(KeyboardInterrupt):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert same(engine.consolidated_state_dict(), before) and engine.global_steps == 3
    monkeypatch.setattr(CheckpointReader, "scan_range", real_scan)
    reads.clear()
    monkeypatch.setattr(CheckpointReader, "read_range", interrupted(real_read))
    with pytest.raises(KeyboardInterrupt):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.setattr(CheckpointReader, "read_range", real_read)
    x, y = data[3]
    with pytest.raises(OffloadError, match="was interrupted.*part loaded"):
        engine.backward(((engine(x) - y) ** 2).mean())
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    engine_run(engine, data[2:])
    got = engine.consolidated_state_dict()
    engine.close()
    assert same(got, expected)


# ---- permissions ----------------------------------------------------------------------------------
def test_checkpoint_files_and_directories_follow_the_umask(tmp_path, swap_dir):
    """Every file and directory of a checkpoint, and `latest`, has the umask's permissions
    (0644 / 0755 under 022, 0600 / 0700 under 077), on a new save and an overwrite alike."""
    engine = new_engine(swap_dir)
    engine_run(engine, batches(1))
    for umask in (0o022, 0o077):
        root = tmp_path / f"ckpt{umask:o}"
        previous = os.umask(umask)
        try:
            engine.save_checkpoint(str(root), client_state={"epoch": 1})
            engine.save_checkpoint(str(root), tag="global_step1", overwrite=True, client_state={"epoch": 2})
        finally:
            os.umask(previous)
        modes = {}
        for directory, _dirs, files in os.walk(root):
            for name in [directory, *(os.path.join(directory, f) for f in files)]:
                modes[os.path.relpath(name, root)] = stat.S_IMODE(os.stat(name).st_mode)
        assert modes.pop("global_step1") == modes.pop(".") == 0o777 & ~umask, (umask, modes)
        assert set(modes) == {"latest", *(f"global_step1/{f}" for f in os.listdir(root / "global_step1"))}
        assert "global_step1/client_state.pt" in modes
        assert set(modes.values()) == {0o666 & ~umask}, (umask, modes)
    engine.close()


# ---- CPUAdamW with compact moments ------------------------------------------------------------------
def compact_optimizer(precision: str):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (40, 70, 33)]
    return params, offload.CPUAdamW(params, lr=1e-2, state_precision=precision)


def step(params, opt, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    opt.step()


def optimizer_snapshot(params, opt) -> list:
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [[p.detach().clone() for p in params], state, groups]


def snapshots_equal(a, b) -> bool:
    def equal(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
        return x == y

    return equal(a, b)


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_refused_compact_state_dict_changes_nothing(precision):
    """A state dict whose last parameter's moment has the wrong size (or whose step is no count)
    is refused with a ValueError before anything changes: the optimizer is bit-identical, and its
    next step equals that of a twin that never tried the load."""
    params, opt = compact_optimizer(precision)
    twin_params, twin = compact_optimizer(precision)
    for seed in (1, 2):
        step(params, opt, seed)
        step(twin_params, twin, seed)
    other_params, other = compact_optimizer(precision)
    for seed in (5, 6, 7):
        step(other_params, other, seed)
    saved = other.state_dict()
    wrong_size = copy.deepcopy(saved)
    wrong_size["state"][2]["exp_avg"] = torch.zeros(5)
    wrong_step = copy.deepcopy(saved)
    wrong_step["state"][1]["step"] = torch.tensor(float("nan"))
    for bad, words in ((wrong_size, "parameter 2's exp_avg has 5 elements"), (wrong_step, "parameter 1's step is nan")):
        before = optimizer_snapshot(params, opt)
        with pytest.raises(ValueError) as refused:
            opt.load_state_dict(bad)
        assert snapshots_equal(optimizer_snapshot(params, opt), before)
        assert words in str(refused.value)
    step(params, opt, 3)
    step(twin_params, twin, 3)
    assert snapshots_equal(optimizer_snapshot(params, opt), optimizer_snapshot(twin_params, twin))
    opt.load_state_dict(saved)  # and a good one still loads, to the saved moments exactly
    assert snapshots_equal(opt.state_dict()["state"], saved["state"])


# ---- two ranks: an interrupt on one rank does not hang the other ---------------------------------
def _interrupted_on_rank_1(rank, world, root, swap_root):
    from distributed_worker import RANK_DEVICE

    swap = os.path.join(swap_root, f"r{rank}")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap), device=RANK_DEVICE)
    engine_run(engine, batches(2))
    engine.save_checkpoint(root, tag="t")
    if rank == 1:
        real = CheckpointReader.scan_range

        def interrupted(self, *args, **kwargs):
            raise KeyboardInterrupt

        CheckpointReader.scan_range = interrupted
    try:
        engine.load_checkpoint(root, tag="t")
        outcome = "loaded"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except CheckpointError as error:
        outcome = f"CheckpointError: {error}"
    if rank == 1:
        CheckpointReader.scan_range = real
    engine.load_checkpoint(root, tag="t")  # both ranks still agree on the next load
    engine.close()
    return outcome


def test_ctrl_c_on_one_rank_while_checking_fails_the_load_on_both(tmp_path):
    from distributed_worker import launch

    results = launch(_interrupted_on_rank_1, 2, str(tmp_path / "ckpt"), str(tmp_path), deadline_s=90)
    assert all(r["ok"] for r in results), results
    assert results[1]["value"] == "KeyboardInterrupt"
    assert results[0]["value"].startswith("CheckpointError") and "rank 1" in results[0]["value"], results[0]["value"]
