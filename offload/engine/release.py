"""Releasing an engine: the body of `Engine.close()`, kept apart from the Engine so that it also runs when
an Engine is dropped without close() (`weakref.finalize` in `Engine.__init__`).

Nothing here may refer to the Engine: the finalizer holds an `EngineRelease` until the Engine is collected,
and a reference back would keep the Engine alive for ever. See docs/design.md
[Note: an engine dropped without close()].
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional

from torch import nn

from offload.scheduler.blocks.block import MARKER, Block
from offload.scheduler.phases.hooks import HookSet
from offload.scheduler.phases.pipeline import StepPipeline


@dataclass(frozen=True)
class EngineRelease:
    """What one engine holds that close() gives back: the step pipeline (its worker thread, tiers, swap file
    and host state), the hooks on the model, the blocks' runtime records, and the model's mark."""

    pipeline: StepPipeline
    hooks: HookSet
    blocks: List[Block]
    module: nn.Module
    mark: "weakref.ref[Any]"  # the mark this engine set; the module's mark is removed only while it is this one
    owner_pid: int = field(default_factory=os.getpid)  # the process whose engine this is (not a forked child)

    def close(self, restore: bool = True) -> None:
        """`Engine.close()`: finish pending updates, remove every hook, bring streamed weights back (`restore`), free
        the state and delete the swap file. An update's error never reported, or an I/O error met on the way, is
        raised after the cleanup; a failure reported earlier is a RuntimeWarning. Idempotent."""
        if self.pipeline.closed:
            return
        failure = self._release(restore)
        if failure is not None:
            raise failure
        self._warn_if_inconsistent("closed")

    def dropped(self) -> None:
        """The Engine was collected without close(): release as close() would, but warn instead of raising
        (an exception raised in a finalizer is printed as "Exception ignored" and lost). Not in a forked child
        (a DataLoader worker): the thread does not exist there, and the swap file is the parent's."""
        if self.pipeline.closed or os.getpid() != self.owner_pid:
            return
        if self.pipeline.on_worker_thread():  # collected on the worker itself: it cannot wait for itself
            threading.Thread(target=self.dropped, name="offload-release", daemon=True).start()
            return
        sharded = self.pipeline.weights_sharded  # bringing its weights back takes gathers every rank makes at once,
        try:                                      # which a collector on one rank cannot: they stay out
            failure = self._release(restore=not sharded)
        except BaseException as exc:  # noqa: BLE001 -- e.g. Ctrl-C while draining: nobody could catch it here
            failure = exc
        if sharded:
            warnings.warn("offload: an engine with sharded weights (shard_weights) was dropped without close(): its "
                          "model's streamed parameters were not gathered back (that needs every rank at once) and "
                          "are NaN placeholders now; call engine.close() on every rank, or load a checkpoint into "
                          "the model", RuntimeWarning, stacklevel=2)
        if failure is not None:
            warnings.warn(f"offload: an engine dropped without close() could not be released cleanly "
                          f"({type(failure).__name__}: {failure}); its hooks and swap file are gone, but the "
                          "model's weights may be inconsistent: call engine.close() to see such errors raised",
                          RuntimeWarning, stacklevel=2)
        else:
            self._warn_if_inconsistent("dropped without close()")

    def _release(self, restore: bool = True) -> Optional[BaseException]:
        """Release everything, whatever fails; return the first error (`restore`: see `Synchronizer.close`)."""
        pipeline = self.pipeline
        failure: Optional[BaseException] = None
        try:
            failure = pipeline.close(restore)
        except Exception as exc:  # e.g. weights on a failed disk could not be read back: release all the same
            failure = exc
        finally:  # whatever failed, the hooks, records, files and the model's mark go
            pipeline.mark_closed()
            self.hooks.remove()
            pipeline.release_records()
            try:
                pipeline.close_tiers()
            except Exception as exc:
                failure = failure or exc
            if getattr(self.module, MARKER, None) is self.mark:
                delattr(self.module, MARKER)
        return failure

    def _warn_if_inconsistent(self, how: str) -> None:
        failed = self.pipeline.failure
        if failed is not None:
            warnings.warn(f"offload: {how} after a failed update ({failed}); the model keeps inconsistent "
                          "weights (some blocks updated, some not): load a checkpoint into it", RuntimeWarning, stacklevel=2)
