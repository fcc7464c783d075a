"""The reduction and clipping modes on their own (modes/reduction.py, modes/clipping.py): `LocalReduction`'s answers
to a block's record (which groups step, the worker's priority, nothing to share), `NoClipping` and `NormClipping`
(which completed blocks they watch, what a completed block does, the step's scale), and the clipping maths against
torch.nn.utils.clip_grad_norm_ (`global_norm` in `model.parameters()` order, `clip_in_place`).

Real block records (records/: a `MemoryStore` and a `GradHome` per group, as placement builds them on the cpu
tier) where the maths is checked, fake blocks, workers and reductions where a mode only dispatches."""

from __future__ import annotations

import math
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import nn

from offload.scheduler.blocks.block import build_blocks
from offload.scheduler.modes.clipping import (
    LastBackward,
    NoClipping,
    NormClipping,
    Speculation,
    clip_in_place,
    clip_scale,
    global_norm,
)
from offload.scheduler.modes.reduction import LocalReduction
from offload.scheduler.records.block_record import BlockRecord, BlockServices, GroupUpdate, UpdateJob
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.grad_home import GradHome
from offload.scheduler.records.group import GroupRecord, GroupState
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.records.pending_guard import PendingGuard
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.state.hypers import StepHypers
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
GROUPS = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)


class Net(nn.Module):
    """Blocks "layers.0", "layers.1", "layers.2"; under bf16 each has a bf16 group (the linear) and an fp32 one
    (the LayerNorm, [Note: compute dtypes])."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer(), Layer()])


class Scalars(nn.Module):
    """Five blocks of one one-element parameter each: a gradient's norm is its one value."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(1, 1, bias=False) for _ in range(5)])


class Records:
    """Every block's record of `model` as placement builds them on the cpu tier, sharing one set of services
    (a real `StepWorker`, `LocalReduction`), and the slot table over them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.blocks = build_blocks(model, dtype)
        self.worker = StepWorker(1)
        copies = CopyContext(CPU)
        streamer = WeightStreamer(DeviceTier(CPU, None), copies)
        self.order = ForwardOrder(len(self.blocks))
        self.reduction = LocalReduction()
        self.nonfinite = NonFiniteSkips()
        self.services = BlockServices(self.worker, streamer, Tracer(), StepCounters(), self.order, self.reduction,
                                      PendingGuard(streamer.read_through), self.nonfinite, 1)
        self.records: List[BlockRecord] = []
        for block in self.blocks:
            groups = []
            for group in block.groups:
                buffer = torch.empty(group.numel, dtype=group.dtype)
                for slot in group.slots:
                    buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
                group.device_buffer = buffer
                group.point_params_at(buffer)
                state = None
                if group.trainable_numel:
                    state = GroupState(group, MemoryStore(group, CPU, on_host=True),
                                       GradHome(group, CPU, copies, off_device=False),
                                       [0] * len(group.trainable_slots))
                groups.append(GroupRecord(block, group, DeviceHome(group, whole_state=True), state))
            self.records.append(BlockRecord(block, groups, False, self.services))
        self.slots = SlotTable(self.records, model)
        self.params = dict(model.named_parameters())

    def give(self, name: str, grad: torch.Tensor) -> None:
        """A parameter's gradient into its group's gradient home, as the backward's `on_grad` puts it."""
        ref = self.slots[self.params[name]]
        ref.state.grads.accumulate(ref.index, grad.to(ref.state.group.dtype))

    def grad(self, name: str) -> Optional[torch.Tensor]:
        """The gradient the engine holds for a parameter (None: none since zero)."""
        ref = self.slots[self.params[name]]
        grads = ref.state.grads
        if not grads.has_grad[ref.index]:
            return None
        slot = ref.state.group.trainable_slots[ref.index]
        return grads.buffer()[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def job(self, record: BlockRecord, check_finite: bool, step: int = 0) -> UpdateJob:
        parts = []
        for group in record.groups:
            assert group.state is not None
            parts.append(GroupUpdate(group, group.state.grads.ready_indices(), group.state.hypers_of((HYPER,)),
                                     group.home.update_target()))
        return UpdateJob(record, parts, 1.0, check_finite, step)

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def net() -> Iterator[Records]:
    torch.manual_seed(0)
    made = Records(Net(), torch.bfloat16)
    yield made
    made.close()


def _fp32_records(model: nn.Module) -> Records:
    return Records(model, torch.float32)


def _torch_clip(model: nn.Module, grads: Dict[str, torch.Tensor], max_norm: float):
    """torch.nn.utils.clip_grad_norm_ over plain copies of the model's parameters (in `model.parameters()` order)
    holding `grads`: (its total norm, the clipped gradients by name)."""
    plain: Dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        copy = nn.Parameter(torch.zeros(param.shape, dtype=grads[name].dtype if name in grads else param.dtype))
        if name in grads:
            copy.grad = grads[name].clone()
        plain[name] = copy
    total = torch.nn.utils.clip_grad_norm_(list(plain.values()), max_norm, foreach=False)
    return total, {name: p.grad for name, p in plain.items() if p.grad is not None}


# ----- LocalReduction -------------------------------------------------------------------------------------
def test_local_reduction_steps_each_groups_ready_parameters(net):
    record = net.records[0]
    net.give("layers.0.fc.weight", torch.randn(5, 6))
    net.give("layers.0.norm.bias", torch.randn(5))
    net.give("layers.0.norm.weight", torch.full((5,), float("nan")))
    job = net.job(record, check_finite=False)
    assert [part.ready for part in job.parts] == [[0], [0, 1]]
    assert net.reduction.ready_to_step(record, job) == [[0], [0, 1]], "unchecked: the NaN group steps too"
    assert net.nonfinite.block_skips == 0, "unchecked: nothing counted"
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert net.reduction.ready_to_step(record, net.job(record, check_finite=True)) == [[0], None]
    assert net.nonfinite.block_skips == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_group_with_a_non_finite_gradient_is_skipped_and_counted_once_per_step(net, bad):
    record = net.records[1]
    net.give("layers.1.fc.bias", torch.tensor([0.0, bad, 0.0, 0.0, 0.0]))
    net.give("layers.1.norm.weight", torch.randn(5))
    job = net.job(record, check_finite=True, step=3)
    with pytest.warns(RuntimeWarning, match=r"optimizer step 4: non-finite gradients.*first: 'layers.1'"):
        assert net.reduction.ready_to_step(record, job) == [None, [0]]
    assert net.nonfinite.block_skips == 1 and net.nonfinite.steps == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same step again: counted, not warned
        assert net.reduction.ready_to_step(record, job) == [None, [0]]
    assert net.nonfinite.block_skips == 2 and net.nonfinite.steps == 1
    with pytest.warns(RuntimeWarning, match="optimizer step 5"):
        net.reduction.ready_to_step(record, net.job(record, check_finite=True, step=4))
    assert net.nonfinite.block_skips == 3 and net.nonfinite.steps == 2


def test_a_block_whose_groups_all_hold_non_finite_gradients_counts_one_skipped_block(net):
    record = net.records[0]
    net.give("layers.0.fc.weight", torch.full((5, 6), float("nan")))  # a NaN loss: every gradient NaN
    net.give("layers.0.norm.weight", torch.full((5,), float("nan")))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert net.reduction.ready_to_step(record, net.job(record, check_finite=True)) == [None, None]
    assert net.nonfinite.block_skips == 1, "one block skipped"


def test_local_reduction_shares_nothing_and_checks_nothing(net):
    record = net.records[0]
    net.give("layers.0.fc.weight", torch.randn(5, 6))
    state = record.states[0]
    before = state.grads.buffer().clone()
    out = torch.randn(state.group.trainable_numel).to(state.group.dtype)
    kept = out.clone()
    reduction = net.reduction
    assert reduction.send_new_weights(state, out) is None
    assert torch.equal(out, kept) and state.steps == [0, 0]
    reduction.take_back_average(record)
    reduction.check_torch_reads(record)
    assert torch.equal(state.grads.buffer(), before)
    assert reduction.zero_waits is False
    assert reduction.runs_every_update(True) is False and reduction.runs_every_update(False) is False


def test_local_reduction_runs_the_block_the_next_forward_needs_first(net):
    reduction = net.reduction
    assert [reduction.priority(p) for p in (0, 1, 7)] == [0, 1, 7], "the forward position itself"
    for index in (2, 0):  # the forward used block 2 first, then block 0; block 1 never
        net.order.record(index)
    assert [record.priority() for record in net.records] == [1, 3 + 1, 0]


def test_local_reduction_norms_are_each_groups_in_slot_order(net):
    record = net.records[2]
    grads = {"layers.2.fc.bias": torch.randn(5), "layers.2.norm.weight": torch.randn(5)}
    for name, grad in grads.items():
        net.give(name, grad)
    net.reduction.norms(record, 0)
    assert record.norms is not None
    names = {id(p): n for n, p in net.params.items()}
    assert [names[id(p)] for p, _n in record.norms] == list(grads)
    for param, norm in record.norms:
        want = torch.linalg.vector_norm(grads[names[id(param)]].to(param.dtype), 2, dtype=torch.float32)
        assert norm == float(want)


# ----- the clipping modes, dispatching ---------------------------------------------------------------------
class FakeBlock:
    """What a clipping mode asks of a block's record."""

    def __init__(self, spills: bool = False) -> None:
        self.spills = spills
        self.shadowed = False  # no speculation here (tests/test_speculative_clipping.py has it)
        self.speculated = False
        self.calls: List[Tuple] = []

    def update_early(self, hypers) -> None:
        self.calls.append(("update_early", hypers))

    def park_grads(self, norms: bool) -> None:
        self.calls.append(("park_grads", norms))


class FakeWorker:
    def __init__(self, log: List) -> None:
        self.log = log

    def wait_all(self) -> None:
        self.log.append("wait_all")


class FakeNormSource:
    def __init__(self, log: List, answer: Tuple[float, float]) -> None:
        self.log = log
        self.answer = answer

    def global_norm(self, blocks, slots, max_norm):
        self.log.append(("global_norm", blocks, slots, max_norm))
        return self.answer


@pytest.mark.parametrize("clipping", ["none", "norm"])
def test_a_clipping_mode_watches_the_last_backward_and_blocks_that_spill(clipping):
    mode = NoClipping() if clipping == "none" else NormClipping(1.0, FakeWorker([]), FakeNormSource([], (0, 1)))
    assert mode.watches(FakeBlock(spills=False), backward=LastBackward.DECLARED)
    assert mode.watches(FakeBlock(spills=True), backward=LastBackward.NO)
    assert mode.watches(FakeBlock(spills=True), backward=LastBackward.DECLARED)
    assert not mode.watches(FakeBlock(spills=False), backward=LastBackward.NO)


def test_no_clipping_updates_early_on_the_declared_last_backward_and_parks_otherwise():
    hypers = StepHypers([dict(g) for g in GROUPS])
    block = FakeBlock(spills=True)
    NoClipping().block_complete(block, hypers, backward=LastBackward.DECLARED)
    assert block.calls == [("update_early", (AdamHyper.from_group(GROUPS[0]),))]
    with pytest.raises(Exception, match="between the last backward and step"):
        hypers.group_changes(0, GROUPS[0], "lr", 0.5)  # the early update's hyperparameters are kept to compare
    block.calls.clear()
    NoClipping().block_complete(block, hypers, backward=LastBackward.NO)
    assert block.calls == [("park_grads", False)], "an earlier micro-batch's sum parks, no norms"
    quiet = FakeBlock(spills=False)
    NoClipping().block_complete(quiet, hypers, backward=LastBackward.NO)
    assert quiet.calls == []


def test_no_clipping_checks_each_block_and_scales_by_one():
    mode = NoClipping()
    assert mode.updates_in(LastBackward.DECLARED) and mode.checks_each_block and math.isnan(mode.last_norm)
    assert mode.scale_for_step([], None, 0, ()) == 1.0  # type: ignore[arg-type]


@pytest.mark.parametrize("last", [LastBackward.DECLARED, LastBackward.LIKELY, LastBackward.NO])
def test_norm_clipping_takes_the_norms_and_parks_on_every_completion(last):
    mode = NormClipping(1.0, FakeWorker([]), FakeNormSource([], (0, 1)))
    assert not mode.updates_in(LastBackward.DECLARED) and not mode.checks_each_block
    block = FakeBlock(spills=False)
    mode.block_complete(block, StepHypers([dict(g) for g in GROUPS]), backward=last)
    assert block.calls == [("park_grads", True)], "never an update before the global norm"


def test_norm_clipping_waits_for_the_norm_jobs_then_asks_the_reduction():
    log: List = []
    blocks, slots = [FakeBlock(), FakeBlock()], object()
    mode = NormClipping(0.5, FakeWorker(log), FakeNormSource(log, (3.25, 0.125)))
    assert math.isnan(mode.last_norm)
    assert mode.scale_for_step(blocks, slots, 0, ()) == 0.125  # type: ignore[arg-type]
    assert log == ["wait_all", ("global_norm", blocks, slots, 0.5)]
    assert mode.last_norm == 3.25


class SpeculatingBlock(FakeBlock):
    """A block whose update ran into its shadows during the last backward (or not: `speculated`)."""

    def __init__(self, speculated: bool) -> None:
        super().__init__()
        self.shadowed = True
        self.speculated = speculated

    def speculate(self, hypers) -> None:
        self.speculated = True

    def written_since_speculation(self) -> bool:
        return False

    def commit_speculation(self) -> None:
        self.calls.append("commit")
        self.speculated = False

    def forget_speculation(self, redone: bool = False) -> None:
        self.calls.append("forget, redone at step()" if redone else "forget")
        self.speculated = False


class TwoRankNorms(FakeNormSource):
    """A norm source whose `everywhere` ANDs this rank's flags with another rank's (the data-parallel answer)."""

    def __init__(self, log: List, answer: Tuple[float, float], other: List[bool]) -> None:
        super().__init__(log, answer)
        self.other = other

    def everywhere(self, flags: List[bool]) -> List[bool]:
        self.log.append(("everywhere", list(flags)))
        return [mine and theirs for mine, theirs in zip(flags, self.other)]


def test_a_speculation_is_kept_only_where_every_rank_keeps_it_and_every_rank_asks_each_step():
    """Another rank dropped block 1's speculation (a gradient cleared there): this rank forgets it too and runs
    its update at step(), as the other rank does; a rank that speculated nothing still takes part in the collective
    (a rank alone in it would wait forever)."""
    hypers = StepHypers([dict(g) for g in GROUPS])
    log: List = []
    blocks = [SpeculatingBlock(False), SpeculatingBlock(False)]
    mode = NormClipping(1.0, FakeWorker(log), TwoRankNorms(log, (0.5, 1.0), other=[True, False, True, False]),
                        Speculation())
    for block in blocks:
        mode.block_complete(block, hypers, backward=LastBackward.DECLARED)
    assert all(b.speculated for b in blocks)
    assert mode.scale_for_step(blocks, None, 0, hypers.read()) == 1.0  # type: ignore[arg-type]
    assert [b.calls for b in blocks] == [["commit"], ["forget, redone at step()"]]
    assert ("everywhere", [True, True, True, False]) in log
    log.clear()
    quiet = [SpeculatingBlock(False), SpeculatingBlock(False)]  # this rank speculated nothing this step
    assert mode.scale_for_step(quiet, None, 1, hypers.read()) == 1.0  # type: ignore[arg-type]
    assert ("everywhere", [False, False, False, True]) in log, "the collective runs on every rank, every step"
    assert [b.calls for b in quiet] == [[], []]


@pytest.mark.parametrize("total", [float("nan"), float("inf")])
def test_norm_clipping_skips_a_step_with_a_non_finite_norm_and_warns(total):
    mode = NormClipping(1.0, FakeWorker([]), FakeNormSource([], (total, float("nan"))))
    with pytest.warns(RuntimeWarning, match=rf"optimizer step 8 skipped: the gradient norm is {total}"):
        assert mode.scale_for_step([], None, 7, ()) is None  # type: ignore[arg-type]
    assert str(mode.last_norm) == str(total)


# ----- the clipping maths against torch ---------------------------------------------------------------------
def _grads_for(model: nn.Module, seed: int, scale: float, skip: Tuple[str, ...] = ()) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * scale for name, p in model.named_parameters()
            if name not in skip}


@pytest.mark.parametrize("scale, max_norm", [(3.0, 0.5), (3.0, 1e6), (1e-6, 1e-5)],
                         ids=["clips", "does-not-clip", "tiny-norm"])
def test_norm_clipping_scale_over_real_records_is_torchs_clip_coefficient(scale, max_norm):
    torch.manual_seed(0)
    made = _fp32_records(Net())
    try:
        grads = _grads_for(made.model, 1, scale, skip=("layers.1.fc.bias",))  # a parameter with no gradient
        for name, grad in grads.items():
            made.give(name, grad)
        mode = NormClipping(max_norm, made.worker, made.reduction)
        in_order = [made.records[i] for i in made.order.update_order()]
        coef = mode.scale_for_step(in_order, made.slots, 0, ())
        total, clipped = _torch_clip(made.model, grads, max_norm)
        assert mode.last_norm == float(total)
        assert coef is not None and (coef < 1.0) == (max_norm < float(total))
        for name, grad in grads.items():
            assert torch.equal(grad * coef, clipped[name]), name
    finally:
        made.close()


@pytest.mark.parametrize("scale, max_norm", [(3.0, 0.5), (3.0, 1e6)], ids=["clips", "does-not-clip"])
def test_clip_in_place_equals_torch_clip_grad_norm(scale, max_norm):
    torch.manual_seed(0)
    made = _fp32_records(Net())
    try:
        grads = _grads_for(made.model, 2, scale, skip=("layers.0.norm.weight", "layers.2.fc.weight"))
        for name, grad in grads.items():
            made.give(name, grad)
        in_order = [made.records[i] for i in made.order.update_order()]
        for record in in_order:
            made.reduction.norms(record, 0)  # taken during the backward: of the unclipped gradients
            record.shard_sumsq = 1.0
        total = clip_in_place(in_order, global_norm(in_order, made.slots, max_norm), error_if_nonfinite=True)
        want_total, clipped = _torch_clip(made.model, grads, max_norm)
        assert total == float(want_total)
        for name in made.params:
            if name in grads:
                assert torch.equal(made.grad(name), clipped[name]), name
            else:
                assert made.grad(name) is None, "no gradient: torch has none to scale either"
        if max_norm < float(want_total):
            assert all(r.norms is None and r.shard_sumsq is None for r in in_order), "stale after the scale"
        else:  # a scale of 1 changes no bit: the norms taken before still hold
            assert all(r.norms is not None and r.shard_sumsq == 1.0 for r in in_order if r.states)
        again = global_norm(in_order, made.slots, max_norm)[0]  # a later norm reads the clipped gradients
        assert again == float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()])))
    finally:
        made.close()


def test_clip_in_place_refuses_a_non_finite_norm_when_asked_and_else_scales_as_torch():
    torch.manual_seed(0)
    made = _fp32_records(Net())
    try:
        grads = _grads_for(made.model, 3, 1.0)
        grads["layers.1.norm.bias"][2] = float("inf")
        for name, grad in grads.items():
            made.give(name, grad)
        in_order = [made.records[i] for i in made.order.update_order()]
        norm = global_norm(in_order, made.slots, 1.0)
        with pytest.raises(RuntimeError, match=r"total norm of order 2.0 for gradients is non-finite \(inf\)"):
            clip_in_place(in_order, norm, error_if_nonfinite=True)
        assert torch.equal(made.grad("layers.0.fc.weight"), grads["layers.0.fc.weight"]), "refused: untouched"
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(_with_grads(made.model, grads), 1.0, error_if_nonfinite=True)
        total = clip_in_place(in_order, norm, error_if_nonfinite=False)
        want_total, clipped = _torch_clip(made.model, grads, 1.0)
        assert math.isinf(total) and math.isinf(float(want_total))
        for name in grads:
            torch.testing.assert_close(made.grad(name), clipped[name], rtol=0, atol=0, equal_nan=True)
    finally:
        made.close()


def _with_grads(model: nn.Module, grads: Dict[str, torch.Tensor]) -> List[nn.Parameter]:
    out = []
    for name, param in model.named_parameters():
        copy = nn.Parameter(torch.zeros(param.shape))
        copy.grad = grads[name].clone()
        out.append(copy)
    return out


# Norms whose fp32 L2 norm depends on the order they are summed in (found by search: forward and reverse differ).
ORDER_SENSITIVE = [634.0786743164062, 0.4900934100151062, 0.08964447677135468, 45.56279754638672, 1.896918773651123]


def test_global_norm_reduces_in_model_parameters_order_whatever_the_block_order():
    made = _fp32_records(Scalars())
    try:
        names = [f"layers.{i}.weight" for i in range(5)]
        assert list(made.params) == names
        grads = {name: torch.tensor([[value]], dtype=torch.float32) for name, value in zip(names, ORDER_SENSITIVE)}
        for name, grad in grads.items():
            made.give(name, grad)
        backwards = made.records[::-1]  # the order blocks complete in a backward
        total, coef = global_norm(backwards, made.slots, 1.0)
        want_total, clipped = _torch_clip(made.model, grads, 1.0)
        assert total == float(want_total)
        assert clip_scale(ORDER_SENSITIVE[::-1], 1.0)[0] != total, "the case is order-sensitive"
        for name, grad in grads.items():
            assert torch.equal(grad * coef, clipped[name])
    finally:
        made.close()


def test_global_norm_uses_the_norms_a_block_took_during_its_backward():
    made = _fp32_records(Scalars())
    try:
        for i in range(5):
            made.give(f"layers.{i}.weight", torch.full((1, 1), 1.0))
        first = made.records[0]
        first.norms = [(made.params["layers.0.weight"], 7.0)]  # taken on the worker, before a later change
        total, _coef = global_norm(made.records, made.slots, 1.0)
        assert total == float(torch.linalg.vector_norm(torch.tensor([7.0, 1.0, 1.0, 1.0, 1.0])))
    finally:
        made.close()
