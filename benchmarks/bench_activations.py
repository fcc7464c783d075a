"""Activations off the device: a transformers GPT-2 on long sequences, the nvme tier with small budgets, with and
without `activations="offload"`, against torch's `save_on_cpu` and plain activation checkpointing.

    python benchmarks/bench_activations.py                     # 8 x 512, vocab 2048, 4 x {512,1024,2048} tokens
    python benchmarks/bench_activations.py --seq 2048 --steps 2

Each row runs in a fresh process (peak RSS is VmHWM, reset after the model is built and wrapped), `--steps`
steps of batch 4, 128 MiB + 128 MiB budgets, `grad_accumulation_steps=1`, fp32 on the CPU (the device here is
this CPU's RAM, so "off the device" means into the swap file). Losses are compared with the row without
offload at the same length; `growth` is peak RSS over the baseline after wrap(), and `vs plain` its ratio to
the plain row's; `block_MB` is the most one transformer layer's forward sent to the swap file (rows that
spill). The JSON row of `run_row` also has the engine's own measurement, `engine.plan.activations`
(`saved_bytes`, `moved_bytes`, `largest_block_bytes`, `tokens`). `save_on_cpu` moves every saved tensor to host
memory: on a CPU device that is the same RAM, so it is the copy's cost without the saving; on CUDA it is the
rival that matters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import append_csv, machine_header, print_table  # noqa: E402

MODES = ("plain", "offload", "save_on_cpu", "checkpointing", "checkpointing+offload")
HOST_MEMORY = 128 << 20  # the budgets of every row (tests/test_activation_memory.py bounds the growth with them)
DEVICE_MEMORY = 128 << 20


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def child(mode: str, seq: int, steps: int, out: str, layers: int = 8, dim: int = 512, batch: int = 4) -> None:
    """One row, in this process: build, wrap, train `steps` steps, report losses, time and peak RSS."""
    import torch
    import transformers

    import offload

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=8, vocab_size=2048, n_positions=max(seq, 1024),
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if mode.startswith("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    swap = tempfile.mkdtemp(prefix="offload-act-")
    engine = offload.wrap(model, "nvme", nvme_path=swap, dtype=torch.float32, device="cpu", lr=1e-4, weight_decay=0.0,
                          host_memory=HOST_MEMORY, device_memory=DEVICE_MEMORY, grad_accumulation_steps=1,
                          activations="offload" if mode.endswith("offload") else None)
    layer_bytes: List[int] = []  # what each transformer layer's forward call sent to the swap file
    for layer in model.transformer.h:
        layer.register_forward_pre_hook(lambda module, args: layer_bytes.append(-_spilled(engine)))
        layer.register_forward_hook(lambda module, args, out: layer_bytes.append(layer_bytes.pop() + _spilled(engine)))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 2048, (batch, seq), generator=gen) for _ in range(steps)]
    _reset_peak()
    base = _peak_rss()
    losses, times = [], []
    for ids in batches:
        start = time.perf_counter()
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                loss = engine(input_ids=ids, labels=ids).loss
        else:
            loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        engine.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = _peak_rss()
    stats = engine.stats()
    use = engine.plan.activations  # the last training forward's saved tensors, measured (offload/scheduler/activations/use.py)
    engine.close()
    if os.path.isdir(swap) and not os.listdir(swap):
        os.rmdir(swap)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"losses": losses, "times": times, "growth": peak - base,
                   "spilled": stats.get("activation_bytes_to_disk", 0),
                   "largest_block_bytes": use.largest_block_bytes if use else 0,
                   "saved_bytes": use.saved_bytes if use else 0, "moved_bytes": use.moved_bytes if use else 0,
                   "tokens": use.tokens if use else batch * seq, "vocab": config.vocab_size,
                   "layer_bytes": max(layer_bytes, default=0)}, f)


def _spilled(engine) -> int:
    return int(engine.stats().get("activation_bytes_to_disk", 0))


def run_row(mode: str, seq: int, steps: int, layers: int = 8, dim: int = 512, batch: int = 4) -> Dict[str, object]:
    """One row in a fresh process (its own peak RSS)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, __file__, "--child", mode, "--seq", str(seq), "--steps", str(steps),
                    "--layers", str(layers), "--dim", str(dim), "--batch", str(batch), "--out", out], check=True)
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.seq[0], args.steps, args.out, args.layers, args.dim, args.batch)
        return 0
    print(machine_header())
    rows = []
    for seq in args.seq:
        results = {mode: run_row(mode, seq, args.steps, args.layers, args.dim, args.batch) for mode in args.modes}
        plain = results.get("plain")
        for mode, r in results.items():
            ref = plain if not mode.startswith("checkpointing") else results.get("checkpointing", plain)
            diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) if ref else float("nan")
            rows.append(dict(seq=seq, mode=mode, step_s=f"{sorted(r['times'])[len(r['times']) // 2]:.2f}",
                             growth_GB=f"{r['growth'] / 1e9:.2f}",
                             vs_plain=f"{r['growth'] / plain['growth']:.2f}" if plain else "",
                             spilled_GB=f"{r['spilled'] / 1e9:.2f}",
                             block_MB=f"{r['layer_bytes'] / 1e6:.0f}" if r["layer_bytes"] else "",
                             loss=f"{r['losses'][-1]:.6f}",
                             max_loss_diff=f"{diff:.1e}"))
    print_table(rows, ["seq", "mode", "step_s", "growth_GB", "vs_plain", "spilled_GB", "block_MB", "loss",
                       "max_loss_diff"])
    append_csv("bench_activations", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
