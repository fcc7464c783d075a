"""`engine.stats()`, assembled from the step's counters (worker/counters.py), the records and each tier's own."""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List

from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.weights.partitioned_home import PartitionedHome
from offload.scheduler.weights.tiers import Tiers
from offload.scheduler.worker.counters import StepCounters


def engine_stats(counters: StepCounters, nonfinite: NonFiniteSkips, clock: PhaseClock, tiers: Tiers,
                 records: List[BlockRecord]) -> Dict[str, float]:
    """Every counter `engine.stats()` reports (see its docstring); `records`: empty once closed (the state is
    freed)."""
    out: Dict[str, float] = asdict(counters)
    out["skipped_steps"] += nonfinite.steps  # steps where some block had non-finite gradients
    out["skipped_block_updates"] = nonfinite.block_skips
    out.update(forward_seconds=clock.forward_seconds, backward_seconds=clock.backward_seconds)
    out.update(tiers.stats())
    homes = [s.grads for r in records for s in r.states]
    out.update(bytes_grads_to_disk=sum(h.disk_bytes.written for h in homes),
               bytes_grads_from_disk=sum(h.disk_bytes.read for h in homes),
               grads_rested_in_moments=sum(h.disk_bytes.rested for h in homes),
               grads_rebuilt_from_moments=sum(h.disk_bytes.rebuilt for h in homes),
               grad_elements_missed_by_rebuilds=sum(h.disk_bytes.missed for h in homes))
    parts = [g.home for r in records for g in r.groups if isinstance(g.home, PartitionedHome)]
    out.update(weight_gathers=sum(h.gathers for h in parts),  # sharded weights: groups made whole, and the
               bytes_weights_gathered=sum(h.bytes_gathered for h in parts),  # other ranks' bytes that brought
               # of those, the gathers' for a forward or backward (zero_quantized_weights sends these as codes)
               bytes_weights_gathered_for_compute=sum(h.bytes_gathered_for_compute for h in parts))
    out.update(host_state_bytes=sum(s.host_bytes for r in records for s in r.states),
               # this rank's fp32 master weights and moments, on any tier (data-parallel: its parts only)
               optimizer_state_bytes=sum(s.optimizer_state_bytes for r in records for s in r.states))
    return out
