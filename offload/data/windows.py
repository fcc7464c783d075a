"""Where each window starts: a pure function of (seed, rank, batch number), so every backend reads the same
windows, a resumed stream continues exactly, and no state but a counter needs saving.

A window start is drawn uniformly over every valid start of every shard (a long shard is drawn from in
proportion to its length); windows never cross a shard's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from offload.data.token_files import TokenFiles


@dataclass(frozen=True)
class WindowSampler:
    files: TokenFiles
    window: int  # seq_len + 1 tokens: inputs and their next-token targets
    batch_size: int
    seed: int
    rank: int = 0  # data-parallel ranks draw different windows from one seed

    def batch(self, number: int) -> Tuple[np.ndarray, np.ndarray]:
        """(shard index, start token) of each of the batch's windows, int64 arrays of batch_size."""
        starts_per_shard = np.array([s.tokens - self.window + 1 for s in self.files.shards], dtype=np.int64)
        bounds = np.cumsum(starts_per_shard)
        rng = np.random.default_rng([self.seed, self.rank, number])
        flat = rng.integers(0, int(bounds[-1]), size=self.batch_size, dtype=np.int64)
        shard = np.searchsorted(bounds, flat, side="right")
        return shard, flat - (bounds[shard] - starts_per_shard[shard])
