"""A timeline of training steps: what the training thread and the update worker do, and when each waits.

    python benchmarks/trace_step.py                      # nvme tier, GPT 6 x 256 fp32, 3 recorded steps
    python benchmarks/trace_step.py --tier cpu --dtype bfloat16 --png docs/img/step_timeline_cpu.png
    python benchmarks/trace_step.py --quick              # a tiny model (smoke run)
    python benchmarks/trace_step.py --device cuda --dtype bfloat16   # on a GPU (benchmarks/gpu_check.sh)

Writes a Chrome/Perfetto trace (open it at ui.perfetto.dev or chrome://tracing) and, when matplotlib is
installed (`pip install offload[bench]`), a PNG of the same spans. Spans come from the engine's tracing seam
(`engine.add_observer`, offload/scheduler/trace.py): step() and each wait for a block's pending update on
the training thread, each block update and, inside it, each wait for the disk on the update worker; this
script times forward and backward itself (on CUDA it synchronizes after each, so their spans hold the GPU's
work too). Prints a table of time per step in each span kind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_header, print_table  # noqa: E402

import offload  # noqa: E402
from offload.cli.demo import DemoGPT  # noqa: E402

Span = Tuple[str, str, float, float, str]  # (thread, kind, start, end, label)
COLORS = {"forward": "#4c78a8", "backward": "#f58518", "step()": "#54a24b", "wait for update": "#e45756",
          "update": "#72b7b2", "disk wait": "#b279a2"}


class Recorder:
    """Collects spans from every thread: the engine's (an observer, `on_span`) and this script's (`add`)."""

    def __init__(self) -> None:
        self.spans: List[Span] = []
        self.on = False
        self._lock = threading.Lock()

    def add(self, kind: str, start: float, end: float, label: str = "") -> None:
        if self.on:
            with self._lock:
                self.spans.append((threading.current_thread().name, kind, start, end, label))

    def on_span(self, name: str, detail: str, start: float, end: float) -> None:
        self.add(name, start, end, detail)


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="nvme", choices=["gpu", "cpu", "nvme"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3, help="steps recorded after 3 warm-up steps")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--device", default="cpu", help="compute device: cpu (default) or cuda")
    parser.add_argument("--trace", default=None, help="Chrome trace path (default: benchmarks/results/)")
    parser.add_argument("--png", default=None, help="PNG path (default: next to the trace)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.steps = 2, 64, 256, 32, 2
    stem = f"step_timeline_{args.tier}{'_quick' if args.quick else ''}"
    trace_path = Path(args.trace or Path(__file__).resolve().parent / "results" / f"{stem}.json")
    png_path = Path(args.png) if args.png else trace_path.with_suffix(".png")
    dtype = getattr(torch, args.dtype)
    print(machine_header())

    recorder = Recorder()
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.context)).to(args.device)
    tgt = torch.randint(0, args.vocab, (args.batch, args.context)).to(args.device)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
        model = DemoGPT(args.vocab, args.dim, args.layers, args.context)
        with offload.wrap(model, tier=args.tier, nvme_path=directory if args.tier == "nvme" else None,
                          lr=1e-4, weight_decay=0.01, dtype=dtype, device=args.device,
                          grad_accumulation_steps=1) as engine:
            engine.add_observer(recorder)
            for step in range(3 + args.steps):
                recorder.on = step >= 3
                start = time.perf_counter()
                # offload keeps norm weights fp32 when computing in bfloat16, as autocast does: the forward runs
                # under autocast so that a norm's fp32 output meets the next layer in its dtype (CUDA's layer_norm
                # takes no mixed dtypes; the CPU's does)
                with torch.autocast(device_type=torch.device(args.device).type, dtype=dtype,
                                    enabled=dtype != torch.float32):
                    loss = engine(idx, tgt)
                sync()
                middle = time.perf_counter()
                loss.backward()
                sync()
                end = time.perf_counter()
                recorder.add("forward", start, middle, f"step {step - 2}")
                recorder.add("backward", middle, end, f"step {step - 2}")
                engine.step()
                engine.zero_grad()
            recorder.on = False  # the last updates run on into the synchronize: not a step's steady state
            engine.synchronize()


    spans = recorder.spans
    origin = min(s[2] for s in spans)
    per_kind: Dict[Tuple[str, str], float] = defaultdict(float)
    for thread, kind, start, end, _label in spans:
        per_kind[(_lane(thread), kind)] += (end - start) / args.steps
    wall = (max(s[3] for s in spans) - origin) / args.steps
    rows = [dict(thread=lane, span=kind, ms_per_step=f"{1e3 * seconds:.1f}", share_of_step=f"{seconds / wall:.2f}")
            for (lane, kind), seconds in sorted(per_kind.items())]
    print(f"tier={args.tier} GPT {args.layers}x{args.dim} {args.dtype}; {args.steps} steps recorded, "
          f"{1e3 * wall:.1f} ms per step (wall)")
    print_table(rows, ["thread", "span", "ms_per_step", "share_of_step"])
    _write_trace(spans, origin, trace_path)
    print(f"trace: {trace_path}")
    if _plot(spans, origin, png_path, f"offload tier={args.tier}, GPT {args.layers}x{args.dim} {args.dtype}, "
             f"{args.steps} steps on {_where(args.device)}"):
        print(f"picture: {png_path}")


def _where(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"the CPU ({len(os.sched_getaffinity(0))} cores)"


def _lane(thread: str) -> str:
    return "update worker" if thread.startswith("offload-step") else "training thread"


def _write_trace(spans: List[Span], origin: float, path: Path) -> None:
    """Chrome trace format: one complete ('X') event per span, microseconds, one row per thread."""
    lanes = {"training thread": 1, "update worker": 2}
    events = [{"name": f"{kind} {label}".strip(), "cat": kind, "ph": "X", "pid": 1, "tid": lanes[_lane(thread)],
               "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6}
              for thread, kind, start, end, label in spans]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
               for lane, tid in lanes.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _plot(spans: List[Span], origin: float, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no picture (pip install offload[bench])")
        return False
    rows = [("training thread", ("forward", "backward", "step()", "wait for update")),
            ("update worker", ("update", "disk wait"))]
    fig, ax = plt.subplots(figsize=(14, 2.8))
    for y, (lane, kinds) in enumerate(rows):
        for kind in kinds:
            bars = [((s - origin) * 1e3, (e - s) * 1e3) for t, k, s, e, _l in spans if _lane(t) == lane and k == kind]
            inner = kind in ("disk wait", "wait for update")  # drawn thinner, on top of what they interrupt
            ax.broken_barh(bars, (y - (0.15 if inner else 0.35), 0.3 if inner else 0.7), color=COLORS[kind],
                           label=kind, zorder=3 if inner else 2)
    ax.set_yticks(range(len(rows)), [lane for lane, _k in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=len(COLORS), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
