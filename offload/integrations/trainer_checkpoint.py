"""The optimizer state of an `OffloadTrainer` checkpoint in the files the plain `transformers.Trainer` reads.

`checkpoint-N` holds what the plain Trainer's holds, so either trainer resumes the other's checkpoint exactly:
the weights (`model.safetensors` or shards, or a PEFT adapter: the mixin's `_save`), `optimizer.pt` (torch's
`AdamW.state_dict()`: per stepped parameter `step`, `exp_avg`, `exp_avg_sq`, fp32, from
`engine.optimizer.state_dict()`), `scheduler.pt`, and the Trainer's own `rng_state.pth`, `trainer_state.json`,
`training_args.bin`. `offload/` adds only what the engine has beyond them, in `offload/offload.json` (written
last) and, where the compute weights are not fp32, `offload/masters.pt`: the fp32 master weights by parameter
name (with fp32 compute the masters are the weights, and are not stored again). Nothing is stored twice. See
docs/design.md [Note: the Hugging Face Trainer].

Where `engine.optimizer.state_dict()` cannot be produced (8 bytes per trained parameter, 12 with masters: host
memory on the cpu and gpu tiers, free space beside the swap files on the nvme tier, where it is file-backed),
`offload/` is the engine's own checkpoint (`engine.save`, streamed group by group) and `optimizer.pt` a stub
whose `torch.load` raises, naming the reason: the plain Trainer fails loudly instead of restarting AdamW.
Checkpoints written before this layout (`offload/` an engine checkpoint, no `optimizer.pt`) load as before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from offload._system import mem_available
from offload.checkpoint.atomic import fsync_dir, publish
from offload.checkpoint.load_weights import Read
from offload.checkpoint.manifest import MANIFEST
from offload.checkpoint.weight_source import WeightSource
from offload.engine.engine import Engine
from offload.engine.torch_state import MASTER_KEY
from offload.errors import OffloadConfigError, OffloadIOError
from offload.policy import Tier

ENGINE_DIR = "offload"  # inside checkpoint-N: what the engine adds to the Trainer's files
RECORD_FILE = "offload.json"  # in ENGINE_DIR, written last
MASTERS_FILE = "masters.pt"  # in ENGINE_DIR: fp32 master weights where the compute weights are not fp32
OPTIMIZER_FILE = "optimizer.pt"  # transformers' OPTIMIZER_NAME
SCHEDULER_FILE = "scheduler.pt"  # transformers' SCHEDULER_NAME
FORMAT = "offload-trainer-checkpoint"
VERSION = 1
ROOM_MARGIN = 1 << 30  # left free beside the exported state: the process goes on training meanwhile
ADAPTER_FILE = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME


# ----- what a checkpoint holds --------------------------------------------------------------------------
def stored_where(engine: Engine) -> str:
    """One sentence: what each checkpoint-N will hold (logged with the plan when training starts)."""
    dtype = str(engine.policy.dtype).replace("torch.", "")
    masters = _low_precision_elements(engine)
    files = (f"checkpoints: the {dtype} weights as the Trainer saves them, optimizer.pt (AdamW's exp_avg, exp_avg_sq "
             f"and step in torch's format, fp32, {_gib(8 * _trained_elements(engine))}) and scheduler.pt")
    if not masters:
        return f"{files}: the plain transformers.Trainer resumes them exactly"
    return (f"{files}, and offload/{MASTERS_FILE} with the fp32 master weights ({_gib(4 * masters)}), which only "
            f"OffloadTrainer reads: it resumes exactly, a plain transformers.Trainer from the {dtype} weights")


def is_engine_checkpoint(checkpoint: str) -> bool:
    """Whether `checkpoint-N/offload` is a whole engine checkpoint (`engine.save`: written before this layout,
    or where the torch-format state did not fit), which `engine.load` resumes."""
    return os.path.isfile(os.path.join(checkpoint, ENGINE_DIR, MANIFEST))


# ----- saving ---------------------------------------------------------------------------------------------
def save_optimizer_state(engine: Engine, output_dir: str, scheduler: Any, writes: bool) -> None:
    """The optimizer state and the scheduler into `output_dir` (checkpoint-N). Called on every rank of a
    data-parallel engine (`state_dict()` and `save` are collectives); `writes`: this rank writes the files."""
    reason = _no_room_for_torch_state(engine)
    directory = os.path.join(output_dir, ENGINE_DIR)
    if reason is not None:
        if writes and os.path.isfile(os.path.join(directory, RECORD_FILE)):
            shutil.rmtree(directory)  # this layout's, from an earlier save of this step: engine.save refuses it
        engine.save(directory, scheduler=scheduler)  # every rank its part
        if writes:
            _write_refusing_stub(os.path.join(output_dir, OPTIMIZER_FILE), reason)
            if scheduler is not None:
                _torch_save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
            warnings.warn(f"offload: {output_dir!r} keeps the optimizer state in {ENGINE_DIR}/ only (OffloadTrainer "
                          f"resumes it; a plain transformers.Trainer refuses it): {reason}", RuntimeWarning,
                          stacklevel=3)
        return
    state = engine.optimizer.state_dict()
    if not writes:
        return
    masters = _split_masters(engine, state)
    _torch_save(state, os.path.join(output_dir, OPTIMIZER_FILE))
    del state
    if scheduler is not None:
        _torch_save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
    counters = engine.step_counts()
    record = {"format": FORMAT, "version": VERSION, "tier": engine.policy.tier.value,
              "compute_dtype": str(engine.policy.dtype).replace("torch.", ""), "moments": engine.policy.moments.value,
              "step": counters["steps"], "skipped_steps": counters["skipped_steps"],
              "optimizer": f"../{OPTIMIZER_FILE}", "masters": MASTERS_FILE if masters else None,
              "holds": stored_where(engine)}
    _replace_directory(directory, masters, record)


def _replace_directory(directory: str, masters: Dict[str, torch.Tensor], record: Dict[str, Any]) -> None:
    """`offload/` written whole into a temporary directory that then replaces the one there (an earlier save
    of this step, in this layout or the engine's), as `engine.save` replaces its directory: a kill leaves
    the old one or the new one (atomic.py)."""
    if os.path.isdir(directory) and os.listdir(directory) and not any(
            os.path.isfile(os.path.join(directory, known)) for known in (RECORD_FILE, MANIFEST)):
        raise OffloadIOError(errno.EEXIST, "exists and is not an offload checkpoint directory; refusing to replace "
                             "it", directory, 0, 0, "save")
    tmp = f"{directory}.tmp-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        if masters:
            torch.save(masters, os.path.join(tmp, MASTERS_FILE))
        with open(os.path.join(tmp, RECORD_FILE), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, directory)


def _split_masters(engine: Engine, state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Takes `offload_master` out of each entry of the torch-format state: {parameter name: fp32 masters}."""
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in engine.module.named_parameters()}
    return {names[id(params[index])]: entry.pop(MASTER_KEY) for index, entry in state["state"].items()
            if MASTER_KEY in entry}


def _no_room_for_torch_state(engine: Engine) -> Optional[str]:
    """None when `engine.optimizer.state_dict()` fits where it is made (every rank of this machine makes the
    whole state); else why not. Data-parallel: one answer for every rank."""
    dp = engine.data_parallel
    ranks = 1 if dp is None else dp.local_world
    needed = ranks * (8 * _trained_elements(engine) + 4 * _low_precision_elements(engine))
    nvme_path = engine.policy.nvme_path
    if engine.policy.tier is Tier.NVME and nvme_path is not None:
        where = f"free space under nvme_path {nvme_path!r} (the state is file-backed there)"
        room: Optional[int] = shutil.disk_usage(nvme_path).free
    else:
        where, room = "available host memory", mem_available()
    reason = None
    if room is not None and needed + ROOM_MARGIN > room:
        reason = (f"the optimizer state in torch's format needs {_gib(needed)} of {where}, and {_gib(room)} are "
                  f"{'free' if engine.policy.tier is Tier.NVME else 'available'}")
    if dp is not None:
        reason = next((str(r) for r in dp.all_gather_object(reason) if r is not None), None)
    return reason


def _trained_elements(engine: Engine) -> int:
    return sum(p.numel() for group in engine.optimizer.param_groups for p in group["params"])


def _low_precision_elements(engine: Engine) -> int:
    """Trained elements whose compute weights are not fp32: each has fp32 master weights of its own."""
    return sum(p.numel() for group in engine.optimizer.param_groups for p in group["params"]
               if p.dtype != torch.float32)


def _torch_save(obj: Any, path: str) -> None:
    """`torch.save` under a temporary name, then renamed: a kill leaves the old file or the new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_refusing_stub(path: str, reason: str) -> None:
    """An `optimizer.pt` whose `torch.load` raises with the reason, weights_only or not: a pickle of one
    global, `offload.<message>`, which the weights-only unpickler refuses by name and the full one cannot
    find (the message is its name)."""
    message = (f"this optimizer.pt holds no optimizer state: OffloadTrainer kept it in {ENGINE_DIR}/ beside it, "
               f"because {reason}; resume this checkpoint with OffloadTrainer (a plain transformers.Trainer would "
               "restart AdamW's moments)").replace("\n", " ")
    data = b"\x80\x02c" + b"offload\n" + message.encode("utf-8") + b"\n."
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ----- loading --------------------------------------------------------------------------------------------
def load_checkpoint_weights(engine: Engine, model: nn.Module, checkpoint: str) -> int:
    """The weights of `checkpoint` (the Trainer's files: `model.safetensors` or shards, or a PEFT adapter)
    into the engine, as the Trainer's `model.load_state_dict` / `load_adapter` would load them, on every tier
    and with streamed blocks; the Adam state stays (`load_weights`). Returns how many entries were loaded."""
    return _load(engine, model, checkpoint, adapter=_is_peft(model))


def load_state_dict_file(engine: Engine, model: nn.Module, path: str) -> int:
    """`model.state_dict()` saved in one safetensors file (accelerate's `save_state`: a PEFT model's whole state
    too, by its state-dict names) into the engine, on every tier and with streamed blocks, the Adam state kept;
    a tied weight may be there under one of its names. Returns how many entries were loaded."""
    return _load(engine, model, path, adapter=False)


def _load(engine: Engine, model: nn.Module, checkpoint: str, adapter: bool) -> int:
    with engine.reading_module_state():
        reads, required = (_adapter_reads(model, checkpoint) if adapter else _model_reads(model, checkpoint))
        missing = [name for name in required if name not in reads]
        if missing:
            raise OffloadConfigError(f"checkpoint {checkpoint!r} has no weights for {len(missing)} entries of the "
                                     f"model (first: {missing[0]!r}): it was saved from another model")
        return engine.load_weights(reads)


def _model_reads(model: nn.Module, checkpoint: str) -> Tuple[Dict[str, Read], List[str]]:
    """Every state-dict entry from the checkpoint's safetensors (one file, or shards with their index); each
    parameter must be there (under one of its names, for a tied one)."""
    try:
        source = WeightSource(checkpoint)
    except OffloadConfigError as exc:
        bins = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                if os.path.isfile(os.path.join(checkpoint, f))]
        hint = f" ({bins[0]} is there: save with safetensors, the default)" if bins else ""
        raise OffloadConfigError(f"cannot resume from {checkpoint!r}: {exc}{hint}") from None
    entries = model.state_dict(keep_vars=True)
    reads = {name: (source, name) for name in entries if name in source}
    names_of: Dict[int, List[str]] = {}
    for name, value in entries.items():
        names_of.setdefault(id(value), []).append(name)
    required = [names[0] for names in names_of.values()
                if isinstance(entries[names[0]], nn.Parameter) and not any(n in reads for n in names)]
    return reads, required


def _adapter_reads(model: nn.Module, checkpoint: str) -> Tuple[Dict[str, Read], List[str]]:
    """A `peft.PeftModel`'s adapter files, as its `save_pretrained` wrote them (one directory per adapter,
    the default one in `checkpoint` itself), mapped back to state-dict names by `get_peft_model_state_dict`
    run on shape-only meta tensors (as `hf_peft.peft_state_dict` selects what to save)."""
    from peft import get_peft_model_state_dict

    entries = model.state_dict(keep_vars=True)
    skeleton = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in entries.items()}
    name_of = {id(t): name for name, t in skeleton.items()}
    reads: Dict[str, Read] = {}
    required: List[str] = []
    for adapter in model.peft_config:  # type: ignore[union-attr]
        directory = checkpoint if adapter == "default" else os.path.join(checkpoint, adapter)
        path = os.path.join(directory, ADAPTER_FILE)
        if not os.path.isfile(path):
            raise OffloadConfigError(f"cannot resume from {checkpoint!r}: adapter {adapter!r} has no {path!r} "
                                     "(saved with safetensors, the default, by PeftModel.save_pretrained)")
        source = WeightSource(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kept = get_peft_model_state_dict(model, state_dict=skeleton, adapter_name=adapter)
        for key, value in kept.items():
            name = name_of.get(id(value))
            if name is None:
                raise OffloadConfigError(f"cannot resume adapter {adapter!r} from {checkpoint!r}: PEFT computes "
                                         f"what it saves as {key!r} from the weights, so it cannot be loaded back "
                                         "into the engine by name")
            required.append(name)
            if key in source:
                reads[name] = (source, key)
    return reads, required


def _is_peft(model: nn.Module) -> bool:
    from offload.integrations.hf_peft import is_peft_model

    return is_peft_model(model)


def load_optimizer_state(engine: Engine, checkpoint: str, scheduler: Any) -> bool:
    """`optimizer.pt` (mapped, not read into memory: `torch.load(mmap=True)`) through
    `engine.optimizer.load_state_dict`, with the master weights of `offload/` where it has them, the engine's
    step counters, and `scheduler.pt` into `scheduler`. Returns False when the checkpoint has no
    `optimizer.pt` (a `save_only_model` checkpoint: AdamW starts afresh, as in the plain Trainer)."""
    path = os.path.join(checkpoint, OPTIMIZER_FILE)
    if not os.path.isfile(path):
        return False
    state = _mapped(path)
    record = _record(checkpoint)
    if record is not None and record.get("masters"):
        _put_masters(engine, state, _mapped(os.path.join(checkpoint, ENGINE_DIR, record["masters"])))
    engine.optimizer.load_state_dict(state)
    del state
    if record is not None:
        engine.restore_step_counts(record["step"], record["skipped_steps"])
    schedule = os.path.join(checkpoint, SCHEDULER_FILE)
    if scheduler is not None and os.path.isfile(schedule):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "please also save the optimizer state" notes, as the Trainer
            scheduler.load_state_dict(torch.load(schedule, weights_only=True))
    return True


def _mapped(path: str) -> Any:
    """`torch.load` with the tensors mapped from the file (read as they are copied into the engine, never
    held whole); a file of torch's legacy format cannot be mapped, and is read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "zipfile" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _put_masters(engine: Engine, state: Dict[str, Any], masters: Mapping[str, torch.Tensor]) -> None:
    """Each entry whose parameter computes in low precision gets its saved fp32 masters back (a parameter
    computing in fp32 keeps the weights just loaded as its masters: there they are the same)."""
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in engine.module.named_parameters()}
    for index, entry in state["state"].items():
        param = params[index] if 0 <= index < len(params) else None
        if param is not None and param.dtype != torch.float32 and names.get(id(param)) in masters:
            entry[MASTER_KEY] = masters[names[id(param)]]


def _record(checkpoint: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(checkpoint, ENGINE_DIR, RECORD_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("format") != FORMAT or record.get("version", 0) > VERSION:
        raise OffloadConfigError(f"{path!r} is not an offload Trainer checkpoint record this offload reads "
                                 f"(format {record.get('format')!r}, version {record.get('version')}): upgrade offload")
    return record


@contextlib.contextmanager
def without_optimizer_files(checkpoint: str) -> Iterator[str]:
    """A directory that shows `checkpoint`'s entries (symbolic links) but for the optimizer and scheduler
    files, for the Trainer's own `_load_optimizer_and_scheduler` after the engine has loaded them: a
    subclass's override (TRL's GRPOTrainer reads its own file after `super()`) still finds its files, and the
    Trainer finds nothing to load again (it would read `optimizer.pt` whole into memory; a stub raises)."""
    hidden = {OPTIMIZER_FILE, "optimizer.bin", SCHEDULER_FILE}
    with tempfile.TemporaryDirectory(prefix="offload-checkpoint-view-") as view:
        for entry in os.listdir(checkpoint):
            source = os.path.join(checkpoint, entry)
            if entry in hidden or (os.path.isdir(source) and "optimizer" in entry):
                continue
            os.symlink(os.path.abspath(source), os.path.join(view, entry))
        yield view


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


__all__ = ["is_engine_checkpoint", "load_checkpoint_weights", "load_optimizer_state", "save_optimizer_state",
           "stored_where", "without_optimizer_files"]
