"""The step's counters, and `engine.stats()` assembled from them and from each tier's own counters."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List

from offload.scheduler.blocks.block import Block
from offload.scheduler.grads.nonfinite import NonFiniteSkips
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.weights.partitioned_home import PartitionedHome
from offload.scheduler.weights.tiers import Tiers


@dataclass
class StepCounters:
    """Counters since wrap(), reported by `engine.stats()` and kept by checkpoints (`steps`, `skipped_steps`)."""

    steps: int = 0
    skipped_steps: int = 0
    block_updates: int = 0
    early_block_updates: int = 0
    update_seconds: float = 0.0
    wait_seconds: float = 0.0
    grad_norm: float = math.nan  # the last step's global gradient norm before clipping (max_grad_norm set)


def engine_stats(counters: StepCounters, nonfinite: NonFiniteSkips, clock: PhaseClock, tiers: Tiers,
                 blocks: List[Block]) -> Dict[str, float]:
    """Every counter `engine.stats()` reports (see its docstring)."""
    out: Dict[str, float] = asdict(counters)
    out["skipped_steps"] += nonfinite.steps  # steps where some block had non-finite gradients
    out["skipped_block_updates"] = nonfinite.block_skips
    out.update(forward_seconds=clock.forward_seconds, backward_seconds=clock.backward_seconds)
    out.update(tiers.stats())
    homes = [s.grads for b in blocks if b.runtime is not None for s in b.runtime.states]
    out.update(bytes_grads_to_disk=sum(h.disk_bytes.written for h in homes),
               bytes_grads_from_disk=sum(h.disk_bytes.read for h in homes))
    parts = [g.home for b in blocks if b.runtime is not None for g in b.runtime.groups
             if isinstance(g.home, PartitionedHome)]
    out.update(weight_gathers=sum(h.gathers for h in parts),  # sharded weights: groups made whole, and the
               bytes_weights_gathered=sum(h.bytes_gathered for h in parts))  # other ranks' bytes that brought
    out.update(host_state_bytes=sum(s.host_bytes for b in blocks if b.runtime is not None
                                    for s in b.runtime.states),  # 0 once closed: the state is freed
               # this rank's fp32 master weights and moments, on any tier (data-parallel: its parts only)
               optimizer_state_bytes=sum(s.optimizer_state_bytes for b in blocks if b.runtime is not None
                                         for s in b.runtime.states))
    return out
