"""`python -m offload <command>`: doctor (what is active and why), verify (parity with plain PyTorch)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="print which native parts, CPU features, I/O backend and limits are active")
    doctor.add_argument("--dir", default=None, help="directory to choose the I/O backend for (default: the temp dir)")
    verify = sub.add_parser("verify", help="train a few steps with and without offload; print the largest differences")
    from offload.verify_cli import add_arguments, run as run_verify

    add_arguments(verify)
    args = parser.parse_args(argv)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "doctor":
        from offload import doctor as doctor_module

        return doctor_module.main(args.dir)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
