"""The windows read by an NVIDIA DALI pipeline: `fn.readers.numpy` with a region of interest per sample.

Each shard has a reader whose ROI for a sample is its window when the sampler picked that shard and empty
otherwise; concatenating the readers' outputs gives each sample its one window. On a CUDA device the reader
is DALI's GPU backend (GPUDirect Storage where present) and batches arrive on the device. DALI's ROI
coordinates are int32: a shard of more than 2**31 - 1 tokens is refused (split it, or use backend="numpy").

On the CPU, DALI 2.4's reader takes the ROI after reading: with `use_o_direct` it reads each sample's whole
file (measured: 512 MiB read for one 4 KiB window of a 512 MiB file), and through its mapping the kernel's
readahead fetches megabytes per window. So O_DIRECT is off unless asked for, and `backend="auto"` reads on
a CPU device with numpy (numpy_reader.py: readahead off); see [Note: token windows].
"""

from __future__ import annotations

import errno
import os
from typing import Any, List, Optional

import numpy as np
import torch

from offload.data.token_files import TokenFiles
from offload.data.windows import WindowSampler
from offload.errors import OffloadConfigError

INSTALL = "pip install nvidia-dali-cuda130  (or pip install \"offload[dali]\"; nvidia-dali-cuda120 for CUDA 12 drivers)"
MAX_ROI = 2 ** 31 - 1


def dali_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


def check_dali_limits(files: TokenFiles) -> None:
    for shard in files.shards:
        if shard.tokens > MAX_ROI:
            raise OffloadConfigError(f"token file {shard.path!r} holds {shard.tokens} tokens; DALI's numpy reader "
                                     f"addresses at most {MAX_ROI} per file: split it into a directory of shards, "
                                     "or use backend=\"numpy\"")


def supports_o_direct(path: str) -> bool:
    """Whether `path`'s file system accepts O_DIRECT (tmpfs and some network file systems do not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    return True


class DaliWindowStream:
    """Batches `start`, `start + 1`, ... of `sampler` from a DALI pipeline (its own prefetch queue)."""

    def __init__(self, files: TokenFiles, sampler: WindowSampler, start: int, device: Optional[torch.device],
                 prefetch: int = 2, o_direct: bool = False, threads: int = 1) -> None:
        check_dali_limits(files)
        self._sampler, self._start, self._shards = sampler, start, len(files.shards)
        self._device = device if device is not None and device.type == "cuda" else None
        if o_direct and not all(supports_o_direct(s.path) for s in files.shards):
            raise OffloadConfigError(f"o_direct=True, but the file system of {files.shards[0].path!r} does not "
                                     "accept O_DIRECT (tmpfs, some network file systems); leave o_direct off")
        self._pipe = self._build(files, prefetch, o_direct, threads)

    def _regions(self, info: Any) -> List[List[np.ndarray]]:
        """Per shard: each sample's ROI start and shape (int32, as DALI takes them)."""
        shards, starts = self._sampler.batch(self._start + info.iteration)
        window = self._sampler.window
        out: List[List[np.ndarray]] = []
        for k in range(self._shards):
            mine = shards == k
            out.append([np.array([s], np.int32) for s in np.where(mine, starts, 0).tolist()])
            out.append([np.array([n], np.int32) for n in np.where(mine, window, 0).tolist()])
        return out

    def _build(self, files: TokenFiles, prefetch: int, o_direct: bool, threads: int) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        device = self._device
        gpu = device is not None
        device_id: Optional[int] = None
        if device is not None:
            device_id = device.index if device.index is not None else torch.cuda.current_device()

        # The ignore: DALI 2.4's typed overloads of pipeline_def omit exec_dynamic and device_id=None (a CPU-only
        # pipeline), which its implementation takes (**pipeline_kwargs, passed on to Pipeline).
        @pipeline_def(batch_size=self._sampler.batch_size, num_threads=threads,  # type: ignore[call-overload]
                      device_id=device_id, prefetch_queue_depth=max(1, prefetch), exec_dynamic=True)
        def windows() -> Any:
            regions = fn.external_source(source=self._regions, num_outputs=2 * self._shards, batch=True,
                                         batch_info=True)
            parts = [fn.readers.numpy(device="gpu" if gpu else "cpu", files=[shard.path], roi_axes=[0],
                                      roi_start=regions[2 * k], roi_shape=regions[2 * k + 1],
                                      dont_use_mmap=o_direct, use_o_direct=o_direct)
                     for k, shard in enumerate(files.shards)]
            joined = parts[0] if len(parts) == 1 else fn.cat(*parts, axis=0)
            return fn.cast(joined, dtype=types.DALIDataType.INT64)

        pipe = windows()
        pipe.build()
        return pipe

    def next(self) -> torch.Tensor:
        (out,) = self._pipe.run()
        if self._device is None:
            return torch.from_numpy(out.as_array())
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = out.as_tensor()
        batch = torch.empty(dense.shape(), dtype=torch.int64, device=self._device)
        feed_ndarray(dense, batch, cuda_stream=torch.cuda.current_stream(self._device))
        return batch

    def close(self) -> None:
        del self._pipe
