"""Reading a wrapped model's weights from outside the engine's hooks (issue "never silently wrong"):
`copy.deepcopy` of the model or of a sub-module is a plain PyTorch copy of the current weights (streamed
blocks included, no engine hooks), and a forward that computes with a streamed block's parameter outside the
modules owning it raises by name instead of training on the NaN placeholder.
See docs/design.md [Note: reading streamed weights outside their module]."""

from __future__ import annotations

import copy
import inspect
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.errors import OffloadError
from tests.faults import faulty_stores
from tests.models import GRAD_ROOM, FP32LayerNorm, Layer, TinyGPT, make_batches, one_intraop_thread

LAYER_BYTES = 50_432  # one TinyGPT layer in fp32
BUDGET = 120_000 + GRAD_ROOM  # the three layers stream (tests/test_engine_streaming.py)
TIED_BUDGET = 2 * LAYER_BYTES + 4_000 + GRAD_ROOM  # the embedding streams too
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _wrap(model: nn.Module, **kwargs) -> offload.Engine:
    options = dict(tier="cpu", dtype=torch.float32, device="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    options.update(kwargs)
    return offload.wrap(model, **options)


def _train(engine, batches) -> None:
    for ((idx, tgt),) in batches:
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()


def _hook_count(module: nn.Module) -> int:
    return sum(len(getattr(sub, name)) for sub in module.modules() for name in _HOOK_DICTS)


def _assert_plain(model: nn.Module) -> None:
    """No engine hook, mark or copier is left in `model`, and no parameter is a placeholder."""
    assert _hook_count(model) == 0
    for sub in model.modules():
        assert "__deepcopy__" not in vars(sub) and "_offload_engine" not in vars(sub)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        assert not param._post_accumulate_grad_hooks, name


def _assert_holds(model: nn.Module, expected: dict, prefix: str = "") -> None:
    got = model.state_dict()
    assert set(got) == {k[len(prefix):] for k in expected if k.startswith(prefix)}
    for key, value in got.items():
        assert value.dtype == expected[prefix + key].dtype, key
        assert torch.equal(value, expected[prefix + key]), key


# ----- copy.deepcopy --------------------------------------------------------------------------------------
def test_deepcopy_with_streamed_blocks_holds_the_current_weights_and_no_engine():
    """Before: the copy held the NaN placeholders of the streamed layers, and the engine's hooks and mark."""
    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET) as engine:
        assert engine.plan.streamed_blocks == ("h.0", "h.1", "h.2")
        _train(engine, make_batches(2, 1))
        twin = copy.deepcopy(model)
        _assert_holds(twin, engine.state_dict())
        _assert_plain(twin)
        assert twin.lm_head.weight is twin.wte.weight  # still tied
        assert twin.h[0].fc.weight is not model.h[0].fc.weight
        assert not twin.h[1].fc.weight.requires_grad and twin.h[0].fc.weight.requires_grad  # frozen stays frozen
        fetches = engine.stats()["block_fetches"]
        (idx, tgt), = make_batches(1, 1, seed=1)[0]
        loss = twin(idx, tgt)  # a plain PyTorch model: trains on its own
        assert torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
        assert engine.stats()["block_fetches"] == fetches  # nothing of it ran through the engine
        before = engine.state_dict()
        torch.optim.AdamW(twin.parameters(), lr=LR).step()
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # the original did not move
        _train(engine, make_batches(1, 1, seed=2))  # and trains on
    with _wrap(twin, device_memory=BUDGET):  # the copy is no wrapped model: it can be wrapped itself
        pass


def test_deepcopy_with_a_streamed_tied_embedding_keeps_it_tied():
    model = TinyGPT()
    with _wrap(model, device_memory=TIED_BUDGET) as engine:
        assert "wte" in engine.plan.streamed_blocks
        _train(engine, make_batches(1, 1))
        best = copy.deepcopy(model)
        _assert_holds(best, engine.state_dict())
        assert best.lm_head.weight is best.wte.weight


def test_deepcopy_without_streaming_strips_the_engine_hooks_and_keeps_the_users():
    """Before: the copy's forward waited on the original's blocks and its backward counted as a micro-batch of
    the original's step; `offload.wrap(copy)` said it was wrapped already."""
    model = TinyGPT()
    calls = []
    model.h[0].register_forward_hook(lambda *_: calls.append("user"))
    with _wrap(model) as engine:
        assert engine.plan.streamed_blocks == ()
        _train(engine, make_batches(1, 1))
        ema = copy.deepcopy(model)
        _assert_holds(ema, engine.state_dict())
        assert sum(len(sub._forward_hooks) for sub in ema.modules()) == 1  # the user's hook came along
        for sub in ema.modules():
            assert "__deepcopy__" not in vars(sub) and "_offload_engine" not in vars(sub)
        calls.clear()
        (idx, tgt), = make_batches(1, 1, seed=1)[0]
        ema(idx, tgt).backward()
        assert calls == ["user"]
        assert all(p.grad is not None for p in ema.parameters() if p.requires_grad)
        with _wrap(ema):
            pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepcopy_keeps_the_wrapped_dtypes(dtype):
    model = TinyGPT()
    with _wrap(model, dtype=dtype, device_memory=BUDGET // 2 if dtype == torch.bfloat16 else BUDGET) as engine:
        assert engine.plan.streamed_blocks
        _train(engine, make_batches(1, 1))
        twin = copy.deepcopy(model)
        wrapped = dict(model.named_parameters())
        for name, param in twin.named_parameters():
            assert param.dtype == wrapped[name].dtype, name
        assert twin.h[0].fc.weight.dtype == dtype and twin.h[0].ln1.weight.dtype == torch.float32
        _assert_holds(twin, engine.state_dict())


def test_deepcopy_right_after_step_waits_for_the_pending_updates():
    """step() may return before the updates run (overlap_step); the copy must hold the stepped weights. The
    updates are held for 0.2 s, so a copy that does not wait holds the weights of before the step."""
    overlap = {"overlap_step": True} if "overlap_step" in inspect.signature(offload.wrap).parameters else {}

    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET, **overlap) as engine:
        faults = faulty_stores(engine)
        faults.hold_updates()
        before = engine.state_dict()
        (idx, tgt), = make_batches(1, 1)[0]
        engine(idx, tgt).backward()
        threading.Timer(0.2, faults.release).start()
        engine.step()
        twin = copy.deepcopy(model)
        after = engine.state_dict()
        assert not torch.equal(before["h.0.fc.weight"], after["h.0.fc.weight"])
        assert not torch.equal(before["wte.weight"], after["wte.weight"])
        _assert_holds(twin, after)


def test_deepcopy_of_a_sub_module_copies_its_real_weights():
    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET) as engine:
        _train(engine, make_batches(1, 1))
        state = engine.state_dict()
        layer = copy.deepcopy(model.h[2])  # streamed
        _assert_holds(layer, state, "h.2.")
        _assert_plain(layer)
        layers = copy.deepcopy(model.h)
        _assert_holds(layers, state, "h.")
        _assert_plain(layers)
        head = copy.deepcopy(model.ln_f)  # resident
        _assert_holds(head, state, "ln_f.")
        _assert_plain(head)
        both = copy.deepcopy({"model": model, "layer": model.h[0]})  # one memo: the layer is the model's
        assert both["layer"] is both["model"].h[0]
        _assert_holds(both["model"], state)


def test_deepcopy_between_the_last_backward_and_step_is_refused_when_blocks_updated_early():
    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET, grad_accumulation_steps=1) as engine:
        for ((idx, tgt),) in make_batches(3, 1):  # from the second backward on, blocks update early
            engine(idx, tgt).backward()
            if engine.stats()["early_block_updates"]:
                with pytest.raises(OffloadError, match="between the last backward and step.*after engine.step"):
                    copy.deepcopy(model)
                engine.step()
                engine.zero_grad()
                _assert_holds(copy.deepcopy(model), engine.state_dict())
                break
            engine.step()
            engine.zero_grad()
        assert engine.stats()["early_block_updates"] > 0


def test_deepcopy_of_a_failed_engines_model_is_refused():
    model = TinyGPT()
    with pytest.warns(RuntimeWarning, match="failed update"):
        with _wrap(model, device_memory=BUDGET) as engine:
            engine._checkpoints.mark_inconsistent(RuntimeError("disk gone"))
            with pytest.raises(OffloadError, match="update failed.*engine.load"):
                copy.deepcopy(model)


def test_deepcopy_that_does_not_fit_on_the_device_is_refused_with_the_fix(monkeypatch):
    """On CUDA the copy of all weights may not fit where they stream from: torch's out-of-memory error would
    not say what to do instead. (Simulated on the CPU.)"""
    from offload.scheduler.records import model_copy

    def out_of_memory(*_args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET) as engine:
        with monkeypatch.context() as patch:
            patch.setattr(model_copy, "_memo_group", out_of_memory)
            with pytest.raises(OffloadError, match="does not fit on cpu.*engine.state_dict"):
                copy.deepcopy(model)
        _assert_holds(copy.deepcopy(model), engine.state_dict())  # nothing was left half-done


def test_after_close_deepcopy_is_torchs_own():
    model = TinyGPT()
    engine = _wrap(model, device_memory=BUDGET)
    _train(engine, make_batches(1, 1))
    state = engine.state_dict()
    engine.close()
    _assert_plain(model)
    _assert_holds(copy.deepcopy(model), state)


# ----- a streamed weight read outside its module ------------------------------------------------------------
class HandTiedGPT(nn.Module):
    """An output head tied by hand: the forward reads the embedding's weight itself."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 3, as_module: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(Layer(dim, 2) for _ in range(layers))
        self.ln_f = FP32LayerNorm(dim)
        self.head = None
        if as_module:  # the fix: an nn.Linear that owns the embedding's parameter too
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.h:
            x = layer(x)
        x = self.ln_f(x)
        logits = self.head(x) if self.head is not None else F.linear(x, self.emb.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("as_module", [True, False], ids=["head-module", "F.linear-on-emb.weight"])
def test_a_tied_head_trains_as_in_torch_while_streamed(as_module):
    """F.linear(x, self.emb.weight) reads a streamed parameter outside its module. Before read-through it
    computed on the NaN placeholder (NaN losses), then raised by name; now the read opens the block."""
    torch.manual_seed(0)
    model = HandTiedGPT(as_module=as_module)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    batches = make_batches(3, 1)
    with _wrap(model, device_memory=TIED_BUDGET) as engine:
        assert "emb" in engine.plan.streamed_blocks
        for ((idx, tgt),) in batches:
            expected = reference(idx, tgt)
            expected.backward()
            opt.step()
            opt.zero_grad()
            loss = engine(idx, tgt)
            loss.backward()
            engine.step()
            engine.zero_grad()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        assert engine.stats()["block_evictions"] > 0
        got = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=key)


# ----- streamed parameters read and written outside any forward (read_through.py) -----------------------------
HOST_FOR_DISK = 300 << 10  # tests/test_engine_disk_weights.py: the streamed layers' weights go to the swap file

PLACEMENTS = {
    "host-mirror": dict(tier="cpu", device_memory=BUDGET),
    "swap-file": dict(tier="nvme", device_memory=BUDGET, host_memory=HOST_FOR_DISK),
}


def _placed(model: nn.Module, placement: str, tmp_path, **kwargs) -> offload.Engine:
    options = dict(PLACEMENTS[placement], **kwargs)
    if options["tier"] == "nvme":
        options["nvme_path"] = tmp_path
    engine = _wrap(model, **options)
    assert engine.plan.streamed_blocks == ("h.0", "h.1", "h.2")
    if placement == "swap-file":
        assert engine.plan.disk_weight_blocks
    return engine


def _torch_step(reference: nn.Module, opt, idx, tgt) -> float:
    loss = reference(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("overlap_step", [False, True])
def test_streamed_weights_read_after_step_are_the_new_weights(placement, overlap_step, tmp_path):
    """Before: outside a forward a released block's parameters were NaN placeholders (a sum of |w| was NaN)."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    with _placed(model, placement, tmp_path, overlap_step=overlap_step) as engine:
        for ((idx, tgt),) in make_batches(3, 1):
            engine(idx, tgt).backward()
            engine.step()  # with overlap_step the updates may still run: a read waits for its block's
            _torch_step(reference, opt, idx, tgt)
            with torch.no_grad():
                got = {name: p.abs().sum().item() for name, p in model.named_parameters()}
            want = {name: p.abs().sum().item() for name, p in reference.named_parameters()}
            for name, value in want.items():
                assert got[name] == pytest.approx(value, rel=1e-5), name
            engine.zero_grad()
        exact = engine.state_dict()
        for name, param in model.named_parameters():
            assert torch.equal(param, exact[name]), name  # bit for bit what the engine holds


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_an_ema_of_streamed_weights_follows_torchs(placement, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    with _placed(model, placement, tmp_path) as engine:
        ema = [p.detach().clone() for p in model.parameters()]
        ema_ref = [p.detach().clone() for p in reference.parameters()]
        for ((idx, tgt),) in make_batches(3, 1):
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
            _torch_step(reference, opt, idx, tgt)
            with torch.no_grad():
                for mine, theirs, p, q in zip(ema, ema_ref, model.parameters(), reference.parameters()):
                    mine.lerp_(p, 0.1)
                    theirs.lerp_(q, 0.1)
        for mine, theirs in zip(ema, ema_ref):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_view_of_a_streamed_weight_taken_outside_the_forward_stays_the_live_weight():
    """torch: `w = p.detach()` shares p's memory, so it shows every later step's weights. A released block's
    view pins the block while it lives (its buffer is never freed under it)."""
    model = TinyGPT()
    with _wrap(model, device_memory=BUDGET) as engine:
        view = model.h[0].fc.weight.detach()
        _train(engine, make_batches(3, 1))
        assert torch.equal(view, engine.state_dict()["h.0.fc.weight"])
        assert engine.stats()["block_evictions"] > 0  # the other layers still stream
        fetches = engine.stats()["block_fetches"]
        del view
        _train(engine, make_batches(2, 1, seed=1))
        assert engine.stats()["block_fetches"] > fetches


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_writes_to_streamed_weights_after_wrap_are_kept(placement, tmp_path):
    """Before: nn.init.zeros_(param) after wrap() wrote the NaN placeholder's one element and the first step
    trained on the old weights. Trainable (h.0, h.2) and frozen (h.1) streamed parameters. (A write through
    `.data` bumps no version counter and stays unseen: docs/design.md [Note: weights written after wrap()].)"""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    with _placed(model, placement, tmp_path) as engine:
        for net in (model, reference):
            with torch.no_grad():
                nn.init.zeros_(net.h[0].fc.weight)
                nn.init.constant_(net.h[1].fc.bias, 0.25)  # frozen
                net.h[2].proj.weight.mul_(0.5)
        losses, expected = [], []
        for ((idx, tgt),) in make_batches(3, 1):
            loss = engine(idx, tgt)
            loss.backward()
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
            expected.append(_torch_step(reference, opt, idx, tgt))
        assert losses == pytest.approx(expected, abs=1e-5)
        got = engine.state_dict()
        assert torch.equal(got["h.1.fc.bias"], torch.full_like(got["h.1.fc.bias"], 0.25))
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=key)
