"""Issue 16 at the checkpoint level: crafted checkpoints read nothing but the files the format
writes (regular files, up to their declared size), temp files that cannot be redirected,
stale saves judged by a lock, clear errors for bad destinations, and recovery in-process
after a swap I/O error by loading a checkpoint."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from reference import TinyNet, batches

import offload
from offload.checkpoint import engine_state as checkpoint
from offload.checkpoint.engine_state import CheckpointCorruptError, CheckpointError, CheckpointReader

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def config(swap, param="cpu", optimizer="cpu"):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap},
    }


def train(engine, data):
    for x, y in data:
        engine.backward((engine(x).float() - y).pow(2).mean())
        engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small checkpoint (with client_state), never modified: tests craft copies of it."""
    base = tmp_path_factory.mktemp("saved")
    swap = base / "swap"
    swap.mkdir()
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(str(swap)))
    train(engine, batches(2))
    engine.save_checkpoint(str(base / "ckpt"), client_state={"epoch": 3}, tag="t")
    engine.close()
    return base / "ckpt" / "t"


@pytest.fixture
def crafted(saved, tmp_path):
    directory = tmp_path / "t"
    shutil.copytree(saved, directory)
    return directory


def load_index(directory):
    with open(directory / "index.json", "rb") as f:
        data = json.load(f)
    data.pop("checksum")
    return data


def write_index(directory, index):
    """An attacker recomputes the checksums: they detect damage, not crafting."""
    (directory / "index.json").write_bytes(checkpoint.json_with_checksum(index))


def child(code: str, *args, timeout=120) -> subprocess.CompletedProcess:
    """Runs `code` with at most 6 GiB of address space, so a read without bound fails fast."""
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


READ_CHECKPOINT = """
import sys
from offload.checkpoint.engine_state import CheckpointReader, CheckpointError
try:
    with CheckpointReader(sys.argv[1]) as r:
        r.buffers(); r.client_state(); r.hf_config()
        for name in r.index["params"]:
            r.read_param(name)
    print("LOADED")
except CheckpointError as e:
    print("REFUSED", type(e).__name__, e)
"""


# ---- 3. crafted checkpoints ---------------------------------------------------------------------
@pytest.mark.host_only
@pytest.mark.parametrize(
    "name", ["../../../etc/hostname", "/etc/hostname", "rank0.json/../../x", "index.json", "notes.txt", "rank0.safetensors"]
)
def test_index_naming_a_file_the_format_never_writes_is_refused(crafted, name):
    index = load_index(crafted)
    index["files"][name] = {"bytes": 10, "crc32c": 0}  # e.g. a size oracle on /etc/hostname
    index["ranks"] = [name]
    write_index(crafted, index)
    result = child(READ_CHECKPOINT, crafted)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("REFUSED CheckpointCorruptError"), result.stdout
    assert "is malformed" in result.stdout and repr(name) in result.stdout, result.stdout


@pytest.mark.host_only
@pytest.mark.parametrize("target", ["/dev/zero", "/etc/hostname", "other-file"])
def test_symlinked_files_are_not_followed(crafted, target):
    if target == "other-file":
        target = str(crafted / "rank0.json")
    os.unlink(crafted / "client_state.pt")
    os.symlink(target, crafted / "client_state.pt")
    result = child(READ_CHECKPOINT, crafted)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED CheckpointCorruptError" in result.stdout and "symbolic link" in result.stdout, result.stdout
    assert str(crafted / "client_state.pt") in result.stdout


@pytest.mark.host_only
def test_a_device_or_fifo_in_place_of_a_file_is_refused(crafted):
    os.unlink(crafted / "client_state.pt")
    os.mkfifo(crafted / "client_state.pt")  # an open of a FIFO would block forever
    result = child(READ_CHECKPOINT, crafted, timeout=60)
    assert "REFUSED CheckpointCorruptError" in result.stdout and "not a regular file" in result.stdout, result.stdout
    if os.geteuid() == 0:
        os.unlink(crafted / "client_state.pt")
        os.mknod(crafted / "client_state.pt", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's device
        result = child(READ_CHECKPOINT, crafted, timeout=60)
        assert "not a regular file" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.host_only
def test_a_file_larger_than_declared_is_not_read(crafted):
    # a sparse 1 TiB file: reading it whole (as before) exhausts memory; its size is enough to refuse it
    with open(crafted / "client_state.pt", "r+b") as f:
        f.truncate(1 << 40)
    result = child(READ_CHECKPOINT, crafted, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED CheckpointCorruptError" in result.stdout and "the index says" in result.stdout, result.stdout


def test_latest_that_is_huge_or_a_link_is_refused(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved.parent, root)
    (root / "latest").unlink()
    os.symlink("/dev/zero", root / "latest")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        CheckpointReader(root)
    (root / "latest").unlink()
    with open(root / "latest", "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(CheckpointCorruptError, match="more than"):
        CheckpointReader(root)
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointCorruptError, match="not a checkpoint tag"):
        CheckpointReader(root)


def rewrite_rank_json(directory, edit):
    part = json.loads((directory / "rank0.json").read_bytes())
    edit(part)
    data = json.dumps(part, sort_keys=True).encode()
    (directory / "rank0.json").write_bytes(data)
    index = load_index(directory)
    index["files"]["rank0.json"] = {"bytes": len(data), "crc32c": checkpoint.crc32c(data)}
    write_index(directory, index)


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: p["slices"][0].update(offset=-4096),
        lambda p: p["slices"][0].update(offset=1 << 50),
        lambda p: p["slices"][0].update(end=p["slices"][0]["start"] - 1),
        lambda p: p["slices"][0].update(crc32c=[]),
        lambda p: p["slices"][0].update(kind="evil"),
        lambda p: p.update(file="../index.json"),
        lambda p: p.update(header_bytes=1 << 40),
        lambda p: p.update(slices="nope"),
    ],
    ids=["negative-offset", "offset-past-end", "end-before-start", "no-crcs", "kind", "file-name", "header", "slices"],
)
def test_crafted_rank_records_are_refused_before_use(crafted, edit):
    rewrite_rank_json(crafted, edit)
    with pytest.raises(CheckpointCorruptError, match="malformed|never writes"):
        CheckpointReader(crafted)


def test_a_parameter_claiming_more_elements_than_stored_is_refused_before_allocating(crafted):
    index = load_index(crafted)
    name = next(iter(index["params"]))
    index["params"][name].update(shape=[1 << 20, 1 << 20], numel=1 << 40)  # 4 TiB of fp32
    write_index(crafted, index)
    with CheckpointReader(crafted) as reader, pytest.raises(CheckpointCorruptError, match="its index says"):
        reader.read_param(name)


def test_client_state_that_would_run_code_is_refused(crafted, tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = pickle.dumps({"x": Evil()})
    (crafted / "client_state.pt").write_bytes(data)
    index = load_index(crafted)
    index["files"]["client_state.pt"] = {"bytes": len(data), "crc32c": checkpoint.crc32c(data)}
    write_index(crafted, index)
    with CheckpointReader(crafted) as reader, pytest.raises(CheckpointCorruptError, match="plain data"):
        reader.client_state()
    assert not marker.exists()


def test_torch_floor_excludes_the_weights_only_hole():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert '"torch>=2.6"' in text


@pytest.mark.host_only
def test_the_original_still_loads(saved):
    result = child(READ_CHECKPOINT, saved)
    assert "LOADED" in result.stdout, result.stdout + result.stderr[-2000:]


# ---- 7. temp files, stale saves, clear errors -------------------------------------------------------
@pytest.fixture
def engine(swap_dir):
    torch.manual_seed(0)
    e = offload.initialize(TinyNet(), config(swap_dir))
    train(e, batches(1))
    yield e
    e.close()


def test_planted_temp_symlinks_never_redirect_a_save_or_an_export(engine, tmp_path):
    root, out, victim = tmp_path / "ckpt", tmp_path / "out", tmp_path / "victim"
    root.mkdir()
    out.mkdir()
    victim.write_text("precious")
    # the names the temp files had before (pid-based, opened without O_EXCL and following links)
    os.symlink(victim, root / f".tmp-latest-{os.getpid()}")
    os.symlink(victim, out / f".tmp-model-{os.getpid()}.safetensors")
    engine.save_checkpoint(str(root), tag="a", client_state={})
    checkpoint.export(str(root), str(out))
    assert victim.read_text() == "precious"
    assert (root / "latest").read_text() == "a\n"


def test_export_fsyncs_config_json(engine, tmp_path, monkeypatch, saved):
    synced = []
    real = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    root = tmp_path / "ckpt"
    shutil.copytree(saved.parent, root)
    index = load_index(root / "t")
    data = b'{"model_type": "tiny"}'
    (root / "t" / "hf_config.json").write_bytes(data)
    index["files"]["hf_config.json"] = {"bytes": len(data), "crc32c": checkpoint.crc32c(data)}
    write_index(root / "t", index)
    monkeypatch.setattr(os, "fsync", recording)
    checkpoint.export(str(root), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_bytes()) == {"model_type": "tiny", "dtype": "float32"}
    # written and fsynced in the save's temporary directory, then moved in and the directory fsynced
    assert any(p.endswith("/config.json") and "/.tmp-offload-save-" in p for p in synced), synced
    assert str(tmp_path / "out") in synced
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


def test_stale_saves_are_judged_by_their_lock_not_by_a_pid(engine, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    # pid 1 is alive here, but this directory was left by a save on another machine: stale
    (root / ".tmp-x-1").mkdir()
    (root / ".tmp-x-1" / "rank0.safetensors").write_bytes(b"partial")
    # a live save elsewhere whose pid means nothing here: it holds its lock, so it is kept
    busy = root / f".tmp-y-{2**22 + 3}"
    busy.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
    """),
            str(busy),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        engine.save_checkpoint(str(root), tag="a")
        assert sorted(os.listdir(root)) == [".tmp-y-4194307", "a", "latest"]
    finally:
        holder.kill()
        holder.wait()
    engine.save_checkpoint(str(root), tag="b")  # the holder died: its directory is stale now
    assert sorted(os.listdir(root)) == ["a", "b", "latest"]


def test_export_to_a_file_is_a_clear_error_without_traceback(saved, tmp_path, capsys):
    from offload.cli import main

    target = tmp_path / "model.safetensors"
    target.write_text("not a directory")
    assert main(["export", str(saved), str(target)]) == 1
    err = capsys.readouterr().err
    assert str(target) in err and "is a file, not a directory" in err and "Traceback" not in err
    assert main(["export", str(saved), str(target / "sub")]) == 1
    err = capsys.readouterr().err
    assert str(target / "sub") in err and "Traceback" not in err


def test_save_to_a_file_or_an_unwritable_place_is_a_clear_error(engine, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="it is a file, not a directory") as e:
        engine.save_checkpoint(str(a_file))
    assert str(a_file) in str(e.value)
    with pytest.raises(CheckpointError) as e:
        engine.save_checkpoint(str(a_file / "below"))
    assert str(a_file / "below") in str(e.value) and "choose a directory" in str(e.value)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True, check=False
        ).returncode
        == 0
    )
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("cannot mount a read-only tmpfs here")
        readonly.chmod(0o500)
    try:
        with pytest.raises(CheckpointError) as e:
            engine.save_checkpoint(str(readonly / "ckpt"))
        assert str(readonly / "ckpt") in str(e.value) and "choose a directory you can write to" in str(e.value)
    finally:
        if mounted:
            subprocess.run(["umount", str(readonly)], check=False)
    train(engine, batches(1))  # training goes on


# ---- 4. recovery in-process after a swap I/O error ----------------------------------------------
RECOVERY = """
import copy, errno, sys, torch, offload
from reference import TinyNet, batches
swap, root, op, phase, err = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], getattr(errno, sys.argv[5])
count = None if sys.argv[6] == "every" else int(sys.argv[6])
config = {"precision": "fp32", "optimizer": {"lr": 1e-2},
          "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": swap}}
torch.manual_seed(0)
model = TinyNet()
data = batches(6)
def step(engine, x, y, fault=None):
    if fault == "forward": engine.store.swap.engine.set_fault(op, err, count=count)
    loss = (engine(x).float() - y).pow(2).mean()
    if fault == "backward": engine.store.swap.engine.set_fault(op, err, count=count)
    engine.backward(loss)
    if fault == "step": engine.store.swap.engine.set_fault(op, err, count=count)
    engine.step()
with offload.initialize(copy.deepcopy(model), config) as ref:
    for x, y in data: step(ref, x, y)
    expected = ref.consolidated_state_dict()
engine = offload.initialize(copy.deepcopy(model), config)
for x, y in data[:2]: step(engine, x, y)
engine.save_checkpoint(root, tag="good")
try:
    for x, y in data[2:]: step(engine, x, y, fault=phase); phase = None
    print("NO ERROR")
except Exception as e:
    print("ERROR", type(e).__name__)
engine.store.swap.engine.clear_fault()
engine.load_checkpoint(root)  # what the error message advises; must work at once
for x, y in data[2:]: step(engine, x, y)
got = engine.consolidated_state_dict()
print("IDENTICAL" if all(torch.equal(got[k], expected[k]) for k in got) else "DIFFERENT")
engine.close()
"""


@pytest.mark.parametrize(
    "op,phase,err,failures",
    [
        ("write", "backward", "EIO", "1"),
        ("read", "forward", "EIO", "1"),
        ("write", "forward", "ENOSPC", "1"),
        ("write", "step", "EIO", "1"),
        # From backward on, reads race the step's optimizer-state reads issued ahead of it, and a
        # failed read ahead is read again (tests/test_nvme_step_io.py): one failed read may be
        # absorbed, so these disks fail every read from then on, which must surface.
        ("read", "backward", "EIO", "every"),
        ("read", "step", "EIO", "every"),
    ],
)
def test_swap_io_error_then_load_checkpoint_recovers_in_process(tmp_path, op, phase, err, failures):
    swap = tmp_path / "swap"
    swap.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", RECOVERY, str(swap), str(tmp_path / "ckpt"), op, phase, err, failures],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE])),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    words = result.stdout.split()
    assert words == ["ERROR", words[1], "IDENTICAL"], result.stdout
    assert os.listdir(swap) == []


def test_reader_closes_what_it_opened(saved):
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with CheckpointReader(saved) as reader:
            reader.client_state()
    with pytest.raises(CheckpointError):
        CheckpointReader(saved.parent / "absent")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_save_in_progress_holds_its_lock(engine, tmp_path):
    """While a save runs, its temp directory is locked (so a concurrent save's sweep keeps it)."""
    root = tmp_path / "ckpt"
    seen = []

    def progress(done, total):
        if not seen:
            temp = next(e for e in os.listdir(root) if e.startswith(".tmp-a-"))
            fd = os.open(root / temp, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("unlocked")
            except BlockingIOError:
                seen.append("locked")
            finally:
                os.close(fd)

    engine.save_checkpoint(str(root), tag="a", progress=progress)
    assert seen == ["locked"]


@pytest.mark.parametrize("param,optimizer", [("nvme", "nvme"), ("none", "cpu")])
def test_gradients_an_interrupted_backward_left_do_not_survive_a_load(tmp_path, swap_dir, param, optimizer):
    """SIGINT in backward (seen in the soak) leaves some parameters' .grad on the device; the
    load that recovers must drop them, or the next backward adds to them."""
    data = batches(5)
    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer)) as ref:
        train(ref, data)
        expected = ref.consolidated_state_dict()
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, param, optimizer))
    train(engine, data[:2])
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="a")
    for p in engine.model.parameters():  # what the interrupted backward left behind
        p.grad = torch.ones_like(p)
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    train(engine, data[2:])
    got = engine.consolidated_state_dict()
    engine.close()
    assert all(torch.equal(got[k], expected[k]) for k in got)
