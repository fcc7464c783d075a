"""Ctrl-C deferred over a short critical section, so an optimizer step is applied whole or not at all.

`engine.step()` only schedules work (the updates run on a worker thread, which SIGINT never interrupts),
so deferring the KeyboardInterrupt until the scheduling is done costs milliseconds; the interrupt is then
raised as usual, with the step fully scheduled and the step counter advanced.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, List


@contextlib.contextmanager
def deferred_keyboard_interrupt() -> Iterator[None]:
    """Hold back SIGINT's KeyboardInterrupt until the block ends (main thread, default handler only)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
