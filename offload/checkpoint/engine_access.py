"""The engine's checkpoint methods: `save`/`load` (delegating to this package) and the narrow accessors
the package uses, so the checkpoint code never reaches into the engine's fields itself.

A mixin of `offload.engine.Engine`; it relies on the engine's blocks, states, streamer and counters.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from offload.errors import OffloadError
from offload.scheduler.block import Block, FlatGroup, Residency
from offload.scheduler.step import GroupState


class CheckpointAccess:
    def save(self, path: str, *, scheduler: Any = None, rng: bool = False, progress: Optional[bool] = None) -> str:
        """Save weights (`model.safetensors`, readable without offload), optimizer state, step counters and,
        when given, the LR scheduler's and the RNG states into directory `path`, atomically: a kill at any
        moment leaves the previous checkpoint or the new one. Streams one flat group at a time."""
        from offload.checkpoint import save_checkpoint

        self._check_open()
        return save_checkpoint(self, path, scheduler=scheduler, rng=rng, progress=progress)

    def load(self, path: str, *, scheduler: Any = None, rng: bool = False, progress: Optional[bool] = None) -> dict:
        """Load a checkpoint saved by any tier (keyed by parameter names); training then continues exactly as
        it would have. Damaged or missing files raise OffloadIntegrityError naming the file and block, and
        leave the engine as it was: every tensor is verified in a first pass before anything changes."""
        from offload.checkpoint import load_checkpoint

        self._check_open()
        self._worker.collect_failure()  # an update that failed unseen also makes the state inconsistent
        prior = self._worker.failure
        if prior is not None:  # a load replaces all of the inconsistent state: let it run
            self._worker.clear_failure()
            if self._ring is not None:
                try:
                    self._ring.drain()  # every slot comes back
                except (OSError, OffloadError):
                    pass  # errors of writes the failed state made; the load rewrites every record
        try:
            return load_checkpoint(self, path, scheduler=scheduler, rng=rng, progress=progress)
        except BaseException:
            if prior is not None:
                self._worker.fail(prior)  # nothing was loaded: the state is still the inconsistent one
            raise

    # ----- accessors for offload/checkpoint -----
    def checkpoint_groups(self) -> Iterator[Tuple[Block, FlatGroup, Optional[GroupState]]]:
        """Every block's flat groups with their optimizer state (None: no trainable parameter), all updates
        applied first."""
        self.synchronize()
        for block in self.blocks:
            states = {id(s.group): s for s in self._states[block.index]}
            for group in block.groups:
                yield block, group, states.get(id(group))

    def group_weights(self, group: FlatGroup) -> torch.Tensor:
        """The group's current compute weights on the host (the streamed host copy, or the device buffer)."""
        block = next(b for b in self.blocks if any(g is group for g in b.groups))
        if self._streamer.is_streamed(block):
            return self._streamer.weights_of(group)
        assert group.device_buffer is not None
        return group.device_buffer.detach().to("cpu")

    def set_group_weights(self, group: FlatGroup, flat: torch.Tensor) -> None:
        """Replace the group's compute weights (all its parameters, in its flat layout)."""
        block = next(b for b in self.blocks if any(g is group for g in b.groups))
        with torch.no_grad():
            if self._streamer.is_streamed(block):
                self._streamer.replace_weights(block, group, flat)
            if not self._streamer.is_streamed(block) or block.residency is Residency.RESIDENT:
                assert group.device_buffer is not None
                group.device_buffer.copy_(flat)
            for state in self._states[block.index]:  # the host copy uploads read (CUDA, host-side state)
                source = self._upload_sources.get(id(state)) if state.group is group else None
                if source is not None:
                    self._copies.release_source(id(group))
                    source.copy_(flat[:group.trainable_numel])
        self._needs_upload.discard(block.index)

    def prepare_for_load(self) -> None:
        """The checkpoint was verified and is about to replace the state: drop accumulated gradients and the
        step in progress (backward count, blocks updated early, gradient norms), as after `step()`."""
        self.zero_grad()
        self._tracker.end_step()
        self._updated_early.clear()
        self._block_norms.clear()
        self._early_hyper = None

    def mark_inconsistent(self, exc: BaseException) -> None:
        """A load failed after it began changing the state: refuse to train or save until a load succeeds."""
        self._worker.fail(exc)

    def checkpoint_counters(self) -> Dict[str, int]:
        stats = self.stats()
        return {"steps": int(stats["steps"]), "skipped_steps": int(stats["skipped_steps"])}

    def restore_counters(self, counters: Dict[str, int]) -> None:
        self._stats["steps"] = counters["steps"]
        self._stats["skipped_steps"] = counters["skipped_steps"]
        self._nonfinite = type(self._nonfinite)()  # its skips are part of the restored count
