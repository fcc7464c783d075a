"""The windows read from memory-mapped token files by one background thread, a few batches ahead.

The reader on a CPU device, and the reference the DALI pipeline is tested against. Only the windows' pages
are touched, so a token file larger than RAM streams through the page cache. Each mapping is advised
MADV_RANDOM: the kernel's readahead (8 MiB on many disks) would otherwise fetch megabytes around every
few-KiB window, taking disk bandwidth and CPU from the swap file and the optimizer (measured by
benchmarks/bench_data.py: 2.4 MiB read per 4 KiB window without the advice, under 8 KiB with it).
"""

from __future__ import annotations

import mmap
import queue
import threading
from typing import List, Optional, Union

import numpy as np
import torch

from offload.data.token_files import TokenFiles, npy_header
from offload.data.windows import WindowSampler

_DONE = object()


def read_windows(maps: List[np.ndarray], sampler: WindowSampler, number: int) -> np.ndarray:
    """Batch `number` as an int64 array (batch_size, window)."""
    shards, starts = sampler.batch(number)
    out = np.empty((sampler.batch_size, sampler.window), dtype=np.int64)
    for row, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist())):
        out[row] = maps[shard][start:start + sampler.window]
    return out


def map_random(path: str) -> np.ndarray:
    """The file's 1-D array, mapped read-only with readahead off (MADV_RANDOM where the platform has it)."""
    shape, dtype, offset = npy_header(path)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype=dtype, count=shape[0], offset=offset)


class NumpyWindowStream:
    """Batches `start`, `start + 1`, ... of `sampler`, prepared by a daemon thread `prefetch` batches ahead."""

    def __init__(self, files: TokenFiles, sampler: WindowSampler, start: int, device: Optional[torch.device],
                 prefetch: int = 2) -> None:
        self._maps = [map_random(s.path) for s in files.shards]
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
                batch = torch.from_numpy(read_windows(self._maps, self._sampler, number))
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
        self._maps.clear()
