"""Waiting, in one place: for the updates, for the swap writes, for the device copies; and closing.

The words for it (docs/design.md, "Glossary of waits"): a block *settles* when its pending update is done
and its new weights are in its parameters (`settle_blocks`, `settle_weights` for all); the engine
*synchronizes* when, besides, every swap write is on disk (`synchronize`); the ring *drains* when every
slot is back, reads ahead dropped (`replacing_state`, `close`). It also serves the reads of streamed
parameters from outside their forward (weights/read_through.py's `BlockAccess`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

from torch import Tensor

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block
from offload.scheduler.modes.disk_traffic import DiskTraffic
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.held_grad import is_held
from offload.scheduler.records.pending_guard import PendingGuard
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.worker.step_worker import StepWorker
from offload.tiers.copies import CopyContext


class Synchronizer:
    def __init__(self, records: List[BlockRecord], slots: SlotTable, worker: StepWorker, disk: DiskTraffic,
                 copies: CopyContext, streamer: WeightStreamer, guard: PendingGuard) -> None:
        self._records = records  # by block index
        self._slots = slots
        self._worker = worker
        self._disk = disk
        self._copies = copies
        self._streamer = streamer
        self._guard = guard
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise OffloadError("this engine is closed; wrap the model again to keep training")

    def synchronize(self) -> None:
        """Every pending update done, every write on disk, every updated weight on the device."""
        self._worker.wait_all()
        try:
            self._disk.flush_writes()  # reads ahead (of groups that got no update) are kept
        except Exception as exc:  # a swap write failed: the file no longer holds the state. (Ctrl-C only
            # interrupts the wait: the writes go on, and the next flush waits for them.)
            self._worker.fail(exc)
            raise
        self.settle_weights()

    def settle_blocks(self, blocks: List[Block]) -> None:
        """These blocks' pending updates done and their weights in the parameters."""
        for block in blocks:
            self._records[block.index].settle()
        self._copies.synchronize()

    def settle_weights(self) -> None:
        """Every pending update done and its weights in the parameters (swap writes may still be in flight); a
        speculation that wrote them in place is dropped (what the caller reads is what torch shows before step())."""
        self._worker.wait_all()
        for record in self._records:
            record.show_live_weights()
            if record.needs_push:
                record.push()
        self._copies.synchronize()
        self._guard.release_all()

    def guard_pending(self) -> None:
        """step() returns before the updates: resident blocks still updating read through until they settle."""
        for record in self._records:
            record.guard_while_pending()

    @contextlib.contextmanager
    def replacing_state(self) -> Iterator[None]:
        """Around a checkpoint load: an update that failed unseen counts as a failure; a failed state is
        let through (the load replaces all of it) and stays failed if the load changes nothing."""
        self._worker.collect_failure()
        prior = self._worker.failure
        if prior is not None:
            self._worker.clear_failure()
            try:
                self._disk.drain()  # every slot comes back
            except (OSError, OffloadError):
                pass  # errors of writes the failed state made; the load rewrites every record
        try:
            yield
        except BaseException:
            if prior is not None:
                self._worker.fail(prior)  # nothing was loaded: the state is still the inconsistent one
            raise

    def close(self, restore: bool = True) -> Optional[BaseException]:
        """Finish the updates, push every new weight, bring streamed blocks back; returns an update's error
        that was never reported (raised by the caller after its own cleanup). `restore=False`: neither pushes
        nor brings back (sharded weights dropped without close(): those are gathers every rank must make)."""
        failure: Optional[BaseException] = None
        try:
            self._worker.close()
            self._disk.drain()
        except Exception as exc:  # still clean up; report it at the end
            failure = exc
        self.closed = True
        for record in self._records if restore else ():
            if record.needs_push:
                record.push()
        self._guard.release_all()
        if restore:
            self._streamer.restore_all()
        self._copies.synchronize()  # the module is plain PyTorch from here on
        for param in self._slots:
            if is_held(param.grad):
                param.grad = None  # the gradients the engine held go with its buffers
        self._slots.clear()
        return failure

    # ----- streamed parameters read outside their forward (weights/read_through.BlockAccess) -------------
    def block_of(self, param: Tensor) -> Optional[Block]:
        return self._streamer.block_of(param) or self._guard.block_of(param)

    def open_for_read(self, block: Block) -> None:
        """The block's pending update landed and its weights resident and pinned, for one operation."""
        self.check_open()
        self._records[block.index].settle()
        self._streamer.ensure(block, pin=True)

    def pin_views(self, tensors: List[Tensor]) -> None:
        self._streamer.pin_views(tensors)

    def close_after_read(self, block: Block) -> None:
        """A write through the parameters is kept now (before anything can release the block)."""
        record = self._records[block.index]
        try:
            record.keep_writes()
        finally:
            record.unpin()
