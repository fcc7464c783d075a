"""`HookSet` on its own (phases/hooks.py): attached to a small model with fake phases that log every call, so
the order torch calls them in is seen directly, without an engine: the root's forward encloses every owner's,
each owning module names its blocks (a tied weight's second owner names both), a backward begins once
before any gradient, each trainable parameter's gradient arrives once, the state-dict hooks run, and
`remove()` leaves the model as it was (hook dicts and `__deepcopy__` included)."""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Tuple

import pytest
import torch
from torch import nn

from offload.scheduler.blocks.block import Block, build_blocks, param_owners
from offload.scheduler.phases.hooks import HookSet

Call = Tuple[Any, ...]


class MayFail(nn.Linear):
    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the forward failed on purpose")
        return super().forward(x)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), MayFail(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """Blocks "emb", "layers.0", "layers.1", "head"; the head's weight is the embedding's (tied), so the head
    module owns parameters of two blocks; "layers.1.b" is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Pair(), Pair()])
        self.head = nn.Linear(8, 10)
        self.head.weight = self.emb.weight
        self.layers[1].b.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class FakePhases:
    """Every phase protocol the hooks call (ForwardHooks, BackwardHooks, StateDictHooks, Synchronizing),
    logging each call with the names of the blocks or the parameter it was given."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: List[Call] = []
        self._names = {id(p): n for n, p in model.named_parameters()}

    def begin_root_forward(self, tokens=None) -> None:
        self.calls.append(("begin_root_forward",))

    def end_root_forward(self) -> None:
        self.calls.append(("end_root_forward",))

    def pre_forward(self, blocks: List[Block]) -> None:
        self.calls.append(("pre", tuple(b.name for b in blocks)))

    def post_forward(self, blocks: List[Block]) -> None:
        self.calls.append(("post", tuple(b.name for b in blocks)))

    def begin_backward(self) -> None:
        self.calls.append(("begin_backward",))

    def on_grad(self, param: nn.Parameter) -> None:
        self.calls.append(("grad", self._names[id(param)]))

    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        self.calls.append(("state_dict", None if blocks is None else tuple(b.name for b in blocks)))

    def after_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        self.calls.append(("after_state_dict", prefix, len(state_dict)))

    def after_owner_state_dict(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        self.calls.append(("after_owner_state_dict", prefix))

    def before_load_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        self.calls.append(("load", None if blocks is None else tuple(b.name for b in blocks)))

    def after_load_state_dict(self) -> None:
        self.calls.append(("after_load",))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


def _attached() -> Tuple[Net, FakePhases, HookSet]:
    torch.manual_seed(0)
    model = Net()
    blocks = build_blocks(model, torch.float32)
    assert [b.name for b in blocks] == ["emb", "layers.0", "layers.1", "head"]
    phases = FakePhases(model)
    hooks = HookSet()
    hooks.attach(model, blocks, param_owners(model), phases, phases, phases, phases, records=[])
    return model, phases, hooks


def _hook_entries(module: nn.Module) -> int:
    """Entries in every hook dict of the module (forward, state dict, load, their kwargs / always-called sets)."""
    return sum(len(v) for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict))


def _grad_hooks(model: nn.Module) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


FORWARD = [("begin_root_forward",),
           ("pre", ("emb",)), ("post", ("emb",)),
           ("pre", ("layers.0",)), ("post", ("layers.0",)), ("pre", ("layers.0",)), ("post", ("layers.0",)),
           ("pre", ("layers.1",)), ("post", ("layers.1",)), ("pre", ("layers.1",)), ("post", ("layers.1",)),
           ("pre", ("emb", "head")), ("post", ("emb", "head")),
           ("end_root_forward",)]
TRAINABLE = ["emb.weight", "layers.0.a.weight", "layers.0.a.bias", "layers.0.b.weight", "layers.0.b.bias",
             "layers.1.a.weight", "layers.1.a.bias", "head.bias"]


def test_the_root_forward_encloses_every_owners_pre_and_post_forward_with_its_blocks():
    model, phases, hooks = _attached()
    model(torch.tensor([[1, 2, 3]]))
    assert phases.calls == FORWARD
    phases.calls.clear()
    with torch.no_grad():  # an evaluation forward: the same phases, no backward hooked
        model(torch.tensor([[1, 2, 3]]))
    assert phases.calls == FORWARD
    hooks.remove()


def test_a_backward_begins_once_before_any_gradient_and_each_trainable_parameter_reports_once():
    model, phases, hooks = _attached()
    model(torch.tensor([[1, 2, 3]])).square().mean().backward()
    after_forward = phases.calls[len(FORWARD):]
    assert after_forward[0] == ("begin_backward",)
    assert [c for c in after_forward if c[0] == "begin_backward"] == [("begin_backward",)]
    grads = [c[1] for c in after_forward if c[0] == "grad"]
    assert sorted(grads) == sorted(TRAINABLE), "once each (the tied weight too), none for the frozen one"
    assert len(after_forward) == 1 + len(TRAINABLE)
    hooks.remove()


def test_a_forward_that_raises_still_closes_the_owner_and_the_root():
    model, phases, hooks = _attached()
    model.layers[0].b.fail = True
    with pytest.raises(RuntimeError, match="on purpose"):
        model(torch.tensor([[1, 2, 3]]))
    assert phases.calls == FORWARD[:7] + [("end_root_forward",)], "the failing owner's post_forward too"
    hooks.remove()


def test_state_dict_and_load_state_dict_reach_the_root_and_every_owner():
    model, phases, hooks = _attached()
    state = model.state_dict()
    assert phases.calls[0] == ("state_dict", None), "the root's first"
    assert phases.calls.pop() == ("after_state_dict", "", len(state)), "the root's post-hook last, on everything"
    after = [c[1] for c in phases.calls if c[0] == "after_owner_state_dict"]  # each owner's post-hook, its prefix
    owners = [c[1] for c in phases.calls[1:] if c[0] == "state_dict"]
    assert len(phases.calls) == 1 + len(owners) + len(after)
    assert owners == [("emb",), ("layers.0",), ("layers.0",), ("layers.1",), ("layers.1",), ("emb", "head")]
    assert after == ["emb.", "layers.0.a.", "layers.0.b.", "layers.1.a.", "layers.1.b.", "head."]
    phases.calls.clear()
    model.layers[0].state_dict()  # a sub-module's own: its owners, not the root
    assert phases.calls == [("state_dict", ("layers.0",)), ("after_owner_state_dict", "a."),
                            ("state_dict", ("layers.0",)), ("after_owner_state_dict", "b.")]
    phases.calls.clear()
    model.load_state_dict(state)
    assert phases.calls[0] == ("load", None) and phases.calls[-1] == ("after_load",)
    assert [c[1] for c in phases.calls[1:-1]] == owners
    hooks.remove()


def test_a_deepcopy_while_attached_synchronizes_and_carries_no_hook():
    model, phases, hooks = _attached()
    twin = copy.deepcopy(model)
    assert phases.calls == [("synchronize",)]
    assert all(_hook_entries(m) == 0 for m in twin.modules()) and _grad_hooks(twin) == 0
    assert all("__deepcopy__" not in vars(m) for m in twin.modules())
    phases.calls.clear()
    twin(torch.tensor([[1, 2, 3]])).sum().backward()
    assert phases.calls == [], "the copy is plain PyTorch"
    hooks.remove()


def test_remove_leaves_no_hook_and_no_deepcopy_and_keeps_the_users_own():
    torch.manual_seed(0)
    model = Net()
    seen: List[str] = []
    mine = model.layers[0].a.register_forward_hook(lambda *args: seen.append("mine"))
    before = {name: _hook_entries(m) for name, m in model.named_modules()}
    blocks = build_blocks(model, torch.float32)
    phases = FakePhases(model)
    hooks = HookSet()
    hooks.attach(model, blocks, param_owners(model), phases, phases, phases, phases, records=[])
    holders = [m for m in model.modules() if next(m.parameters(), None) is not None]
    assert all("__deepcopy__" in vars(m) for m in holders)
    assert sum(_hook_entries(m) for m in model.modules()) > sum(before.values())
    assert _grad_hooks(model) == len(TRAINABLE)
    hooks.remove()
    assert {name: _hook_entries(m) for name, m in model.named_modules()} == before
    assert _grad_hooks(model) == 0
    assert all("__deepcopy__" not in vars(m) for m in model.modules())
    hooks.remove()  # twice: nothing left to remove
    phases.calls.clear()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert phases.calls == [] and seen == ["mine"]
    mine.remove()
