"""`engine.optimizer.state_dict()` / `load_state_dict()` in torch's AdamW format (issue "the loops people
write"): what torch.optim.AdamW holds after the same steps, a `torch.save` round trip that resumes bit for
bit, state dicts that cross between torch's AdamW and the engine both ways, torch's empty state before the
first step (accelerate.prepare), file-backed state on the nvme tier, and every misuse refused before
anything changes. Data-parallel: tests/test_data_parallel.py (`torch_state` cases)."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.engine.engine import Engine
from offload.errors import OffloadError
from tests.models import TinyGPT, make_batches, one_intraop_thread
from tests.proc_status import status

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _engine(model, tmp_path, tier: str, dtype=torch.float32, name: str = "swap", **options):
    kwargs = {}
    if tier == "nvme":
        (tmp_path / name).mkdir(exist_ok=True)
        kwargs["nvme_path"] = tmp_path / name
    return offload.wrap(model, tier=tier, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=dtype,
                        device="cpu", **kwargs, **options)


def _torch_adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=WD, foreach=False)


def _train(trainer, model, batches, clip=None) -> None:
    """Steps of `trainer`: a torch optimizer over `model`, or an engine (`model` its module)."""
    forward = trainer if isinstance(trainer, Engine) else model
    for ((idx, tgt),) in batches:
        forward(idx, tgt).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        trainer.step()
        trainer.zero_grad()


def _assert_same_state(got: dict, want: dict, tol: float) -> None:
    assert got["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        for key, value in entry.items():
            err = (got["state"][index][key].float() - value.float()).abs().max().item()
            assert err <= tol, (index, key, err)


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
def test_the_state_dict_is_torch_adamws_after_the_same_steps(tmp_path, tier):
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = _torch_adamw(reference)
    batches = make_batches(3, 1)
    _train(opt, reference, batches, clip=0.05)
    with _engine(model, tmp_path, tier) as engine:
        assert engine.optimizer.state_dict()["state"] == {}  # torch's, before any step
        _train(engine, model, batches, clip=0.05)
        ours, theirs = engine.optimizer.state_dict(), opt.state_dict()
    assert [g.keys() for g in ours["param_groups"]] == [g.keys() for g in theirs["param_groups"]]
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert set(ours["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # fp32 compute: no master of ours
    assert all(torch.equal(ours["state"][i]["step"], e["step"]) for i, e in theirs["state"].items())
    _assert_same_state(ours, theirs, 1e-6)
    fresh = _torch_adamw(copy.deepcopy(reference))
    fresh.load_state_dict(ours)  # torch's AdamW takes it as its own


@pytest.mark.parametrize("tier,dtype", [("cpu", torch.float32), ("nvme", torch.bfloat16)])
def test_a_torch_save_round_trip_resumes_bit_for_bit(tmp_path, tier, dtype):
    torch.manual_seed(0)
    batches = make_batches(5, 1)
    with _engine(TinyGPT(), tmp_path, tier, dtype) as engine:
        _train(engine, engine.module, batches[:2])
        torch.save({"model": engine.state_dict(), "optimizer": engine.optimizer.state_dict()}, tmp_path / "ck.pt")
        _train(engine, engine.module, batches[2:])
        want = engine.state_dict()
    checkpoint = torch.load(tmp_path / "ck.pt")
    if dtype != torch.float32:
        assert "offload_master" in checkpoint["optimizer"]["state"][0]  # the fp32 weights the bf16 ones round
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    with _engine(TinyGPT(), tmp_path, tier, dtype, name="resumed") as engine:
        engine.module.load_state_dict(checkpoint["model"])
        engine.optimizer.load_state_dict(checkpoint["optimizer"])
        _train(engine, engine.module, batches[2:])
        got = engine.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_torch_adamws_state_loads_into_the_engine_and_trains_on_as_torch(tmp_path):
    torch.manual_seed(0)
    reference = TinyGPT()
    opt = _torch_adamw(reference)
    batches = make_batches(4, 1)
    _train(opt, reference, batches[:2])
    model = TinyGPT()
    model.load_state_dict(reference.state_dict())
    with _engine(model, tmp_path, "nvme") as engine:
        engine.optimizer.load_state_dict(opt.state_dict())
        _train(opt, reference, batches[2:])
        _train(engine, model, batches[2:])
        _assert_same_state(engine.optimizer.state_dict(), opt.state_dict(), 1e-6)
        got = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)


def test_loading_torchs_empty_state_after_steps_starts_afresh_as_torch_does(tmp_path):
    """accelerate.prepare round-trips the state; a state dict without a parameter's entry resets it in torch."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = _torch_adamw(reference)
    empty = opt.state_dict()
    batches = make_batches(3, 1)
    with _engine(model, tmp_path, "cpu") as engine:
        engine.optimizer.load_state_dict(engine.optimizer.state_dict())  # before any step: what prepare does
        _train(opt, reference, batches[:1])
        _train(engine, model, batches[:1])
        opt.load_state_dict(empty)
        engine.optimizer.load_state_dict(empty)
        assert engine.optimizer.state_dict()["state"] == {}
        _train(opt, reference, batches[1:])
        _train(engine, model, batches[1:])
        _assert_same_state(engine.optimizer.state_dict(), opt.state_dict(), 1e-6)


def test_loaded_hyperparameters_take_effect(tmp_path):
    with _engine(TinyGPT(), tmp_path, "cpu") as engine:
        saved = engine.optimizer.state_dict()
        saved["param_groups"][0]["lr"] = 0.5
        engine.optimizer.load_state_dict(saved)
        assert engine.optimizer.param_groups[0]["lr"] == 0.5
        assert "amsgrad" not in engine.optimizer.param_groups[0]  # AdamW's flags are checked, not kept


def _misuses():
    def amsgrad(sd, model):
        sd["param_groups"][0]["amsgrad"] = True

    def sgd_state(sd, model):
        sd["state"][0] = {"momentum_buffer": torch.zeros(1)}

    def another_grouping(sd, model):
        sd["param_groups"].append({"params": [], "lr": 1.0})

    def wrong_shape(sd, model):
        sd["state"][0]["exp_avg"] = torch.zeros(3)

    def unknown_id(sd, model):
        sd["state"][999] = sd["state"][0]

    return {"amsgrad": (amsgrad, "amsgrad"), "another optimizer": (sgd_state, "momentum_buffer.*not torch.optim"),
            "another grouping": (another_grouping, "parameter groups"), "another model": (wrong_shape, "elements"),
            "unknown ids": (unknown_id, "ids")}


@pytest.mark.parametrize("misuse", list(_misuses()))
def test_a_state_dict_of_something_else_is_refused_before_anything_changes(tmp_path, misuse):
    change, message = _misuses()[misuse]
    with _engine(TinyGPT(), tmp_path, "nvme") as engine:
        _train(engine, engine.module, make_batches(1, 1))
        before = engine.optimizer.state_dict()
        bad = copy.deepcopy(before)
        change(bad, engine.module)
        with pytest.raises(OffloadError, match=message):
            engine.optimizer.load_state_dict(bad)
        _assert_same_state(engine.optimizer.state_dict(), before, 0.0)
        assert engine.optimizer.param_groups[0]["lr"] == LR


def test_loading_between_backward_and_step_is_refused_with_the_fix(tmp_path):
    with _engine(TinyGPT(), tmp_path, "cpu") as engine:
        _train(engine, engine.module, make_batches(1, 1))
        saved = engine.optimizer.state_dict()
        ((idx, tgt),) = make_batches(1, 1)[0]
        engine(idx, tgt).backward()
        with pytest.raises(OffloadError, match="step\\(\\) or engine.zero_grad\\(\\) first"):
            engine.optimizer.load_state_dict(saved)
        engine.step()  # the gradients were kept


def test_on_the_nvme_tier_the_state_is_file_backed_not_in_host_memory(tmp_path):
    """torch.save streams it: the tensors map a snapshot next to the swap files (unlinked at once)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=4096, dim=512, layers=6, context=16, heads=8)
    with _engine(model, tmp_path, "nvme") as engine:
        _train(engine, model, make_batches(1, 1, vocab=4096))
        engine.optimizer.state_dict()  # a first call touches the ring's slots and the allocator
        anon_before = status("RssAnon")
        state = engine.optimizer.state_dict()
        anon_grown = status("RssAnon") - anon_before
        state_bytes = sum(t.nbytes for e in state["state"].values() for t in e.values())
        assert state_bytes > 100 * 2**20
        assert anon_grown < state_bytes / 8, (anon_grown, state_bytes)
        assert not [p for p in (tmp_path / "swap").iterdir() if "optimizer-state" in p.name]  # unlinked
        torch.save(state, tmp_path / "optimizer.pt")
        assert torch.equal(torch.load(tmp_path / "optimizer.pt")["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_optimizer_state_of_a_parameter_reads_as_torchs(tmp_path, tier):
    """`engine.optimizer.state[p]["exp_avg"]` after steps, as torch code reads it (it was empty: a bare KeyError);
    a parameter not stepped has none, as in torch; the entries are copies, and writing one names the way."""
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    engine, reference = _engine(model, tmp_path, tier), _torch_adamw(twin)
    param, ref_param = model.wpe.weight, twin.wpe.weight
    assert param not in engine.optimizer.state and len(engine.optimizer.state) == 0
    assert dict(engine.optimizer.state[param]) == {}
    batches = make_batches(2, 1)
    _train(engine, model, batches)
    _train(reference, twin, batches)
    state, ref_state = engine.optimizer.state[param], reference.state[ref_param]
    assert param in engine.optimizer.state and len(engine.optimizer.state) == len(reference.state)
    assert state.keys() == ref_state.keys()
    for key in ("exp_avg", "exp_avg_sq"):
        assert (state[key] - ref_state[key]).abs().max().item() <= 1e-6
    assert float(state["step"]) == float(ref_state["step"]) == 2.0
    with pytest.raises(OffloadError, match="load_state_dict"):
        state["exp_avg"] = torch.zeros_like(state["exp_avg"])
    with pytest.raises(OffloadError, match="load_state_dict"):
        engine.optimizer.state[param] = {}
    engine.close()


def test_copying_or_pickling_the_optimizer_is_refused_naming_its_state_dict(tmp_path):
    """A copy of `engine.optimizer` could not own the engine's state (its state_dict() failed with
    `AttributeError: _state_io`): copying or pickling it raises at once, naming `state_dict()`."""
    import pickle

    engine = _engine(TinyGPT(), tmp_path, "cpu")
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(OffloadError, match=r"state_dict\(\)"):
            copier(engine.optimizer)
    assert type(copy.deepcopy(engine.optimizer.state_dict())) is dict  # the way it names works
    group = pickle.loads(pickle.dumps(engine.optimizer.param_groups[0]))
    assert type(group) is dict and group["lr"] == LR
    engine.close()


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_an_adamw_option_the_engine_does_not_run_is_refused_when_set(tmp_path, flag):
    """`param_groups[0]["amsgrad"] = True` was ignored (its load_state_dict refused the same flag)."""
    engine = _engine(TinyGPT(), tmp_path, "cpu")
    with pytest.raises(OffloadError, match=f"without {flag}"):
        engine.optimizer.param_groups[0][flag] = True
    with pytest.raises(OffloadError, match=f"without {flag}"):
        engine.optimizer.param_groups[0].update({flag: True})
    engine.optimizer.param_groups[0][flag] = False  # torch's value: nothing changes
    engine.close()


@pytest.mark.parametrize("how", ["assignment", "step_pre_hook", "scheduler"])
def test_a_hyperparameter_changed_after_blocks_updated_early_raises_at_the_change(tmp_path, how):
    """With accumulation declared, blocks update during the last backward with the lr of that moment: an lr set
    between that backward and step() (by hand, in a step pre-hook, by a scheduler) could not reach them, and
    raised only a warning after step(). Now the assignment raises, before anything else changes; the same value,
    or a change after step(), is fine."""
    torch.manual_seed(0)
    engine = _engine(TinyGPT(), tmp_path, "cpu", grad_accumulation_steps=1)
    ((idx, tgt),) = make_batches(1, 1)[0]
    engine(idx, tgt).backward()
    engine.optimizer.param_groups[0]["lr"] = LR  # unchanged
    change = {
        "assignment": lambda: engine.optimizer.param_groups[0].__setitem__("lr", LR / 2),
        "step_pre_hook": lambda: (engine.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: opt.param_groups[0].__setitem__("lr", LR / 2)), engine.step()),
        "scheduler": lambda: torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5).step(),
    }[how]
    with pytest.raises(OffloadError, match="between the last backward and step"):
        change()
    assert engine.optimizer.param_groups[0]["lr"] == LR
    engine.close()


def test_hyperparameters_changed_right_after_step_take_effect_without_a_warning(tmp_path):
    import warnings

    engine = _engine(TinyGPT(), tmp_path, "cpu", grad_accumulation_steps=1)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ((idx, tgt),) in make_batches(3, 1):
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
            scheduler.step()
    assert engine.optimizer.param_groups[0]["lr"] == LR / 8
    engine.close()
