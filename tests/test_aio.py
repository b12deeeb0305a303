import errno
import os
import time

import pytest
import torch

from offload import _aio_ext
from offload.errors import SwapError
from offload.storage.aio import AioEngine, crc32c, probe_o_direct
from offload.storage.memory import HostBufferPool


@pytest.fixture
def pool():
    p = HostBufferPool(1 << 28, pin=False)
    yield p
    p.close()


def random_bytes(pool, n, seed=0):
    t = pool.alloc(n, torch.uint8)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return t


def test_crc32c_known_values_and_paths_agree():
    assert _aio_ext.crc32c_bytes(b"123456789") == 0xE3069283
    assert _aio_ext.crc32c_bytes(b"") == 0
    data = os.urandom(70_001)  # long enough for the 3-lane hardware path
    assert _aio_ext.crc32c_bytes(data) == _aio_ext.crc32c_bytes(data, portable=True)
    a, b = data[:12345], data[12345:]
    assert _aio_ext.crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(data)
    assert crc32c(b, crc32c(a)) == crc32c(data)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert crc32c(t) == crc32c(data)


def test_crc32c_combine_joins_any_split_like_the_portable_checksum_of_the_whole():
    """combine(crc(a), crc(b), len(b)) == crc(a + b) for every bit of len(b) up to 2^21 and for
    empty parts; the reference is the table-driven portable CRC of the joined bytes."""
    data = os.urandom((1 << 21) + 4099)
    lengths = [0, 1, 2, 3, 7, 8, 4096, 65535, 1 << 20, (1 << 21) + 4099] + [(1 << k) + k for k in range(21)]
    for n in lengths:
        a, b = data[: len(data) - n], data[len(data) - n :]
        whole = _aio_ext.crc32c_bytes(data, portable=True)
        assert _aio_ext.crc32c_combine(crc32c(a), crc32c(b), len(b)) == whole, n
    assert _aio_ext.crc32c_combine(0x12345678, 0, 0) == 0x12345678


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 65536 + 17])
def test_round_trip_by_path_checksummed(tmp_path, pool, nbytes):
    f = tmp_path / "data.bin"
    src = random_bytes(pool, nbytes, seed=nbytes)
    with AioEngine(block_size=65536, queue_depth=4, threads=3) as eng:
        h = eng.submit_write(str(f), src, checksum=True)
        assert h.wait() is True and h.done()
        assert h.checksum == crc32c(src)
        assert os.path.getsize(f) == nbytes
        dst = pool.alloc(nbytes, torch.uint8)
        h = eng.submit_read(str(f), dst, checksum=True)
        h.wait()
        assert torch.equal(src, dst) and h.checksum == crc32c(src)


def test_direct_padded_transfer_on_fd(tmp_path, pool):
    f = tmp_path / "direct.bin"
    src = random_bytes(pool, 10_000)
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        with AioEngine(block_size=8192, queue_depth=2, threads=2) as eng:
            # O_DIRECT needs the padded length; the checksum covers only the 10_000 data bytes.
            eng.submit_write(fd, src, 4096, nbytes=10_000, io_nbytes=12288, checksum=True).wait()
            dst = pool.alloc(10_000, torch.uint8)
            h = eng.submit_read(fd, dst, 4096, nbytes=10_000, io_nbytes=12288, checksum=True)
            h.wait()
            assert torch.equal(src, dst) and h.checksum == crc32c(src)
            bad = pool.alloc(10_000, torch.uint8)
            with pytest.raises(SwapError) as e:  # unaligned offset refused by the kernel, surfaced with errno
                eng.submit_read(fd, bad, 100, nbytes=4096, io_nbytes=4096).wait()
            assert e.value.errno == errno.EINVAL and "offset 100" in str(e.value)
    finally:
        os.close(fd)


def test_hundreds_of_concurrent_requests(tmp_path, pool):
    f = tmp_path / "many.bin"
    n, size = 300, 8192 + 4096
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        with AioEngine(block_size=4096, queue_depth=16, threads=6) as eng:
            bufs = [random_bytes(pool, size, seed=i) for i in range(n)]
            hs = [eng.submit_write(fd, b, i * size, checksum=True) for i, b in enumerate(bufs)]
            for h, b in zip(hs, bufs):
                h.wait()
                assert h.checksum == crc32c(b)
            outs = [pool.alloc(size, torch.uint8) for _ in range(n)]
            hs = [eng.submit_read(fd, o, i * size) for i, o in enumerate(outs)]
            for h in reversed(hs):
                h.wait()
            for b, o in zip(bufs, outs):
                assert torch.equal(b, o)
    finally:
        os.close(fd)


def test_short_read_is_an_error_naming_file_and_offset(tmp_path, pool):
    f = tmp_path / "short.bin"
    f.write_bytes(b"x" * 5000)
    dst = pool.alloc(8192, torch.uint8)
    with AioEngine(block_size=4096, queue_depth=2, threads=2) as eng, pytest.raises(SwapError) as e:
        eng.submit_read(str(f), dst).wait()
    msg = str(e.value)
    assert e.value.errno == errno.EIO and "short read" in msg and str(f) in msg and "offset 4096" in msg


def test_missing_file_and_closed_engine(tmp_path, pool):
    eng = AioEngine(4096, 1, 1)
    with pytest.raises(SwapError, match="cannot open .*nope") as e:
        eng.submit_read(str(tmp_path / "nope"), pool.alloc(10, torch.uint8))
    assert e.value.errno == errno.ENOENT
    eng.close()
    with pytest.raises(SwapError, match="closed"):
        eng.submit_write(str(tmp_path / "x"), pool.alloc(10, torch.uint8))


def test_injected_enospc_reports_every_failure(tmp_path, pool):
    f = tmp_path / "full.bin"
    src = random_bytes(pool, 5 * 4096)
    with AioEngine(block_size=4096, queue_depth=4, threads=2) as eng:
        eng.set_fault("write", errno.ENOSPC, after_offset=8192)
        h = eng.submit_write(str(f), src)
        with pytest.raises(SwapError) as e:
            h.wait()
        with pytest.raises(SwapError):  # the error is not consumed by the first wait
            h.wait()
        eng.clear_fault()
        eng.submit_write(str(f), src).wait()
    assert e.value.errno == errno.ENOSPC
    assert "write of 4096 bytes at offset" in str(e.value) and "2 more failed pieces" in str(e.value)


def test_wait_timeout_returns_false_then_completes(tmp_path, pool):
    src = random_bytes(pool, 4096)
    with AioEngine(4096, 1, 1) as eng:
        eng.set_delay(0.3)
        h = eng.submit_write(str(tmp_path / "slow.bin"), src)
        assert h.wait(timeout=0.05) is False and not h.done()
        assert h.wait() is True and h.done()
    assert (tmp_path / "slow.bin").read_bytes() == src.numpy().tobytes()


def test_invalid_settings():
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioEngine(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AioEngine(queue_depth=0)


def test_probe_o_direct_refused_falls_back_to_buffered(tmp_path, pool, o_direct_refused, caplog):
    with caplog.at_level("WARNING", logger="offload.storage.aio"):
        assert probe_o_direct(tmp_path) is False
        assert probe_o_direct(tmp_path) is False
    assert sum("does not accept O_DIRECT" in r.message for r in caplog.records) == 1
    src = random_bytes(pool, 8192)
    with AioEngine(4096, 2, 2) as eng:  # aligned buffer, but the filesystem refuses: buffered
        eng.submit_write(str(tmp_path / "b.bin"), src).wait()
        dst = pool.alloc(8192, torch.uint8)
        eng.submit_read(str(tmp_path / "b.bin"), dst).wait()
    assert torch.equal(src, dst)


def test_probe_accepts_on_this_disk(tmp_path):
    # ext4 (the test machine) accepts O_DIRECT; the probe leaves no file behind.
    assert probe_o_direct(tmp_path) in (True, False)
    assert os.listdir(tmp_path) == []


# ---- issue 16: the request owns its buffer; one-shot faults; interrupted waits ---------------
DROPPED_HANDLE = r"""
import gc, sys, torch
from offload.storage.aio import AioEngine
path, n = sys.argv[1], 64 << 20
with open(path, "wb") as f:
    f.write(b"\xab" * n)
eng = AioEngine(1 << 20, 1, 1)
eng.set_delay(0.002)  # ~130 ms of reading still to do when the handle is dropped
t = torch.empty(n, dtype=torch.uint8)
h = eng.submit_read(path, t)
del h, t
gc.collect()
fresh = torch.zeros(n, dtype=torch.uint8)  # typically lands on the freed buffer's address
eng.close()  # every queued piece has run
print("overwritten", int((fresh != 0).sum()), "held", eng.in_flight())
"""


def test_dropped_handle_mid_read_never_writes_into_freed_memory(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", DROPPED_HANDLE, str(tmp_path / "big.bin")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "overwritten 0 held 0" in result.stdout, result.stdout


def test_dropped_handle_is_released_once_complete(tmp_path, pool):
    with AioEngine(4096, 2, 2) as eng:
        eng.set_delay(0.05)
        h = eng.submit_write(str(tmp_path / "f.bin"), random_bytes(pool, 8192))
        del h
        assert eng.in_flight() == 1  # the engine still holds the buffer (and the fd it opened)
        eng.set_delay(0)
        import time

        deadline = time.monotonic() + 10
        while eng.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.in_flight() == 0
        kept = eng.submit_write(str(tmp_path / "g.bin"), random_bytes(pool, 4096))
        kept.wait()
        assert eng.in_flight() == 0


def test_fault_with_a_count_fails_only_the_next_pieces(tmp_path, pool):
    src = random_bytes(pool, 4 * 4096)
    with AioEngine(block_size=4096, queue_depth=1, threads=1) as eng:
        eng.set_fault("write", errno.EIO, count=2)
        with pytest.raises(SwapError) as e:
            eng.submit_write(str(tmp_path / "f.bin"), src).wait()
        assert e.value.errno == errno.EIO and "(and 1 more failed pieces)" in str(e.value)
        eng.submit_write(str(tmp_path / "f.bin"), src).wait()  # spent: no clear_fault needed
    assert (tmp_path / "f.bin").read_bytes() == src.numpy().tobytes()


class Interrupt(BaseException):
    pass


def test_interrupted_wait_leaves_the_request_pending(tmp_path, pool):
    import signal
    import threading

    def handler(signum, frame):
        raise Interrupt()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        src = random_bytes(pool, 4096 * 8)
        with AioEngine(4096, 1, 1) as eng:
            eng.set_delay(0.1)
            h = eng.submit_write(str(tmp_path / "slow.bin"), src)
            threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(Interrupt):
                h.wait()
            assert not h.done()
            assert h.wait() is True  # the real result
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert (tmp_path / "slow.bin").read_bytes() == src.numpy().tobytes()


def test_an_urgent_request_goes_ahead_of_those_queued_before_it(tmp_path, pool):
    """One worker, one piece at a time, each piece slowed: a write queued first still has most of
    its pieces to go when an urgent read submitted after it has completed; both complete whole."""
    background = random_bytes(pool, 16 * 4096, seed=1)
    urgent_source = random_bytes(pool, 4096, seed=2)
    (tmp_path / "urgent.bin").write_bytes(urgent_source.numpy().tobytes())
    target = pool.alloc(4096, torch.uint8)
    with AioEngine(4096, 1, 1) as eng:
        eng.set_delay(0.02)
        slow = eng.submit_write(str(tmp_path / "background.bin"), background)
        quick = eng.submit_read(str(tmp_path / "urgent.bin"), target, urgent=True)
        assert quick.wait() is True
        assert not slow.done()  # about 15 pieces of 20 ms each were still queued
        assert slow.wait() is True
    assert torch.equal(target, urgent_source)
    assert (tmp_path / "background.bin").read_bytes() == background.numpy().tobytes()


def test_background_depth_keeps_places_for_the_other_queue(tmp_path, pool):
    """Two pieces in flight, one kept for the non-urgent queue: a background write submitted
    after a long urgent read completes while the read still has most of its pieces to go (with
    no place kept it would wait for all of them, as the test above shows); both complete whole."""
    urgent_source = random_bytes(pool, 24 * 4096, seed=5)
    (tmp_path / "urgent.bin").write_bytes(urgent_source.numpy().tobytes())
    target = pool.alloc(24 * 4096, torch.uint8)
    background = random_bytes(pool, 2 * 4096, seed=6)
    with AioEngine(4096, 2, 2, background_depth=1) as eng:
        assert eng.background_depth == 1
        eng.set_delay(0.02)
        long_read = eng.submit_read(str(tmp_path / "urgent.bin"), target, urgent=True)
        write = eng.submit_write(str(tmp_path / "background.bin"), background)
        assert write.wait() is True
        assert not long_read.done()  # about 20 of its 24 pieces of 20 ms each were still to run
        assert long_read.wait() is True
    assert torch.equal(target, urgent_source)
    assert (tmp_path / "background.bin").read_bytes() == background.numpy().tobytes()


def test_a_kept_place_goes_only_to_a_direction_with_no_urgent_piece_queued(tmp_path, pool):
    """Two pieces in flight, one kept for the non-urgent queue, each piece slowed: behind a long
    urgent read (the weights compute waits on) a non-urgent write (the write-back) takes the
    kept place and completes early, but a non-urgent read (the next step's state read ahead)
    does not take it after the write: on a drive that reads and writes at once it would only
    take the urgent read's own direction's bandwidth. It runs once the urgent pieces have all
    started. Everything completes whole."""
    urgent_source = random_bytes(pool, 24 * 4096, seed=9)
    (tmp_path / "urgent.bin").write_bytes(urgent_source.numpy().tobytes())
    ahead_source = random_bytes(pool, 4096, seed=10)
    (tmp_path / "ahead.bin").write_bytes(ahead_source.numpy().tobytes())
    target = pool.alloc(24 * 4096, torch.uint8)
    ahead_target = pool.alloc(4096, torch.uint8)
    written = random_bytes(pool, 4096, seed=11)
    with AioEngine(4096, 2, 2, background_depth=1) as eng:
        eng.set_delay(0.02)
        long_read = eng.submit_read(str(tmp_path / "urgent.bin"), target, urgent=True)
        ahead = eng.submit_read(str(tmp_path / "ahead.bin"), ahead_target)
        write = eng.submit_write(str(tmp_path / "write.bin"), written)
        assert write.wait() is True
        time.sleep(0.1)  # five more pieces' time: the read ahead would have had the kept place
        assert not ahead.done() and not long_read.done()
        assert long_read.wait() is True
        assert ahead.wait() is True
    assert torch.equal(target, urgent_source) and torch.equal(ahead_target, ahead_source)
    assert (tmp_path / "write.bin").read_bytes() == written.numpy().tobytes()


@pytest.mark.parametrize("background_depth", [0, 1])
def test_with_places_kept_a_queue_serves_both_directions_at_once(tmp_path, pool, background_depth):
    """Two workers, each piece slowed, everything non-urgent: a long read then a short write.
    With a place kept (a drive that reads and writes at once) the queue takes the direction with
    fewer pieces in flight first, so the write completes while the read still has most of its
    pieces to go; without (one queue for both), strictly in submission order: after the read's
    last piece has started. Both complete whole either way."""
    source = random_bytes(pool, 24 * 4096, seed=7)
    (tmp_path / "read.bin").write_bytes(source.numpy().tobytes())
    target = pool.alloc(24 * 4096, torch.uint8)
    written = random_bytes(pool, 4096, seed=8)
    with AioEngine(4096, 2, 2, background_depth=background_depth) as eng:
        eng.set_delay(0.02)
        long_read = eng.submit_read(str(tmp_path / "read.bin"), target)
        write = eng.submit_write(str(tmp_path / "write.bin"), written)
        assert write.wait() is True
        if background_depth:
            assert not long_read.done()  # about 22 of its 24 pieces of 20 ms each were still to run
        else:
            assert long_read.wait(timeout=0.1) is True  # at most its last piece was still running
        assert long_read.wait() is True
    assert torch.equal(target, source)
    assert (tmp_path / "write.bin").read_bytes() == written.numpy().tobytes()


@pytest.mark.parametrize("background_depth", [0, 1, 3])
def test_mixed_urgent_and_background_requests_all_complete_whole(tmp_path, pool, background_depth):
    """Writes then reads of 24 files, each request urgent or not at random, on 4 workers with up
    to 3 places kept for the non-urgent queue: every request completes and every byte lands."""
    import random

    rng = random.Random(background_depth)
    sources = [random_bytes(pool, 4096 * rng.randint(1, 6), seed=i) for i in range(24)]
    targets = [pool.alloc(src.numel(), torch.uint8) for src in sources]
    with AioEngine(4096, 4, 4, background_depth=background_depth) as eng:
        writes = [eng.submit_write(str(tmp_path / f"{i}.bin"), src, urgent=rng.random() < 0.5) for i, src in enumerate(sources)]
        assert all(h.wait() is True for h in writes)
        reads = [
            eng.submit_read(str(tmp_path / f"{i}.bin"), target, urgent=rng.random() < 0.5) for i, target in enumerate(targets)
        ]
        assert all(h.wait() is True for h in reads)
    assert all(torch.equal(src, target) for src, target in zip(sources, targets, strict=True))


@pytest.mark.parametrize("threads, depth, background_depth", [(2, 8, 2), (8, 2, 2), (4, 4, -1)])
def test_background_depth_must_leave_a_place_for_urgent_io(threads, depth, background_depth):
    with pytest.raises((ValueError, TypeError)):
        AioEngine(4096, depth, threads, background_depth=background_depth)


def test_requests_of_one_class_keep_their_order(tmp_path, pool):
    """Without urgency the queue is first in, first out: of two slowed writes, the first
    completes first."""
    first, second = random_bytes(pool, 4 * 4096, seed=3), random_bytes(pool, 4 * 4096, seed=4)
    with AioEngine(4096, 1, 1) as eng:
        eng.set_delay(0.02)
        a = eng.submit_write(str(tmp_path / "a.bin"), first)
        b = eng.submit_write(str(tmp_path / "b.bin"), second)
        assert a.wait() is True
        assert not b.done()
        assert b.wait() is True
