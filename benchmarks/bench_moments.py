"""Do compressed Adam moments train? The demo and the fine-tune example with moments fp32, bf16 and int8, side by
side: loss curves on one picture (docs/img/moments_loss.png) and the final losses against fp32's.

    python benchmarks/bench_moments.py                 # demo 60 steps + finetune --make-tiny 40 steps, each x3
    python benchmarks/bench_moments.py --demo-steps 20 --finetune-steps 10   # quicker

Each run is the command a user types (`python -m offload demo --moments M`, `python examples/finetune.py
--make-tiny --moments M`) in a subprocess with the same seed and data, so only the moments' format differs.
"Final" is the last step's loss and, less noisy, the mean of the last five steps; the ratio is against fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import append_csv, machine_header, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("fp32", "bf16", "int8")
DEMO_STEP = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", re.MULTILINE)


def demo_losses(moments: str, steps: int, work: str) -> List[float]:
    """The demo's per-step losses (it prints one line per step)."""
    out = subprocess.run([sys.executable, "-m", "offload", "demo", "--moments", moments, "--steps", str(steps),
                          "--out", os.path.join(work, f"demo-{moments}"), "--nvme-path", work],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    losses = [float(loss) for _step, loss in DEMO_STEP.findall(out)]
    if len(losses) != steps:
        raise RuntimeError(f"demo printed {len(losses)} losses, expected {steps}:\n{out[-2000:]}")
    return losses


def finetune_losses(moments: str, steps: int, work: str) -> List[float]:
    """The fine-tune example's per-step losses (history.json in its output directory)."""
    out = os.path.join(work, f"finetune-{moments}")
    subprocess.run([sys.executable, "examples/finetune.py", "--make-tiny", "--out", out, "--moments", moments,
                    "--steps", str(steps), "--save-every", str(steps)], cwd=ROOT, capture_output=True, text=True,
                   check=True)
    with open(os.path.join(out, "history.json"), encoding="utf-8") as f:
        return [entry["loss"] for entry in json.load(f)]


def plot(curves: Dict[str, Dict[str, List[float]]], path: Path) -> Optional[Path]:
    """One panel per workload, one line per format."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 3.8), dpi=120)
    for ax, (workload, by_format) in zip(list(axes) if len(curves) > 1 else [axes], curves.items()):
        for fmt, losses in by_format.items():
            ax.plot(range(1, len(losses) + 1), losses, label=f"moments={fmt}", linewidth=1.2,
                    linestyle="-" if fmt == "fp32" else ("--" if fmt == "bf16" else ":"))
        ax.set_title(workload)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo-steps", type=int, default=60)
    parser.add_argument("--finetune-steps", type=int, default=40)
    parser.add_argument("--picture", default=str(ROOT / "docs" / "img" / "moments_loss.png"))
    args = parser.parse_args(argv)
    print(machine_header())
    workloads = {f"python -m offload demo --steps {args.demo_steps}": lambda m, w: demo_losses(m, args.demo_steps, w),
                 f"examples/finetune.py --make-tiny --steps {args.finetune_steps}":
                     lambda m, w: finetune_losses(m, args.finetune_steps, w)}
    curves: Dict[str, Dict[str, List[float]]] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="offload-moments-") as work:
        for workload, run in workloads.items():
            curves[workload] = {}
            for fmt in FORMATS:
                print(f"{workload} --moments {fmt} ...", flush=True)
                curves[workload][fmt] = run(fmt, work)
            base = curves[workload]["fp32"]
            for fmt, losses in curves[workload].items():
                last5, base5 = sum(losses[-5:]) / 5, sum(base[-5:]) / 5
                rows.append(dict(workload=workload, moments=fmt, first=f"{losses[0]:.4f}", final=f"{losses[-1]:.4f}",
                                 final_vs_fp32=f"{losses[-1] / base[-1]:.4f}", last5_mean=f"{last5:.4f}",
                                 last5_vs_fp32=f"{last5 / base5:.4f}"))
    print_table(rows, ["workload", "moments", "first", "final", "final_vs_fp32", "last5_mean", "last5_vs_fp32"])
    picture = plot(curves, Path(args.picture))
    print(f"picture: {picture}" if picture else "picture: not drawn (matplotlib is not installed)")
    append_csv("bench_moments", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
