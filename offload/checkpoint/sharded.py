"""Checkpoints of a data-parallel engine: every rank writes its part of the optimizer state into the one
checkpoint directory, committed atomically across the ranks, loadable at any world size.

Files: `model.safetensors` (rank 0; every rank holds the same weights: still a plain full-weights file),
`optimizer-<r>-of-<N>.safetensors` (rank r: for each parameter its elements [a, b) of `exp_avg/`, `exp_avg_sq/`
and `master/`, as 1-D tensors, the moments as the engine keeps them: fp32 or bf16 values, or int8 codes with
`exp_avg_scales/` and `exp_avg_sq_scales/`, the scales of the rank's blocks, which start at a: [Note: compressed
moments]; with fp32 weights that every rank holds whole, the masters come from
`model.safetensors` instead, checked as in a single file: [Note: master weights stored once]), `scheduler.pt` and `data.pt` (rank 0), `rng-<r>-of-<N>.pt` (each rank's own
generators, when asked), `manifest.json` last. The manifest's `optimizer_parts` records for each file the
range [a, b) of each parameter it holds, so `PartsReader` can serve any element range of any parameter to
an engine of any world size, and any range of its int8 scales, numbered across the parts in order (a
single-process checkpoint loads into N ranks through the plain reader: each rank reads its range of the whole
tensors).

Commit: rank 0 makes the temporary directory and tells the others its name (the directory must be on a file system
every node sees, at the same path: a rank that does not see it says so); each rank writes and fsyncs
its files; the ranks exchange their results; only when every rank's files are durable does rank 0 write
the manifest and switch the directory (atomic.py), and every rank returns once it is switched. A rank that
failed makes every rank raise, and the previous checkpoint stays.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import Tensor
from tqdm import tqdm

from offload.checkpoint import rng as rng_state
from offload.checkpoint.atomic import begin, fsync_dir, publish
from offload.checkpoint.manifest import MODEL_FILE, write_manifest
from offload.checkpoint.masters import FROM_WEIGHTS, MasterCheck
from offload.checkpoint.target import pieces
from offload.checkpoint.tensor_file import TensorFileReader, TensorFileWriter
from offload.checkpoint.writer import (
    SCALES_SUFFIX,
    checkpoint_layout,
    explained_io_error,
    manifest_fields,
    progress_bar,
    put_moments,
    state_entries,
    stateful_fields,
    weights_in_file_order,
    write_model_file,
    write_pickle,
    write_stateful,
)
from offload.checksum import preferred_algorithm
from offload.errors import OffloadIntegrityError, OffloadIOError
from offload.optim.moment_format import MomentFormat, code_nbytes, scale_count
from offload.tiers.swap_layout import STATE_TENSORS

if TYPE_CHECKING:
    from offload.checkpoint.target import CheckpointTarget
    from offload.distributed.data_parallel import DataParallel

Parts = Dict[str, List[int]]  # parameter name -> [a, b): the elements of it a file holds


def optimizer_file(rank: int, world: int) -> str:
    return f"optimizer-{rank:05d}-of-{world:05d}.safetensors"


def rng_file(rank: int, world: int) -> str:
    return f"rng-{rank:05d}-of-{world:05d}.pt"


def parts_of(groups: list) -> Parts:
    """The element range of each trainable parameter that this rank's state parts cover."""
    parts: Parts = {}
    for _block, group, state in groups:
        if state is None:
            continue
        lo, hi = state.part
        for slot in group.trainable_slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                parts[slot.name] = [a - slot.offset, b - slot.offset]
    return parts


def save_parts(engine: "CheckpointTarget", dp: "DataParallel", path: str, stateful: Dict[str, Any], rng: bool,
               progress: Optional[bool]) -> str:
    """engine.save() on every rank of a data-parallel engine (see the module docstring)."""
    path = os.path.abspath(os.fspath(path))
    groups = list(engine.checkpoint_groups())  # waits for this rank's pending updates
    algorithm = preferred_algorithm()
    tmp, error = None, None
    if dp.rank == 0:
        try:
            tmp = begin(path)
        except (OSError, OffloadIOError) as exc:
            error = _described(exc, path)
    tmp, error = dp.broadcast_object((tmp, error))  # type: ignore[misc]
    if error is not None:
        raise OffloadIOError(5, f"rank 0 could not start checkpoint {path!r}: {error}", path, 0, 0, "save")
    assert tmp is not None
    files: Dict[str, Dict[str, Any]] = {}
    mine = parts_of(groups)
    # masters from the weights where each rank can check its part against them: fp32 weights, not gathered
    derive = () if engine.weights_gathered else (FROM_WEIGHTS,)
    failed: Set[str] = set()
    try:
        layout = checkpoint_layout(engine, groups, derive=derive)
        total = sum(_bytes_per_element(state.state_store.moments) * (mine[slot.name][1] - mine[slot.name][0])
                    for _b, group, state in groups if state is not None
                    for slot in group.trainable_slots if slot.name in mine)
        if dp.rank == 0:
            total += sum(e.nbytes for e in layout.model_entries)
        with progress_bar(total, progress, f"offload: saving {os.path.basename(path)} (rank {dp.rank})") as bar:
            walk = weights_in_file_order(engine, groups, layout)
            if dp.rank == 0:
                try:
                    files.update(write_stateful(tmp, stateful, algorithm))  # one scheduler, one data position
                    files[MODEL_FILE] = write_model_file(engine, groups, layout, os.path.join(tmp, MODEL_FILE),
                                                       algorithm, bar, walk)
                except BaseException:
                    if engine.weights_gathered:  # the other ranks gather to the walk's end: take part, then fail
                        for _ in walk:
                            pass
                    raise
            elif engine.weights_gathered:  # rank 0's reads of the weights are gathers: take part in each
                for _ in walk:
                    pass
            if rng:
                name = rng_file(dp.rank, dp.world)
                files[name] = write_pickle(os.path.join(tmp, name), rng_state.capture(), algorithm)
            name = optimizer_file(dp.rank, dp.world)
            files[name], failed = _write_part_file(engine, groups, layout, mine, os.path.join(tmp, name), algorithm,
                                                   bar)
            if failed:  # masters the weights do not give back (rare): this rank's file again, with them in full
                retry = checkpoint_layout(engine, groups, stored_masters=failed, derive=derive)
                files[name], again = _write_part_file(engine, groups, retry, mine, os.path.join(tmp, name),
                                                      algorithm, bar)
                assert not again, f"masters {sorted(again)[:3]} changed during the save"
    except (OSError, OffloadIOError) as exc:
        error = _described(exc, path)
        if dp.rank != 0 and not os.path.isdir(tmp):
            error += (f" (rank 0 made {tmp!r}, which this rank does not see: the checkpoint directory must be on a "
                      "file system every node sees, at the same path on each)")
    results = cast(List[Tuple[Optional[str], Dict[str, Any], Parts, Set[str]]],
                   dp.all_gather_object((error, files, mine, failed)))
    errors = [(rank, err) for rank, (err, _f, _m, _s) in enumerate(results) if err is not None]
    committed: Optional[str] = None
    if not errors and dp.rank == 0:
        try:
            every: Dict[str, Dict[str, Any]] = {}
            for _err, theirs, _m, _s in results:
                every.update(theirs)
            stored = set().union(*(s for _e, _f, _m, s in results))  # any rank's failed masters are stored
            layout = checkpoint_layout(engine, groups, stored_masters=stored, derive=derive)
            _write_manifest(engine, tmp, layout, algorithm, every, dp.world,
                            [m for _e, _f, m, _s in results], stateful, rng)
            fsync_dir(tmp)
            publish(tmp, path)
            committed = path
        except (OSError, OffloadIOError) as exc:
            errors = [(0, _described(exc, path))]
    if dp.rank == 0 and committed is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    outcome = dp.broadcast_object(errors)
    if outcome:
        rank, err = outcome[0]  # type: ignore[index]
        raise explained_io_error(OffloadIOError(5, f"rank {rank} could not write its part of checkpoint {path!r}: "
                                           f"{err}; nothing was switched", path, 0, 0, "save"), path)
    return path


def _described(exc: BaseException, path: str) -> str:
    return str(exc) or f"{type(exc).__name__} while saving {path!r}"


def _write_part_file(engine: "CheckpointTarget", groups: list, layout: Any, mine: Parts, path: str, algorithm: str,
                     bar: tqdm) -> Tuple[Dict[str, Any], Set[str]]:
    """This rank's parts of each state section, per parameter, streamed chunk by chunk from its stores, the
    moments as they are kept; the masters `layout` derives are checked against the (local) weights instead.
    Returns the file's entry and the parameters whose masters failed that check (the file then lacks them: the
    caller writes it again)."""
    entries = [entry for _block, group, state in groups if state is not None for kind in STATE_TENSORS
               for entry in state_entries(kind, group, state.state_store.moments, layout.masters, mine)]
    writer = TensorFileWriter(path, entries, algorithm, {"format": "pt"})
    failed: Set[str] = set()

    def put(name: str, first: int, data: Tensor, in_file: int = 0) -> None:
        assert not in_file, "a rank's part is written, never cloned"
        writer.put(name, data.element_size() * first, data.contiguous().view(torch.uint8).numpy().data)

    try:
        for _block, group, state in groups:
            if state is None:
                continue
            derived = any(slot.name in layout.masters for slot in group.trainable_slots)
            check = MasterCheck(layout.masters, engine.group_weights(group) if derived else None, put, failed)
            store = state.state_store
            with store.reading(encoded=store.moments is not MomentFormat.FP32) as chunks:
                for start, stop, (master, exp_avg, exp_avg_sq) in chunks:
                    for index, first, lo, piece in pieces(group, start, stop, master):
                        slot = group.trainable_slots[index]
                        check.piece(slot.name, slot.numel, first, lo, piece, stored_from=mine[slot.name][0])
                    put_moments(put, group, state, start, stop, exp_avg, exp_avg_sq, stored_from=mine)
                    bar.update(_bytes_per_element(store.moments) * (stop - start))
        if failed:
            writer.abort()
        else:
            writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"size": os.path.getsize(path), "checksums": writer.checksums}, failed


def _bytes_per_element(moments: MomentFormat) -> int:
    """A rank file's bytes per element of state, for the progress bar: the master and two moments."""
    return 4 + 2 * code_nbytes(moments, 1)


def _write_manifest(engine: "CheckpointTarget", tmp: str, layout: Any, algorithm: str,
                    files: Dict[str, Dict[str, Any]], world: int, parts: Sequence[Parts], stateful: Dict[str, Any],
                    rng: bool) -> None:
    write_manifest(tmp, dict(
        manifest_fields(engine, layout, algorithm, files, parts=True), world_size=world,
        optimizer_parts=[{"file": optimizer_file(r, world), "parts": parts[r]} for r in range(world)],
        **stateful_fields(stateful),
        rng=[rng_file(r, world) for r in range(world)] if rng else None,
    ))


class PartsReader:
    """The optimizer state of a checkpoint saved by several ranks, read like one file: any element range of
    any `<kind>/<name>` tensor, from whichever rank files hold it."""

    def __init__(self, directory: str, manifest: Dict[str, Any], blocks: Dict[str, str]) -> None:
        self._readers: List[TensorFileReader] = []
        self._parts: Dict[str, List[Tuple[TensorFileReader, int, int]]] = {}  # param -> (file, a, b), by a
        try:
            for record in manifest["optimizer_parts"]:
                info = manifest["files"].get(record["file"])
                if info is None:
                    raise OffloadIntegrityError(f"the manifest of {directory!r} lists no {record['file']}", directory)
                reader = TensorFileReader(os.path.join(directory, record["file"]), info["checksums"],
                                          manifest["checksum"], blocks)
                self._readers.append(reader)
                for name, (a, b) in record["parts"].items():
                    self._parts.setdefault(name, []).append((reader, a, b))
        except BaseException:
            self.close()
            raise
        for parts in self._parts.values():
            parts.sort(key=lambda piece: piece[1])

    def segments(self, param: str) -> List[Tuple[int, int]]:
        """The element ranges [a, b) of `param` the files hold, in order: where each part's int8 blocks start."""
        return [(a, b) for _reader, a, b in self._parts.get(param, [])]

    def dtype_of(self, name: str) -> Optional[torch.dtype]:
        """The dtype `<kind>/<name>` is stored in (None: no file holds it)."""
        _kind, param = name.split("/", 1)
        for reader, _a, _b in self._parts.get(param, []):
            return reader.dtype_of(name)
        return None

    def _ranges(self, name: str) -> List[Tuple[TensorFileReader, int, int]]:
        """(file, first, stop) of each part of tensor `name`, in its elements: the parameter's for values and codes;
        for int8 scales (`<kind>_scales/`), the parts' blocks numbered across the parts in order."""
        kind, param = name.split("/", 1)
        parts = self._parts.get(param, [])
        if not kind.endswith(SCALES_SUFFIX):
            return parts
        out, first = [], 0
        for reader, a, b in parts:
            count = scale_count(MomentFormat.INT8, b - a)
            out.append((reader, first, first + count))
            first += count
        return out

    def require(self, name: str, numel: int, dtype: Optional[torch.dtype] = None) -> None:
        """The rank files together hold all `numel` elements of `name`, each part with its size."""
        covered = 0
        for reader, a, b in self._ranges(name):
            if a != covered:
                break
            reader.require(name, b - a, dtype)
            covered = b
        if covered != numel:
            raise OffloadIntegrityError(
                f"the optimizer files of this checkpoint hold {covered} of the {numel} elements of {name!r} "
                "(a rank's file is missing, or the checkpoint belongs to another model)",
                self._readers[0].path if self._readers else "")

    def read_at(self, name: str, start: int, out: Tensor) -> None:
        """Bytes [start, ...) of tensor `name` into `out` (of the stored dtype), from the files holding them."""
        size = out.element_size()
        first, stop = start // size, start // size + out.numel()
        for reader, a, b in self._ranges(name):
            lo, hi = max(first, a), min(stop, b)
            if lo < hi:
                reader.read_at(name, size * (lo - a), out[lo - first:hi - first])

    def verify_all(self, scratch: memoryview, progress: Any = lambda n: None) -> None:
        for reader in self._readers:
            reader.verify_all(scratch, progress)

    def span(self, names: Sequence[str]) -> Optional[Tuple[int, int]]:
        return None  # parts are never cloned copy-on-write

    def close(self) -> None:
        for reader in self._readers:
            reader.close()

    def __enter__(self) -> "PartsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
