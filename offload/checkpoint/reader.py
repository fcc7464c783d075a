"""`load_checkpoint(engine, path)`: stream a checkpoint into an engine of any tier, transactionally.

Keyed by parameter names, so the saving engine's tier, block grouping and compute dtype do not matter
(weights of another dtype are cast). Two streamed passes: the first changes nothing; it checks that every
tensor the engine needs is there with its size (names and shapes against the manifest before that), and
reads every tensor of both files through one small buffer to check its checksum, so a damaged checkpoint
raises OffloadIntegrityError naming the file, tensor and block and leaves the engine exactly as it was.
The second pass loads: one flat group's weights at a time, and its optimizer state chunk by chunk (for the
nvme tier through two slots of the engine's own staging ring), checking checksums again; only an I/O error
or a file changed between the passes can fail there, and that error says the engine is partly loaded. Master
weights the optimizer files leave out (version 3, the manifest's `masters`) come from the weights file:
[Note: master weights stored once].
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from offload.checkpoint import rng as rng_state
from offload.checkpoint.atomic import resolve
from offload.checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, read_manifest
from offload.checkpoint.masters import FROM_BF16, FROM_WEIGHTS, join_bf16, low_key, tie_bytes, tie_key, unpack_bits
from offload.checkpoint.reflink import BLOCK, clone_range
from offload.checkpoint.sharded import PartsReader
from offload.checkpoint.target import pieces
from offload.checkpoint.tensor_file import TensorFileReader
from offload.checkpoint.writer import STORED_DTYPE, optimizer_key, progress_bar, scales_key
from offload.checksum import checksum
from offload.errors import OffloadConfigError, OffloadIntegrityError, OffloadIOError
from offload.optim.moment_format import (
    EXP_AVG,
    EXP_AVG_SQ,
    BlockLayout,
    MomentFormat,
    QuantizedMoment,
)
from offload.optim.moments import decode_moment
from offload.scheduler.state.state_store import Views, moment_blocks
from offload.tiers.swap_layout import STATE_TENSORS

if TYPE_CHECKING:
    from offload.checkpoint.target import CheckpointTarget

OptimizerReader = Union[TensorFileReader, PartsReader]  # one file, or the parts several ranks saved
VERIFY_BYTES = 16 << 20  # the first pass reads through one buffer of this size (two halves), whatever the size


def load_checkpoint(engine: "CheckpointTarget", path: str, *, stateful: Optional[Dict[str, Any]] = None,
                    rng: bool = False, progress: Optional[bool] = None) -> Dict[str, Any]:
    """Load into `engine`; returns the manifest. See `Engine.load`."""
    directory = resolve(path)
    manifest = read_manifest(directory)
    algorithm = manifest["checksum"]
    block_of = manifest.get("block_of", {})
    steps = {p["name"]: p["steps"] for b in manifest["blocks"] for g in b["groups"] for p in g["params"]}
    groups = list(engine.checkpoint_groups())
    _check_compatible(groups, manifest, directory)
    _check_param_groups(engine, manifest, directory)
    _warn_if_moments_convert(engine, manifest, directory)
    parts = manifest.get("optimizer_parts")  # saved by several data-parallel ranks (sharded.py)
    for name in (MODEL_FILE,) if parts else (MODEL_FILE, OPTIMIZER_FILE):
        if name not in manifest["files"]:
            raise OffloadIntegrityError(f"the manifest of {directory!r} lists no {name}", directory)
    stateful = stateful or {}
    extras = {}
    for kind in list(stateful) + (["rng"] if rng else []):
        if not manifest.get(kind):
            raise OffloadConfigError(f"checkpoint {directory!r} was saved without {kind} state; save with "
                                     f"{kind}={'True' if kind == 'rng' else kind}, or load without it")
        file = manifest[kind] if kind != "rng" else _rng_file_of(engine, manifest, directory)
        extras[kind] = _read_pickle(os.path.join(directory, file), manifest["files"][file], algorithm)
    # The data position first, so a stream that refuses it (other files) fails before any change; put back
    # if the load then fails, so a failed load leaves the stream, like the engine, as it was.
    with _applied_first(stateful.get("data"), extras.get("data")):
        model_info = manifest["files"][MODEL_FILE]
        optim_files = [p["file"] for p in parts] if parts else [OPTIMIZER_FILE]
        total = model_info["size"] + sum(manifest["files"].get(f, {"size": 0})["size"] for f in optim_files)
        optim_reader = (PartsReader(directory, manifest, block_of) if parts else
                        TensorFileReader(os.path.join(directory, OPTIMIZER_FILE),
                                         manifest["files"][OPTIMIZER_FILE]["checksums"], algorithm, block_of))
        model_path = os.path.join(directory, MODEL_FILE)
        with TensorFileReader(model_path, model_info["checksums"], algorithm, block_of) as weights, \
                optim_reader as optim, \
                progress_bar(2 * total, progress, f"offload: loading {os.path.basename(directory)}") as bar:
            masters = Masters(manifest.get("masters", {}), weights, optim)
            # Pass 1 changes nothing: every tensor is found, sized and checksummed before the engine is touched.
            _check_entries(engine, groups, weights, optim, masters)
            scratch = memoryview(bytearray(VERIFY_BYTES))
            weights.verify_all(scratch, bar.update)
            optim.verify_all(scratch, bar.update)
            del scratch
            engine.prepare_for_load()
            try:  # pass 2: the files were intact a moment ago; only an I/O error or a concurrent change fails here
                _load_tensors(engine, groups, weights, optim, masters, steps, bar)
            except (OffloadIntegrityError, OffloadIOError) as exc:
                partly = type(exc)(*_partly_loaded(exc))
                engine.mark_inconsistent(partly)
                raise partly from None
            except BaseException as exc:
                engine.mark_inconsistent(exc)
                raise
            bar.update(max(0, bar.total - bar.n))
        for group_now, saved in _paired_groups(engine, manifest):
            group_now.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()
                              if k != "param_names"})
        engine.restore_counters({"steps": manifest["step"], "skipped_steps": manifest.get("skipped_steps", 0)})
        if "scheduler" in extras:
            stateful["scheduler"].load_state_dict(extras["scheduler"])
        if "rng" in extras:
            rng_state.restore(extras["rng"])
    return manifest


def master_weights(path: str) -> Dict[str, Tensor]:
    """Every trainable parameter's fp32 master weights in a checkpoint, by name, whichever way it keeps them
    (a version 3 optimizer file may leave them to the weights file: [Note: master weights stored once]), each
    tensor's checksum verified. Holds them all in memory: for inspection and tests, not for a large model."""
    directory = resolve(path)
    manifest = read_manifest(directory)
    algorithm, block_of = manifest["checksum"], manifest.get("block_of", {})
    shapes = {p["name"]: p["shape"] for b in manifest["blocks"] for g in b["groups"] for p in g["params"]
              if p["trainable"]}
    model_info = manifest["files"][MODEL_FILE]
    optim_reader = (PartsReader(directory, manifest, block_of) if manifest.get("optimizer_parts") else
                    TensorFileReader(os.path.join(directory, OPTIMIZER_FILE),
                                     manifest["files"][OPTIMIZER_FILE]["checksums"], algorithm, block_of))
    out = {}
    with TensorFileReader(os.path.join(directory, MODEL_FILE), model_info["checksums"], algorithm, block_of) as weights, \
            optim_reader as optim:
        masters = Masters(manifest.get("masters", {}), weights, optim)
        for name, shape in shapes.items():
            out[name] = torch.empty(shape, dtype=torch.float32)
            masters.require(name, out[name].numel())
            masters.read(name, 0, out[name].view(-1))
    return out


@contextlib.contextmanager
def _applied_first(stream: Any, state: Any) -> Iterator[None]:
    """Load `state` into `stream` now; restore the stream's own state if the block then raises."""
    if stream is None or state is None:
        yield
        return
    before = stream.state_dict()
    stream.load_state_dict(state)
    try:
        yield
    except BaseException:
        stream.load_state_dict(before)
        raise


def _rng_file_of(engine: "CheckpointTarget", manifest: Dict[str, Any], directory: str) -> str:
    """This process's generator states: one file, or (saved by several ranks) this rank's of as many."""
    saved = manifest["rng"]
    dp = getattr(engine, "data_parallel", None)
    rank, world = (0, 1) if dp is None else (dp.rank, dp.world)
    files = [saved] if isinstance(saved, str) else list(saved)
    if len(files) != world:
        raise OffloadConfigError(
            f"checkpoint {directory!r} holds the random generator states of {len(files)} processes, but "
            f"{world} load it: each process's generators cannot be restored; load with rng=False (weights, "
            "optimizer state and scheduler still resume exactly)")
    return files[rank]


def _partly_loaded(exc: Union[OffloadIntegrityError, OffloadIOError]) -> tuple:
    """The error's arguments, its message saying the engine is now partly loaded (the checkpoint had been
    verified, so the file changed or failed to read during the load)."""
    note = ("; this happened after the checkpoint was verified, while loading it (the file changed or could "
            "not be read): the engine now holds a partly loaded state, load an intact checkpoint before "
            "training on")
    if isinstance(exc, OffloadIOError):
        return (exc.errno, f"{os.strerror(exc.errno) if exc.errno else 'I/O error'}{note}", exc.path, exc.offset,
                exc.size, exc.op)
    return (f"{exc}{note}", exc.path)


class Masters:
    """Where each master weight of a checkpoint is read from ([Note: master weights stored once]): `master/<name>`
    of the optimizer files, or (version 3, the manifest's `masters`) the fp32 weight, or the bf16 weight with the
    optimizer file's low halves and tie bits."""

    def __init__(self, schemes: Dict[str, str], weights: TensorFileReader, optim: "OptimizerReader") -> None:
        unknown = sorted({s for s in schemes.values() if s not in (FROM_WEIGHTS, FROM_BF16)})
        if unknown:
            raise OffloadIntegrityError(f"the manifest's masters come from {unknown[0]!r}, which this offload does "
                                        "not know: upgrade offload", weights.path)
        self._schemes = schemes
        self._weights = weights
        self._optim = optim

    def require(self, name: str, numel: int) -> None:
        """The tensors parameter `name`'s master is read from exist with their sizes (pass 1)."""
        scheme = self._schemes.get(name)
        if scheme is None:
            self._optim.require(optimizer_key("master", name), numel, torch.float32)
        elif scheme == FROM_WEIGHTS:
            self._weights.require(name, numel, torch.float32)
        else:
            self._weights.require(name, numel, torch.bfloat16)
            self._optim.require(low_key(name), numel, torch.int16)
            self._optim.require(tie_key(name), tie_bytes(numel), torch.uint8)

    def stored(self, names: List[str]) -> bool:
        """Whether the optimizer files hold all these parameters' masters (so their section can be cloned)."""
        return not any(name in self._schemes for name in names)

    def read(self, name: str, first: int, out: Tensor) -> None:
        """Elements [first, first + len(out)) of parameter `name`'s fp32 master into `out`."""
        scheme = self._schemes.get(name)
        if scheme is None:
            self._optim.read_at(optimizer_key("master", name), 4 * first, out)
        elif scheme == FROM_WEIGHTS:
            self._weights.read_at(name, 4 * first, out)
        else:
            n = out.numel()
            weights, low = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
            self._weights.read_at(name, 2 * first, weights)
            self._optim.read_at(low_key(name), 2 * first, low)
            packed = torch.empty(tie_bytes(first % 8 + n), dtype=torch.uint8)
            self._optim.read_at(tie_key(name), first // 8, packed)
            out.copy_(join_bf16(weights, low, unpack_bits(packed, first % 8, n)))


def _check_entries(engine: "CheckpointTarget", groups: List[Any], weights: TensorFileReader,
                   optim: "OptimizerReader", masters: Masters) -> None:
    """Every tensor the load will read exists with the size it needs (weights may be of another dtype)."""
    for _block, group, state in groups:
        for slot in group.slots:
            weights.require(slot.name, slot.numel)
        if state is not None:
            for slot in group.trainable_slots:
                masters.require(slot.name, slot.numel)
            for kind in STATE_TENSORS[1:]:
                for slot in group.trainable_slots:
                    name = optimizer_key(kind, slot.name)
                    dtype = _stored_dtype(optim, name)
                    if dtype not in _STORED_FORMATS:
                        raise OffloadIntegrityError(f"tensor {name!r} of the optimizer state is {dtype}: not a "
                                                    "moment format offload stores (fp32, bf16, int8 codes)", name)
                    optim.require(name, slot.numel, dtype)
                    if dtype == torch.uint8:
                        optim.require(scales_key(kind, slot.name), _stored_blocks(optim, slot).scale_count,
                                      torch.float32)
    stored = {s.name for _b, g, _s in groups for s in g.slots}
    for name, buffer in engine.module.named_buffers():
        if name in weights.entries and name not in stored:
            weights.require(name, buffer.numel())


def _load_tensors(engine: "CheckpointTarget", groups: List[Any], weights: TensorFileReader, optim: "OptimizerReader",
                  masters: Masters, steps: Dict[str, int], bar: Any) -> None:
    clone_state = {"try": True}
    for _block, group, state in groups:
        flat = torch.empty(group.numel, dtype=group.dtype)
        for slot in group.slots:
            _read_cast(weights, slot.name, flat[slot.offset:slot.offset + slot.numel])
        engine.set_group_weights(group, flat)
        del flat
        bar.update(group.nbytes)
        if state is None:
            continue
        _load_record(optim, masters, group, state, clone_state)
        state.restore_steps([steps[slot.name] for slot in group.trainable_slots])
        bar.update(12 * group.trainable_numel)
    stored = {s.name for _b, g, _s in groups for s in g.slots}
    for name, buffer in engine.module.named_buffers():
        if name in weights.entries and name not in stored:
            host = torch.empty(buffer.shape, dtype=buffer.dtype)
            _read_cast(weights, name, host.reshape(-1))
            with torch.no_grad():
                buffer.copy_(host)


# how a checkpoint stores a moment, by its entries' dtype ([Note: compressed moments]): fp32 values (every checkpoint
# of fp32 moments, and those saved before compressed moments were stored as they are), bf16 values, int8 codes
_STORED_FORMATS = {dtype: fmt for fmt, dtype in STORED_DTYPE.items()}


def _stored_dtype(optim: "OptimizerReader", name: str) -> torch.dtype:
    dtype = optim.dtype_of(name)
    return torch.float32 if dtype is None else dtype  # missing: `require` says so


def _stored_segments(optim: "OptimizerReader", slot: Any) -> List[Tuple[int, int]]:
    """The ranges of a parameter its optimizer files hold one each: the whole in a single file, each rank's part in
    the files of data-parallel ranks. Stored int8 blocks start at each range's first element."""
    return optim.segments(slot.name) if isinstance(optim, PartsReader) else [(0, slot.numel)]


def _stored_blocks(optim: "OptimizerReader", slot: Any) -> BlockLayout:
    """The int8 blocks of a parameter's stored moments (the scales numbered across its ranges in order)."""
    return BlockLayout.of_segments(slot.numel, _stored_segments(optim, slot))


def _same_blocks(optim: "OptimizerReader", group: Any, state: Any) -> bool:
    """Whether this engine's int8 blocks of each parameter (in its part of the group, on a data-parallel rank) are
    the stored ones: then codes and scales load as they are."""
    lo, hi = state.part
    for slot in group.trainable_slots:
        a, b = max(lo, slot.offset) - slot.offset, min(hi, slot.offset + slot.numel) - slot.offset
        if a < b and (a, b) not in _stored_segments(optim, slot):
            return False
    return True


def _stored_moments(optim: "OptimizerReader", group: Any) -> MomentFormat:
    """The format a group's moments are stored in (one for the whole group: a save writes them so)."""
    found = {_STORED_FORMATS.get(_stored_dtype(optim, optimizer_key(kind, slot.name)))
             for kind in ("exp_avg", "exp_avg_sq") for slot in group.trainable_slots}
    if len(found) != 1 or None in found:
        raise OffloadIntegrityError(f"the moments of block {group.key!r} are stored in several formats ({found})",
                                    group.key)
    return found.pop()  # type: ignore[return-value]


def _load_record(optim: "OptimizerReader", masters: Masters, group: Any, state: Any,
                 clone_state: Dict[str, bool]) -> None:
    """One group's optimizer state, chunk by chunk; moments stored as codes or bf16 values in an engine that keeps
    them the same way, with the same blocks, are copied as they are (`_load_encoded`), others decoded to fp32.
    Into the nvme tier each section's block-aligned part is first cloned from the checkpoint when it holds the
    state as the record keeps it (`_clone_sections`); every chunk is still read, for its checksums and the swap
    file's seals, and only the part no clone covered is written."""
    names = [[optimizer_key(kind, slot.name) for slot in group.trainable_slots] for kind in STATE_TENSORS]
    stored = _stored_moments(optim, group)
    store = state.state_store
    if stored is not MomentFormat.FP32:
        if stored is store.moments and (stored is MomentFormat.BF16 or _same_blocks(optim, group, state)):
            _load_encoded(optim, masters, group, state, _clone_sections(optim, masters, group, store, clone_state))
            return
        if stored is store.moments:  # the same format, other blocks: saved by another number of ranks
            warnings.warn(f"offload: the int8 moments of block {group.key!r} are stored in other quantization blocks "
                          "than this engine's (their blocks start at each parameter's part on a data-parallel rank, "
                          "and this checkpoint was saved by another number of ranks): they are decoded and encoded "
                          "again in this engine's blocks (rounded)", RuntimeWarning, stacklevel=5)
        _load_decoded(optim, masters, group, state, stored)
        return
    encodes = store.moments is not MomentFormat.FP32  # fp32 values into compressed moments: nothing to clone
    cloned = (0, 0, 0) if encodes else _clone_sections(optim, masters, group, store, clone_state)

    def fill(start: int, stop: int, views: Views) -> None:
        _read_masters(masters, group, start, stop, views[0])
        for index, view in enumerate(views[1:], start=1):
            for slot, first, _lo, piece in pieces(group, start, stop, view):
                optim.read_at(names[index][slot], 4 * first, piece)

    state.state_store.write(fill, cloned)


def _clone_sections(optim: "OptimizerReader", masters: Masters, group: Any, store: Any,
                    clone_state: Dict[str, bool]) -> Tuple[int, int, int]:
    """Into the nvme tier, from a checkpoint stored as the record keeps its state: each section's block-aligned
    part (masters, each moment's values or codes) cloned copy-on-write from the file (same file system, each
    section starting on a block in both). Returns the leading elements of each section cloned; the store writes
    the rest and seals all of it."""
    if not clone_state["try"] or not isinstance(optim, TensorFileReader):  # ranks' parts are read, never cloned
        return (0, 0, 0)
    target = store.swap_sections()
    if target is None:  # a memory store
        return (0, 0, 0)
    cloned = [0, 0, 0]
    for index, offset in enumerate(target.offsets):
        if index == 0 and not masters.stored([slot.name for slot in group.trainable_slots]):
            continue  # masters from the weights file: written, not cloned
        nbytes = target.nbytes[index]
        aligned = nbytes // BLOCK * BLOCK
        span = optim.span([optimizer_key(STATE_TENSORS[index], slot.name) for slot in group.trainable_slots])
        if aligned and (span is None or span[1] != nbytes
                        or not clone_range(optim.fileno(), span[0], aligned, target.fd, offset)):
            clone_state["try"] = False  # a file system that cannot clone one section cannot clone the next
            break
        cloned[index] = aligned // target.itemsizes[index]
    return cloned[0], cloned[1], cloned[2]


def _read_masters(masters: Masters, group: Any, start: int, stop: int, master: Tensor) -> None:
    for slot, first, _lo, piece in pieces(group, start, stop, master):
        masters.read(group.trainable_slots[slot].name, first, piece)


def _load_encoded(optim: "OptimizerReader", masters: Masters, group: Any, state: Any,
                  cloned: Tuple[int, int, int]) -> None:
    """bf16 values or int8 codes and scales into a store that keeps them the same way, in the same blocks: copied,
    nothing rounded (`cloned`: what `_clone_sections` put in the swap file already; every byte is still read, for
    the checkpoint's checksums and the swap file's seals)."""
    lo = state.part[0]
    layout = moment_blocks(state.state_store.moments, state.state_store.group)
    stored = {slot.name: _stored_blocks(optim, slot) for slot in group.trainable_slots} if layout is not None else {}

    def fill(start: int, stop: int, views: Any) -> None:
        master, exp_avg, exp_avg_sq = views
        _read_masters(masters, group, start, stop, master)
        blocks = layout.sub(start - lo, stop - lo) if layout is not None else None
        for kind, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            codes = moment.codes if isinstance(moment, QuantizedMoment) else moment
            for index, first, at, piece in pieces(group, start, stop, codes):
                slot = group.trainable_slots[index]
                optim.read_at(optimizer_key(kind, slot.name), piece.element_size() * first, piece)
                if isinstance(moment, QuantizedMoment):
                    assert blocks is not None
                    a, b = blocks.scales_before(at - start), blocks.scales_before(at - start + piece.numel())
                    scale = stored[slot.name].scales_before(first)
                    optim.read_at(scales_key(kind, slot.name), 4 * scale, moment.scales[a:b])

    state.state_store.write(fill, cloned, encoded=True)


def _load_decoded(optim: "OptimizerReader", masters: Masters, group: Any, state: Any, stored: MomentFormat) -> None:
    """bf16 values or int8 codes into a store of another format or other blocks: each piece decoded to fp32 (int8:
    from the start of its first block), which the store encodes in its own format."""

    def fill(start: int, stop: int, views: Views) -> None:
        master, exp_avg, exp_avg_sq = views
        _read_masters(masters, group, start, stop, master)
        for kind, which, view in (("exp_avg", EXP_AVG, exp_avg), ("exp_avg_sq", EXP_AVG_SQ, exp_avg_sq)):
            for slot, first, _lo, piece in pieces(group, start, stop, view):
                _read_decoded(optim, kind, which, group.trainable_slots[slot], first, piece, stored)

    state.state_store.write(fill)


def _read_decoded(optim: "OptimizerReader", kind: str, which: int, slot: Any, first: int, out: Tensor,
                  stored: MomentFormat) -> None:
    """Elements [first, first + len(out)) of a parameter's stored moment, decoded to fp32 into `out`."""
    name = optimizer_key(kind, slot.name)
    if stored is MomentFormat.BF16:
        staged = torch.empty(out.numel(), dtype=torch.bfloat16)
        optim.read_at(name, 2 * first, staged)
        out.copy_(staged)
        return
    layout = _stored_blocks(optim, slot)
    end = first + out.numel()
    begin, _ = layout.enclosing(first, end)
    blocks = layout.sub(begin, end)
    codes = torch.empty(end - begin, dtype=torch.uint8)
    scales = torch.empty(blocks.scale_count, dtype=torch.float32)
    optim.read_at(name, begin, codes)
    optim.read_at(scales_key(kind, slot.name), 4 * layout.scales_before(begin), scales)
    values = torch.empty(end - begin, dtype=torch.float32)
    decode_moment(QuantizedMoment(codes, scales), stored, which, values, blocks)
    out.copy_(values[first - begin:])


def _read_cast(reader: TensorFileReader, name: str, out: Tensor) -> None:
    """Read `name` into `out`, casting when the checkpoint was saved with another compute dtype."""
    entry = reader.entries.get(name)
    if entry is not None and entry[0] != out.dtype:
        staged = torch.empty(out.shape, dtype=entry[0])
        reader.read_into(name, staged)
        out.copy_(staged)
    else:
        reader.read_into(name, out)


def _warn_if_moments_convert(engine: "CheckpointTarget", manifest: Dict[str, Any], directory: str) -> None:
    """A checkpoint saved with another `moments=` setting loads by converting its moments to this engine's
    format ([Note: compressed moments]): exact into fp32, rounded into bf16 or int8 (int8's decoded values are
    not all bf16 numbers, nor bf16's int8 codes)."""
    saved, mine = manifest.get("moments", "fp32"), engine.policy.moments.value
    if saved != mine:
        warnings.warn(f"offload: checkpoint {directory!r} was saved with moments={saved!r} and this engine keeps "
                      f"moments={mine!r}: the Adam moments are converted as they load"
                      + (" (exactly)" if mine == "fp32" else " (rounded to this engine's format)")
                      + f"; wrap with moments={saved!r} to resume in the saved format", RuntimeWarning, stacklevel=4)


Group = Dict[str, Any]


def _paired_groups(engine: "CheckpointTarget", manifest: Dict[str, Any]) -> List[Tuple[Group, Group]]:
    """(engine's group, saved group) in order. Where their numbers differ, groups without parameters are left
    out on both sides: OffloadTrainer left out the Trainer's empty weight-decay group before issue 33 (a LoRA
    model's, all of whose parameters decay) and keeps it now, as the plain Trainer's optimizer.pt has it."""
    saved, now = manifest["param_groups"], engine.optimizer.param_groups
    if len(saved) != len(now):
        saved = [g for g in saved if g.get("param_names", [None])]
        now = [g for g in now if g["params"]]
    return list(zip(now, saved)) if len(saved) == len(now) else []


def _check_param_groups(engine: "CheckpointTarget", manifest: Dict[str, Any], directory: str) -> None:
    """Each saved optimizer group's options go to the group holding the same parameters, or nowhere: a
    checkpoint of another grouping is refused before anything changes (torch.optim refuses it too)."""
    saved, now = manifest["param_groups"], engine.optimizer.param_groups
    paired = _paired_groups(engine, manifest)
    if paired:
        now, saved = [g for g, _s in paired], [s for _g, s in paired]
    if len(saved) != len(now):
        raise OffloadConfigError(
            f"checkpoint {directory!r} has {len(saved)} optimizer parameter groups but this engine has "
            f"{len(now)}: wrap the model with the same param_groups as the run that saved it")
    names = {id(p): name for name, p in engine.module.named_parameters()}
    for i, (group_saved, group_now) in enumerate(zip(saved, now)):
        if "param_names" not in group_saved:  # saved before groups were recorded: one group, checked above
            continue
        missing = sorted(set(group_saved["param_names"]) ^ {names[id(p)] for p in group_now["params"]})
        if missing:
            raise OffloadConfigError(
                f"optimizer parameter group {i} of checkpoint {directory!r} holds other parameters than this "
                f"engine's (first difference: {missing[0]!r}): wrap the model with the same param_groups")


def _check_compatible(groups: List[Any], manifest: Dict[str, Any], directory: str) -> None:
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
