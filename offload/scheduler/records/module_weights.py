"""The module's own `state_dict()` / `load_state_dict()`, kept in step with the engine's copies.

`model.state_dict()` and `load_state_dict()` (of the root or any module that owns parameters) wait for
the blocks' pending updates. A streamed block's entries are read through its parameters (each read brings the
block in) and become host copies module by module, so the device never holds more than it streams; the
state dict as a whole must fit in host memory, else it is refused before anything is read. A load into
streamed blocks is refused. After a load the written weights become the master
weights (each block's record keeps writes made through its parameters: records/block_record.py); a
parameter frozen at wrap() and unfrozen later is refused at step(). See docs/design.md [Note: the module's
own state_dict] and [Note: weights written after wrap()].
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
from torch import Tensor, nn

from offload._system import mem_available
from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block
from offload.scheduler.records.block_record import BlockRecord

HOST_MEMORY_MARGIN = 1 << 30  # what a state dict of streamed blocks leaves free of the host's available memory


class BlockSettler(Protocol):
    """What the synchronizer (phases/sync.py) offers here: whether the engine is closed, and its waits."""

    closed: bool

    def check_open(self) -> None: ...

    def synchronize(self) -> None: ...

    def settle_blocks(self, blocks: List[Block]) -> None: ...


class ModuleWeights:
    """The module-facing side of the engine's weights (the hooks call it through the pipeline)."""

    def __init__(self, records: List[BlockRecord], settler: BlockSettler) -> None:
        self.records = records  # by block index
        self.blocks = [record.block for record in records]
        self._streamed = {record.block.index for record in records if record.streamed}
        self._settler = settler
        self._engine_reads = 0  # >0 while the engine itself reads module.state_dict() (engine_reads)
        self._block_of = {id(slot.param): block for block in self.blocks for slot in block.slots}

    # ----- model.state_dict() and model.load_state_dict() --------------------------------------------
    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        """Every pending update of these blocks (None: all) lands first (with overlap_step, step() returns
        before the updates run); streamed blocks' entries will be host copies: refused, before anything is
        read, when they would not fit in the host's available memory."""
        if self._settler.closed or self._engine_reads:
            return
        if blocks is None:
            self._settler.synchronize()
            blocks = self.blocks
        else:
            self._settler.settle_blocks(blocks)
        streamed = [b for b in blocks if b.index in self._streamed]
        needed = sum(b.weight_bytes for b in blocks)  # every entry becomes a copy of its own (after_state_dict)
        available = mem_available()
        if streamed and available is not None and needed > available - HOST_MEMORY_MARGIN:
            raise OffloadError(
                f"model.state_dict() would copy {needed / 2**30:.2f} GiB of weights into host memory, "
                f"{available / 2**30:.2f} GiB are available, and the blocks streamed from host or disk (first: "
                f"{streamed[0].name!r}) have no other place to be read into: save with engine.save(path) or "
                "engine.save_pretrained(dir), which stream the weights to the file group by group")

    def after_owner_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str) -> None:
        """A module's own entries of streamed blocks, read through their parameters (each read brings its block
        in, pinned while a view of it lives), become host copies now: the block can go again before the next
        module's are read."""
        if self._settler.closed or self._engine_reads:
            return
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            key, block = prefix + name, self._block_of.get(id(param))
            value = state_dict.get(key)
            if block is None or block.index not in self._streamed or isinstance(value, nn.Parameter) \
                    or not isinstance(value, Tensor):
                continue
            state_dict[key] = value.to("cpu", copy=True)

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
        streamed = [b.name for b in blocks if b.index in self._streamed]
        if streamed:
            raise OffloadError(f"{what} the blocks streamed from host or disk (first: {streamed[0]!r}): {fix}")

    # ----- weights written in place ------------------------------------------------------------------
    def after_state_dict(self, state_dict: Dict[str, Any], prefix: str = "") -> None:
        """Each entry that views part of a flat group's buffer becomes a copy with a storage of its own
        (entries of one tied parameter share one copy), as a model of separate parameters has them: accelerate's
        save_state, safetensors' save_model and save_pretrained keep one tensor per shared storage and would
        drop the rest of a group from the file. `keep_vars=True` (the parameters themselves) and the engine's
        own reads keep the views. [Note: the module's own state_dict]"""
        if self._settler.closed or self._engine_reads:
            return
        copies: Dict[Tuple[int, torch.device, torch.Size, Tuple[int, ...], torch.dtype], Tensor] = {}
        for key, value in state_dict.items():
            if not key.startswith(prefix) or isinstance(value, nn.Parameter) or not isinstance(value, Tensor) or not _views_part_of_storage(value):
                continue
            where = (value.data_ptr(), value.device, value.shape, value.stride(), value.dtype)
            if where not in copies:
                copies[where] = value.clone()
            state_dict[key] = copies[where]

    def after_load_state_dict(self) -> None:
        """The loaded weights become the master weights (the Adam moments stay, as torch.optim.AdamW's do)."""
        self.adopt_all()

    def adopt_all(self) -> None:
        """After a load_state_dict, before a save: every block's written weights become its master weights."""
        for record in self.records:
            record.keep_writes()

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


def _views_part_of_storage(tensor: Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
