"""Clipping's norms of half-precision gradients are torch's own, bit for bit (optim/functional.py, TorchNorm): read
in place by the native core in torch's order where the probe found it, else through a kept fp32 buffer."""

import threading

import pytest
import torch

from offload import _native
from offload.optim import functional
from offload.optim.functional import TorchNorm, torch_norm_order

native = pytest.mark.skipif(_native._C is None, reason="needs the native core (offload._C)")
CODES = {torch.bfloat16: 1, torch.float16: 2}


def torchs(piece):
    return float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))


def available_isas():
    isas = ["scalar"]
    for isa in ("avx2", "avx512"):
        try:
            _native._C.torch_order_norm(0, 1, 0, 8, False, isa)
            isas.append(isa)
        except ValueError:
            pass
    return isas


@native
def test_this_torch_reduces_in_an_order_the_native_core_follows():
    """The torch CI installs: if a torch release changes its order, this fails, and norms go the slow way."""
    assert torch_norm_order() is not None


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_isa_gives_torchs_bits_in_place(dtype):
    order = torch_norm_order()
    if order is None:
        pytest.skip("this torch reduces in an order the native core does not follow")
    gen = torch.Generator().manual_seed(1)
    lengths = [4096, 4097, 4105, 4111, 1_000_003, 20_000_011]  # IN_PLACE_NORM_MIN on: shorter ones go to torch
    for isa in available_isas():
        for n in lengths:
            for scale in (3.0, 1e-3, 2.0**-70, 2.0**-74) if dtype == torch.bfloat16 else (3.0, 1e-3, 1e-5):
                piece = (torch.randn(n, generator=gen) * scale).to(dtype)
                got = _native._C.torch_order_norm(piece.data_ptr(), CODES[dtype], n, *order, isa)
                assert got == torchs(piece), (isa, n, scale)


@native
def test_the_probe_refuses_an_order_it_cannot_follow(monkeypatch):
    """A torch that reduced otherwise (here: in fp64) is not followed: every norm then converts to fp32."""
    monkeypatch.setattr(torch.linalg, "vector_norm",
                        lambda x, ord=2: torch.sqrt(x.double().square().sum()).float())
    assert torch_norm_order.__wrapped__() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [True, False])
def test_the_norm_is_torchs_bit_for_bit_either_way(dtype, in_place, monkeypatch):
    if not in_place:
        monkeypatch.setattr(functional, "torch_norm_order", lambda: None)
    elif torch_norm_order() is None:
        pytest.skip("no native core, or a torch whose order it does not follow")
    norms = TorchNorm()
    gen = torch.Generator().manual_seed(0)
    for n in [1, 7, 1000, 1_000_003, 300, 4_000_001, 65, 5000]:  # the buffer grows, then serves smaller ones
        for scale in (3.0, 2.0**-74):  # bf16 squares underflowing fp32; a lone element's norm is |x| in torch
            piece = (torch.randn(n, generator=gen) * scale).to(dtype)
            assert norms.norm(piece) == torchs(piece), (n, scale)
    assert (norms._buffer is None) == in_place  # in place: no fp32 copy at all


def test_fp32_gradients_are_torchs_norm():
    piece = torch.randn(100_003, generator=torch.Generator().manual_seed(2))
    assert TorchNorm().norm(piece) == float(torch.linalg.vector_norm(piece, 2))


def test_a_second_thread_meanwhile_converts_as_torch_does(monkeypatch):
    monkeypatch.setattr(functional, "torch_norm_order", lambda: None)
    norms = TorchNorm()
    piece = torch.randn(10_000).to(torch.bfloat16)
    got = []
    with norms._lock:  # the buffer is busy on another thread
        worker = threading.Thread(target=lambda: got.append(norms.norm(piece)))
        worker.start()
        worker.join(timeout=30)
    assert got == [torchs(piece)]


def test_the_engine_frees_its_buffer_at_close(monkeypatch):
    """One buffer per engine, shared by its gradient homes and freed at close (not a process-wide one)."""
    import offload
    from tests.models import TinyGPT, make_batches

    monkeypatch.setattr(functional, "torch_norm_order", lambda: None)
    torch.manual_seed(0)
    engine = offload.wrap(TinyGPT(), tier="cpu", device="cpu", dtype=torch.bfloat16, max_grad_norm=1.0)
    idx, tgt = make_batches(1, 1, seed=0)[0][0]
    engine(idx, tgt).backward()
    engine.step()
    norms = engine._pipeline._tiers.torch_norm  # the engine's own
    assert norms._buffer is not None and norms._buffer.dtype == torch.float32
    engine.close()
    assert norms._buffer is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a gradient kept on the gpu tier)")
def test_a_device_gradient_is_never_read_in_place():
    piece = torch.randn(100_003, device="cuda").to(torch.bfloat16)
    assert TorchNorm().norm(piece) == torchs(piece.cpu())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_groups_norms_over_several_threads_are_each_torchs(threads):
    """`TorchNorm.norms`: the in-place pieces spread over the threads (each whole on one), the others (short, fp32,
    strided) as `norm` takes them, every value torch's bits and in the pieces' order."""
    gen = torch.Generator().manual_seed(2)
    flat = (torch.randn(3_000_000, generator=gen) * 1e-3).to(torch.bfloat16)
    pieces = [flat[:5], flat[5:1_200_005], flat[1_200_005:1_204_101], flat[1_204_101:2_904_101],
              torch.randn(7000, generator=gen), (torch.randn(9000, generator=gen)).to(torch.float16),
              flat[2_904_101:][::2], flat[2_904_101:2_904_101]]
    got = TorchNorm().norms(pieces, threads)
    assert got == [torchs(piece) for piece in pieces]
