"""The CRC-32C of each piece a compressed-moment step, or the fp32 step (plain and resting), writes ([Note: step
CRCs] in offload/optim/moments.py): the kernel computes them in the same pass, and they must equal
offload.checksum.crc32c of the written bytes, on every kernel variant, odd sizes, several threads (each chunk's CRCs
joined with crc32c_combine), every grad and out dtype, blocks holding infinities and NaNs, slices as the swap file
seals them; and the step's results must not change."""

from __future__ import annotations

import math

import pytest
import torch

from offload import _native
from offload.checksum import crc32c
from offload.errors import OffloadConfigError
from offload.optim.functional import CRC_PIECES, adam_step_flat, adam_step_resting
from offload.optim.moment_format import INT8_BLOCK, QuantizedMoment, slice_moment, zeros_moment
from offload.optim.moments import adam_step_moments, encode_moment

needs_native = pytest.mark.skipif(_native._C is None, reason="offload._C is not built")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
FORMAT_CODES = {"bf16": 1, "int8": 2}


def _isas() -> list[str]:
    return list(_native._C.moment_isas()) if _native._C is not None else []


def _parts(m):
    return (m.codes, m.scales) if isinstance(m, QuantizedMoment) else (m, None)


def _clone(m):
    return QuantizedMoment(m.codes.clone(), m.scales.clone()) if isinstance(m, QuantizedMoment) else m.clone()


def _state(fmt, n, seed, specials=False):
    """p, m, v of n elements with a realistic state; `specials`: blocks with +-inf and NaN moments, subnormals."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    mag = torch.exp(torch.randn(n, generator=gen) * 2) * 1e-3
    m32 = torch.randn(n, generator=gen) * mag
    v32 = mag * mag * (1 + torch.rand(n, generator=gen))
    if specials and n > 3 * INT8_BLOCK:
        m32[5], m32[9], v32[7] = math.inf, -math.inf, math.inf
        m32[INT8_BLOCK + 1] = math.nan
        v32[2 * INT8_BLOCK + 3], p[3 * INT8_BLOCK - 1] = 1e-41, -3e-39
    m, v = zeros_moment(fmt, n), zeros_moment(fmt, n)
    encode_moment(m32, fmt, 1, m)
    encode_moment(v32, fmt, 2, v)
    return p, m, v


def _want(p, m, v, out):
    """crc32c of each piece, CRC_PIECES order, as the swap file seals them."""
    (mc, ms), (vc, vs) = _parts(m), _parts(v)
    return [0 if t is None else crc32c(t) for t in (p, mc, ms, vc, vs, out)]


def _native_step(isa, p, g, m, v, fmt, step, out, num_threads, crcs):
    (mc, ms), (vc, vs) = _parts(m), _parts(v)
    _native._C.adam_moments_step(
        p.data_ptr(), g.data_ptr(), DTYPE_CODES[g.dtype], mc.data_ptr(), 0 if ms is None else ms.data_ptr(),
        vc.data_ptr(), 0 if vs is None else vs.data_ptr(), FORMAT_CODES[fmt], p.numel(),
        0 if out is None else out.data_ptr(), 0 if out is None else DTYPE_CODES[out.dtype], step, HP["lr"],
        HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], True, 1.0, num_threads, None, isa,
        0 if crcs is None else crcs.data_ptr())


def _run(isa, fmt, n, *, seed=0, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_threads=1, steps=2,
         specials=False, with_crcs=True):
    p, m, v = _state(fmt, n, seed, specials)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32) if with_crcs else None
    got = []
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 1e-3).to(grad_dtype)
        if specials and n > 2 * INT8_BLOCK and step == 1:
            g[INT8_BLOCK + 7] = 1e21  # its square overflows: v = inf
        _native_step(isa, p, g, m, v, fmt, step, out, num_threads, crcs)
        if with_crcs:
            got.append((crcs.tolist(), _want(p, m, v, out)))
    return (p, *_parts(m), *_parts(v), out), got


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))  # bit for bit, NaNs included


@needs_native
def test_pieces_are_named_as_the_kernel_fills_them():
    assert tuple(_native._C.MOMENT_CRC_PIECES) == CRC_PIECES


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("n", [1, 17, 255, 256, 257, 1000, 4096 + 77, 3 * 4096 + 5 * INT8_BLOCK + 3])
def test_fused_crcs_are_the_crc32c_of_the_written_bytes(isa, fmt, n):
    results, crcs = _run(isa, fmt, n, seed=n)
    for got, want in crcs:
        assert got == want
    plain, _ = _run(isa, fmt, n, seed=n, with_crcs=False)
    _assert_same(results, plain)  # asking for the CRCs changes nothing the step writes


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_threads_join_their_chunks_crcs(isa, fmt, num_threads):
    n = (1 << 18) * 2 + 4 * INT8_BLOCK + 300  # over the threading threshold: 9 chunks, a partial block at the end
    results, crcs = _run(isa, fmt, n, num_threads=num_threads, steps=1)
    for got, want in crcs:
        assert got == want
    single, _ = _run(isa, fmt, n, num_threads=1, steps=1, with_crcs=False)
    _assert_same(results, single)


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype, out_dtype",
                         [(torch.float32, None), (torch.float16, torch.float16), (torch.float32, torch.float32),
                          (torch.bfloat16, torch.float32)])
def test_every_grad_and_out_dtype(isa, fmt, grad_dtype, out_dtype):
    _, crcs = _run(isa, fmt, 2 * 4096 + 333, grad_dtype=grad_dtype, out_dtype=out_dtype)
    for got, want in crcs:
        assert got == want
        if out_dtype is None:
            assert got[CRC_PIECES.index("out")] == 0


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("with_crcs", [True, False])
@pytest.mark.parametrize("grad_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, None),
                                                   (torch.float16, torch.float32)])
def test_every_variant_writes_the_scalar_kernels_bytes(fmt, with_crcs, grad_dtype, out_dtype):
    """p, codes, scales and out of every kernel variant are the scalar kernel's, bit for bit, on a realistic state over
    several steps: whole groups and blocks (the AVX-512 int8 step's crc32 chains), a partial block, a tail."""
    n = 9 * 4096 + 3 * INT8_BLOCK + 37
    runs = {isa: _run(isa, fmt, n, seed=4, steps=3, grad_dtype=grad_dtype, out_dtype=out_dtype,
                      with_crcs=with_crcs) for isa in _isas()}
    for isa, (results, crcs) in runs.items():
        _assert_same(results, runs["scalar"][0])
        for got, want in crcs:
            assert got == want, isa


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_blocks_with_infinities_and_nans(fmt):
    """The rare paths (a block's scale NaN or marking an infinity, a gradient whose square overflows, subnormals)
    write the same bytes on every variant, and their CRCs are those of the bytes."""
    n = 5 * INT8_BLOCK + 40
    runs = {isa: _run(isa, fmt, n, specials=True, steps=3) for isa in _isas()}
    for isa, (results, crcs) in runs.items():
        for got, want in crcs:
            assert got == want, isa
        _assert_same(results, runs["scalar"][0])
    if fmt == "int8":  # v's block 0 still holds an infinity (its scale marked), m's became NaN (inf - inf)
        scales_m, scales_v = runs["scalar"][0][2], runs["scalar"][0][4]
        assert torch.signbit(scales_v[0]) and torch.isnan(scales_m[0])


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_chunk_of_slices_is_sealed_as_the_swap_file_seals_it(fmt):
    """disk.py seals a chunk [start, stop) of a group as its master, each moment's codes and scales (slice_moment),
    and its compute weights: the step of that chunk gives those CRCs."""
    n = 6 * INT8_BLOCK + 77
    p, m, v = _state(fmt, n, 3)
    out = torch.empty(n, dtype=torch.bfloat16)
    g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    for start, stop in ((0, 2 * INT8_BLOCK), (2 * INT8_BLOCK, 5 * INT8_BLOCK), (5 * INT8_BLOCK, n)):
        crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32)
        ms, vs = slice_moment(m, fmt, start, stop), slice_moment(v, fmt, start, stop)
        adam_step_moments(p[start:stop], g[start:stop], ms, vs, fmt, step=2, out=out[start:stop], crcs=crcs,
                          num_threads=1, **HP)
        assert crcs.tolist() == _want(p[start:stop], ms, vs, out[start:stop])


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("native", [True, False])
def test_python_api_fills_crcs_on_every_path(fmt, native, monkeypatch):
    """adam_step_moments(crcs=...) on the native kernel, and read back after the step for fp32 moments and the torch
    fallback: the same values for the same bytes."""
    if native and _native._C is None:
        pytest.skip("offload._C is not built")
    if not native:
        monkeypatch.setattr(_native, "_C", None)
    n = 3 * INT8_BLOCK + 11
    p, m, v = _state(fmt, n, 5)
    out = torch.empty(n, dtype=torch.bfloat16)
    crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32)
    adam_step_moments(p, torch.randn(n) * 1e-3, m, v, fmt, step=1, out=out, crcs=crcs, **HP)
    assert crcs.tolist() == _want(p, m, v, out)
    if fmt != "int8":
        assert crcs[CRC_PIECES.index("exp_avg_scales")] == 0 and crcs[CRC_PIECES.index("exp_avg_sq_scales")] == 0


@pytest.mark.parametrize(
    "crcs, match",
    [
        (torch.zeros(6, dtype=torch.int64), "crcs has dtype"),
        (torch.zeros(5, dtype=torch.uint32), "crcs has 5 elements"),
        (torch.zeros(12, dtype=torch.uint32)[::2], "crcs is not contiguous"),
    ],
)
def test_bad_crcs_raise_config_error(crcs, match):
    n = 300
    m, v = zeros_moment("int8", n), zeros_moment("int8", n)
    with pytest.raises(OffloadConfigError, match=match):
        adam_step_moments(torch.zeros(n), torch.zeros(n), m, v, "int8", step=1, crcs=crcs, **HP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_refuses_crcs():
    n = 300
    m, v = zeros_moment("int8", n, "cuda"), zeros_moment("int8", n, "cuda")
    with pytest.raises(OffloadConfigError, match="host memory"):
        adam_step_moments(torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), m, v, "int8", step=1,
                          crcs=torch.zeros(6, dtype=torch.uint32), **HP)


@needs_native
def test_crc32c_combine():
    gen = torch.Generator().manual_seed(9)
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=gen)
    whole = crc32c(data)
    for cut in (0, 1, 7, 4096, 65_536, 100_002, 100_003):
        a, b = data[:cut], data[cut:]
        assert _native._C.crc32c_combine(crc32c(a), crc32c(b), b.numel()) == whole


def _flat_isas() -> list[str]:
    return [isa for isa in ("avx512", "avx2", "scalar") if _native._C is not None and _flat_runs(isa)]


def _flat_runs(isa: str) -> bool:
    try:
        _native._C.adam_step(0, 0, 0, 0, 0, 0, 0, 0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, 1, None, isa)
    except ValueError:
        return False
    return True


@needs_native
@pytest.mark.parametrize("resting", [False, True], ids=["plain", "resting"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, None], ids=["bf16-out", "fp32-out", "no-out"])
@pytest.mark.parametrize("n,num_threads", [(1, 1), (4097, 1), (300_001, 2)])
def test_the_fp32_step_checksums_what_it_writes(n, num_threads, out_dtype, resting):
    """The fp32 step's CRCs (every kernel the CPU runs; `out` then written plainly, not streamed) are crc32c of the
    pieces as written, 0 for the absent scales and out, and its results are bit for bit those of the step without."""
    gen = torch.Generator().manual_seed(n)
    p, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen) * 1e-6
    m, g = torch.randn(n, generator=gen) * 1e-3, (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    for isa in _flat_isas():
        runs = []
        for with_crcs in (True, False):
            state = [p.clone(), m.clone(), v.clone()]
            out = None if out_dtype is None else torch.empty(n + 1, dtype=out_dtype)[1:]  # off its vector alignment
            crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32) if with_crcs else None
            addr = 0 if crcs is None else crcs.data_ptr()
            args = (state[0].data_ptr(), g.data_ptr(), 1, state[1].data_ptr(), state[2].data_ptr(), n,
                    0 if out is None else out.data_ptr(), 0 if out is None else DTYPE_CODES[out.dtype], 3, 1e-3, 0.9,
                    0.999, 1e-8, 0.01)
            if resting:
                index, bits = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int16)
                _native._C.adam_step_resting(*args, index.data_ptr(), bits.data_ptr(), n, num_threads, None, isa, 0,
                                             addr)
            else:
                _native._C.adam_step(*args, True, 1.0, num_threads, None, isa, addr)
            if crcs is not None:
                assert crcs.tolist() == [crc32c(state[0]), crc32c(state[1]), 0, crc32c(state[2]), 0,
                                         0 if out is None else crc32c(out)], isa
            runs.append((*state, out))
        _assert_same(runs[0], runs[1])


@needs_native
def test_the_fp32_steps_take_crcs_from_python():
    """adam_step_flat and adam_step_resting fill `crcs` as the kernel does (and check it as the moment step does)."""
    n = 70_000
    p, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    for step_fn in ("flat", "resting"):
        state, out = [p.clone(), m.clone(), v.clone()], torch.empty(n, dtype=torch.bfloat16)
        crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32)
        hp = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, out=out, num_threads=2,
                  crcs=crcs)
        if step_fn == "flat":
            adam_step_flat(state[0], g, state[1], state[2], adamw=True, **hp)
        else:
            assert adam_step_resting(state[0], g, state[1], state[2], capacity=n, **hp) is not None
        assert crcs.tolist() == [crc32c(state[0]), crc32c(state[1]), 0, crc32c(state[2]), 0, crc32c(out)]
    with pytest.raises(OffloadConfigError, match="crcs has 3 elements"):
        adam_step_flat(p.clone(), g, m.clone(), v.clone(), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, adamw=True, crcs=torch.zeros(3, dtype=torch.uint32))
