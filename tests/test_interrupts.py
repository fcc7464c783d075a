"""Ctrl-C never poisons an engine whose updates all complete: a KeyboardInterrupt that lands while the
training thread waits for a pending update reaches the user, the update runs on, and the engine stays
usable (issue "never silently wrong", Ctrl-C)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import offload
from tests.faults import Faults, faulty_stores
from tests.models import TinyGPT, make_batches

pytestmark = pytest.mark.usefixtures("default_sigint_handler")  # the tests send themselves SIGINT


def _sigint_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _slowed_updates(engine) -> Faults:
    """The engine's updates from now on wait (in their state store's load, on the worker) until the test lets
    them run on: `repair()`."""
    faults = faulty_stores(engine)
    faults.hold_updates()
    return faults


def _interrupted(action) -> bool:
    """Run `action` with a real SIGINT 0.3 s in; whether the KeyboardInterrupt reached this thread."""
    timer = _sigint_after(0.3)
    try:
        action()
    except KeyboardInterrupt:
        return True
    finally:
        timer.cancel()
    return False


def _step(engine, idx, tgt) -> None:
    engine(idx, tgt).backward()
    engine.step()
    engine.zero_grad()


def test_ctrl_c_while_a_forward_waits_for_an_update_does_not_poison(tmp_path):
    batches = make_batches(3, 1)
    torch.manual_seed(0)
    model, reference_model = TinyGPT(), TinyGPT()
    reference_model.load_state_dict(model.state_dict())
    with offload.wrap(reference_model, tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu") as plain:
        for ((idx, tgt),) in batches:
            _step(plain, idx, tgt)
        expected = plain.state_dict()
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      overlap_step=True) as engine:
        (idx, tgt), = batches[0]
        _step(engine, idx, tgt)
        engine.synchronize()
        faults = _slowed_updates(engine)
        (idx, tgt), = batches[1]
        engine(idx, tgt).backward()
        engine.step()  # returns at once: the updates are held
        # the forward waits for the first block's held update; Ctrl-C lands in that wait
        assert _interrupted(lambda: engine(idx, tgt)), "the interrupt must reach the user"
        faults.repair()  # the held updates run on, and later ones are not held
        engine.zero_grad()
        engine.save(tmp_path / "ckpt")  # not poisoned: saving works
        (idx, tgt), = batches[2]
        _step(engine, idx, tgt)
        got = engine.state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key  # the interrupted step was applied exactly once


def test_ctrl_c_while_step_waits_for_the_updates_does_not_poison():
    """step() waits for the updates it scheduled (overlap_step off); Ctrl-C in that wait reaches the user,
    the step stays scheduled, and the next forward waits for it: the result is the uninterrupted one."""
    batches = make_batches(2, 1)
    torch.manual_seed(0)
    model, reference_model = TinyGPT(), TinyGPT()
    reference_model.load_state_dict(model.state_dict())
    with offload.wrap(reference_model, tier="cpu", dtype=torch.float32, device="cpu") as plain:
        for ((idx, tgt),) in batches:
            _step(plain, idx, tgt)
        expected = plain.state_dict()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=False) as engine:
        faults = _slowed_updates(engine)
        (idx, tgt), = batches[0]
        engine(idx, tgt).backward()
        assert _interrupted(engine.step), "the interrupt must reach the user"
        faults.repair()  # the held updates run on, and later ones are not held
        engine.zero_grad()
        (idx, tgt), = batches[1]
        _step(engine, idx, tgt)
        assert engine.stats()["steps"] == 2
        got = engine.state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_ctrl_c_during_save_leaves_the_engine_usable(tmp_path):
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True) as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        faults = _slowed_updates(engine)
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()
        assert _interrupted(lambda: engine.save(tmp_path / "ckpt"))  # it waits for the held updates first
        assert not (tmp_path / "ckpt").exists()
        faults.repair()  # the held updates run on, and later ones are not held
        engine.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "manifest.json").exists()


def test_ctrl_c_during_load_while_updates_are_pending_does_not_poison(tmp_path):
    """load() first finishes the queued updates (an unseen failure among them would count): a Ctrl-C in
    that wait is not a failed update either."""
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True) as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        engine.save(tmp_path / "ckpt")
        faults = _slowed_updates(engine)
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()
        assert _interrupted(lambda: engine.load(tmp_path / "ckpt"))
        faults.repair()  # the held updates run on, and later ones are not held
        engine.save(tmp_path / "after")  # not poisoned
        engine.load(tmp_path / "ckpt")
        _step(engine, idx, tgt)


def test_ctrl_c_while_step_schedules_applies_the_step_and_stats_say_so(monkeypatch):
    """A Ctrl-C that lands inside step() while it computes the clipping norm and schedules the updates is
    held until the step is fully scheduled: the KeyboardInterrupt then reaches the user, `stats()["steps"]`
    has counted the step, and it is applied exactly (README: "Ctrl-C during step()")."""
    import time

    from offload.scheduler.modes import reduction

    batches = make_batches(2, 1)
    torch.manual_seed(0)
    model, reference_model = TinyGPT(), TinyGPT()
    reference_model.load_state_dict(model.state_dict())
    options = dict(tier="cpu", dtype=torch.float32, device="cpu", max_grad_norm=0.5)
    with offload.wrap(reference_model, **options) as plain:
        for ((idx, tgt),) in batches:
            _step(plain, idx, tgt)
        expected = plain.state_dict()
    real_norm = reduction.global_norm

    def slow_norm(*args, **kwargs):
        time.sleep(0.8)  # the SIGINT lands here, 0.3 s into step()
        return real_norm(*args, **kwargs)

    with offload.wrap(model, **options) as engine:
        (idx, tgt), = batches[0]
        engine(idx, tgt).backward()
        monkeypatch.setattr(reduction, "global_norm", slow_norm)
        assert _interrupted(engine.step), "the interrupt must reach the user"
        monkeypatch.undo()
        assert engine.stats()["steps"] == 1  # counted: the step is applied
        engine.zero_grad()
        (idx, tgt), = batches[1]
        _step(engine, idx, tgt)
        got = engine.state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
