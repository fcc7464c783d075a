"""The staging pool: alignment, zero-copy views, the hard budget, waiting, reuse and no leaks.

Each test runs on the native arena and on the pure-torch fallback (offload._C hidden)."""

import gc
import threading
import time

import pytest
import torch

from offload import _native
from offload.errors import OffloadConfigError, OffloadMemoryError
from offload.tiers.host import ALIGNMENT, StagingPool

MiB = 1 << 20


@pytest.fixture(params=["native", "fallback"])
def backend(request, monkeypatch):
    if request.param == "native":
        if _native._C is None:
            pytest.skip(f"native core unavailable: {_native.native_import_error()}")
    else:
        monkeypatch.setattr(_native, "_C", None)
    return request.param


@pytest.mark.parametrize("nbytes", [0, 1, 511, 4096, 4097, 123_457, 3 * MiB + 5])
def test_leases_are_aligned_and_sized(backend, nbytes):
    pool = StagingPool(8 * MiB)
    bufs = [pool.lease(nbytes) for _ in range(2)]
    for b in bufs:
        assert b.data_ptr % ALIGNMENT == 0
        assert b.view().numel() == nbytes
        if nbytes:  # torch reports data_ptr() == 0 for empty tensors
            assert b.view().data_ptr() == b.data_ptr
    assert bufs[0].data_ptr != bufs[1].data_ptr


def test_views_share_memory_without_copies(backend):
    pool = StagingPool(MiB)
    buf = pool.lease(4096)
    as_float = buf.view(torch.float32, (32, 32))
    as_bytes = buf.view()
    as_float.fill_(1.0)
    assert as_bytes.data_ptr() == as_float.data_ptr()
    assert bytes(as_bytes[:4].tolist()) == torch.tensor([1.0]).numpy().tobytes()
    tail = buf.view(torch.float32, 4, offset=4096 - 16)
    assert tail.data_ptr() == buf.data_ptr + 4096 - 16
    with pytest.raises(OffloadConfigError, match="needs 4112 bytes"):
        buf.view(torch.float32, 1028)
    with pytest.raises(OffloadConfigError, match="multiple"):
        buf.view(torch.float32, 1, offset=2)


def test_budget_is_hard(backend):
    pool = StagingPool(MiB)
    held = [pool.lease(256 * 1024) for _ in range(4)]
    with pytest.raises(OffloadMemoryError, match="exhausted.*host_memory"):
        pool.lease(1)
    with pytest.raises(OffloadMemoryError, match="exhausted"):
        pool.lease(2 * MiB)  # larger than the budget: fails at once even if we were to wait
    assert pool.bytes_in_use == MiB
    del held


def test_wait_times_out(backend):
    pool = StagingPool(MiB)
    held = pool.lease(MiB)
    with pytest.raises(OffloadMemoryError):
        pool.lease(4096, wait=True, timeout=0.05)
    held.release()


def test_wait_returns_when_another_thread_releases(backend):
    pool = StagingPool(MiB)
    held = pool.lease(MiB)
    got = []

    def waiter():
        got.append(pool.lease(MiB, wait=True, timeout=30))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert not got  # still waiting: the budget is taken
    held.release()
    t.join(30)
    assert len(got) == 1 and got[0].nbytes == MiB


def test_memory_returns_only_after_views_die(backend):
    pool = StagingPool(MiB)
    buf = pool.lease(MiB)
    view = buf.view(torch.float32)
    view.fill_(7.0)
    buf.release()
    del buf
    gc.collect()
    if backend == "native":  # the native lease lives on inside the view
        assert pool.bytes_in_use == MiB
        with pytest.raises(OffloadMemoryError):
            pool.lease(4096)
    assert float(view[0]) == 7.0
    del view
    gc.collect()
    assert pool.bytes_in_use == 0
    with pytest.raises(OffloadConfigError, match="released"):
        b = pool.lease(16)
        b.release()
        b.view()


def test_fragmented_ranges_coalesce(backend):
    pool = StagingPool(64 * 4096)
    bufs = [pool.lease(4096 * (1 + i % 3)) for i in range(32)]
    for b in bufs[::2]:
        b.release()
    for b in bufs[1::2]:
        b.release()
    del bufs
    gc.collect()
    stats = pool.stats()
    assert stats["in_use"] == 0
    assert stats["largest_free"] == stats["capacity"]
    whole = pool.lease(64 * 4096)  # only possible if every range merged back into one
    assert whole.nbytes == 64 * 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_no_leak_over_ten_thousand_leases(backend):
    pool = StagingPool(4 * MiB)
    for i in range(200):  # warm up allocator caches before measuring
        pool.lease(4096 + i).view().fill_(1)
    gc.collect()
    rss_before = _rss_bytes()
    for i in range(10_000):
        buf = pool.lease(4096 + (i * 37) % 100_000)
        buf.view()[:8].fill_(i % 256)
        if i % 3 == 0:
            buf.release()
        del buf
    gc.collect()
    stats = pool.stats()
    assert stats["in_use"] == 0
    assert stats.get("live_leases", 0) == 0
    assert stats["largest_free"] == stats["capacity"]
    assert _rss_bytes() - rss_before < 8 * MiB


def test_bad_arguments(backend):
    with pytest.raises(OffloadConfigError, match="budget_bytes"):
        StagingPool(0)
    pool = StagingPool(MiB)
    with pytest.raises(OffloadConfigError, match="nbytes"):
        pool.lease(-1)
    pool.close()
    with pytest.raises(OffloadConfigError, match="closed"):
        pool.lease(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_pin_without_cuda_is_refused(backend):
    with pytest.raises(OffloadConfigError, match="pin=True needs CUDA"):
        StagingPool(MiB, pin=True)
    assert StagingPool(MiB).pinned is False  # auto: no CUDA, no locking


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_pool_copies_asynchronously(backend):
    pool = StagingPool(16 * MiB)
    assert pool.pinned, pool.pin_reason
    buf = pool.lease(8 * MiB)
    host = buf.view(torch.float32)
    host.copy_(torch.arange(host.numel(), dtype=torch.float32))
    if backend == "native":
        assert host.is_pinned()
    dev = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)
    del host, dev
    buf.release()
    pool.close()


@pytest.mark.skipif(_native._C is None, reason="the native arena maps the budget")
@pytest.mark.parametrize("budget", [2**64 - 4096, 2**64 - 1, 2**63])
def test_a_budget_no_machine_has_is_refused_not_wrapped_around(budget):
    """Rounded up (and aligned to 2 MiB) such a size would wrap to a few bytes, and leases would run past
    the mapping; it is refused with the fix instead."""
    with pytest.raises(ValueError, match="larger than any machine's memory"):
        StagingPool(budget)


@pytest.mark.skipif(_native._C is None, reason="the native arena's placement")
def test_large_arenas_start_on_a_huge_page_boundary():
    with StagingPool(3 << 20) as pool:
        lease = pool.lease(4096)
        assert lease.data_ptr % (2 << 20) == 0  # first-fit: the first lease is the region's start
        lease.release()
