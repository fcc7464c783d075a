"""`save_checkpoint(engine, path)`: stream an engine's weights and optimizer state into a checkpoint.

Files, all written into a temporary directory that replaces `path` atomically (atomic.py):
`model.safetensors` (every entry of the model's state_dict, readable without offload),
`optimizer.safetensors` (fp32 `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` of each trainable
parameter), `scheduler.pt` and `rng.pt` when asked, and `manifest.json` last. One flat group is in host
memory at a time: for the nvme tier one swap record, staged through the engine's staging pool.
"""

from __future__ import annotations

import errno
import io
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from tqdm import tqdm

from offload.checkpoint import rng as rng_state
from offload.checkpoint import state_io
from offload.checkpoint.atomic import atomic_directory
from offload.checkpoint.reflink import BLOCK
from offload.checkpoint.manifest import (FORMAT, MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, SCHEDULER_FILE, VERSION,
                                         jsonable_group, write_manifest)
from offload.checkpoint.tensor_file import Entry, TensorFileWriter
from offload.checksum import checksum, preferred_algorithm
from offload.errors import OffloadIOError

if TYPE_CHECKING:
    from offload.engine import Engine

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
PAD = "__pad__"  # zero bytes that align each optimizer record to a file-system block (reflink.BLOCK)
PROGRESS_BYTES = 512 << 20  # show a progress bar above this much data (a few seconds on most disks)


def optimizer_key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


def _progress(total: int, progress: Optional[bool], desc: str) -> tqdm:
    show = total >= PROGRESS_BYTES if progress is None else progress
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show, leave=False)


def save_checkpoint(engine: "Engine", path: str, *, scheduler: Any = None, rng: bool = False,
                    progress: Optional[bool] = None) -> str:
    """Write the checkpoint; returns its absolute path. See `Engine.save`.

    Any file error (a full disk above all) raises OffloadIOError after the temporary directory is removed:
    the previous checkpoint and the engine's state are untouched, so the user can free space and save again.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        return _save(engine, path, scheduler, rng, progress)
    except OffloadIOError as exc:
        raise _explained(exc, path) from None
    except OSError as exc:
        raise _explained(OffloadIOError.from_errno(exc.errno or errno.EIO, exc.filename or path, 0, 0, "save"),
                         path) from None


def _explained(exc: OffloadIOError, path: str) -> OffloadIOError:
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return exc
    return OffloadIOError(exc.errno, f"no space left while saving checkpoint {path!r}; the previous checkpoint "
                          "there (if any) is intact and training state is unharmed: free space and save again",
                          exc.path, exc.offset, exc.size, exc.op)


def _save(engine: "Engine", path: str, scheduler: Any, rng: bool, progress: Optional[bool]) -> str:
    groups = list(engine.checkpoint_groups())  # waits for pending updates first
    if any(state is not None and any(state.has_grad) for _b, _g, state in groups):
        warnings.warn("offload: saving between backward() and step(): accumulated gradients are not part of a "
                      "checkpoint; save after step()/zero_grad() to resume exactly", RuntimeWarning, stacklevel=3)
    algorithm = preferred_algorithm()
    block_of: Dict[str, str] = {}
    blocks: List[Dict[str, Any]] = []
    model_entries: List[Entry] = []
    optim_entries: List[Entry] = []
    optim_bytes = 0
    for block, group, state in groups:
        if not blocks or blocks[-1]["name"] != block.name:
            blocks.append({"name": block.name, "groups": []})
        params = []
        for slot in group.slots:
            index = group.trainable_slots.index(slot) if slot.trainable else -1
            params.append({"name": slot.name, "shape": list(slot.shape), "offset": slot.offset,
                           "trainable": slot.trainable, "steps": state.steps[index] if index >= 0 else 0})
            block_of[slot.name] = block.name
            model_entries.append(Entry(slot.name, group.dtype, tuple(slot.shape)))
        blocks[-1]["groups"].append({"dtype": str(group.dtype).replace("torch.", ""), "params": params})
        if state is not None:
            gap = -optim_bytes % BLOCK  # each record starts on a file-system block, so it can be cloned
            if gap:
                optim_entries.append(Entry(f"{PAD}/{len(optim_entries)}", torch.uint8, (gap,)))
                block_of[optim_entries[-1].name] = block.name
            optim_bytes += gap + 12 * group.trainable_numel
        for kind in STATE_KINDS:
            for slot in group.trainable_slots:
                optim_entries.append(Entry(optimizer_key(kind, slot.name), torch.float32, tuple(slot.shape)))
                block_of[optimizer_key(kind, slot.name)] = block.name
    stored = {id(slot.param): slot.name for _b, g, _s in groups for slot in g.slots}
    tied = {}
    extra = []  # tied aliases and buffers, after the parameters
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in stored and stored[id(value)] != name:
            tied[name] = stored[id(value)]
            block_of[name] = block_of[stored[id(value)]]
            extra.append((name, value))
        elif id(value) not in stored:
            extra.append((name, value))
            block_of[name] = "<buffers>"
    model_entries += [Entry(name, v.dtype, tuple(v.shape)) for name, v in extra]
    total = sum(e.nbytes for e in model_entries + optim_entries)
    files: Dict[str, Dict[str, Any]] = {}
    with atomic_directory(path) as tmp, _progress(total, progress, f"offload: saving {os.path.basename(path)}") as bar:
        if rng:
            files[RNG_FILE] = _write_pickle(os.path.join(tmp, RNG_FILE), rng_state.capture(), algorithm)
        if scheduler is not None:
            files[SCHEDULER_FILE] = _write_pickle(os.path.join(tmp, SCHEDULER_FILE), scheduler.state_dict(), algorithm)
        weights = TensorFileWriter(os.path.join(tmp, MODEL_FILE), model_entries, algorithm, {"format": "pt"})
        try:
            for _block, group, _state in groups:
                flat = engine.group_weights(group)
                for slot in group.slots:
                    weights.write(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
                    bar.update(slot.numel * flat.element_size())
            for name, value in extra:
                source = stored.get(id(value))
                if source is not None:  # a tied alias: the stored parameter's current weights
                    _b, group, _s = next(x for x in groups if any(s.name == source for s in x[1].slots))
                    slot = next(s for s in group.slots if s.name == source)
                    value = engine.group_weights(group)[slot.offset:slot.offset + slot.numel].view(slot.shape)
                weights.write(name, value.detach())
            weights.close()
        except BaseException:
            weights.abort()
            raise
        optim = TensorFileWriter(os.path.join(tmp, OPTIMIZER_FILE), optim_entries, algorithm, {"format": "pt"},
                                 align=BLOCK)
        transfer = {"cloned_bytes": 0, "copied_bytes": 0}
        try_clone = True
        try:
            for _block, group, state in groups:
                if state is None:
                    continue
                pad = next((e.name for e in optim_entries[optim._next:optim._next + 1] if e.name.startswith(PAD)), None)
                if pad is not None:
                    optim.write_zeros(pad)
                cloned = _write_record(optim, group, state, try_clone)
                if cloned is None:
                    try_clone = False  # a file system that cannot clone one record cannot clone the next
                else:
                    transfer["cloned_bytes"] += cloned
                transfer["copied_bytes"] += 12 * group.trainable_numel
                bar.update(12 * group.trainable_numel)
            transfer["copied_bytes"] -= transfer["cloned_bytes"]
            optim.close()
        except BaseException:
            optim.abort()
            raise
        for writer in (weights, optim):
            files[os.path.basename(writer.path)] = {"size": os.path.getsize(writer.path), "checksums": writer.checksums}
        counters = engine.checkpoint_counters()
        manifest = {
            "format": FORMAT, "version": VERSION, "created": time.time(), "checksum": algorithm,
            "tier": engine.policy.tier.value, "compute_dtype": str(engine.policy.dtype).replace("torch.", ""),
            "step": counters["steps"], "skipped_steps": counters["skipped_steps"],
            "param_groups": [jsonable_group(g) for g in engine.optimizer.param_groups],
            "blocks": blocks, "tied": tied, "block_of": block_of, "files": files,
            "scheduler": SCHEDULER_FILE if scheduler is not None else None, "rng": RNG_FILE if rng else None,
            "optimizer_state_transfer": transfer,  # bytes cloned copy-on-write from the swap file vs written
        }
        write_manifest(tmp, manifest)
    return os.path.abspath(path)


def _write_record(optim: TensorFileWriter, group: Any, state: Any, try_clone: bool) -> Optional[int]:
    """One group's optimizer state: cloned from its swap record when possible, else written; returns the
    bytes cloned, None when written. A function of its own so every view of the staging lease is gone when it returns (the
    lease goes back to the pool only then)."""
    with state_io.reading(state) as views:
        items = [(optimizer_key(kind, slot.name), view[slot.offset:slot.offset + slot.numel].view(slot.shape))
                 for kind, view in zip(STATE_KINDS, views) for slot in group.trainable_slots]
        source = state_io.swap_record(state) if try_clone else None
        if source is not None and optim.clone(items, source[0], source[1]):
            return source[2] // BLOCK * BLOCK
        for name, tensor in items:
            optim.write(name, tensor)
        return None


def _write_pickle(path: str, obj: Any, algorithm: str) -> Dict[str, Any]:
    """A torch.save file (loadable with weights_only=True), with its whole-file checksum."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OffloadIOError.from_errno(exc.errno or 5, path, 0, len(data), "write") from None
    return {"size": len(data), "checksum": checksum(data, algorithm)}
