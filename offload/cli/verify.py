"""Arguments and table of `python -m offload verify` (the function form is `offload.verify`)."""

from __future__ import annotations

import argparse
import importlib

import torch

from offload.cli.options import non_negative_finite_float, positive_finite_float, positive_int

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-1}  # bf16: rounding of weights and activations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="offload.cli.verify_model:tiny_gpt",
                        help="module:function returning (model, batch_fn); default: a built-in tiny GPT")
    parser.add_argument("--tier", default="all", choices=["all", "gpu", "cpu", "nvme"])
    parser.add_argument("--steps", type=positive_int, default=4, help="optimizer steps to compare (>= 1)")
    parser.add_argument("--accum", type=positive_int, default=1, help="micro-batches per step (>= 1)")
    parser.add_argument("--max-grad-norm", type=positive_finite_float, default=None,
                        help="clip the global gradient norm to this (> 0); default: no clipping")
    parser.add_argument("--lr", type=non_negative_finite_float, default=1e-3, help="learning rate (>= 0)")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nvme-path", default=None, help="swap directory for the nvme tier (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    from offload.parity import verify

    module_name, _, function_name = args.model.partition(":")
    model_fn = getattr(importlib.import_module(module_name), function_name or "main")
    tiers = ["gpu", "cpu", "nvme"] if args.tier == "all" else [args.tier]
    tolerance = TOLERANCE[args.dtype]
    print(f"model {args.model}, {args.steps} steps x {args.accum} micro-batches, dtype {args.dtype}, "
          f"device {args.device}, max_grad_norm {args.max_grad_norm}; reference: torch.optim.AdamW")
    print(f"{'tier':<6} {'max |dloss|':>12} {'max |dweight|':>14}  {'worst parameter':<28} verdict (tol {tolerance:g})")
    ok = True
    for tier in tiers:
        report = verify(model_fn, args.steps, tier, lr=args.lr, max_grad_norm=args.max_grad_norm,
                        grad_accumulation_steps=args.accum, dtype=getattr(torch, args.dtype), device=args.device,
                        nvme_path=args.nvme_path)
        passed = report.passed(tolerance)
        ok &= passed
        print(f"{tier:<6} {report.max_loss_diff:>12.3g} {report.max_weight_diff:>14.3g}  {report.worst_parameter:<28} "
              f"{'ok' if passed else 'DIFFERS'}")
    return 0 if ok else 1
