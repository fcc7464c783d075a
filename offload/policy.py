"""The options of `offload.wrap`, parsed once into an enum and a frozen dataclass.

Everything below the public API reads these types, never the user's strings: a typo fails here, at
`wrap()`, with the list of valid values, before any memory is allocated or any file is created.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

from offload.errors import OffloadConfigError
from offload.optim.moment_format import MomentFormat
from offload.param_groups import GroupOptions


class Activations(enum.Enum):
    """What happens to the tensors autograd saves in the forward: KEEP (where the forward made them) or OFFLOAD
    (to the swap directory, back for the backward: docs/design.md [Note: activations off the device])."""

    KEEP = "keep"
    OFFLOAD = "offload"

    @staticmethod
    def parse(value: Union[None, str, "Activations"]) -> "Activations":
        if value is None:
            return Activations.KEEP
        if isinstance(value, Activations):
            return value
        if isinstance(value, str) and value.strip().lower() == "offload":
            return Activations.OFFLOAD
        raise OffloadConfigError(f"activations={value!r} is not a setting: use None (saved tensors stay where the "
                                 "forward made them) or 'offload' (they go to the swap directory and come back)")


class ShardWeights(enum.Enum):
    """Data-parallel mode: whether each rank keeps the whole compute weights (OFF), a 1/N part of every block's,
    gathered whole for each use (ON: ZeRO-3), or what the budgets need (AUTO: sharded when the whole weights do
    not fit a rank's host memory). See docs/design.md [Note: sharded weights]."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @staticmethod
    def parse(value: Union[None, bool, "ShardWeights"]) -> "ShardWeights":
        if value is None:
            return ShardWeights.AUTO
        if isinstance(value, ShardWeights):
            return value
        if isinstance(value, bool):
            return ShardWeights.ON if value else ShardWeights.OFF
        raise OffloadConfigError(f"shard_weights={value!r} is not a setting: use None (decided from the budgets), "
                                 "True (each rank keeps 1/N of the weights) or False (each rank keeps them all)")


class DiskWeights(enum.Enum):
    """nvme tier: how the compute weights the budgets leave on disk are kept. COPY: a record of their own in the
    compute dtype (2 B/param more on disk for bf16; each fetch reads 2 B/param); MASTER: none, each fetch reads the
    fp32 master from the state record and casts it, the weights an update makes exactly (4 B/param read per fetch,
    no byte on disk); AUTO: MASTER only when the copies would not fit the swap directory's free disk. See
    docs/design.md [Note: weights from the master]."""

    AUTO = "auto"
    COPY = "copy"
    MASTER = "master"

    @staticmethod
    def parse(value: Union[None, str, "DiskWeights"]) -> "DiskWeights":
        if value is None:
            return DiskWeights.AUTO
        if isinstance(value, DiskWeights):
            return value
        for option in DiskWeights:
            if value == option.value:
                return option
        raise OffloadConfigError(f"disk_weights={value!r} is not a setting: use None or 'auto' (read from the master "
                                 "only when the disk is short), 'copy' (a record of their own) or 'master' (read from "
                                 "the fp32 master and cast)")


class Tier(enum.Enum):
    """Where the optimizer state (fp32 master weights, Adam moments) lives.

    GPU: everything on the compute device (the reference). CPU: state in host memory, CPU Adam step
    (ZeRO-Offload). NVME: state in preallocated swap files under `nvme_path` (ZeRO-Infinity).
    """

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"

    @staticmethod
    def parse(value: Union[str, "Tier"]) -> "Tier":
        if isinstance(value, Tier):
            return value
        if isinstance(value, str):
            for tier in Tier:
                if tier.value == value.strip().lower():
                    return tier
        valid = ", ".join(repr(t.value) for t in Tier)
        raise OffloadConfigError(f"unknown tier {value!r}; valid tiers are {valid}")


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Union[int, float, str, None], what: str) -> Optional[int]:
    """Bytes from an int or a string like "24GB" (10^9), "512MiB" (2^20) or "4G" (2^30); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise OffloadConfigError(f"{what} must be a byte count or a string like '24GB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise OffloadConfigError(f"{what} must be a finite byte count (or None for no budget), got {value!r}")
        number, unit = float(value), ""
    elif isinstance(value, str) and _SIZE.match(value):
        match = _SIZE.match(value)
        assert match is not None
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise OffloadConfigError(f"{what} must be a byte count or a string like '24GB', got {value!r}")
    if unit not in _UNITS:
        units = ", ".join(u for u in _UNITS if u)
        raise OffloadConfigError(f"{what}: unknown unit {unit!r} in {value!r}; use one of {units}")
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise OffloadConfigError(f"{what} must be positive, got {value!r}")
    return size


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bounds_host_memory(tier: Tier, host_memory: Optional[object]) -> bool:
    """nvme tier under a host budget: where RSS is promised to stay within the budgets + a constant (docs/design.md
    [Note: the nvme memory bound]), so the engine gives freed memory back to the system."""
    return tier is Tier.NVME and host_memory is not None


@dataclass(frozen=True)
class OffloadPolicy:
    """Every option of `offload.wrap`, validated once; the engine and planner read only this.

    Attributes:
        tier: where the optimizer state lives (see `Tier`).
        nvme_path: directory for swap files; required by, and only allowed with, `Tier.NVME`.
        lr, betas, eps, weight_decay: AdamW hyperparameters (decoupled weight decay, as torch.optim.AdamW).
            They seed `engine.optimizer.param_groups`; changes made there later take effect.
        max_grad_norm: clip the global gradient norm to this value (as torch.nn.utils.clip_grad_norm_),
            or None for no clipping. Clipping needs the global norm before any update.
        dtype: compute dtype of the weights; fp32 parameters of the model are cast to it, except those of
            normalization layers, which stay fp32 (see docs/design.md [Note: compute dtypes]). `wrap()` sets
            the model's own dtype unless told otherwise: a lower one is mixed precision, asked for by name.
        device: the compute device; None means CUDA when available, else CPU.
        device_memory, host_memory: budgets in bytes (None: no budget beyond what the machine has).
        grad_accumulation_steps: how many backward calls make one optimizer step, when the user knows it.
            Declared, it lets the engine update each block during the last backward; None (the default)
            means "not told": results are still exact, but updates wait for `step()`.
        param_groups: per-group overrides of lr, betas, eps, weight_decay (offload/param_groups.py); empty:
            one group.
        overlap_step: whether `step()` returns once the updates are scheduled, so they overlap the next
            forward (each block's forward waits for its own update; a parameter of a block whose update is
            still pending reads through, waiting for it, so code right after `step()` sees the new weights as
            with torch). None (the default): when the updates could not run during the backward (clipping,
            or accumulation not declared) and the model computes on a GPU (on the CPU the next forward and the
            updates would share its cores). False: `step()` waits for every update (an update's error then
            raises from `step()`). See docs/design.md [Note: step returns early].
        moments: how the Adam moments are kept (`MomentFormat`): fp32 (exactly torch AdamW), bf16, or int8
            with a scale per block; the master weights stay fp32. See docs/design.md [Note: compressed moments].
        activations: whether the tensors autograd saves in the forward stay where they were made (KEEP) or go
            to the swap directory and come back for the backward, bit for bit (OFFLOAD).
        activation_memory: device bytes the plan keeps free of weights for the forward's saved activations (within
            device_memory, which it needs); None: the weights take what they can.
        shard_weights: data-parallel mode only: whether each rank keeps a 1/N part of the compute weights
            (`ShardWeights`).
        speculative_clipping: with `max_grad_norm`, whether blocks update during the last backward anyway, into
            shadow copies of their state, on the speculation that the step will not clip (committed when it does
            not, redone from the untouched state when it does: the same bits either way). See docs/design.md
            [Note: speculative clipping]. None (default): yes, except on the cpu tier computing on the CPU itself,
            where the updates would share the backward's cores and the shadows' copies cost more than they hide.
        zero_quantized_weights: with sharded weights, the gathers that feed compute send each rank's part as int8
            blocks with a scale each (ZeRO++'s qwZ: distributed/quantized_gather.py): about half the bytes of bf16,
            a quarter of fp32, and the forward and backward compute with the decoded weights (this changes the
            maths; the master weights, the update and every read of the weights stay exact). Off by default.
        zero_quantized_gradients: data-parallel mode: the gradients' reduce-scatter sends each rank's pieces as
            int8 blocks through all-to-alls, summed in fp32 where they land, within each machine first and then
            across machines (ZeRO++'s qgZ). Changes the maths by the quantization error. Off by default.
        disk_weights: nvme tier, weights the budgets put on disk: a copy of their own, or read from the fp32 master
            (`DiskWeights`).
        zero_hpz_partition_size: with sharded weights, > 1 makes ranks in consecutive groups of this many (the ranks
            of one machine: LOCAL_WORLD_SIZE) keep a secondary part of each block from its forward's gather, so
            the backward's gathers stay within the group (ZeRO++'s hpZ). Exact. 1 (default): off.
    """

    tier: Tier = Tier.CPU
    nvme_path: Optional[str] = None
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: Optional[float] = None
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_memory: Optional[int] = None
    host_memory: Optional[int] = None
    grad_accumulation_steps: Optional[int] = None
    param_groups: Tuple[GroupOptions, ...] = ()
    overlap_step: Optional[bool] = None
    moments: MomentFormat = MomentFormat.FP32
    activations: Activations = Activations.KEEP
    activation_memory: Optional[int] = None
    shard_weights: ShardWeights = ShardWeights.AUTO
    speculative_clipping: Optional[bool] = None
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    disk_weights: DiskWeights = DiskWeights.AUTO

    @property
    def speculates(self) -> bool:
        """Whether clipping speculates (see `speculative_clipping`)."""
        if self.max_grad_norm is None:
            return False
        if self.speculative_clipping is not None:
            return self.speculative_clipping
        return not (self.tier is Tier.CPU and self.device.type == "cpu")

    @property
    def step_returns_early(self) -> bool:
        """See `overlap_step`: unset, when the last backward could not run the updates and the next forward runs
        on another device than they do (with the CPU computing, the two would share its cores and the
        interpreter: the tiny row of `bench_train --tiny` waited 1.18x torch's step against 1.25x overlapped)."""
        if self.overlap_step is not None:
            return self.overlap_step
        could_not_run = self.max_grad_norm is not None or self.grad_accumulation_steps is None
        return could_not_run and self.device.type != "cpu"

    @property
    def bounds_host_memory(self) -> bool:
        """See `bounds_host_memory`."""
        return bounds_host_memory(self.tier, self.host_memory)


    def __post_init__(self) -> None:
        if not isinstance(self.tier, Tier):
            raise OffloadConfigError(f"tier must be a Tier, got {self.tier!r}; use Tier.parse()")
        if self.tier is Tier.NVME and not self.nvme_path:
            raise OffloadConfigError("tier='nvme' needs nvme_path=<a directory on a fast disk> for the swap files")
        if self.tier is not Tier.NVME and self.nvme_path is not None:
            raise OffloadConfigError(f"nvme_path is only used with tier='nvme' (tier is {self.tier.value!r})")
        _check_number("lr", self.lr, minimum=0.0)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise OffloadConfigError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            _check_number(f"betas[{i}]", beta, minimum=0.0)
            if beta >= 1.0:
                raise OffloadConfigError(f"betas[{i}] must be in [0, 1), got {beta!r}")
        _check_number("eps", self.eps, minimum=0.0)
        _check_number("weight_decay", self.weight_decay, minimum=0.0)
        if self.max_grad_norm is not None:
            _check_number("max_grad_norm", self.max_grad_norm, minimum=0.0)
            if self.max_grad_norm == 0.0:
                raise OffloadConfigError("max_grad_norm must be > 0, or None for no clipping")
        if self.dtype not in COMPUTE_DTYPES:
            names = ", ".join(str(d) for d in COMPUTE_DTYPES)
            raise OffloadConfigError(f"dtype must be one of {names}, got {self.dtype!r}")
        if not isinstance(self.device, torch.device) or self.device.type not in ("cpu", "cuda"):
            raise OffloadConfigError(f"device must be a CPU or CUDA torch.device, got {self.device!r}")
        for name in ("device_memory", "host_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise OffloadConfigError(f"{name} must be a positive byte count, got {value!r}")
        if self.activation_memory is not None:
            if not isinstance(self.activation_memory, int) or self.activation_memory < 0:
                raise OffloadConfigError(f"activation_memory must be a byte count >= 0, got {self.activation_memory!r}")
            if self.device_memory is None:
                raise OffloadConfigError(
                    "activation_memory keeps room for the activations within device_memory, which is not set: give "
                    "device_memory too (with no device budget the weights are not limited, so nothing can be kept)")
        steps = self.grad_accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise OffloadConfigError(f"grad_accumulation_steps must be an int >= 1 or None, got {steps!r}")
        if not isinstance(self.activations, Activations):
            raise OffloadConfigError(f"activations must be an Activations, got {self.activations!r}; use "
                                     "Activations.parse()")
        if self.activations is Activations.OFFLOAD and self.tier is not Tier.NVME:
            raise OffloadConfigError(
                f"activations='offload' sends saved activations to the swap directory, which only tier='nvme' has "
                f"(tier is {self.tier.value!r}): use tier='nvme' with nvme_path=..., or activations=None")
        if not isinstance(self.shard_weights, ShardWeights):
            raise OffloadConfigError(f"shard_weights must be a ShardWeights, got {self.shard_weights!r}; use "
                                     "ShardWeights.parse()")
        if self.shard_weights is ShardWeights.ON and self.tier is Tier.GPU:
            raise OffloadConfigError(
                "shard_weights=True keeps each rank's part of the weights in host memory or on disk, gathered for "
                "each use; tier='gpu' keeps everything on the device: use tier='cpu' or tier='nvme', or "
                "shard_weights=None")
        if not isinstance(self.moments, MomentFormat):
            raise OffloadConfigError(f"moments must be a MomentFormat, got {self.moments!r}; use MomentFormat.parse()")
        if self.speculative_clipping is not None and not isinstance(self.speculative_clipping, bool):
            raise OffloadConfigError(
                f"speculative_clipping must be True, False or None, got {self.speculative_clipping!r}")
        for name in ("zero_quantized_weights", "zero_quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise OffloadConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        size = self.zero_hpz_partition_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OffloadConfigError(f"zero_hpz_partition_size must be an int >= 1 (1: off), got {size!r}")
        if size > 1 and self.shard_weights is ShardWeights.OFF:
            raise OffloadConfigError("zero_hpz_partition_size > 1 keeps secondary parts of sharded weights, and "
                                     "shard_weights=False keeps them whole on every rank: set shard_weights=True")
        if self.zero_quantized_weights and self.shard_weights is ShardWeights.OFF:
            raise OffloadConfigError("zero_quantized_weights=True quantizes the gathers of sharded weights, and "
                                     "shard_weights=False keeps them whole on every rank: set shard_weights=True")
        if self.overlap_step is not None and not isinstance(self.overlap_step, bool):
            raise OffloadConfigError(f"overlap_step must be True, False or None, got {self.overlap_step!r}")
        if not isinstance(self.disk_weights, DiskWeights):
            raise OffloadConfigError(f"disk_weights must be a DiskWeights, got {self.disk_weights!r}; use "
                                     "DiskWeights.parse()")
        if self.disk_weights is DiskWeights.MASTER and self.tier is not Tier.NVME:
            raise OffloadConfigError(f"disk_weights='master' reads weights on disk from the master in the swap file, "
                                     f"which only tier='nvme' has (tier is {self.tier.value!r}): use tier='nvme', or "
                                     "disk_weights=None")


def _check_number(name: str, value: object, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OffloadConfigError(f"{name} must be a number, got {value!r}")
    if not value >= minimum:  # also rejects nan
        raise OffloadConfigError(f"{name} must be >= {minimum}, got {value!r}")


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """The compute device: CUDA when available and not told otherwise, else CPU."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OffloadConfigError(f"device {device!r} is not a torch device: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise OffloadConfigError(f"device {device!r} asked for, but CUDA is not available; use device='cpu'")
    return resolved
