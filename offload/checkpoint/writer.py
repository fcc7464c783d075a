"""`save_checkpoint(engine, path)`: stream an engine's weights and optimizer state into a checkpoint.

Files, all written into a temporary directory that replaces `path` atomically (atomic.py):
`model.safetensors` (every entry of the model's state_dict, readable without offload),
`optimizer.safetensors` (`exp_avg/<name>`, `exp_avg_sq/<name>` of each trainable parameter and, where the weights
do not give it back, its fp32 `master/<name>`; with bf16 weights `master_low/<name>` and `master_tie/<name>`, what
the master adds to them: [Note: master weights stored once], masters.py; each record's three sections 4 KiB-aligned
as in the swap file, so they can be cloned; bf16 moments as bf16 values, int8 ones as uint8 codes plus
`exp_avg_scales/<name>`, `exp_avg_sq_scales/<name>`: the parameter's block scales, [Note: compressed moments] in
docs/design.md),
`scheduler.pt`, `data.pt` (a data stream's position) and `rng.pt` when asked, and `manifest.json` last. One flat group is in host memory at a
time; for the nvme tier not even that: one chunk of its record, in a slot of the engine's staging ring. Both
files are written in one walk over the groups, so each group's weights, read once, are also what its masters are
checked against.
"""

from __future__ import annotations

import errno
import io
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Any,
    Callable,
    Collection,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import torch
from tqdm import tqdm

from offload.checkpoint import rng as rng_state
from offload.checkpoint.atomic import atomic_directory
from offload.checkpoint.manifest import (
    FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATEFUL_FILES,
    jsonable_group,
    version_for,
    write_manifest,
)
from offload.checkpoint.masters import FROM_BF16, FROM_WEIGHTS, MasterCheck, low_key, scheme_for, tie_bytes, tie_key
from offload.checkpoint.reflink import BLOCK
from offload.checkpoint.target import pieces
from offload.checkpoint.tensor_file import Entry, TensorFileWriter
from offload.checksum import checksum, preferred_algorithm
from offload.errors import OffloadIOError
from offload.optim.moment_format import INT8_BLOCK, BlockLayout, MomentFormat, QuantizedMoment, scale_count
from offload.scheduler.state.state_store import moment_blocks
from offload.tiers.swap_layout import STATE_TENSORS

if TYPE_CHECKING:
    from offload.checkpoint.target import CheckpointTarget

PAD = "__pad__"  # zero bytes that align each optimizer record to a file-system block (reflink.BLOCK)
PROGRESS_BYTES = 512 << 20  # show a progress bar above this much data (a few seconds on most disks)


def optimizer_key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


SCALES_SUFFIX = "_scales"  # an int8 moment's block scales: `<kind>_scales/<name>`


def scales_key(kind: str, name: str) -> str:
    """The entry of an int8 moment's block scales (`kind`: exp_avg or exp_avg_sq)."""
    return f"{kind}{SCALES_SUFFIX}/{name}"


def state_entries(kind: str, group: Any, moments: MomentFormat, masters: Dict[str, str],
                  parts: Optional[Dict[str, List[int]]] = None) -> List[Entry]:
    """The entries of one section of a group's optimizer state ([Note: compressed moments]): fp32 master weights
    where `masters` has no other source for them, low halves and tie bits where it says FROM_BF16 ([Note: master
    weights stored once]); each moment as the engine keeps it: fp32 or bf16 values, or int8 codes (uint8) and then
    every parameter's fp32 block scales (its blocks start at its first element: `BlockLayout`). `parts`: a
    data-parallel rank's file, which holds elements [a, b) of each parameter it names, as 1-D tensors, the int8
    blocks starting at a (sharded.py)."""
    slots = [s for s in group.trainable_slots if parts is None or s.name in parts]

    def shape(slot: Any) -> Tuple[int, ...]:
        return tuple(slot.shape) if parts is None else (parts[slot.name][1] - parts[slot.name][0],)

    def numel(slot: Any) -> int:
        return slot.numel if parts is None else parts[slot.name][1] - parts[slot.name][0]

    if kind == "master":
        return ([Entry(optimizer_key(kind, s.name), torch.float32, shape(s)) for s in slots if s.name not in masters]
                + [Entry(low_key(s.name), torch.int16, shape(s)) for s in slots if masters.get(s.name) == FROM_BF16]
                + [Entry(tie_key(s.name), torch.uint8, (tie_bytes(numel(s)),)) for s in slots
                   if masters.get(s.name) == FROM_BF16])
    stored = [Entry(optimizer_key(kind, s.name), STORED_DTYPE[moments], shape(s)) for s in slots]
    if moments is not MomentFormat.INT8:
        return stored
    return stored + [Entry(scales_key(kind, s.name), torch.float32, (scale_count(moments, numel(s)),)) for s in slots]


# the dtype a checkpoint stores each moment format's values or codes in
STORED_DTYPE = {MomentFormat.FP32: torch.float32, MomentFormat.BF16: torch.bfloat16, MomentFormat.INT8: torch.uint8}


def progress_bar(total: int, progress: Optional[bool], desc: str) -> tqdm:
    show = total >= PROGRESS_BYTES if progress is None else progress
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show, leave=False)


def save_checkpoint(engine: "CheckpointTarget", path: str, *, stateful: Optional[Dict[str, Any]] = None,
                    rng: bool = False, progress: Optional[bool] = None) -> str:
    """Write the checkpoint; returns its absolute path. See `Engine.save`.

    Any file error (a full disk above all) raises OffloadIOError after the temporary directory is removed:
    the previous checkpoint and the engine's state are untouched, so the user can free space and save again.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        return _save(engine, path, stateful or {}, rng, progress)
    except OffloadIOError as exc:
        raise explained_io_error(exc, path) from None
    except OSError as exc:
        raise explained_io_error(OffloadIOError.from_errno(exc.errno or errno.EIO, exc.filename or path, 0, 0, "save"),
                         path) from None


def explained_io_error(exc: OffloadIOError, path: str) -> OffloadIOError:
    return exc.if_disk_full(f"no space left while saving checkpoint {path!r}; the previous checkpoint "
                            "there (if any) is intact and training state is unharmed: free space and save again")


@dataclass
class CheckpointLayout:
    """What the files will hold, known before any data is read: entries in write order, and the manifest's
    per-block description."""

    blocks: List[Dict[str, Any]] = field(default_factory=list)
    block_of: Dict[str, str] = field(default_factory=dict)  # tensor name -> block, for error messages
    model_entries: List[Entry] = field(default_factory=list)
    optim_entries: List[Entry] = field(default_factory=list)
    extra: List[Tuple[str, torch.Tensor]] = field(default_factory=list)  # tied aliases, buffers
    tied: Dict[str, str] = field(default_factory=dict)  # alias -> stored name
    masters: Dict[str, str] = field(default_factory=dict)  # name -> where its master comes from, when not stored

    def record_bytes(self, group: Any, moments: MomentFormat) -> int:
        """The bytes of a group's optimizer state in the file (padding aside)."""
        return sum(e.nbytes for kind in STATE_TENSORS for e in state_entries(kind, group, moments, self.masters))


def checkpoint_layout(engine: "CheckpointTarget", groups: list, stored_masters: AbstractSet[str] = frozenset(),
                      derive: Collection[str] = (FROM_WEIGHTS, FROM_BF16)) -> CheckpointLayout:
    """The files' layout. Masters come from the weights by the schemes in `derive` ([Note: master weights stored
    once]; the writer checks them against the weights as it writes), except those in `stored_masters` (ones that
    failed that check)."""
    out, optim_bytes = CheckpointLayout(), 0
    for _block, group, state in groups:
        scheme = scheme_for(group.dtype) if state is not None else None
        if scheme in derive:
            out.masters.update({s.name: scheme for s in group.trainable_slots if s.name not in stored_masters})
    for block, group, state in groups:
        if not out.blocks or out.blocks[-1]["name"] != block.name:
            out.blocks.append({"name": block.name, "groups": []})
        steps = dict(zip((s.name for s in group.trainable_slots), state.steps)) if state is not None else {}
        params = [{"name": slot.name, "shape": list(slot.shape), "offset": slot.offset, "trainable": slot.trainable,
                   "steps": steps.get(slot.name, 0)} for slot in group.slots]
        out.blocks[-1]["groups"].append({"dtype": str(group.dtype).replace("torch.", ""), "params": params})
        for slot in group.slots:
            out.block_of[slot.name] = block.name
            out.model_entries.append(Entry(slot.name, group.dtype, tuple(slot.shape)))
        if state is None:
            continue
        for kind in STATE_TENSORS:  # each section starts on a file-system block, as in the swap record (v2)
            entries = state_entries(kind, group, state.state_store.moments, out.masters)
            if not entries:
                continue
            gap = -optim_bytes % BLOCK
            if gap:
                out.optim_entries.append(Entry(f"{PAD}/{len(out.optim_entries)}", torch.uint8, (gap,)))
                out.block_of[out.optim_entries[-1].name] = block.name
            for entry in entries:
                out.optim_entries.append(entry)
                out.block_of[entry.name] = block.name
                optim_bytes += entry.nbytes
            optim_bytes += gap
    stored = {id(slot.param): slot.name for _b, g, _s in groups for slot in g.slots}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in stored and stored[id(value)] == name:
            continue
        if id(value) in stored:
            out.tied[name] = stored[id(value)]
            out.block_of[name] = out.block_of[stored[id(value)]]
        else:
            out.block_of[name] = "<buffers>"
        out.extra.append((name, value))
        out.model_entries.append(Entry(name, value.dtype, tuple(value.shape)))
    return out


def _save(engine: "CheckpointTarget", path: str, stateful: Dict[str, Any], rng: bool, progress: Optional[bool]) -> str:
    groups = list(engine.checkpoint_groups())  # waits for pending updates first
    if any(state is not None and state.has_pending_grads for _b, _g, state in groups):
        warnings.warn("offload: saving between backward() and step(): accumulated gradients are not part of a "
                      "checkpoint; save after step()/zero_grad() to resume exactly", RuntimeWarning, stacklevel=3)
    algorithm = preferred_algorithm()
    layout = checkpoint_layout(engine, groups)
    total = sum(e.nbytes for e in layout.model_entries + layout.optim_entries)
    files: Dict[str, Dict[str, Any]] = {}
    with atomic_directory(path) as tmp, progress_bar(total, progress, f"offload: saving {os.path.basename(path)}") as bar:
        if rng:
            files[RNG_FILE] = write_pickle(os.path.join(tmp, RNG_FILE), rng_state.capture(), algorithm)
        files.update(write_stateful(tmp, stateful, algorithm))
        model = TensorFileWriter(os.path.join(tmp, MODEL_FILE), layout.model_entries, algorithm, {"format": "pt"})
        try:
            files[OPTIMIZER_FILE], transfer, failed = _write_optimizer(engine, groups, layout, os.path.join(
                tmp, OPTIMIZER_FILE), algorithm, bar, model)
            for name, value, _nbytes in extras_in_file_order(engine, groups, layout):
                model.write(name, value)
            model.close()
        except BaseException:
            model.abort()
            raise
        files[MODEL_FILE] = {"size": os.path.getsize(os.path.join(tmp, MODEL_FILE)), "checksums": model.checksums}
        if failed:  # masters the weights do not give back (rare): the optimizer file again, with them in full
            layout = checkpoint_layout(engine, groups, stored_masters=failed)
            files[OPTIMIZER_FILE], transfer, failed = _write_optimizer(engine, groups, layout, os.path.join(
                tmp, OPTIMIZER_FILE), algorithm, bar)
            assert not failed, f"masters {sorted(failed)[:3]} changed during the save"
        write_manifest(tmp, dict(
            manifest_fields(engine, layout, algorithm, files),
            **stateful_fields(stateful), rng=RNG_FILE if rng else None,
            optimizer_state_transfer=transfer,  # bytes cloned copy-on-write from the swap file vs written
        ))
    return path


def manifest_fields(engine: "CheckpointTarget", layout: CheckpointLayout, algorithm: str,
                    files: Dict[str, Dict[str, Any]], parts: bool = False) -> Dict[str, Any]:
    """What every manifest records (manifest.py), whoever wrote the files (`parts`: data-parallel ranks)."""
    counters = engine.checkpoint_counters()
    names = {id(p): name for name, p in engine.module.named_parameters()}  # tied: the first name
    return {
        "format": FORMAT, "version": version_for(engine.policy.moments.value, bool(layout.masters), parts),
        "created": time.time(), "checksum": algorithm,
        "tier": engine.policy.tier.value, "compute_dtype": str(engine.policy.dtype).replace("torch.", ""),
        # [Note: compressed moments] the engine's moment format; the optimizer files hold the moments as the
        # engine keeps them (bf16 values, int8 codes and scales), a data-parallel rank's file its part of them
        "moments": engine.policy.moments.value,
        "step": counters["steps"], "skipped_steps": counters["skipped_steps"],
        "param_groups": [dict(jsonable_group(g), param_names=[names[id(p)] for p in g["params"]])
                         for g in engine.optimizer.param_groups],
        "blocks": layout.blocks, "tied": layout.tied, "block_of": layout.block_of, "files": files,
        # [Note: master weights stored once] parameter -> where its master comes from, when the optimizer files
        # do not hold it: "weights" (the fp32 weight) or "bf16+low" (the bf16 weight, master_low/, master_tie/)
        "masters": layout.masters,
    }


def write_model_file(engine: "CheckpointTarget", groups: list, layout: CheckpointLayout, path: str, algorithm: str,
                   bar: tqdm, walk: Optional[Iterator[Tuple[str, torch.Tensor, int]]] = None) -> Dict[str, Any]:
    """model.safetensors: each group's current weights, then tied aliases and buffers (`walk`: that sequence,
    begun by the caller, which then can finish it after a failure)."""
    writer = TensorFileWriter(path, layout.model_entries, algorithm, {"format": "pt"})
    try:
        for name, value, nbytes in (walk if walk is not None else weights_in_file_order(engine, groups, layout)):
            writer.write(name, value)
            bar.update(nbytes)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"size": os.path.getsize(path), "checksums": writer.checksums}


def group_slices(group: Any, flat: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """Each parameter of a group's flat weights, by name, in its shape."""
    for slot in group.slots:
        yield slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape)


def weights_in_file_order(engine: "CheckpointTarget", groups: list,
                          layout: CheckpointLayout) -> Iterator[Tuple[str, torch.Tensor, int]]:
    """model.safetensors' tensors in file order, with the bytes of progress each completes: each group's current
    weights, then tied aliases and buffers. Sharded weights: the other ranks walk it too (each read is a gather)."""
    for _block, group, _state in groups:
        named = list(group_slices(group, engine.group_weights(group)))
        for index, (name, value) in enumerate(named):
            yield name, value, group.nbytes if index == len(named) - 1 else 0
    yield from extras_in_file_order(engine, groups, layout)


def extras_in_file_order(engine: "CheckpointTarget", groups: list,
                         layout: CheckpointLayout) -> Iterator[Tuple[str, torch.Tensor, int]]:
    """model.safetensors' tensors after the groups' weights: tied aliases (the stored parameter's current
    weights; a gather with sharded weights) and buffers."""
    where = {slot.name: (group, slot) for _b, group, _s in groups for slot in group.slots}
    for name, value in layout.extra:
        if name in layout.tied:
            group, slot = where[layout.tied[name]]
            value = engine.group_weights(group)[slot.offset:slot.offset + slot.numel].view(slot.shape)
        yield name, value.detach(), 0


def _write_optimizer(engine: "CheckpointTarget", groups: list, layout: CheckpointLayout, path: str, algorithm: str,
                     bar: tqdm, model: Optional[TensorFileWriter] = None) -> Tuple[Dict[str, Any], Dict[str, int],
                                                                                  Set[str]]:
    """optimizer.safetensors, one record at a time and each record chunk by chunk, each group's masters checked
    against its weights (read once a group, and written into `model` too when given); returns the file's entry,
    the bytes cloned/written and the parameters whose masters the weights did not give back (the file then
    lacks them: the caller writes it again with them stored)."""
    writer = TensorFileWriter(path, layout.optim_entries, algorithm, {"format": "pt"}, align=BLOCK)
    transfer = {"cloned_bytes": 0, "copied_bytes": 0}
    failed: Set[str] = set()
    try_clone = True
    try:
        for entry in layout.optim_entries:
            if entry.name.startswith(PAD + "/"):
                writer.write_zeros(entry.name)
        for _block, group, state in groups:
            derived = state is not None and any(s.name in layout.masters for s in group.trainable_slots)
            flat = engine.group_weights(group) if model is not None or derived else None
            if model is not None:
                assert flat is not None
                for name, value in group_slices(group, flat):
                    model.write(name, value)
                bar.update(group.nbytes)
            if state is None:
                continue
            check = MasterCheck(layout.masters, flat, lambda name, first, data: _put(writer, name, first, data),
                                failed)
            nbytes = layout.record_bytes(group, state.state_store.moments)
            cloned, complete = _write_record(writer, group, state, try_clone, check, not derived)
            try_clone = try_clone and complete  # a file system that cannot clone one record cannot clone the next
            transfer["cloned_bytes"] += cloned
            transfer["copied_bytes"] += nbytes - cloned
            bar.update(nbytes)
        if failed:
            writer.abort()
        else:
            writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"size": os.path.getsize(path), "checksums": writer.checksums}, transfer, failed


def _masters(check: MasterCheck, group: Any, start: int, stop: int, master: torch.Tensor) -> None:
    """A chunk's master weights: each parameter's piece through the group's `MasterCheck`."""
    for slot, first, lo, piece in pieces(group, start, stop, master):
        trainable = group.trainable_slots[slot]
        check.piece(trainable.name, trainable.numel, first, lo, piece)


def _write_record(optim: TensorFileWriter, group: Any, state: Any, try_clone: bool, check: MasterCheck,
                  masters_stored: bool) -> Tuple[int, bool]:
    """One group's optimizer state, chunk by chunk through a ring slot (nvme) or from memory, the moments as the
    store keeps them (fp32 or bf16 values, int8 codes and scales: `put_moments`). Each section's block-aligned
    part (the masters, each moment's values or codes) is first cloned from its swap-record section when possible
    (the file mirrors the record's sections, each starting on a block; the masters' only when the file stores
    them all), and only the rest written; every byte still passes through the per-tensor checksums. Returns
    (bytes cloned, whether every clone tried worked)."""
    store = state.state_store
    if store.moments is MomentFormat.INT8:
        whole = BlockLayout.of_segments(group.trainable_numel, group.trainable_segments)
        assert moment_blocks(store.moments, store.group) == whole, "a single file holds whole parameters' blocks"
    names = [[optimizer_key(kind, slot.name) for slot in group.trainable_slots] for kind in STATE_TENSORS]
    cloned = [0, 0, 0]  # per section: leading elements the clone covered
    source = store.swap_sections() if try_clone else None
    complete = True
    if source is not None:
        for index, offset in enumerate(source.offsets):
            if index == 0 and not masters_stored:
                continue
            aligned = source.nbytes[index] // BLOCK * BLOCK
            if aligned and not optim.clone(names[index][0], aligned, source.fd, offset):
                complete = False
                break
            cloned[index] = aligned // source.itemsizes[index]
    with store.reading(encoded=store.moments is not MomentFormat.FP32) as chunks:
        for start, stop, (master, exp_avg, exp_avg_sq) in chunks:
            if cloned[0]:
                for slot, first, at, piece in pieces(group, start, stop, master):
                    _put(optim, names[0][slot], first, piece, _in_file(cloned[0], at, piece))
            else:
                _masters(check, group, start, stop, master)
            put_moments(lambda name, first, data, skip: _put(optim, name, first, data, skip), group, state, start,
                        stop, exp_avg, exp_avg_sq, cloned=cloned[1:])
    itemsizes = source.itemsizes if source is not None else (4, 4, 4)
    return sum(n * size for n, size in zip(cloned, itemsizes)), complete


def put_moments(put: Callable[[str, int, torch.Tensor, int], None], group: Any, state: Any, start: int, stop: int,
                exp_avg: Any, exp_avg_sq: Any, stored_from: Optional[Dict[str, List[int]]] = None,
                cloned: Sequence[int] = (0, 0)) -> None:
    """A chunk [start, stop) of a group's two moments, as its store keeps them (fp32 or bf16 values, int8
    `QuantizedMoment`s), cut into parameters: `put(entry, first element, data, in file)` for each piece's values
    or codes and, for int8, its blocks' scales. The store's blocks start over at each parameter's part of its
    range ([Note: compressed moments]), so a piece's scales are a range of the chunk's; `stored_from`: where the
    file's part of each parameter starts (a data-parallel rank's file), else at element 0; `cloned`: the leading
    elements of each moment's values or codes the file holds already (`in file`: how many of the piece's)."""
    lo = state.part[0]
    layout = moment_blocks(state.state_store.moments, state.state_store.group)
    blocks = layout.sub(start - lo, stop - lo) if layout is not None else None
    for kind, moment, below in (("exp_avg", exp_avg, cloned[0]), ("exp_avg_sq", exp_avg_sq, cloned[1])):
        codes = moment.codes if isinstance(moment, QuantizedMoment) else moment
        for slot, first, at, piece in pieces(group, start, stop, codes):
            name = group.trainable_slots[slot].name
            first -= stored_from[name][0] if stored_from is not None else 0
            put(optimizer_key(kind, name), first, piece, _in_file(below, at, piece))
            if isinstance(moment, QuantizedMoment):
                assert blocks is not None and first % INT8_BLOCK == 0, "chunks are cut where blocks start"
                a, b = blocks.scales_before(at - start), blocks.scales_before(at - start + piece.numel())
                put(scales_key(kind, name), first // INT8_BLOCK, moment.scales[a:b], 0)


def _in_file(cloned: int, at: int, piece: torch.Tensor) -> int:
    """How many leading elements of a piece starting at element `at` of its section lie below `cloned`."""
    return min(max(cloned - at, 0), piece.numel())


def _put(optim: TensorFileWriter, name: str, first: int, piece: torch.Tensor, in_file: int = 0) -> None:
    """A piece starting at element `first` of tensor `name`: its first `in_file` elements are in the file already
    (cloned), the rest is written."""
    data = piece.contiguous().view(torch.uint8).numpy().data
    split = piece.element_size() * in_file
    if split:
        optim.put(name, piece.element_size() * first, data[:split], written=False)
    if split < len(data):
        optim.put(name, piece.element_size() * first + split, data[split:])


def write_stateful(tmp: str, stateful: Dict[str, Any], algorithm: str) -> Dict[str, Dict[str, Any]]:
    """Each given object's state_dict() (the LR scheduler's, the data stream's) into its file."""
    return {STATEFUL_FILES[kind]: write_pickle(os.path.join(tmp, STATEFUL_FILES[kind]), obj.state_dict(), algorithm)
            for kind, obj in stateful.items()}


def stateful_fields(stateful: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """The manifest's `scheduler` / `data` entries: the file, or null when not saved."""
    return {kind: file if kind in stateful else None for kind, file in STATEFUL_FILES.items()}


def write_pickle(path: str, obj: Any, algorithm: str) -> Dict[str, Any]:
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
