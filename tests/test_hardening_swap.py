"""Issue 16 at the swap level: nothing left behind on any death, hostile nvme_path entries never
followed, swap files that know whose they are and which write they hold, recovery after an
I/O error, and (issue 11) waits that an interrupt cannot turn into a false completion."""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from offload.errors import InsufficientSpaceError, SwapCorruptError, SwapError
from offload.storage.memory import HostBufferPool
from offload.storage.swap import SwapStore
from offload.storage.swap_layout import HEADER_SIZE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def pool():
    p = HostBufferPool(1 << 26, pin=False)
    yield p
    p.close()


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 MiB tmpfs of its own: the bytes it uses are exactly what the swap files hold."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=700", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def used_bytes(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def tree(path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        found += [os.path.relpath(os.path.join(dirpath, d), path) + "/" for d in dirnames]
        found += [os.path.relpath(os.path.join(dirpath, f), path) for f in filenames]
    return sorted(found)


def child(code: str, *args, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        **kwargs,
    )


def fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g))
    return t


# ---- 1. nothing left behind -------------------------------------------------------------------
HOLD_SWAP = """
import sys, time, torch
from offload.storage.memory import HostBufferPool
from offload.storage.swap import SwapStore
s = SwapStore(sys.argv[1], rank=0)
s.reserve({"a": (2 << 20, torch.float32), "b": (2 << 20, torch.float32)})
pool = HostBufferPool(1 << 24, pin=False)
s.write_from("a", pool.alloc(2 << 20, torch.float32).fill_(1)).wait()
print("ready", flush=True)
sys.stdin.readline()  # the parent has measured
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("uncaught")
if how == "exit":
    sys.exit(0)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["sigkill", "raise", "exit"])
def test_swap_space_is_reclaimed_on_any_death(tmpfs, how):
    before = used_bytes(tmpfs)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SWAP, str(tmpfs), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert used_bytes(tmpfs) - before >= 16 << 20  # two 8 MiB files, reserved
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if how == "sigkill":
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert used_bytes(tmpfs) - before < 1 << 20, "the dead run's swap space was not reclaimed"
    assert not [f for f in tree(tmpfs) if f.endswith(".swp")]
    if how != "sigkill":
        assert tree(tmpfs) == []  # atexit removed the directories too
    # the next store on the same path removes what a SIGKILL left (its empty directories)
    with SwapStore(tmpfs, run_name="next") as s:
        assert tree(tmpfs) == ["next/", "next/rank0/"] and s.other_runs == []
    assert tree(tmpfs) == []


def test_engine_exit_without_close_leaves_nothing(swap_dir):
    result = child(
        """
        import sys, torch, offload
        from reference import TinyNet
        config = {"precision": "fp32", "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": sys.argv[1]}}
        engine = offload.initialize(TinyNet(), config)
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        raise SystemExit
    """,
        swap_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert tree(swap_dir) == []


def test_store_dropped_by_the_garbage_collector_leaves_nothing(swap_dir, pool):
    s = SwapStore(swap_dir)
    s.create("x", 1000, torch.float32)
    s.write_from("x", pool.alloc(1000, torch.float32))  # in flight when dropped
    del s
    gc.collect()
    assert tree(swap_dir) == []


def test_live_runs_are_not_swept_and_are_named_when_space_runs_out(swap_dir):
    a = SwapStore(swap_dir)  # alive: holds its flock
    b = SwapStore(swap_dir)
    try:
        assert a.run_name != b.run_name and b.other_runs == [a.run_name]
        assert os.path.isdir(a.path)
        with pytest.raises(InsufficientSpaceError) as e:
            b.create("huge", 1 << 60, torch.float32)
        assert a.run_name in str(e.value) and "still alive" in str(e.value)
    finally:
        a.close()
        b.close()
    assert tree(swap_dir) == []


def test_dead_runs_left_by_older_versions_are_swept_and_foreign_dirs_kept(swap_dir):
    # offload before this change: named swap files in run-<pid>/rank<r>/ (a pid that is gone,
    # or this very pid left by a previous container)
    dead_pid = 2**22 + 17
    for name in (f"run-{dead_pid}", f"run-{os.getpid()}"):
        os.makedirs(os.path.join(swap_dir, name, "rank0"), mode=0o700)
        os.chmod(os.path.join(swap_dir, name), 0o700)
        with open(os.path.join(swap_dir, name, "rank0", "unit0.master.swp"), "wb") as f:
            f.write(b"x" * 10000)
    os.makedirs(os.path.join(swap_dir, "mine", "rank0"), mode=0o700)  # someone's directory
    os.chmod(os.path.join(swap_dir, "mine"), 0o700)
    with open(os.path.join(swap_dir, "mine", "rank0", "notes.txt"), "w") as f:
        f.write("keep me")
    os.mkdir(os.path.join(swap_dir, "empty-user-dir"), 0o700)
    with SwapStore(swap_dir, run_name="now"):
        pass
    assert tree(swap_dir) == ["empty-user-dir/", "mine/", "mine/rank0/", "mine/rank0/notes.txt"]


def test_two_nvme_engines_in_one_process_do_not_collide(swap_dir):
    from reference import TinyNet

    import offload

    config = {"precision": "fp32", "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": swap_dir}}
    first = offload.initialize(TinyNet(), config)
    second = offload.initialize(TinyNet(), config)
    try:
        assert first.store.swap.run_name != second.store.swap.run_name
        for engine in (first, second):
            loss = engine(torch.randn(4, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    finally:
        first.close()
        second.close()
    assert tree(swap_dir) == []


def test_default_run_names_are_unique():
    from offload.storage.tiers import default_run_name

    names = {default_run_name() for _ in range(100)}
    assert len(names) == 100 and all(str(os.getpid()) in n for n in names)


# ---- 2. hostile nvme_path -----------------------------------------------------------------------
@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim"
    (v / "rank0").mkdir(parents=True)
    (v / "rank0" / "precious").write_text("do not delete")
    (v / "precious").write_text("do not delete")
    return v


def test_planted_run_symlink_is_refused(swap_dir, victim):
    os.symlink(victim, os.path.join(swap_dir, "r"))
    with pytest.raises(SwapError, match="not a directory this run created") as e:
        SwapStore(swap_dir, run_name="r", rank=1)
    assert os.path.join(swap_dir, "r") in str(e.value)
    assert tree(victim) == ["precious", "rank0/", "rank0/precious"]


def test_run_dir_repointed_during_training_close_deletes_nothing_outside(swap_dir, victim, pool):
    s = SwapStore(swap_dir, run_name="r")
    s.create("x", 1000, torch.float32)
    s.write_from("x", fill(pool.alloc(1000, torch.float32), 1)).wait()
    os.rename(os.path.join(swap_dir, "r"), os.path.join(swap_dir, "moved"))
    os.symlink(victim, os.path.join(swap_dir, "r"))
    dst = pool.alloc(1000, torch.float32)
    s.read_into("x", dst).wait()  # still its own file, by descriptor
    s.close()
    assert tree(victim) == ["precious", "rank0/", "rank0/precious"]
    assert os.path.islink(os.path.join(swap_dir, "r")) and os.listdir(os.path.join(swap_dir, "moved")) == []


@pytest.mark.parametrize("problem", ["mode", "owner", "file"])
def test_existing_run_dir_that_is_not_private_is_refused(swap_dir, problem):
    path = os.path.join(swap_dir, "r")
    if problem == "file":
        open(path, "w").close()
    else:
        os.mkdir(path)
        os.chmod(path, 0o777 if problem == "mode" else 0o700)
        if problem == "owner":
            if os.geteuid() != 0:
                pytest.skip("needs root to give a directory to another user")
            os.chown(path, 12345, 12345)
    with pytest.raises(SwapError) as e:
        SwapStore(swap_dir, run_name="r", rank=1)
    expected = {"mode": "has mode 777, not 700", "owner": "owned by uid 12345", "file": "not a directory"}[problem]
    assert expected in str(e.value) and path in str(e.value)
    assert sorted(os.listdir(swap_dir)) == ["r"]  # nothing created in or next to it
    if problem != "file":
        assert os.listdir(path) == []


def test_planted_rank_symlink_is_refused(swap_dir, victim):
    a = SwapStore(swap_dir, run_name="r", rank=0)
    try:
        os.symlink(victim, os.path.join(a.run_dir, "rank1"))
        with pytest.raises(SwapError, match="already exists"):
            SwapStore(swap_dir, run_name="r", rank=1)
    finally:
        a.close()
    assert tree(victim) == ["precious", "rank0/", "rank0/precious"]


def test_world_writable_nvme_path_without_sticky_bit_warns(tmp_path, caplog):
    for mode, warns in ((0o777, True), (0o1777, False), (0o755, False)):
        root = tmp_path / f"m{mode:o}"
        root.mkdir()
        os.chmod(root, mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offload.storage.swap_layout"):
            SwapStore(root).close()
        assert any("no sticky bit" in r.message for r in caplog.records) == warns, oct(mode)


def test_run_name_must_be_a_plain_name(swap_dir):
    for bad in (".", "..", "a/b", ".hidden", "a\0b"):
        with pytest.raises(ValueError, match="plain directory name"):
            SwapStore(swap_dir, run_name=bad)


# ---- 5. identity and generation in the header --------------------------------------------------
@pytest.fixture
def store(swap_dir):
    s = SwapStore(swap_dir, run_name="t", block_size=8192, queue_depth=2, threads=2)
    yield s
    s.close()


def swap_file(store, name) -> str:
    """Where this process can open the swap file (it has no name on disk; before issue 16 it had)."""
    return store.proc_path(name) if hasattr(store, "proc_path") else store.file_path(name)


def raw(store, name) -> bytes:
    with open(swap_file(store, name), "rb") as f:
        return f.read()


def put(store, name, data: bytes) -> None:
    with open(swap_file(store, name), "r+b") as f:
        f.write(data)


def test_another_tensors_file_copied_over_is_detected(store, pool):
    store.reserve({"a": (3000, torch.float32), "b": (3000, torch.float32)})
    store.write_from("a", fill(pool.alloc(3000, torch.float32), 1)).wait()
    store.write_from("b", fill(pool.alloc(3000, torch.float32), 2)).wait()
    put(store, "a", raw(store, "b"))  # self-consistent, same dtype and shape
    with pytest.raises(SwapCorruptError, match="it is the file of 'b'") as e:
        store.read_into("a", pool.alloc(3000, torch.float32))
    assert e.value.filename == store.file_path("a") and store.file_path("a") in str(e.value)


def test_an_older_self_consistent_copy_is_detected(store, pool):
    store.create("a", 3000, torch.float32)
    store.write_from("a", fill(pool.alloc(3000, torch.float32), 1)).wait()
    old = raw(store, "a")
    store.write_from("a", fill(pool.alloc(3000, torch.float32), 2)).wait()
    put(store, "a", old)
    with pytest.raises(SwapCorruptError, match="generation 1, but this store last wrote generation 2") as e:
        store.read_into("a", pool.alloc(3000, torch.float32))
    assert store.file_path("a") in str(e.value)


def test_another_runs_file_is_detected(store, swap_dir, pool):
    store.create("a", 3000, torch.float32)
    store.write_from("a", fill(pool.alloc(3000, torch.float32), 1)).wait()
    with SwapStore(swap_dir, run_name="other") as other:
        other.create("a", 3000, torch.float32)
        other.write_from("a", fill(pool.alloc(3000, torch.float32), 1)).wait()
        put(store, "a", raw(other, "a"))
    with pytest.raises(SwapCorruptError, match="written by another run"):
        store.read_into("a", pool.alloc(3000, torch.float32))


def test_an_unwritten_file_replaced_by_a_written_one_is_detected(store, pool):
    store.reserve({"a": (3000, torch.float32), "b": (3000, torch.float32)})
    store.write_from("b", fill(pool.alloc(3000, torch.float32), 2)).wait()
    put(store, "a", raw(store, "b")[:HEADER_SIZE].replace(b"b", b"a", 0))  # header only: still foreign
    with pytest.raises(SwapCorruptError):
        store.read_into("a", pool.alloc(3000, torch.float32))


# ---- 4. recovery after an I/O error -------------------------------------------------------------
def wait_all(handles: list) -> None:
    """What a caller's wait list does (state.OptimizerSlot.wait_writes): wait in order, clear
    only when every wait returned."""
    for h in handles:
        h.wait()
    handles.clear()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_failed_write_raises_once_and_the_store_recovers(store, pool, err):
    store.reserve({n: (3000, torch.float32) for n in "abc"})
    srcs = {n: fill(pool.alloc(3000, torch.float32), i) for i, n in enumerate("abc")}
    pending = [store.write_from("a", srcs["a"])]
    pending[0].wait()
    store.engine.set_fault("write", err, count=1)
    pending = [store.write_from(n, srcs[n]) for n in "abc"]
    with pytest.raises(SwapError) as e:
        wait_all(pending)
    assert e.value.errno == err and "swap write of" in str(e.value)
    wait_all(pending)  # the failure was reported: the list drains, nothing re-raises forever
    assert pending == []
    failed = [n for n in "abc" if store._entries[n].state == 2]
    assert len(failed) == 1
    dst = pool.alloc(3000, torch.float32)
    with pytest.raises(SwapCorruptError, match="last write failed"):
        store.read_into(failed[0], dst)  # never what the failed write left
    for n in "abc":  # what load_checkpoint does: write everything again, then read
        store.write_from(n, srcs[n]).wait()
        store.read_into(n, dst).wait()
        assert torch.equal(dst.view(torch.uint8), srcs[n].view(torch.uint8))


def test_settle_takes_every_unreported_failure_off_the_books(store, pool):
    """load_checkpoint's first move: a failed step's wait lists then drain at once."""
    store.reserve({n: (3000, torch.float32) for n in "abcd"})
    srcs = {n: fill(pool.alloc(3000, torch.float32), i) for i, n in enumerate("abcd")}
    store.engine.set_fault("write", errno.EIO)  # every write fails
    pending = [store.write_from(n, srcs[n]) for n in "abcd"]
    errors = store.settle()
    store.engine.clear_fault()
    assert sorted(str(e).split("'")[1] for e in errors) == list("abcd")
    wait_all(pending)  # nothing left to raise
    assert store.settle() == []
    for n in "abcd":
        store.write_from(n, srcs[n]).wait()


def test_a_failed_read_raises_once_and_the_next_read_works(store, pool):
    store.create("a", 3000, torch.float32)
    src = fill(pool.alloc(3000, torch.float32), 1)
    store.write_from("a", src).wait()
    store.engine.set_fault("read", errno.EIO, count=1)
    h = store.read_into("a", pool.alloc(3000, torch.float32))
    with pytest.raises(SwapError, match="swap read of 'a' failed"):
        h.wait()
    h.wait()
    dst = pool.alloc(3000, torch.float32)
    store.read_into("a", dst).wait()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


# ---- issue 11: interrupted waits ----------------------------------------------------------------
class Interrupt(BaseException):
    pass


@pytest.fixture
def interrupt_after():
    def handler(signum, frame):
        raise Interrupt()

    previous = signal.signal(signal.SIGUSR1, handler)

    def arm(seconds: float) -> None:
        threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1)).start()

    yield arm
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("then", ["read", "wait_again", "close"])
def test_an_interrupted_write_is_remembered_until_it_completes(store, pool, interrupt_after, then):
    n = 64 * 1024
    store.create("w", n, torch.float32)
    src = fill(pool.alloc(n, torch.float32), 3)
    store.engine.set_delay(0.05)  # 32 pieces of 8 KiB, two at a time: ~0.8 s in flight
    h = store.write_from("w", src)
    interrupt_after(0.1)
    with pytest.raises(Interrupt):
        h.wait()
    assert not h.done() or store._entries["w"].pending is h  # not taken for complete
    store.engine.set_delay(0)
    if then == "wait_again":
        h.wait()  # the real result
    elif then == "close":
        store.close()  # completes it (and would report an error)
        return
    dst = pool.alloc(n, torch.float32)
    store.read_into("w", dst).wait()  # ordered after the write: its data, never zeros
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    h.wait()


def test_an_interrupted_read_can_be_waited_again(store, pool, interrupt_after):
    n = 64 * 1024
    store.create("r", n, torch.float32)
    src = fill(pool.alloc(n, torch.float32), 4)
    store.write_from("r", src).wait()
    store.engine.set_delay(0.05)
    dst = pool.alloc(n, torch.float32)
    h = store.read_into("r", dst)
    interrupt_after(0.1)
    with pytest.raises(Interrupt):
        h.wait()
    store.engine.set_delay(0)
    h.wait()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_ctrl_c_during_a_swap_write_then_read_gives_the_data(swap_dir):
    result = child(
        """
        import os, signal, sys, threading, torch
        from offload.storage.memory import HostBufferPool
        from offload.storage.swap import SwapStore
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with it ignored
        s = SwapStore(sys.argv[1], block_size=8192, queue_depth=1, threads=1)
        pool = HostBufferPool(1 << 24, pin=False)
        s.create("w", 1 << 16, torch.float32)
        src = pool.alloc(1 << 16, torch.float32).copy_(torch.arange(1 << 16, dtype=torch.float32))
        s.engine.set_delay(0.2)  # 32 blocks one at a time: the write is still in flight when the timer fires
        h = s.write_from("w", src)
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            h.wait()
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        s.engine.set_delay(0)
        dst = pool.alloc(1 << 16, torch.float32)
        s.read_into("w", dst).wait()
        print("same" if torch.equal(dst, src) else "zeros" if not dst.any() else "different")
        s.close()
    """,
        swap_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["interrupted", "same"]
    assert tree(swap_dir) == []


def test_close_waits_for_a_write_whose_owner_was_interrupted_elsewhere(store, pool):
    store.create("w", 4096, torch.float32)
    store.engine.set_delay(0.05)
    h = store.write_from("w", fill(pool.alloc(4096, torch.float32), 5))
    del h  # the owner is gone; the store still completes it
    time.sleep(0.01)
    store.engine.set_delay(0)
    assert store._entries["w"].pending is not None
    store.close()
    assert store._entries == {}
    assert stat.S_ISDIR(os.stat(store.root).st_mode)


def test_a_forked_child_exiting_leaves_the_parents_store_alone(swap_dir, pool):
    s = SwapStore(swap_dir)
    s.create("x", 1000, torch.float32)
    src = fill(pool.alloc(1000, torch.float32), 9)
    s.write_from("x", src).wait()
    pid = os.fork()
    if pid == 0:  # a data loader worker, say, that exits normally: atexit and gc run there
        code = 1
        try:
            from offload.storage import swap

            swap._close_live_stores()  # what atexit does
            s.close()
            del s
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert os.path.isdir(s.path)  # the child removed nothing
    dst = pool.alloc(1000, torch.float32)
    s.read_into("x", dst).wait()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    s.close()
    assert tree(swap_dir) == []
