"""The norms of half-precision gradients through a kept fp32 buffer are torch's own (optim/functional.py, Fp32Scratch)."""

import threading

import pytest
import torch

from offload.optim.functional import Fp32Scratch


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


def test_the_engine_frees_its_buffer_at_close(tmp_path):
    """One buffer per engine, shared by its gradient homes and freed at close (not a process-wide one)."""
    import offload
    from tests.models import TinyGPT, make_batches

    torch.manual_seed(0)
    engine = offload.wrap(TinyGPT(), tier="cpu", device="cpu", dtype=torch.bfloat16, max_grad_norm=1.0)
    idx, tgt = make_batches(1, 1, seed=0)[0][0]
    engine(idx, tgt).backward()
    engine.step()
    scratch = engine._pipeline._tiers.norm_scratch  # the engine's own
    assert scratch._buffer is not None and scratch._buffer.dtype == torch.float32
    engine.close()
    assert scratch._buffer is None
