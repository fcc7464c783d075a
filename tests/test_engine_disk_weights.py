"""Weights on disk: with host_memory too small for the streamed weights, the planner puts them in the swap
file; they stream disk -> host staging -> device per block, and training still matches plain PyTorch."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import offload
from offload.planner.plan import Location
from tests.models import TinyGPT, one_intraop_thread, train_steps
from tests.test_engine_parity import _compare
from tests.test_engine_streaming import BUDGET

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
HOST = 300 << 10  # the gradients (~109 KiB), a small ring, and no room for the streamed layers' weights


def test_plan_puts_streamed_weights_on_disk(tmp_path):
    with offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      device_memory=BUDGET, host_memory=HOST) as engine:
        on_disk = engine.plan.disk_weight_blocks
        assert on_disk and set(on_disk) <= set(engine.plan.streamed_blocks)
        assert "disk" in str(engine.plan)
        assert engine.plan.bytes_on(Location.HOST) <= HOST
        layout_file = next(p for p in tmp_path.iterdir() if p.name.endswith(".layout.json"))
        layout = json.loads(layout_file.read_text())
        assert {w["block"] for w in layout["weights"]} == set(on_disk)
        assert all(w["offset"] % 4096 == 0 for w in layout["weights"])


@pytest.mark.parametrize("accum,declared,max_norm", [(1, True, None), (2, False, 0.05)])
def test_parity_with_weights_on_disk(accum, declared, max_norm):
    stats = _compare("nvme", accum=accum, declared=declared, max_norm=max_norm, evaluate=True,
                     device_memory=BUDGET, host_memory=HOST)
    assert stats["block_fetches"] > 0 and stats["device_peak_bytes"] <= BUDGET


def test_settled_blocks_are_prefetched_from_disk(tmp_path):
    """With every update settled before the next forward (synchronize), the forward starts each next
    block's disk reads one block ahead: prefetches happen (timing-free: no update is pending)."""
    from tests.models import make_batches

    with offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      device_memory=BUDGET, host_memory=HOST) as engine:
        for (idx, tgt), in make_batches(3, 1):
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
            engine.synchronize()
        assert engine.stats()["block_prefetches"] > 0


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_parity_with_weights_on_disk_and_checkpointing(checkpointing):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _compare("nvme", accum=2, declared=False, checkpointing=checkpointing, device_memory=BUDGET,
                 host_memory=HOST)


def test_save_and_load_with_weights_on_disk(tmp_path):
    """A checkpoint of an engine whose weights live in the swap file reads them from disk, and a load writes
    them back there; training then continues exactly as without the round trip."""
    from tests.models import make_batches

    def make(directory):
        torch.manual_seed(0)
        return offload.wrap(TinyGPT(), tier="nvme", nvme_path=directory, dtype=torch.float32, device="cpu",
                            device_memory=BUDGET, host_memory=HOST, lr=1e-3)

    batches = [b for step in make_batches(4, 1) for b in step]


    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with make(tmp_path / "a") as first:
        assert first.plan.disk_weight_blocks
        train_steps(first, batches[:2])
        first.save(tmp_path / "ckpt")
        saved = first.state_dict()
        expected = train_steps(first, batches[2:])
    with make(tmp_path / "b") as second:
        second.load(tmp_path / "ckpt")
        loaded = second.state_dict()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert train_steps(second, batches[2:]) == expected
