"""Write and read GB/s of offload.AsyncIO against plain Python, aiofiles, torch.save/load, DeepSpeed aio
and fio O_DIRECT (the device bound), all in one process, interleaved round by round, same file size.

    python benchmarks/bench_io.py                 # 1 GiB, 1 and 8 MiB requests, 3 rounds (~1-2 min)
    python benchmarks/bench_io.py --size 4        # 4 GiB
    python benchmarks/bench_io.py --quick         # 64 MiB, a smoke run of a few seconds

Writes are timed to durability (fdatasync included; fio's own number excludes its end_fsync). Before
each read the page cache is dropped (/proc/sys/vm/drop_caches when permitted, else fadvise DONTNEED after
fsync), so reads come from the device. Each rival writes its own fresh file each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import append_csv, machine_header, print_table, summarize, sync_file  # noqa: E402
from offload.io import AsyncIO, choose_backend  # noqa: E402

ALIGN = 4096
MiB = 1 << 20


def aligned_buffer(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    buf = raw[start : start + nbytes]
    buf.copy_(torch.randint(0, 256, (min(nbytes, 64 * MiB),), dtype=torch.uint8).repeat(-(-nbytes // (64 * MiB)))[:nbytes])
    return buf


def drop_cache(path: Path) -> str:
    """Evict path from the page cache; returns how."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


# -- rivals: each has write(buf, path, request) and read(buf, path, request), both blocking ---------------
class Offload:
    def __init__(self, backend: str) -> None:
        self.backend = backend

    def write(self, buf: torch.Tensor, path: Path, request: int) -> None:
        with AsyncIO(self.backend, queue_depth=32, chunk_bytes=request) as aio:
            swap = aio.open(path, size=buf.numel())
            futures = [aio.pwrite(buf[at : at + request], swap, at) for at in range(0, buf.numel(), request)]
            for f in futures:
                f.result()
            swap.fsync()

    def read(self, buf: torch.Tensor, path: Path, request: int) -> None:
        with AsyncIO(self.backend, queue_depth=32, chunk_bytes=request) as aio:
            swap = aio.open(path, create=False)
            futures = [aio.pread(buf[at : at + request], swap, at) for at in range(0, buf.numel(), request)]
            for f in futures:
                f.result()


class PlainPython:
    def write(self, buf: torch.Tensor, path: Path, request: int) -> None:
        view = memoryview(buf.numpy())
        with open(path, "wb", buffering=0) as f:
            for at in range(0, len(view), request):
                f.write(view[at : at + request])
            os.fdatasync(f.fileno())

    def read(self, buf: torch.Tensor, path: Path, request: int) -> None:
        view = memoryview(buf.numpy())
        with open(path, "rb", buffering=0) as f:
            for at in range(0, len(view), request):
                f.readinto(view[at : at + request])


class Aiofiles:
    def write(self, buf: torch.Tensor, path: Path, request: int) -> None:
        import aiofiles

        async def run() -> None:
            view = memoryview(buf.numpy())
            async with aiofiles.open(path, "wb", buffering=0) as f:
                for at in range(0, len(view), request):
                    await f.write(view[at : at + request])
                await f.flush()
                os.fdatasync(f.fileno())

        asyncio.run(run())

    def read(self, buf: torch.Tensor, path: Path, request: int) -> None:
        import aiofiles

        async def run() -> None:
            view = memoryview(buf.numpy())
            async with aiofiles.open(path, "rb", buffering=0) as f:
                for at in range(0, len(view), request):
                    await f.readinto(view[at : at + request])

        asyncio.run(run())


class TorchSave:
    def write(self, buf: torch.Tensor, path: Path, request: int) -> None:
        torch.save(buf, path)
        sync_file(path, data_only=True)

    def read(self, buf: torch.Tensor, path: Path, request: int) -> None:
        buf.copy_(torch.load(path, weights_only=True))


class DeepSpeedAio:
    def __init__(self) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("installed, op incompatible (no libaio)")
        self.module = builder.load(verbose=False)

    def _handle(self, request: int):  # block size, queue depth, single submit, overlap events, threads
        return self.module.aio_handle(request, 32, False, True, 1)

    def write(self, buf: torch.Tensor, path: Path, request: int) -> None:
        self._handle(request).sync_pwrite(buf, str(path))
        sync_file(path, data_only=True)

    def read(self, buf: torch.Tensor, path: Path, request: int) -> None:
        self._handle(request).sync_pread(buf, str(path))


def fio_engine() -> Optional[str]:
    if shutil.which("fio") is None:
        return None
    engines = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
    return next((e for e in ("io_uring", "libaio", "psync") if e in engines), "psync")


def run_fio(engine: str, path: Path, rw: str, size: int, request: int) -> float:
    """GB/s that fio measures with O_DIRECT, queue depth 32, at this request size and file size."""
    cmd = [
        "fio", "--name=bound", f"--filename={path}", f"--rw={rw}", f"--bs={request}", f"--size={size}",
        "--direct=1", f"--ioengine={engine}", "--iodepth=32", "--numjobs=1", "--output-format=json",
    ] + (["--end_fsync=1"] if rw == "write" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="GiB per file (default 1)")
    parser.add_argument("--requests", default="1,8", help="request sizes in MiB (default 1,8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--all-backends", action="store_true", help="also time each native engine by name")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 MiB requests, 1 round (smoke test)")
    parser.add_argument("--no-csv", action="store_true", help="do not append to benchmarks/results/bench_io.csv")
    args = parser.parse_args()
    size = 64 * MiB if args.quick else int(args.size * 2**30) // ALIGN * ALIGN
    requests = [MiB] if args.quick else [int(float(r) * MiB) for r in args.requests.split(",")]
    rounds = 1 if args.quick else args.rounds

    base = Path(tempfile.mkdtemp(prefix="offload-bench-io-", dir=args.dir))
    backend, reason = choose_backend(base)
    rivals: Dict[str, object] = {f"offload ({backend.value})": Offload("auto")}
    if args.all_backends:
        for name in ("io_uring", "aio", "threads"):
            rivals[f"offload ({name})"] = Offload(name)
    rivals.update({"plain python": PlainPython(), "aiofiles": Aiofiles(), "torch.save/load": TorchSave()})
    missing: Dict[str, str] = {}
    try:
        rivals["deepspeed aio"] = DeepSpeedAio()
    except Exception as exc:  # not installed, or its op cannot build here
        missing["deepspeed aio"] = "not installed" if isinstance(exc, ImportError) else f"{exc}"[:48]
    engine = fio_engine()
    if engine is None:
        missing["fio O_DIRECT"] = "not installed"

    print(machine_header())
    print(f"dir {base} | file {size / 2**30:.2f} GiB | requests {[r // MiB for r in requests]} MiB | "
          f"rounds {rounds} | backend {backend.value}: {reason}")
    buf = aligned_buffer(size)
    samples: Dict[tuple, List[float]] = {}
    evict = "?"
    start = time.perf_counter()
    for _ in range(rounds):
        for request in requests:
            names = list(rivals) + (["fio O_DIRECT"] if engine else [])
            paths = {name: base / f"{i}.bin" for i, name in enumerate(names)}
            for name in names:  # writes, interleaved
                if name == "fio O_DIRECT":
                    rate = run_fio(engine, paths[name], "write", size, request)
                else:
                    t0 = time.perf_counter()
                    rivals[name].write(buf, paths[name], request)  # type: ignore[attr-defined]
                    rate = size / (time.perf_counter() - t0) / 1e9
                samples.setdefault((name, "write", request), []).append(rate)
            for name in names:  # reads from the device, interleaved
                evict = drop_cache(paths[name])
                if name == "fio O_DIRECT":
                    rate = run_fio(engine, paths[name], "read", size, request)
                else:
                    t0 = time.perf_counter()
                    rivals[name].read(buf, paths[name], request)  # type: ignore[attr-defined]
                    rate = size / (time.perf_counter() - t0) / 1e9
                samples.setdefault((name, "read", request), []).append(rate)
            for p in paths.values():
                p.unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)

    rows: List[Dict[str, object]] = []
    for direction in ("write", "read"):
        for request in requests:
            bound = summarize(samples.get(("fio O_DIRECT", direction, request), []))[0]
            ours = summarize(samples[(f"offload ({backend.value})", direction, request)])[0]
            for name in list(rivals) + ["fio O_DIRECT"]:
                key = (name, direction, request)
                if key not in samples:
                    continue
                median, p20, p80 = summarize(samples[key])
                rows.append({
                    "method": name, "dir": direction, "req MiB": request // MiB, "GB/s p50": f"{median:.2f}",
                    "p20-p80": f"{p20:.2f}-{p80:.2f}",
                    "of fio": f"{median / bound:.2f}" if engine else "-",
                    "offload x": f"{ours / median:.2f}",
                })
            for name, why in missing.items():
                rows.append({"method": name, "dir": direction, "req MiB": request // MiB, "GB/s p50": why})
    print_table(rows, ["method", "dir", "req MiB", "GB/s p50", "p20-p80", "of fio", "offload x"])
    print(f"page cache before reads: {evict}; writes include fdatasync; {time.perf_counter() - start:.0f} s")
    if not args.no_csv and not args.quick:
        append_csv("bench_io", [{**r, "size_gib": size / 2**30, "machine": machine_header()} for r in rows])


if __name__ == "__main__":
    main()
