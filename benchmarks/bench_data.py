"""Random LM windows from a token file on disk: offload.data.TokenWindows (DALI with and without O_DIRECT, numpy:
one preadv per window) against a torch DataLoader over np.memmap, and the disk bound for the same reads,
interleaved round by round.

    python benchmarks/bench_data.py                  # 8 GiB of uint16 tokens in 2 GiB shards, batch 8 x 2048, 5 rounds
    python benchmarks/bench_data.py --file tok.npy   # reuse a token file (or a directory of shards)
    python benchmarks/bench_data.py --quick          # 2 shards of 2 MiB, 1 round of a few batches (smoke test)

Every rival reads the same windows in a round (offload.data.windows.WindowSampler, seed = round). Before each
rival's run the file is evicted from the page cache (posix_fadvise DONTNEED), so each run starts cold. The
disk bound reads the 4 KiB blocks covering each window with O_DIRECT, 32 in flight (offload.io.AsyncIO) and one
at a time (os.preadv): what the disk allows for this access pattern ('of bound' is over the faster of the two).
CPU ms/batch counts this process and its live children (DataLoader workers): the cores a loader takes from the
optimizer. Disk KiB/window is what the kernel fetched from storage for it (/proc/<pid>/io read_bytes): readahead
shows up there. DALI's CPU reader with O_DIRECT reads a sample's whole file, so it is skipped (with its KiB/window
measured on a 16 MiB copy) where batch x file size would not fit in RAM.
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import resource
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import append_csv, machine_header, print_table, summarize  # noqa: E402
from offload._system import mem_available  # noqa: E402
from offload.data import TokenWindows, open_token_files, write_tokens  # noqa: E402
from offload.data.token_files import TokenFiles  # noqa: E402
from offload.data.windows import WindowSampler  # noqa: E402
from offload.io import AsyncIO  # noqa: E402

ALIGN = 4096
MiB = 1 << 20
WARMUP = 2  # batches read before the clock starts (pipeline build, worker start)
BOUND_QD = "disk bound: O_DIRECT, 32 in flight"
BOUND_1 = "disk bound: O_DIRECT, 1 at a time"


def make_tokens(directory: Path, nbytes: int, shard_bytes: int, vocab: int = 50257) -> None:
    """Shards of uint16 random ids (DALI addresses at most 2**31 - 1 tokens per file), written in 32 MiB chunks
    (never the whole array in RAM) and fsynced, so evicting them from the page cache works."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    chunk = 16 * MiB  # tokens
    with tqdm(total=nbytes // 2 * 2, unit="B", unit_scale=True, desc="token shards") as bar:
        for k, first in enumerate(range(0, nbytes // 2, shard_bytes // 2)):
            tokens = min(shard_bytes // 2, nbytes // 2 - first)
            with open(directory / f"shard-{k:05d}.npy", "wb") as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "<u2", "fortran_order": False, "shape": (tokens,)})
                for at in range(0, tokens, chunk):
                    n = min(chunk, tokens - at)
                    f.write((np.frombuffer(rng.bytes(2 * n), np.uint16) % vocab).astype(np.uint16).tobytes())
                    bar.update(2 * n)
                os.fsync(f.fileno())


def evict(files: TokenFiles) -> None:
    """Drop the shards' clean pages from the page cache (root's drop_caches is not needed for this)."""
    for shard in files.shards:
        fd = os.open(shard.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_ahead_kb(path: str) -> str:
    """The block device's readahead window, which memmap page faults and buffered reads pull in around a miss."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for candidate in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            return Path(candidate).read_text().strip()
        except OSError:
            continue
    return "?"


def _proc_children() -> List[int]:
    pids: List[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return pids


def usage() -> Tuple[float, int]:
    """(CPU seconds, bytes fetched from storage) of this process and its live children (psutil, else /proc)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    cpu = own.ru_utime + own.ru_stime
    read = int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("read_bytes")))
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
                cpu += times.user + times.system
                read += child.io_counters().read_bytes
            except psutil.Error:
                continue
    except ImportError:
        tick = os.sysconf("SC_CLK_TCK")
        for pid in _proc_children():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu += (int(stat[11]) + int(stat[12])) / tick
                io = Path(f"/proc/{pid}/io").read_text().splitlines()
                read += int(next(line.split()[1] for line in io if line.startswith("read_bytes")))
            except (OSError, StopIteration):
                continue
    return cpu, read


# -- rivals: each is a function (files, sampler) -> an iterator yielding once per batch ----------------------
def token_windows(backend: str, o_direct: Optional[bool]) -> Callable[[TokenFiles, WindowSampler], Iterator]:
    def run(files: TokenFiles, sampler: WindowSampler) -> Iterator:
        path = files.shards[0].path if len(files.shards) == 1 else os.path.dirname(files.shards[0].path)
        with TokenWindows(path, sampler.window - 1, sampler.batch_size, seed=sampler.seed, backend=backend,
                          o_direct=o_direct) as windows:
            for batch in windows:
                yield batch

    return run


class MemmapWindows(torch.utils.data.Dataset):
    """The map-style Dataset a user would write: item i is row i % batch of the sampler's batch i // batch."""

    def __init__(self, files: TokenFiles, sampler: WindowSampler, batches: int) -> None:
        self.files, self.sampler, self.batches = files, sampler, batches
        self.maps: Optional[List[np.ndarray]] = None  # opened in each worker

    def __len__(self) -> int:
        return self.batches * self.sampler.batch_size

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.maps is None:
            self.maps = [np.load(s.path, mmap_mode="r") for s in self.files.shards]
        shards, starts = self.sampler.batch(i // self.sampler.batch_size)
        row = i % self.sampler.batch_size
        start = int(starts[row])
        return torch.from_numpy(self.maps[int(shards[row])][start:start + self.sampler.window].astype(np.int64))


def data_loader(workers: int, batches: int) -> Callable[[TokenFiles, WindowSampler], Iterator]:
    def run(files: TokenFiles, sampler: WindowSampler) -> Iterator:
        loader = torch.utils.data.DataLoader(MemmapWindows(files, sampler, batches), batch_size=sampler.batch_size,
                                             num_workers=workers)
        yield from loader

    return run


def extents(files: TokenFiles, sampler: WindowSampler) -> Iterator[Tuple[int, int, int]]:
    """(shard, 4 KiB-aligned offset, length) of the blocks covering each window, batch after batch."""
    offsets = [np.load(s.path, mmap_mode="r").offset for s in files.shards]
    itemsize = files.dtype.itemsize
    number = 0
    while True:
        shards, starts = sampler.batch(number)
        for shard, start in zip(shards.tolist(), starts.tolist()):
            first = offsets[shard] + start * itemsize
            low = first // ALIGN * ALIGN
            high = -(-(first + sampler.window * itemsize) // ALIGN) * ALIGN
            yield shard, low, high - low
        number += 1


def aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes]


def bound_in_flight(depth: int) -> Callable[[TokenFiles, WindowSampler], Iterator]:
    def run(files: TokenFiles, sampler: WindowSampler) -> Iterator:
        span = -(-(sampler.window * files.dtype.itemsize) // ALIGN) * ALIGN + ALIGN
        buf = aligned(depth * span)
        sizes = [s.tokens * files.dtype.itemsize + np.load(s.path, mmap_mode="r").offset for s in files.shards]
        pending: deque = deque()
        with AsyncIO(queue_depth=depth) as aio:
            handles = [aio.open(s.path, create=False, direct=True) for s in files.shards]
            source, k, done = extents(files, sampler), 0, 0
            try:
                while True:
                    while len(pending) < depth:
                        shard, offset, length = next(source)
                        length = min(length, sizes[shard] - offset)  # the last block may end past the file
                        slot = (k % depth) * span
                        pending.append(aio.pread(buf[slot:slot + length], handles[shard], offset))
                        k += 1
                    pending.popleft().result()
                    done += 1
                    if done % sampler.batch_size == 0:
                        yield None
            finally:
                for future in pending:
                    future.result()

    return run


def bound_one_at_a_time(files: TokenFiles, sampler: WindowSampler) -> Iterator:
    span = -(-(sampler.window * files.dtype.itemsize) // ALIGN) * ALIGN + ALIGN
    buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
    fds = [os.open(s.path, os.O_RDONLY | os.O_DIRECT) for s in files.shards]
    try:
        source = extents(files, sampler)
        while True:
            for _ in range(sampler.batch_size):
                shard, offset, length = next(source)
                os.preadv(fds[shard], [memoryview(buf)[:length]], offset)
            yield None
    finally:
        for fd in fds:
            os.close(fd)
        buf.close()


def measure(rival: Callable, files: TokenFiles, sampler: WindowSampler, batches: int,
            max_seconds: float) -> Tuple[int, float, float, int]:
    """(batches timed, seconds, CPU seconds, bytes fetched) for up to `batches` batches after a cold start."""
    evict(files)
    stream = rival(files, sampler)
    try:
        for _ in range(WARMUP):
            next(stream)
        cpu0, read0 = usage()
        t0 = time.perf_counter()
        done = 0
        while done < batches and (done == 0 or time.perf_counter() - t0 < max_seconds):
            next(stream)
            done += 1
        seconds = time.perf_counter() - t0
        cpu1, read1 = usage()
    finally:
        stream.close()
    return done, seconds, cpu1 - cpu0, read1 - read0


def whole_file_probe(files: TokenFiles, base: Path, sampler: WindowSampler) -> str:
    """Why DALI + O_DIRECT is skipped: its KiB/window on a copy of the first 8M tokens, measured here."""
    probe = base / "probe-16MiB.npy"
    write_tokens(probe, np.load(files.shards[0].path, mmap_mode="r")[:8 * MiB])
    small = open_token_files(probe, sampler.window)
    try:
        done, _, _, read = measure(token_windows("dali", True), small,
                                   WindowSampler(small, sampler.window, sampler.batch_size, 0), 2, 30.0)
        copy_mib = small.tokens * small.dtype.itemsize / MiB
        return f"{read / done / sampler.batch_size / 1024:.0f} KiB/window on a {copy_mib:.0f} MiB copy"
    finally:
        probe.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=8.0, help="GiB of uint16 tokens to write (default 8)")
    parser.add_argument("--shard", type=float, default=2.0, help="GiB per shard written (default 2)")
    parser.add_argument("--file", default=None, help="an existing token .npy (or directory of shards) to read")
    parser.add_argument("--dir", default=None, help="where to write the token file (default: a temp dir)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=100, help="timed batches per rival and round")
    parser.add_argument("--max-seconds", type=float, default=8.0, help="cap on one rival's timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--quick", action="store_true", help="2 shards of 2 MiB, 1 round of 4 batches (smoke test)")
    parser.add_argument("--no-csv", action="store_true", help="do not append to benchmarks/results/bench_data.csv")
    args = parser.parse_args()
    rounds, batches = (1, 4) if args.quick else (args.rounds, args.batches)

    base = Path(tempfile.mkdtemp(prefix="offload-bench-data-", dir=args.dir))
    print(machine_header())
    try:
        if args.file:
            path = args.file
        else:
            path = str(base / "tokens")
            make_tokens(Path(path), 4 * MiB if args.quick else int(args.size * 2**30),
                        2 * MiB if args.quick else int(args.shard * 2**30))
        files = open_token_files(path, args.seq_len + 1)
        rivals: Dict[str, Callable] = {}
        skipped: Dict[str, str] = {}
        file_bytes = files.tokens * files.dtype.itemsize
        try:
            importlib.import_module("nvidia.dali")

            # DALI's CPU reader with O_DIRECT reads each sample's whole file (see the probe): guard the RAM
            need = args.batch * file_bytes * 4
            if need < (mem_available() or 0) / 2:
                rivals["offload.data dali, O_DIRECT"] = token_windows("dali", True)
            else:
                why = whole_file_probe(files, base, WindowSampler(files, args.seq_len + 1, args.batch, 0))
                skipped["offload.data dali, O_DIRECT"] = (f"reads the whole file per window ({why}); "
                                                          f"~{need / 2**30:.0f} GiB of RAM needed here")
            rivals["offload.data dali, page cache"] = token_windows("dali", False)
        except ImportError as exc:
            for name in ("offload.data dali, O_DIRECT", "offload.data dali, page cache"):
                skipped[name] = f"DALI not importable ({exc})"
        rivals["offload.data numpy (auto on CPU: preadv, FADV_RANDOM, thread)"] = token_windows("numpy", None)
        rivals[f"torch DataLoader, {args.workers} workers, np.memmap"] = data_loader(args.workers, WARMUP + batches)
        rivals[BOUND_QD] = bound_in_flight(32)
        rivals[BOUND_1] = bound_one_at_a_time

        avail = mem_available() or 0
        window_bytes = (args.seq_len + 1) * files.dtype.itemsize
        print(f"file {path}: {file_bytes / 2**30:.2f} GiB, {files.tokens} {files.dtype} tokens in "
              f"{len(files.shards)} shard(s) | batch {args.batch} x seq_len {args.seq_len} ({window_bytes} B per "
              f"window) | {rounds} round(s) of up to {batches} batches or {args.max_seconds:.0f} s per rival | "
              f"readahead {read_ahead_kb(files.shards[0].path)} KiB")
        print(("the file fits in RAM (" if file_bytes < avail else "the file exceeds free RAM (")
              + f"{avail / 2**30:.1f} GiB available): evicted with posix_fadvise(DONTNEED) before every rival's run, "
              "so runs start cold; pages one run's readahead brings in serve that run's later windows")

        samples: Dict[str, List[Tuple[float, float, float, float]]] = {}
        names = list(rivals)
        start = time.perf_counter()
        with tqdm(total=rounds * len(names), desc="rounds x rivals", leave=False) as bar:
            for r in range(rounds):
                sampler = WindowSampler(files, args.seq_len + 1, args.batch, seed=r)
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who reads first
                    done, seconds, cpu, read = measure(rivals[name], files, sampler, batches, args.max_seconds)
                    wins = done * args.batch
                    samples.setdefault(name, []).append((wins / seconds, 1e3 * cpu / done, read / wins / 1024,
                                                         read / file_bytes))
                    bar.update()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    bound_name = max((BOUND_QD, BOUND_1), key=lambda n: summarize([s[0] for s in samples[n]])[0])
    bound = summarize([s[0] for s in samples[bound_name]])[0]
    rows: List[Dict[str, object]] = []
    for name in list(skipped) + names:
        if name in skipped:
            rows.append({"method": name, "windows/s": "skipped", "note": skipped[name]})
            continue
        rate, p20, p80 = summarize([s[0] for s in samples[name]])
        rows.append({
            "method": name, "windows/s": f"{rate:.0f}", "p20-p80": f"{p20:.0f}-{p80:.0f}",
            "MB/s": f"{rate * window_bytes / 1e6:.1f}", "of bound": f"{rate / bound:.2f}",
            "CPU ms/batch": f"{summarize([s[1] for s in samples[name]])[0]:.2f}",
            "disk KiB/window": f"{summarize([s[2] for s in samples[name]])[0]:.0f}",
        })
    print_table(rows, ["method", "windows/s", "p20-p80", "MB/s", "of bound", "CPU ms/batch", "disk KiB/window"])
    for name, why in skipped.items():
        print(f"{name}: {why}")
    cached = max([s[3] for name in names if "O_DIRECT" not in name for s in samples[name]], default=0.0)
    print(f"page-cache rows: one run's readahead fetched at most {100 * cached:.0f}% of the file's bytes, so up to "
          "that share of its later windows came from the cache (over a file far larger than RAM they would not)")
    print(f"MB/s counts the windows' tokens ({window_bytes} B each); the disk bound reads the covering 4 KiB blocks; "
          f"'of bound' is windows/s over the faster disk row ('{bound_name}'); {time.perf_counter() - start:.0f} s")
    if not args.no_csv and not args.quick:
        append_csv("bench_data", [{**row, "file_gib": round(file_bytes / 2**30, 2), "batch": args.batch,
                                   "seq_len": args.seq_len, "rounds": rounds, "machine": machine_header()}
                                  for row in rows])


if __name__ == "__main__":
    main()
