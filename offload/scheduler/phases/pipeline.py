"""`StepPipeline`: the training step of one model, composed of its phases, and the narrow face the Engine sees.

The phases (forward.py, backward.py, step.py, sync.py) are reached by the hooks directly (hooks.py); the
Engine (offload/engine/) calls only the methods here, never into a phase, the worker or the tiers. Made by
setup/assemble.py. See docs/design.md, "Map".
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, Iterator, List, Optional

import torch
from torch import nn

from offload.planner.activations import ActivationUse
from offload.scheduler.blocks.block import Block, FlatGroup
from offload.scheduler.phases.backward import BackwardPhase
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.engine_stats import engine_stats
from offload.scheduler.phases.forward import ForwardPhase
from offload.scheduler.phases.hooks import HookSet
from offload.scheduler.phases.optimizer_view import EngineOptimizer
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.phases.step import StepPhase
from offload.scheduler.phases.sync import Synchronizer
from offload.scheduler.records.block_record import BlockRecord, BlockServices
from offload.scheduler.records.group import GroupRecord
from offload.scheduler.records.module_weights import ModuleWeights
from offload.scheduler.weights.tiers import Tiers
from offload.trace import PhaseObserver


class StepPipeline:
    def __init__(self, blocks: List[Block], records: List[BlockRecord], forward: ForwardPhase, backward: BackwardPhase, step: StepPhase,
                 sync: Synchronizer, weights: ModuleWeights, services: BlockServices, tiers: Tiers,
                 tracker: BackwardTracker, clock: PhaseClock, optimizer: EngineOptimizer) -> None:
        self._blocks = blocks
        self.records = records  # by block index; emptied at close (the state is freed)
        self._group_records = {id(g.group): g for r in records for g in r.groups}
        self._forward = forward
        self._backward = backward
        self._step = step
        self._sync = sync
        self._weights = weights
        self._services = services
        self._tiers = tiers
        self._tracker = tracker
        self._clock = clock
        self.optimizer = optimizer

    def attach_hooks(self, module: nn.Module, owners: Dict[int, List[nn.Module]]) -> HookSet:
        hooks = HookSet()
        hooks.attach(module, self._blocks, owners, self._forward, self._backward, self._weights, self._sync,
                     self.records)
        return hooks

    # ----- what the Engine calls --------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Before a forward: the engine is open and no update failed."""
        self._sync.check_open()
        self._services.worker.raise_if_failed()

    def check_open(self) -> None:
        self._sync.check_open()

    def activation_use(self) -> Optional[ActivationUse]:
        """What the last metered training forward saved for its backward (None before one)."""
        return self._forward.saved_tensors.meter.last

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        return self._step.clip_grad_norm(max_norm, norm_type, error_if_nonfinite)

    def synchronize(self) -> None:
        self._sync.check_open()
        self._sync.synchronize()

    def stats(self) -> Dict[str, float]:
        return engine_stats(self._services.counters, self._services.nonfinite, self._clock, self._tiers,
                            self.records)

    def grad_norm(self) -> float:
        """The last step's global gradient norm before clipping (nan: no norm was taken)."""
        return self._services.counters.grad_norm

    def add_observer(self, observer: PhaseObserver) -> Callable[[], None]:
        return self._services.tracer.add(observer)

    def engine_reads(self) -> ContextManager[None]:
        """The engine reads the module's state dict itself (streamed blocks are not refused)."""
        return self._weights.engine_reads()

    def keep_all_writes(self) -> None:
        """Every block's weights written through its parameters become its master weights (before a save)."""
        self._weights.adopt_all()

    @contextlib.contextmanager
    def replacing_state(self) -> Iterator[None]:
        with self._sync.replacing_state():
            yield

    def prepare_for_load(self) -> None:
        """A checkpoint is about to replace the state: the step in progress and the gradients go."""
        self._tracker.end_step()
        self._step.reset_step()  # first: the load replaces whatever a step in progress did
        self._step.zero_grad()

    def mark_inconsistent(self, exc: BaseException) -> None:
        self._services.worker.fail(exc)

    def counters(self) -> Dict[str, int]:
        counters = self._services.counters
        return {"steps": counters.steps, "skipped_steps": counters.skipped_steps + self._services.nonfinite.steps}

    def restore_counters(self, steps: int, skipped_steps: int) -> None:
        """A checkpoint's step counts (its skips for non-finite gradients are part of `skipped_steps`)."""
        counters = self._services.counters
        counters.steps, counters.skipped_steps = steps, skipped_steps
        self._services.nonfinite.reset()

    # ----- closing (engine/release.py) ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._sync.closed

    @property
    def failure(self) -> Optional[BaseException]:
        """The first update (or load) that failed, until a load succeeds."""
        return self._services.worker.failure

    def on_worker_thread(self) -> bool:
        return self._services.worker.on_own_thread()

    def close(self, restore: bool = True) -> Optional[BaseException]:
        """Finish the updates, push every new weight, bring streamed blocks back (unless `restore` is False);
        returns an update's error that was never reported (raised by the caller after its own cleanup)."""
        failure = self._sync.close(restore)
        return failure

    @property
    def weights_sharded(self) -> bool:
        return any(record.partitioned for record in self.records)

    def group_record(self, group: FlatGroup) -> GroupRecord:
        """The record of a flat group (checkpoints read and replace its weights through its home)."""
        return self._group_records[id(group)]

    def replace_group_weights(self, group: FlatGroup, flat: torch.Tensor) -> None:
        """New compute weights for a whole group (a checkpoint load): the device has them, or fetches them."""
        record = self._group_records[id(group)]
        with torch.no_grad():
            record.replace_weights(flat)
        self.records[record.block.index].needs_push = False

    def mark_closed(self) -> None:
        self._sync.closed = True

    def release_records(self) -> None:
        """Drop the blocks' records, and with them the optimizer state and gradients (after `close`)."""
        self.records.clear()
        self._group_records.clear()

    def close_tiers(self) -> None:
        """Delete the swap file and free the ring's slots and the staging pool."""
        self._tiers.close()
