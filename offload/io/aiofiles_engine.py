"""The pure-Python I/O engine on aiofiles, used when offload._C is unavailable (or asked for by name).

It mirrors the native engine's interface (`submit(write, segments, chunk_bytes)` returning a request with
done/wait/bytes/error/error_offset/error_size), so AsyncIO does not care which one it drives. An asyncio
loop runs in one daemon thread; each chunk is an `os.pread`/`os.pwrite` through `aiofiles.os.wrap` on a
bounded executor, so many chunks are in flight at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

Segment = Tuple[int, bool, int, int, int]  # (fd, direct, address, size, file offset)

_DIRECT_ALIGN = 4096


class PyRequest:
    """Completion state of one request: the same surface as the native `_C.IoRequest`."""

    def __init__(self, num_chunks: int) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._remaining = num_chunks
        self.bytes = 0
        self.error = 0
        self.error_offset = 0
        self.error_size = 0
        if num_chunks == 0:
            self._event.set()

    def finish_chunk(self, nbytes: int, err: int, offset: int, size: int) -> None:
        with self._lock:
            self.bytes += nbytes
            if err and not self.error:
                self.error, self.error_offset, self.error_size = err, offset, size
            self._remaining -= 1
            if self._remaining == 0:
                self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float = -1.0) -> bool:
        return self._event.wait(None if timeout_s < 0 else timeout_s)


class AiofilesEngine:
    """Runs chunks on an asyncio loop in a background thread, at most queue_depth of them at once."""

    name = "aiofiles"

    def __init__(self, queue_depth: int = 32, num_threads: int = 4) -> None:
        import aiofiles.os  # imported here so `import offload` works without aiofiles

        self._pread = aiofiles.os.wrap(os.preadv)
        self._pwrite = aiofiles.os.wrap(os.pwrite)
        self._executor = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="offload-aiofiles")
        self._loop = asyncio.new_event_loop()
        self._slots: Optional[asyncio.Semaphore] = None
        self._queue_depth = max(1, queue_depth)
        self._thread = threading.Thread(target=self._run_loop, name="offload-aiofiles-loop", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()
        self._tasks: List["concurrent.futures.Future[None]"] = []  # run_coroutine_threadsafe's

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self._queue_depth)
        self._ready.set()
        self._loop.run_forever()

    def submit(self, write: bool, segments: Sequence[Segment], chunk_bytes: int) -> PyRequest:
        if self._loop.is_closed():
            raise RuntimeError("this aiofiles engine is closed")
        chunks = [
            (fd, direct, address + at, min(chunk_bytes, size - at), offset + at)
            for fd, direct, address, size, offset in segments
            for at in range(0, size, chunk_bytes)
        ]
        request = PyRequest(len(chunks))
        for chunk in chunks:
            future = asyncio.run_coroutine_threadsafe(self._run_chunk(write, chunk, request), self._loop)
            self._tasks.append(future)
        self._tasks = [t for t in self._tasks if not t.done()]
        return request

    async def _run_chunk(self, write: bool, chunk: Segment, request: PyRequest) -> None:
        fd, direct, address, size, offset = chunk
        view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        done, err = 0, 0
        assert self._slots is not None
        async with self._slots:
            while done < size and not err:
                try:
                    if write:
                        n = await self._pwrite(fd, view[done:], offset + done, executor=self._executor)
                    else:
                        n = await self._pread(fd, [view[done:]], offset + done, executor=self._executor)
                except InterruptedError:
                    continue
                except OSError as exc:
                    err = exc.errno or errno.EIO
                    break
                if n == 0:
                    err = errno.ENODATA if not write else errno.EIO  # end of file: short read
                elif direct and (offset + done + n) % _DIRECT_ALIGN and done + n < size:
                    err = errno.ENODATA if not write else errno.EIO  # O_DIRECT cannot resume unaligned
                done += n
        request.finish_chunk(done, err, offset + done, size - done if err else 0)

    def close(self) -> None:
        """Wait for every chunk, then stop the loop and the executor. Idempotent."""
        if self._loop.is_closed():
            return
        for task in self._tasks:
            task.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=True)
