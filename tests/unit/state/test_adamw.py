"""The one AdamW loop (offload/scheduler/state/adamw.py) over each store against torch.optim.AdamW's
single-tensor maths."""

from __future__ import annotations

import pytest
import torch

from offload.errors import OffloadConfigError
from offload.scheduler.state.adamw import AdamHyper, adamw
from tests.unit.state.stores import STORE_KINDS, CallLog, open_store, read_all, ring_slots_all_back

HYPERS = (  # one optimizer group per parameter, all different
    AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    AdamHyper(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0),
    AdamHyper(lr=5e-3, beta1=0.95, beta2=0.98, eps=1e-7, weight_decay=0.05),
)
# per step: (parameters with a gradient, grad_scale); parameter 1 gets none at step 2 (skipped, as torch skips
# `grad is None`: no decay, no step count)
STEPS = (((0, 1, 2), 1.0), ((0, 2), 0.5), ((0, 1, 2), 1.0), ((1,), 0.25))


def _reference(group, per_param: bool):
    params = [slot.param.detach().clone().requires_grad_(True) for slot in group.trainable_slots]
    groups = [{"params": [p], "lr": h.lr, "betas": (h.beta1, h.beta2), "eps": h.eps, "weight_decay": h.weight_decay}
              for p, h in zip(params, HYPERS if per_param else HYPERS[:1] * 3)]
    return params, torch.optim.AdamW(groups, foreach=False)


@pytest.mark.parametrize("per_param", [True, False], ids=["span-per-param", "one-span"])
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_adamw_equals_torch_adamw_over_several_steps(tmp_path, kind, per_param):
    with open_store(kind, str(tmp_path)) as case:
        group, store, lo, hi = case.group, case.store, case.lo, case.hi
        slots, n = group.trainable_slots, group.trainable_numel
        ref_params, ref_opt = _reference(group, per_param)
        out = group.device_buffer[:n].clone()  # the compute weights the update writes
        out_before = out.clone()
        steps = [0] * len(slots)
        gen = torch.Generator().manual_seed(1)
        plan = STEPS if per_param else [((0, 1, 2), scale) for _ready, scale in STEPS]
        for ready, scale in plan:
            grad = torch.full((n,), 1e9)  # what a parameter without a gradient holds must not be read
            spans = []
            for i, (slot, ref) in enumerate(zip(slots, ref_params)):
                ref.grad = None
                if i not in ready:
                    continue
                g = torch.randn(slot.numel, generator=gen)
                grad[slot.offset:slot.offset + slot.numel] = g
                ref.grad = (g * scale).view(slot.shape) if scale != 1.0 else g.view(slot.shape).clone()
                steps[i] += 1
                spans.append((slot.offset, slot.offset + slot.numel, steps[i], HYPERS[i]))
            if not per_param:
                spans = [(0, n, steps[0], HYPERS[0])]
            store.announce()
            adamw(store, grad, spans, scale, out, num_threads=None)
            ref_opt.step()

        flat = torch.cat([p.detach().reshape(-1) for p in ref_params])
        moments = [torch.cat([ref_opt.state[p][key].reshape(-1) for p in ref_params])
                   for key in ("exp_avg", "exp_avg_sq")]
        _spans, master, exp_avg, exp_avg_sq = read_all(store)
        close = {"rtol": 0.0, "atol": 1e-6}
        torch.testing.assert_close(master, flat[lo:hi], **close)
        torch.testing.assert_close(exp_avg, moments[0][lo:hi], **close)
        torch.testing.assert_close(exp_avg_sq, moments[1][lo:hi], **close)
        if store.writes_compute_copy:
            torch.testing.assert_close(out[lo:hi], flat[lo:hi], **close)
            assert torch.equal(out[:lo], out_before[:lo]) and torch.equal(out[hi:], out_before[hi:])
        else:  # the master weights are the compute weights: `out` is not touched
            assert torch.equal(out, out_before)
            torch.testing.assert_close(group.device_buffer[lo:hi], flat[lo:hi], **close)
        assert ring_slots_all_back(case)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_an_update_that_raises_abandons_its_chunk_and_stores_the_ones_before(tmp_path, kind):
    with open_store(kind, str(tmp_path)) as case:
        store, n = case.store, case.group.trainable_numel
        _spans, *before = read_all(store)
        chunks = store.chunks()
        last_start = chunks[-1][0]
        short = torch.ones(n - 10)  # the last chunk's gradient is short: its update raises
        logged = CallLog(store)
        with pytest.raises((OffloadConfigError, RuntimeError)):  # the kernel's size check, or torch's
            adamw(logged, short, [(0, n, 1, HYPERS[1])], 1.0, case.group.device_buffer[:n].clone(), None)
        expected = [c for start, _stop in chunks[:-1] for c in (("load", start), ("store", start))]
        assert logged.calls == expected + [("load", last_start), ("abandon", last_start)]
        _spans, *after = read_all(store)
        if case.load_copies:  # a slot: the last chunk keeps its old state, the ones before are stepped
            k = last_start - case.lo
            for old, new in zip(before, after):
                assert torch.equal(new[k:], old[k:])
            if len(chunks) > 1:
                assert not torch.equal(after[1][:k], before[1][:k])
        assert ring_slots_all_back(case)
