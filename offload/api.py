"""`offload.wrap`: the public entry point. Parses the user's options once into an `OffloadPolicy`."""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from offload.checkpoint.weight_source import WeightSource
from offload.engine.engine import Engine
from offload.errors import OffloadConfigError
from offload.integrations.accelerate import adopt_accelerate
from offload.optim.moment_format import MomentFormat
from offload.param_groups import parse_param_groups
from offload.policy import (
    COMPUTE_DTYPES,
    Activations,
    DiskWeights,
    OffloadPolicy,
    ShardWeights,
    Tier,
    parse_bytes,
    resolve_device,
)
from offload.scheduler.setup.initial_weights import choose

Bytes = Union[int, str, None]


def wrap(
    model: nn.Module,
    tier: Union[str, Tier] = "cpu",
    *,
    nvme_path: Optional[Union[str, os.PathLike]] = None,
    lr: float = 1e-3,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    max_grad_norm: Optional[float] = None,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device, None] = None,
    device_memory: Bytes = None,
    host_memory: Bytes = None,
    grad_accumulation_steps: Optional[int] = None,
    param_groups: Optional[Sequence[Dict[str, Any]]] = None,
    overlap_step: Optional[bool] = None,
    moments: Union[str, MomentFormat] = "fp32",
    activations: Optional[str] = None,
    activation_memory: Bytes = None,
    shard_weights: Optional[bool] = None,
    speculative_clipping: Optional[bool] = None,
    zero_quantized_weights: bool = False,
    zero_quantized_gradients: bool = False,
    zero_hpz_partition_size: int = 1,
    disk_weights: Optional[str] = None,
    weights: Optional[Union[str, os.PathLike]] = None,
    init: Optional[Callable[[nn.Module], None]] = None,
    **unknown: object,
) -> Engine:
    """Wrap `model` for training with AdamW, its optimizer state offloaded to `tier`.

    Args:
        model: the model to train. Its parameters are moved into per-block flat buffers on `device`; the
            `nn.Parameter` objects stay the same (tied weights stay tied).
        tier: "gpu" (all on the device: the reference), "cpu" (fp32 master weights and Adam state in host
            memory, updated by the CPU) or "nvme" (optimizer state in swap files under `nvme_path`).
        lr, betas, eps, weight_decay: AdamW hyperparameters, with torch.optim.AdamW's defaults (1e-3, (0.9,
            0.999), 1e-8, 1e-2; decoupled weight decay); later changes to `engine.optimizer.param_groups` take
            effect (LR schedulers work).
        max_grad_norm: clip the global gradient norm, as torch.nn.utils.clip_grad_norm_ would; `engine.step()`
            returns the norm it clipped with (before clipping), and `engine.stats()["grad_norm"]` keeps it.
        dtype: compute dtype of the weights. None (default): the model's own, nothing is cast (an fp32 model
            trains in fp32, exactly as plain PyTorch). `torch.bfloat16` asks for mixed precision: fp32
            parameters compute in bf16 (norms stay fp32), the master weights and Adam state stay fp32.
        device: compute device; CUDA when available, else CPU.
        device_memory, host_memory: budgets, as bytes or strings like "24GB" or "512MiB".
        grad_accumulation_steps: backward calls per optimizer step, if you know it: then each block is
            updated during the last backward. Unset, results are the same, updates wait for `step()`.
        param_groups: AdamW options per group, as torch.optim takes them, e.g. no weight decay on biases
            and norms: `[{"params": no_decay, "weight_decay": 0.0}]`. Keys: params, lr, betas, eps,
            weight_decay; parameters not listed form a last group with the options above.
        overlap_step: let `step()` return before the updates run, so they overlap the next forward; each
            block's forward waits for its update, and a parameter whose block's update is pending reads
            through (any read or write waits for it), so code after `step()` sees the new weights as with
            torch. None (default): on when the updates could not run during the backward (`max_grad_norm`
            set, or `grad_accumulation_steps` not declared) and the model computes on a GPU (with the CPU
            computing, the next forward and the updates would share its cores). False: `step()` waits for
            every update.
        moments: how the Adam moments are kept: "fp32" (default, exactly torch.optim.AdamW), "bf16" (half
            the bytes), or "int8" (a quarter, plus one fp32 scale per 256 elements): on the nvme tier the
            disk then moves about half the bytes per step (6 instead of 12 per parameter). The master weights
            stay fp32; the update is computed in fp32 and only the stored moments are rounded, as 8-bit Adam.
        activations: None (default) keeps the tensors autograd saves in the forward where they were made;
            "offload" (tier="nvme") writes each saved tensor of 1 MiB or more to a file in the swap directory
            as the forward goes and reads it back, bit for bit, when the backward needs it: long sequences
            then need host/device memory for the weights' working set, not for every layer's activations.
        activation_memory: device bytes (like device_memory) that no weight takes, for the tensors the forward
            saves for the backward: the plan puts fewer weights on the device (more stream) so that they fit
            within device_memory. None (default): the weights take what they can, and the activations get what is
            left. `engine.plan` shows the activations measured in the last training forward, and wrap() warns
            after the first one when they exceed the room left (on a GPU: out of memory; on a CPU device: memory
            over the budgets), naming the value to give here.
        shard_weights: under torchrun (several processes): True makes each rank keep 1/N of every block's
            weights (in host memory or its own swap file), gathered whole for each use and freed after it
            (ZeRO-3), so a machine holds one copy of the model, not one per rank; False keeps all of them on
            every rank; None (default) shards when the whole weights do not fit `host_memory`. Reading
            weights outside a forward (state_dict, save) is then a collective: every rank must do it.
        speculative_clipping: with `max_grad_norm` (None, the default, is True except on the cpu tier computing on
            the CPU itself, whose updates would share the backward's cores): each block updates as soon as the last
            backward completes its gradients, as without clipping, into shadow copies of its state (in host
            memory on the cpu tier, in the swap file on the nvme tier, as far as the plan finds room: it says
            where), on the speculation that the step will not clip; `step()` keeps them when the global norm is
            at or below `max_grad_norm` and redoes them from the untouched state, clipped, when it is not: the
            same bits either way, only the time differs. After a step that clipped it waits until the norm has
            stayed below the threshold for a while. False: every update waits for the global norm.
        zero_quantized_weights: with sharded weights (ZeRO++'s qwZ, DeepSpeed's key of the same name): the
            gathers for the forward and backward send each rank's part as int8 blocks of 64 with a scale each,
            about half the bytes of bf16 weights (a quarter of fp32), and compute with the decoded weights. This
            changes the maths (the loss moves by the quantization error); the fp32 master weights, the update and
            every read of the weights (state_dict, save) stay exact. Default False: exact gathers.
        zero_quantized_gradients: under several processes (ZeRO++'s qgZ): the gradients' reduce-scatter sends
            each rank's pieces as int8 blocks through all-to-alls, summed in fp32 where they land; across several
            machines in two levels (within each machine, then one machine-sum per machine across them), so about
            an eighth of fp32's bytes cross machines. Changes the maths by the quantization error. Default False.
        zero_hpz_partition_size: with sharded weights (ZeRO++'s hpZ): > 1 makes ranks in consecutive groups of this
            many (set it to the ranks of one machine, LOCAL_WORLD_SIZE) keep a 1/size part of each block from its
            forward's gather, so the backward gathers it within the machine. Exact; costs that part in host
            memory between a block's forward and its update (the plan says how much; within host_memory, else
            wrap() raises naming the budget). Default 1: off.
        disk_weights: tier="nvme", the compute weights the budgets leave on disk: "copy" keeps a record of their
            own in the swap file (2 B/param more on disk in bf16, each fetch reads 2 B/param); "master" keeps none:
            each fetch reads the fp32 master from the block's state record and casts it, which is exactly the
            weights an update writes (the same bits), for 4 B/param read per fetch instead of 2; None (default,
            "auto"): "master" only when the copies would not fit the swap directory's free disk. The plan says
            which, and its bandwidth cost.
        weights: a pretrained checkpoint to fill the model from, block by block as it is placed (a
            `.safetensors` file, a directory of Hugging Face shards, or an offload checkpoint directory):
            the model may be built on the meta device (`accelerate.init_empty_weights()`), so it never
            exists whole in memory. Names must match as `load_state_dict(strict=True)` requires.
        init: for a model on the meta device without `weights`: `init(module)` initializes each module
            as its block is placed (for Hugging Face models, `model._init_weights`); unset, each module's
            `reset_parameters()` does.

    Returns:
        An `Engine`: call it like the model, then `loss.backward()`, `engine.step()`, `engine.zero_grad()`.

    Raises:
        OffloadConfigError: an unknown tier or bad option (the message lists the valid ones), a budget too
            small for the largest block, a model already wrapped, parameters on the meta device.
    """
    if unknown:
        _refuse_unknown_options(sorted(unknown))
    policy = OffloadPolicy(
        tier=Tier.parse(tier),
        nvme_path=_absolute(nvme_path),
        lr=lr, betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,  # type: ignore[arg-type]
        eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
        dtype=(model_dtype(model) if isinstance(model, nn.Module) else torch.float32) if dtype is None else dtype,
        device=resolve_device(device),
        device_memory=parse_bytes(device_memory, "device_memory"),
        host_memory=parse_bytes(host_memory, "host_memory"),
        grad_accumulation_steps=grad_accumulation_steps,
        param_groups=parse_param_groups(param_groups),
        overlap_step=overlap_step,
        moments=MomentFormat.parse(moments),
        activations=Activations.parse(activations),
        activation_memory=parse_bytes(activation_memory, "activation_memory"),
        shard_weights=ShardWeights.parse(shard_weights),
        speculative_clipping=speculative_clipping,
        zero_quantized_weights=zero_quantized_weights,
        zero_quantized_gradients=zero_quantized_gradients,
        zero_hpz_partition_size=zero_hpz_partition_size,
        disk_weights=DiskWeights.parse(disk_weights),
    )
    if policy.tier is Tier.NVME:
        _check_nvme_path(policy.nvme_path)
    if init is not None and not callable(init):
        raise OffloadConfigError(f"init must be a function of one module, got {init!r}")
    if not isinstance(model, nn.Module):
        raise OffloadConfigError(f"offload.wrap needs a torch.nn.Module, got {type(model).__name__}")
    source = WeightSource(weights) if weights is not None else None
    engine = Engine(model, policy, choose(model, source, init))
    adopt_accelerate()  # accelerate imported: its prepare() leaves this module to the engine, not to DDP
    return engine


def model_dtype(model: nn.Module) -> torch.dtype:
    """The compute dtype that casts nothing: the dtype every floating parameter already has, or float32 when
    they differ or offload does not compute in theirs (only fp32 parameters take the compute dtype, so float32
    leaves each one as the user made it; a float64 one is then refused by name, with the fix)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return dtype if dtype in COMPUTE_DTYPES else torch.float32


def _refuse_unknown_options(names: List[str]) -> None:
    valid = [n for n in inspect.signature(wrap).parameters if n not in ("model", "unknown")]
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise OffloadConfigError(f"unknown option {', '.join(hints)}; valid options are {', '.join(valid)}")


def _absolute(path: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    """The swap directory as an absolute path, so a later os.chdir cannot move where close() cleans up
    ("" stays "": the policy refuses it by name)."""
    if path is None:
        return None
    text = os.fspath(path)
    return os.path.abspath(text) if text else text


def _check_nvme_path(path: Optional[str]) -> None:
    """Fail at wrap() on a swap directory that cannot work, before anything is allocated."""
    assert path is not None
    if not os.path.exists(path):
        raise OffloadConfigError(f"nvme_path {path!r} does not exist; create it (mkdir -p) on a fast local disk")
    if not os.path.isdir(path):
        raise OffloadConfigError(f"nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadConfigError(f"nvme_path {path!r} is not writable by this user")
