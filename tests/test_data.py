"""offload.data: both readers give the same windows, streams resume exactly, bad input is refused with the fix."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import offload
from offload.data import TokenWindows, open_token_files, write_tokens
from offload.data.dali_reader import dali_available
from offload.errors import OffloadConfigError, OffloadIntegrityError
from tests.models import TinyGPT

needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed (pip install nvidia-dali-cuda130)")
BACKENDS = ["numpy", pytest.param("dali", marks=needs_dali)]


@pytest.fixture
def corpus(tmp_path):
    """A directory of three shards of unequal length (uint16), each token its global position mod 60000."""
    directory = tmp_path / "shards"
    directory.mkdir()
    start = 0
    for i, n in enumerate((5000, 700, 20000)):
        write_tokens(directory / f"part-{i}.npy", (np.arange(start, start + n) % 60000))
        start += n
    return directory


def _take(windows: TokenWindows, n: int):
    return [b.clone() for b in itertools.islice(windows, n)]


@needs_dali
@pytest.mark.parametrize("which", ["directory", "one file", "int32"])
def test_dali_and_numpy_read_identical_windows(corpus, tmp_path, which):
    path = corpus
    if which == "one file":
        path = corpus / "part-2.npy"
    elif which == "int32":
        path = tmp_path / "big-ids.npy"
        write_tokens(path, np.arange(30000) * 3 + 70000)  # ids beyond uint16
    with TokenWindows(path, 31, 5, seed=7, backend="numpy") as a, TokenWindows(path, 31, 5, seed=7, backend="dali") as b:
        assert b.backend.value == "dali"
        for x, y in zip(_take(a, 12), _take(b, 12)):
            assert x.dtype == y.dtype == torch.int64 and x.shape == (5, 32)
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_are_consecutive_tokens_of_the_files(corpus, backend):
    files = open_token_files(corpus, 17)
    whole = np.concatenate([np.load(s.path) for s in files.shards]).astype(np.int64)
    seen_shards = set()
    with TokenWindows(corpus, 16, 8, seed=1, backend=backend) as windows:
        for batch in _take(windows, 40):
            for row in batch.numpy():
                # tokens count up by one within a window: it never crosses a shard's end
                assert (np.diff(row) == 1).all()
                start = int(row[0])
                assert np.array_equal(whole[start:start + 17] % 60000, row)
                seen_shards.add(0 if start < 5000 else 1 if start < 5700 else 2)
    assert seen_shards == {0, 1, 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_continues_the_same_stream(corpus, backend):
    with TokenWindows(corpus, 24, 4, seed=3, backend=backend) as first:
        stream = _take(first, 10)
    with TokenWindows(corpus, 24, 4, seed=3, backend=backend) as partial:
        _take(partial, 6)
        state = partial.state_dict()
    with TokenWindows(corpus, 24, 4, seed=3, backend=backend) as resumed:
        resumed.load_state_dict(state)
        assert resumed.batches == 6
        for x, y in zip(_take(resumed, 4), stream[6:]):
            assert torch.equal(x, y)


def test_seeds_and_ranks_draw_different_windows(corpus):
    def first(**kw):
        with TokenWindows(corpus, 16, 8, backend="numpy", **kw) as w:
            return next(w)
    assert torch.equal(first(seed=0), first(seed=0, rank=0))
    assert not torch.equal(first(seed=0), first(seed=1))
    assert not torch.equal(first(seed=0, rank=0), first(seed=0, rank=1))


def test_state_of_other_windows_is_refused(corpus, tmp_path):
    with TokenWindows(corpus, 16, 8, seed=0, backend="numpy") as w:
        state = w.state_dict()
    with TokenWindows(corpus, 16, 4, seed=0, backend="numpy") as other:
        with pytest.raises(OffloadConfigError, match="batch_size"):
            other.load_state_dict(state)
    write_tokens(tmp_path / "other.npy", np.arange(9000))
    with TokenWindows(tmp_path / "other.npy", 16, 8, seed=0, backend="numpy") as other:
        with pytest.raises(OffloadConfigError, match="same files"):
            other.load_state_dict(state)
        assert other.batches == 0


def test_bad_input_is_refused_with_the_fix(tmp_path):
    with pytest.raises(OffloadConfigError, match="does not exist.*tokenize"):
        TokenWindows(tmp_path / "missing.npy", 16, 2)
    np.save(tmp_path / "floats.npy", np.zeros(100, np.float32))
    with pytest.raises(OffloadConfigError, match="dtype float32.*uint16 or int32"):
        TokenWindows(tmp_path / "floats.npy", 16, 2)
    np.save(tmp_path / "int64.npy", np.zeros(100, np.int64))
    with pytest.raises(OffloadConfigError, match="dtype int64"):
        TokenWindows(tmp_path / "int64.npy", 16, 2)
    np.save(tmp_path / "matrix.npy", np.zeros((10, 10), np.uint16))
    with pytest.raises(OffloadConfigError, match="1-D"):
        TokenWindows(tmp_path / "matrix.npy", 4, 2)
    write_tokens(tmp_path / "short.npy", np.arange(50))
    with pytest.raises(OffloadConfigError, match="50 tokens, fewer than one window of seq_len \\+ 1 = 65"):
        TokenWindows(tmp_path / "short.npy", 64, 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(OffloadConfigError, match="holds no .npy files"):
        TokenWindows(tmp_path / "empty", 16, 2)
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(OffloadConfigError, match="not a .npy file"):
        TokenWindows(tmp_path / "text.txt", 16, 2)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_tokens(mixed / "a.npy", np.arange(100))
    write_tokens(mixed / "b.npy", np.arange(100) + 70000)
    with pytest.raises(OffloadConfigError, match="mix dtypes"):
        TokenWindows(mixed, 16, 2)
    with pytest.raises(OffloadConfigError, match="backend='torch'"):
        TokenWindows(tmp_path / "short.npy", 16, 2, backend="torch")
    with pytest.raises(OffloadConfigError, match="seq_len >= 1"):
        TokenWindows(tmp_path / "short.npy", 0, 2)


REWRITE_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np, pytest
    from offload.data import TokenWindows, write_tokens
    from offload.errors import OffloadIntegrityError

    path, how = sys.argv[1], sys.argv[2]
    write_tokens(path, np.arange(1 << 20) % 60000)  # 2 MiB, 512 pages
    with TokenWindows(path, 255, 8, seed=0, backend="numpy", prefetch=1) as windows:
        first = next(windows)
        if how == "rename":  # the right way: the reader keeps the file it opened
            write_tokens(path + ".new.npy", np.zeros(1 << 20, np.int64))
            os.replace(path + ".new.npy", path)
            for _ in range(20):
                steps = np.diff(next(windows).numpy(), axis=1)
                assert ((steps == 1) | (steps == 1 - 60000)).all(), "read the new file's zeros"
        else:
            # np.save truncates the file, then writes it again: pages beyond the new end are gone
            np.save(path, np.arange(100, dtype=np.uint16) if how == "shorter" else np.zeros(1 << 20, np.uint16))
            with pytest.raises(OffloadIntegrityError, match=(
                    f"token file '{path}' changed while TokenWindows read it.*do not rewrite a token file "
                    "while it is read; write a new file and rename it into place")):
                for _ in range(20):
                    next(windows)
    print("ok")
""")


@pytest.mark.parametrize("how", ["shorter", "same size", "rename"])
def test_a_token_file_rewritten_while_read_is_an_error_not_a_crash(tmp_path, how):
    """np.save over a mapped token file used to kill the process with SIGBUS (no Python error): run in a
    child so that a crash fails the test instead of killing pytest."""
    child = subprocess.run([sys.executable, "-c", REWRITE_CHILD, str(tmp_path / "tokens.npy"), how],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "ok"


def test_windows_refuse_a_file_replaced_after_they_were_built(corpus):
    """The shards' lengths were checked at construction; a file swapped before the reader opens it is named."""
    with TokenWindows(corpus, 16, 4, seed=0, backend="numpy") as windows:
        write_tokens(corpus / "part-1.npy", np.arange(300))
        with pytest.raises(OffloadIntegrityError, match="part-1.npy' changed after TokenWindows checked it: it "
                                                        "holds 300 uint16 tokens, not the 700.*build TokenWindows again"):
            next(windows)


@pytest.mark.skipif(dali_available(), reason="checks the message shown when DALI is missing")
def test_dali_backend_without_dali_names_the_install(corpus):
    with pytest.raises(OffloadConfigError, match="pip install nvidia-dali"):
        TokenWindows(corpus, 16, 2, backend="dali")


def test_write_tokens_picks_the_smallest_dtype(tmp_path):
    assert np.load(write_tokens(tmp_path / "a.npy", np.array([0, 65535]))).dtype == np.uint16
    assert np.load(write_tokens(tmp_path / "b.npy", np.array([0, 65536]))).dtype == np.int32
    with pytest.raises(OffloadConfigError, match="token ids"):
        write_tokens(tmp_path / "c.npy", np.array([-1, 3]))


def test_write_tokens_writes_integer_ids_exactly(tmp_path):
    for ids in ([5, 0, 7], np.array([5, 0, 7], np.int8), np.array([5, 0, 7], np.uint64), torch.tensor([5, 0, 7])):
        assert np.load(write_tokens(tmp_path / "a.npy", ids)).tolist() == [5, 0, 7]
    assert np.load(write_tokens(tmp_path / "big.npy", [2**31 - 1, 0])).tolist() == [2**31 - 1, 0]
    assert np.load(write_tokens(tmp_path / "empty.npy", [])).size == 0


@pytest.mark.parametrize("ids, message", [
    (np.array([1.7, 2.2, 3.9]), r"dtype float64.*not integers.*np.rint\(tokens\).astype\(np.int64\)"),
    (np.array([1.0, 2.0], np.float32), r"dtype float32.*not integers"),  # whole-valued floats too: say so
    (torch.tensor([1.0, 2.0]), r"dtype float32.*not integers"),
    (np.array([True, False]), r"dtype bool.*not integers"),
    (np.array(["1", "2"]), r"dtype <U1.*not integers"),
    (np.array([3, -100, 5]), r"negative id -100 at index 1.*padding or ignore_index"),
    (np.array([3, 2**31]), r"id 2147483648 at index 1.*int32.*2147483647"),
    (np.array([2**63], np.uint64), r"id 9223372036854775808 at index 0.*int32"),
])
def test_write_tokens_refuses_what_is_not_a_token_id(tmp_path, ids, message):
    with pytest.raises(OffloadConfigError, match=message):
        write_tokens(tmp_path / "bad.npy", ids)
    assert not os.listdir(tmp_path)  # nothing written, not even a temporary file


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_arrive_on_the_cuda_device(corpus, backend):
    with TokenWindows(corpus, 16, 4, seed=2, backend=backend, device="cuda") as on_gpu, \
            TokenWindows(corpus, 16, 4, seed=2, backend="numpy") as on_cpu:
        for x, y in zip(_take(on_gpu, 3), _take(on_cpu, 3)):
            assert x.device.type == "cuda"
            assert torch.equal(x.cpu(), y)


def _train(engine, windows, steps):
    losses = []
    for batch in itertools.islice(windows, steps):
        batch = batch % 64  # TinyGPT's vocabulary
        loss = engine(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def test_engine_checkpoint_carries_the_data_position(corpus, tmp_path):
    """Save after 3 steps with data=windows; a new engine and a new stream loaded from it train on the same
    batches as the run that went on, to the bit."""
    torch.manual_seed(0)
    start = TinyGPT(context=16)
    with offload.wrap(start, tier="cpu", device="cpu", lr=1e-2) as engine, \
            TokenWindows(corpus, 16, 4, seed=5, backend="numpy") as windows:
        _train(engine, windows, 3)
        engine.save(tmp_path / "ckpt", data=windows)
        went_on = _train(engine, windows, 3)
    assert os.path.exists(tmp_path / "ckpt" / "data.pt")
    torch.manual_seed(1)
    with offload.wrap(TinyGPT(context=16), tier="cpu", device="cpu", lr=1e-2) as engine, \
            TokenWindows(corpus, 16, 4, seed=5, backend="numpy") as windows:
        with pytest.raises(OffloadConfigError, match="saved without scheduler state"):
            engine.load(tmp_path / "ckpt", data=windows, scheduler=torch.optim.lr_scheduler.StepLR(engine.optimizer, 1))
        damaged = tmp_path / "damaged"
        shutil.copytree(tmp_path / "ckpt", damaged)
        with open(damaged / "model.safetensors", "r+b") as f:  # flip a byte of the weights
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        with pytest.raises(OffloadIntegrityError):
            engine.load(damaged, data=windows)
        assert windows.batches == 0  # a failed load leaves the stream where it was, like the engine
        manifest = engine.load(tmp_path / "ckpt", data=windows)
        assert manifest["data"] == "data.pt" and windows.batches == 3
        assert _train(engine, windows, 3) == went_on


def test_engine_refuses_a_data_object_without_state(tmp_path):
    with offload.wrap(TinyGPT(context=16), tier="cpu", device="cpu") as engine:
        with pytest.raises(OffloadConfigError, match="data=list has no state_dict"):
            engine.save(tmp_path / "ckpt", data=[1, 2])
    assert not os.path.exists(tmp_path / "ckpt")
