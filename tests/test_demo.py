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
    # first what the machine can use, for the disk the swap file goes to (the set-up command runs no doctor)
    assert out.startswith("offload doctor (python ") and f"in {swap}" in out.split("DemoGPT")[0]
    assert "offload plan (tier=nvme; compute bfloat16 (mixed precision" in out  # the demo asks for bf16
    assert "data: TokenWindows(" in out
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 12 and not np.isnan(losses).any()
    assert losses[-1] < losses[0] - 0.5  # ln(64) = 4.16 at the start; the 16 used ids alone are worth 1.4
    efficiency = float(re.search(r"efficiency = bound / step = ([0-9.]+)", out).group(1))
    assert efficiency > 0
    assert "T_read + T_write" in out and "disk read" in out
    assert os.listdir(swap) == []  # the swap file, its layout and the probe file are gone
    assert os.path.exists(out_dir / "markov-16-tokens.npy")
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the demo prints how to get loss.png")
    assert (out_dir / "loss.png").stat().st_size > 1000


TINY = {"--steps": "2", "--layers": "1", "--dim": "32", "--vocab": "64", "--context": "16", "--batch": "2"}


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "must be an integer >= 1, got '0'"),
    ("--steps", "-3", "must be an integer >= 1, got '-3'"),
    ("--layers", "0", "must be an integer >= 1, got '0'"),
    ("--dim", "30", r"must be a multiple of 4 \(the demo's 4 attention heads\), >= 4, got '30'"),
    ("--dim", "0", r"must be a multiple of 4 .*got '0'"),
    ("--vocab", "0", r"must be an integer >= 4 \(.*4 successors\), got '0'"),
    ("--vocab", "3", r"must be an integer >= 4 .*got '3'"),
    ("--context", "0", r"must be an integer in \[1, 1048575\] .*got '0'"),
    ("--context", "1048576", r"must be an integer in \[1, 1048575\] .*got '1048576'"),
    ("--batch", "0", "must be an integer >= 1, got '0'"),
    ("--lr", "nan", "must be a finite number >= 0, got 'nan'"),
    ("--lr", "-1", "must be a finite number >= 0, got '-1'"),
    ("--host-memory", "lots", "must be a byte size > 0 such as 24GB"),
    ("--device-memory", "0", "must be a byte size > 0 such as 24GB"),
    ("--nvme-path", "MISSING", r"must be an existing directory .*got '.*missing'"),
    ("--out", "A_FILE", r"must be a directory .*made if missing.*'.*a-file' is a file"),
])
def test_every_demo_flag_is_checked_when_parsed(tmp_path, capsys, flag, value, message):
    """A bad value is an argparse error naming the flag and its valid range (exit 2), before any work."""
    (tmp_path / "a-file").write_text("")
    value = {"MISSING": str(tmp_path / "missing"), "A_FILE": str(tmp_path / "a-file")}.get(value, value)
    args = {**TINY, "--out": str(tmp_path / "out"), "--nvme-path": str(tmp_path), flag: value}
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *[item for pair in args.items() for item in pair]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(f"argument {flag}: {message}", err), err
    assert not (tmp_path / "out").exists()  # refused before anything was written
