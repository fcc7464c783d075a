"""accelerate's own training loop through an engine (issue "the loops people write"): `prepare(model,
optimizer, scheduler)`, `accelerator.backward`, `accelerator.clip_grad_norm_(model.parameters(), 1.0)`, a
LambdaLR, `save_state` at step 3 and `load_state` into a fresh run. The same loop over torch.optim.AdamW is
the reference: losses within 1e-5, clip norms within 1e-4, and the resumed run equal to the uninterrupted
one within 1e-6."""

from __future__ import annotations

import pytest
import torch

import offload
from tests.models import TinyGPT, make_batches, one_intraop_thread

accelerate = pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

LR, WD, STEPS, SAVE_AT = 1e-2, 0.1, 6, 3
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _loop(tmp_path, tier, save_to=None, resume_from=None):
    """The user's script: `tier` None is plain torch.optim.AdamW. Returns losses, clip norms, final weights."""
    torch.manual_seed(0)
    model = TinyGPT()
    accelerator = accelerate.Accelerator(cpu=True)
    engine = None
    if tier is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                                      foreach=False)
    else:
        swap = tmp_path / f"swap-{len(list(tmp_path.glob('swap-*')))}"
        swap.mkdir()
        engine = offload.wrap(model, tier=tier, dtype=torch.float32, device="cpu", lr=LR, weight_decay=WD,
                              **(dict(nvme_path=swap) if tier == "nvme" else {}))
        optimizer = engine.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    first = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = SAVE_AT
    losses, norms = [], []
    batches = make_batches(STEPS, 1)
    for step in range(first, STEPS):
        if step == SAVE_AT and save_to is not None:
            accelerator.save_state(save_to)
        ((idx, tgt),) = batches[step]
        loss = model(idx, tgt)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if engine is not None:
        engine.close()
    return losses, norms, weights


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_accelerates_loop_trains_saves_and_resumes_as_with_torch_adamw(tmp_path, tier):
    want_losses, want_norms, want_weights = _loop(tmp_path, None)
    losses, norms, weights = _loop(tmp_path, tier, save_to=tmp_path / "state")
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
    assert max(abs(a - b) for a, b in zip(norms, want_norms)) <= 1e-4, (norms, want_norms)
    assert max(n for n in norms) > 1.0  # the clip did clip
    for key, value in want_weights.items():
        torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=1e-5, msg=key)
    resumed_losses, _norms, resumed = _loop(tmp_path, tier, resume_from=tmp_path / "state")
    assert max(abs(a - b) for a, b in zip(resumed_losses, losses[SAVE_AT:])) <= 1e-6
    for key, value in weights.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0, msg=key)


def test_the_models_state_dict_entries_have_storages_of_their_own(tmp_path):
    """safetensors (accelerate's save_state, save_model, save_pretrained) keeps one tensor per storage: with
    entries viewing one flat buffer it dropped all but one per group. Before: save_state wrote a file
    missing most weights (with a warning), and load_state refused it."""
    torch.manual_seed(0)
    reference = TinyGPT()
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu") as engine:
        engine.module.load_state_dict(reference.state_dict())
        safetensors_torch.save_model(engine.module, str(tmp_path / "model.safetensors"))
        state = engine.module.state_dict()
        assert engine.module.lm_head.weight is engine.module.wte.weight  # tied: one copy for both names
        assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
        for key, value in state.items():
            assert value.untyped_storage().nbytes() == value.nbytes, key
        params = engine.module.state_dict(keep_vars=True)
        assert params["wte.weight"] is engine.module.wte.weight  # keep_vars: the parameters themselves
    loaded = TinyGPT()
    safetensors_torch.load_model(loaded, str(tmp_path / "model.safetensors"))
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
