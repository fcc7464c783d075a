"""Fault injection through one engine's state stores: its updates fail or wait on command.

`faulty_stores(engine)` wraps the `store` of every `GroupState` of that engine (`engine.records[i].states`)
in a `FaultyStore`, which implements the `StateStore` protocol (state/state_store.py) by delegating to the
store it wraps. Armed, its `load` raises (`fail_updates`) or waits (`hold_updates`, until `release`): that is
where an update meets its state (`GroupState.update` -> `adamw(store, ...)` -> `store.load`), on the step
worker. Nothing is patched on a class, so every other engine in the process is untouched.

Faults meet only the loads of the worker thread (the updates): a load on the thread that armed them (the
training thread: `keep_writes` writing a parameter's new weights into the master through `load`/`store`)
passes, so a held update never blocks the training thread by itself. An update with no ready gradient
never loads, so no fault meets it.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

HOLD_SECONDS = 30.0  # a held load goes on by itself after this, so a test that forgets `release` still ends


class Faults:
    """The faults of one engine's stores: `fail_updates(exc)`, `hold_updates()` / `release()`, `repair()`.
    `met` counts the loads that met an armed fault (failed, or waited)."""

    def __init__(self, training_thread: threading.Thread) -> None:
        self._training_thread = training_thread
        self._error: Optional[BaseException] = None
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.met = 0
        self.timed_out = 0  # held loads that went on after HOLD_SECONDS, not released
        self.stores: List["FaultyStore"] = []

    def fail_updates(self, exc: BaseException) -> None:
        """From now on each update's load raises `exc` (the same object each time)."""
        self._error = exc

    def hold_updates(self) -> None:
        """From now on each update's load waits for `release()` (or HOLD_SECONDS) before it runs."""
        self._open.clear()

    def release(self) -> None:
        """Held loads go on, and later ones no longer wait (until the next `hold_updates`)."""
        self._open.set()

    def repair(self) -> None:
        """No fault any more: loads neither fail nor wait."""
        self._error = None
        self._open.set()

    def meet(self) -> None:
        """Before a wrapped store's load: fail or wait as armed (worker thread only, see the module docstring)."""
        if threading.current_thread() is self._training_thread:
            return
        error, held = self._error, not self._open.is_set()
        if error is None and not held:
            return
        with self._lock:
            self.met += 1
        if error is not None:
            raise error
        if not self._open.wait(HOLD_SECONDS):
            self.timed_out += 1  # nobody released it: a test asserts this stays 0 where it must not happen


class FaultyStore:
    """A `StateStore` that is `inner` in everything, except that its `load` first meets `faults`."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        self.inner = inner
        self._faults = faults

    def load(self, start: int, stop: int, shadow: bool = False) -> Any:
        self._faults.meet()
        return self.inner.load(start, stop, shadow)

    def __getattr__(self, name: str) -> Any:  # the rest of the protocol: group, chunks, store, abandon, ...
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"


def faulty_stores(engine: Any) -> Faults:
    """Wrap every state store of `engine` (one engine: its blocks' group states); the returned `Faults` arms
    them (a second call replaces the first's wrappers). Call it on the training thread, after `offload.wrap`."""
    faults = Faults(threading.current_thread())
    for record in engine.records:
        for state in record.states:
            inner = state.store.inner if isinstance(state.store, FaultyStore) else state.store
            state.store = FaultyStore(inner, faults)
            faults.stores.append(state.store)
    assert faults.stores, "the engine has no trainable group: no update would meet a fault"
    return faults
