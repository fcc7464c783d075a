"""Speculative clipping (issue 35, docs/design.md [Note: speculative clipping]): with `max_grad_norm`, each block
updates during the last backward into shadows of its state and weights; `step()` keeps those updates when the
scale is exactly 1 and redoes them, clipped, from the untouched state when it is not.

Every case trains twice, speculation on and off (`speculative_clipping=False`: today's path, every update after
the global norm), and against torch AdamW + `clip_grad_norm_`: the two engines must agree bit for bit (weights,
optimizer state, norms), and both with torch within 1e-5, in both regimes: norms far below the threshold (every
speculation kept) and far above it (the first one dropped, then none until the norms calm down). The 2-rank cases
run in tests/rank_agreement_child.py.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import offload
from offload.scheduler.modes.clipping import Speculation
from tests.faults import faulty_stores
from tests.models import TinyGPT, make_batches, one_intraop_thread
from tests.test_rank_agreement import launch, reports

ROOT = Path(__file__).resolve().parents[1]
LR, WD = 3e-3, 0.01
BELOW, ABOVE = 1e3, 1e-3  # thresholds the norms stay far below / far above
REGIMES = [pytest.param(BELOW, id="norms-below"), pytest.param(ABOVE, id="clips-every-step")]

one_thread = pytest.fixture(autouse=True)(one_intraop_thread)


def _engine(tmp_path: Path, tier: str, clip: float, speculate: Optional[bool], **options):
    torch.manual_seed(0)
    if tier == "nvme":
        options["nvme_path"] = str(tmp_path / f"swap-{speculate}")
        os.makedirs(options["nvme_path"], exist_ok=True)
    return offload.wrap(TinyGPT(), tier=tier, lr=LR, weight_decay=WD, max_grad_norm=clip,
                        speculative_clipping=speculate, **options)


def _train(engine, batches, between=None) -> List[float]:
    """The steps of `batches` ([step][micro] of (idx, targets)); `between(engine, step)` runs after the backward
    passes of each step, before step()."""
    norms = []
    for index, step in enumerate(batches):
        for idx, tgt in step:
            (engine(idx, tgt) / len(step)).backward()
        if between is not None:
            between(engine, index)
        norms.append(float(engine.step()))
        engine.zero_grad()
    engine.synchronize()
    return norms


def _torch(batches, clip: float, between=None):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    norms = []
    for index, step in enumerate(batches):
        for idx, tgt in step:
            (model(idx, tgt) / len(step)).backward()
        if between is not None:
            between(model, opt, index)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return model, norms


def _state(engine) -> Dict[str, torch.Tensor]:
    """Weights and every optimizer state tensor of an engine, by name."""
    out = {f"w:{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    optimizer = engine.optimizer.state_dict()
    for pid, entry in optimizer["state"].items():
        for key, value in entry.items():
            out[f"s:{pid}:{key}"] = torch.as_tensor(value).clone()
    return out


def _bit_identical(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _close_to_torch(engine, model, norms, torch_norms) -> None:
    for (name, got), want in zip(engine.module.state_dict().items(), model.state_dict().values()):
        assert (got.float() - want.float()).abs().max().item() < 1e-5, name
    assert max(abs(a - b) / max(b, 1e-12) for a, b in zip(norms, torch_norms)) < 1e-5, (norms, torch_norms)


def _both(tmp_path: Path, tier: str, clip: float, batches, between=None, **options):
    """The same training with speculation on and off: (engine on, norms on, engine off, norms off); both open."""
    on = _engine(tmp_path, tier, clip, True, **options)
    norms_on = _train(on, batches, between)
    off = _engine(tmp_path, tier, clip, False, **options)
    norms_off = _train(off, batches, between)
    assert norms_on == norms_off
    return on, norms_on, off


ACCUMULATION = [pytest.param(1, 1, id="declared-1"), pytest.param(2, 2, id="declared-2"),
                pytest.param(None, 2, id="undeclared-2")]


@pytest.mark.parametrize("clip", REGIMES)
@pytest.mark.parametrize("declared, micro", ACCUMULATION)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_speculation_trains_as_torch_and_as_without_it(tmp_path, tier, declared, micro, clip):
    batches = make_batches(5, micro, seed=1)
    on, norms, off = _both(tmp_path, tier, clip, batches, grad_accumulation_steps=declared)
    try:
        _bit_identical(_state(on), _state(off))
        model, torch_norms = _torch(batches, clip)
        _close_to_torch(on, model, norms, torch_norms)
        stats, blocks = on.stats(), len(on.plan.shadowed_blocks)
        assert blocks == len([b for b in on.plan.blocks if b.state_bytes]) > 0, on.plan
        assert off.stats()["speculative_updates"] == 0
        if clip == BELOW:
            assert all(n < clip for n in norms)
            # undeclared: the first step has no count of backward passes to guess the last one from
            speculated_steps = 5 if declared else 4
            assert stats["committed_speculations"] == stats["speculative_updates"] == speculated_steps * blocks
            assert stats["forgotten_speculations"] == 0
        else:
            assert all(n > clip for n in norms)
            assert stats["speculative_updates"] == stats["forgotten_speculations"] == blocks, \
                "one speculation dropped, then none while every step clips"
            assert stats["committed_speculations"] == 0
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("clip", REGIMES)
def test_gradients_on_disk(tmp_path, clip):
    """host_memory too small for every gradient: those that wait go to the swap file, and a speculative update
    leaves its gradients there for a step that clips."""
    batches = make_batches(4, 2, seed=2)
    options = dict(grad_accumulation_steps=2, host_memory=236_000)  # the ring and less than all the gradients
    on, norms, off = _both(tmp_path, "nvme", clip, batches, **options)
    try:
        assert on.plan.grads_on_disk and on.stats()["bytes_grads_to_disk"] > 0, on.plan
        _bit_identical(_state(on), _state(off))
        model, torch_norms = _torch(batches, clip)
        _close_to_torch(on, model, norms, torch_norms)
        assert on.stats()["speculative_updates"] > 0
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("clip", REGIMES)
@pytest.mark.parametrize("moments", ["bf16", "int8"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_compressed_moments_make_the_same_codes(tmp_path, tier, moments, clip):
    batches = make_batches(4, 1, seed=3)
    on, _norms, off = _both(tmp_path, tier, clip, batches, grad_accumulation_steps=1, moments=moments)
    try:
        _bit_identical(_state(on), _state(off))
        assert on.stats()["speculative_updates"] > 0
    finally:
        on.close()
        off.close()


def test_a_non_finite_step_is_skipped_and_its_speculations_dropped(tmp_path):
    """Step 2's loss is NaN: its blocks speculate on NaN gradients, the global norm is NaN, the step is skipped
    (the engine's non-finite skip, as without speculation) and its speculations dropped."""
    batches = make_batches(4, 1, seed=4)
    states = []
    for speculate in (True, False):
        engine = _engine(tmp_path, "nvme", BELOW, speculate, grad_accumulation_steps=1)
        for index, [(idx, tgt)] in enumerate(batches):
            loss = engine(idx, tgt)
            (loss * float("nan") if index == 2 else loss).backward()
            if index == 2:
                with pytest.warns(RuntimeWarning, match="optimizer step 3 skipped"):
                    assert math.isnan(engine.step())
            else:
                engine.step()
            engine.zero_grad()
        engine.synchronize()
        assert engine.stats()["skipped_steps"] == 1
        if speculate:
            assert engine.stats()["forgotten_speculations"] == len(engine.plan.shadowed_blocks)
        states.append(_state(engine))
        engine.close()
    _bit_identical(*states)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_what_changes_between_backward_and_step_is_stepped_on_as_torch_does(tmp_path, tier):
    """A learning rate set, a weight written, torch's clip_grad_norm_ (not firing, then firing) between the
    backward and step(): each speculation that read the old value is dropped, the others kept."""
    batches = make_batches(6, 1, seed=5)

    def between(engine, step):
        if step == 1:
            engine.optimizer.param_groups[0]["lr"] = LR / 2
        if step == 2:
            with torch.no_grad():
                engine.module.h[2].fc.weight.mul_(0.5)
        if step == 3:
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e6)  # a scale of exactly 1
        if step == 4:
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05)

    def torch_between(model, opt, step):
        if step == 1:
            opt.param_groups[0]["lr"] = LR / 2
        if step == 2:
            with torch.no_grad():
                model.h[2].fc.weight.mul_(0.5)
        if step == 3:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        if step == 4:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    on, norms, off = _both(tmp_path, tier, BELOW, batches, between=between, grad_accumulation_steps=1)
    try:
        _bit_identical(_state(on), _state(off))
        model, torch_norms = _torch(batches, BELOW, torch_between)
        _close_to_torch(on, model, norms, torch_norms)
        stats, blocks = on.stats(), len(on.plan.shadowed_blocks)
        # steps 0, 3 and 5 kept all; step 1 (lr) dropped all; step 2 dropped the written block; step 4 all
        assert stats["forgotten_speculations"] == 2 * blocks + 1, stats
        assert stats["committed_speculations"] == 4 * blocks - 1, stats
    finally:
        on.close()
        off.close()


def test_frozen_weights_of_a_block_on_disk_stay_through_the_commits(tmp_path):
    """A block whose weights live on disk and whose flat group holds frozen parameters after its trainable ones: a
    speculative update writes only the trainable range of the weight record's shadow, so the frozen rest must be
    there when a commit makes the shadow live, also after a write to a frozen weight between steps (before the
    fix they read back as zeros)."""
    from tests.test_engine_streaming import BUDGET
    batches = make_batches(4, 1, seed=7)

    def frozen(model):
        model.h[2].ln1.requires_grad_(False)
        return model

    def run(speculate: bool):
        torch.manual_seed(0)
        swap = tmp_path / f"swap-{speculate}"
        swap.mkdir()
        engine = offload.wrap(frozen(TinyGPT()), tier="nvme", nvme_path=str(swap), lr=LR, weight_decay=WD,
                              max_grad_norm=BELOW, speculative_clipping=speculate, device_memory=BUDGET,
                              host_memory=300 << 10, grad_accumulation_steps=1)
        norms = []
        for index, ((idx, tgt),) in enumerate(batches):
            engine(idx, tgt).backward()
            norms.append(float(engine.step()))
            engine.zero_grad()
            if index == 1:
                engine.synchronize()
                with torch.no_grad():
                    engine.module.h[2].ln1.weight.mul_(0.5)
        engine.synchronize()
        return engine, norms

    on, norms = run(True)
    off, _ = run(False)
    try:
        assert "h.2" in on.plan.disk_weight_blocks and "h.2" in on.plan.shadowed_blocks, on.plan
        assert on.stats()["committed_speculations"] > 0
        _bit_identical(_state(on), _state(off))
        torch.manual_seed(0)
        model = frozen(TinyGPT())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                                foreach=False)
        torch_norms = []
        for index, ((idx, tgt),) in enumerate(batches):
            model(idx, tgt).backward()
            torch_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), BELOW)))
            opt.step()
            opt.zero_grad()
            if index == 1:
                with torch.no_grad():
                    model.h[2].ln1.weight.mul_(0.5)
        _close_to_torch(on, model, norms, torch_norms)
    finally:
        on.close()
        off.close()


def test_a_dropped_speculation_leaves_a_resident_blocks_upload_source_as_it_was(tmp_path, monkeypatch):
    """On a GPU, a resident block of the cpu tier keeps only an upload source on the host, which its speculative
    update writes in place; when the speculation is dropped and a later update skips a parameter (its .grad set to
    None before step(), as torch skips it), the upload must not carry the dropped values. This CPU machine has no
    such block, so placement is made to take the branch a CUDA device takes."""
    from offload.scheduler.setup import placement
    from offload.scheduler.weights.weight_home import HostMirror
    own = placement._weight_home

    def as_on_a_gpu(block, group, policy, tiers, streamed, on_disk, trains, whole_state, *more):
        if block.name not in on_disk and block.name not in streamed and trains:
            return HostMirror(group, tiers.copies, whole=False)
        return own(block, group, policy, tiers, streamed, on_disk, trains, whole_state, *more)

    monkeypatch.setattr(placement, "_weight_home", as_on_a_gpu)
    batches = make_batches(3, 1, seed=8)

    def between(engine, step):
        if step == 1:
            engine.module.h[2].fc.bias.grad = None

    def torch_between(model, opt, step):
        if step == 1:
            model.h[2].fc.bias.grad = None

    on, norms, off = _both(tmp_path, "cpu", BELOW, batches, between=between, grad_accumulation_steps=1)
    try:
        assert on.stats()["forgotten_speculations"] >= 1
        _bit_identical(_state(on), _state(off))
        model, torch_norms = _torch(batches, BELOW, torch_between)
        _close_to_torch(on, model, norms, torch_norms)
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("speculate", [True, False], ids=["speculating", "not"])
def test_torch_clip_right_after_the_backward_waits_for_the_norm_jobs(tmp_path, speculate):
    """The worker takes each block's gradient norms after the backward; a torch clip right after must not race it
    (the job's norms, of the gradients before the clip, then reached step(): it returned the unclipped norm and
    clipped with it). The jobs are slowed here so that the clip always comes first."""
    import time

    batches = make_batches(2, 1, seed=11)
    engine = _engine(tmp_path, "cpu", BELOW, speculate, grad_accumulation_steps=1)
    reduction = engine.records[0].services.reduction

    def slow_norms(block, step):  # LocalReduction.norms, with time between taking the norms and keeping them
        values = [n for state in block.states for n in state.grads.norms()]
        time.sleep(0.05)
        block.norms = values

    reduction.norms = slow_norms
    clip = lambda e, s: torch.nn.utils.clip_grad_norm_(e.module.parameters(), 0.05)  # noqa: E731
    try:
        norms = _train(engine, batches, clip)
        model, torch_norms = _torch(batches, BELOW, lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                                                      0.05))
        assert all(abs(n - 0.05) < 1e-3 for n in norms), norms
        _close_to_torch(engine, model, norms, torch_norms)
    finally:
        engine.close()


def test_engine_clip_grad_norm_within_the_threshold_keeps_the_speculations(tmp_path):
    batches = make_batches(3, 1, seed=6)
    on, norms, off = _both(tmp_path, "nvme", BELOW, batches, between=lambda e, s: e.clip_grad_norm_(1e6),
                           grad_accumulation_steps=1)
    try:
        _bit_identical(_state(on), _state(off))
        assert on.stats()["forgotten_speculations"] == 0 and on.stats()["committed_speculations"] > 0
    finally:
        on.close()
        off.close()


def test_a_backward_that_fails_partway_is_skipped_as_torch_skips_it(tmp_path):
    """The common out-of-memory skip, `try: loss.backward() except: optimizer.zero_grad(); continue`, with
    accumulation declared: the blocks updated before the failure are only speculations, which zero_grad drops, so
    the run equals torch's that skipped the batch."""
    batches = make_batches(4, 1, seed=7)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    engine = _engine(tmp_path, "nvme", BELOW, True, grad_accumulation_steps=1)
    try:
        for index, [(idx, tgt)] in enumerate(batches):
            for run, module, zero in ((model, model, opt.zero_grad), (engine, engine.module, engine.zero_grad)):
                # at step 1 the gradient of the first layer's input raises: the later blocks completed before it
                handle = module.h[0].register_full_backward_hook(_raise) if index == 1 else None
                loss = run(idx, tgt)
                try:
                    loss.backward()
                except MemoryError:
                    zero()
                    continue
                finally:
                    if handle is not None:
                        handle.remove()
                if run is model:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), BELOW)
                    opt.step()
                    opt.zero_grad()
                else:
                    engine.step()
                    engine.zero_grad()
        engine.synchronize()
        assert engine.stats()["forgotten_speculations"] > 0, "blocks had speculated before the failure"
        for (name, got), want in zip(engine.module.state_dict().items(), model.state_dict().values()):
            assert (got - want).abs().max().item() < 1e-5, name
    finally:
        engine.close()


@pytest.mark.parametrize("tier, options", [("cpu", {}), ("nvme", {}),
                                           ("nvme", dict(dtype=torch.bfloat16, moments="int8"))],
                         ids=["cpu", "nvme", "nvme-bf16-int8"])
def test_weights_read_between_backward_and_step_are_the_weights_before_it(tmp_path, tier, options):
    """With the CPU computing, a resident block's speculative update writes its weights in place (no shadow to
    allocate or copy at the commit): whatever reads them before step() (a norm of one layer's weight, the
    module's state_dict, a deepcopy, `.data`) must still see the weights before the step, as in torch, so the read drops that block's
    speculation and puts its weights back from the master; the step then redoes its update exactly."""
    batches = make_batches(4, 1, seed=6)
    reads: Dict[object, List[torch.Tensor]] = {}

    def between(engine, step):
        seen = reads.setdefault(engine.policy.speculative_clipping, [])
        if step == 1:
            seen.append(engine.module.h[2].fc.weight.detach().clone())
        if step == 3:
            seen.extend(p.data.clone() for p in engine.module.h[0].parameters())
            seen.extend(p.detach().clone() for p in copy.deepcopy(engine.module.h[2]).parameters())
        if step == 2:
            seen.extend(v.detach().clone() for v in engine.module.state_dict().values())

    on, norms, off = _both(tmp_path, tier, BELOW, batches, between=between, grad_accumulation_steps=1, **options)
    try:
        assert not any(b.shadow_device_bytes for b in on.plan.blocks), str(on.plan)
        for block in on.plan.blocks:  # the state's shadow only (fp32 master and moments in memory on the cpu tier)
            trainable = sum(p.numel() for p in on.module.get_submodule(block.name).parameters() if p.requires_grad)
            assert block.shadow_host_bytes == (12 * trainable if tier == "cpu" and block.shadowed else 0), block
        assert len(reads[True]) == len(reads[False]) > 1
        for got, want in zip(reads[True], reads[False]):
            assert torch.equal(got, want)
        _bit_identical(_state(on), _state(off))
        if not options:  # (bf16 weights put back from fp32 masters: the same bits as the run that never wrote them)
            model, torch_norms = _torch(batches, BELOW)
            _close_to_torch(on, model, norms, torch_norms)
        stats, blocks = on.stats(), len(on.plan.shadowed_blocks)
        # step 1 dropped the block read; steps 2 and 3 every block (the whole state_dict; a deepcopy synchronizes
        # the engine); step 0 kept all
        assert stats["forgotten_speculations"] == 1 + 2 * blocks, stats
        assert stats["committed_speculations"] == 2 * blocks - 1, stats
    finally:
        on.close()
        off.close()


def _raise(*_args):
    raise MemoryError("out of memory (a test's)")


def test_a_save_between_backward_and_step_holds_the_state_before_the_step(tmp_path):
    batches = make_batches(4, 1, seed=8)
    saved = {}

    def save(engine, step):
        if step == 2:
            with pytest.warns(RuntimeWarning, match="saving between backward"):
                saved[engine.policy.speculative_clipping] = engine.save(str(tmp_path / f"ckpt-{step}-"
                                                                              f"{engine.policy.speculative_clipping}"))

    on, _norms, off = _both(tmp_path, "nvme", BELOW, batches, between=save, grad_accumulation_steps=1)
    try:
        assert on.stats()["committed_speculations"] > 0
        for key in ("model.safetensors",):
            assert (Path(saved[True]) / key).read_bytes() == (Path(saved[False]) / key).read_bytes()
        resumed = _engine(tmp_path / "resumed", "nvme", BELOW, True, grad_accumulation_steps=1)
        resumed.load(saved[True])
        # the step in progress at the save (its gradients were not saved) runs again, then the rest
        _train(resumed, batches[2:])
        _bit_identical(_state(resumed), _state(on))
        resumed.close()
    finally:
        on.close()
        off.close()


def test_a_failed_speculative_update_fails_the_step_and_the_checkpoint_stands(tmp_path):
    batches = make_batches(3, 1, seed=9)
    engine = _engine(tmp_path, "nvme", BELOW, True, grad_accumulation_steps=1)
    _train(engine, batches[:1])
    checkpoint = engine.save(str(tmp_path / "ckpt"))
    faults = faulty_stores(engine)
    faults.fail_updates(OSError(5, "injected"))
    idx, tgt = batches[1][0]
    engine(idx, tgt).backward()
    with pytest.raises(Exception, match="injected"):
        engine.step()
    engine.close()
    _resumes_exactly(tmp_path, checkpoint, batches, 1)


def _resumes_exactly(tmp_path: Path, checkpoint: str, batches, step: int) -> None:
    """A fresh engine loads `checkpoint` (taken after `step` steps) and trains the rest of `batches`: bit for bit
    the run that never stopped (without speculation)."""
    resumed = _engine(tmp_path / "resumed", "nvme", BELOW, True, grad_accumulation_steps=1)
    resumed.load(checkpoint)
    _train(resumed, batches[step:])
    reference = _engine(tmp_path / "reference", "nvme", BELOW, False, grad_accumulation_steps=1)
    _train(reference, batches)
    _bit_identical(_state(resumed), _state(reference))
    resumed.close()
    reference.close()


def test_sigkill_while_shadows_are_live_leaves_the_checkpoint_exact(tmp_path):
    """The child saves after step 1, runs the next backward (every block's shadow written) and waits; killed
    there, its checkpoint resumes exactly as a run that never stopped."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, cwd=tmp_path)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line.startswith("LIVE"), line
        assert int(line.split()[1]) > 0, "speculative updates ran before the kill"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    _resumes_exactly(tmp_path, str(tmp_path / "ckpt"), make_batches(3, 1, seed=10), 1)


_CHILD = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
import offload
from tests.models import TinyGPT, make_batches
torch.manual_seed(0)
out = sys.argv[2]
import os
os.makedirs(out + "/swap-child", exist_ok=True)
engine = offload.wrap(TinyGPT(), tier="nvme", nvme_path=out + "/swap-child", lr=%r, weight_decay=%r,
                      max_grad_norm=%r, grad_accumulation_steps=1)
batches = make_batches(3, 1, seed=10)
idx, tgt = batches[0][0]
engine(idx, tgt).backward(); engine.step(); engine.zero_grad()
engine.save(out + "/ckpt")
idx, tgt = batches[1][0]
engine(idx, tgt).backward()
engine.synchronize()
print("LIVE", engine.stats()["speculative_updates"], flush=True)
time.sleep(120)
""" % (LR, WD, BELOW)


@pytest.mark.parametrize("clip", [BELOW, ABOVE], ids=["norms-below", "clips-every-step"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_two_ranks(tmp_path, shard, clip):
    """Each rank speculates on its part of the averaged gradients; the keep-or-drop is one collective, so the ranks
    stay bit-identical, and equal to the run without speculation."""
    weights = {}
    for speculate in (True, False):
        name = f"spec-{shard}-{speculate}"
        options = dict(tier="nvme", dtype="float32", device="cpu", lr=1e-3, weight_decay=0.0, max_grad_norm=clip,
                       shard_weights=shard, grad_accumulation_steps=1, speculative_clipping=speculate)
        launch(tmp_path, dict(name=name, model=dict(vocab=128, dim=64, layers=4, heads=4), options=options,
                              steps=4, micro=1))
        ranks = reports(tmp_path, name)
        assert all("error" not in r for r in ranks), [r.get("traceback") for r in ranks]
        stats = ranks[0]["stats"]
        if speculate:
            key = "committed_speculations" if clip == BELOW else "forgotten_speculations"
            assert stats[key] > 0 and ranks[1]["stats"][key] == stats[key], stats
        weights[speculate] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    for key, value in weights[True].items():
        assert torch.equal(value, weights[False][key]), key


def test_the_speculation_policy_is_deterministic_and_backs_off():
    """It speculates until a step clips, then waits for 1, 2, 4, ... (at most 64) calm steps in a row before it
    tries again; a speculation dropped for another reason (a learning rate set, a weight written) costs nothing."""
    policy = Speculation()
    tried = []
    calm = [False, True, False, False, True, True, True, False] + [True] * 8
    for step, was_calm in enumerate(calm):
        now = policy.now
        tried.append(now)
        policy.after_step(now, now and was_calm and step != 6, was_calm)
    # step 0 clips: wait 1 calm step (1), try (2), clips: wait 2 (4, 5), try at 6: dropped for another reason (a
    # write), kept trying at 7: clips: wait 4 calm steps (8-11), try at 12
    assert tried == [True, False, True, False, False, False, True, True] + [False] * 4 + [True] * 4, tried
    assert policy.failures == 3 and policy.patience == 4
    for _ in range(20):
        policy.after_step(True, False, False)
    assert policy.patience == Speculation.MAX_PATIENCE


def test_the_plan_says_where_speculation_runs_and_what_it_costs(tmp_path):
    with _engine(tmp_path, "nvme", 1.0, True, grad_accumulation_steps=1) as engine:
        line = [x for x in str(engine.plan).splitlines() if "speculative clipping" in x]
        assert len(line) == 1 and "update during the last backward into shadows" in line[0], str(engine.plan)
        disk = sum(b.shadow_disk_bytes for b in engine.plan.blocks)
        assert disk == sum(b.state_bytes for b in engine.plan.blocks if b.shadowed) > 0
    with _engine(tmp_path, "cpu", 1.0, False) as engine:
        assert "speculative clipping: off (speculative_clipping=False)" in str(engine.plan)
    # unset: off where the CPU computes and the cpu tier updates on the same cores; on for the nvme tier
    with _engine(tmp_path, "cpu", 1.0, None, grad_accumulation_steps=1) as engine:
        assert "speculative clipping: off (the cpu tier computing on the CPU" in str(engine.plan)
        assert not engine.plan.shadowed_blocks
    with _engine(tmp_path, "nvme", 1.0, None, grad_accumulation_steps=1) as engine:
        assert engine.plan.shadowed_blocks, str(engine.plan)
    torch.manual_seed(0)
    with offload.wrap(TinyGPT(), tier="gpu", device="cpu", max_grad_norm=1.0) as engine:
        assert "speculative clipping: off: the gpu tier updates on the device" in str(engine.plan)
    with _engine(tmp_path, "cpu", 1.0, False) as engine:
        state = sum(b.state_bytes for b in engine.plan.blocks)
    # a host budget that leaves room for some shadows only: the last block of the forward gets one first
    with _engine(tmp_path, "cpu", 1.0, True, host_memory=state + 60_000) as engine:
        said = str(engine.plan)
        assert engine.plan.blocks[-1].shadowed and not all(b.shadowed for b in engine.plan.blocks), said
        assert "no room for their shadows" in said and "raise host_memory" in said
        assert sum(b.shadow_host_bytes for b in engine.plan.blocks) <= 60_000
