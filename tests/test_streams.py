"""CopyContext and GradDownloads without a GPU.

On a CPU device copies stay plain and synchronous (no stream, no event). The CUDA path's bookkeeping (who
waits for which event, the host adds of accumulated gradients) runs here with fake side streams whose copies
happen only when waited for (tests/fake_streams.py): the engine must still train exactly like torch.
"""

from __future__ import annotations

import pytest
import torch

from offload.tiers import copies as streams
from offload.tiers.copies import CopyContext, GradDownloads
from tests.fake_streams import DeferredStreams
from tests.models import one_intraop_thread
from tests.test_engine_parity import STEPS, _compare

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


@pytest.fixture
def fake(monkeypatch, request):
    """Every CopyContext made during the test gets one DeferredStreams (eager when parametrized so)."""
    side = DeferredStreams(eager=getattr(request, "param", "deferred") == "eager")
    monkeypatch.setattr(streams, "side_streams_for", lambda device: side)
    return side


def test_cpu_copies_are_synchronous_without_events():
    copies = CopyContext(torch.device("cpu"))
    assert not copies.is_async
    dst, src = torch.zeros(6), torch.arange(6.0)
    copies.upload(7, dst, src)
    assert torch.equal(dst, src)  # done when upload returns
    copies.use_upload(7)
    copies.release_source(7)
    copies.synchronize()
    assert copies.async_copies == 0 and copies._uploads == {}
    assert copies.bytes_to_device == 24
    assert not copies.empty_host(4, torch.bfloat16).is_pinned()
    with pytest.raises(AssertionError, match="CUDA"):
        copies.download(dst, src)


def test_upload_waits_are_keyed(fake):
    copies = CopyContext(torch.device("cpu"))
    assert copies.is_async
    a, b = torch.zeros(3), torch.zeros(3)
    copies.upload(1, a, torch.ones(3))
    copies.upload(2, b, torch.full((3,), 2.0))
    assert a.sum() == 0 and b.sum() == 0  # in flight
    copies.use_upload(1)  # the compute stream waits for key 1's copy
    assert torch.equal(a, torch.ones(3)) and b.sum() == 0
    copies.release_source(2)  # the host waits for key 2's copy
    assert torch.equal(b, torch.full((3,), 2.0))
    copies.use_upload(3)  # nothing uploaded under this key: nothing to wait for
    assert copies.async_copies == 2 and copies.bytes_to_device == 24 and fake.compute_waits == 1


def test_grad_downloads_copy_then_add_on_settle(fake):
    copies = CopyContext(torch.device("cpu"))
    downloads = GradDownloads(copies, 6, torch.float32)
    grad = downloads.new_accumulator()
    assert torch.equal(grad, torch.zeros(6))
    downloads.put(grad[0:2], 0, torch.tensor([1.0, 2.0]), accumulate=False)
    downloads.put(grad[2:6], 2, torch.tensor([1.0, 1.0, 1.0, 1.0]), accumulate=False)
    downloads.put(grad[0:2], 0, torch.tensor([10.0, 20.0]), accumulate=True)
    assert downloads.pending == 3 and grad.sum() == 0  # nothing landed yet
    downloads.finish_downloads()
    assert downloads.pending == 0
    assert grad.tolist() == [11.0, 22.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("fake", ["eager", "deferred"], indirect=True)
def test_a_staging_range_is_not_overwritten_before_its_add(fake):
    """A parameter firing twice (reentrant checkpointing) accumulates twice into the same staging range."""
    copies = CopyContext(torch.device("cpu"))
    downloads = GradDownloads(copies, 4, torch.float32)
    grad = downloads.new_accumulator()
    downloads.put(grad[0:4], 0, torch.full((4,), 1.0), accumulate=False)
    downloads.put(grad[0:4], 0, torch.full((4,), 2.0), accumulate=True)
    downloads.put(grad[0:4], 0, torch.full((4,), 4.0), accumulate=True)  # settles the first add first
    downloads.put(grad[0:2], 0, torch.full((2,), 8.0), accumulate=True)
    downloads.finish_downloads()
    assert grad.tolist() == [15.0, 15.0, 7.0, 7.0]


def test_settle_waits_in_issue_order(fake):
    copies = CopyContext(torch.device("cpu"))
    downloads = GradDownloads(copies, 2, torch.float32)
    grad = downloads.new_accumulator()
    downloads.put(grad, 0, torch.tensor([1.0, 1.0]), accumulate=False)
    downloads.put(grad, 0, torch.tensor([2.0, 3.0]), accumulate=True)
    events = [event for event, _t, _s in downloads._pending]
    downloads.finish_downloads()
    assert [e.synchronized for e in events] == [1, 1] and all(e.done for e in events)
    assert grad.tolist() == [3.0, 4.0]


# ----- the engine with deferred copies: every reader must wait --------------------------------------------

BUDGET = 120_000  # tests/test_engine_streaming.py: the three layers stream


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("accum,declared", [(1, False), (1, True), (4, False), (4, True)])
def test_engine_parity_with_deferred_copies(fake, tier, accum, declared):
    stats = _compare(tier, accum=accum, declared=declared)
    assert stats["steps"] == STEPS
    assert stats["copies_on_side_streams"] == fake.issued > 0


@pytest.mark.parametrize("fake", ["eager", "deferred"], indirect=True)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_engine_parity_with_deferred_copies_and_clipping(fake, tier):
    _compare(tier, accum=4, declared=False, max_norm=0.05)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])  # tier="gpu" keeps everything on the device: no streaming
@pytest.mark.parametrize("accum,declared", [(1, False), (2, True)])
def test_engine_parity_with_deferred_uploads_of_streamed_blocks(fake, tier, accum, declared):
    stats = _compare(tier, accum=accum, declared=declared, evaluate=True, device_memory=BUDGET)
    assert stats["block_fetches"] > 0 and fake.compute_waits > 0


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_engine_parity_with_deferred_copies_and_checkpointing(fake, checkpointing):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reentrant checkpoint warns about inputs without grad in torch
        _compare("cpu", accum=2, declared=False, checkpointing=checkpointing, device_memory=BUDGET)
