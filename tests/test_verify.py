"""`offload.verify` and `python -m offload verify`: parity of a user's model, reported as largest differences."""

from __future__ import annotations

import pytest
import torch

from offload.__main__ import main
from offload.cli.verify_model import tiny_gpt
from offload.parity import verify
from tests.models import one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_verify_reports_parity_on_the_builtin_model(tier):
    report = verify(tiny_gpt, steps=2, tier=tier, grad_accumulation_steps=2, max_grad_norm=1.0)
    assert len(report.offload_losses) == len(report.reference_losses) == 4
    assert report.passed(1e-5), report


def test_verify_finds_a_difference():
    """bf16 compute against the fp32 reference: real differences, reported (and within the bf16 tolerance)."""
    report = verify(tiny_gpt, steps=2, tier="cpu", dtype=torch.bfloat16)
    assert not report.passed(1e-5) and report.max_loss_diff > 1e-4
    assert report.passed(1e-1)


def test_cli_prints_a_row_per_tier(capsys):
    assert main(["verify", "--tier", "cpu", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "max |dloss|" in out and "\ncpu " in out and "ok" in out


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["--steps=-2"], "argument --steps: must be an integer >= 1, got '-2'"),
    (["--accum", "0"], "argument --accum: must be an integer >= 1, got '0'"),
    (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got 'nan'"),
    (["--lr", "inf"], "argument --lr: must be a finite number >= 0, got 'inf'"),
    (["--lr=-1e-3"], "argument --lr: must be a finite number >= 0, got '-1e-3'"),
    (["--max-grad-norm", "0"], "argument --max-grad-norm: must be a finite number > 0, got '0'"),
    (["--max-grad-norm=-1"], "argument --max-grad-norm: must be a finite number > 0, got '-1'"),
    (["--max-grad-norm", "nan"], "argument --max-grad-norm: must be a finite number > 0, got 'nan'"),
    (["--max-grad-norm", "inf"], "argument --max-grad-norm: must be a finite number > 0, got 'inf'"),
])
def test_cli_rejects_a_bad_number_at_parse_time(capsys, argv, message):
    """`--steps 0` compared nothing and printed "ok"; every numeric option is checked before any run."""
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--tier", "cpu", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "python -m offload verify: error:" in captured.err
    assert "ok" not in captured.out
