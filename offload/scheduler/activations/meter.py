"""`SavedTensorMeter`: counts what a training forward saves for its backward, per block call, for the plan
(`engine.plan`'s activation lines, offload/scheduler/activations/use.py).

It sits around the root forward's pack hook (the spill's or the weight streamer's), so it sees every saved tensor
and what became of it: a streamed weight's handle and the model's own parameters are weights, not activations; a
`SpilledTensor` went to the swap file; a tensor returned as it is stayed. With no hooks otherwise (activations
kept, no streamed weights) nothing is metered: the model's forward runs without hooks, as it would without
offload.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Optional, Set, Tuple

import torch
from torch import Tensor

from offload.scheduler.activations.spill import SpilledTensor, movable
from offload.scheduler.activations.use import ActivationUse

TOKEN_INPUT_NAMES = ("input_ids", "idx", "tokens")


class SavedTensorMeter:
    """One engine's measurement of saved-tensor bytes: `begin` / `end` around a training forward, `enter_block` at
    each block owner's call, `pack` in the saved-tensor hooks; `last` is the newest result.

    A tensor counts for the block entered last: the owners hooked are the modules that hold parameters (a layer's
    linears and norms), so what a layer saves between them (attention, activations, residual adds) is its own,
    and the loss after the last layer counts for the block of the head that made the logits."""

    def __init__(self, inner_pack: Callable[[Tensor], object], is_weight: Callable[[Tensor], bool]) -> None:
        self._inner_pack = inner_pack
        self._is_weight = is_weight
        self.last: Optional[ActivationUse] = None
        self._active = False
        self._tokens: Optional[int] = None
        self._saved = self._movable = self._moved = 0
        self._kept: Set[Tuple[int, int]] = set()  # kept tensors already counted (they live until the backward)
        self._per_block: Dict[int, int] = {}  # bytes saved while each block was the one entered last (-1: none yet)
        self._current = -1

    def begin(self, tokens: Optional[int]) -> None:
        self._active, self._tokens = True, tokens
        self._saved = self._movable = self._moved = 0
        self._kept.clear()
        self._per_block = {}
        self._current = -1

    def end(self) -> None:
        if not self._active:
            return
        self._active = False
        self._kept.clear()
        largest = max(self._per_block.values(), default=0)
        self.last = ActivationUse(self._saved, self._movable, self._moved, largest, self._tokens)

    def enter_block(self, index: int) -> None:
        self._current = index

    def saw_recompute(self) -> None:
        """A block's forward ran again in a backward: activation checkpointing (the plan says so)."""
        if self.last is not None and not self.last.recomputed:
            self.last = ActivationUse(self.last.saved_bytes, self.last.movable_bytes, self.last.moved_bytes,
                                      self.last.largest_block_bytes, self.last.tokens, recomputed=True)

    def pack(self, tensor: Tensor) -> object:
        """The pack hook while metering: the inner hook's result, counted."""
        packed = self._inner_pack(tensor)
        if self._active:
            self._count(tensor, packed)
        return packed

    def _count(self, tensor: Tensor, packed: object) -> None:
        if isinstance(packed, Tensor):
            if tensor.layout is not torch.strided or tensor.is_meta or self._is_weight(tensor):
                return
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            if key in self._kept:  # one tensor saved by several nodes is held once
                return
            self._kept.add(key)
        elif not isinstance(packed, SpilledTensor):
            return  # a streamed weight's handle
        nbytes = tensor.numel() * tensor.element_size()
        self._saved += nbytes
        self._per_block[self._current] = self._per_block.get(self._current, 0) + nbytes
        if isinstance(packed, SpilledTensor):
            self._moved += nbytes
            self._movable += nbytes
        elif movable(tensor):
            self._movable += nbytes


class RootSavedTensors:
    """The root forward's saved-tensor hooks: the inner pair (the activation spill's, whose pack asks the weight
    streamer first, or the streamer's alone), in place while `needed()` (activations offloaded, weights streaming),
    with the meter around pack in training forwards. With no hooks needed nothing is metered: hooks the model
    did not have could refuse a forward that works without them (torch.func transforms inside it)."""

    def __init__(self, pack: Callable[[Tensor], object], unpack: Callable[[Any], Tensor], needed: Callable[[], bool],
                 is_weight: Callable[[Tensor], bool]) -> None:
        self._pack, self._unpack, self._needed = pack, unpack, needed
        self.meter = SavedTensorMeter(pack, is_weight)

    def context(self, training: bool, tokens: Optional[int]) -> ContextManager[object]:
        """For one root forward (`training`: it records a graph)."""
        if not self._needed():
            return contextlib.nullcontext()
        if training:
            self.meter.begin(tokens)
            return torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self._unpack)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def token_count(args: Tuple[Any, ...], kwargs: dict) -> Optional[int]:
    """The elements of a forward's token input: `input_ids` (or `idx` / `tokens`) when given by name, else the first
    positional integer tensor; None when there is none."""
    for name in TOKEN_INPUT_NAMES:
        value = kwargs.get(name)
        if isinstance(value, Tensor):
            return value.numel()
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and not value.is_floating_point() and not value.is_complex() \
                and value.dtype is not torch.bool:
            return value.numel()
    return None
