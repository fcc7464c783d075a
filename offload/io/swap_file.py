"""Open, preallocate and describe one swap file: O_DIRECT where the file system allows it.

A SwapFile holds up to two descriptors of the same file: `direct_fd` (O_DIRECT, for 4096-aligned ranges)
and `buffered_fd` (for unaligned heads and tails, and everything on file systems without O_DIRECT).
Mixing them stays coherent because Linux writes back dirty cached pages before a direct read of their
range and drops cached pages after a direct write of theirs; a request never sends the same page through
both descriptors, so the only overlap is between requests, which callers order anyway.
"""

from __future__ import annotations

import errno
import fcntl
import os
import warnings
from pathlib import Path
from typing import Callable, Optional, Set, Union

from offload.errors import OffloadConfigError, OffloadIOError

PathLike = Union[str, "os.PathLike[str]"]

DIRECT_ALIGNMENT = 4096  # covers both 512-byte and 4096-byte logical blocks


def file_system_of(path: PathLike) -> str:
    """'<type> at <mount point>' for the file system holding path (from /proc/self/mounts), or 'unknown'."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, best_type = mount, fields[2]
    except OSError:
        return "unknown"
    return f"{best_type} at {best}" if best else "unknown"


class SwapFile:
    """One open file: `path`, `size` (bytes preallocated, or the size at open), `direct` (O_DIRECT in use).

    Created by `AsyncIO.open`. Closing the AsyncIO closes its files; `close()` is idempotent.
    """

    def __init__(self, path: str, size: int, direct_fd: int, buffered_fd: int) -> None:
        self.path = path
        self.size = size
        self.direct_fd = direct_fd
        self.buffered_fd = buffered_fd

    @property
    def direct(self) -> bool:
        return self.direct_fd >= 0

    @property
    def closed(self) -> bool:
        return self.buffered_fd < 0

    def fsync(self) -> None:
        """Make every completed write durable (one fdatasync covers both descriptors: same inode)."""
        if self.closed:
            raise OffloadConfigError(f"swap file {self.path!r} is closed")
        try:
            os.fdatasync(self.buffered_fd)
        except OSError as exc:
            raise OffloadIOError.from_errno(exc.errno or errno.EIO, self.path, 0, self.size, "fsync") from None

    def close(self) -> None:
        for fd in (self.direct_fd, self.buffered_fd):
            if fd >= 0:
                os.close(fd)
        self.direct_fd = self.buffered_fd = -1

    def __repr__(self) -> str:
        return f"SwapFile({self.path!r}, size={self.size}, direct={self.direct})"


def _open_fd(path: str, flags: int, op: str) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        err = exc.errno or errno.EIO
        hint = {
            errno.ENOENT: "the file or its directory does not exist",
            errno.EACCES: "permission denied: choose a writable directory",
            errno.EROFS: "the file system is read-only: choose a writable directory",
            errno.EISDIR: "the path is a directory: give a file path",
        }.get(err, os.strerror(err))
        raise OffloadIOError(err, hint, path, 0, 0, op) from None


def _preallocate(fd: int, path: str, size: int) -> None:
    """Reserve `size` bytes now so a full disk is found before training, not in the middle of it."""
    current = os.fstat(fd).st_size
    if current >= size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        err = exc.errno or errno.EIO
        os.ftruncate(fd, current)  # do not leave a half-reserved file behind
        if err == errno.ENOSPC:
            stats = os.statvfs(os.path.dirname(path) or ".")
            free = stats.f_bavail * stats.f_frsize
            message = (
                f"not enough space to preallocate: need {size - current} more bytes, {free} free on "
                f"{file_system_of(path)}; free space or choose another directory"
            )
        else:
            message = os.strerror(err)
        raise OffloadIOError(err, message, path, 0, size, "preallocate") from None


def open_swap_file(
    path: PathLike,
    *,
    size: Optional[int],
    direct: Optional[bool],
    create: bool,
    warned_file_systems: Set[str],
    open_direct: Optional[Callable[[str, int], int]] = None,
) -> SwapFile:
    """Open (and maybe create and preallocate) a swap file; see AsyncIO.open for the options.

    `warned_file_systems` is the caller's record of file systems already warned about, so a fallback to
    buffered I/O warns once per file system per AsyncIO. `open_direct` is os.open by default (tests swap it).
    """
    if size is not None and (not isinstance(size, int) or size < 0):
        raise OffloadConfigError(f"size={size!r} must be a non-negative int (bytes to preallocate) or None")
    name = os.fspath(path)
    if not name:
        raise OffloadConfigError("path is empty: give a file path for the swap file")
    writable = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        buffered_fd = _open_fd(name, writable, "open")
    except OffloadIOError as exc:
        if create or exc.errno not in (errno.EACCES, errno.EROFS):
            raise
        buffered_fd = _open_fd(name, os.O_RDONLY, "open")  # an existing read-only file can still be read
    direct_fd = -1
    try:
        if direct is not False:
            direct_fd = _try_open_direct(name, direct, warned_file_systems, open_direct or os.open, buffered_fd)
        if size is not None:
            _preallocate(buffered_fd, name, size)
        actual = os.fstat(buffered_fd).st_size
    except BaseException:
        for fd in (direct_fd, buffered_fd):
            if fd >= 0:
                os.close(fd)
        raise
    return SwapFile(str(Path(name).absolute()), actual, direct_fd, buffered_fd)


def _try_open_direct(
    name: str, direct: Optional[bool], warned: Set[str], open_direct: Callable[..., int], buffered_fd: int
) -> int:
    access = os.O_RDWR if fcntl.fcntl(buffered_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR else os.O_RDONLY
    try:
        return open_direct(name, access | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        fs = file_system_of(name)
        if direct:
            raise OffloadConfigError(
                f"direct=True but {fs} refuses O_DIRECT for {name!r} ({os.strerror(exc.errno or 0)}): "
                "pass direct=None to fall back to buffered I/O, or use a file system with O_DIRECT (ext4, xfs)"
            ) from None
        if fs not in warned:
            warned.add(fs)
            warnings.warn(
                f"offload: {fs} does not support O_DIRECT ({os.strerror(exc.errno or 0)}); using buffered I/O "
                f"for {name!r} and other files there (slower, and it fills the page cache)",
                RuntimeWarning,
                stacklevel=4,
            )
        return -1
