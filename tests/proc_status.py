"""Peak-RSS measurement for the memory-bound tests' child processes (Linux /proc): read a field of
/proc/self/status in bytes, and reset the peak (VmHWM) to the current RSS."""

from __future__ import annotations

from pathlib import Path

CAN_RESET_PEAK = Path("/proc/self/clear_refs").exists()
SKIP_REASON = "needs Linux /proc/self/clear_refs to reset the peak RSS"


def status(field: str) -> int:
    """A /proc/self/status field given in kB (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """VmHWM becomes the current RSS, so a later VmHWM is the peak since now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
