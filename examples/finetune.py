"""Fine-tune a pretrained Hugging Face causal LM with offload, from a model directory and a text file to an
exported model that plain transformers loads.

    python examples/finetune.py --make-tiny --out runs/tiny              # offline: a tiny Llama, sample text
    python examples/finetune.py --model llama-dir/ --text corpus.txt --out runs/ft --nvme-path /mnt/nvme/ft

The model is built on the meta device and filled block by block from the shards (the larger-than-RAM path:
`offload.integrations.transformers.from_pretrained`), its optimizer state lives in a swap file (tier "nvme"),
batches are random windows of the token file (`offload.data.TokenWindows`). See examples/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/ is not a package
import _common  # noqa: E402

CHECKPOINT = re.compile(r"^step-(\d+)$")
HISTORY = "history.json"  # the loss log, inside each checkpoint directory and in OUT


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_common_arguments(parser)
    return parser.parse_args(argv)


def newest_checkpoint(out: str) -> Optional[Tuple[int, str]]:
    """(step, directory) of the newest complete checkpoint: engine.save's manifest and the loss log both there
    (a run killed between the two leaves a directory that is skipped)."""
    root = os.path.join(out, "checkpoints")
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match, path = CHECKPOINT.match(name), os.path.join(root, name)
        if match and all(os.path.isfile(os.path.join(path, f)) for f in ("manifest.json", HISTORY)):
            found.append((int(match.group(1)), path))
    return max(found) if found else None


def build_engine(args: argparse.Namespace, model_dir: str) -> Any:
    """The pretrained model wrapped for training: built on the meta device and filled block by block from
    the shards, its fp32 master weights and Adam moments in a swap file under --nvme-path."""
    import torch

    from offload.integrations.transformers import from_pretrained

    nvme_path = args.nvme_path or os.path.join(args.out, "swap")
    os.makedirs(nvme_path, exist_ok=True)
    # max_grad_norm= here and engine.clip_grad_norm_ in the loop: with grad_accumulation_steps declared, blocks
    # would otherwise update during the last backward, before a global norm could be taken over all of them
    # (clip_grad_norm_ then raises). With it, the norms are taken during backward and the updates wait.
    return from_pretrained(model_dir, tier="nvme", nvme_path=nvme_path, dtype=getattr(torch, args.dtype),
                           lr=_common.peak_lr(args), weight_decay=0.01, max_grad_norm=args.max_grad_norm,
                           grad_accumulation_steps=args.accum, host_memory=args.host_memory,
                           device_memory=args.device_memory, moments=args.moments)


def train(args: argparse.Namespace, engine: Any, tokens: str) -> List[Dict[str, float]]:
    """The training loop; returns the loss history (every step since the start, resumed runs included)."""
    import contextlib

    import torch
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from offload.data import TokenWindows

    device = engine.policy.device
    windows = TokenWindows(tokens, args.seq_len, args.micro_batch, seed=args.seed,
                           device=device if device.type == "cuda" else None)
    # engine.optimizer is a torch Optimizer: any torch/transformers LR scheduler drives its param_groups.
    sched = get_cosine_schedule_with_warmup(engine.optimizer, args.warmup, args.steps)
    history: List[Dict[str, float]] = []
    start = 0
    found = newest_checkpoint(args.out) if args.resume else None
    if args.resume and found is None:
        print(f"--resume: no checkpoint under {args.out}/checkpoints yet, starting from step 0")
    if found is not None:
        start, path = found
        # Weights, Adam state, step counters, LR schedule and the data stream's position: the next batch is
        # the one the interrupted run would have drawn next. (A larger --steps stretches the cosine from here.)
        engine.load(path, scheduler=sched, data=windows)
        history = [h for h in _read_history(path) if h["step"] <= start]
        for group, base, fn in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(start)  # this run's schedule at step `start` (the saved one may be shorter)
        print(f"resumed from {path} at step {start}")
    autocast = (torch.autocast(device.type, dtype=engine.policy.dtype) if engine.policy.dtype != torch.float32
                else contextlib.nullcontext())  # a bf16 layer after an fp32 norm needs autocast
    tokens_per_step = args.accum * args.micro_batch * args.seq_len
    print(f"training steps {start + 1}..{args.steps}: {args.accum} x {args.micro_batch} windows of "
          f"{args.seq_len} tokens a step")
    bar = tqdm(range(start + 1, args.steps + 1), desc="finetune", unit="step", initial=start, total=args.steps)
    for step in bar:
        began, loss_sum = time.perf_counter(), 0.0
        for _ in range(args.accum):
            batch = next(windows)  # (micro_batch, seq_len + 1) int64
            with autocast:
                # Hugging Face causal LMs shift the labels themselves (position t is scored on token t + 1), so
                # the whole window goes in as both input_ids and labels: seq_len predicted tokens per row. Passing
                # input_ids=batch[:, :-1], labels=batch[:, 1:] would shift twice and train to predict t + 2.
                loss = engine(input_ids=batch, labels=batch).loss
            (loss / args.accum).backward()  # gradients add up over micro-batches, as in plain torch
            loss_sum += float(loss.detach())
        # The global norm before clipping; the gradients are clipped in place to --max-grad-norm.
        grad_norm = float(engine.clip_grad_norm_(args.max_grad_norm))
        lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step uses (the Trainer logs the same)
        engine.step()
        engine.zero_grad()
        sched.step()
        seconds = time.perf_counter() - began
        entry = {"step": step, "loss": loss_sum / args.accum, "lr": lr,
                 "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / seconds}
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:,.0f}")
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(args, engine, sched, windows, step, history)
    bar.close()
    windows.close()
    return history


def save_checkpoint(args: argparse.Namespace, engine: Any, sched: Any, windows: Any, step: int,
                    history: List[Dict[str, float]]) -> str:
    """OUT/checkpoints/step-N: engine.save's directory (weights, optimizer state, scheduler, data position),
    then the loss log beside them; newest_checkpoint only counts a directory holding both."""
    path = os.path.join(args.out, "checkpoints", f"step-{step}")
    engine.save(path, scheduler=sched, data=windows, progress=False)
    _common.write_json(os.path.join(path, HISTORY), history)
    return path


def _read_history(checkpoint: str) -> List[Dict[str, float]]:
    import json

    with open(os.path.join(checkpoint, HISTORY), encoding="utf-8") as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    model_dir, tokens, texts = _common.prepare(args)
    engine = build_engine(args, model_dir)
    print(engine.plan)
    history = train(args, engine, tokens)
    _common.write_json(os.path.join(args.out, HISTORY), history)
    if history:
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"loss: step {history[0]['step']} {first:.4f} -> step {history[-1]['step']} {last:.4f}")
        if not all(math.isfinite(h["loss"]) for h in history):
            print("warning: a non-finite loss was logged")
    _common.plot_losses(history, os.path.join(args.out, "loss.png"), "finetune.py (offload engine)")
    _common.print_stats(engine.stats())
    final = engine.save_pretrained(os.path.join(args.out, "final"), progress=False)
    engine.close()
    _common.show_export(args, model_dir, final, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
