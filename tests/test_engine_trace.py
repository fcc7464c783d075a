"""The engine's tracing seam (offload/scheduler/trace.py): observers see the step's named spans, and an
observer can neither fail training nor outlive its removal."""

from __future__ import annotations

import threading

import pytest
import torch

import offload
from tests.models import TinyGPT, make_batches


class Spans:
    def __init__(self, fail: bool = False) -> None:
        self.seen = []
        self.fail = fail
        self._lock = threading.Lock()

    def on_span(self, name: str, detail: str, start: float, end: float) -> None:
        with self._lock:
            self.seen.append((name, detail, threading.current_thread().name, end - start))
        if self.fail:
            raise ValueError("observer broke")


def _train(engine, steps: int = 2) -> None:
    for ((idx, tgt),) in make_batches(steps, 1):
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()
    engine.synchronize()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_observers_see_each_phase_on_its_thread(tmp_path, tier):
    spans = Spans()
    with offload.wrap(TinyGPT(), tier=tier, nvme_path=tmp_path if tier == "nvme" else None, dtype=torch.float32,
                      device="cpu") as engine:
        remove = engine.add_observer(spans)
        _train(engine)
        names = {name for name, *_rest in spans.seen}
        assert {"step()", "update"} <= names
        assert ("disk wait" in names) == (tier == "nvme")
        updated = {detail for name, detail, *_rest in spans.seen if name == "update"}
        assert updated == {b.name for b in engine.blocks if b.trainable_numel}  # one span per block with state
        assert all(thread.startswith("offload-step") for name, _d, thread, _s in spans.seen if name == "update")
        assert all(seconds >= 0 for *_rest, seconds in spans.seen)
        remove()
        count = len(spans.seen)
        _train(engine, 1)
        assert len(spans.seen) == count  # removed: told nothing more


def test_an_observer_that_raises_is_warned_and_training_goes_on():
    torch.manual_seed(0)
    model = TinyGPT()
    reference = TinyGPT()
    reference.load_state_dict(model.state_dict())
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine, \
            offload.wrap(reference, tier="cpu", dtype=torch.float32, device="cpu") as plain:
        engine.add_observer(Spans(fail=True))
        with pytest.warns(RuntimeWarning, match="observer .* raised ValueError: observer broke"):
            _train(engine)
        _train(plain)
        assert engine.stats()["steps"] == 2
        for key, value in plain.state_dict().items():
            assert torch.equal(engine.state_dict()[key], value), key  # the observer changed nothing


def test_stats_still_answer_after_close(tmp_path):
    engine = offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu")
    _train(engine, 1)
    before = engine.stats()
    engine.close()
    after = engine.stats()
    assert after["steps"] == before["steps"] == 1 and after["host_state_bytes"] == 0  # the state is freed
