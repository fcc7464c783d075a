"""Where data parallelism is the engine's job, other data-parallel wrappers are refused, loudly.

The engine trains data-parallel itself when `torch.distributed` runs several processes at `wrap()`
(data_parallel.py). `DistributedDataParallel` or FSDP around or under the engine cannot work with it: the
engine moves each gradient off the device as autograd produces it, so DDP's all-reduce would see none and
write zeros back, and DDP's start-up broadcast never reaches the optimizer's master weights. A process
group started after `wrap()` would leave the engine training alone on each rank. Each raises at the
moment of misuse (wrap, forward, step) with the fix; a process that a launcher started as one of several but that
never started the process group is warned at `wrap()`.
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed as dist
from torch import nn

from offload.distributed.launchers import launched_rank_and_world
from offload.errors import OffloadConfigError, OffloadError

_LET_THE_ENGINE = ("offload trains data-parallel itself when torch.distributed is initialized before "
                   "offload.wrap() (torchrun / accelerate launch / deepspeed / torch.distributed.launch): wrap the "
                   "plain model, without DDP or FSDP (accelerate's own loop: make the Accelerator first, then "
                   "offload.wrap(), then accelerator.prepare(engine.module, engine.optimizer, ...), which leaves the "
                   "engine's module to the engine instead of DDP)")
_WRAPPER_NAMES = ("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel")
_FRAMES_SEARCHED = 12  # a DDP/FSDP forward reaches the module's __call__ within a few frames


def refuse_data_parallel_wrapper(module: nn.Module) -> None:
    """At wrap(): a model inside DDP / DataParallel / FSDP (or with FSDP-sharded sub-modules) is refused."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or _is_fsdp(module):
        raise OffloadConfigError(
            f"offload.wrap got a {type(module).__name__}: {_LET_THE_ENGINE} (`model.module` here)")
    for name, sub in module.named_modules():
        if sub is not module and _is_fsdp(sub):
            raise OffloadConfigError(
                f"sub-module {name!r} is sharded by FSDP ({type(sub).__name__}): {_LET_THE_ENGINE}")


def refuse_ranks_unknown_at_wrap(made_for: int) -> None:
    """At forward and step(): several processes now, but the engine was made for another world size (`made_for`;
    a process group started after wrap(), e.g. to apply DDP), would train each rank alone."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and world != made_for:
        raise OffloadError(
            f"torch.distributed runs {world} processes, but this engine was made by offload.wrap() for "
            f"{made_for}: each rank would step on its own gradients and the ranks would drift apart. Initialize "
            "the process group first (torchrun does, before your script runs; else dist.init_process_group()), "
            f"then call offload.wrap(); {_LET_THE_ENGINE}")


def refuse_outer_data_parallel(module: nn.Module) -> None:
    """At each root forward: DDP / FSDP around the engine's module (applied after wrap()) is refused."""
    if _is_fsdp(module):
        raise OffloadError(f"the wrapped model was sharded by FSDP after offload.wrap(): {_LET_THE_ENGINE}")
    frame = sys._getframe(1)
    for _ in range(_FRAMES_SEARCHED):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if owner is not None and type(owner).__name__ in _WRAPPER_NAMES and getattr(owner, "module", None) is module:
            raise OffloadError(f"the engine's model runs inside {type(owner).__name__}: {_LET_THE_ENGINE} "
                               "(call the engine, or its module, directly)")


def warn_launched_without_process_group() -> None:
    """At wrap() without a process group: a process a launcher started as one of several (RANK / WORLD_SIZE, or
    mpirun's) would train alone, each rank on its own data, drifting apart; say so, and what starts the group.
    (A warning, not an error: a process group started after wrap() is refused at the first forward.)"""
    launched = launched_rank_and_world()
    if launched is None:
        return
    rank, world, said = launched
    warnings.warn(
        f"offload.wrap(): this process was launched as rank {rank} of {world} ({said}), but torch.distributed is not "
        "initialized, so the engine trains this process alone and the ranks will drift apart. Call "
        "torch.distributed.init_process_group() before offload.wrap() ('gloo' on the CPU, 'nccl' on GPUs; "
        "accelerate's Accelerator(), deepspeed.init_distributed() and the HF Trainer's TrainingArguments start it "
        "too): the engine then trains data-parallel", RuntimeWarning, stacklevel=5)  # at the caller of wrap()


def _is_fsdp(module: nn.Module) -> bool:
    """FSDP1's wrapper, or a module FSDP2's fully_shard changed (its class becomes FSDP<name>)."""
    return any(cls.__name__ in ("FullyShardedDataParallel", "FSDPModule") for cls in type(module).__mro__)
