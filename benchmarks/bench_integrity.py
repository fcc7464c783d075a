"""What the nvme tier's integrity checks cost per training step: swap-file checksums and the finite-gradient
check, each switched off in turn, four engines interleaved round by round in one process.

    python benchmarks/bench_integrity.py           # GPT 6 x 256, fp32, 5 rounds x 3 steps
    python benchmarks/bench_integrity.py --quick   # a tiny model, 2 rounds (smoke run)

Each engine's checks are switched off for its whole life by replacing them with no-ops on its own runtime
records (`engine.records`: each group's gradient accumulator and swap store; a measurement device only:
offload itself has no switch for them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import offload  # noqa: E402
from benchmarks.bench_train import GPT  # noqa: E402
from benchmarks.common import machine_header, print_table, summarize  # noqa: E402

VARIANTS = {"both checks": (True, True), "no checksums": (False, True),
            "no finite-gradient check": (True, False), "neither": (False, False)}


def disable_checks(engine: "offload.Engine", checksums: bool, finite: bool) -> None:
    """Switch this engine's checks off for its whole life (never per turn: a seal skipped in one turn and
    verified in another would be a false alarm)."""
    for record in engine.records:
        for state in record.states:
            if not finite:
                state.grads.all_finite = lambda *a, **k: True
            swap = getattr(state.store, "swap", None)  # the nvme tier's swap file
            if not checksums and swap is not None:
                swap.checksums.seal = swap.checksums.verify = lambda *a, **k: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    layers, dim, vocab, context, rounds = (2, 64, 256, 32, 2) if args.quick else (6, 256, 4096, 128, args.rounds)
    torch.manual_seed(0)
    idx, tgt = torch.randint(0, vocab, (4, context)), torch.randint(0, vocab, (4, context))
    print(machine_header())
    samples = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
        engines = {}
        for name, (checksums, finite) in VARIANTS.items():
            engines[name] = offload.wrap(GPT(vocab, dim, layers, context, 4), tier="nvme",
                                         nvme_path=directory, dtype=torch.float32, device="cpu", lr=1e-4, weight_decay=0.0,
                                         grad_accumulation_steps=1)
            disable_checks(engines[name], checksums, finite)
        for r in range(rounds + 1):  # round 0 warms up
            for name, engine in engines.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine(idx, tgt).backward()
                    engine.step()
                    engine.zero_grad()
                engine.synchronize()
                if r:
                    samples[name].append((time.perf_counter() - start) / args.steps)
        rows = []
        base = summarize(samples["neither"])[0]
        for name, engine in engines.items():
            med, p20, p80 = summarize(samples[name])
            stats = engine.stats()
            rows.append(dict(variant=name, step_ms=f"{1e3 * med:.1f}", p20_p80=f"{1e3 * p20:.1f}-{1e3 * p80:.1f}",
                             vs_neither=f"{med / base:.2f}x",
                             update_ms=f"{1e3 * stats['update_seconds'] / stats['steps']:.1f}",
                             io_wait_ms=f"{1e3 * stats.get('nvme_io_wait_seconds', 0.0) / stats['steps']:.1f}"))
            engine.close()
    print(f"GPT layers={layers} dim={dim} vocab={vocab} context={context} | fp32 | nvme tier in {directory} | "
          f"{rounds} rounds x {args.steps} steps")
    print_table(rows, ["variant", "step_ms", "p20_p80", "vs_neither", "update_ms", "io_wait_ms"])


if __name__ == "__main__":
    main()
