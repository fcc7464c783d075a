"""The windows read from the token files by one background thread, a few batches ahead.

The reader on a CPU device, and the reference the DALI pipeline is tested against. Each window is one
`preadv` into the batch, from a descriptor advised POSIX_FADV_RANDOM: only the window's pages are read, so a
token file larger than RAM streams through the page cache, and no readahead around each few-KiB window takes
disk bandwidth and CPU from the swap file and the optimizer. Measured on this repository's test machine
(8 MiB readahead, cache dropped): 7.8 KiB read per 4 KiB window and 0.36 ms CPU per batch of 8 x 2049,
against 7.8 KiB and 0.58 ms through the mapping advised MADV_RANDOM that this reader used before
(benchmarks/bench_data.py measured that one: 2.4 MiB per window without the advice).

Why not a mapping: a token file rewritten in place while it is read (`np.save` over it truncates it, then
writes) turns every mapped page past the new end into a SIGBUS that kills the process with no Python error.
A read past the end is only short; see [Note: a token file changed while read].
"""

from __future__ import annotations

import os
import queue
import threading
from typing import List, Optional, Union

import numpy as np
import torch

from offload.data.token_files import TokenFiles, TokenShard, npy_header
from offload.data.windows import WindowSampler
from offload.errors import OffloadIntegrityError

_DONE = object()
REWRITE_FIX = ("do not rewrite a token file while it is read; write a new file and rename it into place "
               "(offload.data.write_tokens and python -m offload tokenize do), which readers already open "
               "never see")

# [Note: a token file changed while read]
# A token file must not change while TokenWindows reads it. The shard is opened once and read by preadv from
# that descriptor, so a file renamed over it changes nothing here (the descriptor keeps the old file). A file
# rewritten in place is caught three ways, each an OffloadIntegrityError naming the file and the fix:
#   - at opening, the header read from the descriptor must give the length and dtype the shards were checked
#     with (the file may have been replaced since TokenWindows was built);
#   - a window read short (truncated, or not yet written again);
#   - after each batch's reads, the descriptor's size and mtime must be those seen at opening, so a batch
#     read across a rewrite of the same size is not returned.
# Left unseen: a same-size rewrite that the file system's timestamp granularity (a few ms on some) cannot
# tell from the write before the file was opened; windows read before a rewrite began are valid old data.


class ShardReader:
    """One token file, held open: windows read into caller buffers, the file checked for changes."""

    def __init__(self, shard: TokenShard, dtype: np.dtype) -> None:
        self.path = shard.path
        self._fd = os.open(shard.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            with os.fdopen(os.dup(self._fd), "rb") as f:
                shape, found, self._offset = npy_header(f)
            if (int(shape[0]) if len(shape) == 1 else -1, found) != (shard.tokens, dtype):
                now = f"{shape[0]} {found} tokens" if len(shape) == 1 else f"a {found} array of shape {shape}"
                raise OffloadIntegrityError(
                    f"token file {shard.path!r} changed after TokenWindows checked it: it holds {now}, not the "
                    f"{shard.tokens} {dtype} tokens it held when TokenWindows was built; build TokenWindows "
                    "again after changing its files (its windows and saved positions depend on their lengths)",
                    shard.path)
            status = os.fstat(self._fd)
            self._seen = (status.st_size, status.st_mtime_ns)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # readahead off: windows are random
        except BaseException:
            os.close(self._fd)
            raise
        self._itemsize = dtype.itemsize

    def read(self, into: np.ndarray, start: int) -> None:
        """Tokens [start, start + len(into)) into the contiguous 1-D `into` (of the file's dtype)."""
        buffer = into.data.cast("B")
        at, got = self._offset + start * self._itemsize, 0
        while got < len(buffer):  # a read may return less (network file systems); 0 bytes: the file's end
            if hasattr(os, "preadv"):
                n = os.preadv(self._fd, [buffer[got:]], at + got)
            else:  # pragma: no cover - platforms without preadv
                data = os.pread(self._fd, len(buffer) - got, at + got)
                n = len(data)
                buffer[got:got + n] = data
            if n == 0:
                raise self._changed(f"a window at token {start} read {got} of {len(buffer)} bytes: the file is "
                                    "shorter now")
            got += n

    def check(self) -> None:
        status = os.fstat(self._fd)
        if (status.st_size, status.st_mtime_ns) != self._seen:
            raise self._changed(f"its size or modification time changed (size {self._seen[0]} -> "
                                f"{status.st_size} bytes)")

    def _changed(self, what: str) -> OffloadIntegrityError:
        return OffloadIntegrityError(f"token file {self.path!r} changed while TokenWindows read it: {what}; "
                                     f"{REWRITE_FIX}", self.path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_windows(readers: List[ShardReader], sampler: WindowSampler, number: int, dtype: np.dtype) -> np.ndarray:
    """Batch `number` as an int64 array (batch_size, window); raises if a file it read from changed."""
    shards, starts = sampler.batch(number)
    raw = np.empty((sampler.batch_size, sampler.window), dtype=dtype)
    for row, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist())):
        readers[shard].read(raw[row], start)
    for shard in set(shards.tolist()):
        readers[shard].check()
    return raw.astype(np.int64)


class NumpyWindowStream:
    """Batches `start`, `start + 1`, ... of `sampler`, prepared by a daemon thread `prefetch` batches ahead."""

    def __init__(self, files: TokenFiles, sampler: WindowSampler, start: int, device: Optional[torch.device],
                 prefetch: int = 2) -> None:
        self._readers: List[ShardReader] = []
        try:
            for shard in files.shards:
                self._readers.append(ShardReader(shard, files.dtype))
        except BaseException:
            self._close_readers()
            raise
        self._dtype = files.dtype
        self._sampler = sampler
        self._device = device
        self._pin = device is not None and device.type == "cuda"
        self._ready: "queue.Queue[Union[torch.Tensor, BaseException, object]]" = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(start,), name="offload-token-windows", daemon=True)
        self._thread.start()

    def _produce(self, number: int) -> None:
        try:
            while not self._stop.is_set():
                batch = torch.from_numpy(read_windows(self._readers, self._sampler, number, self._dtype))
                self._put(batch.pin_memory() if self._pin else batch)
                number += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> torch.Tensor:
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, torch.Tensor)
        if self._device is not None and item.device != self._device:
            return item.to(self._device, non_blocking=self._pin)
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else the daemon thread may still read: leave its descriptors open
            self._close_readers()

    def _close_readers(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers = []
