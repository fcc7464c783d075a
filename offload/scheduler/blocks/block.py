"""Blocks: the unit every transfer, update and disk read works on.

A block is one layer of the model's main layer list (a transformer layer), or one of the remaining
top-level modules. Its parameters live in one flat contiguous buffer per dtype on the compute device, and
the user's `nn.Parameter` objects are kept (identity: optimizers, tied weights and user code still hold
them) with `.data` re-pointed to views of that buffer. No attribute is ever added to a parameter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.errors import OffloadConfigError, OffloadError
from offload.optim.moment_format import MomentFormat
from offload.planner.place import spec_of
from offload.planner.plan import BlockSpec
from offload.policy import Tier
from offload.scheduler.torch_internals import own_parameters
from offload.tiers.swap_layout import GroupShape

# The attribute a wrapped model carries: a weak reference to its engine (`wrap()` refuses a model that has one
# alive; `close()` and a deepcopy of the model remove it).
MARKER = "_offload_engine"

# Normalization layers keep their fp32 parameters under a lower compute dtype, as autocast does.
_NORM_TYPES: Tuple[type, ...] = tuple(
    t for t in (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None),
                nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) if t is not None
)


class Residency(enum.Enum):
    """Where a block's compute weights are: every change is checked against the allowed moves. Whether an
    upload into a resident block is still in flight (CUDA) is not residency but its copy event, kept in
    one place, the copy context (tiers/copies.py): the compute stream waits on it before the block is used."""

    RESIDENT = "resident"    # on the compute device, params point into the device buffer
    RELEASED = "released"    # device buffer freed; the weight home's copy is the only one


_ALLOWED_MOVES = {
    Residency.RESIDENT: {Residency.RELEASED},
    Residency.RELEASED: {Residency.RESIDENT},
}


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its block: name, shape and element range in the flat buffer of its dtype."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int
    trainable: bool


class FlatGroup:
    """All parameters of one block that share a compute dtype: one flat buffer, trainable ones first.

    Putting trainable parameters first makes their range `[0, trainable_numel)` contiguous, so the
    optimizer state, the gradient buffer and the updated weights are each a single flat tensor.
    """

    def __init__(self, dtype: torch.dtype, slots: List[ParamSlot], block_name: str = "") -> None:
        self.key = f"{block_name}/{str(dtype).replace('torch.', '')}"  # stable across processes: layouts use it
        self.dtype = dtype
        self.slots = slots
        self.numel = sum(s.numel for s in slots)
        self.trainable_slots = [s for s in slots if s.trainable]
        self.trainable_numel = sum(s.numel for s in self.trainable_slots)
        self.device_buffer: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def trainable_segments(self) -> List[Tuple[int, int]]:
        """Each trainable parameter's element range [start, stop): where int8 moments' blocks start over."""
        return [(s.offset, s.offset + s.numel) for s in self.trainable_slots]

    def shape(self, block: str) -> GroupShape:
        """What the swap file's layout needs of the group (tiers/swap_layout.py): `block` is its block's name."""
        params = tuple((s.name, tuple(s.shape), s.offset) for s in self.slots)
        return GroupShape(self.key, block, self.dtype, self.numel, self.trainable_numel, params,
                          params[:len(self.trainable_slots)])

    def point_params_at(self, buffer: torch.Tensor) -> None:
        """Re-point each parameter's `.data` to its view of `buffer` (the identity of the Parameter is kept;
        a parameter on the meta device first becomes a real, empty one in place: `.data` cannot change a
        tensor's type, `torch.utils.swap_tensors` can)."""
        for slot in self.slots:
            if slot.param.is_meta:
                _make_real(slot.name, slot.param, buffer)
            slot.param.data = buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)


class Block:
    """A named set of parameters moved and updated together; see the module docstring."""

    def __init__(self, name: str, index: int, groups: List[FlatGroup]) -> None:
        self.name = name
        self.index = index
        self.groups = groups
        self.residency = Residency.RESIDENT
        self.slots: List[ParamSlot] = [slot for group in groups for slot in group.slots]

    @property
    def weight_bytes(self) -> int:
        """Bytes of compute weights on the device when resident."""
        return sum(g.nbytes for g in self.groups)

    @property
    def trainable_numel(self) -> int:
        return sum(g.trainable_numel for g in self.groups)

    def spec(self, tier: Tier, moments: MomentFormat = MomentFormat.FP32, world: int = 1,
             sharded: bool = False) -> BlockSpec:
        """Bytes of the block's weights and optimizer state (fp32 master unless aliased, m, v, gradient); of one
        rank's part of the state among `world` data-parallel ranks, and of its weights when `sharded`."""
        largest_grad = max((slot.numel * g.dtype.itemsize for g in self.groups for slot in g.trainable_slots), default=0)
        part = sum(-(-g.numel // world) * g.dtype.itemsize for g in self.groups) if sharded else None
        per_rank = None
        if sharded:  # the state part is cut at the weights' part size (rank 0's is the largest); the gradient
            per_rank = [(min(-(-g.numel // world), g.trainable_numel),
                         -(-g.numel // world) * world if g.trainable_numel else 0) for g in self.groups]  # padded
        return spec_of(self.name, self.weight_bytes, [(g.trainable_numel, g.dtype) for g in self.groups], tier,
                       largest_grad, moments, world, part, per_rank)

    def move_to(self, new: Residency) -> None:
        """Change residency; a move the state machine does not allow is a bug, reported loudly."""
        if new not in _ALLOWED_MOVES[self.residency]:
            raise OffloadError(f"block {self.name!r}: illegal residency change {self.residency.value} -> {new.value}")
        self.residency = new

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {self.weight_bytes} bytes, {self.residency.value})"


def _make_real(name: str, param: nn.Parameter, like: torch.Tensor) -> None:
    """Turn a meta parameter into an empty real one, the same Python object (its own version counter)."""
    real = nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, real)
    except RuntimeError as exc:
        raise OffloadConfigError(f"parameter {name!r} on the meta device cannot be materialized in place ({exc}); "
                                 "drop the weak references to it before offload.wrap()") from None


_DTYPE_MISMATCH = ("same dtype", "expected scalar type", "expected both", "type (float)", "dtype mismatch",
                   "expected mat1 and mat2")


def mixed_dtype_hint(exc: RuntimeError, compute: torch.dtype, device: torch.device,
                     blocks: List["Block"]) -> Optional[str]:
    """For a forward that failed on mixed dtypes while normalization weights stay fp32 under a lower compute
    dtype ([Note: compute dtypes]): the fix (autocast), else None."""
    if compute == torch.float32 or not any(m in str(exc) for m in _DTYPE_MISMATCH):
        return None
    if not any(g.dtype == torch.float32 for b in blocks for g in b.groups):
        return None
    name = str(compute).replace("torch.", "")
    return (f"the forward failed on mixed dtypes ({exc}): offload computes in {name} but keeps normalization "
            f"layers' weights fp32, as autocast does, so a norm's fp32 output can meet a {name} layer; run the "
            f"forward under torch.autocast(device_type={device.type!r}, dtype=torch.{name}), or wrap with "
            "dtype=torch.float32")


def is_norm_layer(module: nn.Module) -> bool:
    """torch's normalization layers, and any module class named like one ("...Norm": HF's LlamaRMSNorm,
    T5LayerNorm, Qwen2RMSNorm are plain nn.Modules). Only a module's own parameters count, so a wrapper
    named "PreNorm" that holds a whole layer keeps that layer's weights in the compute dtype."""
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the fp32 optimizer state can master


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def find_layer_list(module: nn.Module) -> Optional[str]:
    """Path of the ModuleList/Sequential holding the most parameters (the transformer layers), or None.

    Only lists of at least two children count; ties go to the shallower list.
    """
    best: Optional[Tuple[int, int, str]] = None
    for path, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2 or child is module:
            continue
        size = sum(p.numel() for p in child.parameters())
        key = (size, -path.count("."), path)
        if size > 0 and (best is None or key[:2] > best[:2]):
            best = key
    return None if best is None else best[2]


def block_key(param_name: str, owner_path: str, layer_list: Optional[str]) -> str:
    """Name of the block a parameter belongs to.

    A parameter under the layer list belongs to its layer ("h.3"); any other belongs to the smallest module
    on its path that does not contain the layer list ("wte", "ln_f"), or to its owning module when that
    module contains the layer list (parameters registered directly on the root become "<root>").
    """
    parts = param_name.split(".")
    if layer_list is not None and param_name.startswith(layer_list + "."):
        depth = layer_list.count(".") + 2
        return ".".join(parts[:depth])
    ancestors = set()
    if layer_list is not None:
        pieces = layer_list.split(".")
        ancestors = {".".join(pieces[:i]) for i in range(1, len(pieces) + 1)}
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix not in ancestors:
            return prefix
    return owner_path or "<root>"


def build_blocks(module: nn.Module, compute_dtype: torch.dtype, allow_meta: bool = False) -> List[Block]:
    """Group the module's parameters into blocks (in registration order) and describe their flat layout.

    Tied parameters are stored once, under their first name. Floating fp32 parameters take
    `compute_dtype` unless they belong to a normalization layer; other dtypes are kept as they are.
    Allocation is the caller's job (see `Engine`), so this stays a pure description of the model.
    """
    layer_list = find_layer_list(module)
    norm_params = {id(p) for m in module.modules() if is_norm_layer(m) for p in m.parameters(recurse=False)}
    by_block: Dict[str, Dict[torch.dtype, List[Tuple[str, nn.Parameter]]]] = {}
    for name, param in module.named_parameters():
        if param.is_meta and not allow_meta:
            raise OffloadConfigError(
                f"parameter {name!r} is on the meta device: materialize the model first "
                "(model.to_empty(device='cpu') and load its weights) before offload.wrap()")
        if param.is_sparse:
            raise OffloadConfigError(f"parameter {name!r} is sparse; offload supports dense parameters only")
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        key = block_key(name, owner, layer_list)
        dtype = param.dtype
        if dtype == torch.float32 and id(param) not in norm_params:
            dtype = compute_dtype
        by_block.setdefault(key, {}).setdefault(dtype, []).append((name, param))
    blocks = []
    for index, (key, per_dtype) in enumerate(by_block.items()):
        groups = []
        for dtype, named in per_dtype.items():
            ordered = [np for np in named if np[1].requires_grad] + [np for np in named if not np[1].requires_grad]
            slots, offset = [], 0
            for name, param in ordered:
                if param.requires_grad and not (param.is_floating_point()):
                    raise OffloadConfigError(f"parameter {name!r} requires grad but has dtype {param.dtype}")
                if param.requires_grad and dtype not in TRAINABLE_DTYPES:
                    raise OffloadConfigError(
                        f"parameter {name!r} is {param.dtype}: offload trains fp32, bf16 and fp16 weights (fp32 "
                        "master weights and Adam state); convert the model first (model.float()), or freeze it "
                        "(requires_grad_(False))")
                slots.append(ParamSlot(name, param, param.shape, offset, param.numel(), param.requires_grad))
                offset += param.numel()
            groups.append(FlatGroup(dtype, slots, key))
        blocks.append(Block(key, index, groups))
    return blocks


def param_owners(module: nn.Module) -> Dict[int, List[nn.Module]]:
    """For each parameter (by id), every module that registers it directly: tied weights have several."""
    owners: Dict[int, List[nn.Module]] = {}
    for sub in module.modules():
        for param in own_parameters(sub).values():
            if param is not None:
                owners.setdefault(id(param), [])
                if all(m is not sub for m in owners[id(param)]):
                    owners[id(param)].append(sub)
    return owners
