"""Gradients resting in the first moments (issue 35, offload/scheduler/records/grad_in_moments.py): with exact
clipping on the nvme tier, a speculating block's 16-bit gradient is given back after its speculative update and
rebuilt, bit for bit, from the old and new first moment (plus the few elements the step's own check kept) for
whatever reads it next: the redo of a step that clips, torch's `clip_grad_norm_` by call, a read of `.grad`, the
next micro-batch's sum. Each case trains twice, resting (speculation on) and not
(`speculative_clipping=False`: every gradient waits whole, in memory or on disk), and the two must agree bit for
bit: weights, optimizer state, norms and every gradient read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import offload
from offload import _native
from offload.optim.functional import adam_step_flat, adam_step_resting, rebuild_gradient
from offload.scheduler.state import adamw as adamw_module
from tests.models import TinyGPT, make_batches, one_intraop_thread

LR, WD = 3e-3, 0.01
BELOW, ABOVE = 1e3, 1e-3  # thresholds the norms stay far below / far above
REGIMES = [pytest.param(BELOW, id="norms-below"), pytest.param(ABOVE, id="clips-every-step")]
HOST = 183_616  # bf16 TinyGPT: the window, a ring, and less than every gradient beside the preferred ring

one_thread = pytest.fixture(autouse=True)(one_intraop_thread)
native = pytest.mark.skipif(_native._C is None, reason="the gradient's check and rebuild are in offload._C")


def _engine(tmp_path: Path, clip: float, speculate: bool, **options):
    torch.manual_seed(0)
    path = tmp_path / f"swap-{speculate}"
    os.makedirs(path, exist_ok=True)
    options.setdefault("host_memory", HOST)
    return offload.wrap(TinyGPT(), tier="nvme", nvme_path=str(path), dtype=torch.bfloat16, lr=LR, weight_decay=WD,
                        max_grad_norm=clip, speculative_clipping=speculate, **options)


def _grads(engine) -> Dict[str, torch.Tensor]:
    """Each gradient as torch code may read it (a held gradient answers norms): its 1-, 2-, 3- and inf-norms."""
    return {name: torch.stack([torch.linalg.vector_norm(p.grad, order) for order in (1, 2, 3, float("inf"))])
            for name, p in engine.module.named_parameters() if p.grad is not None}


def _state(engine) -> Dict[str, torch.Tensor]:
    out = {f"w:{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    for pid, entry in engine.optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"s:{pid}:{key}"] = torch.as_tensor(value).clone()
    return out


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _train(engine, batches, between=None, zero: bool = True) -> List[object]:
    """Steps of `batches`; `between(engine, step)` after the backward passes, before step(). Returns the norms and
    whatever `between` returned."""
    seen: List[object] = []
    for index, step in enumerate(batches):
        for idx, tgt in step:
            (engine(idx, tgt) / len(step)).backward()
        if between is not None:
            seen.append(between(engine, index))
        seen.append(float(engine.step()))
        if zero:
            engine.zero_grad()
    engine.synchronize()
    return seen


def _both(tmp_path: Path, clip: float, batches, between=None, **options):
    on, off = _engine(tmp_path, clip, True, **options), _engine(tmp_path, clip, False, **options)
    try:
        seen_on, seen_off = _train(on, batches, between), _train(off, batches, between)
        for a, b in zip(seen_on, seen_off):
            if isinstance(a, dict):
                _same(a, b)  # type: ignore[arg-type]
            else:
                assert a == b
        _same(_state(on), _state(off))
        return on.stats(), off.stats(), on.plan
    finally:
        on.close()
        off.close()


@native
@pytest.mark.parametrize("clip", REGIMES)
@pytest.mark.parametrize("declared, micro", [pytest.param(1, 1, id="declared-1"), pytest.param(2, 2, id="declared-2"),
                                             pytest.param(None, 2, id="undeclared-2")])
def test_resting_gradients_train_as_kept_ones(tmp_path, declared, micro, clip):
    stats, off, plan = _both(tmp_path, clip, make_batches(5, micro, seed=1), grad_accumulation_steps=declared)
    # declared: every gradient a step waits for rests, so none is kept beside the window; undeclared, any backward
    # may be followed by another, and the plan keeps what fits (the parked blocks' still rest)
    assert plan.grads_on_disk and plan.grads_rest == (declared is not None), plan
    assert ("rests in the first moments" in plan.grads_placement()) == plan.grads_rest
    assert stats["grads_rested_in_moments"] > 0 and off["grads_rested_in_moments"] == 0
    if clip == ABOVE:  # the first step's speculation is redone from the rebuilt gradients
        assert stats["grads_rebuilt_from_moments"] > 0
    else:  # every speculation kept: no resting gradient was ever needed again, nor written
        assert stats["grads_rebuilt_from_moments"] == 0
        assert stats["bytes_grads_to_disk"] < off["bytes_grads_to_disk"]


@native
def test_what_torch_reads_and_changes_between_backward_and_step_is_the_gradient_bit_for_bit(tmp_path):
    """The gradients read after the backward (their norms), torch's clip_grad_norm_ by call not firing, then
    firing (the speculations dropped, the updates run again on the scaled gradients, rebuilt first)."""

    def between(engine, step):
        grads = _grads(engine)
        if step == 1:
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e6)  # a scale of exactly 1
        if step == 2:
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05)
            grads.update({f"clipped:{k}": v for k, v in _grads(engine).items()})
        return grads

    stats, _off, _plan = _both(tmp_path, BELOW, make_batches(4, 1, seed=5), between, grad_accumulation_steps=1)
    assert stats["grads_rebuilt_from_moments"] > 0


@native
def test_more_misses_than_allowed_keep_the_gradient_on_disk(tmp_path, monkeypatch):
    """A gradient the moments would give back with more misses than the step keeps goes to its record on disk."""
    monkeypatch.setattr(adamw_module, "MISSES_PER_ELEMENT", 0.0)
    monkeypatch.setattr(adamw_module, "MISSES_SLACK", 0)
    stats, off, _plan = _both(tmp_path, ABOVE, make_batches(3, 1, seed=8), grad_accumulation_steps=1)
    rested = stats["grads_rested_in_moments"]
    assert stats["grad_elements_missed_by_rebuilds"] == 0  # only gradients without a miss rested
    assert stats["bytes_grads_to_disk"] > 0 and rested < stats["speculative_updates"]


# ----- the step's check and the rebuild, element by element -------------------------------------------------------
def _hard_gradients(n: int, dtype: torch.dtype, seed: int) -> Dict[str, torch.Tensor]:
    """(grad, exp_avg): the usual, zeros and negative zeros, gradients tiny against the moment, subnormals,
    non-finite values."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 1e-3
    m = torch.randn(n, generator=gen) * 1e-3
    g[: n // 8] = 0.0
    g[n // 8: n // 8 + 7] = -0.0
    g[n // 4: n // 4 + 100] *= 1e-6  # tiny against |m|: the moment cannot give them back
    g[n // 3: n // 3 + 5] = torch.tensor([1e-40, -1e-40, float("inf"), float("-inf"), float("nan")])
    m[n // 2: n // 2 + 50] = 0.0  # the first step: m = 0
    return {"grad": g.to(dtype), "exp_avg": m}


def _native_for(isa):
    """The native core, once a resting step of `isa` runs on this CPU (else the test is skipped)."""
    C = _native._C
    assert C is not None
    try:
        C.adam_step_resting(0, 0, 1, 0, 0, 0, 0, 0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 0, 1, None, isa)
    except ValueError as error:
        pytest.skip(f"this CPU cannot run the {isa} kernels: {error}")
    return C


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_the_rebuild_patched_with_the_steps_misses_is_the_gradient(isa, dtype):
    C = _native_for(isa)
    n = 300_001  # several threads' chunks, a ragged tail
    case = _hard_gradients(n, dtype, seed=1)
    grad, m = case["grad"], case["exp_avg"]
    p, v = torch.randn(n), torch.rand(n) * 1e-6
    state = [p.clone(), m.clone(), v.clone()]
    index = torch.empty(n, dtype=torch.int64)
    bits = torch.empty(n, dtype=torch.int16)
    count = C.adam_step_resting(state[0].data_ptr(), grad.data_ptr(), 1 if dtype == torch.bfloat16 else 2,
                                state[1].data_ptr(), state[2].data_ptr(), n, 0, 0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01,
                                index.data_ptr(), bits.data_ptr(), n, 2, None, isa)
    plain = [p.clone(), m.clone(), v.clone()]
    adam_step_flat(plain[0], grad, plain[1], plain[2], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.01, adamw=True, num_threads=2)
    for a, b in zip(state, plain):  # the step is the plain step (the non-finite elements' NaNs included)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert 7 <= count < n // 100, count  # the negative zeros, tiny and non-finite ones; not the zeros
    out = torch.empty(n, dtype=dtype)
    C.rebuild_gradient(m.data_ptr(), state[1].data_ptr(), 0.9, out.data_ptr(), 1 if dtype == torch.bfloat16 else 2,
                       n, 2, None, isa)
    missed = out.view(torch.int16) != grad.view(torch.int16)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[index[:count]] = True
    # every element the rebuild misses is kept; so may be one whose rebuild is NaN (the fused AVX-512 check keeps
    # those: a NaN's payload is the instruction's, which two compilations of the rebuild need not share)
    assert torch.equal(missed & ~kept, torch.zeros_like(kept))
    assert torch.equal(kept & ~missed & ~torch.isnan(out), torch.zeros_like(kept))
    out.view(torch.int16)[index[:count]] = bits[:count]
    assert torch.equal(out.view(torch.int16), grad.view(torch.int16))


@native
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16-out", "fp32-out"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_the_resting_step_writes_the_plain_steps_weights_wherever_they_start(isa, out_dtype):
    """The compute copy the resting step writes (streamed from the vector its address aligns on, AVX-512) is the
    plain step's, bit for bit, whatever the copy's alignment."""
    C = _native_for(isa)
    n = 300_001
    case = _hard_gradients(n, torch.bfloat16, seed=3)
    grad, m = case["grad"], case["exp_avg"]
    p, v = torch.randn(n), torch.rand(n) * 1e-6
    for shift in (0, 1, 7):  # the copy's first element at 0, 2 or 4 bytes, and 14 or 28 bytes, past a vector
        state = [p.clone(), m.clone(), v.clone()]
        out = torch.full((n + shift,), 7.0, dtype=out_dtype)[shift:]
        index = torch.empty(n, dtype=torch.int64)
        bits = torch.empty(n, dtype=torch.int16)
        C.adam_step_resting(state[0].data_ptr(), grad.data_ptr(), 1, state[1].data_ptr(), state[2].data_ptr(), n,
                            out.data_ptr(), 1 if out_dtype == torch.bfloat16 else 0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01,
                            index.data_ptr(), bits.data_ptr(), n, 2, None, isa)
        plain = [p.clone(), m.clone(), v.clone()]
        expected = torch.empty(n, dtype=out_dtype)
        adam_step_flat(plain[0], grad, plain[1], plain[2], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.01, adamw=True, num_threads=2, out=expected)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), shift
        assert torch.equal(state[0].view(torch.int32), plain[0].view(torch.int32)), shift


@native
def test_too_many_misses_are_reported_not_kept(monkeypatch):
    n = 100_000
    case = _hard_gradients(n, torch.bfloat16, seed=2)
    p, v, m = torch.randn(n), torch.rand(n), case["exp_avg"].clone()
    m_old = m.clone()
    got: Optional[object] = adam_step_resting(p, case["grad"], m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                                              eps=1e-8, weight_decay=0.0, out=None, num_threads=1, capacity=10)
    assert got is None
    out = torch.empty(n, dtype=torch.bfloat16)
    rebuild_gradient(m_old, m, 0.9, out, 1)  # the step ran all the same: its moment gives most of it back
    assert (out.view(torch.int16) == case["grad"].view(torch.int16)).float().mean() > 0.99


@native
def test_the_misses_come_back_ascending_from_the_base_given():
    """The threads find the misses in no order; the step hands them back sorted, offset by `index_base` (the span's
    first element in its group), as the rebuild patches them in."""
    n = 300_001
    case = _hard_gradients(n, torch.bfloat16, seed=4)
    grad, m, p, v = case["grad"], case["exp_avg"], torch.randn(n), torch.rand(n) * 1e-6
    found = {}
    for base in (0, 1 << 40):
        got = adam_step_resting(p.clone(), grad, m.clone(), v.clone(), step=3, lr=1e-3, beta1=0.9, beta2=0.999,
                                eps=1e-8, weight_decay=0.01, out=None, num_threads=2, capacity=n, index_base=base)
        assert got is not None
        found[base] = got
    index, bits = found[0]
    assert index.numel() >= 7 and bool((index[1:] > index[:-1]).all())
    assert torch.equal(bits, grad.view(torch.int16)[index])
    assert torch.equal(found[1 << 40][0], index + (1 << 40)) and torch.equal(found[1 << 40][1], bits)
