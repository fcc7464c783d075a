"""A block's record with `LocalReduction` on its own (records/block_record.py, modes/reduction.py): an `UpdateJob`
and a `ParkJob` (norms) of one block built with its records (records/: the block record, group records, group states
with a `MemoryStore` and a `GradHome`), run by a real `StepWorker` through the block's `BlockServices`.

The block: a bf16 linear and an fp32 LayerNorm (kept fp32, [Note: compute dtypes]), so two flat groups."""

from __future__ import annotations

import threading
import warnings
from typing import Dict, Iterator, List

import pytest
import torch
from torch import nn

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block, build_blocks
from offload.scheduler.modes.reduction import LocalReduction
from offload.scheduler.records.block_record import BlockRecord, BlockServices, GroupUpdate, ParkJob, UpdateJob
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.grad_home import GradHome
from offload.scheduler.records.group import GroupRecord, GroupState
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.records.pending_guard import PendingGuard
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.state.state_store import MemoryStore
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.weights.weight_home import DeviceHome
from offload.scheduler.worker.counters import StepCounters
from offload.scheduler.worker.step_worker import StepWorker
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier
from offload.trace import Tracer

CPU = torch.device("cpu")
HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


class Logged:
    """A `StateStore` that is `inner`, logging the update-side calls (`load`, `discard`)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.calls: List[str] = []

    def load(self, start: int, stop: int, shadow: bool = False):
        self.calls.append("load")
        return self.inner.load(start, stop, shadow)

    def discard(self) -> None:
        self.calls.append("discard")
        self.inner.discard()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)


class Net(nn.Module):
    """Blocks are the layers of the main layer list: "layers.0" is the one tested."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


class OneBlock:
    """The block's records as placement builds them (setup/placement.py), and the services they work with."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        net = Net()
        self.model = net.layers[0]
        with torch.no_grad():
            self.model.norm.weight.uniform_(0.5, 1.5)  # not all ones: weight decay shows
        self.block: Block = build_blocks(net, torch.bfloat16)[0]
        assert self.block.name == "layers.0" and len(self.block.groups) == 2
        self.worker = StepWorker(1)
        copies = CopyContext(CPU)
        tracer, counters, reduction = Tracer(), StepCounters(), LocalReduction()
        self.nonfinite = NonFiniteSkips()
        streamer = WeightStreamer(DeviceTier(CPU, None), copies)
        self.services = BlockServices(self.worker, streamer, tracer, counters, ForwardOrder(1), reduction,
                                      PendingGuard(streamer.read_through), self.nonfinite, 1)
        self.stores: Dict[torch.dtype, Logged] = {}
        groups = []
        for group in self.block.groups:
            buffer = torch.empty(group.numel, dtype=group.dtype)
            for slot in group.slots:
                buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
            group.device_buffer = buffer
            group.point_params_at(buffer)
            store = self.stores[group.dtype] = Logged(MemoryStore(group, CPU, on_host=True))
            grads = GradHome(group, CPU, copies, off_device=False)
            state = GroupState(group, store, grads, [0] * len(group.trainable_slots))  # type: ignore[arg-type]
            groups.append(GroupRecord(self.block, group, DeviceHome(group, whole_state=True), state))
        self.record = BlockRecord(self.block, groups, False, self.services)

    def group(self, dtype: torch.dtype) -> GroupRecord:
        return next(g for g in self.record.groups if g.group.dtype == dtype)

    def give_grad(self, name: str, grad: torch.Tensor) -> None:
        """A parameter's gradient into its group's gradient home, as the backward's `on_grad` puts it."""
        for group in self.record.groups:
            for index, slot in enumerate(group.group.trainable_slots):
                if slot.name == f"layers.0.{name}":
                    assert group.state is not None
                    group.state.grads.accumulate(index, grad.to(group.group.dtype))
                    return
        raise KeyError(name)

    def run_update(self, check_finite: bool = True) -> UpdateJob:
        parts = []
        for group in self.record.groups:
            state = group.state
            assert state is not None
            parts.append(GroupUpdate(group, state.grads.ready_indices(), state.hypers_of((HYPER,)),
                                     group.home.update_target()))
        job = UpdateJob(self.record, parts, 1.0, check_finite, 0)
        self.worker.submit(self.block.index, job)
        self.worker.wait(self.block.index)
        return job

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def one_block() -> Iterator[OneBlock]:
    made = OneBlock()
    yield made
    made.close()


def _adamw(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """torch.optim.AdamW's first step of an fp32 copy of `param`."""
    master = nn.Parameter(param.detach().float().clone())
    master.grad = grad.float()
    torch.optim.AdamW([master], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                      weight_decay=HYPER.weight_decay, foreach=False).step()
    return master.detach()


def test_an_update_changes_exactly_the_parameters_with_a_gradient(one_block):
    before = {name: p.detach().clone() for name, p in one_block.model.named_parameters()}
    grads = {"fc.weight": torch.randn(5, 6), "norm.bias": torch.randn(5)}
    for name, grad in grads.items():
        one_block.give_grad(name, grad)
    one_block.run_update()
    for name, param in one_block.model.named_parameters():
        if name not in grads:
            assert torch.equal(param.detach(), before[name]), f"{name} has no gradient: untouched"
            continue
        want = _adamw(before[name], grads[name]).to(param.dtype)
        rtol = 1e-2 if param.dtype == torch.bfloat16 else 1e-6  # bf16: the fp32 master's step, rounded
        torch.testing.assert_close(param.detach(), want, atol=0, rtol=rtol)
        assert not torch.equal(param.detach(), before[name])
    for dtype in (torch.bfloat16, torch.float32):
        group = one_block.group(dtype)
        assert group.state is not None
        names = [slot.name.removeprefix("layers.0.") for slot in group.group.trainable_slots]
        assert group.state.steps == [1 if n in grads else 0 for n in names], "only ready parameters count a step"
        store = group.state.store
        for slot in group.group.trainable_slots:  # the moments of a parameter without gradient stay zero
            moments = store.inner.exp_avg[slot.offset:slot.offset + slot.numel]
            assert bool((moments != 0).any()) == (slot.name.removeprefix("layers.0.") in grads), slot.name
    counters = one_block.services.counters
    assert counters.update_seconds > 0 and one_block.nonfinite.block_skips == 0


def test_a_group_with_a_nan_gradient_is_skipped_when_checked_and_counted(one_block):
    before = {name: p.detach().clone() for name, p in one_block.model.named_parameters()}
    one_block.give_grad("fc.weight", torch.randn(5, 6))
    one_block.give_grad("norm.weight", torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0]))
    with pytest.warns(RuntimeWarning, match=r"optimizer step 1: non-finite gradients.*first: 'layers.0'"):
        one_block.run_update(check_finite=True)
    assert torch.equal(one_block.model.norm.weight.detach(), before["norm.weight"]), "the NaN group keeps its weights"
    assert not torch.equal(one_block.model.fc.weight.detach(), before["fc.weight"]), "the finite group steps"
    nan_group = one_block.group(torch.float32)
    assert nan_group.state is not None and nan_group.state.steps == [0, 0]
    assert one_block.stores[torch.float32].calls == ["discard"], "skipped: its reads dropped, never loaded"
    assert one_block.stores[torch.bfloat16].calls == ["load"]
    nonfinite = one_block.nonfinite
    assert nonfinite.block_skips == 1 and nonfinite.steps == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per step: the second skip of step 1 is counted, not warned
        one_block.run_update(check_finite=True)
    assert nonfinite.block_skips == 2 and nonfinite.steps == 1


def test_unchecked_a_nan_gradient_is_stepped_on(one_block):
    one_block.give_grad("norm.weight", torch.full((5,), float("nan")))
    one_block.run_update(check_finite=False)
    assert bool(one_block.model.norm.weight.detach().isnan().all())
    assert one_block.nonfinite.block_skips == 0


def test_an_update_with_no_ready_gradient_never_touches_a_store(one_block):
    before = {name: p.detach().clone() for name, p in one_block.model.named_parameters()}
    one_block.run_update()
    assert all(torch.equal(p.detach(), before[n]) for n, p in one_block.model.named_parameters())
    assert all(store.calls == [] for store in one_block.stores.values())


def test_a_norm_job_fills_the_blocks_norms_in_slot_order(one_block):
    grads = {"fc.bias": torch.randn(5), "fc.weight": torch.randn(5, 6), "norm.weight": torch.randn(5)}
    for name, grad in grads.items():
        one_block.give_grad(name, grad)
    assert one_block.record.norms is None
    one_block.worker.submit(one_block.block.index, ParkJob(one_block.record, True))
    one_block.worker.wait(one_block.block.index)
    norms = one_block.record.norms
    assert norms is not None
    params = dict(one_block.model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    assert [names[id(p)] for p, _n in norms] == ["fc.weight", "fc.bias", "norm.weight"], "trainable-slot order"
    for param, norm in norms:
        name = names[id(param)]
        want = torch.linalg.vector_norm(grads[name].to(param.dtype), 2, dtype=torch.float32)
        assert norm == pytest.approx(float(want), rel=1e-6), name
    one_block.record.end_step()
    assert one_block.record.norms is None


def test_the_record_waits_for_its_own_job_and_every_wait_raises_after_a_failure(one_block):
    """The record keeps the future of its last job: settled while it runs or not, waited for once; after any job
    of the worker failed, every wait raises, a record with nothing pending included."""
    record, worker = one_block.record, one_block.worker
    assert record.is_settled() and record.job is None
    record.wait_for_update(counted=False)  # nothing submitted: no wait, nothing raised
    gate = threading.Event()
    record.job = worker.submit(record.block.index, gate.wait, record.priority())
    assert not record.is_settled()
    gate.set()
    record.wait_for_update(counted=True)
    assert record.job is None and record.is_settled()
    record.job = worker.submit(record.block.index, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        record.wait_for_update(counted=False)
    assert record.job is not None, "a job that raised stays until a wait returns"
    with pytest.raises(OffloadError, match="ZeroDivisionError"):
        record.wait_for_update(counted=False)
    other = worker.submit(99, lambda: None)  # another block's job: the worker is poisoned for every wait
    other.result()
    record.job = None
    with pytest.raises(OffloadError, match="an optimizer update failed earlier"):
        record.wait_for_update(counted=False)
