"""`load_weights(engine, reads)`: new weights for a running engine from safetensors files, read by name.

For the files other trainers leave (a Trainer checkpoint's `model.safetensors` or shards, a PEFT adapter),
which hold weights and no optimizer state: what `model.load_state_dict(state, strict=False)` does to a model
trained by `torch.optim.AdamW`, on every tier and with streamed blocks (whose parameters are placeholders
that `load_state_dict` cannot write). A named parameter's compute weights become the file's values in its
group's dtype and, when it is trained, its fp32 master weights the file's values exactly; its Adam moments and
step stay, as torch's optimizer state stays (load them after, with `engine.optimizer.load_state_dict`, to
resume). Parameters and buffers the files do not name keep their values. Everything is checked (each name's
number of elements) before anything changes; one flat group's weights are in memory at a time (a group the
files cover only in part is read from the engine first). Called inside `engine.reading_module_state()`, on
every rank of a data-parallel engine (with sharded weights, reading a group the files cover in part is a
gather).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, cast

import torch
from torch import Tensor

from offload.checkpoint.weight_source import WeightSource
from offload.errors import OffloadConfigError, OffloadError
from offload.scheduler.state.state_store import overwrite_master

if TYPE_CHECKING:
    from offload.checkpoint.target import CheckpointTarget

Read = Tuple[WeightSource, str]  # where one tensor is: its file(s) and its name there


def load_weights(target: "CheckpointTarget", reads: Mapping[str, Read]) -> int:
    """Load the tensors `reads` names (keys: `module.state_dict()` names; a tied weight under any of its
    names) into the engine; returns how many entries were loaded. See the module docstring."""
    groups = list(target.checkpoint_groups())  # every update applied, in-place writes adopted
    if any(state is not None and state.has_pending_grads for _b, _g, state in groups):
        raise OffloadError("loading weights between a backward and step() would drop the pending gradients: call "
                           "engine.step() or engine.zero_grad() first")
    entries = target.module.state_dict(keep_vars=True)
    names_of: Dict[int, List[str]] = {}
    for name, value in entries.items():
        names_of.setdefault(id(value), []).append(name)

    def find(value: Tensor) -> Optional[Read]:
        return next((reads[name] for name in names_of.get(id(value), []) if name in reads), None)

    plan: List[Tuple[Any, Any, List[Tuple[Any, Optional[Read]]]]] = []
    for _block, group, state in groups:
        found = [(slot, find(slot.param)) for slot in group.slots]
        for slot, read in found:
            if read is not None:
                _check_size(read, slot.numel, slot.name)
        if any(read is not None for _s, read in found):
            plan.append((group, state, found))
    stored = {id(slot.param) for _b, group, _s in groups for slot in group.slots}
    others = [(value, read) for name, value in entries.items()
              if id(value) not in stored and (read := find(value)) is not None]  # buffers
    for value, read in others:
        _check_size(read, value.numel(), read[1])
    target.prepare_for_load()
    try:
        for group, state, found in plan:
            _load_group(target, group, state, found)
        for value, (source, name) in others:
            with torch.no_grad():
                value.copy_(source.read(name).reshape(value.shape))
    except BaseException as exc:
        target.mark_inconsistent(exc)
        raise
    return sum(read is not None for _g, _s, found in plan for _slot, read in found) + len(others)


def _load_group(target: "CheckpointTarget", group: Any, state: Any, found: List[Tuple[Any, Optional[Read]]]) -> None:
    """One flat group: its compute weights (the engine's own where the files name no entry), then the named
    trainable parameters' master weights, their moments kept."""
    partial = any(read is None for _s, read in found)
    flat = target.group_weights(group).clone() if partial else torch.empty(group.numel, dtype=group.dtype)
    masters = torch.empty(group.trainable_numel, dtype=torch.float32) if state is not None else None
    ranges = []
    for slot, read in found:
        if read is None:
            continue
        source, name = read
        value = source.read(name).reshape(-1)
        flat[slot.offset:slot.offset + slot.numel].copy_(value)
        if masters is not None and slot.trainable:  # trainable slots come first: their offsets index `masters`
            masters[slot.offset:slot.offset + slot.numel].copy_(value)
            ranges.append((slot.offset, slot.offset + slot.numel))
    target.set_group_weights(group, flat)
    if masters is not None and ranges:
        overwrite_master(cast(Any, state.state_store), masters, ranges)


def _check_size(read: Read, numel: int, name: str) -> None:
    source, key = read
    shape = source.shapes[key]
    if int(torch.Size(shape).numel()) != numel:
        raise OffloadConfigError(f"{source.path}: tensor {key!r} has shape {list(shape)} ({torch.Size(shape).numel()} "
                                 f"elements), the model's {name!r} {numel}: the weights are of another model")
