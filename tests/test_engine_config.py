"""Bad input is refused at wrap(), before anything is lost, with a message that names the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload.errors import OffloadConfigError, OffloadError
from offload.policy import OffloadPolicy, Tier, parse_bytes
from tests.models import TinyGPT, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _wrap(model=None, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", torch.float32)
    return offload.wrap(model if model is not None else TinyGPT(), **kw)


def test_unknown_tier_lists_valid_ones():
    with pytest.raises(OffloadConfigError, match="'gpu', 'cpu', 'nvme'"):
        _wrap(tier="disk")
    with pytest.raises(ValueError):  # OffloadConfigError is a ValueError
        _wrap(tier="")


def test_unknown_option_lists_valid_ones_and_suggests():
    with pytest.raises(OffloadConfigError, match=r"'max_grad_nrom' \(did you mean 'max_grad_norm'\?\).*valid options"):
        _wrap(max_grad_nrom=1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(lr=float("nan")), "lr must be"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(eps="1e-8"), "eps must be a number"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    (dict(dtype=torch.int8), "dtype must be one of"),
    (dict(grad_accumulation_steps=0), "grad_accumulation_steps"),
    (dict(grad_accumulation_steps=True), "grad_accumulation_steps"),
    (dict(device_memory="lots"), "device_memory"),
    (dict(host_memory="12 parsecs"), "unknown unit"),
    (dict(device="tpu"), "device"),
    (dict(nvme_path="/tmp"), "only used with tier='nvme'"),
    (dict(tier="nvme"), "needs nvme_path"),
])
def test_bad_options(kw, match):
    with pytest.raises(OffloadConfigError, match=match):
        _wrap(**kw)


def test_nvme_path_checks(tmp_path):
    with pytest.raises(OffloadConfigError, match="does not exist"):
        _wrap(tier="nvme", nvme_path=tmp_path / "missing")
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(OffloadConfigError, match="not a directory"):
        _wrap(tier="nvme", nvme_path=file)


def test_memory_strings_parse_once():
    assert parse_bytes("24GB", "x") == 24 * 10**9
    assert parse_bytes("512MiB", "x") == 512 * 2**20
    assert parse_bytes("1.5 GiB", "x") == int(1.5 * 2**30)
    assert parse_bytes(4096, "x") == 4096
    assert parse_bytes(None, "x") is None
    with pytest.raises(OffloadConfigError):
        parse_bytes(-1, "x")


def test_policy_is_frozen_and_typed():
    policy = OffloadPolicy(tier=Tier.CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.lr = 1.0  # type: ignore[misc]
    with pytest.raises(OffloadConfigError):
        OffloadPolicy(tier="cpu")  # type: ignore[arg-type]  (strings are parsed by Tier.parse, in wrap)


@pytest.mark.parametrize("options", [dict(), dict(max_grad_norm=1.0)], ids=["undeclared", "clipping"])
def test_step_returns_early_by_default_only_when_a_gpu_computes(options):
    """Where the updates cannot run during the backward, step() returning early lets them overlap the next
    forward on a GPU; with the CPU computing, both would share its cores, so step() waits ([Note: step returns
    early]). Declared accumulation without clipping waits either way; `overlap_step` decides when given."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert OffloadPolicy(tier=Tier.CPU, device=cuda, **options).step_returns_early
    assert not OffloadPolicy(tier=Tier.CPU, device=cpu, **options).step_returns_early
    assert not OffloadPolicy(tier=Tier.CPU, device=cuda, grad_accumulation_steps=1).step_returns_early
    assert OffloadPolicy(tier=Tier.CPU, device=cpu, overlap_step=True, **options).step_returns_early
    assert not OffloadPolicy(tier=Tier.CPU, device=cuda, overlap_step=False, **options).step_returns_early


def test_budget_smaller_than_largest_block_names_it():
    model = TinyGPT(vocab=512)  # the tied embedding is the largest block
    with pytest.raises(OffloadConfigError, match=r"block 'wte' \(64\.0 KiB"):
        _wrap(model, tier="cpu", device_memory=10_000)


def test_gpu_tier_budget_too_small():
    with pytest.raises(OffloadConfigError, match="tier='gpu' keeps everything on the device"):
        _wrap(tier="gpu", device_memory="100KiB")


def test_model_wrapped_twice_then_after_close():
    model = TinyGPT()
    engine = _wrap(model)
    with pytest.raises(OffloadConfigError, match="already wrapped"):
        _wrap(model)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(OffloadError, match="closed"):
        engine.step()
    _wrap(model).close()


def test_not_a_module():
    with pytest.raises(OffloadConfigError, match="nn.Module"):
        offload.wrap("model", device="cpu")  # type: ignore[arg-type]


def test_backward_more_often_than_declared_is_an_error():
    engine = _wrap(grad_accumulation_steps=1)
    idx = torch.randint(0, 64, (2, 16))
    engine(idx, idx).backward()
    with pytest.raises(OffloadError, match="grad_accumulation_steps=1"):
        engine(idx, idx).backward()
    engine.close()
