"""CRC-32C throughput: each native path this CPU runs (carry-less folding with VPCLMULQDQ/AVX-512 or PCLMULQDQ,
three SSE4.2 crc32 lanes, the table fallback) vs zlib.crc32 (CRC-32, what a user without our core would reach
for), against the single-thread memory read bound measured in the same run.

    python benchmarks/bench_crc32c.py           # 256 MiB (out of cache) and 1 MiB (in cache), ~20 s
    python benchmarks/bench_crc32c.py --quick   # a few seconds (smoke test)

All rivals read the same buffer, interleaved round by round, single-threaded (a checksum runs on the thread
that moved the record). `bound` reads the buffer once with a vectorised sum (torch, 1 thread). The last
lines turn the rate into the cost per optimizer step of the nvme tier, which checksums 24 B per parameter
(12 sealed when a record is written, 12 verified when it is read back).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from benchmarks.common import append_csv, machine_header, print_table, summarize  # noqa: E402
from offload import _native  # noqa: E402

CHECKSUMMED_BYTES_PER_PARAM = 24
LABELS = {"vpclmulqdq-avx512": "4x512 fold", "pclmulqdq": "4x128 fold + 3 lanes", "sse4.2": "3 lanes"}


def label(path: str) -> str:
    return f"offload crc32c ({path}, {LABELS[path]})"


def rivals(buffer: torch.Tensor):
    C = _native._C
    ptr, nbytes = buffer.data_ptr(), buffer.numel()
    view = memoryview(buffer.numpy())
    floats = buffer.view(torch.float32)
    out = {}
    if C is not None:
        for path in C.crc32c_paths():  # each forced, so the slower paths are measured on this CPU too
            if path in LABELS:
                out[label(path)] = lambda path=path: C.crc32c_with(path, ptr, nbytes)
        out["offload crc32c (table fallback)"] = lambda: C.crc32c_portable(ptr, nbytes)
    out["zlib.crc32 (CRC-32)"] = lambda: zlib.crc32(view)
    out["bound: memory read (torch sum)"] = lambda: float(floats.sum())
    return out


def measure(nbytes: int, rounds: int):
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    fns = rivals(buffer)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [(16 << 20, 5), (1 << 20, 20)] if args.quick else [(256 << 20, 15), (1 << 20, 200)]
    print(machine_header())
    rows, best = [], {}
    for nbytes, rounds in sizes:
        samples = measure(nbytes, rounds)
        zlib_median = summarize(samples["zlib.crc32 (CRC-32)"])[0]
        for name, values in samples.items():
            median, p20, p80 = summarize(values)
            rows.append({"size": f"{nbytes >> 20} MiB", "rival": name, "GB/s": f"{median:.2f}",
                         "p20-p80": f"{p20:.2f}-{p80:.2f}", "vs zlib": f"{median / zlib_median:.2f}x"})
            best.setdefault(nbytes, {})[name] = median
    print_table(rows, ["size", "rival", "GB/s", "p20-p80", "vs zlib"])
    if not args.quick:  # smoke runs do not pollute the results
        append_csv("crc32c", [dict(row, cpu=platform.processor()) for row in rows])
    big = best[sizes[0][0]]
    C = _native._C
    default = C.crc32c_path() if C is not None else None
    ours = big.get(label(default)) if default in LABELS else None
    for name, rate in ((f"offload crc32c ({default}, the default here)", ours), ("zlib.crc32", big["zlib.crc32 (CRC-32)"])):
        if rate:
            seconds = CHECKSUMMED_BYTES_PER_PARAM * 1e9 / (rate * 1e9)
            print(f"# {name}: {seconds:.2f} s of one core per optimizer step per 1e9 parameters on the nvme tier "
                  f"({CHECKSUMMED_BYTES_PER_PARAM} B/param checksummed)")


if __name__ == "__main__":
    main()
