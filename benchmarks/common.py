"""Helpers every benchmark shares: the machine header, timing summaries, a plain-text table, CSV rows."""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_header() -> str:
    """One line per fact that changes a result: CPU, cores we may use, memory, library versions."""
    import torch

    from offload import _native
    from offload._system import mem_available, usable_cores

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    avail = mem_available()
    native = _native._C
    isa = native.adam_isa() if native is not None and hasattr(native, "adam_isa") else "n/a (no native core)"
    return "\n".join([
        f"# {cpu}; usable cores {usable_cores()} (os.cpu_count {os.cpu_count()})",
        f"# memory available {avail / 2**30:.1f} GiB" if avail else "# memory available: unknown",
        f"# torch {torch.__version__}; python {platform.python_version()}; offload kernel ISA {isa}",
        f"# {_dt.datetime.now().isoformat(timespec='seconds')}",
    ])


def summarize(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of the samples, by linear interpolation between order statistics."""
    if not samples:
        raise ValueError("summarize() needs at least one sample")
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return quantile(0.5), quantile(0.2), quantile(0.8)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print rows as an aligned text table; numbers are shown as given (format them before)."""
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def append_csv(name: str, rows: Iterable[dict]) -> Path:
    """Append rows to benchmarks/results/<name>.csv, writing the header when the file is new."""
    rows = list(rows)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.csv"
    if not rows:
        return path
    fields = list(rows[0].keys())
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return path
