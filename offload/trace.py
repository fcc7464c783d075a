"""The one tracing seam: named spans at the pipeline's phase boundaries, for profilers and observers.

Every span is a `torch.profiler.record_function("offload::<name>")` range (so torch.profiler and Perfetto
traces show it) and is reported to the observers added with `Engine.add_observer` (benchmarks/trace_step.py
draws its step timeline from them). Spans: "step()" and "wait for update" on the training thread,
"update" (one block's AdamW) on the update worker, "disk wait" wherever the nvme ring waits for its I/O.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Callable, List, Protocol

import torch


class PhaseObserver(Protocol):
    """Told of each span when it ends: its name, what it was about (a block's name), perf_counter times."""

    def on_span(self, name: str, detail: str, start: float, end: float) -> None: ...


class Tracer:
    """The spans of one engine and the observers listening to them (any thread may open a span)."""

    def __init__(self) -> None:
        self._observers: List[PhaseObserver] = []
        self._lock = threading.Lock()

    def add(self, observer: PhaseObserver) -> Callable[[], None]:
        """Start telling `observer` about spans; returns the function that stops it."""
        with self._lock:
            self._observers = self._observers + [observer]

        def remove() -> None:
            with self._lock:
                self._observers = [o for o in self._observers if o is not observer]

        return remove

    def span(self, name: str, detail: str = "") -> "contextlib.AbstractContextManager[None]":
        """A span around the `with` block; nothing at all (a shared no-op) when no observer listens and no torch
        profiler runs, since spans open on the hot path (every block update, every wait)."""
        if not self._observers and not torch.autograd._profiler_enabled():
            return _NO_SPAN
        return _Span(self, name, detail)

    def tell(self, name: str, detail: str, start: float) -> None:
        """A span that began at `start` (perf_counter) ends now: tell the observers."""
        observers = self._observers
        if observers:
            end = time.perf_counter()
            for observer in observers:
                _tell(observer, name, detail, start, end)


_NO_SPAN = contextlib.nullcontext()


class _Span:
    """A `torch.profiler.record_function("offload::<name>")` range, reported to the tracer's observers at its end."""

    def __init__(self, tracer: Tracer, name: str, detail: str) -> None:
        self._tracer = tracer
        self._name = name
        self._detail = detail
        self._start = 0.0
        self._range = torch.profiler.record_function(f"offload::{name}")

    def __enter__(self) -> None:
        self._start = time.perf_counter()
        self._range.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._range.__exit__(*exc)
        finally:
            self._tracer.tell(self._name, self._detail, self._start)

def _tell(observer: PhaseObserver, name: str, detail: str, start: float, end: float) -> None:
    """An observer's error is its own: warned, never raised into the update, the wait or the step it watched
    (an update that succeeded must not fail, nor an error of the work be replaced by the observer's)."""
    try:
        observer.on_span(name, detail, start, end)
    except Exception as exc:  # noqa: BLE001 - reported, not propagated
        warnings.warn(f"offload: trace observer {observer!r} raised {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
