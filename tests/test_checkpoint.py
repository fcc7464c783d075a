"""Checkpoints: exact resume in a new process for every tier, loading across tiers, files other tools read,
atomic replacement under SIGKILL, and damaged files found by size checks and checksums."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import offload
from offload.checkpoint import reflink
from offload.checkpoint.reader import master_weights
from offload.errors import OffloadIntegrityError
from tests.checkpoint_child import BATCHES, make_engine, train
from tests.models import TinyGPT, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = ("gpu", "cpu", "nvme")
K, M = 2, 3  # steps before the save, steps after


def _child(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tests.checkpoint_child", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("tier", TIERS)
def test_resume_in_a_new_process_is_bit_identical(tier, tmp_path):
    engine, scheduler = make_engine(tier, str(tmp_path))
    with engine:
        train(engine, scheduler, range(K))
        engine.save(tmp_path / "ckpt", scheduler=scheduler, rng=True)
        losses = train(engine, scheduler, range(K, K + M))
        weights = engine.state_dict()
        lr = engine.optimizer.param_groups[0]["lr"]
    result = _child("resume", tmp_path, tier, M)
    assert result.returncode == 0, result.stderr
    resumed = torch.load(tmp_path / f"resumed-{tier}.pt", weights_only=True)
    assert resumed["losses"] == losses  # bit-identical, not close
    assert resumed["lr"] == lr
    assert weights.keys() == resumed["weights"].keys()
    assert all(torch.equal(weights[k], resumed["weights"][k]) for k in weights)


@pytest.mark.parametrize("saved,loaded", [("gpu", "nvme"), ("nvme", "cpu"), ("cpu", "gpu"), ("nvme", "gpu")])
def test_load_into_another_tier(saved, loaded, tmp_path):
    engine, scheduler = make_engine(saved, str(tmp_path))
    with engine:
        train(engine, scheduler, range(K))
        engine.save(tmp_path / "ckpt", scheduler=scheduler, rng=True)
        state = torch.random.get_rng_state()
        losses = train(engine, scheduler, range(K, K + M))
        weights = engine.state_dict()
    torch.random.set_rng_state(state)
    other, other_scheduler = make_engine(loaded, str(tmp_path))
    with other:
        other.load(tmp_path / "ckpt", scheduler=other_scheduler, rng=True)
        assert other.stats()["steps"] == K
        other_losses = train(other, other_scheduler, range(K, K + M))
        other_weights = other.state_dict()
    # The gpu tier runs torch's AdamW maths, the others the fused kernel: equal to rounding (as in parity tests).
    assert max(abs(a - b) for a, b in zip(losses, other_losses)) <= 1e-5
    assert max((weights[k] - other_weights[k]).abs().max().item() for k in weights) <= 1e-5


def test_files_are_readable_without_offload(tmp_path):
    engine, scheduler = make_engine("nvme", str(tmp_path))
    with engine:
        train(engine, scheduler, range(K))
        engine.save(tmp_path / "ckpt", scheduler=scheduler, rng=True)
        expected = engine.state_dict()
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    directory = tmp_path / "ckpt"
    assert sorted(os.listdir(directory)) == ["manifest.json", "model.safetensors", "optimizer.safetensors",
                                             "rng.pt", "scheduler.pt"]
    weights = safetensors.torch.load_file(directory / "model.safetensors")
    assert weights.keys() == expected.keys()  # tied aliases included, so load_state_dict(strict=True) works
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    optim = safetensors.torch.load_file(directory / "optimizer.safetensors")
    # fp32 compute: the masters are the weights, stored once in model.safetensors ([Note: master weights stored once])
    assert {k for k in optim if not k.startswith("__pad__/")} == {f"{kind}/{n}" for kind in ("exp_avg", "exp_avg_sq") for n in trainable}
    assert torch.load(directory / "scheduler.pt", weights_only=True)["last_epoch"] == K
    assert "torch" in torch.load(directory / "rng.pt", weights_only=True)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert (manifest["version"], manifest["tier"], manifest["step"]) == (3, "nvme", K)
    assert manifest["masters"] == {n: "weights" for n in trainable}
    steps = {p["name"]: p["steps"] for b in manifest["blocks"] for g in b["groups"] for p in g["params"]}
    assert all(steps[n] == K for n in trainable)
    assert manifest["tied"] == {"lm_head.weight": "wte.weight"}
    assert manifest["files"]["optimizer.safetensors"]["size"] == os.path.getsize(directory / "optimizer.safetensors")


def _damage(path, how):
    size = os.path.getsize(path)
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        os.truncate(path, size - 100)
    else:
        with open(path, "r+b") as f:
            f.seek(size - 64)
            data = bytearray(f.read(4))
            if how == "zeroed":
                data = bytearray(4) if any(data) else bytearray(b"\1\1\1\1")
            else:
                data[0] ^= 0x10  # one bit
            f.seek(size - 64)
            f.write(data)


@pytest.mark.parametrize("how", ["truncated", "zeroed", "bit-flipped", "missing"])
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_damaged_checkpoint_file_is_named_not_loaded(name, how, tmp_path):
    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        train(engine, scheduler, range(1))
        engine.save(tmp_path / "ckpt")
        _damage(tmp_path / "ckpt" / name, how)
        what = {"missing": "is missing", "truncated": "truncated"}.get(how, r"checksum mismatch .* of block '(wte|ln_f)'")
        pattern = rf"(?=.*{re.escape(name)})(?=.*{what})"
        with pytest.raises(OffloadIntegrityError, match=pattern):
            engine.load(tmp_path / "ckpt")


def test_damaged_manifest_is_an_integrity_error(tmp_path):
    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        engine.save(tmp_path / "ckpt")
        (tmp_path / "ckpt" / "manifest.json").write_text('{"format": "offload-checkpoint", "vers')
        with pytest.raises(OffloadIntegrityError, match="manifest.json.*damaged"):
            engine.load(tmp_path / "ckpt")


def _kill_during_save(tmp_path, pause_at):
    proc = subprocess.Popen([sys.executable, "-m", "tests.checkpoint_child", "kill", str(tmp_path), str(pause_at)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()  # "PAUSED", or "DONE <calls>" when pause_at is past the last call
    if line == "PAUSED":
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    assert line.startswith(("PAUSED", "DONE")), proc.stderr.read()
    engine, _ = make_engine("cpu", str(tmp_path))
    with engine:
        manifest = engine.load(tmp_path / "ckpt")
        expected = torch.load(tmp_path / f"expected-{manifest['step']}.pt", weights_only=True)
        loaded = engine.state_dict()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    return line, manifest["step"]


@pytest.mark.parametrize("pause_at", [3, 6, 7])  # inside the file writes, between the renames, after them
def test_sigkill_during_save_leaves_a_loadable_checkpoint(pause_at, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "loading the previous checkpoint" is expected
        line, step = _kill_during_save(tmp_path, pause_at)
    assert line == "PAUSED" and step in (1, 2)


@pytest.mark.slow
def test_sigkill_at_every_fsync_and_rename_point(tmp_path):
    import warnings

    steps, pause_at = [], 1
    while True:
        directory = tmp_path / str(pause_at)
        directory.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            line, step = _kill_during_save(directory, pause_at)
        steps.append(step)
        if line.startswith("DONE"):
            break
        pause_at += 1
    assert steps[0] == 1 and steps[-1] == 2 and steps == sorted(steps)  # old until the switch, then new


def test_nvme_save_and_load_stream_without_a_ram_spike(tmp_path):
    """Peak RSS growth while saving/loading 79 MB of optimizer state, whose embedding record (50 MB) is 32
    ring chunks, is bounded by chunks, not records: a save moves each record through a ring slot the engine
    already holds; a load adds one group's compute weights and the first pass's verify buffer. (Before
    chunking, a record-sized buffer grew save by 50 MB and load by 62 MB.)"""
    from offload.checkpoint.reader import VERIFY_BYTES

    result = _child("memory", tmp_path)
    assert result.returncode == 0, result.stderr
    state, record, chunk, weights, save_growth, load_growth = map(int, result.stdout.split("MEMORY")[1].split())
    slack = 8 << 20  # glibc heap slack, thread stacks, the manifest and safetensors headers
    save_bound, load_bound = 2 * chunk + slack, weights + VERIFY_BYTES + 2 * chunk + slack
    assert state > 64 << 20 and record >= 32 * chunk and record > load_bound  # a whole record would not fit
    assert save_growth < save_bound and load_growth < load_bound, (save_growth, save_bound, load_growth, load_bound)


@pytest.fixture
def xfs_dir(tmp_path):
    """A loop-mounted 300 MiB XFS with reflink (skipped where mkfs.xfs or mounting is unavailable)."""
    for tool in ("mkfs.xfs", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed here (Debian: apt-get install xfsprogs mount)")
    image, mount = tmp_path / "xfs.img", tmp_path / "xfs"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(300 << 20)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"no mkfs.xfs with reflink here ({made.stderr.decode().strip()[:80]})")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount here ({mounted.stderr.decode().strip()[:80]})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _clonable_bytes(engine):
    """Bytes a section-by-section clone covers: each record's two moment sections, rounded down to 4 KiB (fp32
    compute: the masters are not in the optimizer file, [Note: master weights stored once])."""
    return sum(2 * (4 * g.trainable_numel // reflink.BLOCK * reflink.BLOCK)
               for _b, g, s in engine._checkpoints.checkpoint_groups() if s is not None)


def _xfs_resume(clone_expected, xfs_dir, tmp_path, monkeypatch):
    engine, scheduler = make_engine("nvme", str(xfs_dir))
    with engine:
        train(engine, scheduler, range(K))
        engine.save(xfs_dir / "ckpt", scheduler=scheduler, rng=True)
        saved = engine.state_dict()
        clonable, state_bytes = _clonable_bytes(engine), 8 * sum(
            g.trainable_numel for _b, g, s in engine._checkpoints.checkpoint_groups() if s is not None)
        losses = train(engine, scheduler, range(K, K + M))  # rewrites every swap record: the clone must not change
    import offload.checkpoint.reader as reader

    clones = []
    monkeypatch.setattr(reader, "clone_range", lambda *a: clones.append(a) or reflink.clone_range(*a))
    resumed, resumed_scheduler = make_engine("nvme", str(xfs_dir))
    with resumed:  # load into the nvme tier: records cloned from the checkpoint into the new swap file
        resumed.load(xfs_dir / "ckpt", scheduler=resumed_scheduler, rng=True)
        if clone_expected:  # both moment sections of every record of at least 4 KiB a section, each once
            assert sum(c[2] for c in clones) == clonable and len({c[4] for c in clones}) == len(clones), clones
        assert train(resumed, resumed_scheduler, range(K, K + M)) == losses
    manifest = json.loads((xfs_dir / "ckpt" / "manifest.json").read_text())
    transfer = manifest["optimizer_state_transfer"]
    if clone_expected:
        assert transfer == {"cloned_bytes": clonable, "copied_bytes": state_bytes - clonable}
        assert clonable > 4 * (state_bytes - clonable)  # only unaligned tails and tiny records are written
    other, _ = make_engine("cpu", str(tmp_path))
    with other:
        other.load(xfs_dir / "ckpt")
        loaded = other.state_dict()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    masters = master_weights(str(xfs_dir / "ckpt"))
    assert all(torch.equal(masters[k], saved[k]) for k in ("h.0.fc.weight", "ln_f.bias"))


def test_nvme_checkpoint_on_a_reflink_file_system_resumes_exactly(xfs_dir, tmp_path, monkeypatch):
    _xfs_resume(False, xfs_dir, tmp_path, monkeypatch)


def test_nvme_checkpoint_on_the_swap_file_system_is_a_copy_on_write_clone(xfs_dir, tmp_path, monkeypatch):
    _xfs_resume(True, xfs_dir, tmp_path, monkeypatch)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_compressed_moments_are_cloned_into_a_checkpoint_on_the_swap_file_system(moments, xfs_dir, monkeypatch):
    """bf16 values and int8 codes are cloned copy-on-write from the swap records into the checkpoint and back into
    a new engine's swap file, as fp32 moments are (the int8 scales and each section's unaligned tail are written),
    and the checkpoint keeps what was saved while training rewrites the records: the new engine continues bit for
    bit."""
    engine, scheduler = make_engine("nvme", str(xfs_dir), moments=moments)
    itemsize = {"bf16": 2, "int8": 1}[moments]
    with engine:
        train(engine, scheduler, range(K))
        engine.save(xfs_dir / "ckpt", scheduler=scheduler, rng=True)
        clonable = sum(2 * (itemsize * g.trainable_numel // reflink.BLOCK * reflink.BLOCK)
                       for _b, g, s in engine._checkpoints.checkpoint_groups() if s is not None)
        losses = train(engine, scheduler, range(K, K + M))  # rewrites every swap record: the clone must not change
    transfer = json.loads((xfs_dir / "ckpt" / "manifest.json").read_text())["optimizer_state_transfer"]
    assert transfer["cloned_bytes"] == clonable and clonable > 2 * transfer["copied_bytes"], (transfer, clonable)
    import offload.checkpoint.reader as reader

    clones: list = []
    monkeypatch.setattr(reader, "clone_range", lambda *a: clones.append(a[2]) or reflink.clone_range(*a))
    resumed, resumed_scheduler = make_engine("nvme", str(xfs_dir), moments=moments)
    with resumed:
        resumed.load(xfs_dir / "ckpt", scheduler=resumed_scheduler, rng=True)
        assert sum(clones) == clonable, (clones, clonable)
        assert train(resumed, resumed_scheduler, range(K, K + M)) == losses


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_clones_put_the_records_bytes_where_the_checkpoint_expects_them(moments, tmp_path, monkeypatch):
    """The clone path on any file system: `clone_range` replaced by a copy of the same block-aligned bytes, so a
    save and a load take each section's aligned part from the other file as a reflink would. The checkpoint
    verifies (every tensor's checksum over the bytes the clone put there), the swap file's seals cover what the load
    cloned, and the engine resumes bit for bit."""
    def copy_range(src_fd, src_offset, nbytes, dst_fd, dst_offset):
        assert (src_offset | dst_offset | nbytes) % reflink.BLOCK == 0
        copied.append(nbytes)
        os.pwrite(dst_fd, os.pread(src_fd, nbytes, src_offset), dst_offset)
        return True

    import offload.checkpoint.reader as reader

    copied: list = []
    monkeypatch.setattr(reflink, "clone_range", copy_range)
    monkeypatch.setattr(reader, "clone_range", copy_range)
    engine, scheduler = make_engine("nvme", str(tmp_path), moments=moments)
    with engine:
        train(engine, scheduler, range(K))
        engine.save(tmp_path / "ckpt", scheduler=scheduler, rng=True)
        losses = train(engine, scheduler, range(K, K + M))
    transfer = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["optimizer_state_transfer"]
    assert transfer["cloned_bytes"] == sum(copied) > 2 * transfer["copied_bytes"], (transfer, copied)
    copied.clear()
    resumed, resumed_scheduler = make_engine("nvme", str(tmp_path), moments=moments)
    with resumed:
        resumed.load(tmp_path / "ckpt", scheduler=resumed_scheduler, rng=True)
        assert sum(copied) == transfer["cloned_bytes"], (copied, transfer)  # the same sections, the other way
        assert train(resumed, resumed_scheduler, range(K, K + M)) == losses


def test_streamed_weights_round_trip_and_progress_bar(tmp_path, capsys):
    """Weights streamed under a small device_memory are saved from their host copies and loaded back into
    them; progress=True shows a tqdm bar."""
    from tests.test_engine_streaming import BUDGET

    torch.manual_seed(0)
    streamed = offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", device_memory=BUDGET)
    scheduler = torch.optim.lr_scheduler.StepLR(streamed.optimizer, 1)
    with streamed:
        assert streamed.stats()["block_evictions"] >= 0 and any(r.streamed for r in streamed.records)
        train(streamed, scheduler, range(K))
        streamed.save(tmp_path / "ckpt", progress=True, scheduler=scheduler, rng=True)
        assert "saving ckpt" in capsys.readouterr().err
        expected = streamed.state_dict()
        losses = train(streamed, scheduler, range(K, K + 1))
    for budget in (None, BUDGET):
        torch.manual_seed(1)
        engine = offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", device_memory=budget)
        resumed_scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1)
        with engine:
            engine.load(tmp_path / "ckpt", scheduler=resumed_scheduler, rng=True)
            assert all(torch.equal(engine.state_dict()[k], expected[k]) for k in expected)
            again = train(engine, resumed_scheduler, range(K, K + 1))
            assert again == losses


def test_wrong_model_is_refused_before_anything_changes(tmp_path):
    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        engine.save(tmp_path / "ckpt")
    other = offload.wrap(TinyGPT(dim=48), tier="cpu", dtype=torch.float32, device="cpu")
    with other:
        before = other.state_dict()
        with pytest.raises(offload.OffloadConfigError, match=r"'wte.weight' is \(64, 48\) in this model but \(64, 32\)"):
            other.load(tmp_path / "ckpt")
        assert all(torch.equal(other.state_dict()[k], before[k]) for k in before)


def test_saving_with_accumulated_gradients_warns(tmp_path):
    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        (idx, tgt) = BATCHES[0][0]
        engine(idx, tgt).backward()
        with pytest.warns(RuntimeWarning, match="accumulated gradients are not part of a checkpoint"):
            engine.save(tmp_path / "ckpt")


def test_without_the_native_core_checkpoints_use_zlib_crc32(tmp_path, monkeypatch):
    from offload import _native

    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        train(engine, scheduler, range(1))
        monkeypatch.setattr(_native, "_C", None)  # checksums only: the engine keeps its kernels
        engine.save(tmp_path / "ckpt")
        assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["checksum"] == "crc32"
        engine.load(tmp_path / "ckpt")
        monkeypatch.undo()
        engine.load(tmp_path / "ckpt")  # the manifest names the algorithm, whatever this process prefers
        _damage(tmp_path / "ckpt" / "optimizer.safetensors", "bit-flipped")
        with pytest.raises(OffloadIntegrityError, match="checksum mismatch"):
            engine.load(tmp_path / "ckpt")
