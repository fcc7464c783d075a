"""Faults: full disks, damaged or leftover swap files, non-finite gradients, Ctrl-C during step()."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import offload
from offload.errors import OffloadConfigError, OffloadIntegrityError, OffloadIOError
from tests.checkpoint_child import make_engine, train
from tests.models import TinyGPT, make_batches, one_intraop_thread
from tests.test_checkpoint import _damage

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a real full disk (skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip() or 'not permitted'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_disk_full_during_save_keeps_old_checkpoint_and_training_state(tiny_disk, tmp_path):
    engine, scheduler = make_engine("cpu", str(tmp_path))
    with engine:
        train(engine, scheduler, range(1))
        engine.save(tiny_disk / "ckpt")
        saved = engine.state_dict()
        train(engine, scheduler, range(1, 2))
        before = engine.state_dict()
        filler = tiny_disk / "filler"
        free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
        filler.write_bytes(b"\0" * (free - 64 * 1024))
        with pytest.raises(OffloadIOError, match="no space left while saving checkpoint .* intact .* save again"):
            engine.save(tiny_disk / "ckpt")
        assert sorted(os.listdir(tiny_disk)) == ["ckpt", "filler"]  # no temporary directory left behind
        assert _same(engine.state_dict(), before)  # training state unharmed
        train(engine, scheduler, range(2, 3))  # and training goes on
        filler.unlink()
        engine.save(tiny_disk / "ckpt")  # after freeing space
        final = engine.state_dict()
    other, _ = make_engine("cpu", str(tmp_path))
    with other:
        other.load(tiny_disk / "ckpt")
        assert _same(other.state_dict(), final) and not _same(final, saved)


def test_disk_full_at_swap_file_creation_says_needed_and_free(tiny_disk):
    model = TinyGPT(vocab=4096, dim=64)  # ~ 3.7 MiB of optimizer state for a 2 MiB disk
    with pytest.raises(OffloadConfigError, match=r"has \d+ bytes free but the optimizer state needs \d+ bytes"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # tmpfs: no O_DIRECT
            offload.wrap(model, tier="nvme", nvme_path=tiny_disk, dtype=torch.float32, device="cpu")
    assert os.listdir(tiny_disk) == []


def test_bit_flip_in_swap_file_is_an_integrity_error_naming_file_and_block(tmp_path):
    engine, scheduler = make_engine("nvme", str(tmp_path), overlap_step=False)
    train(engine, scheduler, range(1))
    engine.synchronize()
    engine.optimizer.state_dict()  # reads the swap file whole: the ring's slots keep no chunk after it, so the
    # next updates read the file ([Note: clean chunks]; a chunk still in a slot is rewritten, never read)
    swap = next(p for p in tmp_path.iterdir() if p.suffix == ".swap")
    layout = json.loads((tmp_path / (swap.name + ".layout.json")).read_text())
    record = next(r for r in layout["records"] if r["block"] == "h.2")
    with open(swap, "r+b") as f:
        f.seek(record["offset"] + 12)
        byte = f.read(1)
        f.seek(record["offset"] + 12)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(OffloadIntegrityError, match=rf"{swap.name}.*block 'h.2'.*checksum"):
        train(engine, scheduler, range(1, 2))  # step() waits for the updates, which read the damaged record
    with pytest.warns(RuntimeWarning, match="closed after a failed update"):
        engine.close()  # the damaged block was reported once; cleanup still works


def _chunked_engine(directory):
    """An nvme engine with the smallest ring (2048-element chunks): its layer records are several chunks."""
    from offload.planner.ring import min_ring_bytes

    torch.manual_seed(0)
    model = TinyGPT()
    grads = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = offload.wrap(model, tier="nvme", nvme_path=directory, dtype=torch.float32, device="cpu",
                          host_memory=grads + min_ring_bytes(), overlap_step=False)
    return engine, torch.optim.lr_scheduler.StepLR(engine.optimizer, 1)


def _flip_in_swap(directory, block, section, element):
    """Flip one bit of element `element` of a section (0 master, 1 exp_avg, 2 exp_avg_sq) of `block`'s record."""
    swap = next(p for p in directory.iterdir() if p.suffix == ".swap")
    layout = json.loads((directory / (swap.name + ".layout.json")).read_text())
    record = next(r for r in layout["records"] if r["block"] == block)
    assert record["numel"] > element >= 2048  # the record is several chunks; the element lies past the first
    offset = record["offset"] + section * record["section_bytes"] + 4 * element + 1
    with open(swap, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    return swap


def test_bit_flip_in_swap_file_is_caught_by_a_chunked_save(tmp_path):
    (tmp_path / "swap").mkdir()
    engine, scheduler = _chunked_engine(tmp_path / "swap")
    with engine:
        assert engine.stats()["nvme_chunk_numel"] == 2048
        train(engine, scheduler, range(1))
        engine.synchronize()
        swap = _flip_in_swap(tmp_path / "swap", "h.2", 2, 3 * 2048 + 5)  # exp_avg_sq, fourth chunk
        with pytest.raises(OffloadIntegrityError, match=rf"{swap.name}.*block 'h.2'.*checksum"):
            engine.save(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()


def test_records_loaded_into_the_nvme_tier_are_sealed_chunk_by_chunk(tmp_path):
    """A load writes and seals records along the ring's chunks, so the step's chunk reads verify them (a
    whole-record seal would cover no chunk read, and this flip would go unnoticed)."""
    saved, scheduler = make_engine("cpu", str(tmp_path))
    with saved:
        train(saved, scheduler, range(1))
        saved.save(tmp_path / "ckpt")
    (tmp_path / "swap").mkdir()
    engine, scheduler = _chunked_engine(tmp_path / "swap")
    with pytest.warns(RuntimeWarning, match="closed after a failed update"), engine:
        engine.load(tmp_path / "ckpt")
        engine.save(tmp_path / "again")  # chunked load, then chunked save: the same state
        assert _same(_optimizer_tensors(tmp_path / "again"), _optimizer_tensors(tmp_path / "ckpt"))
        swap = _flip_in_swap(tmp_path / "swap", "h.2", 0, 2 * 2048 + 9)  # master, third chunk
        with pytest.raises(OffloadIntegrityError, match=rf"{swap.name}.*block 'h.2'.*checksum"):
            train(engine, scheduler, range(1, 2))  # step() waits for the update that reads the flipped chunk


def _optimizer_tensors(path):
    import safetensors.torch

    return {k: v for k, v in safetensors.torch.load_file(path / "optimizer.safetensors").items()}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_damage_found_by_load_leaves_the_engine_as_it_was(tier, tmp_path):
    """Load verifies the whole checkpoint before changing anything: a bit flip in the last tensor of
    optimizer.safetensors raises, and weights, optimizer state, step counts and training are unchanged."""
    reference, reference_scheduler = make_engine(tier, str(tmp_path))
    with reference:
        expected = train(reference, reference_scheduler, range(3))
        expected_weights = reference.state_dict()
    engine, scheduler = make_engine(tier, str(tmp_path))
    with engine:
        train(engine, scheduler, range(1))
        engine.save(tmp_path / "damaged")
        losses = train(engine, scheduler, range(1, 2))
        engine.save(tmp_path / "before")
        weights = engine.state_dict()
        last = list(json.loads((tmp_path / "damaged" / "manifest.json").read_text())["files"][
            "optimizer.safetensors"]["checksums"])[-1]
        assert last.startswith("exp_avg_sq/")
        _damage(tmp_path / "damaged" / "optimizer.safetensors", "bit-flipped")
        with pytest.raises(OffloadIntegrityError, match=rf"checksum mismatch .*optimizer.safetensors.*{last}") as info:
            engine.load(tmp_path / "damaged")
        assert "partly loaded" not in str(info.value)
        assert _same(engine.state_dict(), weights) and engine.stats()["steps"] == 2
        engine.save(tmp_path / "after")
        assert _same(_optimizer_tensors(tmp_path / "after"), _optimizer_tensors(tmp_path / "before"))
        losses += train(engine, scheduler, range(2, 3))
        assert losses == expected[2:] and _same(engine.state_dict(), expected_weights)


def test_io_error_while_loading_says_the_engine_is_partly_loaded(tmp_path, monkeypatch):
    """After the first pass verified the files, only an I/O error (or a change under the load) can fail the
    second; the error then names the file and says the engine holds a partly loaded state."""
    import errno

    from offload.checkpoint.tensor_file import TensorFileReader

    engine, scheduler = make_engine("cpu", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="closed after a failed update"), engine:
        train(engine, scheduler, range(1))
        engine.save(tmp_path / "ckpt")

        def failing(self, name, start, out):
            raise OffloadIOError.from_errno(errno.EIO, self.path, 4096, out.numel() * out.element_size(), "read")

        monkeypatch.setattr(TensorFileReader, "read_part", failing)
        with pytest.raises(OffloadIOError, match=r"read .*model.safetensors.*Input/output error.*after the "
                           r"checkpoint was verified.*partly loaded state") as info:
            engine.load(tmp_path / "ckpt")
        assert info.value.errno == errno.EIO and info.value.path.endswith("model.safetensors")


def test_leftover_swap_files_of_dead_runs_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f"offload-{dead.pid}-0123abcd.swap"
    leftover.write_bytes(b"\1" * 8192)
    (tmp_path / (leftover.name + ".layout.json")).write_text("{}")
    unrelated = tmp_path / "notes.swap"
    unrelated.write_text("not ours")
    with pytest.warns(RuntimeWarning, match="removed 1 swap file"):
        first = offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu")
    assert not leftover.exists() and unrelated.exists()
    with first:
        second = offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu")
        swaps = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".swap" and p.name.startswith("offload-"))
        assert len(swaps) == 2 and all(n.startswith(f"offload-{os.getpid()}-") for n in swaps)  # both live engines
        train(first, torch.optim.lr_scheduler.StepLR(first.optimizer, 1), range(1))
        first.synchronize()
        second.close()


@pytest.mark.timeout(120)  # a skipped nvme block whose reads held ring slots used to hang the next step
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("declared", [None, 1])
def test_nonfinite_loss_without_clipping_skips_the_step(declared, tier, tmp_path):
    engine = offload.wrap(TinyGPT(), tier=tier, nvme_path=str(tmp_path) if tier == "nvme" else None,
                          dtype=torch.float32, device="cpu", grad_accumulation_steps=declared)
    (idx, tgt), = make_batches(1, 1)[0]
    with engine:
        before = engine.state_dict()
        with pytest.warns(RuntimeWarning, match="step 1: non-finite gradients"):
            (engine(idx, tgt) * float("nan")).backward()
            engine.step()
            engine.synchronize()
        engine.zero_grad()
        assert _same(engine.state_dict(), before)
        stats = engine.stats()
        assert stats["skipped_steps"] == 1 and stats["skipped_block_updates"] == 5  # every block with state
        for _ in range(3):  # later steps run normally (and, on nvme, find every ring slot free again)
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        assert engine.stats()["skipped_steps"] == 1 and not _same(engine.state_dict(), before)


@pytest.mark.usefixtures("default_sigint_handler")  # it sends itself SIGINT
def test_ctrl_c_during_step_applies_the_whole_step(tmp_path):
    plain, plain_scheduler = make_engine("cpu", str(tmp_path))
    with plain:
        train(plain, plain_scheduler, range(2))
        expected = plain.state_dict()
    from offload.scheduler.records.block_record import BlockRecord

    engine, scheduler = make_engine("cpu", str(tmp_path))
    submit, calls = BlockRecord.schedule_update, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # a real SIGINT, delivered between two blocks of the step
            os.kill(os.getpid(), signal.SIGINT)
        return submit(*args, **kwargs)

    with engine:
        train(engine, scheduler, range(1))
        BlockRecord.schedule_update = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                train(engine, scheduler, range(1, 2))
        finally:
            BlockRecord.schedule_update = submit
        assert len(calls) == 6 and engine.stats()["steps"] == 2  # every block scheduled; the step counted
        engine.zero_grad()
        scheduler.step()  # the interrupt skipped the training loop's scheduler.step()
        assert _same(engine.state_dict(), expected)
        engine.save(tmp_path / "ckpt")
    other, _ = make_engine("cpu", str(tmp_path))
    with other:
        other.load(tmp_path / "ckpt")
        assert _same(other.state_dict(), expected)
