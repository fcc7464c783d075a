"""AdamW's finer semantics kept under offload: unused parameters skipped, zero_grad variants, direct
`optimizer.step()`, fewer backward calls than declared, and bf16 within a tolerance of fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from tests.faults import faulty_stores
from tests.models import TinyGPT, make_batches, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


class Pair(nn.Module):
    """Two linears in one block; `b` is used only when `use_b` is set, so its step count falls behind."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.use_b = True

    def forward(self, x):
        x = torch.tanh(self.a(x))
        return torch.tanh(self.b(x)) if self.use_b else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Pair(), Pair()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _train(model, opt_step, zero_grad, uses):
    losses = []
    gen = torch.Generator().manual_seed(1)
    for use_b in uses:
        for layer in model.layers:
            layer.use_b = use_b
        loss = model(torch.randn(4, 8, generator=gen))
        loss.backward()
        losses.append(loss.item())
        opt_step()
        zero_grad()
    return losses


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
@pytest.mark.parametrize("declared", [None, 1])
def test_unused_parameters_are_skipped_like_adamw(tier, declared):
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    uses = [True, False, True, False, False, True]
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    ref = _train(twin, opt.step, opt.zero_grad, uses)
    engine = offload.wrap(model, tier=tier, lr=1e-2, weight_decay=0.1, dtype=torch.float32, device="cpu",
                          grad_accumulation_steps=declared)
    with engine:
        got = _train(model, engine.optimizer.step, engine.optimizer.zero_grad, uses)  # the Optimizer facade
        state = engine.state_dict()
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-6
    for name, value in twin.state_dict().items():
        assert (state[name] - value).abs().max() <= 1e-6, name


def test_zero_grad_set_to_none_false_still_updates_with_zero_grads():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    uses = [True, False, False]
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    _train(twin, opt.step, lambda: opt.zero_grad(set_to_none=False), uses)
    with offload.wrap(model, tier="cpu", lr=1e-2, weight_decay=0.1, dtype=torch.float32, device="cpu") as engine:
        _train(model, engine.step, lambda: engine.zero_grad(set_to_none=False), uses)
        state = engine.state_dict()
    for name, value in twin.state_dict().items():
        assert (state[name] - value).abs().max() <= 1e-6, name


def test_fewer_backward_calls_than_declared_is_exact():
    """A last, partial accumulation (e.g. at the end of an epoch): gradients still on the device are
    offloaded by step() and nothing is dropped."""
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    batches = make_batches(2, 3)
    opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    engine = offload.wrap(model, tier="cpu", lr=1e-2, weight_decay=0.0, dtype=torch.float32, device="cpu",
                          grad_accumulation_steps=4)
    for micro in batches:
        for idx, tgt in micro:
            twin(idx, tgt).backward()
            engine(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        engine.step()
        engine.zero_grad()
    state = engine.state_dict()
    engine.close()
    for name, value in twin.state_dict().items():
        assert (state[name] - value).abs().max() <= 1e-5, name


def test_bf16_stays_close_to_fp32():
    """bf16 compute weights (fp32 master and norms): losses within 0.05 of the fp32 run over 6 steps."""
    batches = make_batches(6, 1)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        with offload.wrap(TinyGPT(), tier="cpu", lr=3e-3, dtype=dtype, device="cpu") as engine:
            losses[dtype] = []
            for (idx, tgt), in batches:
                loss = engine(idx, tgt)
                loss.backward()
                engine.step()
                engine.zero_grad()
                losses[dtype].append(loss.item())
    diffs = [abs(a - b) for a, b in zip(losses[torch.float32], losses[torch.bfloat16])]
    assert max(diffs) <= 0.05, diffs
    assert losses[torch.bfloat16][-1] < losses[torch.bfloat16][0]  # it trains


def test_grads_leave_the_device_and_stats_count_them():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.bfloat16, device="cpu") as engine:
        (idx, tgt), = make_batches(1, 1)[0]
        engine(idx, tgt).backward()
        # each .grad is a storage-less stand-in: the gradient itself is in the engine's host buffers
        assert all(type(p.grad).__name__ == "HeldGrad" for p in engine.module.parameters() if p.requires_grad)
        stats = engine.stats()
        bf16 = sum(p.numel() for p in engine.module.parameters() if p.requires_grad and p.dtype == torch.bfloat16)
        fp32 = sum(p.numel() for p in engine.module.parameters() if p.requires_grad and p.dtype == torch.float32)
        assert stats["bytes_device_to_host"] == 2 * bf16 + 4 * fp32  # bf16 gradients stay bf16
        engine.step()
        engine.synchronize()
        assert engine.stats()["block_updates"] == 5  # every block with trainable parameters


def test_non_finite_gradient_norm_skips_the_step_with_a_warning():
    torch.manual_seed(0)
    model = Net()
    with offload.wrap(model, tier="cpu", lr=1e-2, max_grad_norm=1.0, dtype=torch.float32, device="cpu") as engine:
        before = engine.state_dict()
        loss = model(torch.full((4, 8), float("inf")))
        loss.backward()
        with pytest.warns(RuntimeWarning, match="step 1 skipped: the gradient norm is (nan|inf)"):
            engine.step()
        engine.zero_grad()
        after = engine.state_dict()
        assert all(after[k].equal(v) for k, v in before.items())
        assert engine.stats()["skipped_steps"] == 1
        model(torch.ones(4, 8)).backward()  # the next step trains normally
        engine.step()
        assert not engine.state_dict()["layers.0.a.weight"].equal(before["layers.0.a.weight"])
        assert engine.stats()["skipped_steps"] == 1


def test_an_update_that_fails_surfaces_at_the_next_use_of_its_block():
    from offload.errors import OffloadError

    model = Net()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True)
    model(torch.ones(4, 8)).backward()
    faulty_stores(engine).fail_updates(RuntimeError("update failed on purpose"))
    engine.step()  # returns before the updates run
    with pytest.raises(RuntimeError, match="update failed on purpose"):
        model(torch.ones(4, 8))  # block layers.0
    with pytest.raises(OffloadError, match="failed earlier.*update failed on purpose"):
        model(torch.ones(4, 8))  # block layers.1 failed too: every later use names the first failure
    with pytest.warns(RuntimeWarning, match="closed after a failed update"):
        engine.close()  # the failure was reported: cleanup does not raise it again
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_failure_never_reported_is_raised_by_close():
    model = Net()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True)
    model(torch.ones(4, 8)).backward()
    faulty_stores(engine).fail_updates(RuntimeError("late"))
    engine.step()
    with pytest.raises(RuntimeError, match="late"):
        engine.close()
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_without_overlap_step_a_failed_update_raises_from_step():
    from offload.errors import OffloadError

    model = Net()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=False)
    model(torch.ones(4, 8)).backward()
    faulty_stores(engine).fail_updates(RuntimeError("now"))
    with pytest.raises(RuntimeError, match="now"):
        engine.step()  # it waits for the updates, so their failure is the step's
    with pytest.raises(OffloadError, match="failed earlier.*now"):
        model(torch.ones(4, 8))
    with pytest.warns(RuntimeWarning, match="closed after a failed update"):
        engine.close()


def test_changing_lr_after_an_early_update_raises_at_the_assignment():
    """It warned after step(); the blocks updated early could not take the new lr (tests/test_torch_optimizer_state.py
    has the other ways to set it)."""
    from offload.errors import OffloadError

    model = Net()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        for step in range(2):  # blocks update during backward (the first step by the forward's prediction)
            model(torch.ones(4, 8)).backward()
            if engine.stats()["early_block_updates"]:
                with pytest.raises(OffloadError, match="between the last backward and step"):
                    engine.optimizer.param_groups[0]["lr"] = 0.5 + step
            engine.step()
            engine.zero_grad()
        assert engine.stats()["early_block_updates"] > 0


def test_after_a_failed_update_the_engine_refuses_to_train_or_save_until_a_checkpoint_is_loaded(tmp_path):
    """Some blocks updated and some not: training on (or saving) would silently use inconsistent state."""
    from offload.errors import OffloadError

    torch.manual_seed(0)
    model = Net()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True) as engine:
        model(torch.ones(4, 8)).sum().backward()
        engine.step()
        engine.zero_grad()
        engine.save(tmp_path / "good")
        saved = engine.state_dict()
        model(torch.ones(4, 8)).sum().backward()
        faults = faulty_stores(engine)
        faults.fail_updates(RuntimeError("boom"))
        engine.step()
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(4, 8))
        for action in (lambda: model(torch.ones(4, 8)), engine.step, lambda: engine.save(tmp_path / "bad"),
                       engine.state_dict):
            with pytest.raises(OffloadError, match="failed earlier.*RuntimeError: boom.*engine.load"):
                action()
        assert not (tmp_path / "bad").exists()
        faults.repair()
        engine.load(tmp_path / "good")
        assert all(torch.equal(engine.state_dict()[k], v) for k, v in saved.items())
        model(torch.ones(4, 8)).sum().backward()  # training goes on from the checkpoint
        engine.step()
        assert not torch.equal(engine.state_dict()["layers.0.a.weight"], saved["layers.0.a.weight"])


def test_stats_split_the_time_into_forward_backward_and_updates():
    model = Net()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        stats = engine.stats()
        assert stats["forward_seconds"] == 0.0 and stats["backward_seconds"] == 0.0
        for _ in range(2):
            engine(torch.ones(4, 8)).sum().backward()
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        trained = engine.stats()
        assert trained["forward_seconds"] > 0 and trained["backward_seconds"] > 0 and trained["update_seconds"] > 0
        with torch.no_grad():
            engine(torch.ones(4, 8))  # an evaluation forward: forward time only
        after_eval = engine.stats()
        assert after_eval["forward_seconds"] > trained["forward_seconds"]
        assert after_eval["backward_seconds"] == trained["backward_seconds"]


def _broken_update(engine):
    """The engine's updates fail from now on; returns what repairs them."""
    faults = faulty_stores(engine)
    faults.fail_updates(RuntimeError("boom"))
    return faults.repair


def test_a_load_that_fails_leaves_a_failed_engine_failed_and_a_good_load_recovers(tmp_path):
    from offload.errors import OffloadError

    model = Net()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True) as engine:
        engine.save(tmp_path / "good")
        model(torch.ones(4, 8)).sum().backward()
        repair = _broken_update(engine)
        engine.step()  # the failure is not seen yet: the next load must still count it
        with pytest.raises(OffloadError):  # the checkpoint is missing
            engine.load(tmp_path / "missing")
        repair()
        with pytest.raises(OffloadError, match="failed earlier.*boom"):
            engine(torch.ones(4, 8))
        with pytest.raises(OffloadError, match="failed earlier"):
            engine.save(tmp_path / "bad")
        engine.load(tmp_path / "good")
        engine(torch.ones(4, 8)).sum().backward()
        engine.step()
    with pytest.warns(RuntimeWarning, match="closed after a failed update"):
        with offload.wrap(Net(), tier="cpu", dtype=torch.float32, device="cpu", overlap_step=True) as engine:
            engine.module(torch.ones(4, 8)).sum().backward()
            repair = _broken_update(engine)
            engine.step()
            with pytest.raises(RuntimeError, match="boom"):
                engine.synchronize()
            repair()


def test_a_load_that_fails_while_changing_the_state_poisons_the_engine(tmp_path, monkeypatch):
    import offload.checkpoint.reader as reader
    from offload.errors import OffloadError, OffloadIOError

    model = Net()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        engine.save(tmp_path / "good")
        real = reader._load_tensors

        def fails_halfway(*args, **kwargs):
            raise OffloadIOError(5, "disk went away", str(tmp_path), 0, 0, "read")

        monkeypatch.setattr(reader, "_load_tensors", fails_halfway)
        with pytest.raises(OffloadIOError, match="partly loaded"):
            engine.load(tmp_path / "good")
        with pytest.raises(OffloadError, match="failed earlier.*partly loaded"):
            engine(torch.ones(4, 8))
        monkeypatch.setattr(reader, "_load_tensors", real)
        engine.load(tmp_path / "good")
        engine(torch.ones(4, 8)).sum().backward()
        engine.step()


def test_load_in_the_middle_of_an_accumulation_starts_a_fresh_step(tmp_path):
    """Loading drops the micro-batches already run since the last step, as a fresh process would."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def two_micro_batches_then_step(engine):
        for x in batches[1:]:
            (engine(x).sum() / 2).backward()
        engine.step()
        engine.zero_grad()
        return engine.state_dict()

    torch.manual_seed(0)
    with offload.wrap(Net(), tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=2) as engine:
        for _ in range(2):
            two_micro_batches_then_step(engine)  # a profile exists: blocks update during the last backward
        engine.save(tmp_path / "ckpt")
        engine(batches[0]).sum().backward()  # an accumulation the load abandons
        engine.load(tmp_path / "ckpt")
        resumed = two_micro_batches_then_step(engine)
        assert engine.stats()["early_block_updates"] > 0
    torch.manual_seed(1)
    with offload.wrap(Net(), tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=2) as fresh:
        fresh.load(tmp_path / "ckpt")
        expected = two_micro_batches_then_step(fresh)
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_a_model_returning_its_own_result_object_still_counts_its_backward():
    """A forward that returns a plain object holding the loss (pytree sees one opaque leaf): the backward's
    start is still seen (its clock, the reads ahead), as for a tensor or a tuple."""

    class Result:
        def __init__(self, loss):
            self.loss = loss

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return Result(self.net(x).sum())

    with offload.wrap(Wrapped(), tier="cpu", dtype=torch.float32, device="cpu") as engine:
        engine(torch.ones(4, 8)).loss.backward()
        engine.step()
        assert engine.stats()["backward_seconds"] > 0


class _FailsInBackward(nn.Module):
    """TinyGPT whose backward raises once it reaches the first layer (an out-of-memory, a bad batch): the
    blocks after it (the head, the last layers) have their gradients by then."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.fail = False

    def forward(self, idx, tgt):
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
        x = gpt.h[0](x)
        if self.fail and torch.is_grad_enabled():
            x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)")))
        for layer in gpt.h[1:]:
            x = layer(x)
        logits = gpt.lm_head(gpt.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))


def test_a_last_backward_that_fails_partway_is_named_as_such_with_the_ways_on(tmp_path):
    """Before: zero_grad() after the failure said "zero_grad() between the last backward and step()", a misuse
    the user did not commit. Now each next call says what happened and what to do; step() finishes the step."""
    torch.manual_seed(0)
    model = _FailsInBackward()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=2) as engine:
        batches = make_batches(3, 2)
        for micro in batches[0]:  # a first step gives the blocks their gradient profile
            engine(*micro).backward()
        engine.step()
        engine.zero_grad()
        engine.save(tmp_path / "ckpt")
        engine(*batches[1][0]).backward()
        model.fail = True
        with pytest.raises(RuntimeError, match="out of memory"):
            engine(*batches[1][1]).backward()
        model.fail = False
        assert engine.stats()["early_block_updates"] > 0  # the head and last layers updated before it failed
        with pytest.raises(offload.OffloadError, match=r"zero_grad\(\) after the last backward of this step "
                                                       r"\(micro-batch 2 of grad_accumulation_steps=2\) raised "
                                                       r"partway.*engine\.load.*engine\.step\(\)"):
            engine.zero_grad()
        with pytest.raises(offload.OffloadError, match=r"backward called again after the last backward.*raised"):
            engine(*batches[1][1]).backward()  # retrying the micro-batch
        with pytest.warns(RuntimeWarning, match="raised partway"):
            engine.step()  # the way on from here
        engine.zero_grad()
        engine.load(tmp_path / "ckpt")  # or back to where it was exact
        for micro in batches[2]:
            engine(*micro).backward()
        engine.step()
        engine.zero_grad()
    assert engine.stats()["steps"] == 2  # the first step, then the checkpoint's count plus one


def _backward_with_early_updates(engine) -> None:
    """A first step (it gives the blocks their gradient profile), then a declared last backward that updates them."""
    (first,), (second,) = make_batches(2, 1)
    engine(*first).backward()
    engine.step()
    engine.zero_grad()
    engine(*second).backward()
    assert engine.stats()["early_block_updates"] > 0


def test_zero_grad_after_a_completed_last_backward_is_still_the_misuse_message():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        _backward_with_early_updates(engine)
        with pytest.raises(offload.OffloadError, match=r"zero_grad\(\) between the last backward and step\(\)"):
            engine.zero_grad()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_model_zero_grad_between_an_early_update_and_step_is_refused(tmp_path, tier):
    """`model.zero_grad()` (the module's, which the engine does not see) between the declared last backward and
    step(): torch would then not step, but the blocks were updated during the backward. Before, on the nvme tier,
    whose gradient window gives each gradient back after its update, step() went on silently; now it raises there
    as on the cpu tier."""
    options = dict(nvme_path=str(tmp_path), host_memory=1_000_000) if tier == "nvme" else {}
    with offload.wrap(TinyGPT(), tier=tier, dtype=torch.float32, device="cpu", grad_accumulation_steps=1,
                      **options) as engine:
        _backward_with_early_updates(engine)
        engine.synchronize()  # every update done: on the nvme tier each gave its gradient back to the window
        engine.module.zero_grad()
        with pytest.raises(offload.OffloadError, match=r"zero_grad\(\) between the last backward and step\(\)"):
            engine.step()
