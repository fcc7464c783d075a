"""`python -m offload demo` runs end to end with a tiny config, learns, and reports its efficiency."""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np
import pytest

from offload.__main__ import main
from offload.cli.demo_data import STATES, chain_entropy, markov_tokens


def test_demo_tokens_follow_the_chain():
    tokens = markov_tokens(200_000, STATES, seed=0)
    assert tokens.min() >= 0 and tokens.max() < STATES
    counts = np.zeros((STATES, STATES))
    np.add.at(counts, (tokens[:-1], tokens[1:]), 1)
    top4 = np.sort(counts, axis=1)[:, -4:].sum(axis=1)
    assert (top4 / counts.sum(axis=1) > 0.99).all()  # four successors (a few others where two walks join)
    rows = counts / counts.sum(axis=1, keepdims=True)
    entropy = -(counts * np.log(np.where(rows > 0, rows, 1))).sum() / counts.sum()
    assert abs(entropy - chain_entropy()) < 0.02


def test_demo_learns_and_reports_efficiency(tmp_path, capsys):
    out_dir = tmp_path / "out"
    swap = tmp_path / "swap"
    swap.mkdir()
    rc = main(["demo", "--steps", "12", "--layers", "1", "--dim", "32", "--vocab", "64", "--context", "16",
               "--batch", "4", "--lr", "1e-2", "--nvme-path", str(swap), "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "offload plan (tier=nvme)" in out and "data: TokenWindows(" in out
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 12 and all(l == l for l in losses)
    assert losses[-1] < losses[0] - 0.5  # ln(64) = 4.16 at the start; the 16 used ids alone are worth 1.4
    efficiency = float(re.search(r"efficiency = bound / step = ([0-9.]+)", out).group(1))
    assert efficiency > 0
    assert "T_read + T_write" in out and "disk read" in out
    assert os.listdir(swap) == []  # the swap file, its layout and the probe file are gone
    assert os.path.exists(out_dir / "markov-16-tokens.npy")
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the demo prints how to get loss.png")
    assert (out_dir / "loss.png").stat().st_size > 1000
