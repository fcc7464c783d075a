"""`engine.optimizer.state_dict()` / `load_state_dict()` in torch's AdamW format, over the engine's flat state.

Lightning, accelerate (`prepare`, `save_state` / `load_state`) and most hand-written loops checkpoint an
optimizer with `torch.save(opt.state_dict())`. The engine's Adam state lives in flat per-group buffers in
host memory or the swap file; this module cuts it into what `torch.optim.AdamW` holds per parameter:
`step` (a float32 scalar tensor), `exp_avg`, `exp_avg_sq`, and, where the compute weights are not fp32, the
fp32 master weights under `offload_master` (so a round trip resumes bit for bit; torch's AdamW ignores the
key). A parameter never stepped has no entry, as in torch, so before the first step the state is torch's
empty one (`accelerator.prepare` round-trips it). On the nvme tier the tensors are backed by a snapshot file
next to the swap files (unlinked at once: the space goes back when the last tensor is dropped), so the state
does not have to fit in host memory and `torch.save` streams it from the page cache. Data-parallel, every
rank fills its part and a sum over the ranks completes each tensor (the others' parts are zeros), so every
rank returns the whole state, as torch's optimizer on each DDP rank does. See docs/design.md
[Note: torch-style optimizer state].
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from offload.checkpoint.target import CheckpointTarget, GroupStateView, pieces
from offload.distributed.data_parallel import DataParallel
from offload.errors import OffloadError
from offload.policy import Tier
from offload.scheduler.blocks.block import FlatGroup
from offload.tiers.swap_layout import STATE_TENSORS

MASTER_KEY = "offload_master"  # the fp32 master weights, ours: torch's AdamW keeps none
MOMENTS = ("exp_avg", "exp_avg_sq")
KNOWN_KEYS = frozenset({"step", *MOMENTS, MASTER_KEY})

Groups = List[Tuple[Any, FlatGroup, Optional[GroupStateView]]]
PerParam = Dict[nn.Parameter, Dict[str, Tensor]]


class TorchStyleState:
    """Reads and replaces the engine's optimizer state per parameter (the `TorchStateIO` of
    scheduler/phases/optimizer_view.py)."""

    def __init__(self, target: CheckpointTarget, data_parallel: Optional[DataParallel]) -> None:
        self._target = target
        self._data_parallel = data_parallel

    # ----- export -----------------------------------------------------------------------------------
    def per_param_state(self, only: Optional[nn.Parameter] = None) -> PerParam:
        """Every stepped parameter's state, whole (data-parallel: the same on every rank); `only`: that
        parameter's alone (its group is read, no other)."""
        groups = list(self._target.checkpoint_groups())
        stepped = [(group, state, [i for i, s in enumerate(state.steps)
                                   if s > 0 and (only is None or group.trainable_slots[i].param is only)])
                   for _block, group, state in groups if state is not None]
        kinds = {id(group): _kinds(group) for group, _state, _which in stepped}
        total = sum(len(kinds[id(g)]) * g.trainable_slots[i].numel for g, _s, which in stepped for i in which)
        sink = _Sink(total, self._snapshot_directory())
        out: PerParam = {}
        for group, state, which in stepped:
            if not which:
                continue
            wanted = {i: {kind: sink.take(group.trainable_slots[i].numel) for kind in kinds[id(group)]}
                      for i in which}
            with state.state_store.reading() as chunks:
                for start, stop, views in chunks:
                    for kind, view in zip(STATE_TENSORS, views):
                        for index, first, _lo, piece in pieces(group, start, stop, view):
                            target = wanted.get(index, {}).get(kind)
                            if target is not None:
                                target[first:first + piece.numel()].copy_(piece)
            for index, tensors in wanted.items():
                slot = group.trainable_slots[index]
                if self._data_parallel is not None:
                    for tensor in tensors.values():
                        self._data_parallel.sum_into_all(tensor)  # every rank's part; zeros elsewhere
                entry: Dict[str, Tensor] = {"step": torch.tensor(float(state.steps[index]), dtype=torch.float32)}
                for kind, tensor in tensors.items():
                    entry[MASTER_KEY if kind == "master" else kind] = tensor.view(slot.shape)
                out[slot.param] = entry
        return out

    def _snapshot_directory(self) -> Optional[str]:
        """Where file-backed tensors go: next to the swap files on the nvme tier; None: host memory."""
        policy = self._target.policy
        return policy.nvme_path if policy.tier is Tier.NVME else None

    # ----- import -----------------------------------------------------------------------------------
    def load_per_param_state(self, state: Mapping[nn.Parameter, Mapping[str, Any]]) -> None:
        """Replace the state of every trainable parameter: one without an entry starts afresh (zero moments,
        step 0), as in torch; the master weights stay unless the entry has `offload_master`. Checked whole
        before anything changes."""
        groups = list(self._target.checkpoint_groups())
        _check_entries(groups, state)
        for _block, _group, view in groups:
            if view is not None and view.has_pending_grads:
                raise OffloadError(
                    "engine.optimizer.load_state_dict() between a backward and step() would drop the pending "
                    "gradients: call engine.step() or engine.zero_grad() first, then load")
        self._target.prepare_for_load()
        try:
            for _block, group, view in groups:
                if view is not None:
                    _load_group(group, view, [state.get(slot.param) for slot in group.trainable_slots])
        except BaseException as exc:
            self._target.mark_inconsistent(exc)
            raise


def _kinds(group: FlatGroup) -> Tuple[str, ...]:
    """What a parameter's entry holds: the master weights only where they differ from the compute weights."""
    return STATE_TENSORS if group.dtype != torch.float32 else MOMENTS


def _check_entries(groups: Groups, state: Mapping[nn.Parameter, Mapping[str, Any]]) -> None:
    names = {slot.param: slot.name for _b, group, view in groups if view is not None
             for slot in group.trainable_slots}
    for param, entry in state.items():
        name = names.get(param)
        if name is None:
            raise OffloadError("engine.optimizer.load_state_dict(): the state names a parameter the engine does "
                               "not train (frozen, or not in its param_groups)")
        unknown = sorted(set(entry) - KNOWN_KEYS)
        if unknown:
            raise OffloadError(
                f"engine.optimizer.load_state_dict(): the state of {name!r} holds {unknown}, which is not "
                "torch.optim.AdamW's state (amsgrad's max_exp_avg_sq, or another optimizer's): the engine runs "
                "AdamW; load a state dict saved from AdamW or from engine.optimizer")
        missing = [key for key in ("step", *MOMENTS) if key not in entry]
        if missing:
            raise OffloadError(f"engine.optimizer.load_state_dict(): the state of {name!r} lacks {missing}")
        for key in (*MOMENTS, MASTER_KEY):
            if key in entry and torch.as_tensor(entry[key]).numel() != param.numel():
                raise OffloadError(
                    f"engine.optimizer.load_state_dict(): {key} of {name!r} has {torch.as_tensor(entry[key]).numel()}"
                    f" elements, the parameter {param.numel()}: the state dict is of another model")


def _load_group(group: FlatGroup, view: GroupStateView, entries: Sequence[Optional[Mapping[str, Any]]]) -> None:
    """One group's state, written chunk by chunk through its store."""
    current = _current_master(group, view) if any(e is None or MASTER_KEY not in e for e in entries) else None
    flat = [{key: torch.as_tensor(e[key]).detach().reshape(-1) for key in (*MOMENTS, MASTER_KEY) if key in e}
            if e is not None else {} for e in entries]

    def fill(start: int, stop: int, views: Tuple[Tensor, Tensor, Tensor]) -> None:
        for kind, section in zip(STATE_TENSORS, views):
            for index, first, lo, piece in pieces(group, start, stop, section):
                source = flat[index].get(MASTER_KEY if kind == "master" else kind)
                if source is not None:
                    piece.copy_(source[first:first + piece.numel()])
                elif kind == "master":
                    assert current is not None
                    piece.copy_(current[lo:lo + piece.numel()])
                else:
                    piece.zero_()  # no entry: a fresh start, as torch's AdamW has for it

    view.state_store.write(fill)
    view.restore_steps([int(torch.as_tensor(e["step"]).item()) if e is not None else 0 for e in entries])


def _current_master(group: FlatGroup, view: GroupStateView) -> Tensor:
    """The group's master weights now (this rank's part of them; the rest stays zero and unread)."""
    current = torch.zeros(group.trainable_numel, dtype=torch.float32)
    with view.state_store.reading() as chunks:
        for start, stop, (master, _m, _v) in chunks:
            current[start:stop].copy_(master[:stop - start])
    return current


class _Sink:
    """Zeroed fp32 tensors for the exported state: one snapshot file mapped into memory (nvme tier: the
    state need not fit in host memory) or host memory. Each tensor has a storage of its own over its part
    (as torch's AdamW state has), so `torch.save` writes each tensor's bytes only: a file of some of them
    (`optimizer.pt` without the master weights) holds just those."""

    def __init__(self, total: int, directory: Optional[str]) -> None:
        self._flat = (_mapped_zeros(total, directory) if directory is not None and total
                      else np.zeros(total, dtype=np.float32))
        self._used = 0

    def take(self, numel: int) -> Tensor:
        tensor = torch.from_numpy(self._flat[self._used:self._used + numel])  # keeps the whole mapping alive
        self._used += numel
        return tensor


def _mapped_zeros(numel: int, directory: str) -> np.ndarray:
    """`numel` fp32 zeros in a new file under `directory`, mapped shared and unlinked at once: its blocks
    are freed when the last tensor viewing it goes."""
    nbytes = 4 * numel
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise OffloadError(
            f"engine.optimizer.state_dict() needs {nbytes / 2**30:.2f} GiB free under {directory!r} for the "
            f"optimizer state it returns (file-backed on the nvme tier), {free / 2**30:.2f} GiB are: free space "
            "there, or checkpoint with engine.save(path), which streams the state group by group")
    fd, path = tempfile.mkstemp(prefix="offload-optimizer-state-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, nbytes)  # sparse: reads as zeros
        mapped = np.memmap(path, dtype=np.float32, mode="r+", shape=(numel,))
    finally:
        os.close(fd)
        os.unlink(path)
    return mapped
