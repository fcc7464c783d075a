"""Async file I/O: round trips on every engine, odd sizes and offsets, deep queues, and every failure
(ENOSPC, truncated, missing, read-only, bad tensors) as a typed exception naming path, offset, size, errno."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import warnings

import pytest
import torch

from offload import _native
from offload.errors import OffloadConfigError, OffloadIOError
from offload.io import AsyncIO, IOBackend, IOFuture, choose_backend, parse_backend
from offload.io import probe as probe_module

ALIGN = 4096
NATIVE = ["io_uring", "aio", "threads"]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(tmp_path_factory):
    """Keep measured backend choices out of the real ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def aligned(nbytes: int, dtype: torch.dtype = torch.uint8, shift: int = 0) -> torch.Tensor:
    """A tensor of nbytes whose data starts `shift` bytes past a 4096 boundary."""
    raw = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN + shift
    return raw[start : start + nbytes].view(dtype)


def random_bytes(nbytes: int, shift: int = 0) -> torch.Tensor:
    t = aligned(nbytes, shift=shift)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return t


def engine_usable(name: str) -> bool:
    if name == "aiofiles":
        return True
    if _native._C is None:
        return False
    try:
        _native._C.IoEngine(name, 2, 1).close()
        return True
    except OSError:
        return False


@pytest.fixture(params=NATIVE + ["aiofiles"])
def backend(request) -> str:
    if not engine_usable(request.param):
        pytest.skip(f"{request.param} is not available here (native core missing or refused by the kernel)")
    return request.param


@contextlib.contextmanager
def tiny_tmpfs(path, options: str):
    """Mount a tmpfs with `options` at path, or skip the test when mounting is not permitted."""
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- round trips ---------------------------------------------------------------------------------------
SIZES = [1, 4095, 4096, 4097, 3 * ALIGN + 5, (1 << 20) + 123]
OFFSETS = [0, 1, 4096, 8191]


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
def test_round_trip_odd_sizes_and_offsets(backend, direct, tmp_path):
    with AsyncIO(backend, chunk_bytes=16 * ALIGN) as aio:
        swap = aio.open(tmp_path / "swap.bin", size=4 << 20, direct=direct)
        assert aio.backend is parse_backend(backend)
        for size in SIZES:
            for offset in OFFSETS:
                for shift in (0, 3):  # aligned buffer, and one that forces the buffered path
                    data = random_bytes(size, shift)
                    assert aio.pwrite(data, swap, offset).result() == size
                    back = aligned(size, shift=shift).zero_()
                    assert aio.pread(back, swap, offset).result() == size
                    assert torch.equal(back, data), (size, offset, shift)


def test_direct_used_where_supported(tmp_path):
    with AsyncIO("threads") as aio:
        swap = aio.open(tmp_path / "d.bin", size=1 << 20)
        fs = probe_module.file_system_of(tmp_path)
        if fs.startswith(("ext4", "xfs", "btrfs")):
            assert swap.direct, fs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.float16])
def test_any_dtype(dtype, tmp_path):
    with AsyncIO("auto") as aio:
        x = aligned(1000 * torch.tensor([], dtype=dtype).element_size(), dtype)
        x.copy_(torch.randn(1000).to(dtype) if dtype.is_floating_point else torch.arange(1000))
        aio.pwrite(x, tmp_path / "t.bin", 0).result()
        y = torch.empty_like(x)
        aio.pread(y, tmp_path / "t.bin", 0).result()
        assert torch.equal(x, y)


def test_many_requests_in_flight(backend, tmp_path):
    count, size = 96, 64 * 1024 + 17
    with AsyncIO(backend, queue_depth=8, chunk_bytes=4 * ALIGN) as aio:
        swap = aio.open(tmp_path / "many.bin", size=count * 128 * 1024)
        blocks = [random_bytes(size) for _ in range(count)]
        writes = [aio.pwrite(b, swap, i * 128 * 1024) for i, b in enumerate(blocks)]
        assert [w.result() for w in writes] == [size] * count
        backs = [aligned(size).zero_() for _ in range(count)]
        reads = [aio.pread(b, swap, i * 128 * 1024) for i, b in enumerate(backs)]
        for r in reads:
            r.result(timeout=60)
        assert all(torch.equal(a, b) for a, b in zip(blocks, backs))


def test_request_larger_than_chunk_is_split(backend, tmp_path):
    size = 5 * (1 << 20) + 4096 * 3 + 11
    with AsyncIO(backend, chunk_bytes=64 * 1024) as aio:
        data = random_bytes(size)
        aio.pwrite(data, tmp_path / "big.bin", 4096).result()
        back = aligned(size).zero_()
        aio.pread(back, tmp_path / "big.bin", 4096).result()
        assert torch.equal(back, data)
        assert os.path.getsize(tmp_path / "big.bin") == 4096 + size


def test_zero_bytes_is_done_at_once(tmp_path):
    with AsyncIO("threads") as aio:
        future = aio.pwrite(torch.empty(0), tmp_path / "z.bin", 0)
        assert future.done() and future.result() == 0


def test_close_waits_for_in_flight_requests(tmp_path):
    aio = AsyncIO("threads", chunk_bytes=ALIGN)
    futures = [aio.pwrite(random_bytes(256 * 1024), tmp_path / "c.bin", i * 256 * 1024) for i in range(16)]
    aio.close()
    assert all(f.done() for f in futures)
    assert os.path.getsize(tmp_path / "c.bin") == 16 * 256 * 1024
    with pytest.raises(OffloadConfigError, match="closed"):
        aio.pwrite(random_bytes(10), tmp_path / "c.bin", 0)


def test_fsync_and_reopen_without_create(tmp_path):
    data = random_bytes(12345)
    with AsyncIO("auto") as aio:
        swap = aio.open(tmp_path / "s.bin", size=1 << 16)
        aio.pwrite(data, swap, 100).result()
        swap.fsync()
    with AsyncIO("auto") as aio:
        swap = aio.open(tmp_path / "s.bin", create=False)
        assert swap.size == 1 << 16
        back = aligned(12345).zero_()
        aio.pread(back, swap, 100).result()
        assert torch.equal(back, data)


# -- tmpfs and O_DIRECT fallback ----------------------------------------------------------------------
def test_tmpfs_round_trip():
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm (tmpfs) is not available here")
    path = f"/dev/shm/offload-test-{os.getpid()}.bin"
    try:
        with AsyncIO("auto") as aio:
            data = random_bytes(100_003, shift=5)
            aio.pwrite(data, path, 7).result()
            back = aligned(100_003).zero_()
            aio.pread(back, path, 7).result()
            assert torch.equal(back, data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_no_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch):
    """Like tmpfs before Linux 6.6, overlayfs or NFS: open(O_DIRECT) fails with EINVAL."""
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    with AsyncIO("threads") as aio:
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT") as caught:
            first = aio.open(tmp_path / "a.bin", size=1 << 16)
            second = aio.open(tmp_path / "b.bin", size=1 << 16)
        assert len([w for w in caught if "O_DIRECT" in str(w.message)]) == 1
        assert not first.direct and not second.direct
        data = random_bytes(5000)
        aio.pwrite(data, first, 4096).result()
        back = aligned(5000).zero_()
        aio.pread(back, first, 4096).result()
        assert torch.equal(back, data)
        with pytest.raises(OffloadConfigError, match="refuses O_DIRECT"):
            aio.open(tmp_path / "c.bin", direct=True)


# -- failures ------------------------------------------------------------------------------------------
def test_enospc_at_preallocation_names_needed_and_free(tmp_path):
    with tiny_tmpfs(tmp_path / "tiny", "size=1M") as tiny:
        with AsyncIO("threads") as aio:
            with pytest.raises(OffloadIOError, match=r"need \d+ more bytes, \d+ free") as info:
                aio.open(tiny / "swap.bin", size=8 << 20)
            assert info.value.errno == errno.ENOSPC
            assert info.value.size == 8 << 20 and "swap.bin" in str(info.value)
            assert os.path.getsize(tiny / "swap.bin") == 0  # the partial reservation was undone


def test_enospc_during_write_raises_not_aborts(backend, tmp_path):
    with tiny_tmpfs(tmp_path / "tiny", "size=1M") as tiny:
        with AsyncIO(backend, chunk_bytes=64 * 1024) as aio:
            future = aio.pwrite(random_bytes(4 << 20), tiny / "full.bin", 0)
            with pytest.raises(OffloadIOError) as info:
                future.result(timeout=60)
            assert info.value.errno == errno.ENOSPC
            assert info.value.offset == 0 and info.value.size == 4 << 20
            assert "full.bin" in str(info.value) and "ENOSPC" in str(info.value)


def test_truncated_file_is_a_short_read(backend, tmp_path):
    path = tmp_path / "trunc.bin"
    with AsyncIO(backend) as aio:
        aio.pwrite(random_bytes(64 * 1024), path, 0).result()
        os.truncate(path, 10_000)
        back = aligned(64 * 1024).fill_(7)
        with pytest.raises(OffloadIOError, match="short read") as info:
            aio.pread(back, path, 0).result()
        assert info.value.errno == errno.ENODATA
        assert (info.value.path, info.value.offset, info.value.size) == (str(path), 0, 64 * 1024)


def test_missing_file_on_read(tmp_path):
    with AsyncIO("auto") as aio:
        with pytest.raises(OffloadIOError, match="does not exist") as info:
            aio.pread(aligned(100), tmp_path / "nope.bin", 0)
        assert info.value.errno == errno.ENOENT
        assert not (tmp_path / "nope.bin").exists()


def test_missing_directory_on_write(tmp_path):
    with AsyncIO("auto") as aio:
        with pytest.raises(OffloadIOError) as info:
            aio.pwrite(aligned(100), tmp_path / "no" / "dir" / "x.bin", 0)
        assert info.value.errno == errno.ENOENT and "x.bin" in str(info.value)


def test_read_only_file_system(tmp_path):
    with tiny_tmpfs(tmp_path / "ro", "size=1M,ro") as ro:
        with AsyncIO("auto") as aio:
            with pytest.raises(OffloadIOError, match="read-only") as info:
                aio.open(ro / "swap.bin", size=4096)
            assert info.value.errno in (errno.EROFS, errno.EACCES)


def test_bad_tensors_are_config_errors(tmp_path):
    with AsyncIO("threads") as aio:
        with pytest.raises(OffloadConfigError, match="contiguous"):
            aio.pwrite(torch.zeros(8, 8).t(), tmp_path / "x.bin", 0)
        with pytest.raises(OffloadConfigError, match="torch.Tensor"):
            aio.pwrite(b"bytes", tmp_path / "x.bin", 0)
        with pytest.raises(OffloadConfigError, match="offset"):
            aio.pwrite(torch.zeros(8), tmp_path / "x.bin", -1)


def test_bad_options_are_config_errors():
    with pytest.raises(OffloadConfigError, match="backend"):
        AsyncIO("libaio")
    with pytest.raises(OffloadConfigError, match="chunk_bytes"):
        AsyncIO("threads", chunk_bytes=1000)
    with pytest.raises(OffloadConfigError, match="queue_depth"):
        AsyncIO("threads", queue_depth=0)


def test_result_timeout_is_an_io_error():
    class NeverDone:
        def done(self):
            return False

        def wait(self, timeout_s):
            return False

    future = IOFuture(NeverDone(), None, "/x", 4096, 10, "pread")
    with pytest.raises(OffloadIOError, match="not finished") as info:
        future.result(timeout=0.01)
    assert info.value.errno == errno.ETIMEDOUT and not future.done()


# -- backend choice ------------------------------------------------------------------------------------
def test_parse_backend():
    assert parse_backend("auto") is None
    assert parse_backend("aio") is IOBackend.KERNEL_AIO
    assert parse_backend("IO_URING") is IOBackend.IO_URING
    assert parse_backend(IOBackend.THREADS) is IOBackend.THREADS


def test_choose_backend_measures_once_then_caches(tmp_path):
    if _native._C is None:
        pytest.skip("native core not built")
    backend, reason = choose_backend(tmp_path)
    assert backend.native and "measured" in reason
    again, why = choose_backend(tmp_path)
    assert again is backend and why.startswith("cached")
    assert probe_module.cache_path().exists()
    assert not any(p.name.startswith(".offload-probe") for p in tmp_path.iterdir())


def test_aiofiles_when_native_core_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(_native, "_C", None)
    assert choose_backend(tmp_path)[0] is IOBackend.AIOFILES
    with AsyncIO("auto") as aio:
        data = random_bytes(10_000)
        aio.pwrite(data, tmp_path / "py.bin", 3).result()
        back = aligned(10_000).zero_()
        aio.pread(back, tmp_path / "py.bin", 3).result()
        assert aio.backend is IOBackend.AIOFILES and torch.equal(back, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AsyncIO("io_uring") as aio:
            assert aio.backend is IOBackend.AIOFILES
    assert any("native core" in str(w.message) for w in caught)


def test_a_small_file_system_is_measured_with_a_smaller_probe_not_refused(tmp_path, monkeypatch):
    """A 16 MiB file system with room for a 3 MiB swap file: the 32 MiB probe would not fit."""
    if _native._C is None:
        pytest.skip("native core not built")
    cache = probe_module.cache_path()
    saved = cache.read_bytes() if cache.exists() else None
    cache.unlink(missing_ok=True)  # the choice is cached per device: measure here, and put it back after
    try:
        _small_file_system(tmp_path, monkeypatch)
    finally:
        cache.unlink(missing_ok=True)
        if saved is not None:
            cache.write_bytes(saved)


def _small_file_system(tmp_path, monkeypatch):
    real = probe_module.shutil.disk_usage
    monkeypatch.setattr(probe_module.shutil, "disk_usage", lambda p: real(p)._replace(free=14 << 20))
    assert probe_module.probe_bytes(str(tmp_path)) == 3 << 20
    backend, reason = choose_backend(tmp_path)
    assert backend.native and "write+read 3 MiB" in reason
    (tmp_path / "tiny").mkdir()
    probe_module.cache_path().unlink()  # measure again
    monkeypatch.setattr(probe_module.shutil, "disk_usage", lambda p: real(p)._replace(free=3 << 20))
    backend, reason = choose_backend(tmp_path / "tiny")
    assert backend.native and "not measured" in reason
