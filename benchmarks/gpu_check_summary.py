"""The machine facts and the summary of benchmarks/gpu_check.sh (issue 32), and the packing of its output.

    python benchmarks/gpu_check_summary.py machine WORK SWAP_DIR    # WORK/machine.json, printed too
    python benchmarks/gpu_check_summary.py summary WORK OUT MODE "part part ..." SECONDS

`summary` reads WORK/parts/<part>.{status,log,note,xml}, WORK/bench/bench_gpu.{md,json} and the timeline's log;
writes WORK/summary.md, then OUT/summary.md, OUT/gpu-check.tar.gz (all of WORK), OUT/bench_gpu.csv and
OUT/step_timeline.png: at most 8 files of at most 16 MiB, none in a folder (what the device tool brings back).
gpu_check.sh runs it after every part, so a run stopped half-way still leaves a summary of what ran.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional

MAX_FILE = 16 << 20
MAX_FILES = 8
OUT_FILES = ("summary.md", "gpu-check.tar.gz", "bench_gpu.csv", "step_timeline.png")
TAIL = 25  # lines of a failure's log or traceback in the summary
WHAT = {
    "machine": "GPU, driver, CUDA, torch, CPU, RAM, disk",
    "build": "offload._C with its CUDA part (pip install -e ., OFFLOAD_CUDA=auto)",
    "doctor": "python -m offload doctor",
    "tests_cuda": "pytest -m cuda",
    "tests_device": "engine tests with OFFLOAD_TEST_DEVICE",
    "bench": "benchmarks/bench_gpu.py",
    "timeline": "benchmarks/trace_step.py: one offload step's timeline",
}


# ----- machine -----------------------------------------------------------------------------------------------
def _run(cmd: List[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({cmd[0]}: {type(exc).__name__})"
    return (proc.stdout or proc.stderr).strip()


def machine(work: Path, swap_dir: str) -> int:
    facts: Dict[str, str] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    facts["gpu"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                                       "pcie.link.width.max", "--format=csv,noheader"])
    nvcc = _run(["nvcc", "--version"]).splitlines()
    facts["nvcc"] = nvcc[-1] if nvcc else ""
    try:
        import torch

        facts["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()})"
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            facts["torch_gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    except Exception as exc:  # noqa: BLE001 - reported
        facts["torch"] = f"not importable: {exc}"
    facts["python"] = f"{platform.python_version()} ({sys.executable})"
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    facts["cpu"] = f"{cpu}; {len(os.sched_getaffinity(0))} usable cores (os.cpu_count {os.cpu_count()})"
    facts["ram"] = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    facts["kernel"] = platform.release()
    usage = shutil.disk_usage(swap_dir)
    fs = _run(["stat", "-f", "-c", "%T", swap_dir])
    source = _run(["df", "--output=source", swap_dir]).splitlines()[-1:]
    facts["disk"] = (f"{swap_dir}: {fs} on {source[0] if source else '?'}, {usage.total / 1e9:.0f} GB, "
                     f"{usage.free / 1e9:.0f} GB free")
    facts["commit"] = _run(["git", "rev-parse", "--short", "HEAD"])
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    facts["commit"] += f" ({len(changed.splitlines())} tracked files changed)" if changed else " (clean)"
    (work / "machine.json").write_text(json.dumps(facts, indent=1))
    for key, value in facts.items():
        print(f"{key}: {value}")
    return 0


# ----- summary -----------------------------------------------------------------------------------------------
def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = TAIL) -> str:
    """The last lines of a log, from its last traceback when one is among them."""
    rows = text.rstrip().splitlines()
    starts = [i for i, line in enumerate(rows) if line.startswith("Traceback (most recent call last)")]
    if starts and len(rows) - starts[-1] <= 4 * lines:
        rows = rows[starts[-1]:]
    return "\n".join(rows[-lines:])


def _status(parts_dir: Path, name: str) -> Dict[str, str]:
    text = _read(parts_dir / f"{name}.status")
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _junit(path: Path):
    """(counts, [(test id, failure text)]) of a JUnit XML file, or None when it is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failures.append((name, (node.text or node.get("message") or "").strip()))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts, failures


def _bench(work: Path):
    """(the table in markdown, failed rows [(name, text)], notes) from the bench's files."""
    table = _read(work / "bench" / "bench_gpu.md").strip()
    failed, notes = [], []
    try:
        data = json.loads(_read(work / "bench" / "bench_gpu.json"))
    except ValueError:
        return table, failed, notes
    probe = data.get("probe") or {}
    if probe.get("status") == "failed":
        failed.append(("probe", probe.get("error", "") + "\n" + "\n".join(probe.get("log_tail", []))))
    for row in data.get("rows", []):
        if row.get("status") == "failed":
            failed.append((row["row"], row.get("error", "") + "\n" + "\n".join(row.get("log_tail", [])[-TAIL:])))
        elif row.get("status") == "skipped":
            notes.append(f"{row['row']} skipped: {row.get('reason', row.get('error', ''))}")
    if probe.get("status") == "ok":
        bws = [f"{key[:-4]} {probe[key] / 1e9:.1f} GB/s" for key in
               ("dram_Bps", "h2d_Bps", "d2h_Bps", "disk_read_Bps", "disk_write_Bps") if key in probe]
        notes.insert(0, f"probe: T_gpu {probe.get('T_gpu_s', float('nan')):.3f} s; " + ", ".join(bws)
                     + f" (disk: {probe.get('disk_backend')}, O_DIRECT {probe.get('disk_direct')})")
    return table, failed, notes


def _timeline(work: Path) -> str:
    """trace_step.py's table of time per span, from its log."""
    text = _read(work / "parts" / "timeline.log")
    match = re.search(r"^tier=.*?(?=^trace: )", text, flags=re.S | re.M)
    return match.group(0).strip() if match else ""


def summary(work: Path, out: Path, mode: str, parts: List[str], seconds: float) -> int:
    parts_dir = work / "parts"
    rows, failures, passed = [], [], 0
    for name in parts:
        st = _status(parts_dir, name)
        state = st.get("state", "pending")
        note = " ".join(_read(parts_dir / f"{name}.note").split())
        junit = _junit(parts_dir / f"{name}.xml") if name.startswith("tests") else None
        if junit is not None:
            counts, failed_tests = junit
            note = (f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                    f"{counts['skipped']} skipped. " + note).strip()
            for test, text in failed_tests:
                failures.append((f"{name}: {test}", _tail(text, 15)))
        if name == "bench":
            _table, failed_rows, bench_notes = _bench(work)
            note = "; ".join([note] + bench_notes if note else bench_notes)
            for row, text in failed_rows:
                failures.append((f"bench: row {row}", _tail(text)))
        result = {"passed": "passed", "failed": "FAILED", "timeout": "TIMEOUT", "skipped": "not run"}.get(state, state)
        if state == "passed":
            passed += 1
        elif state in ("failed", "timeout"):
            already = any(title.startswith(f"{name}:") for title, _ in failures)
            if not already or state == "timeout":
                why = f"exit code {st.get('rc')}" if state == "failed" else f"stopped at its limit of {st.get('limit')} s"
                failures.append((f"{name}: {why}", _tail(_read(parts_dir / f"{name}.log"))))
        rows.append(f"| {name} | {result} | {st.get('seconds', '')} | {st.get('limit', '')} | {WHAT.get(name, '')}"
                     f"{': ' + note if note else ''} |")
    states = [_status(parts_dir, name).get("state", "pending") for name in parts]
    chosen = len(parts) - states.count("skipped")
    title = f"all {chosen} parts passed" if passed == chosen else f"{passed} of {chosen} parts passed"
    if states.count("skipped"):
        title += f" ({states.count('skipped')} not selected)"
    if "pending" in states or "running" in states:
        title += f" ({states.count('pending') + states.count('running')} not finished yet)"
    lines = [f"# GPU check (issue 32): {title}", ""]
    lines.append(f"Mode: {'rehearsal on the CPU (tiny sizes; offload._C not rebuilt)' if mode == 'rehearsal' else 'GPU'}"
                 f"; {seconds:.0f} s so far; `benchmarks/gpu_check.sh{' --rehearse' if mode == 'rehearsal' else ''}`.")
    try:
        facts = json.loads(_read(work / "machine.json"))
    except ValueError:
        facts = {}
    if facts:
        lines += ["", "## Machine", ""] + [f"- {key}: {value}" for key, value in facts.items()]
    lines += ["", "## Parts", "", "| part | result | s | limit s | what |", "| --- | --- | --- | --- | --- |", *rows]
    lines += ["", "## Failures", ""]
    if not failures:
        lines.append("None.")
    for head, text in failures:
        lines += [f"### {head}", "", "```", text or "(no output)", "```", ""]
    table = _bench(work)[0]
    lines += ["", "## Benchmark (benchmarks/bench_gpu.py)", "", table or "(no table: the bench did not run)"]
    timeline = _timeline(work)
    lines += ["", "## Step timeline (benchmarks/trace_step.py)", ""]
    if timeline:
        lines += ["```", timeline, "```", "", "Perfetto trace: timeline/step_timeline.json in gpu-check.tar.gz; "
                  "picture: step_timeline.png."]
    else:
        lines.append("(no timeline)")
    prep = _read(work / "deepspeed_prep.json")
    if prep:
        lines += ["", "## DeepSpeed preparation", "", "```", prep.strip(), "```"]
    text = "\n".join(lines) + "\n"
    (work / "summary.md").write_text(text, encoding="utf-8")
    pack(work, out, text)
    return 0


def pack(work: Path, out: Path, text: str) -> None:
    """OUT/summary.md, OUT/gpu-check.tar.gz (WORK, largest files left out if it would pass 16 MiB), and copies of
    the table and the picture; nothing else of ours is left in OUT."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:
        (out / name).unlink(missing_ok=True)
    files = sorted((p for p in work.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    left_out: List[str] = []
    while True:
        tmp = out / "gpu-check.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in files:
                tar.add(path, arcname=str(Path("gpu-check") / path.relative_to(work)))
            if left_out:
                info = "left out to stay under 16 MiB: " + ", ".join(left_out) + "\n"
                data = info.encode()
                member = tarfile.TarInfo("gpu-check/LEFT_OUT.txt")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        if tmp.stat().st_size <= MAX_FILE or not files:
            os.replace(tmp, out / "gpu-check.tar.gz")
            break
        left_out.append(str(files.pop().relative_to(work)))  # the largest goes first
    if left_out:
        text += "\nLeft out of gpu-check.tar.gz (16 MiB): " + ", ".join(left_out) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    for source, name in ((work / "bench" / "bench_gpu.csv", "bench_gpu.csv"),
                         (work / "timeline" / "step_timeline.png", "step_timeline.png")):
        if source.is_file() and source.stat().st_size <= MAX_FILE:
            shutil.copyfile(source, out / name)
    ours = [p for p in out.iterdir() if p.name in OUT_FILES]
    assert len(ours) <= MAX_FILES


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["machine"] and len(argv) == 3:
        return machine(Path(argv[1]), argv[2])
    if argv[:1] == ["summary"] and len(argv) == 6:
        return summary(Path(argv[1]), Path(argv[2]), argv[3], argv[4].split(), float(argv[5]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
