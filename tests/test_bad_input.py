"""Bad input at wrap() and load(): refused at once, by name, with the fix, before anything is allocated or
written (issue "never silently wrong", item "bad input"); and paths fixed at wrap()."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadConfigError


def _pair() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_a_trainable_float64_parameter_is_refused_at_wrap_not_on_the_worker():
    model = _pair().double()
    with pytest.raises(OffloadConfigError, match=r"'0.weight' is torch.float64.*model.float\(\)"):
        offload.wrap(model, tier="cpu", device="cpu")
    assert not hasattr(model, "_offload_engine")  # nothing of the failed wrap stays on the model


def test_a_frozen_float64_parameter_is_kept_as_it_is():
    model = _pair()
    model[1].double().requires_grad_(False)
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        assert model[1].weight.dtype == torch.float64
        out = model[1](model[0](torch.ones(2, 4)).double())
        engine.step()
    assert out.dtype == torch.float64


@pytest.mark.parametrize("option", ["host_memory", "device_memory"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_non_finite_or_negative_budgets_are_refused_by_name(option, value):
    with pytest.raises(OffloadConfigError, match=option):
        offload.wrap(_pair(), tier="cpu", device="cpu", **{option: value})


def test_an_all_frozen_model_on_the_nvme_tier_is_refused_before_any_file_exists(tmp_path):
    model = _pair().requires_grad_(False)
    with pytest.raises(OffloadConfigError, match="no parameter of this model requires grad.*tier='cpu'"):
        offload.wrap(model, tier="nvme", nvme_path=tmp_path, device="cpu")
    assert os.listdir(tmp_path) == []
    with offload.wrap(model, tier="cpu", device="cpu", dtype=torch.float32) as engine:  # inference still works
        assert engine(torch.ones(2, 4)).shape == (2, 4)


def test_loading_a_regular_file_says_it_is_not_a_checkpoint_directory(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"not a checkpoint")
    with offload.wrap(_pair(), tier="cpu", device="cpu") as engine:
        with pytest.raises(OffloadConfigError, match="is a file, not a checkpoint directory"):
            engine.load(path)


def test_a_relative_nvme_path_is_fixed_at_wrap_so_a_chdir_cannot_strand_the_swap_file(tmp_path, monkeypatch):
    (tmp_path / "swap").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    engine = offload.wrap(_pair(), tier="nvme", nvme_path="swap", device="cpu", dtype=torch.float32)
    assert engine.policy.nvme_path == str(tmp_path / "swap")
    assert os.listdir(tmp_path / "swap")  # the swap file and its layout
    os.chdir(tmp_path / "elsewhere")
    engine.close()
    assert os.listdir(tmp_path / "swap") == [] and os.listdir(tmp_path / "elsewhere") == []


def test_a_sub_module_already_wrapped_is_refused_by_name():
    inner = _pair()
    with offload.wrap(inner, tier="cpu", device="cpu"):
        with pytest.raises(OffloadConfigError, match="sub-module '0' is already wrapped.*close()"):
            offload.wrap(nn.Sequential(inner, nn.Linear(4, 4)), tier="cpu", device="cpu")


class LlamaRMSNorm(nn.Module):
    """Hugging Face's RMSNorm as transformers defines it: a plain nn.Module with a weight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def test_norm_layers_named_like_hugging_faces_stay_fp32_under_bf16():
    model = nn.Sequential(nn.Linear(8, 8), LlamaRMSNorm(8), nn.Linear(8, 8))
    with offload.wrap(model, tier="cpu", dtype=torch.bfloat16, device="cpu"):
        assert model[1].weight.dtype == torch.float32  # as torch's own RMSNorm and LayerNorm
        assert model[0].weight.dtype == model[2].weight.dtype == torch.bfloat16


def test_close_after_a_disk_error_reports_once_and_still_releases_everything(tmp_path, monkeypatch):
    """A file system that fails under the swap file: close() raises the error once, yet removes the hooks
    and the swap file, a second close() is quiet, and the model can be wrapped again."""
    from offload.tiers.disk import SwapStore

    model = _pair()
    engine = offload.wrap(model, tier="nvme", nvme_path=tmp_path, device="cpu", dtype=torch.float32)
    real_close = SwapStore.close

    def failing_close(self):
        real_close(self)  # the files go, then the file system reports an error
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(SwapStore, "close", failing_close)
    with pytest.raises(OSError, match="Input/output error"):
        engine.close()
    monkeypatch.undo()
    engine.close()  # reported once: nothing more to raise
    assert not any(m._forward_pre_hooks for m in model.modules()) and os.listdir(tmp_path) == []
    with offload.wrap(model, tier="cpu", device="cpu", dtype=torch.float32) as again:  # not "already wrapped"
        assert again(torch.ones(2, 4)).shape == (2, 4)


def test_a_script_that_ends_without_close_leaves_no_swap_file(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, offload
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        engine = offload.wrap(model, tier="nvme", nvme_path={str(tmp_path)!r}, device="cpu", dtype=torch.float32)
        model(torch.ones(2, 4)).sum().backward()
        engine.step()
        print(len(__import__("os").listdir({str(tmp_path)!r})))
    """)  # no engine.close(): the interpreter exits with the engine alive
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"  # the swap file and its layout existed while it ran
    assert os.listdir(tmp_path) == []
