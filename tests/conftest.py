"""Test-session settings shared by every test file."""

import os
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_io_backend_cache():
    """The I/O backend choice is cached per device in $XDG_CACHE_HOME/offload; the tests measure on loop
    mounts and tmpfs whose device numbers get reused, so they keep their cache to themselves instead of
    writing into the user's home (subprocesses inherit the variable)."""
    before = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory(prefix="offload-test-cache-") as directory:
        os.environ["XDG_CACHE_HOME"] = directory
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture
def default_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt) for a test that sends itself SIGINT: pytest started in the
    background (`nohup ... &`, some CI runners) inherits SIGINT ignored, and the signal would then do nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
