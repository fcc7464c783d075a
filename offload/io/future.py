"""IOFuture: the handle pwrite/pread (and pwritev/preadv) return. It keeps the tensors alive until the I/O is
done."""

from __future__ import annotations

import errno
import os
from typing import Any, List, Optional

from offload.errors import OffloadIOError

_EXPLAIN = {
    errno.ENODATA: "short read: the file ends before offset+size (truncated or never written)",
    errno.ENOSPC: "no space left on the device",
    errno.EINVAL: "the kernel refused the request (O_DIRECT alignment, or a bad descriptor)",
    errno.EBADF: "the file was closed while the request was in flight",
}


class IOFuture:
    """Result of one AsyncIO.pwrite/pread (or pwritev/preadv, several pieces as one request): `result()` waits
    (GIL released) and returns bytes moved."""

    def __init__(self, request: Any, tensor: Any, path: str, offset: int, size: int, op: str) -> None:
        self._request = request
        self._tensor = tensor  # the engine writes into/reads from its memory (one tensor or a list): alive until done
        self.path = path
        self.offset = offset
        self.size = size
        self.op = op

    def done(self) -> bool:
        """Whether the request has finished, successfully or not (never blocks)."""
        return self._request.done()

    def result(self, timeout: Optional[float] = None) -> int:
        """Wait up to `timeout` seconds (None: no limit); return the bytes moved.

        Raises OffloadIOError naming path, offset, size and errno when the I/O failed, and
        OffloadIOError(ETIMEDOUT) when the wait outlasts `timeout` (the request stays in flight).
        """
        if not self._request.wait(-1.0 if timeout is None else max(0.0, float(timeout))):
            raise OffloadIOError(
                errno.ETIMEDOUT,
                f"not finished after {timeout} s: the device may be stalled (the request is still in flight)",
                self.path, self.offset, self.size, self.op,
            )
        self._tensor = None
        err = self._request.error
        if err:
            where = self._request.error_offset
            left = self._request.error_size
            reason = _EXPLAIN.get(err, os.strerror(err))
            raise OffloadIOError(
                err, f"{reason}; failed at file offset {where} with {left} bytes of that piece left",
                self.path, self.offset, self.size, self.op,
            )
        return self.size

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"IOFuture({self.op} {self.path!r} offset={self.offset} size={self.size}, {state})"


def wait_all(futures: List["IOFuture"]) -> None:
    """Wait for every request, then raise the first error: a buffer goes back to its owner only when no
    request still reads into it or writes from it, even when one of them failed."""
    first: Optional[BaseException] = None
    for future in futures:
        try:
            future.result()
        except BaseException as exc:  # noqa: B902 - re-raised below, after the others are done
            first = first or exc
    if first is not None:
        raise first


class DoneRequest:
    """A request that needed no I/O (zero bytes): always done, no error."""

    bytes = 0
    error = 0
    error_offset = 0
    error_size = 0

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float = -1.0) -> bool:
        return True
