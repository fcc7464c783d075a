"""`export_pretrained(engine, directory)`: the trained weights as Hugging Face-style safetensors shards.

What `transformers`' `save_pretrained` writes, so `AutoModel.from_pretrained(directory)` (and any tool that
reads that layout) loads it: `model.safetensors` when everything fits one shard, else
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json` (`{"metadata": {"total_size",
"total_parameters"}, "weight_map": {name: file}}`); and `config.json` when the module is a
`PreTrainedModel`. Each tensor is in the dtype it has in the engine (bf16 weights stay bf16, fp32 norms
fp32), named as in `module.state_dict()`; tied weights are stored once (under the name Hugging Face keeps:
not a `_tied_weights_keys` target, else the first), persistent buffers are included. See docs/design.md,
[Note: exporting for from_pretrained].

Streamed: the shard plan is made from names, dtypes and shapes before any data is read; then one flat
group at a time is read (`engine.group_weights`: device, host mirror or swap file) and its tensors are
written at their places in their shard (`TensorFileWriter`, the writer of `model.safetensors`), so host
memory holds one group, never a whole shard or the model. Every shard is written under a temporary name
and fsynced; only when all are complete are they renamed into place, then the index is written (also
through a temporary name), then files of an earlier export that the new one does not use are removed. A
failure or a kill before the renames leaves the directory as it was (a killed export's temporary files are
removed by the next export into that directory).
"""

from __future__ import annotations

import copy
import errno
import glob
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from offload.checkpoint.atomic import fsync_dir
from offload.checkpoint.tensor_file import Entry, TensorFileWriter, dtype_code
from offload.checkpoint.writer import progress_bar
from offload.checksum import preferred_algorithm
from offload.errors import OffloadConfigError, OffloadIOError
from offload.policy import parse_bytes

if TYPE_CHECKING:
    from offload.checkpoint.target import CheckpointTarget

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TMP = ".tmp-"


def shard_name(index: int, count: int) -> str:
    """`model-00001-of-00003.safetensors` (1-based), or `model.safetensors` for a single shard."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclass
class _Shard:
    entries: List[Entry] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Plan:
    """Every tensor to write, in write order: group slots (flat group by flat group), then the other
    state-dict entries (buffers). `shard_of` gives each name's shard; shards are contiguous in write order."""

    groups: List[Tuple[Any, List[Tuple[str, Any]]]] = field(default_factory=list)  # (group, [(name, slot)])
    extra: List[Tuple[str, torch.Tensor]] = field(default_factory=list)  # buffers, unmanaged parameters
    shards: List[_Shard] = field(default_factory=list)
    shard_of: Dict[str, int] = field(default_factory=dict)
    total_parameters: int = 0
    dtype: Optional[torch.dtype] = None  # of the first floating-point parameter: config.json's `dtype`

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def file_of(self, name: str) -> str:
        return shard_name(self.shard_of[name], len(self.shards))


def export_pretrained(engine: "CheckpointTarget", directory: Union[str, "os.PathLike[str]"],
                      max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                      progress: Optional[bool] = None) -> str:
    """Write the engine's current weights into `directory`; returns its absolute path. See
    `Engine.save_pretrained`. File errors raise OffloadIOError; the directory then holds what it held before,
    unless the error came after the shards were renamed into place (the index or the clean-up)."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    assert limit is not None
    directory = os.path.abspath(os.fspath(directory))
    reads = [0]  # groups whose weights were read (sharded weights: gathers the other ranks take part in)
    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise OffloadConfigError(f"save_pretrained needs a directory, but {directory!r} is a file")
        os.makedirs(directory, exist_ok=True)
        _export(engine, directory, limit, progress, reads)
    except BaseException as exc:
        if engine.weights_gathered:  # the other ranks gather every group: take part in the rest, then fail
            take_part_in_export(engine, max_shard_size, skip=reads[0])
        if isinstance(exc, OffloadIOError):
            raise explained_io_error(exc, directory) from None
        if isinstance(exc, OSError):
            raise explained_io_error(OffloadIOError.from_errno(exc.errno or errno.EIO, exc.filename or directory, 0, 0,
                                                       "export"), directory) from None
        raise
    return directory


def take_part_in_export(engine: "CheckpointTarget", max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                        skip: int = 0) -> None:
    """Sharded weights: rank 0's export reads each group's weights by a gather; take part in every one after the
    first `skip`, in its order (the same plan from the same module), writing nothing (the other ranks; rank 0
    itself after a failure, so that the others finish)."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    assert limit is not None
    plan = _plan(engine, list(engine.checkpoint_groups()), limit)
    for group in [group for group, pairs in plan.groups if pairs][skip:]:
        engine.group_weights(group)


def explained_io_error(exc: OffloadIOError, directory: str) -> OffloadIOError:
    return exc.if_disk_full(f"no space left while exporting to {directory!r}; files of an earlier export "
                            "there are intact and training state is unharmed: free space and export again")


def _kept_name(names: List[str], tied_targets: Any) -> str:
    """The one name a tied tensor is stored under: Hugging Face drops the names its `_tied_weights_keys`
    declare as tie targets (from_pretrained ties them back to their source), so keep the first other one."""
    for name in names:
        if name not in tied_targets:
            return name
    return names[0]


def _plan(engine: "CheckpointTarget", groups: list, limit: int) -> _Plan:
    module = engine.module
    tied_targets = getattr(module, "all_tied_weights_keys", None) or {}  # transformers >= 5: {target: source}
    ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    names: Dict[int, List[str]] = {}
    values: Dict[int, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():  # the caller allows the engine's reads
        if name in ignored:
            continue
        if not isinstance(value, torch.Tensor):
            raise OffloadConfigError(f"save_pretrained: state_dict entry {name!r} is a {type(value).__name__}, "
                                     "not a tensor; safetensors holds tensors only")
        names.setdefault(id(value), []).append(name)
        values[id(value)] = value
    plan = _Plan()
    managed = set()
    params = {id(p) for p in module.parameters()}
    order: List[Entry] = []
    for _block, group, _state in groups:
        pairs = []
        for slot in group.slots:
            managed.add(id(slot.param))
            if id(slot.param) not in names:  # every alias is ignored on save
                continue
            name = _kept_name(names[id(slot.param)], tied_targets)
            pairs.append((name, slot))
            order.append(Entry(name, group.dtype, tuple(slot.shape)))
            plan.total_parameters += slot.numel
            if plan.dtype is None and group.dtype.is_floating_point:
                plan.dtype = group.dtype
        plan.groups.append((group, pairs))
    for key, value in values.items():
        if key in managed:
            continue
        name = _kept_name(names[key], tied_targets)
        plan.extra.append((name, value))
        order.append(Entry(name, value.dtype, tuple(value.shape)))
        if key in params:
            plan.total_parameters += value.numel()
    for entry in order:
        try:
            dtype_code(entry.dtype)
        except KeyError:
            raise OffloadConfigError(f"save_pretrained: {entry.name!r} is {entry.dtype}, which this writer does not "
                                     "store (float32/16, bfloat16, float64, integers, bool)") from None
        # transformers' rule: a tensor over the limit gets a shard of its own; otherwise a shard is closed when
        # the next tensor would take it over the limit.
        if not plan.shards or (plan.shards[-1].entries and plan.shards[-1].nbytes + entry.nbytes > limit):
            plan.shards.append(_Shard())
        plan.shards[-1].entries.append(entry)
        plan.shards[-1].nbytes += entry.nbytes
        plan.shard_of[entry.name] = len(plan.shards) - 1
    if not plan.shards:
        plan.shards.append(_Shard())  # a model without tensors: an empty model.safetensors, as transformers
    return plan


class _ShardWriter:
    """Writes the shards one after another under temporary names: a shard is closed (fsynced) when the
    first tensor of the next one arrives. Tensors come in the plan's write order."""

    def __init__(self, directory: str, plan: _Plan, tag: str) -> None:
        self._directory, self._plan, self._tag = directory, plan, tag
        self._algorithm = preferred_algorithm()  # TensorFileWriter checksums each tensor; unused here
        self._current = -1
        self._writer: Optional[TensorFileWriter] = None
        self.temporary: List[Tuple[str, str]] = []  # (temporary path, final path) of every shard opened

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index = self._plan.shard_of[name]
        while self._current < index:
            self._open(self._current + 1)
        assert self._writer is not None
        self._writer.write(name, tensor)

    def _open(self, index: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        final = os.path.join(self._directory, shard_name(index, len(self._plan.shards)))
        path = os.path.join(self._directory, f".{os.path.basename(final)}{_TMP}{self._tag}")
        self.temporary.append((path, final))
        self._current = index
        self._writer = TensorFileWriter(path, self._plan.shards[index].entries, self._algorithm, {"format": "pt"})

    def close(self) -> None:
        while self._current < len(self._plan.shards) - 1:  # empty shards (a model without tensors)
            self._open(self._current + 1)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for path, _final in self.temporary:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _remove_leftovers(directory: str) -> None:
    """Temporary files of exports that were killed before their renames."""
    for pattern in (f".model*.safetensors{_TMP}*", f".{INDEX_FILE}{_TMP}*"):
        for leftover in glob.glob(os.path.join(glob.escape(directory), pattern)):
            try:
                os.unlink(leftover)
            except OSError:
                pass


def _export(engine: "CheckpointTarget", directory: str, limit: int, progress: Optional[bool], reads: List[int]) -> None:
    groups = list(engine.checkpoint_groups())  # waits for pending updates first
    plan = _plan(engine, groups, limit)
    _remove_leftovers(directory)
    tag = uuid.uuid4().hex[:8]
    shards = _ShardWriter(directory, plan, tag)
    desc = f"offload: exporting {os.path.basename(directory)}"
    with progress_bar(plan.total_size, progress, desc) as bar:
        try:
            for group, pairs in plan.groups:
                if not pairs:
                    continue
                flat = engine.group_weights(group)  # one group in host memory (a fresh copy when it was on disk)
                reads[0] += 1
                for name, slot in pairs:
                    shards.write(name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
                bar.update(group.nbytes)
                del flat
            for name, value in plan.extra:
                shards.write(name, value.detach())
                bar.update(value.numel() * value.element_size())
            shards.close()
        except BaseException:
            shards.abort()
            raise
    for path, final in shards.temporary:
        os.replace(path, final)
    finals = {os.path.basename(final) for _path, final in shards.temporary}
    if len(plan.shards) > 1:
        index = {"metadata": {"total_size": plan.total_size, "total_parameters": plan.total_parameters},
                 "weight_map": {name: plan.file_of(name) for name in sorted(plan.shard_of)}}
        _write_text(os.path.join(directory, INDEX_FILE), json.dumps(index, indent=2, sort_keys=True) + "\n", tag)
        finals.add(INDEX_FILE)
    for name in os.listdir(directory):  # an earlier export's files the new one does not use
        if name not in finals and (name in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(name)):
            os.unlink(os.path.join(directory, name))
    fsync_dir(directory)
    _write_config(engine.module, directory, plan.dtype)


def _write_text(path: str, text: str, tag: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{_TMP}{tag}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_config(module: torch.nn.Module, directory: str, dtype: Optional[torch.dtype]) -> None:
    """config.json of a Hugging Face model (`module.config.save_pretrained`), saying the weights' dtype and
    the model class as transformers' save_pretrained does, without changing the module's own config. A module
    without such a config leaves the directory's config.json (if any) alone."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    if dtype is not None and hasattr(config, "dtype"):
        config.dtype = str(dtype).replace("torch.", "")
    if hasattr(config, "architectures"):
        config.architectures = [type(module).__name__]
    config.save_pretrained(directory)


__all__ = ["export_pretrained", "shard_name", "DEFAULT_MAX_SHARD_SIZE"]
