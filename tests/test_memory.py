import threading

import pytest
import torch

from offload.errors import InsufficientMemoryError
from offload.storage.memory import HostBufferPool, TierLedger, available_ram

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
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 3, 1023, 1025, 100_003])
def test_alloc_exact_aligned_zeroed(dtype, numel):
    with HostBufferPool(1 << 30, pin=False) as pool:
        t = pool.alloc(numel, dtype)
        assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
        nbytes = numel * t.element_size()
        assert t.data_ptr() % 4096 == 0
        cap = pool.capacity_of(t)
        assert cap % 4096 == 0 and nbytes <= cap < nbytes + 4096 + (4096 if nbytes == 0 else 0)
        assert t.untyped_storage().nbytes() == cap
        assert not t.to(torch.float64 if not dtype.is_complex else dtype).abs().sum().item()
        assert pool.allocated_bytes == cap


def test_accounting_peak_free_and_ledger():
    ledger = TierLedger()
    pool = HostBufferPool(1 << 24, pin=False, ledger=ledger)
    a = pool.alloc(1000, torch.float32, category="master")  # 4000 B -> 4096
    b = pool.alloc(2048, torch.float32, category="exp_avg")  # 8192
    assert pool.allocated_bytes == 4096 + 8192
    pool.free(a)
    assert pool.allocated_bytes == 8192 and pool.peak_bytes == 4096 + 8192
    rep = ledger.report()["host"]
    assert rep["current"] == 8192 and rep["peak"] == 12288
    assert rep["by_category"]["master"] == {"current": 0, "peak": 4096}
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.free(a)
    b[:] = 7  # still usable until freed
    pool.close()
    assert pool.allocated_bytes == 0 and ledger.report()["host"]["current"] == 0


def test_budget_exceeded_names_numbers():
    pool = HostBufferPool(3 * 4096, pin=False)
    pool.alloc(4096, torch.uint8)
    with pytest.raises(InsufficientMemoryError, match=r"budget of .*12288 bytes.*4096 bytes\) in use") as e:
        pool.alloc(2 * 4096 + 1, torch.uint8)
    assert "12288" in str(e.value)
    pool.alloc(2 * 4096, torch.uint8)  # exactly fills the budget
    assert pool.allocated_bytes == 3 * 4096
    pool.close()


def test_budget_above_free_ram_fails_at_construction():
    free = available_ram()
    with pytest.raises(InsufficientMemoryError, match="available") as e:
        HostBufferPool(free * 4, pin=False)
    msg = str(e.value)
    assert str(free * 4) in msg and "lower the host budget" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent; CUDA is present")
def test_pin_without_cuda_is_clear():
    with pytest.raises(ValueError, match="needs CUDA"):
        HostBufferPool(None, pin=True)
    assert HostBufferPool(None).pin is False


@pytest.mark.cuda
def test_pinned_buffers_with_cuda_are_pinned_and_aligned():
    with HostBufferPool(1 << 24, pin=True) as pool:
        t = pool.alloc(1025, torch.float32)
        assert t.is_pinned() and t.data_ptr() % 4096 == 0
        assert pool.allocated_bytes == pool.capacity_of(t)


@pytest.mark.cuda
def test_a_buffer_asked_unpinned_stays_pageable_in_a_pinned_pool():
    """The speculative steps' spare state is never copied to the device: it is not page-locked."""
    with HostBufferPool(1 << 24, pin=True) as pool:
        pageable = pool.alloc(1025, torch.float32, pin=False)
        assert not pageable.is_pinned() and pageable.data_ptr() % 4096 == 0
        pool.free(pageable)


def test_ledger_threadsafe_and_validation():
    ledger = TierLedger()

    def work():
        for _ in range(2000):
            ledger.allocate("nvme", 3, "a")
            ledger.release("nvme", 3, "a")
            ledger.allocate("device", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    rep = ledger.report()
    assert rep["nvme"]["current"] == 0 and rep["device"]["current"] == 8000
    with pytest.raises(ValueError, match="unknown tier"):
        ledger.allocate("gpu", 1)
    with pytest.raises(ValueError, match="only 0 are allocated"):
        ledger.release("host", 1, "x")
