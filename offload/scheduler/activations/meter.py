"""`SavedTensorMeter`: counts what a training forward saves for its backward, per block call, for the plan
(`engine.plan`'s activation lines, offload/planner/activations.py).

It sits around the root forward's pack hook (the spill's or the weight streamer's), so it sees every saved tensor
and what became of it: a streamed weight's handle and the model's own parameters are weights, not activations; a
`SpilledTensor` went to the swap file; a tensor returned as it is stayed. With no hooks otherwise (activations
kept, no streamed weights) nothing is metered: the model's forward runs without hooks, as it would without
offload.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
import weakref
from typing import Any, Callable, ContextManager, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from offload.planner.activations import ActivationUse
from offload.planner.plan import human_bytes
from offload.scheduler.activations.spill import SpilledTensor, movable
from offload.scheduler.torch_internals import (
    FUNC_TRANSFORMS_REFUSE_HOOKS,
    node_name,
    version_of,
    version_probe,
    view_base,
)

TOKEN_INPUT_NAMES = ("input_ids", "idx", "tokens")


class SavedTensorMeter:
    """One engine's measurement of saved-tensor bytes: `begin` / `end` around a training forward, `enter_block` at
    each block owner's call, `pack` in the saved-tensor hooks; `last` is the newest result.

    A tensor counts for the block entered last: the owners hooked are the modules that hold parameters (a layer's
    linears and norms), so what a layer saves between them (attention, activations, residual adds) is its own,
    and the loss after the last layer counts for the block of the head that made the logits."""

    def __init__(self, inner_pack: Callable[[Tensor], object], is_weight: Callable[[Tensor], bool],
                 room: Optional[int] = None) -> None:
        self._inner_pack = inner_pack
        self._is_weight = is_weight
        self._room = room  # what the device budget leaves the activations (the plan's device_room), None: no budget
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
        beyond = None if self._room is None else self.last.beyond_room(self._room, human_bytes)
        if beyond is not None:
            self._room = None  # said once
            warnings.warn(beyond, RuntimeWarning, stacklevel=2)

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
    did not have could refuse a forward that works without them (torch.func transforms inside it).

    Around the inner pair, torch's own check of saved tensors ([Note: saved tensors written in place]), and the
    error of a torch.func transform under the hooks says why they are on and what to change.
    `activations_offloaded`: activations="offload" (else the hooks are the streamer's); `streamed_blocks`: the
    names of the blocks whose weights stream now; `block_name`: a block's name by index."""

    def __init__(self, pack: Callable[[Tensor], object], unpack: Callable[[Any], Tensor], needed: Callable[[], bool],
                 is_weight: Callable[[Tensor], bool], *, activations_offloaded: bool = False,
                 streamed_blocks: Callable[[], List[str]] = list,
                 block_name: Callable[[int], str] = str, device_room: Optional[int] = None) -> None:
        self._pack, self._unpack, self._needed, self._is_weight = pack, unpack, needed, is_weight
        self._activations_offloaded = activations_offloaded
        self._streamed_blocks, self._block_name = streamed_blocks, block_name
        self.meter = SavedTensorMeter(pack, is_weight, device_room)

    def context(self, training: bool, tokens: Optional[int]) -> ContextManager[object]:
        """For one root forward (`training`: it records a graph)."""
        if not self._needed():
            return contextlib.nullcontext()
        if training:
            self.meter.begin(tokens)
            return _HooksContext(self, self._checked_pack_metered, self.unpack)
        return _HooksContext(self, self._checked_pack, self.unpack)

    # ----- the hooks ---------------------------------------------------------------------------------
    def _checked_pack(self, tensor: Tensor) -> object:
        return self._save(tensor, self._pack)

    def _checked_pack_metered(self, tensor: Tensor) -> object:
        return self._save(tensor, self.meter.pack)

    def _save(self, tensor: Tensor, pack: Callable[[Tensor], object]) -> "SavedTensor":
        version = version_of(tensor)  # what torch's SavedVariable records
        packed = pack(tensor)
        counter: Any
        if isinstance(packed, Tensor):
            counter = packed  # the tensor itself or its detached alias: the same version counter
        elif isinstance(packed, SpilledTensor):
            probe = version_probe(tensor)  # the tensor's memory is to be freed: hold its counter only
            counter = probe if probe is not None else weakref.ref(tensor)
        else:
            counter = weakref.ref(view_base(tensor))  # a streamed weight: its parameter, which lives
        return SavedTensor(packed, version, counter, tuple(tensor.shape), node_name(tensor), tensor.output_nr)

    def unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, SavedTensor):
            return self._unpack(saved)
        counter = saved.counter() if isinstance(saved.counter, weakref.ref) else saved.counter
        if counter is not None and version_of(counter) != saved.version:
            raise RuntimeError(self._modified(saved, counter))
        return self._unpack(saved.packed)

    # ----- messages ----------------------------------------------------------------------------------
    def _modified(self, saved: "SavedTensor", counter: Tensor) -> str:
        """torch's message for a saved tensor written in place (saved_variable.cpp), and which one it is here."""
        which = "" if saved.node is None else f", which is output {saved.output_nr} of {_op_name(saved.node)},"
        shape = ", ".join(str(d) for d in saved.shape)
        used = "the backward would have read the values written in place"
        if isinstance(saved.packed, Tensor) and self._is_weight(counter):
            where = "a weight of the model that stays on the device"
        elif isinstance(saved.packed, Tensor):
            where = ("kept on the device by activations='offload' (saved tensors under 1 MiB stay)"
                     if self._activations_offloaded else
                     "kept on the device under the hooks that are on while weights stream")
        elif isinstance(saved.packed, SpilledTensor):
            where = f"written to the swap file by activations='offload' ({saved.packed.nbytes:,} bytes)"
            used = "the swap file holds the values from before the write, but torch refuses this, so offload does"
        else:
            where = self._weight_name(saved.packed)
        hint = ("the backtrace further above shows the operation that failed to compute its gradient. The variable "
                "in question was changed in there or anywhere later. Good luck!" if torch.is_anomaly_enabled() else
                "enable anomaly detection to find the operation that failed to compute its gradient, with "
                "torch.autograd.set_detect_anomaly(True).")
        return (f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{counter.type()} [{shape}]]{which} is at version {version_of(counter)}; expected version "
                f"{saved.version} instead. Hint: {hint} (offload: the tensor was saved for the backward in the "
                f"engine's saved-tensor hooks, which take the place of torch's own check: {where}; {used}.)")

    def _weight_name(self, packed: Any) -> str:
        """A streamed weight's description: its parameter's name and its block's."""
        group, block = getattr(packed, "group", None), int(getattr(packed, "block_index", -1))
        names = [slot.name for slot in getattr(group, "slots", [])
                 if slot.offset <= getattr(packed, "storage_offset", -1) < slot.offset + max(slot.numel, 1)]
        param = f" {names[0]!r}" if names else ""
        return (f"the weight{param} of block {self._block_name(block)!r}, which streams under device_memory "
                f"(fetched again for the backward)")

    def transforms_refused(self, around: bool) -> str:
        """Why the hooks are on, for the error of a torch.func transform that refused to run under them (`around`:
        the transform encloses the model's forward, else the forward calls it)."""
        reasons, fixes = [], []
        if self._activations_offloaded:
            reasons.append("activations='offload' sends the tensors saved for the backward to the swap file")
            fixes.append("wrap() with activations=None (saved tensors stay on the device)")
        streamed = self._streamed_blocks()
        if streamed:
            listed = ", ".join(repr(n) for n in streamed[:4]) + (f" and {len(streamed) - 4} more" if len(streamed) > 4
                                                                  else "")
            reasons.append(f"the weights of {len(streamed)} block(s) ({listed}) stream under device_memory, so "
                           f"autograd keeps handles to them, fetched again for the backward")
            fixes.append("give device_memory room for the whole model (engine.plan shows what it needs), so no "
                         "block streams")
        where = ("the wrapped model's forward runs inside a torch.func transform, and the transform refuses the "
                 "saved-tensor hooks the engine sets for it" if around else
                 "a torch.func transform inside the wrapped model's forward refuses the saved-tensor hooks the engine "
                 "sets for that forward")
        outside = "" if around else "; or call the transform outside the wrapped model's forward"
        return (f"offload: {where}. They are on because {' and '.join(reasons)}. To run torch.func transforms "
                f"(grad, vjp, jacrev, hessian, ...) there, {', and '.join(fixes)}{outside}.")


class SavedTensor:
    """What the root hooks hand autograd for one saved tensor: the inner hooks' result, and what torch's check
    at unpack needs: the version at pack and something sharing the tensor's version counter (`counter`: the kept
    tensor, an empty probe, or a weak reference to a streamed weight's parameter)."""

    __slots__ = ("packed", "version", "counter", "shape", "node", "output_nr")

    def __init__(self, packed: object, version: int, counter: Any, shape: Tuple[int, ...], node: Optional[str],
                 output_nr: int) -> None:
        self.packed = packed
        self.version = version
        self.counter = counter
        self.shape = shape
        self.node = node
        self.output_nr = output_nr


class _HooksContext:
    """torch's saved_tensors_hooks for one root forward; a torch.func transform's refusal of them (at the start of
    the forward, or from inside it) names offload's setting and the fix ([Note: saved tensors written in place])."""

    def __init__(self, owner: RootSavedTensors, pack: Callable[[Tensor], object],
                 unpack: Callable[[Any], Tensor]) -> None:
        self._owner = owner
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def __enter__(self) -> None:
        try:
            self._hooks.__enter__()
        except RuntimeError as error:  # the forward itself runs inside a transform
            if FUNC_TRANSFORMS_REFUSE_HOOKS not in str(error):
                raise
            raise RuntimeError(f"{error} ({self._owner.transforms_refused(around=True)})") from error

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        # The forward raised (torch calls the root's always_call forward hook, which leaves this, while it handles
        # the exception, then re-raises that same object): a transform inside it refused the hooks. The message
        # is amended in place, the one way to reach an exception torch re-raises itself.
        error = sys.exc_info()[1]
        if (isinstance(error, RuntimeError) and len(error.args) == 1 and isinstance(error.args[0], str)
                and FUNC_TRANSFORMS_REFUSE_HOOKS in error.args[0] and "offload:" not in error.args[0]):
            error.args = (f"{error.args[0]} ({self._owner.transforms_refused(around=False)})",)


def _op_name(node: str) -> str:
    """torch's name for the node in this message (2.13 writes `Exp` for `ExpBackward0`)."""
    return re.sub(r"Backward\d*$", "", node) or node


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
