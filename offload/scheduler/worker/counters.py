"""`StepCounters`: the step's counters since wrap(), which the records, the phases and the worker add to."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class StepCounters:
    """Counters since wrap(), reported by `engine.stats()` and kept by checkpoints (`steps`, `skipped_steps`)."""

    steps: int = 0
    skipped_steps: int = 0
    block_updates: int = 0
    early_block_updates: int = 0
    speculative_updates: int = 0  # block updates run during the backward on the speculation that the step won't clip
    committed_speculations: int = 0  # of those, the ones the step kept
    forgotten_speculations: int = 0  # and the ones dropped (clipped, skipped, changed since), run again at step()
    update_seconds: float = 0.0
    wait_seconds: float = 0.0
    grad_norm: float = math.nan  # the last step's global gradient norm before clipping (max_grad_norm set)
