"""The `python -m offload <command>` tools: doctor (what is active here and why), estimate (memory per tier
before wrapping), demo (a short nvme-tier run against the measured bound), verify (parity with PyTorch).

Each module has `add_arguments(parser)` and `run(args)`; `offload/__main__.py` dispatches to them. They use
the library's public surface only, so nothing in the engine depends on them.
"""
