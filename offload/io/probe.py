"""choose_backend: pick the fastest native engine for a directory by a short timed probe, cached per device.

The probe writes and reads PROBE_BYTES in 1 MiB requests with each engine the kernel offers (O_DIRECT
where the file system allows it), two rounds interleaved, and keeps the best of each. Engines within
TIE_MARGIN of the fastest count as equal and the preference order (backend.NATIVE_PREFERENCE) decides.
Results are cached in $XDG_CACHE_HOME/offload/io_backend.json (default ~/.cache) keyed by the device id and
kernel release, so `python -m offload doctor` and every later run pay nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

from offload import _native
from offload.errors import OffloadConfigError
from offload.io.backend import NATIVE_PREFERENCE, IOBackend
from offload.io.swap_file import DIRECT_ALIGNMENT, PathLike, file_system_of, open_swap_file

PROBE_BYTES = 32 << 20
PROBE_REQUEST = 1 << 20
TIE_MARGIN = 0.05


def cache_path() -> Path:
    """Where measured choices are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "offload" / "io_backend.json"


def _cache_key(directory: str) -> str:
    return f"dev={os.stat(directory).st_dev}:kernel={os.uname().release}"


def _load_cache() -> Dict[str, Dict[str, str]]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_cache(key: str, backend: IOBackend, reason: str) -> None:
    path = cache_path()
    data = _load_cache()
    data[key] = {"backend": backend.value, "reason": reason}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def available_native_backends() -> Dict[IOBackend, str]:
    """Each native engine the kernel offers, mapped to '' (usable) or why not."""
    status: Dict[IOBackend, str] = {}
    for backend in NATIVE_PREFERENCE:
        if _native._C is None:
            status[backend] = f"native core unavailable ({_native.native_import_error()})"
            continue
        try:
            _native._C.IoEngine(backend.value, 4, 1).close()
            status[backend] = ""
        except OSError as exc:
            status[backend] = f"refused by the kernel: {exc}"
    return status


def _aligned_buffer(nbytes: int) -> Tuple[object, int]:
    import torch

    raw = torch.empty(nbytes + DIRECT_ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % DIRECT_ALIGNMENT
    buf = raw[shift : shift + nbytes]
    buf.fill_(0x5A)
    return raw, buf.data_ptr()


def probe_bytes(directory: str) -> int:
    """PROBE_BYTES, or a quarter of the free space when that is less (whole MiB): a small file system that
    has room for its swap file is measured, not refused for the probe's sake. 0: too little to measure."""
    quarter = shutil.disk_usage(directory).free // 4 // PROBE_REQUEST * PROBE_REQUEST
    return min(PROBE_BYTES, quarter)


def _time_engine(backend: IOBackend, fds: Tuple[int, bool], address: int, nbytes: int) -> float:
    """Seconds to write then read `nbytes` through one engine (queue depth 16, 1 MiB requests)."""
    assert _native._C is not None
    fd, direct = fds
    engine = _native._C.IoEngine(backend.value, 16, 4)
    try:
        start = time.perf_counter()
        for write in (True, False):
            request = engine.submit(write, [(fd, direct, address, nbytes, 0)], PROBE_REQUEST)
            request.wait(-1.0)
            if request.error:
                raise OSError(request.error, os.strerror(request.error))
        return time.perf_counter() - start
    finally:
        engine.close()


def _measure(directory: str, usable: List[IOBackend], nbytes: int) -> Tuple[IOBackend, str]:
    with tempfile.TemporaryDirectory(prefix=".offload-probe-", dir=directory) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            swap = open_swap_file(
                os.path.join(tmp, "probe.bin"), size=nbytes, direct=None, create=True, warned_file_systems=set()
            )
        raw, address = _aligned_buffer(nbytes)
        fds = (swap.direct_fd, True) if swap.direct else (swap.buffered_fd, False)
        best: Dict[IOBackend, float] = {}
        try:
            for _ in range(2):
                for backend in usable:
                    try:
                        seconds = _time_engine(backend, fds, address, nbytes)
                    except OSError:
                        continue
                    best[backend] = min(best.get(backend, float("inf")), seconds)
        finally:
            swap.close()
            del raw
    if not best:
        return IOBackend.THREADS, "every native engine failed the probe; using the pread/pwrite thread pool"
    fastest = min(best.values())
    winner = next(b for b in NATIVE_PREFERENCE if b in best and best[b] <= fastest * (1 + TIE_MARGIN))
    rates = ", ".join(f"{b.value} {2 * nbytes / best[b] / 1e9:.2f} GB/s" for b in NATIVE_PREFERENCE if b in best)
    mode = "O_DIRECT" if fds[1] else "buffered"
    return winner, f"measured on {file_system_of(directory)} ({mode}, write+read {nbytes >> 20} MiB): {rates}"


def choose_backend(directory: PathLike) -> Tuple[IOBackend, str]:
    """The fastest I/O engine for files in `directory`, and why: measured once (< 2 s), then cached."""
    path = os.fspath(directory)
    if not os.path.isdir(path):
        raise OffloadConfigError(f"{path!r} is not a directory: give the directory that will hold the swap files")
    if _native._C is None:
        return IOBackend.AIOFILES, f"native core unavailable ({_native.native_import_error()}): pure-Python aiofiles"
    key = _cache_key(path)
    cached = _load_cache().get(key)
    if cached:
        try:
            return IOBackend(cached["backend"]), f"cached: {cached['reason']}"
        except (KeyError, ValueError):
            pass
    status = available_native_backends()
    usable = [b for b in NATIVE_PREFERENCE if not status[b]]
    if not usable:
        reasons = "; ".join(f"{b.value}: {why}" for b, why in status.items())
        return IOBackend.AIOFILES, f"no native engine usable ({reasons}): pure-Python aiofiles"
    if not os.access(path, os.W_OK):
        return usable[0], f"{path!r} is not writable, so not measured: first usable engine"
    nbytes = probe_bytes(path)
    if nbytes == 0:  # not cached: a later run, with more room, measures
        return usable[0], f"{path!r} has under 4 MiB free, so not measured: first usable engine"
    backend, reason = _measure(path, usable, nbytes)
    _store_cache(key, backend, reason)
    return backend, reason
