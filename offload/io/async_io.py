"""AsyncIO: many reads and writes of CPU tensors to files in flight at once, on the best engine.

    with offload.AsyncIO() as aio:
        swap = aio.open("/nvme/swap.bin", size=1 << 30)      # preallocated: a full disk fails here
        aio.pwrite(tensor, swap, offset=0).result()
        aio.pread(tensor, swap, offset=0).result()

Alignment (O_DIRECT needs 4096-aligned buffer address, file offset and length): a request on an O_DIRECT
file is split into a buffered head, an aligned O_DIRECT middle and a buffered tail, so odd sizes and
offsets just work. That needs `address - offset` to be a multiple of 4096 (true for offload's aligned
staging buffers at aligned offsets); when it is not, the whole request goes through the buffered
descriptor: still correct, only slower. Coherence between the two descriptors: see swap_file.py.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from offload import _native
from offload.errors import OffloadConfigError
from offload.io.aiofiles_engine import AiofilesEngine
from offload.io.backend import NATIVE_PREFERENCE, IOBackend, parse_backend
from offload.io.future import DoneRequest, IOFuture
from offload.io.probe import choose_backend
from offload.io.swap_file import DIRECT_ALIGNMENT, PathLike, SwapFile, open_swap_file

Segment = Tuple[int, bool, int, int, int]  # (fd, direct, address, size, file offset)

_MAX_CHUNK = 1 << 30  # Linux moves at most ~2 GiB per call; stay well below


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OffloadConfigError(f"{name}={value!r} must be an int >= {low}")
    return value


def split_request(swap: SwapFile, address: int, size: int, offset: int) -> List[Segment]:
    """Byte ranges of one request and the descriptor each goes through (see the module docstring)."""
    buffered = swap.buffered_fd
    if not swap.direct or (address - offset) % DIRECT_ALIGNMENT:
        return [(buffered, False, address, size, offset)]
    head = min(size, (-offset) % DIRECT_ALIGNMENT)
    middle = (size - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
    tail = size - head - middle
    segments: List[Segment] = []
    if head:
        segments.append((buffered, False, address, head, offset))
    if middle:
        segments.append((swap.direct_fd, True, address + head, middle, offset + head))
    if tail:
        segments.append((buffered, False, address + head + middle, tail, offset + head + middle))
    return segments


def _check_tensor(tensor: Any, op: str) -> int:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise OffloadConfigError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise OffloadConfigError(f"{op}: tensor is on {tensor.device}; disk I/O needs a CPU tensor (use .cpu())")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise OffloadConfigError(f"{op}: tensor is not contiguous; pass tensor.contiguous() (one flat byte range)")
    return tensor.numel() * tensor.element_size()


class AsyncIO:
    """Asynchronous pwrite/pread of CPU tensors to files; each call returns an IOFuture at once.

    backend: "auto" (measured by choose_backend for the first file's directory, cached), "io_uring",
        "aio", "threads" or "aiofiles" (pure Python), or an IOBackend. A native engine the kernel refuses
        falls back to the next one with a warning.
    queue_depth: chunks in flight at once. num_threads: workers of the thread-pool and aiofiles engines.
    chunk_bytes: large requests are split into pieces of this size (a multiple of 4096) across the queue.
    """

    def __init__(
        self,
        backend: Union[str, IOBackend] = "auto",
        *,
        queue_depth: int = 32,
        num_threads: int = 4,
        chunk_bytes: int = 8 << 20,
    ) -> None:
        self._requested = parse_backend(backend)
        self._queue_depth = _check_int("queue_depth", queue_depth, 1)
        self._num_threads = _check_int("num_threads", num_threads, 1)
        self._chunk_bytes = _check_int("chunk_bytes", chunk_bytes, DIRECT_ALIGNMENT)
        if chunk_bytes % DIRECT_ALIGNMENT or chunk_bytes > _MAX_CHUNK:
            raise OffloadConfigError(f"chunk_bytes={chunk_bytes} must be a multiple of 4096 and at most 1 GiB")
        self._engine: Any = None
        self._backend: Optional[IOBackend] = None
        self._files: List[SwapFile] = []
        self._by_path: Dict[str, SwapFile] = {}
        self._in_flight: List[IOFuture] = []  # keeps tensors alive even if callers drop their futures
        self._in_flight_lock = threading.Lock()
        self._warned_file_systems: Set[str] = set()
        self._closed = False

    # -- engine -----------------------------------------------------------------------------------------
    @property
    def backend(self) -> IOBackend:
        """The engine in use (resolving "auto" for the current directory if no file was opened yet)."""
        return self._ensure_engine(os.getcwd())

    def _ensure_engine(self, directory: str) -> IOBackend:
        if self._closed:
            raise OffloadConfigError("this AsyncIO is closed; create a new one")
        if self._backend is not None:
            return self._backend
        wanted = self._requested or choose_backend(directory)[0]
        if wanted.native and _native._C is None:
            warnings.warn(
                f"offload: I/O backend {wanted.value!r} needs the native core ({_native.native_import_error()}); "
                "using the pure-Python aiofiles engine",
                RuntimeWarning,
                stacklevel=4,
            )
            wanted = IOBackend.AIOFILES
        order = [wanted] + [b for b in NATIVE_PREFERENCE if b is not wanted] if wanted.native else [wanted]
        for candidate in order:
            try:
                self._engine = self._make_engine(candidate)
            except OSError as exc:
                warnings.warn(f"offload: I/O backend {candidate.value!r} unavailable ({exc}); trying the next",
                              RuntimeWarning, stacklevel=4)
                continue
            self._backend = candidate
            return candidate
        self._engine, self._backend = self._make_engine(IOBackend.AIOFILES), IOBackend.AIOFILES
        return self._backend

    def _make_engine(self, backend: IOBackend) -> Any:
        if backend is IOBackend.AIOFILES:
            return AiofilesEngine(self._queue_depth, self._num_threads)
        assert _native._C is not None
        return _native._C.IoEngine(backend.value, self._queue_depth, self._num_threads)

    # -- files ------------------------------------------------------------------------------------------
    def open(
        self,
        path: PathLike,
        *,
        size: Optional[int] = None,
        direct: Optional[bool] = None,
        create: bool = True,
    ) -> SwapFile:
        """Open a swap file (created unless create=False).

        size: preallocate this many bytes now with posix_fallocate; a full disk raises OffloadIOError(ENOSPC)
            naming the bytes needed and free. direct: None tries O_DIRECT and falls back to buffered I/O with
            one warning per file system; True requires it (OffloadConfigError if refused); False never uses it.
        """
        if self._closed:
            raise OffloadConfigError("this AsyncIO is closed; create a new one")
        swap = open_swap_file(
            path, size=size, direct=direct, create=create, warned_file_systems=self._warned_file_systems
        )
        self._files.append(swap)
        return swap

    def _resolve(self, file: Union[SwapFile, PathLike], write: bool) -> SwapFile:
        if isinstance(file, SwapFile):
            if file.closed:
                raise OffloadConfigError(f"swap file {file.path!r} is closed")
            return file
        key = os.path.abspath(os.fspath(file))
        swap = self._by_path.get(key)
        if swap is None or swap.closed:
            swap = self.open(key, create=write)
            self._by_path[key] = swap
        return swap

    # -- I/O --------------------------------------------------------------------------------------------
    def pwrite(self, tensor: Any, file: Union[SwapFile, PathLike], offset: int) -> IOFuture:
        """Write the tensor's bytes to `file` at byte `offset`; returns at once with an IOFuture."""
        return self._submit(True, tensor, file, offset)

    def pread(self, tensor: Any, file: Union[SwapFile, PathLike], offset: int) -> IOFuture:
        """Fill the tensor with bytes of `file` from byte `offset`; a short file raises at result()."""
        return self._submit(False, tensor, file, offset)

    def pwritev(self, pieces: Sequence[Tuple[Any, int]], file: Union[SwapFile, PathLike]) -> IOFuture:
        """Write each (tensor, offset) of `pieces` to `file`, as one request with one IOFuture (a chunk of a
        swap record and its sections: one call, one wait)."""
        return self._submit_pieces(True, pieces, file)

    def preadv(self, pieces: Sequence[Tuple[Any, int]], file: Union[SwapFile, PathLike]) -> IOFuture:
        """Fill each (tensor, offset) of `pieces` from `file`, as one request with one IOFuture."""
        return self._submit_pieces(False, pieces, file)

    def _submit(self, write: bool, tensor: Any, file: Union[SwapFile, PathLike], offset: int) -> IOFuture:
        return self._submit_pieces(write, ((tensor, offset),), file)

    def _submit_pieces(self, write: bool, pieces: Sequence[Tuple[Any, int]], file: Union[SwapFile, PathLike]
                       ) -> IOFuture:
        op = ("pwrite" if write else "pread") + ("v" if len(pieces) > 1 else "")
        swap = self._resolve(file, write)
        self._ensure_engine(os.path.dirname(swap.path))
        segments: List[Segment] = []
        tensors, size = [], 0
        for tensor, offset in pieces:
            nbytes = _check_tensor(tensor, op)
            _check_int("offset", offset, 0)
            if nbytes:
                segments.extend(split_request(swap, tensor.data_ptr(), nbytes, offset))
                tensors.append(tensor)
                size += nbytes
        first = pieces[0][1] if pieces else 0
        if not segments:
            return IOFuture(DoneRequest(), tensors, swap.path, first, 0, op)
        request = self._engine.submit(write, segments, self._chunk_bytes)
        future = IOFuture(request, tensors, swap.path, first, size, op)
        with self._in_flight_lock:
            if len(self._in_flight) >= 64:
                self._in_flight = [f for f in self._in_flight if not f.done()]
            self._in_flight.append(future)
        return future

    def wait_all(self) -> None:
        """Wait for every request submitted so far (errors stay with their futures)."""
        with self._in_flight_lock:
            pending, self._in_flight = self._in_flight, []
        for future in pending:
            future._request.wait(-1.0)

    def close(self) -> None:
        """Wait for in-flight requests, stop the engine and close the files opened here. Idempotent."""
        if self._closed:
            return
        self.wait_all()
        if self._engine is not None:
            self._engine.close()
        for swap in self._files:
            swap.close()
        self._closed = True

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
