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


def warmed_baseline(model, batch) -> int:
    """VmRSS once the process-wide one-time costs any PyTorch training pays are paid (the model's kernels, loaded by
    a forward; torch._dynamo, ~70 MB of modules the first torch.optim.Optimizer imports; autograd, started by a first
    backward), the peak reset from there: what a memory bound is measured from."""
    import torch

    with torch.no_grad():
        model(*batch)
    warm = torch.nn.Linear(4, 4)
    torch.optim.SGD(warm.parameters(), lr=0.1)
    warm(torch.zeros(1, 4)).sum().backward()
    baseline = status("VmRSS")
    reset_peak()
    return baseline
