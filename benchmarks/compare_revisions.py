"""A benchmark run on two source trees, alternated, to compare a change with what came before it.

    git worktree add /tmp/before <commit> && (cd /tmp/before && python setup.py build_ext --inplace)
    python benchmarks/compare_revisions.py --before /tmp/before [--pairs 3] [--bench bench_train.py] [-- ARGS]

Each pair runs the benchmark script once from `--before` and once from this checkout, in alternating order
(before-after, then after-before), in fresh processes, so slow drifts of a shared machine fall on both
sides. Each script imports offload from its own tree (it puts its repository first on sys.path). The
rows of the table each run prints are matched by rival name; printed: per rival, the median step time of
each tree over the pairs, and the ratio after/before within each pair (its median and p20-p80): a pair
whose two runs met the same machine load compares them, where a ratio of medians across pairs would not.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_header, print_table, summarize  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(HERE))  # the machine header imports this checkout's offload, installed or not


def _table(output: str) -> Dict[str, float]:
    """rival -> step_ms, from the aligned table a benchmark prints (columns two or more spaces apart)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rival"))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows: Dict[str, float] = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = dict(zip(header, re.split(r"\s{2,}", line.strip())))
        rows[cells["rival"]] = float(cells["step_ms"])
    return rows


def _run(tree: Path, bench: str, args: List[str]) -> Dict[str, float]:
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / bench), *args], cwd=tree,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}/benchmarks/{bench} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return _table(proc.stdout)


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the other source tree (built in place)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--bench", default="bench_train.py")
    parser.add_argument("bench_args", nargs="*", help="arguments for the benchmark (after --)")
    args = parser.parse_args(argv)
    runs: Dict[str, List[Dict[str, float]]] = {"before": [], "after": []}
    for pair in range(args.pairs):
        order = ["before", "after"] if pair % 2 == 0 else ["after", "before"]
        for side in order:
            tree = args.before.resolve() if side == "before" else HERE
            runs[side].append(_run(tree, args.bench, args.bench_args))
            print(f"pair {pair + 1}/{args.pairs}: {side} done", file=sys.stderr)
    rivals = [r for r in runs["after"][0] if all(r in run for run in runs["before"] + runs["after"])]
    rows = []
    for rival in rivals:
        before = [run[rival] for run in runs["before"]]
        after = [run[rival] for run in runs["after"]]
        ratios = [a / b for a, b in zip(after, before)]
        ratio, low, high = summarize(ratios)
        rows.append(dict(rival=rival, before_ms=f"{summarize(before)[0]:.1f}", after_ms=f"{summarize(after)[0]:.1f}",
                         after_over_before=f"{ratio:.3f}", p20_p80=f"{low:.3f}-{high:.3f}",
                         pair_ratios=" ".join(f"{r:.3f}" for r in ratios)))
    print(machine_header())
    print(f"{args.bench} {' '.join(args.bench_args)} | before: {args.before} | after: {HERE} | {args.pairs} pairs, "
          "alternating order")
    print("after_over_before: the median over the pairs of after/before within a pair (1.000: no change)")
    print_table(rows, ["rival", "before_ms", "after_ms", "after_over_before", "p20_p80", "pair_ratios"])


if __name__ == "__main__":
    main()
