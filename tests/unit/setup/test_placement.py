"""Placement on its own (setup/placement.py `plan_and_open`, setup/assemble.py `assemble`), without an Engine or
hooks: for each policy, which state store, weight home and gradient home every flat group of a TinyGPT gets,
and which modes (modes/selection.py) the step runs with. The data-parallel choices (`ShardedStore`,
`DataParallelReduction`) need several processes: tests/test_data_parallel.py."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional

import pytest
import torch
from torch import nn

from offload.param_groups import optimizer_groups
from offload.planner.plan import Plan
from offload.policy import OffloadPolicy, Tier
from offload.scheduler.blocks.block import Block, FlatGroup, Residency, build_blocks
from offload.scheduler.modes.clipping import NoClipping, NormClipping
from offload.scheduler.modes.disk_traffic import NoDiskTraffic, RingTraffic
from offload.scheduler.modes.reduction import LocalReduction
from offload.scheduler.modes.selection import Modes
from offload.scheduler.phases.pipeline import StepPipeline
from offload.scheduler.setup import placement
from offload.scheduler.setup.assemble import assemble
from offload.scheduler.setup.initial_weights import FromModule
from offload.scheduler.state.disk_store import DiskStore
from offload.scheduler.state.state_store import MemoryStore
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.weights.tiers import Tiers
from offload.scheduler.weights.weight_home import DeviceHome, DiskHome, HostMirror
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier
from offload.trace import Tracer
from tests.models import GRAD_ROOM, TinyGPT, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)

CPU = torch.device("cpu")
STREAM = 120_000 + GRAD_ROOM  # device_memory: TinyGPT's three layers stream (tests/test_engine_streaming.py)
HOST_FORCES_DISK = 300 << 10  # host_memory: no room for the streamed weights (tests/test_engine_disk_weights.py)


@dataclass
class Placed:
    blocks: List[Block]
    plan: Plan
    tiers: Tiers
    pipeline: StepPipeline

    def groups(self, trains: Optional[bool] = None) -> List[FlatGroup]:
        out = [g for b in self.blocks for g in b.groups]
        return out if trains is None else [g for g in out if bool(g.trainable_numel) == trains]

    def state(self, group: FlatGroup):
        state = self.pipeline.group_record(group).state
        assert state is not None
        return state

    def home(self, group: FlatGroup):
        return self.pipeline.group_record(group).home

    @property
    def modes(self) -> Modes:
        """The modes `assemble` chose: the forward phase holds them (phases/forward.py)."""
        return self.pipeline._forward._modes


@contextlib.contextmanager
def placed(policy: OffloadPolicy, model: Optional[nn.Module] = None) -> Iterator[Placed]:
    """`model` (a TinyGPT) planned, its tiers opened and its step assembled as Engine.__init__ does; closed after."""
    model = TinyGPT() if model is None else model
    blocks = build_blocks(model, policy.dtype)
    tracer = Tracer()
    plan, tiers = placement.plan_and_open(blocks, policy, tracer)
    trainable = [s.param for b in blocks for s in b.slots if s.trainable]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    try:
        pipeline = assemble(blocks, model, policy, plan, tiers, tracer,
                            optimizer_groups(policy.param_groups, trainable, names), FromModule(), 1)
    except BaseException:
        tiers.close()
        raise
    try:
        yield Placed(blocks, plan, tiers, pipeline)
    finally:
        pipeline.close()
        pipeline.close_tiers()


def _policy(tier: Tier, tmp_path, **options) -> OffloadPolicy:
    return OffloadPolicy(tier=tier, nvme_path=str(tmp_path) if tier is Tier.NVME else None, dtype=torch.float32,
                         device=CPU, **options)




def test_the_gpu_tier_keeps_state_and_gradients_on_the_device(tmp_path):
    with placed(_policy(Tier.GPU, tmp_path)) as p:
        assert not p.plan.streamed_blocks and p.tiers.ring is None
        for group in p.groups(trains=True):
            state = p.state(group)
            assert type(state.store) is MemoryStore and not state.store.on_host
            assert not state.store.uses_cpu_kernel, "torch maths on the device"
            assert not state.store.writes_compute_copy, "fp32: the master weights are the device buffer itself"
            assert state.grads.pool is None and state.grads.device == CPU
        for group in p.groups():
            assert type(p.home(group)) is DeviceHome
        for group in p.groups(trains=False):
            assert p.pipeline.group_record(group).state is None
        assert isinstance(p.modes.disk, NoDiskTraffic) and isinstance(p.modes.reduction, LocalReduction)
        assert isinstance(p.modes.clipping, NoClipping)


def test_the_cpu_tier_keeps_the_state_on_the_host_for_the_cpu_adam(tmp_path):
    with placed(_policy(Tier.CPU, tmp_path, max_grad_norm=1.0)) as p:
        for group in p.groups(trains=True):
            state = p.state(group)
            assert type(state.store) is MemoryStore and state.store.on_host and state.store.uses_cpu_kernel
            assert state.grads.pool is None
            assert type(p.home(group)) is DeviceHome, "the compute device is the cpu: no upload source"
        assert isinstance(p.modes.disk, NoDiskTraffic) and isinstance(p.modes.reduction, LocalReduction)
        assert isinstance(p.modes.clipping, NormClipping) and p.modes.clipping.max_norm == 1.0


def test_streamed_blocks_get_a_whole_host_mirror_and_are_released(tmp_path):
    with placed(_policy(Tier.CPU, tmp_path, device_memory=STREAM)) as p:
        streamed = set(p.plan.streamed_blocks)
        assert streamed == {"h.0", "h.1", "h.2"}
        for block in p.blocks:
            assert p.pipeline.records[block.index].streamed == (block.name in streamed)
            assert block.residency is (Residency.RELEASED if block.name in streamed else Residency.RESIDENT)
            for group in block.groups:
                home = p.home(group)
                if block.name in streamed:
                    assert type(home) is HostMirror and home.host.numel() == group.numel
                else:
                    assert type(home) is DeviceHome
        assert p.tiers.streamer.active


def test_the_nvme_tier_keeps_the_state_in_the_swap_file_through_the_ring(tmp_path):
    with placed(_policy(Tier.NVME, tmp_path)) as p:
        assert p.tiers.ring is not None and p.tiers.swap is not None and p.tiers.grad_pool is None
        for group in p.groups(trains=True):
            state = p.state(group)
            assert type(state.store) is DiskStore and state.store.reads_ahead
            assert state.grads.pool is None and state.grads.device == CPU
            assert type(p.home(group)) is DeviceHome, "no budget: the weights stay on the device"
        assert isinstance(p.modes.disk, RingTraffic) and isinstance(p.modes.clipping, NoClipping)


def test_a_host_budget_too_small_for_the_streamed_weights_puts_them_on_disk(tmp_path):
    with placed(_policy(Tier.NVME, tmp_path, device_memory=STREAM, host_memory=HOST_FORCES_DISK)) as p:
        on_disk, streamed = set(p.plan.disk_weight_blocks), set(p.plan.streamed_blocks)
        assert on_disk and on_disk <= streamed
        for block in p.blocks:
            for group in block.groups:
                home = p.home(group)
                if block.name in on_disk:
                    assert type(home) is DiskHome, block.name
                elif block.name in streamed:
                    assert type(home) is HostMirror, block.name
                else:
                    assert type(home) is DeviceHome, block.name
        for group in p.groups(trains=True):
            assert p.state(group).grads.pool is None, "accumulation not declared: no window"


def test_a_gradient_window_needs_declared_accumulation_no_clipping_and_a_host_budget(tmp_path):
    windowed = dict(host_memory=1 << 30, grad_accumulation_steps=1)
    with placed(_policy(Tier.NVME, tmp_path, **windowed)) as p:
        assert p.tiers.grad_pool is not None and p.plan.grad_window_bytes is not None
        for group in p.groups(trains=True):
            grads = p.state(group).grads
            assert grads.pool is not None and grads.pool is p.tiers.grad_pool
            assert grads.grad is None, "no buffer before the first gradient"
    for other in (dict(windowed, max_grad_norm=1.0), dict(grad_accumulation_steps=1), dict(host_memory=1 << 30)):
        with placed(_policy(Tier.NVME, tmp_path, **other)) as p:
            assert p.tiers.grad_pool is None, other
            assert all(p.state(g).grads.pool is None for g in p.groups(trains=True)), other


def test_resident_trainable_weights_on_a_gpu_with_host_state_get_an_upload_source():
    """On CUDA with the state on the host, a resident block's trainable range has a host copy the update
    writes (an upload source), next to the device weights; frozen groups and the gpu tier keep DeviceHome.
    Asked of `_weight_home` directly (this machine may have no GPU): the copies run on the cpu here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].requires_grad_(False)
    blocks = build_blocks(model, torch.float32)
    for block in blocks:
        for group in block.groups:
            group.device_buffer = torch.zeros(group.numel)
    tiers = Tiers(DeviceTier(CPU, None), CopyContext(CPU), WeightStreamer(DeviceTier(CPU, None), CopyContext(CPU)))
    cuda = torch.device("cuda")
    for tier, block, trains, want in [(Tier.CPU, blocks[0], True, HostMirror), (Tier.NVME, blocks[0], True, HostMirror),
                                      (Tier.CPU, blocks[1], False, DeviceHome), (Tier.GPU, blocks[0], True, DeviceHome)]:
        policy = OffloadPolicy(tier=tier, nvme_path="/nonexistent" if tier is Tier.NVME else None, device=cuda)
        group = block.groups[0]
        home = placement._weight_home(block, group, policy, tiers, set(), set(), trains, whole_state=True)
        assert type(home) is want, (tier, block.name)
        if isinstance(home, HostMirror):
            assert home.host.numel() == group.trainable_numel, "the trainable range only"
