"""Helpers every benchmark shares: the machine header, timing summaries, a printed table, CSV rows."""

from __future__ import annotations

import csv
import os
import platform
import statistics
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

RESULTS = Path(__file__).resolve().parent / "results"


def machine_header() -> str:
    """One line naming the machine: CPU model, usable cores, memory, torch and Python versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu} | {cores} cores | {mem:.0f} GiB | {gpu} | torch {torch.__version__} "
            f"| python {platform.python_version()}")


def summarize(samples: Sequence[float]) -> Tuple[float, float, float]:
    """(median, p20, p80) of the samples."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0], ordered[0], ordered[0]
    q = statistics.quantiles(ordered, n=10, method="inclusive")
    return statistics.median(ordered), q[1], q[7]


def print_table(rows: List[Dict[str, object]], columns: List[str]) -> None:
    """A plain-text table with one row per dict, columns in the given order."""
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def append_csv(name: str, rows: List[Dict[str, object]]) -> Path:
    """Append rows to benchmarks/results/<name>.csv (header written once)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    fields = list(rows[0]) if rows else []
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
