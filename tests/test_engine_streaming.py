"""Weights streamed from the host under a small device_memory: same results, device bytes within budget."""

from __future__ import annotations

import warnings

import pytest
import torch

import offload
from offload.planner.plan import Location
from tests.devices import DEVICE, on_device
from tests.models import GRAD_ROOM, TinyGPT, make_batches, one_intraop_thread
from tests.test_engine_parity import _compare

LAYER_BYTES = 50_432  # one TinyGPT layer in fp32
BUDGET = 120_000 + GRAD_ROOM  # the small blocks, a window of two layers, autograd's largest gradient: the layers stream

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def test_plan_streams_the_layers():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device=DEVICE, device_memory=BUDGET) as engine:
        assert engine.plan.streamed_blocks == ("h.0", "h.1", "h.2")
        assert {b.name: b.weight_bytes for b in engine.blocks}["h.0"] == LAYER_BYTES
        assert all(b.weights is Location.DEVICE for b in engine.plan.blocks if b.name in ("wte", "wpe", "ln_f"))
        assert engine.stats()["device_bytes"] <= BUDGET
        assert engine.module.h[1].fc.weight.shape == (128, 32)  # released: metadata answered without a fetch
        assert engine.stats()["block_fetches"] == 0
        expected = engine.state_dict()["h.1.fc.weight"]
        assert expected.shape == (128, 32) and torch.isfinite(expected).all()
        assert torch.equal(engine.module.h[1].fc.weight.cpu(), expected)  # a read opens the block (read_through.py)
        assert engine.stats()["block_fetches"] == 1
        assert str(engine.module.h[1].fc.weight).startswith("Parameter containing:\ntensor(")


@pytest.mark.parametrize("accum,declared", [(1, False), (2, True)])
def test_streaming_parity_and_budget(accum, declared):
    stats = _compare("cpu", accum=accum, declared=declared, evaluate=True, device_memory=BUDGET)
    assert stats["block_fetches"] > 3 * STEPS_AT_LEAST and stats["block_evictions"] > 0
    assert stats["device_peak_bytes"] <= BUDGET
    assert stats["device_over_budget_events"] == 0


STEPS_AT_LEAST = 2


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_streaming_with_activation_checkpointing(checkpointing):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = _compare("cpu", accum=2, declared=False, checkpointing=checkpointing, device_memory=BUDGET)
    assert stats["block_fetches"] > 0


def test_streaming_with_clipping_and_declared_accumulation():
    _compare("cpu", accum=2, declared=True, max_norm=0.05, device_memory=BUDGET)


def test_streamed_tied_embedding():
    """The tied embedding streams too: its gradient lands (AccumulateGrad) while the block is released."""
    stats = _compare("cpu", accum=1, declared=True, device_memory=2 * LAYER_BYTES + 4_000 + GRAD_ROOM)
    assert stats["block_evictions"] > 0


def test_close_brings_streamed_weights_back():
    model = TinyGPT()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device=DEVICE, device_memory=BUDGET)
    idx, tgt = on_device(*make_batches(1, 1)[0][0])
    engine(idx, tgt).backward()
    engine.step()
    state = engine.state_dict()
    engine.close()
    for name, value in model.state_dict().items():
        assert value.cpu().equal(state[name]), name
    model(idx, tgt).backward()  # a plain model again
