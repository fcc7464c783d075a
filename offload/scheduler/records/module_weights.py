"""The user's own reads and writes of the module's weights, kept in step with the engine's copies.

`model.state_dict()` and `load_state_dict()` (of the root or any module that owns parameters) wait for
the blocks' pending updates and refuse streamed placeholders; weights written in place through the
parameters after `wrap()` (nn.init, any module's load_state_dict, a torch.no_grad() write) become the
master weights before the block is used or updated; a parameter frozen at wrap() and unfrozen later is
refused at step(). See docs/design.md [Note: the module's own
state_dict] and [Note: weights written after wrap()].
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Protocol

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block, Residency
from offload.scheduler.records.runtime import BlockRuntime, GroupRuntime


class BlockSettler(Protocol):
    """What the step pipeline offers here: its state and its waits."""

    closed: bool

    def check_open(self) -> None: ...

    def synchronize(self) -> None: ...

    def settle_blocks(self, blocks: List[Block]) -> None: ...

    def is_pending(self, block: Block) -> bool: ...


class ModuleWeights:
    """The module-facing side of the engine's weights (the hooks call it through the pipeline)."""

    def __init__(self, blocks: List[Block], settler: BlockSettler) -> None:
        self.blocks = blocks
        self._settler = settler
        self._engine_reads = 0  # >0 while the engine itself reads module.state_dict() (engine_reads)

    # ----- model.state_dict() and model.load_state_dict() --------------------------------------------
    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        """Every pending update of these blocks (None: all) lands first (with overlap_step, step() returns
        before the updates run); streamed blocks hold placeholders, so reading them through the module is
        refused (engine.state_dict() reads their homes)."""
        if self._settler.closed or self._engine_reads:
            return
        self._settle(blocks, "model.state_dict() would return placeholders for",
                     "use engine.state_dict() (full CPU copies) or engine.save(path)")

    @contextlib.contextmanager
    def engine_reads(self) -> Iterator[None]:
        """The engine reads the module's state dict itself (and swaps in streamed weights): no refusal."""
        self._engine_reads += 1
        try:
            yield
        finally:
            self._engine_reads -= 1

    def before_load_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        """Every pending update of these blocks (None: all) lands first (it would overwrite the loaded
        weights); streamed blocks hold only placeholders, which the load cannot write into: refused before
        anything changes."""
        self._settler.check_open()
        self._settle(blocks, "model.load_state_dict() cannot write the weights of",
                     "load the weights before offload.wrap(), or resume with engine.load(checkpoint)")

    def _settle(self, blocks: Optional[List[Block]], what: str, fix: str) -> None:
        """Wait for the blocks' updates (None: every block, and the swap writes); refuse (by the first block's
        name) when some of them stream, whose parameters are placeholders the module's own state-dict methods
        would read or write."""
        if blocks is None:
            self._settler.synchronize()
            blocks = self.blocks
        else:
            self._settler.settle_blocks(blocks)
        streamed = [b.name for b in blocks if _runtime(b).streamed]
        if streamed:
            raise OffloadError(f"{what} the blocks streamed from host or disk (first: {streamed[0]!r}): {fix}")

    # ----- weights written in place ------------------------------------------------------------------
    def adopt_all(self) -> None:
        """After a load_state_dict, before a save: every block's written weights become its master weights."""
        for block in self.blocks:
            self.adopt(_runtime(block))

    def adopt(self, runtime: BlockRuntime) -> None:
        """Weights written in place through the parameters since the engine last looked become the master
        weights, moments kept, as torch.optim would train on from them; the host mirror (or the swap file)
        follows. Run before each use of the block and before its update reads the master. A released
        streamed block's parameters read through (read_through.py): a write to one opened the block and
        was kept when it closed."""
        if runtime.lost_write is not None:
            name, runtime.lost_write = runtime.lost_write, None
            raise _written_while_pending(name, "the update overwrote the write")
        if runtime.block.residency is Residency.RELEASED:
            return
        for group in runtime.groups:
            edited = group.edited_names()
            if not edited:
                continue
            if self._settler.is_pending(runtime.block) or runtime.needs_push:
                raise _written_while_pending(edited[0], "the update would overwrite it")
            group.keep_writes()

    def refuse_unfrozen(self) -> None:
        """A parameter frozen at wrap() has no optimizer state: unfrozen later, torch would train it, and here
        it would never change while autograd piled gradients into its `.grad`."""
        for block in self.blocks:
            for slot in block.slots:
                if not slot.trainable and slot.param.requires_grad:
                    raise OffloadError(
                        f"parameter {slot.name!r} was frozen at offload.wrap() and requires grad now: the engine "
                        "placed no optimizer state for it; set requires_grad before wrapping (engine.close(), then "
                        "wrap again), or freeze it again")

    @staticmethod
    def note_writes_during_update(group: GroupRuntime, block: BlockRuntime) -> None:
        """On the worker, after a group's update: a parameter written meanwhile (overlap_step: after step()
        returned) was overwritten by the update; the block's next use says so."""
        edited = group.edited_slots()
        if edited:
            block.lost_write = group.group.trainable_slots[edited[0]].name
            group.mark_seen()


def _written_while_pending(name: str, consequence: str) -> OffloadError:
    return OffloadError(
        f"parameter {name!r} was written while its block's update was still pending (overlap_step=True: step() "
        f"returns before the updates run), and {consequence}; call engine.synchronize() after step() before "
        "writing weights, or leave overlap_step off")


def _runtime(block: Block) -> BlockRuntime:
    assert block.runtime is not None, "the block has no runtime record (not materialized, or closed)"
    return block.runtime
