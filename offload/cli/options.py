"""argparse `type=` functions shared by the commands: each checks a numeric option once, at parse time, so
a bad value is an argparse error (exit code 2, "argument --steps: must be an integer >= 1, got '0'" on
stderr), never a traceback or a run on a meaningless number.
"""

from __future__ import annotations

import argparse
import math

from offload.errors import OffloadConfigError
from offload.policy import parse_bytes


def _finite_float(text: str, valid: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {valid}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of steps, layers, micro-batches...)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_finite_float(text: str) -> float:
    """A finite number > 0 (not nan, not inf)."""
    valid = "a finite number > 0"
    value = _finite_float(text, valid)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be {valid}, got {text!r}")
    return value


def non_negative_finite_float(text: str) -> float:
    """A finite number >= 0 (not nan, not inf)."""
    valid = "a finite number >= 0"
    value = _finite_float(text, valid)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be {valid}, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """A byte count > 0 as `offload.policy.parse_bytes` reads it: "24GB" (10^9), "512MiB" (2^20), "4G" (2^30)."""
    try:
        size = parse_bytes(text, "size")
    except (OffloadConfigError, ValueError, OverflowError):
        size = None
    if size is None or size <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a byte size > 0 such as 24GB, 512MiB or 4G (units B; KB..TB: 10^3..10^12; "
            f"KiB..TiB, K..T: 2^10..2^40), got {text!r}")
    return size


__all__ = ["byte_size", "non_negative_finite_float", "positive_finite_float", "positive_int"]
