"""A small flat group and its gradient homes, built on their own (as setup/placement.py builds them)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from offload.scheduler.blocks.block import FlatGroup, ParamSlot
from offload.scheduler.records.grad_home import GradHome
from offload.tiers.copies import CopyContext
from offload.tiers.grad_window import GradPool

TRAINABLE_SHAPES: Tuple[Tuple[int, ...], ...] = ((3, 4), (5,), (2, 3))  # elements 0..12, 12..17, 17..23
HOME_KINDS = ["host", "windowed"]


def make_group(dtype: torch.dtype = torch.float32, name: str = "blk") -> FlatGroup:
    """Three trainable parameters and a frozen one, pointing into the group's device buffer (the cpu)."""
    slots: List[ParamSlot] = []
    offset = 0
    for i, shape in enumerate(TRAINABLE_SHAPES + ((2,),)):
        trainable = i < len(TRAINABLE_SHAPES)
        param = nn.Parameter(torch.randn(shape).to(dtype), requires_grad=trainable)
        slots.append(ParamSlot(f"{name}.p{i}", param, param.shape, offset, param.numel(), trainable))
        offset += param.numel()
    group = FlatGroup(dtype, slots, name)
    group.device_buffer = torch.zeros(group.numel, dtype=dtype)
    group.point_params_at(group.device_buffer)
    return group


def make_home(kind: str, group: FlatGroup, off_device: bool = True, pool: Optional[GradPool] = None,
              padded_numel: Optional[int] = None) -> Tuple[GradHome, CopyContext]:
    """The group's gradient home of `kind` on the host (a buffer of its own, or one from a window), with the cpu
    device's copy context."""
    copies = CopyContext(torch.device("cpu"))
    cpu = torch.device("cpu")
    if kind == "host":
        return GradHome(group, cpu, copies, off_device, padded_numel), copies
    pool = pool if pool is not None else GradPool(1 << 20)
    return GradHome(group, cpu, copies, off_device, padded_numel, pool), copies


def grad_of(group: FlatGroup, index: int, value: Optional[float] = None) -> torch.Tensor:
    """A gradient for trainable parameter `index` (random, or filled with `value`), in its shape."""
    slot = group.trainable_slots[index]
    if value is not None:
        return torch.full(slot.shape, value, dtype=group.dtype)
    return torch.randn(slot.shape).to(group.dtype)


def piece(home: GradHome, index: int) -> torch.Tensor:
    """Parameter `index`'s range of the home's flat gradient."""
    slot = home.group.trainable_slots[index]
    return home.buffer()[slot.offset:slot.offset + slot.numel]
