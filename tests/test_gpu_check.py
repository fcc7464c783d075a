"""`benchmarks/gpu_check.sh --rehearse` (issue 32): every part of the GPU check runs on the CPU, through the same
code and into the same output layout as on a GPU machine, so that a typo fails here and not in GPU minutes."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("machine", "build", "doctor", "tests_cuda", "tests_device", "bench", "timeline")
RIVALS = ("PyTorch, all on the GPU", 'offload tier="cpu"', 'offload tier="nvme"', "DeepSpeed ZeRO-3")

pytestmark = pytest.mark.slow


def _rehearse(tmp_path: Path, **env: str):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--rehearse"], cwd=ROOT, capture_output=True, text=True,
                          timeout=560, env=dict(os.environ, OUT=str(out), GPU_CHECK_WORK=str(work),
                                                PYTHON=sys.executable, **env))
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else "(no summary.md)"
    return proc, out, work, summary


def _result(summary: str, part: str) -> str:
    match = re.search(rf"^\| {part} \| ([^|]+) \|", summary, flags=re.M)
    return match.group(1).strip() if match else "(not in the summary)"


def _parts_and_failures(summary: str) -> str:
    """The summary up to its benchmark table: which part failed, and the last lines of its log."""
    return summary.split("## Benchmark", 1)[0][-6000:]


def _check_layout(out: Path) -> None:
    """What the device tool brings back: at most 8 files of at most 16 MiB, no deeper than 2 folders."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    assert all(p.stat().st_size <= 16 << 20 for p in files)
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for p in files for part in p.relative_to(out).parts)


def test_the_rehearsal_runs_every_part_and_writes_the_gpu_layout(tmp_path):
    proc, out, work, summary = _rehearse(tmp_path)
    assert proc.returncode == 0, _parts_and_failures(summary) + proc.stderr[-3000:]
    _check_layout(out)
    names = {p.name for p in out.iterdir()}
    assert {"summary.md", "gpu-check.tar.gz", "bench_gpu.csv"} <= names, names
    assert [part for part in PARTS if _result(summary, part) != "passed"] == [], summary
    assert "all 7 parts passed" in summary and "## Failures\n\nNone." in summary
    assert "offload._C not rebuilt" in summary  # the rehearsal says what it did not do
    for rival in RIVALS:
        assert rival in summary, summary
    with open(out / "bench_gpu.csv", newline="", encoding="utf-8") as f:
        rows = {row["rival"]: row for row in csv.DictReader(f)}
    for rival, row in rows.items():
        if rival.startswith("DeepSpeed"):
            assert row["note"].startswith("SKIPPED"), row
        else:  # every measured row has its step time, its bound and its efficiency
            assert float(row["step_s"]) > 0 and float(row["bound_s"]) > 0 and float(row["efficiency"]) > 0, row
            first, last = (float(x) for x in row["loss"].split("->"))
            assert last < first, row  # it trained
    assert len(rows) == 4
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        members = set(tar.getnames())
    for name in [f"parts/{part}.log" for part in PARTS] + ["parts/tests_cuda.xml", "parts/tests_device.xml",
                                                           "bench/bench_gpu.json", "timeline/step_timeline.json",
                                                           "machine.json", "summary.md"]:
        assert f"gpu-check/{name}" in members, sorted(members)
    swap = re.search(r"swap folder (\S+),", proc.stdout).group(1)
    assert not os.path.exists(swap)  # the swap files went with it


def test_a_failing_part_is_reported_with_its_traceback_and_the_next_parts_still_run(tmp_path):
    proc, out, _work, summary = _rehearse(tmp_path, GPU_CHECK_ONLY="machine bench",
                                          GPU_CHECK_BENCH_ROWS="offload_cpu,offload_nvme",
                                          GPU_CHECK_INJECT_FAILURE="machine,bench:offload_cpu")
    assert proc.returncode == 1, proc.stdout[-3000:]
    _check_layout(out)
    assert _result(summary, "machine") == "FAILED" and _result(summary, "bench") == "FAILED", summary
    assert _result(summary, "doctor") == "not run", summary
    assert "RuntimeError: injected failure in part machine" in summary
    assert "### bench: row offload_cpu" in summary and "injected failure in bench row offload_cpu" in summary
    assert "Traceback (most recent call last)" in summary
    assert "0 of 2 parts passed (5 not selected)" in summary
    with open(out / "bench_gpu.csv", newline="", encoding="utf-8") as f:
        rows = {row["rival"]: row for row in csv.DictReader(f)}
    assert rows['offload tier="cpu"']["note"].startswith("FAILED"), rows
    assert float(rows['offload tier="nvme"']["step_s"]) > 0, rows  # the row after the failure still ran
