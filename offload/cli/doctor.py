"""`python -m offload doctor`: what offload can use on this machine, and why any part is not active."""

from __future__ import annotations

import importlib
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from offload import _native
from offload._system import mem_available, memlock_limit, usable_cores

Row = Tuple[str, str, str]  # (part, status, detail)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def native_rows() -> List[Row]:
    C = _native._C
    if C is None:
        reason = _native.native_import_error() or "unknown"
        return [("native core (offload._C)", "MISSING", f"{reason}; pure-PyTorch fallbacks in use. "
                 "Rebuild with `pip install -v .` to see the compiler's error.")]
    rows = [("native core (offload._C)", "ok", Path(C.__file__).name if C.__file__ else C.__name__)]
    if hasattr(C, "adam_step"):
        rows.append(("fused CPU Adam", "ok", f"{C.adam_isa()} kernel (chosen at run time), "
                     f"up to {usable_cores()} threads"))
    else:
        rows.append(("fused CPU Adam", "fallback", "this build has no native Adam; torch maths in use"))
    if hasattr(C, "crc32c"):
        rows.append(("crc32c checksums", "ok", f"{C.crc32c_path()} path (chosen at run time)"))
    else:
        rows.append(("crc32c checksums", "fallback", "this build has no native crc32c; zlib crc32 for new files"))
    rows.append(("staging buffers", "ok" if hasattr(C, "HostArena") else "fallback",
                 "4 KiB-aligned arena with a hard budget" if hasattr(C, "HostArena") else "torch allocations"))
    return rows


def cpu_rows() -> List[Row]:
    C = _native._C
    features = C.cpu_features() if C is not None else {}
    found = ", ".join(name for name, ok in features.items() if ok) or "unknown (native core unavailable)"
    return [("CPU", platform.processor() or platform.machine(), f"{usable_cores()} usable cores; features: {found}")]


def io_rows(directory: Path) -> List[Row]:
    try:
        io = importlib.import_module("offload.io")
    except ImportError as exc:
        return [("async I/O", "MISSING", f"offload.io failed to import: {exc}")]
    choose: Callable | None = getattr(io, "choose_backend", None)
    if choose is None:
        return [("async I/O", "MISSING", "offload.io has no choose_backend (incomplete install?)")]
    try:
        backend, reason = choose(directory)
    except Exception as exc:  # doctor reports, never crashes
        return [("async I/O", "ERROR", f"choosing a backend in {directory} failed: {exc}")]
    return [("async I/O", getattr(backend, "name", str(backend)).lower(), f"in {directory}: {reason}")]


def block_queue_of(path: Path) -> Optional[Path]:
    """The sysfs queue directory of the block device holding `path` (its disk's, for a partition), or None
    (no such device: tmpfs, overlay, a network file system, or no /sys)."""
    try:
        dev = os.stat(path).st_dev
        device = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve(strict=True)
    except OSError:
        return None
    for candidate in (device, device.parent):
        if (candidate / "queue" / "scheduler").is_file():
            return candidate / "queue"
    return None


def disk_rows(directory: Path) -> List[Row]:
    """The swap directory's disk as the kernel sees it: the nvme tier keeps dozens of reads and writes in flight,
    and the I/O scheduler decides their order."""
    queue = block_queue_of(directory)
    if queue is None:
        return [("swap disk", "unknown", f"{directory} is not on a block device offload can see in /sys")]
    try:
        schedulers = (queue / "scheduler").read_text().split()
        rotational = (queue / "rotational").read_text().strip() == "1"
    except OSError as exc:
        return [("swap disk", "unknown", f"{queue}: {exc}")]
    active = next((name.strip("[]") for name in schedulers if name.startswith("[")), "unknown")
    detail = f"/dev/{queue.parent.name}, {'rotational' if rotational else 'non-rotational'}, I/O scheduler {active}"
    return [("swap disk", active, detail)]


def memory_rows() -> List[Row]:
    limit = memlock_limit()
    avail = mem_available()
    lock_text = "unlimited" if limit is None else f"{limit} bytes"
    advice = "" if limit is None or limit >= 2**30 or os.geteuid() == 0 else (
        " (page-locking the staging pool may fail: raise it with `ulimit -l unlimited` or "
        "`docker run --ulimit memlock=-1`)")
    return [("memlock limit", lock_text, advice.strip()),
            ("host memory available", _gib(avail) if avail is not None else "unknown", "MemAvailable, cgroup-capped")]


def cuda_rows() -> List[Row]:
    C = _native._C
    built = bool(C is not None and getattr(C, "built_with_cuda", False))
    usable = torch.cuda.is_available()
    if usable:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        detail = f"torch {torch.__version__} (CUDA {torch.version.cuda}): {names}"
    elif torch.version.cuda is None:
        detail = f"torch {torch.__version__} is a CPU build; the compute device is the CPU"
    else:
        detail = f"torch {torch.__version__} has CUDA {torch.version.cuda} but sees no device"
    built_text = (f"offload._C built with CUDA runtime {C.cuda_runtime_version}" if C is not None and built
                  else "offload._C built without the CUDA toolkit (pinning goes through torch)")
    return [("CUDA", "usable" if usable else "not usable", detail), ("CUDA in offload._C", str(built), built_text)]


def report(directory: Path) -> str:
    rows = native_rows() + cpu_rows() + io_rows(directory) + disk_rows(directory) + memory_rows() + cuda_rows()
    width = max(len(r[0]) for r in rows)
    swidth = max(len(r[1]) for r in rows)
    lines = [f"offload doctor (python {platform.python_version()}, torch {torch.__version__})"]
    lines += [f"  {part:<{width}}  {status:<{swidth}}  {detail}" for part, status, detail in rows]
    return "\n".join(lines)


def main(directory: str | None = None) -> int:
    print(report(Path(directory) if directory else Path(tempfile.gettempdir())))
    return 0
