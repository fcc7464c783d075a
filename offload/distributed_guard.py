"""Refuses data-parallel training until the engine does it: every rank would train alone, silently.

An engine moves each gradient off the device as autograd produces it and updates its own optimizer state,
so `DistributedDataParallel`'s all-reduce never sees the gradients, and with several processes each rank
steps on its own batches: the ranks drift apart with no error. Checked at `wrap()` and at every `step()`
(a process group may be started, or DDP applied, after `wrap()`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from offload.errors import OffloadConfigError, OffloadError


def refuse_data_parallel_wrapper(module: nn.Module) -> None:
    """At wrap(): a model already inside DDP / DataParallel is refused, naming the fix."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise OffloadConfigError(
            f"offload.wrap got a {type(module).__name__}: offload does not train data-parallel yet (the "
            "ranks' gradients would never be averaged); wrap the plain model (`model.module`) in a single process")


def refuse_several_ranks() -> None:
    """At wrap() and step(): more than one process in torch.distributed's default group is refused."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise OffloadError(
            f"torch.distributed runs {dist.get_world_size()} processes, but offload does not train data-parallel "
            "yet: each rank would step on its own gradients and the ranks would drift apart, with DDP or "
            "without. Train in one process (no torchrun / accelerate launch with several processes)")
