"""`load_checkpoint(engine, path)`: stream a checkpoint into an engine of any tier, verifying every tensor.

Keyed by parameter names, so the saving engine's tier, block grouping and compute dtype do not matter
(weights of another dtype are cast). Files are read tensor by tensor into one flat group's worth of host
memory at a time (for the nvme tier, one staging lease that is then written to the swap file). Every
tensor's checksum and every file's size are checked; a mismatch raises OffloadIntegrityError naming the
file, tensor and block. Checks that need no data (names, shapes, sizes) run before anything is changed.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import Tensor

from offload.checkpoint import rng as rng_state
from offload.checkpoint import state_io
from offload.checkpoint.atomic import resolve
from offload.checkpoint.reflink import BLOCK, clone_range
from offload.checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, read_manifest
from offload.checkpoint.tensor_file import TensorFileReader
from offload.checkpoint.writer import STATE_KINDS, _progress, optimizer_key
from offload.checksum import checksum
from offload.errors import OffloadConfigError, OffloadIntegrityError

if TYPE_CHECKING:
    from offload.engine import Engine


def load_checkpoint(engine: "Engine", path: str, *, scheduler: Any = None, rng: bool = False,
                    progress: Optional[bool] = None) -> Dict[str, Any]:
    """Load into `engine`; returns the manifest. See `Engine.load`."""
    directory = resolve(path)
    manifest = read_manifest(directory)
    algorithm = manifest["checksum"]
    block_of = manifest.get("block_of", {})
    steps = {p["name"]: p["steps"] for b in manifest["blocks"] for g in b["groups"] for p in g["params"]}
    groups = list(engine.checkpoint_groups())
    _check_compatible(groups, manifest, directory)
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        if name not in manifest["files"]:
            raise OffloadIntegrityError(f"the manifest of {directory!r} lists no {name}", directory)
    extras = {}
    for kind, key in (("scheduler", "scheduler"), ("rng", "rng")):
        wanted = scheduler is not None if kind == "scheduler" else rng
        if wanted:
            if not manifest.get(key):
                raise OffloadConfigError(f"checkpoint {directory!r} was saved without {kind} state; "
                                         f"save with {kind}={'scheduler' if kind == 'scheduler' else 'True'}")
            extras[kind] = _read_pickle(os.path.join(directory, manifest[key]), manifest["files"][manifest[key]],
                                        algorithm)
    engine.zero_grad()
    try:
        _load_tensors(engine, groups, directory, manifest, steps, block_of, algorithm, progress)
    except OffloadIntegrityError as exc:
        raise OffloadIntegrityError(f"{exc}; the engine now holds a partly loaded state: load an intact "
                                    "checkpoint before training on", exc.path) from None
    for group_now, saved in zip(engine.optimizer.param_groups, manifest["param_groups"]):
        group_now.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
    engine.restore_counters({"steps": manifest["step"], "skipped_steps": manifest.get("skipped_steps", 0)})
    if "scheduler" in extras:
        scheduler.load_state_dict(extras["scheduler"])
    if "rng" in extras:
        rng_state.restore(extras["rng"])
    return manifest


def _load_tensors(engine: "Engine", groups, directory: str, manifest: Dict[str, Any], steps: Dict[str, int],
                  block_of: Dict[str, str], algorithm: str, progress: Optional[bool]) -> None:
    total = sum(g.nbytes + 12 * g.trainable_numel for _b, g, _s in groups)
    clone_state = {"try": True}
    model_info, optim_info = manifest["files"][MODEL_FILE], manifest["files"][OPTIMIZER_FILE]
    with TensorFileReader(os.path.join(directory, MODEL_FILE), model_info["checksums"], algorithm, block_of) as weights, \
            TensorFileReader(os.path.join(directory, OPTIMIZER_FILE), optim_info["checksums"], algorithm,
                             block_of) as optim, \
            _progress(total, progress, f"offload: loading {os.path.basename(directory)}") as bar:
        scratch = state_io.RecordScratch(state for _b, _g, state in groups)
        for _block, group, state in groups:
            flat = torch.empty(group.numel, dtype=group.dtype)
            for slot in group.slots:
                _read_cast(weights, slot.name, flat[slot.offset:slot.offset + slot.numel])
            engine.set_group_weights(group, flat)
            del flat
            bar.update(group.nbytes)
            if state is None:
                continue
            commit = _clone_into_swap(optim, group, state, clone_state) if clone_state["try"] else None
            with state_io.writing(state, commit, scratch) as views:
                for kind, view in zip(STATE_KINDS, views):
                    for slot in group.trainable_slots:
                        optim.read_into(optimizer_key(kind, slot.name), view[slot.offset:slot.offset + slot.numel])
                del views, view
            state.steps = [steps[slot.name] for slot in group.trainable_slots]
            bar.update(12 * group.trainable_numel)
        stored = {s.name for _b, g, _s in groups for s in g.slots}
        for name, buffer in engine.module.named_buffers():
            if name in weights.entries and name not in stored:
                host = torch.empty(buffer.shape, dtype=buffer.dtype)
                _read_cast(weights, name, host.reshape(-1))
                with torch.no_grad():
                    buffer.copy_(host)
        weights.verify_rest()
        optim.verify_rest()


def _clone_into_swap(optim: TensorFileReader, group: Any, state: Any, clone_state: Dict[str, bool]):
    """A commit for state_io.writing: clone the verified record from the checkpoint into the swap file
    (copy-on-write, same file system) instead of writing it; after one failure, records are written."""
    target = state_io.swap_record(state)
    if target is None:
        return None
    names = [optimizer_key(kind, slot.name) for kind in STATE_KINDS for slot in group.trainable_slots]

    def commit(record: Tensor) -> bool:
        span = optim.span(names)
        nbytes = record.numel() * record.element_size()
        aligned = nbytes // BLOCK * BLOCK
        if span is None or span[1] != nbytes or not clone_range(optim.fileno(), span[0], aligned, target[0], target[1]):
            clone_state["try"] = False
            return False
        tail = memoryview(record.view(torch.uint8).numpy())[aligned:]
        while tail:
            written = os.pwrite(target[0], tail, target[1] + aligned + (nbytes - aligned - len(tail)))
            tail = tail[written:]
        return True

    return commit


def _read_cast(reader: TensorFileReader, name: str, out: Tensor) -> None:
    """Read `name` into `out`, casting when the checkpoint was saved with another compute dtype."""
    entry = reader.entries.get(name)
    if entry is not None and entry[0] != out.dtype:
        staged = torch.empty(out.shape, dtype=entry[0])
        reader.read_into(name, staged)
        out.copy_(staged)
    else:
        reader.read_into(name, out)


def _check_compatible(groups, manifest: Dict[str, Any], directory: str) -> None:
    """Names and shapes, before anything in the engine changes."""
    saved = {p["name"]: p for b in manifest["blocks"] for g in b["groups"] for p in g["params"]}
    missing = [s.name for _b, g, _s in groups for s in g.trainable_slots if s.name not in saved]
    if missing:
        raise OffloadConfigError(f"checkpoint {directory!r} has no state for {len(missing)} trainable parameters "
                                 f"of this model (first: {missing[0]!r}): it was saved from another model")
    for _b, group, _s in groups:
        for slot in group.slots:
            if slot.name in saved and tuple(saved[slot.name]["shape"]) != tuple(slot.shape):
                raise OffloadConfigError(f"parameter {slot.name!r} is {tuple(slot.shape)} in this model but "
                                         f"{tuple(saved[slot.name]['shape'])} in checkpoint {directory!r}")


def _read_pickle(path: str, info: Dict[str, Any], algorithm: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise OffloadIntegrityError(f"checkpoint file {path!r} is missing", path) from None
    if len(data) != info["size"] or checksum(data, algorithm) != info["checksum"]:
        raise OffloadIntegrityError(f"checkpoint file {path!r} is damaged (size or checksum mismatch)", path)
    return torch.load(io.BytesIO(data), weights_only=True)
