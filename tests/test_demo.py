"""`python -m offload demo` runs end to end with a tiny config and reports its efficiency."""

from __future__ import annotations

import os
import re

import torch

from offload.__main__ import main
from offload.cli.demo import synthetic_batches


def test_synthetic_tokens_count_up_by_one():
    (idx, tgt), = synthetic_batches(1, batch=3, context=8, vocab=1000)
    assert idx.shape == tgt.shape == (3, 8)
    assert torch.equal(tgt, (idx + 1) % 256) and int(idx.max()) < 256


def test_demo_runs_and_reports_efficiency(tmp_path, capsys):
    rc = main(["demo", "--steps", "4", "--layers", "1", "--dim", "32", "--vocab", "64", "--context", "16",
               "--batch", "2", "--lr", "3e-3", "--nvme-path", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "offload plan (tier=nvme)" in out
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 4 and all(l == l for l in losses)
    efficiency = float(re.search(r"efficiency = bound / step = ([0-9.]+)", out).group(1))
    assert efficiency > 0
    assert "T_read + T_write" in out and "disk read" in out
    assert os.listdir(tmp_path) == []  # the swap file, its layout and the probe file are gone
