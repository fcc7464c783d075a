"""PyTorch habits around a wrapped model work as without offload, or raise at once with the fix (issue
"never silently wrong"). Each test trains the same model with torch.optim.AdamW next to the engine."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadError
from tests.faults import faulty_stores
from tests.models import GRAD_ROOM, TinyGPT, make_batches, one_intraop_thread

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOL = 1e-5

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _train(model, step, batches) -> None:
    for ((idx, tgt),) in batches:
        model(idx, tgt).backward()
        step()


def _wrap_as_reference(model, tier: str, tmp_path):
    """`model` wrapped with the AdamW options the torch reference runs with, fp32 on the CPU."""
    return offload.wrap(model, tier=tier, nvme_path=tmp_path if tier == "nvme" else None, lr=LR, betas=BETAS,
                        eps=EPS, weight_decay=WD, dtype=torch.float32, device="cpu")


def _stepper(engine):
    def step_and_zero() -> None:
        engine.step()
        engine.zero_grad()
    return step_and_zero


def _pretrained() -> dict:
    torch.manual_seed(1)
    return TinyGPT().state_dict()


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
def test_load_state_dict_after_wrap_becomes_the_weights_that_train(tmp_path, tier):
    """torch: the loaded weights train on, the optimizer keeps its moments. Before: the engine's master copy
    was not refreshed and the first step wrote the old weights back."""
    batches = make_batches(4, 1)
    torch.manual_seed(0)
    reference = TinyGPT()
    model = TinyGPT()
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)

    def torch_step():
        opt.step()
        opt.zero_grad()

    _train(reference, torch_step, batches[:2])
    reference.load_state_dict(_pretrained())
    _train(reference, torch_step, batches[2:])
    with _wrap_as_reference(model, tier, tmp_path) as engine:
        engine_step = _stepper(engine)

        _train(engine, engine_step, batches[:2])  # updates still pending when the load comes
        model.load_state_dict(_pretrained())
        _train(engine, engine_step, batches[2:])
        got = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


def test_load_state_dict_into_streamed_blocks_is_refused_before_anything_changes():
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", device_memory=60_000 + GRAD_ROOM) as engine:
        assert any(r.streamed for r in engine.records)
        before = engine.state_dict()
        with pytest.raises(OffloadError, match="streamed from host or disk.*engine.load"):
            model.load_state_dict(_pretrained())
        after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_model_state_dict_right_after_step_holds_the_updated_weights(tmp_path):
    """With overlap_step, step() returns before the updates run; model.state_dict() must still read the
    weights after the step, as with torch. Before: the weights of before or midway through the update.
    The updates are held for 0.2 s after each step(), so a read that does not wait sees the old weights."""
    batches = make_batches(3, 1)
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      dtype=torch.float32, device="cpu", overlap_step=True) as engine:
        faults = faulty_stores(engine)
        for ((idx, tgt),) in batches:
            reference(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
            model(idx, tgt).backward()
            faults.hold_updates()
            engine.step()
            engine.zero_grad()
            threading.Timer(0.2, faults.release).start()
            got = {k: v.clone() for k, v in model.state_dict().items()}  # right after step()
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_model_state_dict_with_streamed_blocks_equals_engine_state_dict(tmp_path, tier):
    """nanoGPT saves `raw_model.state_dict()`: with blocks streamed (from disk too) it raised at the first
    checkpoint, after the training before it. Now it returns the current weights, as `engine.state_dict()`, read
    module by module (the device budget holds), a sub-module's too; after close, plain PyTorch."""
    torch.manual_seed(0)
    model = TinyGPT()
    options = dict(nvme_path=tmp_path, host_memory=300_000) if tier == "nvme" else {}
    with offload.wrap(model, tier=tier, dtype=torch.float32, device="cpu", device_memory=60_000 + GRAD_ROOM,
                      **options) as engine:
        assert engine.plan.streamed_blocks and (tier == "cpu" or engine.plan.disk_weight_blocks)
        _train(engine, _stepper(engine), make_batches(2, 1))
        got, want = model.state_dict(), engine.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        layer = model.get_submodule(engine.plan.streamed_blocks[-1])
        for key, value in layer.state_dict().items():
            assert torch.equal(value, want[f"{engine.plan.streamed_blocks[-1]}.{key}"]), key
        assert engine.stats()["device_peak_bytes"] <= 60_000 + GRAD_ROOM
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())  # after close: plain PyTorch


def test_model_state_dict_that_would_not_fit_host_memory_is_refused_before_reading(monkeypatch):
    from offload.scheduler.records import module_weights

    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", device_memory=60_000 + GRAD_ROOM) as engine:
        monkeypatch.setattr(module_weights, "mem_available", lambda: module_weights.HOST_MEMORY_MARGIN + 1000)
        fetches = engine.stats()["bytes_host_to_device"]
        with pytest.raises(OffloadError, match=r"engine.save\(path\) or engine.save_pretrained"):
            model.state_dict()
        assert engine.stats()["bytes_host_to_device"] == fetches  # nothing was read


def test_converting_the_model_after_wrap_raises_at_the_next_forward():
    """model.double() after wrap() used to disconnect the parameters: they never changed again."""
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        model.float()  # already fp32: the same tensors, nothing changes
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()
        model.double()
        with pytest.raises(OffloadError, match="moved or converted after offload.wrap.*convert the model first"):
            engine(idx, tgt)


def test_a_parameter_unfrozen_after_wrap_is_refused_at_step():
    """It had no optimizer state: it never changed, and its .grad grew at every backward."""
    model = TinyGPT()
    model.h[1].requires_grad_(False)
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        model.h[1].requires_grad_(True)
        engine(idx, tgt).backward()
        with pytest.raises(OffloadError, match="'h.1.* was frozen at offload.wrap.*requires grad now"):
            engine.step()


def test_zero_grad_between_the_last_backward_and_step_is_refused_when_blocks_updated_early():
    """torch would step on no gradient; with accumulation declared the blocks already stepped in backward."""
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        for ((idx, tgt),) in make_batches(2, 1):  # the second backward has a profile: blocks update early
            engine(idx, tgt).backward()
            if engine.stats()["early_block_updates"]:
                with pytest.raises(OffloadError, match="zero_grad\\(\\) between the last backward and step"):
                    engine.zero_grad()
                break
            engine.step()
            engine.zero_grad()
        assert engine.stats()["early_block_updates"] > 0
        engine.step()  # the step in progress completes normally
        engine.zero_grad()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_an_ema_over_model_parameters_right_after_step_matches_torch(tmp_path, tier):
    """An EMA read from model.parameters() right after step() (no state_dict hook in the way) sees the
    stepped weights, as with torch: step() waits for its updates unless overlap_step is asked for.
    Before: 8 of 8 steps read weights from before or midway through the update."""
    batches = make_batches(4, 1)
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    ema_ref = [p.detach().clone() for p in reference.parameters()]
    ema = [p.detach().clone() for p in model.parameters()]
    kwargs = dict(nvme_path=tmp_path) if tier == "nvme" else {}
    with offload.wrap(model, tier=tier, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                      device="cpu", **kwargs) as engine:
        for ((idx, tgt),) in batches:
            reference(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
            model(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
            with torch.no_grad():
                for avg, p in zip(ema_ref, reference.parameters()):
                    avg.lerp_(p, 0.5)
                for avg, p in zip(ema, model.parameters()):
                    avg.lerp_(p, 0.5)
    for got, want in zip(ema, ema_ref):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def _edits(model) -> None:
    """What people do to weights after building (or wrapping) a model: nn.init, a sub-module's
    load_state_dict, a torch.no_grad() write."""
    torch.nn.init.zeros_(model.h[0].fc.bias)
    torch.nn.init.constant_(model.ln_f.weight, 0.5)
    torch.manual_seed(3)
    model.h[0].proj.load_state_dict(torch.nn.Linear(*model.h[0].proj.weight.shape[::-1]).state_dict())
    with torch.no_grad():
        model.wte.weight[:4].mul_(0.5)


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
def test_weights_written_after_wrap_train_on_as_with_torch(tmp_path, tier):
    """Before: nn.init.zeros_(layer.bias) after wrap() was undone by the first step (the fp32 master copy
    never saw it), and a sub-module's load_state_dict was discarded the same way."""
    batches = make_batches(4, 1)
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)

    def torch_step():
        opt.step()
        opt.zero_grad()

    _edits(reference)  # right after building, i.e. right after wrap() for the engine
    _train(reference, torch_step, batches[:2])
    _edits(reference)  # between steps: the moments stay
    _train(reference, torch_step, batches[2:])
    with _wrap_as_reference(model, tier, tmp_path) as engine:
        engine_step = _stepper(engine)

        _edits(model)
        _train(engine, engine_step, batches[:2])
        _edits(model)
        _train(engine, engine_step, batches[2:])
        got = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


def test_a_checkpoint_saved_right_after_a_write_holds_it(tmp_path):
    """engine.save() takes the written weights as the master weights too, so a resume trains on from them."""
    batches = make_batches(3, 1)
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    _train(reference, lambda: (opt.step(), opt.zero_grad()), batches[:1])
    _edits(reference)
    _train(reference, lambda: (opt.step(), opt.zero_grad()), batches[1:])
    options = dict(tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32, device="cpu")
    with offload.wrap(model, **options) as engine:
        _train(engine, lambda: (engine.step(), engine.zero_grad()), batches[:1])
        _edits(model)
        engine.save(tmp_path / "ckpt")
    torch.manual_seed(0)
    with offload.wrap(TinyGPT(), **options) as resumed:
        resumed.load(tmp_path / "ckpt")
        _train(resumed, lambda: (resumed.step(), resumed.zero_grad()), batches[1:])
        got = resumed.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


def test_a_bf16_write_keeps_the_fp32_master_of_the_weights_it_did_not_touch(tmp_path):
    """Only the written parameters take their (bf16) values into the fp32 master copy; the others keep the
    fp32 master digits the bf16 weights cannot hold."""
    from offload.checkpoint.reader import master_weights

    masters = []
    for write in (False, True):
        torch.manual_seed(0)
        with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.bfloat16, device="cpu", lr=LR) as engine:
            _train(engine, lambda: (engine.step(), engine.zero_grad()), make_batches(1, 1))
            if write:
                torch.nn.init.zeros_(engine.module.h[0].fc.bias)
            engine.save(tmp_path / f"ckpt{write}")
        masters.append(master_weights(str(tmp_path / f"ckpt{write}")))
    untouched, written = masters
    assert torch.equal(written["h.0.fc.bias"], torch.zeros_like(written["h.0.fc.bias"]))
    for key in ("h.0.fc.weight", "h.0.qkv.weight", "wte.weight"):
        assert torch.equal(untouched[key], written[key]), key
        assert not torch.equal(written[key], written[key].bfloat16().float()), key  # real fp32 digits kept


def test_a_write_right_after_an_overlapped_step_lands_after_the_update_as_in_torch():
    """step() returns before the updates (overlap_step): a write to a parameter whose update is still pending
    waits for it (the parameter reads through until its block settles), then lands, as after torch's step.
    Before: the write raced the update, and the next forward refused it ("written while its block's update was
    still pending")."""
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    ((idx, tgt),), ((idx2, tgt2),) = make_batches(2, 1)
    reference(idx, tgt).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        torch.nn.init.zeros_(reference.h[0].fc.bias)
    with offload.wrap(model, tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                      device="cpu", overlap_step=True) as engine:
        faults = faulty_stores(engine)
        faults.hold_updates()
        engine(idx, tgt).backward()
        engine.step()  # returns at once: the updates are held
        engine.zero_grad()
        threading.Timer(0.2, faults.release).start()
        with torch.no_grad():
            torch.nn.init.zeros_(model.h[0].fc.bias)  # waits for h.0's update, then writes
        assert faults.met > 0
        got = engine(idx2, tgt2)
        want = reference(idx2, tgt2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        trained = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_a_sub_module_state_dict_after_an_overlapped_step_holds_the_updated_weights():
    """The state-dict hooks sit on every module that owns parameters, so `model.h[0].state_dict()` waits
    for that block's update as `model.state_dict()` does."""
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    ((idx, tgt),) = make_batches(1, 1)[0]
    reference(idx, tgt).backward()
    opt.step()
    with offload.wrap(model, tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                      device="cpu", overlap_step=True) as engine:
        faults = faulty_stores(engine)
        faults.hold_updates()
        model(idx, tgt).backward()
        engine.step()  # returns at once: the updates are held
        threading.Timer(0.2, faults.release).start()
        got = {k: v.clone() for k, v in model.h[0].state_dict().items()}
    for key, value in reference.h[0].state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


def test_a_streamed_sub_module_load_is_refused():
    """Before: `model.h[0].state_dict()` of a streamed block returned its NaN placeholders, no error (now it
    reads the weights: above); a load into a streamed block cannot write them and is refused."""
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", device_memory=60_000 + GRAD_ROOM) as engine:
        streamed = [r.block.name for r in engine.records if r.streamed]
        layer = model.get_submodule(streamed[0])
        with pytest.raises(OffloadError, match="cannot write the weights"):
            layer.load_state_dict({k: torch.zeros_like(v) for k, v in TinyGPT().get_submodule(streamed[0])
                                   .state_dict().items()})
        assert all(torch.isfinite(v).all() for v in engine.state_dict().values())  # nothing was written


def test_a_bf16_forward_failing_on_an_fp32_norm_names_autocast():
    """Norm weights stay fp32 under a bf16 compute dtype (as autocast keeps them); a Hugging Face style norm
    then returns fp32 into a bf16 layer. Before: torch's bare dtype error, nothing about why or the fix."""

    class ScaleNorm(torch.nn.Module):  # like LlamaRMSNorm: weight * x, in the weight's dtype
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.weight * x

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), ScaleNorm(), torch.nn.Linear(8, 1))
    with offload.wrap(model, dtype=torch.bfloat16, device="cpu") as engine:
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
        with pytest.raises(OffloadError, match=r"mixed dtypes.*torch.autocast\(device_type='cpu', dtype=torch.bfloat16\)"):
            engine(torch.ones(2, 8, dtype=torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
        engine.step()


@pytest.mark.parametrize("options", [dict(), dict(max_grad_norm=0.5), dict(grad_accumulation_steps=1,
                                                                            max_grad_norm=0.5,
                                                                            speculative_clipping=False)],
                         ids=["undeclared", "clipping", "declared-clipping"])
def test_step_returns_before_the_updates_and_a_read_right_after_it_sees_the_new_weights(options):
    """Where the updates cannot run during the backward (clipping without speculation, undeclared accumulation),
    step() returns once they are scheduled with `overlap_step=True` (the default when a GPU computes), so they
    overlap the next forward; a resident parameter read before that forward waits for its block's update (it
    reads through while the update is pending), as torch shows it. (A speculating step waits for the updates
    the backward started: tests/test_speculative_clipping.py.)"""
    options = dict(options, overlap_step=True)
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    ((idx, tgt),) = make_batches(1, 1)[0]
    reference(idx, tgt).backward()
    if "max_grad_norm" in options:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), options["max_grad_norm"])
    opt.step()
    with offload.wrap(model, tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                      device="cpu", **options) as engine:
        assert engine.plan.streamed_blocks == ()  # every block resident: what the guard is for
        faults = faulty_stores(engine)
        faults.hold_updates()
        engine(idx, tgt).backward()
        engine.step()  # returns while the updates are held: they would block it otherwise
        threading.Timer(0.2, faults.release).start()
        with torch.no_grad():
            got = {name: p.detach().clone() for name, p in model.named_parameters()}  # each waits for its block
        assert faults.met > 0 and faults.timed_out == 0, "step() waited for the held updates"
        assert type(model.h[0].fc.weight) is nn.Parameter  # settled: plain again
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("tier,options", [("gpu", {}), ("cpu", {}), ("cpu", dict(grad_accumulation_steps=2)),
                                          ("nvme", {}), ("nvme", dict(max_grad_norm=1e9, host_memory=170_000))])
def test_a_post_accumulate_grad_hook_registered_before_wrap_reads_the_running_sum(tmp_path, tier, options):
    """A hook registered before the engine's runs first: at the second micro-batch it reads torch's running sum
    of the gradients (it read only the earlier micro-batches' before: the engine had not yet added this one's),
    and what it does in place (a scale) applies to that sum, as in torch. Last case: the gradients wait on disk."""
    def run(wrapped: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 2))
        seen = []

        def hook(param):
            seen.append(param.grad.norm().item())
            param.grad.mul_(0.5)

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(hook)
        if wrapped:
            engine = offload.wrap(model, tier=tier, nvme_path=tmp_path if tier == "nvme" else None, lr=LR,
                                  betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32, device="cpu", **options)
            forward, optimizer = engine, engine
        else:
            forward, optimizer = model, torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                                          weight_decay=WD)
        for step in range(2):
            for micro in range(2):
                x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10 * step + micro))
                forward(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return seen, [p.detach().clone() for p in model.parameters()]

    seen, weights = run(True)
    ref_seen, ref_weights = run(False)
    assert seen == pytest.approx(ref_seen, rel=1e-6, abs=1e-7)
    for got, ref in zip(weights, ref_weights):
        assert (got - ref).abs().max().item() <= TOL
