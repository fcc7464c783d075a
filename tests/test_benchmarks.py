"""Every benchmark's --quick mode runs to the end and prints each rival (timings are never asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args, tmp_path=None):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_io_quick(tmp_path):
    out = _run(["benchmarks/bench_io.py", "--quick", "--dir", str(tmp_path)])
    for rival in ("offload", "plain python", "aiofiles", "torch.save/load", "fio", "deepspeed"):
        assert rival in out
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up its files


def test_bench_crc32c_quick():
    out = _run(["benchmarks/bench_crc32c.py", "--quick"])
    for rival in ("zlib.crc32", "bound: memory read", "per optimizer step"):
        assert rival in out


def test_bench_integrity_quick(tmp_path):
    out = _run(["benchmarks/bench_integrity.py", "--quick", "--nvme-path", str(tmp_path)])
    for variant in ("both checks", "no checksums", "no finite-gradient check", "neither"):
        assert variant in out


def test_bench_train_quick(tmp_path):
    out = _run(["benchmarks/bench_train.py", "--quick", "--nvme-path", str(tmp_path)])
    for rival in ("torch AdamW", "offload gpu tier", "offload cpu tier", "offload nvme tier", "efficiency"):
        assert rival in out


def test_bench_scale_quick(tmp_path):
    """A ~100M-parameter Llama-style model built on the meta device, initialized and trained by offload on the nvme
    tier: every table prints and the swap directory is removed."""
    out = _run(["benchmarks/bench_scale.py", "--quick", "--nvme-path", str(tmp_path)])
    for key in ("training state", "peak RSS growth", "disk bandwidth (DiskProbe", "efficiency", "DeepSpeed",
                "estimate(), this model's blocks", "wrap()'s plan", "bytes per tier against wrap()'s plan"):
        assert key in out, out
    assert list(tmp_path.iterdir()) == []  # swap file, layout and probe file all removed


def test_grad_from_moments_quick():
    """The measurement for issue 35's next design prints a row per gradient dtype; bf16 gradients come back from
    the first moments on the first step exactly (m = 0: m' = (1 - beta1) g, within a bf16 ulp)."""
    out = _run(["benchmarks/grad_from_moments.py", "--quick"])
    rows = [line.split() for line in out.splitlines() if line.startswith(("bfloat16 ", "float32 "))]
    assert [row[0] for row in rows] == ["bfloat16"] * 3 + ["float32"] * 3, out
    assert rows[0][1:4:2] == ["1", "0.00e+00"], rows[0]


def test_bench_checkpoint_quick(tmp_path):
    out = _run(["benchmarks/bench_checkpoint.py", "--quick", "--dir", str(tmp_path)])
    rows = [line for line in out.splitlines() if line.split("  ")[0].strip() in (
        "offload cpu tier", "offload nvme tier", "offload nvme tier, XFS clones", "torch.save/load",
        "safetensors save_file/load_file")]
    assert len(rows) == 10, out  # every rival saves and loads (the XFS rows say "skipped: why" where no XFS)
    assert "disk bound, the checkpoint directory" in out and "of_bound" in out
    assert list(tmp_path.iterdir()) == []  # checkpoints, swap files, probe and XFS image all removed


def test_trace_step_quick(tmp_path):
    """The timeline writes a Chrome trace whose spans cover both threads (and a PNG where matplotlib is)."""
    import json

    trace = tmp_path / "timeline.json"
    out = _run(["benchmarks/trace_step.py", "--quick", "--trace", str(trace), "--png", str(tmp_path / "t.png"),
                "--nvme-path", str(tmp_path)])
    for span in ("forward", "backward", "update", "ms_per_step"):
        assert span in out
    events = json.loads(trace.read_text())["traceEvents"]
    threads = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    kinds = {(e["tid"], e["cat"]) for e in events if e["ph"] == "X"}
    assert (threads["training thread"], "backward") in kinds and (threads["update worker"], "update") in kinds
    assert ("picture:" in out) == (tmp_path / "t.png").exists()


def test_bench_dp_quick(tmp_path):
    """Two ranks over gloo (torchrun per rival and round): offload's data-parallel mode on the cpu and nvme tiers,
    replicated and sharded (and sharded with weight parts in the swap files), and torch DDP + AdamW each train and
    report step time, peak RSS, optimizer state, swap bytes and collective bytes per rank; DeepSpeed prints why it
    was skipped where it is not importable; the swap directory is removed."""
    out = _run(["benchmarks/bench_dp.py", "--quick", "--nvme-path", str(tmp_path)])
    for rival in ("offload cpu replicated", "offload nvme replicated", "offload cpu sharded", "offload nvme sharded",
                  "offload nvme sharded, weights on disk", "torch DDP + AdamW", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3"):
        assert rival in out, out
    for column in ("step_ms", "peak_rss_MB", "state_MB", "step_vs_ddp", "swap_MB", "gather_MB", "reduce_MB",
                   "other_MB", "comm_vs_ddp"):
        assert column in out, out
    assert "weights on disk: " in out, out  # the row's plan put some blocks' weight parts in the swap files
    assert "FAILED" not in out, out
    assert list(tmp_path.iterdir()) == []  # every rank's swap file and directory removed


def test_bench_data_quick(tmp_path):
    """A 4 MiB token file, one round: every loader (the DALI rows print why where DALI is missing), the torch
    DataLoader and both disk-bound rows report windows/s, CPU per batch and disk KiB per window; the file is
    removed."""
    out = _run(["benchmarks/bench_data.py", "--quick", "--dir", str(tmp_path)])
    for rival in ("offload.data dali, O_DIRECT", "offload.data dali, page cache", "offload.data numpy",
                  "torch DataLoader", "disk bound: O_DIRECT, 32 in flight", "disk bound: O_DIRECT, 1 at a time"):
        assert rival in out, out
    for column in ("windows/s", "of bound", "CPU ms/batch", "disk KiB/window"):
        assert column in out, out
    assert list(tmp_path.iterdir()) == []  # the token file and its directory removed
