"""Where a block's first weights come from when `materialize` gives it its flat buffers.

- `FromModule`: the parameters themselves (a model built in memory, the default);
- `FromSource`: a pretrained checkpoint read tensor by tensor (`wrap(model, weights=PATH)`), for a model
  built on the meta device or one whose weights it simply overwrites;
- `ByInit`: a model built on the meta device and initialized block by block, by its modules'
  `reset_parameters()` or the user's `init(module)` (for HF models, `model._init_weights`).

`check()` runs before any memory or file is allocated: names, shapes and meta buffers are refused there,
by name, as `load_state_dict(strict=True)` would. See docs/design.md [Note: lazy construction].
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from offload.errors import OffloadConfigError
from offload.scheduler.blocks.block import Block
from offload.scheduler.torch_internals import own_buffers, own_parameters

Init = Callable[[nn.Module], None]
Span = Tuple[int, int]
_LISTED = 8  # names shown per kind of mismatch


class InitialWeights(Protocol):
    """Fills each block's device buffers as it is materialized."""

    def check(self, module: nn.Module, blocks: List[Block]) -> None: ...

    def copies_parameters(self) -> bool: ...

    def reads_parts(self) -> bool:
        """Whether `fill` can fill only given element ranges, the same on every rank (a checkpoint file): sharded
        weights then read each rank's part and nothing is broadcast."""
        ...

    def fill(self, block: Block, parts: Optional[Sequence[Span]] = None) -> None:
        """Fill the block's buffers; `parts`: per group, the elements [a, b) to fill (the rest stays unset)."""
        ...

    def finish(self, module: nn.Module, device: torch.device) -> None: ...


class FromModule:
    """The model's own (materialized) parameters: `materialize` copies them into the buffers."""

    def check(self, module: nn.Module, blocks: List[Block]) -> None:
        _refuse_meta_buffers(module, set())

    def copies_parameters(self) -> bool:
        return True

    def reads_parts(self) -> bool:
        return False

    def fill(self, block: Block, parts: Optional[Sequence[Span]] = None) -> None:
        pass

    def finish(self, module: nn.Module, device: torch.device) -> None:
        pass


class Tensors(Protocol):
    """Named tensors to start from (checkpoint/weight_source.py's `WeightSource`: a safetensors file, Hugging Face
    shards or an offload checkpoint), an input the scheduler reads without knowing its format."""

    path: str
    shapes: Dict[str, Tuple[int, ...]]
    dtypes: Dict[str, torch.dtype]
    @property
    def verifies(self) -> bool:
        """Whether each read is checked against a checksum (a part of a tensor then cannot be)."""

    def names(self) -> List[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def read(self, name: str) -> Tensor: ...

    def read_into(self, name: str, out: Tensor) -> None: ...

    def read_range_into(self, name: str, start: int, out: Tensor) -> None: ...


class FromSource:
    """A checkpoint's tensors, matched by name as `load_state_dict(strict=True)` matches them (a tie stored
    once under any of its names is fine), converted to each parameter's compute dtype on the fly."""

    def __init__(self, source: Tensors) -> None:
        self.source = source
        self._names_of: Dict[int, List[str]] = {}  # id(param) -> every name of it in the module

    def check(self, module: nn.Module, blocks: List[Block]) -> None:
        for name, param in module.named_parameters(remove_duplicate=False):
            self._names_of.setdefault(id(param), []).append(name)
        buffers = _persistent_buffers(module)
        aliases = list(self._names_of.values()) + [[name] for name, _buf in buffers]
        shapes = {name: tuple(p.shape) for name, p in module.named_parameters(remove_duplicate=False)}
        shapes.update({name: tuple(b.shape) for name, b in buffers})
        missing = [group[0] for group in aliases if not any(n in self.source for n in group)]
        unexpected = [n for n in self.source.names() if n not in shapes]
        mismatched = [f"{n}: checkpoint {list(self.source.shapes[n])}, model {list(shapes[n])}"
                      for n in self.source.names() if n in shapes and self.source.shapes[n] != shapes[n]]
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing[:_LISTED])}")
        if unexpected:
            problems.append(f"not in the model ({len(unexpected)}): {', '.join(unexpected[:_LISTED])}")
        if mismatched:
            problems.append(f"shapes differ ({len(mismatched)}): {'; '.join(mismatched[:_LISTED])}")
        if problems:
            raise OffloadConfigError(f"weights={self.source.path!r} does not match the model, as "
                                     f"load_state_dict(strict=True) would say: {' | '.join(problems)}")
        _refuse_meta_buffers(module, set(self.source.names()))

    def copies_parameters(self) -> bool:
        return False

    def reads_parts(self) -> bool:
        return True

    def fill(self, block: Block, parts: Optional[Sequence[Span]] = None) -> None:
        with torch.no_grad():
            for index, group in enumerate(block.groups):
                assert group.device_buffer is not None
                a, b = (0, group.numel) if parts is None else parts[index]
                for slot in group.slots:
                    lo, hi = max(a, slot.offset), min(b, slot.offset + slot.numel)
                    if lo >= hi:
                        continue  # outside this rank's part
                    name = next(n for n in self._names_of[id(slot.param)] if n in self.source)
                    target = group.device_buffer[lo:hi]
                    if hi - lo < slot.numel and not self.source.verifies:
                        self._read_part(name, lo - slot.offset, target)
                    elif target.device.type == "cpu" and self.source.dtypes[name] == target.dtype and hi - lo == slot.numel:
                        self.source.read_into(name, target)  # straight into the block's buffer
                    else:  # converts dtype, moves to the device; an offload checkpoint's tensor is verified whole
                        target.copy_(self.source.read(name).reshape(-1)[lo - slot.offset:hi - slot.offset])

    def _read_part(self, name: str, start: int, target: Tensor) -> None:
        """Elements [start, start + target.numel()) of tensor `name` into `target` (converted, moved)."""
        if target.device.type == "cpu" and self.source.dtypes[name] == target.dtype:
            self.source.read_range_into(name, start, target)
            return
        piece = torch.empty(target.numel(), dtype=self.source.dtypes[name])
        self.source.read_range_into(name, start, piece)
        target.copy_(piece)

    def finish(self, module: nn.Module, device: torch.device) -> None:
        """The checkpoint's buffers (e.g. BatchNorm statistics) replace the module's."""
        for name, buf in _persistent_buffers(module):
            owner_path, _, key = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            value = self.source.read(name)
            own_buffers(owner)[key] = value.to(device=device, dtype=buf.dtype).clone()


class ByInit:
    """A meta model initialized block by block: each module whose parameters become real is initialized by
    `init(module)`, or its `reset_parameters()` when `init` is None, once all of its parameters in this
    block are real; a parameter initialized earlier (a tie) is kept as it was. Every parameter must come
    out finite: the buffers start as NaN, so one no initializer touched is named."""

    def __init__(self, module: nn.Module, init: Optional[Init]) -> None:
        self.init = init
        self._order = [m for m in module.modules() if any(p is not None for p in own_parameters(m).values())]
        self._done: Set[int] = set()  # parameters initialized so far (by id)

    def check(self, module: nn.Module, blocks: List[Block]) -> None:
        if self.init is None:
            bare = [name for name, m in module.named_modules()
                    if any(p is not None for p in own_parameters(m).values()) and not hasattr(m, "reset_parameters")]
            if bare:
                raise OffloadConfigError(
                    f"modules without reset_parameters() hold parameters on the meta device ({len(bare)}, first: "
                    f"{bare[0]!r}): pass init=fn(module) to offload.wrap (for Hugging Face models, "
                    "init=model._init_weights), or weights=<a checkpoint>")
        _refuse_meta_buffers(module, set())

    def copies_parameters(self) -> bool:
        return False

    def reads_parts(self) -> bool:
        return False

    def fill(self, block: Block, parts: Optional[Sequence[Span]] = None) -> None:
        in_block = {id(slot.param) for slot in block.slots}
        with torch.no_grad():
            for group in block.groups:
                assert group.device_buffer is not None
                if group.dtype.is_floating_point:
                    group.device_buffer.fill_(float("nan"))
                group.point_params_at(group.device_buffer)
            for module in self._order:
                own = [p for p in own_parameters(module).values() if p is not None]
                fresh = [p for p in own if id(p) in in_block and id(p) not in self._done]
                if not fresh or any(p.is_meta for p in own if id(p) not in self._done and id(p) not in in_block):
                    continue  # nothing new here, or it still has parameters of a later block
                kept = [(p, p.detach().clone()) for p in own if id(p) in self._done]
                self._initialize(module)
                for param, value in kept:
                    param.copy_(value)
                self._done.update(id(p) for p in fresh)
        for group in block.groups:
            assert group.device_buffer is not None
            for slot in group.slots:
                if slot.param.is_floating_point() and not bool(torch.isfinite(slot.param).all()):
                    raise OffloadConfigError(
                        f"parameter {slot.name!r} was not initialized (it is still NaN after "
                        f"{'init' if self.init is not None else 'reset_parameters()'} of the modules that own it): "
                        "pass init=fn(module) that covers it, or weights=<a checkpoint>")

    def _initialize(self, module: nn.Module) -> None:
        if self.init is not None:
            self.init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # type: ignore[operator]

    def finish(self, module: nn.Module, device: torch.device) -> None:
        pass


def choose(module: nn.Module, weights: Optional[Tensors], init: Optional[Init]) -> InitialWeights:
    """A checkpoint when given; else `init`, or reset_parameters() for a model with meta parameters; else
    the model's own parameters."""
    if weights is not None:
        return FromSource(weights)
    if init is not None or any(p.is_meta for p in module.parameters()):
        return ByInit(module, init)
    return FromModule()


def _persistent_buffers(module: nn.Module) -> List[Tuple[str, Tensor]]:
    """The buffers `module.state_dict()` holds (persistent ones), by their state-dict name."""
    out = []
    for owner_path, owner in module.named_modules():
        for key, buf in own_buffers(owner).items():
            if buf is not None and key not in owner._non_persistent_buffers_set:
                out.append((f"{owner_path}.{key}" if owner_path else key, buf))
    return out


def _refuse_meta_buffers(module: nn.Module, provided: Set[str]) -> None:
    """Buffers on the meta device that nothing will fill: named, with the fix."""
    meta = []
    for owner_path, owner in module.named_modules():
        for key, buf in own_buffers(owner).items():
            name = f"{owner_path}.{key}" if owner_path else key
            if buf is not None and buf.is_meta and name not in provided:
                meta.append(name)
    if meta:
        raise OffloadConfigError(
            f"buffers on the meta device that the weights do not hold ({len(meta)}, first: {meta[0]!r}): build the "
            "model under accelerate's init_empty_weights() (it keeps buffers real), or torch.device('meta') only "
            "around the parameters, so the buffers computed in __init__ (e.g. rotary frequencies) exist")
