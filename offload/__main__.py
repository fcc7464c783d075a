"""`python -m offload <command>`: doctor (what is active and why), estimate (memory per tier for a model
size and budgets), demo (a short nvme-tier training run with its efficiency against the measured bound),
verify (parity with plain PyTorch), tokenize (text to a token file for offload.data)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="print which native parts, CPU features, I/O backend and limits are active")
    doctor.add_argument("--dir", default=None, help="directory to choose the I/O backend for (default: the temp dir)")
    from offload.cli import demo as demo_module
    from offload.cli import estimate as estimate_module
    from offload.cli.verify import add_arguments as add_verify_arguments
    from offload.cli.verify import run as run_verify

    demo_module.add_arguments(sub.add_parser("demo", help="a short nvme-tier training run and its efficiency"))
    estimate_module.add_arguments(sub.add_parser("estimate", help="memory per tier for a model size and budgets"))
    add_verify_arguments(sub.add_parser(
        "verify", help="train a few steps with and without offload; print the largest differences"))
    from offload.cli import tokenize as tokenize_module

    tokenize_module.add_arguments(sub.add_parser(
        "tokenize", help="text to a token file (.npy) with your Hugging Face tokenizer, for offload.data"))
    args = parser.parse_args(argv)
    if args.command == "tokenize":
        return tokenize_module.run(args)
    if args.command == "demo":
        return demo_module.run(args)
    if args.command == "estimate":
        return estimate_module.run(args)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "doctor":
        from offload.cli import doctor as doctor_module

        return doctor_module.main(args.dir)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
