"""Helpers shared by the benchmarks: machine header, timing summary, table printing, CSV rows."""

from __future__ import annotations

import csv
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

RESULTS = Path(__file__).resolve().parent / "results"


def machine_header() -> str:
    """Lines naming what the numbers depend on: CPU, usable cores, memory, kernel, versions, kernel ISA."""
    import torch

    from offload import _native
    from offload._system import mem_available, usable_cores

    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    avail = mem_available()
    native = _native._C
    isa = native.adam_isa() if native is not None and hasattr(native, "adam_isa") else "n/a (no native core)"
    return "\n".join([
        f"# {cpu}; {usable_cores()} usable cores (os.cpu_count {os.cpu_count()}); {total_gib:.0f} GiB RAM"
        + (f", {avail / 2**30:.1f} GiB available" if avail else ""),
        f"# Linux {platform.release()}; Python {platform.python_version()}; torch {torch.__version__}; "
        f"offload kernel ISA {isa}",
        f"# {time.strftime('%Y-%m-%dT%H:%M:%S')}",
    ])


def summarize(samples: Sequence[float]) -> Tuple[float, float, float]:
    """(median, p20, p80) of the samples; with fewer than two, all three are the one value."""
    values = sorted(samples)
    if not values:
        return float("nan"), float("nan"), float("nan")
    if len(values) == 1:
        return values[0], values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), cuts[1], cuts[7]


def print_table(rows: List[Dict[str, object]], columns: List[str]) -> None:
    """Print rows as an aligned text table with the given columns (missing cells are blank)."""
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def append_csv(name: str, rows: Iterable[Dict[str, object]]) -> Path:
    """Append rows (with a timestamp) to benchmarks/results/<name>.csv, writing the header when new."""
    rows = list(rows)
    path = RESULTS / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    fields = ["timestamp"] + sorted({k for row in rows for k in row})
    new = not path.exists()
    if not new:
        with open(path, newline="", encoding="utf-8") as f:
            existing = next(csv.reader(f), None)
        if existing:
            fields = existing  # keep the file's columns; new keys are dropped rather than misaligned
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({"timestamp": stamp, **row})
    return path


def sync_file(path, data_only: bool = False) -> None:
    """fsync (or fdatasync) a file by path: writes timed "to durability" end with this."""
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)
