"""The norms of half-precision gradients through a kept fp32 buffer are torch's own (grad_home.Fp32Scratch)."""

import threading

import pytest
import torch

from offload.scheduler.records.grad_home import Fp32Scratch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_norm_through_the_kept_buffer_is_torchs_bit_for_bit(dtype):
    scratch = Fp32Scratch()
    gen = torch.Generator().manual_seed(0)
    for n in [1, 7, 1000, 1_000_003, 300, 4_000_001, 65]:  # the buffer grows, then serves smaller ones
        piece = (torch.randn(n, generator=gen) * 3).to(dtype)
        assert scratch.norm(piece) == float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32)), n


def test_a_second_thread_meanwhile_converts_as_torch_does():
    scratch = Fp32Scratch()
    piece = torch.randn(10_000).to(torch.bfloat16)
    want = float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))
    got = []
    with scratch._lock:  # the buffer is busy on another thread
        worker = threading.Thread(target=lambda: got.append(scratch.norm(piece)))
        worker.start()
        worker.join(timeout=30)
    assert got == [want]
