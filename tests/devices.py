"""The compute device of the engine tests that take one: `OFFLOAD_TEST_DEVICE` (default "cpu").

`benchmarks/gpu_check.sh` runs a chosen set of engine tests with `OFFLOAD_TEST_DEVICE=cuda` (docs/benchmarks.md,
"GPU check"). On CUDA those tests compare runs bit for bit, so attention runs on the math kernel and torch picks
deterministic kernels where it has them (a warning names any op that has none).
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("OFFLOAD_TEST_DEVICE", "cpu")

if DEVICE.startswith("cuda"):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def on_device(*tensors: torch.Tensor):
    """The tensors moved to DEVICE (a tuple, in order)."""
    return tuple(t.to(DEVICE) for t in tensors)
