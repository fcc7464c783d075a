"""Measure, in the running process, the bandwidths that bound a training step, and compute that bound.

DESIGN.md section 2: on a machine without a GPU, compute and the CPU Adam share the cores and DRAM, and
reads and writes share the disk, so a step cannot beat `max(T_compute + T_cpu, T_read + T_write)`.
`benchmarks/bench_train.py` and `python -m offload demo` both report `efficiency = bound / step` with
the bandwidths measured here, in the same run, on the same machine and the same swap directory.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional

import torch

ADAM_BYTES_PER_PARAM = {torch.float32: 32, torch.bfloat16: 30, torch.float16: 30}  # DESIGN.md section 2


def dram_bandwidth(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Bytes/s of one large copy, read and write both counted."""
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * src.nbytes / (time.perf_counter() - start)


@dataclass(frozen=True)
class DiskBandwidth:
    """Bytes/s of O_DIRECT writes (to durability) and reads of fresh regions of a file in `directory`."""

    read: float
    write: float
    backend: str
    direct: bool


class DiskProbe:
    """Times AsyncIO writes and reads of fresh file regions in the swap directory, one sample per call.

    Each sample writes `sample_bytes` to a region never written before and reads it back with O_DIRECT
    (when the file system allows it), so neither the page cache nor an earlier sample's data is measured.
    Requests go in `request_bytes` pieces, `queue` at a time, like the engine's ring.
    """

    def __init__(self, directory: Optional[str], sample_bytes: int = 64 << 20, samples: int = 8,
                 request_bytes: int = 8 << 20) -> None:
        from offload.io import AsyncIO
        from offload.tiers.host import StagingPool

        self.sample_bytes = sample_bytes
        self.request_bytes = min(request_bytes, sample_bytes)
        self._regions = samples
        self._next = 0
        directory = directory or tempfile.gettempdir()
        self._path = os.path.join(directory, f"offload-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin")
        self._io = AsyncIO()
        self._file = self._io.open(self._path, size=sample_bytes * samples)
        self._pool = StagingPool(sample_bytes)
        self._lease = self._pool.lease(sample_bytes)
        self._buffer = self._lease.view(torch.uint8, (sample_bytes,))
        self._buffer.copy_(torch.randint(0, 256, (sample_bytes,), dtype=torch.uint8))
        self.reads: List[float] = []
        self.writes: List[float] = []

    def sample(self) -> None:
        """Write then read one fresh region; appends bytes/s to `writes` and `reads`."""
        offset = (self._next % self._regions) * self.sample_bytes
        self._next += 1
        for write, out in ((True, self.writes), (False, self.reads)):
            start = time.perf_counter()
            futures = []
            for piece in range(0, self.sample_bytes, self.request_bytes):
                part = self._buffer[piece:piece + self.request_bytes]
                futures.append(self._io.pwrite(part, self._file, offset + piece) if write
                               else self._io.pread(part, self._file, offset + piece))
            for future in futures:
                future.result()
            if write:
                os.fdatasync(self._file.buffered_fd)
            out.append(self.sample_bytes / (time.perf_counter() - start))

    def result(self) -> DiskBandwidth:
        from statistics import median

        return DiskBandwidth(median(self.reads), median(self.writes), self._io.backend.value, self._file.direct)

    def close(self) -> None:
        self._buffer = None  # type: ignore[assignment]
        self._lease.release()
        self._pool.close()
        self._io.close()
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class StepBound:
    """The step-time bound of DESIGN.md section 2 for a machine without a GPU, and its parts (seconds)."""

    t_compute: float
    t_cpu: float
    t_read: float
    t_write: float

    @property
    def seconds(self) -> float:
        return max(self.t_compute + self.t_cpu, self.t_read + self.t_write)

    @property
    def limited_by(self) -> str:
        return "disk" if self.t_read + self.t_write > self.t_compute + self.t_cpu else "compute + cpu"

    def efficiency(self, step_seconds: float) -> float:
        return self.seconds / step_seconds


def step_bound(t_compute: float, trainable_params: int, dtype: torch.dtype, dram_bytes_per_s: float,
               disk_read_bytes: float = 0.0, disk_write_bytes: float = 0.0,
               disk: Optional[DiskBandwidth] = None) -> StepBound:
    """Bound of one step: T_cpu from the Adam bytes per parameter at the DRAM bandwidth, T_read and T_write
    from the bytes a step moves to and from disk at the measured disk bandwidths."""
    t_cpu = trainable_params * ADAM_BYTES_PER_PARAM[dtype] / dram_bytes_per_s
    t_read = disk_read_bytes / disk.read if disk is not None and disk_read_bytes else 0.0
    t_write = disk_write_bytes / disk.write if disk is not None and disk_write_bytes else 0.0
    return StepBound(t_compute, t_cpu, t_read, t_write)


__all__ = ["DiskBandwidth", "DiskProbe", "StepBound", "dram_bandwidth", "step_bound"]
