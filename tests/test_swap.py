import errno
import os
import re
import shutil
import stat

import pytest
import torch

from offload.errors import InsufficientSpaceError, SwapCorruptError, SwapError
from offload.storage.memory import HostBufferPool, TierLedger
from offload.storage.swap import SwapStore
from offload.storage.swap_layout import HEADER_SIZE

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@pytest.fixture
def pool():
    p = HostBufferPool(1 << 28, pin=False)
    yield p
    p.close()


@pytest.fixture
def store(tmp_path):
    s = SwapStore(tmp_path, run_name="t", block_size=8192, queue_depth=4, threads=3)
    yield s
    s.close()


def fill_random(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    t.view(torch.uint8).copy_(raw) if t.numel() else None  # every bit pattern, NaNs included
    return t


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_unaligned_sizes(store, pool, dtype):
    item = torch.empty((), dtype=dtype).element_size()
    for k, nbytes in enumerate((0, item, 4095, 4096, 4097, 3 * 8192 + 5)):
        numel = nbytes // item
        name = f"w.{dtype}.{k}"
        store.create(name, numel, dtype)
        src = fill_random(pool.alloc(numel, dtype), numel)
        store.write_from(name, src).wait()
        dst = pool.alloc(numel, dtype)
        h = store.read_into(name, dst)
        h.wait()
        assert h.done() and same_bits(src, dst), name


def test_unaligned_plain_tensor_goes_through_buffered_fd(store):
    store.create("plain", 1001, torch.float32)
    src = torch.randn(1001)
    store.write_from("plain", src).wait()
    dst = torch.empty(2002)[1::2].contiguous()[:1001]  # an ordinary torch allocation
    store.read_into("plain", dst).wait()
    assert torch.equal(src, dst)


def test_unwritten_tensor_reads_as_zeros(store, pool):
    store.create("fresh", 5000, torch.float32)
    dst = pool.alloc(5000, torch.float32).fill_(3.0)
    store.read_into("fresh", dst).wait()
    assert not dst.any()


def test_read_after_write_in_flight_is_ordered(store, pool):
    store.reserve({"a": (20_000, torch.float32), "b": (20_000, torch.float32)})
    first = fill_random(pool.alloc(20_000, torch.float32), 1)
    second = fill_random(pool.alloc(20_000, torch.float32), 2)
    store.write_from("a", first).wait()
    store.engine.set_delay(0.02)  # keeps the write in flight when the read is submitted
    hw = store.write_from("a", second)
    assert not hw.done()
    dst = pool.alloc(20_000, torch.float32)
    hr = store.read_into("a", dst)
    hr.wait()
    assert same_bits(dst, second)
    hw.wait()  # already completed by the ordering; waiting again is harmless
    # write-after-read: a write submitted while a read is in flight does not change what it reads
    out = pool.alloc(20_000, torch.float32)
    hr = store.read_into("a", out)
    store.write_from("a", first).wait()
    hr.wait()
    assert same_bits(out, second)
    store.engine.set_delay(0)


def test_many_concurrent_names(store, pool):
    n = 200
    store.reserve({f"p{i}": (1000 + i, torch.bfloat16) for i in range(n)})
    srcs = [fill_random(pool.alloc(1000 + i, torch.bfloat16), i) for i in range(n)]
    handles = [store.write_from(f"p{i}", s) for i, s in enumerate(srcs)]
    [h.wait() for h in handles]
    dsts = [pool.alloc(1000 + i, torch.bfloat16) for i in range(n)]
    handles = [store.read_into(f"p{i}", d) for i, d in enumerate(dsts)]
    [h.wait() for h in reversed(handles)]
    assert all(same_bits(s, d) for s, d in zip(srcs, dsts))


def test_modes_layout_and_close_leaves_nothing(tmp_path, pool):
    ledger = TierLedger()
    s = SwapStore(tmp_path, rank=3, ledger=ledger)
    s.reserve({"x": (1000, torch.float32), "y/slash name": (1, torch.int8)})
    assert s.path == str(tmp_path / s.run_name / "rank3")
    assert stat.S_IMODE(os.stat(s.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o700
    assert os.listdir(s.path) == []  # the files have no name: the kernel frees them on any exit
    for name in ("x", "y/slash name"):
        st = os.stat(s.proc_path(name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 0
        assert st.st_blocks * 512 >= st.st_size  # space reserved up front (fallocate)
    assert s.nbytes_on_disk() == (HEADER_SIZE + 4096) * 2
    assert ledger.report()["nvme"]["current"] == s.nbytes_on_disk()
    s.write_from("x", pool.alloc(1000, torch.float32))  # pending at close: waited for, then removed
    s.close()
    assert os.listdir(tmp_path) == []
    assert ledger.report()["nvme"]["current"] == 0
    with pytest.raises(SwapError, match="closed"):
        s.create("z", 1, torch.float32)


def _written(store, pool, name="t", numel=3000, dtype=torch.float32):
    store.create(name, numel, dtype)
    src = fill_random(pool.alloc(numel, dtype), 7)
    store.write_from(name, src).wait()
    return src


def test_truncated_file_detected(store, pool):
    _written(store, pool)
    path = store.file_path("t")
    os.truncate(store.proc_path("t"), HEADER_SIZE + 4096)
    with pytest.raises(SwapCorruptError, match="truncated") as e:
        store.read_into("t", pool.alloc(3000, torch.float32))
    assert e.value.filename == path and path in str(e.value)


def test_flipped_data_byte_detected(store, pool):
    src = _written(store, pool)
    path = store.file_path("t")
    with open(store.proc_path("t"), "r+b") as f:
        f.seek(HEADER_SIZE + 5000)
        b = f.read(1)
        f.seek(HEADER_SIZE + 5000)
        f.write(bytes([b[0] ^ 0x10]))
    dst = pool.alloc(3000, torch.float32)
    h = store.read_into("t", dst)
    with pytest.raises(SwapCorruptError, match="checksum .* does not match") as e:
        h.wait()
    assert e.value.filename == path and "'t'" in str(e.value)
    store.write_from("t", src).wait()  # rewriting repairs it
    store.read_into("t", dst).wait()
    assert same_bits(src, dst)


def test_flipped_byte_in_padding_is_harmless(store, pool):
    src = _written(store, pool)  # 12000 data bytes, padded to 12288
    with open(store.proc_path("t"), "r+b") as f:
        f.seek(HEADER_SIZE + 12100)
        f.write(b"\xff")
    dst = pool.alloc(3000, torch.float32)
    store.read_into("t", dst).wait()
    assert same_bits(src, dst)


@pytest.mark.parametrize("damage", ["magic", "header_byte", "foreign_header", "zeros"])
def test_wrong_header_detected(store, pool, damage):
    _written(store, pool)
    _written(store, pool, name="other", numel=100, dtype=torch.int64)
    path = store.file_path("t")
    with open(store.proc_path("t"), "r+b") as f:
        if damage == "magic":
            f.write(b"NOTSWAP!")
        elif damage == "header_byte":
            f.seek(20)
            b = f.read(1)
            f.seek(20)
            f.write(bytes([b[0] ^ 1]))
        elif damage == "foreign_header":
            with open(store.proc_path("other"), "rb") as g:
                f.write(g.read(HEADER_SIZE))
        else:
            f.write(bytes(HEADER_SIZE))
    with pytest.raises(SwapCorruptError, match="wrong header") as e:
        store.read_into("t", pool.alloc(3000, torch.float32))
    assert path in str(e.value)
    if damage == "foreign_header":
        assert "int64 [100]" in str(e.value) and "float32 [3000]" in str(e.value)


def test_enospc_during_write_reported_others_intact(store, pool):
    keep = _written(store, pool, name="keep")
    victim_old = _written(store, pool, name="victim")
    store.engine.set_fault("write", errno.ENOSPC, after_offset=HEADER_SIZE + 4096)
    with pytest.raises(SwapError) as e:
        store.write_from("victim", fill_random(pool.alloc(3000, torch.float32), 99)).wait()
    store.engine.clear_fault()
    assert e.value.errno == errno.ENOSPC
    assert store.file_path("victim") in str(e.value) and "'victim'" in str(e.value)
    dst = pool.alloc(3000, torch.float32)
    store.read_into("keep", dst).wait()
    assert same_bits(keep, dst)
    with pytest.raises(SwapCorruptError, match="last write failed"):
        store.read_into("victim", dst)
    store.write_from("victim", victim_old).wait()
    store.read_into("victim", dst).wait()
    assert same_bits(victim_old, dst)


def test_reserve_more_than_free_disk_fails_before_creating(store):
    free = shutil.disk_usage(store.path).free
    with pytest.raises(InsufficientSpaceError) as e:
        store.reserve({"small": (10, torch.float32), "huge": (free, torch.float64)})
    msg = str(e.value)
    # the free bytes it names, measured again by the store: other processes (a second pytest-xdist
    # worker) write to the same disk meanwhile, so the two measures agree to within 1%, not exactly
    named = re.search(r"only (\d+) bytes .* are free in", msg)
    assert "needs" in msg and named, msg
    assert abs(int(named.group(1)) - free) <= 0.01 * free, msg
    assert os.listdir(store.path) == [] and store.names() == []


def test_bad_names_and_buffers(store, pool):
    store.create("n", 10, torch.float32)
    with pytest.raises(ValueError, match="already exists"):
        store.create("n", 10, torch.float32)
    with pytest.raises(KeyError, match="create"):
        store.read_into("missing", pool.alloc(10, torch.float32))
    with pytest.raises(ValueError, match=r"float32\[10\], the buffer is float16\[10\]"):
        store.write_from("n", pool.alloc(10, torch.float16))


def test_missing_path(tmp_path):
    with pytest.raises(SwapError, match="does not exist; create it") as e:
        SwapStore(tmp_path / "absent")
    assert e.value.errno == errno.ENOENT and str(tmp_path / "absent") in str(e.value)


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SwapError, match="is not a directory") as e:
        SwapStore(f)
    assert str(f) in str(e.value)


def test_unwritable_path():
    with pytest.raises(SwapError, match="/proc is not writable"):  # root cannot create files in /proc either
        SwapStore("/proc")


def test_same_run_and_rank_twice_refused(tmp_path):
    a = SwapStore(tmp_path, run_name="r", rank=0)
    b = SwapStore(tmp_path, run_name="r", rank=1)  # other ranks share the run directory
    with pytest.raises(SwapError, match="already exists"):
        SwapStore(tmp_path, run_name="r", rank=0)
    a.close()
    assert os.listdir(tmp_path / "r") == ["rank1"]
    b.close()
    assert os.listdir(tmp_path) == []


def test_buffered_fallback_store(tmp_path, pool, o_direct_refused):
    s = SwapStore(tmp_path)
    try:
        assert s.direct is False
        src = _written(s, pool, numel=5001)
        dst = pool.alloc(5001, torch.float32)
        s.read_into("t", dst).wait()
        assert same_bits(src, dst)
    finally:
        s.close()


def test_tmpfs_round_trip(pool):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    s = SwapStore("/dev/shm")
    try:
        src = _written(s, pool, numel=1025)
        dst = pool.alloc(1025, torch.float32)
        s.read_into("t", dst).wait()
        assert same_bits(src, dst)
    finally:
        s.close()
    assert not os.path.exists(s.run_dir)
