"""The fused CPU Adam against torch.optim.Adam/AdamW: flat step (native and fallback), every kernel variant
this CPU supports, the bf16/fp16 copy-out, the sum of squares, and the CPUAdam optimizer (groups, schedulers,
state_dict round trips).

Tolerance: rtol=1e-6 plus a small atol (an element crossing zero has no meaningful relative error). With AdamW,
m and v come out bit-identical to torch; p differs by an ulp now and then because torch's CPU sqrt is not
correctly rounded (ours is). With L2 decay that ulp feeds back into the gradient, hence m and v too.
"""

from __future__ import annotations

import io

import pytest
import torch

import offload
from offload import _native
from offload.errors import OffloadConfigError
from offload.optim import CPUAdam, adam_step_flat, sum_of_squares

RTOL = ATOL = 1e-6
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
needs_native = pytest.mark.skipif(_native._C is None, reason="offload._C is not built")


def _supported_isas() -> list[str]:
    if _native._C is None:
        return []
    order = ["avx512", "avx2", "scalar"]
    return order[order.index(_native._C.adam_isa()):]


def _torch_reference(p0, grads, *, lr, betas, eps, wd, adamw):
    """Params, exp_avg, exp_avg_sq after torch's single-tensor Adam/AdamW over `grads` (fp32 upcasts)."""
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g in grads:
        ref.grad = g.float()
        opt.step()
    st = opt.state[ref]
    return ref.detach(), st["exp_avg"], st["exp_avg_sq"]


def _run_flat(p0, grads, *, lr, betas, eps, wd, adamw, step_fn):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, g in enumerate(grads, start=1):
        step_fn(p, g, m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, adamw=adamw)
    return p, m, v


def _native_isa_step(isa, num_threads=1):
    def step_fn(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale=1.0, out=None):
        _native._C.adam_step(
            p.data_ptr(), g.data_ptr(), DTYPE_CODES[g.dtype], m.data_ptr(), v.data_ptr(), p.numel(),
            0 if out is None else out.data_ptr(), 0 if out is None else DTYPE_CODES[out.dtype], step, lr, beta1,
            beta2, eps, weight_decay, adamw, grad_scale, num_threads, None, isa)
    return step_fn


def _assert_matches_torch(p0, grads, step_fn, **hp):
    p, m, v = _run_flat(p0, grads, step_fn=step_fn, **hp)
    rp, rm, rv = _torch_reference(p0, grads, **hp)
    torch.testing.assert_close(m, rm, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, rv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(p, rp, rtol=RTOL, atol=ATOL)


def _grads(n, steps, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 33, 1000, 4099])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_flat_step_matches_torch(n, grad_dtype, adamw):
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    _assert_matches_torch(p0, _grads(n, 20, grad_dtype), adam_step_flat, wd=0.1, adamw=adamw, **HP)


@needs_native
@pytest.mark.parametrize("isa", _supported_isas())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_every_kernel_variant_matches_torch(isa, grad_dtype, adamw):
    n = 16 * 9 + 5  # full vectors of 8 and 16 lanes plus a tail
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(2))
    _assert_matches_torch(p0, _grads(n, 10, grad_dtype), _native_isa_step(isa), wd=0.05, adamw=adamw, **HP)


@pytest.mark.parametrize(
    "hp",
    [
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, adamw=True),
        dict(lr=3e-4, betas=(0.8, 0.95), eps=1e-6, wd=0.01, adamw=True),
        dict(lr=1e-1, betas=(0.5, 0.9), eps=1e-3, wd=0.5, adamw=False),
        dict(lr=1e-2, betas=(0.0, 0.0), eps=1e-8, wd=0.0, adamw=False),
    ],
)
def test_hyperparameters(hp):
    p0 = torch.randn(1003, generator=torch.Generator().manual_seed(3))
    _assert_matches_torch(p0, _grads(1003, 15, torch.float32), adam_step_flat, **hp)


@pytest.mark.parametrize("adamw", [True, False])
def test_one_thousand_steps(adamw):
    p0 = torch.randn(257, generator=torch.Generator().manual_seed(4))
    _assert_matches_torch(p0, _grads(257, 1000, torch.bfloat16), adam_step_flat, wd=0.1, adamw=adamw, **HP)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_threaded_large_buffer_matches_torch(num_threads):
    n = (1 << 18) * 3 + 77  # over the threading threshold, several chunks, odd tail

    def step_fn(*args, **kwargs):
        adam_step_flat(*args, num_threads=num_threads, **kwargs)

    p0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    _assert_matches_torch(p0, _grads(n, 3, torch.bfloat16), step_fn, wd=0.1, adamw=True, **HP)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [5, 16, 1000, 300_001])
def test_out_is_the_rounded_new_param(out_dtype, n):
    p = torch.randn(n) * 3
    m, v, g = torch.zeros(n), torch.zeros(n), torch.randn(n).to(torch.bfloat16)
    out = torch.empty(n, dtype=out_dtype)
    adam_step_flat(p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True,
                   out=out)
    assert torch.equal(out, p.to(out_dtype))  # bit-exact: round to nearest even, like torch


@needs_native
@pytest.mark.parametrize("isa", _supported_isas())
def test_out_rounding_edge_cases_per_kernel(isa):
    """Ties, values near the bf16 maximum, infinities and NaN, produced by an lr=0 step (p unchanged)."""
    specials = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38, 1e-40, 65504.0, 70000.0,
                             float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.00390625, 2.0**-24])
    p = torch.cat([specials, torch.randn(37)])
    n = p.numel()
    for out_dtype in (torch.bfloat16, torch.float16):
        q, out = p.clone(), torch.empty(n, dtype=out_dtype)
        _native_isa_step(isa)(q, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, out=out)
        expected = p.to(out_dtype)
        assert torch.equal(out.isnan(), expected.isnan())
        keep = ~expected.isnan()
        assert torch.equal(out[keep], expected[keep]), out_dtype


def test_grad_scale_is_applied_in_registers():
    n = 999
    p0, g = torch.randn(n), torch.randn(n).to(torch.bfloat16)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    adam_step_flat(p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True,
                   grad_scale=0.25)
    rp, rm, rv = _torch_reference(p0, [g.float() * 0.25], wd=0.1, adamw=True, **HP)
    torch.testing.assert_close(m, rm, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(p, rp, rtol=RTOL, atol=ATOL)


def test_multidimensional_buffers_are_flat_views():
    p0 = torch.randn(3, 5, 7)
    grads = [torch.randn(3, 5, 7) for _ in range(3)]
    p, m, v = p0.clone(), torch.zeros(3, 5, 7), torch.zeros(3, 5, 7)
    for step, g in enumerate(grads, 1):
        adam_step_flat(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    rp, _, _ = _torch_reference(p0, grads, wd=0.0, adamw=True, **HP)
    torch.testing.assert_close(p, rp, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("adamw", [True, False])
def test_fallback_matches_torch_and_native(monkeypatch, adamw):
    n = 1000
    p0 = torch.randn(n)
    grads = _grads(n, 10, torch.bfloat16)
    native = _run_flat(p0, grads, step_fn=adam_step_flat, wd=0.1, adamw=adamw, **HP)
    monkeypatch.setattr(_native, "_C", None)
    _assert_matches_torch(p0, grads, adam_step_flat, wd=0.1, adamw=adamw, **HP)
    fallback = _run_flat(p0, grads, step_fn=adam_step_flat, wd=0.1, adamw=adamw, **HP)
    for a, b in zip(native, fallback):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    out = torch.empty(n, dtype=torch.bfloat16)
    p = p0.clone()
    adam_step_flat(p, grads[0], torch.zeros(n), torch.zeros(n), step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, adamw=adamw, out=out)
    assert torch.equal(out, p.to(torch.bfloat16))


def _flat_args(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(param=torch.zeros(8, dtype=torch.float64)), "param"),
        (dict(grad=torch.zeros(8, dtype=torch.int32)), "grad"),
        (dict(grad=torch.zeros(9)), "grad"),
        (dict(exp_avg=torch.zeros(16)[::2]), "exp_avg"),
        (dict(exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16)), "exp_avg_sq"),
        (dict(exp_avg=torch.zeros(8, device="meta")), "exp_avg"),
        (dict(out=torch.zeros(7, dtype=torch.bfloat16)), "out"),
    ],
)
def test_bad_tensors_raise_config_error_naming_the_argument(bad, name):
    args = {**_flat_args(), **bad}
    with pytest.raises(OffloadConfigError, match=name):
        adam_step_flat(**args, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def test_bad_step_and_threads_raise():
    with pytest.raises(OffloadConfigError, match="step"):
        adam_step_flat(**_flat_args(), step=0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    with pytest.raises(OffloadConfigError, match="num_threads"):
        adam_step_flat(**_flat_args(), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                       adamw=True, num_threads=0)
    assert issubclass(OffloadConfigError, ValueError)


# ---- sum of squares ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 15, 17, 1000, (1 << 18) * 2 + 3])
def test_sum_of_squares_matches_fp64(dtype, n):
    t = torch.randn(n).to(dtype)
    expected = float(t.double().square().sum())
    assert sum_of_squares(t) == pytest.approx(expected, rel=1e-12, abs=1e-300)
    assert sum_of_squares(t.view(-1, 1) if n else t, num_threads=1) == pytest.approx(expected, rel=1e-12, abs=1e-300)


@needs_native
@pytest.mark.parametrize("isa", _supported_isas())
def test_sum_of_squares_every_kernel(isa):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(16 * 5 + 3).to(dtype)
        got = _native._C.sum_of_squares(t.data_ptr(), DTYPE_CODES[dtype], t.numel(), 1, None, isa)
        assert got == pytest.approx(float(t.double().square().sum()), rel=1e-12)


def test_sum_of_squares_is_independent_of_thread_count():
    t = torch.randn((1 << 18) * 3 + 11)
    assert sum_of_squares(t, num_threads=1) == sum_of_squares(t, num_threads=2) == sum_of_squares(t, num_threads=3)


@pytest.mark.parametrize("special", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_propagates_inf_and_nan(special, dtype):
    t = torch.randn(1001)
    t[777] = special
    got = sum_of_squares(t.to(dtype))
    assert (got != got) if special != special else got == float("inf")


def test_sum_of_squares_fallback(monkeypatch):
    t = torch.randn(1234).to(torch.bfloat16)
    native = sum_of_squares(t)
    monkeypatch.setattr(_native, "_C", None)
    assert sum_of_squares(t) == pytest.approx(native, rel=1e-12)


# ---- CPUAdam ----------------------------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def _train(model, opt, steps, seed=10, scheduler=None, grad_dtype=None, upcast=False):
    """`grad_dtype` rounds the gradients to that dtype; `upcast` hands them back as fp32 (torch's optimizers)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 13, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        if grad_dtype is not None:
            for p in model.parameters():
                if p.grad is not None:
                    rounded = p.grad.to(grad_dtype)
                    _set_grad(p, rounded.float() if upcast else rounded)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _set_grad(p, grad):
    if hasattr(p, "grad_dtype"):  # torch >= 2.10 refuses a grad of another dtype unless told
        p.grad_dtype = None
    p.grad = grad


def _groups(model, wd):
    first, second = model[0], model[2]
    return [{"params": list(first.parameters())}, {"params": list(second.parameters()), "lr": 3e-3, "weight_decay": wd}]


def _assert_models_close(a, b):
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_matches_torch_with_groups_and_scheduler(adamw):
    ours, ref = _model(), _model()
    opt = CPUAdam(_groups(ours, 0.1), lr=1e-2, weight_decay=0.01, adamw=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls(_groups(ref, 0.1), lr=1e-2, weight_decay=0.01, foreach=False)
    _train(ours, opt, 12, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5))
    _train(ref, ref_opt, 12, scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5))
    _assert_models_close(ours, ref)
    assert opt.param_groups[1]["lr"] == pytest.approx(3e-3 * 0.125)


def test_cpu_adam_bf16_grads_and_skipped_params():
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), lr=1e-2, weight_decay=0.1, num_threads=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for model, o, upcast in ((ours, opt, False), (ref, ref_opt, True)):
        model[2].bias.requires_grad_(False)  # grad stays None: skipped, like torch
        _train(model, o, 5, grad_dtype=torch.bfloat16, upcast=upcast)
    _assert_models_close(ours, ref)
    assert ours[2].bias not in opt.state


def test_state_dict_round_trip_continues_identically(tmp_path):
    uninterrupted, resumed = _model(), _model()
    opt_a = CPUAdam(uninterrupted.parameters(), lr=1e-2, weight_decay=0.1)
    _train(uninterrupted, opt_a, 6, seed=1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": uninterrupted.state_dict(), "optim": opt_a.state_dict()}, path)
    _train(uninterrupted, opt_a, 6, seed=2)

    ckpt = torch.load(path, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt_b = CPUAdam(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b.load_state_dict(ckpt["optim"])
    assert int(opt_b.state_dict()["state"][0]["step"]) == 6
    _train(resumed, opt_b, 6, seed=2)
    for pa, pb in zip(uninterrupted.parameters(), resumed.parameters()):
        assert torch.equal(pa, pb)  # bit-identical continuation


def test_state_dict_loads_into_torch_adamw_and_back():
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), lr=1e-2)
    _train(ours, opt, 3)
    ref.load_state_dict(ours.state_dict())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ref_opt.load_state_dict(torch.load(buf, weights_only=True))
    _train(ours, opt, 3, seed=3)
    _train(ref, ref_opt, 3, seed=3)
    _assert_models_close(ours, ref)
    back = CPUAdam(_model().parameters(), lr=1e-2)
    back.load_state_dict(ref_opt.state_dict())
    assert back.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))],
         "param 1 has dtype"),
        (lambda: [torch.nn.Parameter(torch.zeros(4, 4).t())], "param 0 is not contiguous"),
        (lambda: [torch.nn.Parameter(torch.zeros(3, device="meta"))], "param 0 is on meta"),
    ],
)
def test_cpu_adam_rejects_bad_params(make, match):
    with pytest.raises(OffloadConfigError, match=match):
        CPUAdam(make())


def test_cpu_adam_rejects_bad_hyperparameters_and_grads():
    with pytest.raises(OffloadConfigError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    p = torch.nn.Parameter(torch.zeros(3))
    opt = CPUAdam([p])
    _set_grad(p, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(OffloadConfigError, match="param 0 has a torch.float64 gradient"):
        opt.step()


def test_cpu_adam_is_exported_and_is_an_optimizer():
    assert offload.CPUAdam is CPUAdam
    assert isinstance(CPUAdam([torch.nn.Parameter(torch.zeros(1))]), torch.optim.Optimizer)


def test_cpu_adam_fallback(monkeypatch):
    monkeypatch.setattr(_native, "_C", None)
    ours, ref = _model(), _model()
    _train(ours, CPUAdam(ours.parameters(), lr=1e-2, weight_decay=0.1), 4)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), 4)
    _assert_models_close(ours, ref)


@needs_native
def test_thread_pool_sizes():
    assert _native._C.ThreadPool(3).size == 3
    with pytest.raises(ValueError):
        _native._C.ThreadPool(0)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        _native._C.adam_step(0, 0, 0, 0, 0, 0, 0, 0, 1, 0.1, 0.9, 0.9, 1e-8, 0.0, True, 1.0, 1, None, "sse9")


def test_benchmark_quick_mode_runs():
    """The benchmark's --quick mode finishes and prints every rival (timings are not asserted)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_adam.py"), "--quick", "--threads", "1"],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for rival in ("offload flat, engine", "torch AdamW fused + bf16 copy", "in-place DRAM bound", "DeepSpeed"):
        assert rival in result.stdout
