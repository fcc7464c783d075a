"""An engine dropped without close() releases what close() would: its worker thread, its swap files, its
host state, and its hooks on the model, which stays a plain PyTorch model with its trained weights.
See docs/design.md [Note: an engine dropped without close()]."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

import offload
from tests.models import TinyGPT, make_batches, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)

REPO = Path(__file__).resolve().parent.parent
STREAMED = 120_000  # device bytes: the small blocks and a window of two layers, so the layers stream


def _step_threads() -> int:
    return sum(t.name == "offload-step" for t in threading.enumerate() if t.is_alive())


def _wrap(model: nn.Module, tier: str, tmp_path: Path, **options) -> offload.Engine:
    nvme = {"nvme_path": tmp_path} if tier == "nvme" else {}
    return offload.wrap(model, tier=tier, device="cpu", dtype=torch.float32, lr=1e-2, **nvme, **options)


def _train(engine, steps: int = 2) -> None:
    for (idx, targets), in make_batches(steps, 1, seed=1):
        engine(idx, targets).backward()
        engine.step()
        engine.zero_grad()


def _swap_files(tmp_path: Path) -> list:
    return sorted(os.listdir(tmp_path))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_dropped_engine_stops_its_thread_and_deletes_its_swap_files(tier, tmp_path):
    before = _step_threads()
    model = TinyGPT()
    engine = _wrap(model, tier, tmp_path)
    _train(engine)
    pipeline = weakref.ref(engine._pipeline)
    assert _step_threads() == before + 1
    assert (len(_swap_files(tmp_path)) == 2) == (tier == "nvme")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean release warns of nothing
        del engine
        gc.collect()
    assert pipeline() is None  # the host state, staging buffers and records went with it
    assert _step_threads() == before
    assert _swap_files(tmp_path) == []


@pytest.mark.parametrize("tier,options", [("cpu", {}), ("nvme", {}), ("cpu", {"device_memory": STREAMED})],
                         ids=["cpu", "nvme", "cpu-streamed"])
def test_the_model_of_a_dropped_engine_is_plain_pytorch_with_the_trained_weights(tier, options, tmp_path):
    """Dropping the engine leaves the model exactly as close() does: the last step's updates (still pending
    with overlap_step) applied, streamed weights brought back, no hook left; torch then trains it alone."""
    models = []
    for drop in (False, True):
        torch.manual_seed(0)
        model = TinyGPT()
        engine = _wrap(model, tier, tmp_path, overlap_step=True, **options)
        _train(engine, steps=3)
        assert (engine.stats()["block_fetches"] > 0) == ("device_memory" in options)
        if drop:
            del engine
            gc.collect()
        else:
            engine.close()
        models.append(model)
    closed, dropped = (m.state_dict() for m in models)
    assert closed.keys() == dropped.keys() and all(torch.equal(closed[k], dropped[k]) for k in closed)
    torch.manual_seed(0)
    assert any(not torch.equal(v, TinyGPT().state_dict()[k]) for k, v in dropped.items())  # it did train
    model = models[1]
    assert not hasattr(model, "_offload_engine")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    (idx, targets), = make_batches(1, 1, seed=2)[0]
    model(idx, targets).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)  # no hook took the gradients away
    torch.optim.AdamW(model.parameters()).step()  # and torch's own optimizer trains it


def test_the_model_of_a_dropped_engine_can_be_wrapped_again(tmp_path):
    model = TinyGPT()
    engine = _wrap(model, "nvme", tmp_path)
    _train(engine)
    engine = None  # rebinding drops it, as `engine = offload.wrap(model)` in a loop would
    engine = _wrap(model, "nvme", tmp_path)  # not "already wrapped"
    _train(engine)
    assert len(_swap_files(tmp_path)) == 2
    engine.close()
    assert _swap_files(tmp_path) == []


def test_dropping_the_model_with_the_engine_releases_both(tmp_path):
    before = _step_threads()
    model = TinyGPT()
    engine = _wrap(model, "nvme", tmp_path)
    _train(engine)
    model_ref, pipeline = weakref.ref(model), weakref.ref(engine._pipeline)
    del engine, model
    gc.collect()
    assert model_ref() is None and pipeline() is None
    assert _step_threads() == before and _swap_files(tmp_path) == []


def test_close_then_drop_is_quiet_and_drop_after_a_failed_close_is_too(tmp_path, monkeypatch):
    from offload.tiers.disk import SwapStore

    engine = _wrap(TinyGPT(), "nvme", tmp_path)
    _train(engine, steps=1)
    real_close = SwapStore.close

    def failing_close(self):
        real_close(self)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(SwapStore, "close", failing_close)
    with pytest.raises(OSError):
        engine.close()
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del engine
        gc.collect()
    assert _swap_files(tmp_path) == []


def test_an_error_while_releasing_a_dropped_engine_is_a_warning_not_lost(tmp_path, monkeypatch):
    """A finalizer cannot raise (Python prints "Exception ignored" and goes on): the error is a RuntimeWarning,
    and everything else is released all the same."""
    from offload.tiers.disk import SwapStore

    before = _step_threads()
    model = TinyGPT()
    engine = _wrap(model, "nvme", tmp_path)
    _train(engine, steps=1)
    real_close = SwapStore.close

    def failing_close(self):
        real_close(self)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(SwapStore, "close", failing_close)
    with pytest.warns(RuntimeWarning, match="dropped without close.*Input/output error"):
        del engine
        gc.collect()
    assert _step_threads() == before and _swap_files(tmp_path) == []
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_dropped_engine_with_a_failed_update_warns_as_close_does(tmp_path):
    model = TinyGPT()
    engine = _wrap(model, "cpu", tmp_path)
    _train(engine, steps=1)
    (idx, targets), = make_batches(1, 1, seed=3)[0]
    engine(idx, targets).backward()
    engine._pipeline._services.worker.submit(0, lambda: 1 / 0)  # an update that fails, never reported
    with pytest.warns(RuntimeWarning, match="dropped without close.*ZeroDivisionError"):
        del engine
        gc.collect()
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_an_engine_kept_alive_by_a_reference_cycle_is_released_by_the_collector(tmp_path):
    before = _step_threads()
    model = TinyGPT()
    holder = {"engine": _wrap(model, "nvme", tmp_path)}
    holder["self"] = holder  # a cycle: only the collector frees it
    _train(holder["engine"], steps=1)
    del holder
    gc.collect()
    assert _step_threads() == before and _swap_files(tmp_path) == []


def test_an_engine_still_in_an_uncollected_cycle_does_not_block_wrapping_again(tmp_path):
    model = TinyGPT()
    gc.disable()  # only wrap() may collect here
    try:
        holder = {"engine": _wrap(model, "cpu", tmp_path)}
        holder["self"] = holder
        engine = weakref.ref(holder["engine"])
        del holder  # unreachable, not yet collected: wrap() collects once before refusing
        assert engine() is not None
        with _wrap(model, "cpu", tmp_path) as again:
            assert engine() is None
            _train(again, steps=1)
    finally:
        gc.enable()


def test_the_optimizer_kept_after_the_engine_is_dropped_refuses_to_step(tmp_path):
    """An LR scheduler may keep `engine.optimizer`; the engine is released all the same, and a step through
    the kept optimizer says so instead of training a model it no longer owns."""
    model = TinyGPT()
    engine = _wrap(model, "cpu", tmp_path)
    optimizer = engine.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _train(engine, steps=1)
    del engine
    gc.collect()
    assert not any(m._forward_pre_hooks for m in model.modules())
    with pytest.raises(offload.OffloadError, match="closed"):
        optimizer.step()
    del scheduler


def test_a_dropped_engine_collected_on_its_own_worker_thread_is_released_from_another(tmp_path):
    """A collection can run on any thread, the worker's too (its updates allocate); the worker cannot wait for
    itself, so the release moves to a thread of its own."""
    before = _step_threads()
    model = TinyGPT()
    engine = _wrap(model, "nvme", tmp_path)
    _train(engine, steps=1)
    engine._pipeline._services.worker.submit(0, engine._dropped)  # what a collection on the worker would run
    releasing = [t for t in threading.enumerate() if t.name == "offload-release"]
    engine._pipeline._services.worker._thread.join(timeout=30)
    for thread in releasing + [t for t in threading.enumerate() if t.name == "offload-release"]:
        thread.join(timeout=30)
    assert _step_threads() == before and _swap_files(tmp_path) == []
    assert not any(m._forward_pre_hooks for m in model.modules())
    del engine  # already released: nothing happens
    gc.collect()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_dropping_its_copy_leaves_the_parents_engine_alone(tmp_path):
    """A DataLoader worker is a fork of the training process: the engine it drops (or collects at exit) is
    the parent's, whose swap file and hooks must stay."""
    model = TinyGPT()
    engine = _wrap(model, "nvme", tmp_path)
    _train(engine, steps=1)
    pid = os.fork()
    if pid == 0:  # the child: drop the copy, report whether the parent's files survived
        code = 1
        try:
            del engine
            gc.collect()
            code = 0 if len(_swap_files(tmp_path)) == 2 else 2
        finally:
            os._exit(code)
    assert _exit_code(pid, timeout=60) == 0  # not 2 (files deleted), nor a hang (waiting for a lost thread)
    assert len(_swap_files(tmp_path)) == 2
    _train(engine, steps=1)  # the parent's engine trains on
    engine.close()


_SIX_ENGINES = """
import gc, os, sys, threading, weakref, torch, offload
sys.path.insert(0, {repo!r})
from tests.models import TinyGPT, make_batches
torch.manual_seed(0)
path = {path!r}


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


pipelines = []
for i in range(6):
    engine = offload.wrap(TinyGPT(dim=128, layers=4), tier="nvme", nvme_path=path, device="cpu",
                          dtype=torch.float32)  # no close(): the next iteration rebinds `engine`
    pipelines.append(weakref.ref(engine._pipeline))
    for (idx, targets), in make_batches(1, 1, seed=i):
        engine(idx, targets).backward()
        engine.step()
        engine.zero_grad()
    if i == 0:
        base, ring = rss(), engine.stats()["nvme_staging_bytes"]
    threads = sum(t.name == "offload-step" for t in threading.enumerate())
    print("engine", i, "threads", threads, "files", len(os.listdir(path)), flush=True)
    assert (threads, len(os.listdir(path))) == (1, 2)
growth = rss() - base
print("growth", growth, "ring", ring, flush=True)
assert growth < 2 * ring, (growth, ring)  # not one staging ring per dropped engine
del engine
gc.collect()
print("after", sum(t.name == "offload-step" for t in threading.enumerate()), len(os.listdir(path)),
      sum(p() is not None for p in pipelines))
"""


def test_six_engines_dropped_in_a_loop_keep_one_thread_one_swap_file_and_one_ring(tmp_path):
    """The issue's report: six engines rebound without close() kept six threads, their memory and six swap
    files. Each `engine = offload.wrap(...)` now releases the previous one (threads and files at once; the
    staging ring's host memory too, although the engine's objects wait in reference cycles for the
    collector), and a collection frees the rest."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("reads the resident set size from /proc")
    script = _SIX_ENGINES.format(repo=str(REPO), path=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "after 0 0 0"
    assert os.listdir(tmp_path) == []


def test_a_dropped_worker_stops_its_thread_and_does_not_keep_its_callback_owner():
    """The thread is a GC root: it holds neither the StepWorker nor (weakly only) its queue observer (the
    ring's read-ahead), so both can be collected, and the worker's finalizer stops it."""
    from offload.scheduler.worker.step_worker import StepWorker

    class Owner:
        def queued(self, upcoming):
            pass

    before = _step_threads()
    owner = Owner()
    worker = StepWorker(1, observer=owner)
    worker.submit(0, lambda: None)
    worker.wait(0)
    owner_ref, worker_ref = weakref.ref(owner), weakref.ref(worker)
    thread = worker._thread
    del owner, worker
    gc.collect()
    assert owner_ref() is None and worker_ref() is None
    thread.join(timeout=10)
    assert _step_threads() == before


def _exit_code(pid: int, timeout: float) -> Optional[int]:
    """The forked child's exit code, or None (and the child killed) when it has not exited in `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
