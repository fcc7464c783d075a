"""Checkpoint save and load: offload's tiers against torch.save/torch.load and safetensors, and against the
disk bound measured in the same run.

    python benchmarks/bench_checkpoint.py              # DemoGPT 8 layers, dim 512, vocab 8192: 29.5M params,
                                                       # a 489 MB checkpoint, 5 rounds (~2-3 min on 2 cores)
    python benchmarks/bench_checkpoint.py --dim 768    # larger
    python benchmarks/bench_checkpoint.py --quick      # a tiny model, 1 round (a smoke run)
    python benchmarks/bench_checkpoint.py --sizes      # bytes only: each moments= and compute dtype, no timing

One model, trained one step (so the Adam moments are real), is saved by each rival, interleaved round by
round (the order rotated each round): offload's cpu and nvme tiers (`engine.save`, swap file on the
checkpoint's file system), the nvme tier on a loop-mounted XFS where sections are cloned copy-on-write
(when mkfs.xfs and loop mounts work here: root), plain PyTorch (`torch.save({'model': ..., 'optimizer':
AdamW.state_dict()})` + fsync: neither atomic nor checksummed) and `safetensors.torch.save_file` of the
same tensors + fsync. Each save goes to a fresh directory; then the page cache is dropped
(/proc/sys/vm/drop_caches, root; else fadvise DONTNEED), the checkpoint is loaded into a freshly wrapped
engine (or a fresh model and AdamW: `torch.load(..., weights_only=True)` + `load_state_dict`), and the
directory is removed. Wrapping is not timed.

The bound of a row is the disk traffic it cannot avoid at the bandwidths offload.measure.DiskProbe measures
in the same rounds, in the same directory (O_DIRECT writes of fresh regions to durability, then reads):
a save writes the checkpoint's bytes (less what a clone shares) and, on the nvme tier, reads the swap
record; a load reads the checkpoint once (offload's first, verifying pass reads it a second time: not part
of the bound) and, on the nvme tier, writes the swap record (less what a clone shares).
`of_bound` = bound time / row time. `verify` = share of a load's time spent in its first pass (timed in
this script by wrapping TensorFileReader.verify_all; the library has no switch for it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import offload  # noqa: E402
from benchmarks.common import append_csv, machine_header, print_table, summarize, sync_file  # noqa: E402
from offload.checkpoint import tensor_file  # noqa: E402
from offload.checksum import checksum, preferred_algorithm  # noqa: E402
from offload.cli.demo import DemoGPT  # noqa: E402
from offload.measure import DiskProbe  # noqa: E402
from offload.optim.moment_format import code_nbytes, scale_count  # noqa: E402

MB = 1e6


# -- the first pass of a load, timed from outside the library -------------------------------------------------
class VerifyTimer:
    """Adds up the seconds spent in TensorFileReader.verify_all (load's first pass) while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = tensor_file.TensorFileReader.verify_all

    def __enter__(self) -> "VerifyTimer":
        original, timer = self._original, self

        def timed(reader, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(reader, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start

        tensor_file.TensorFileReader.verify_all = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        tensor_file.TensorFileReader.verify_all = self._original  # type: ignore[method-assign]


# -- page cache and file helpers --------------------------------------------------------------------------------
def drop_cache(directory: Path) -> str:
    """Write back and evict the page cache (all of it when root, else the files under `directory`)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in directory.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise DONTNEED (not root: pages of other files stay cached)"


def tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


class LoopXFS:
    """A sparse image file formatted XFS (reflink=1) and loop-mounted; `reason` says why not when it fails."""

    def __init__(self, parent: Path, nbytes: int) -> None:
        self.image, self.mount, self.reason = parent / "xfs.img", parent / "xfs", ""
        self.device, self.direct = "", False
        for tool in ("mkfs.xfs", "losetup", "mount", "umount"):
            if shutil.which(tool) is None:
                self.reason = f"{tool} not installed (apt-get install xfsprogs)"
                return
        self.mount.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(max(nbytes, 320 << 20))
        done = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(self.image)], capture_output=True, text=True)
        if done.returncode == 0:
            # direct-io=on: the loop device reads and writes the image with O_DIRECT, so the image's pages are
            # not cached a second time below the XFS (the probe would measure memory otherwise)
            done = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(self.image)],
                                  capture_output=True, text=True)
            self.device = done.stdout.strip()
            self.direct = done.returncode == 0
            if done.returncode == 0:
                done = subprocess.run(["mount", self.device, str(self.mount)], capture_output=True, text=True)
            else:
                done = subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount)],
                                      capture_output=True, text=True)
        if done.returncode != 0:
            self.reason = f"{done.args[0]} failed: {done.stderr.strip()[:80]}"
            self.close()

    @property
    def ok(self) -> bool:
        return not self.reason

    def close(self) -> None:
        if os.path.ismount(self.mount):
            if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        if self.direct:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
        shutil.rmtree(self.mount, ignore_errors=True)
        self.image.unlink(missing_ok=True)


# -- rivals: save(path) -> disk bytes (read, written, cloned); load(path) -> disk bytes (read, written, cloned) --
class Result:
    def __init__(self, read: int, written: int, cloned: int = 0, data: int = 0) -> None:
        self.read, self.written, self.cloned, self.data = read, written, cloned, data


def swap_state_bytes(numel: int, moments: str) -> int:
    """A parameter's optimizer state in the swap file: its fp32 master and two moments in their format."""
    return 4 * numel + 2 * (code_nbytes(moments, numel) + 4 * scale_count(moments, numel))


class OffloadRival:
    """engine.save of a trained engine; engine.load into a fresh engine of the same tier."""

    def __init__(self, make_model: Callable[[], torch.nn.Module], tier: str, swap_dir: Optional[Path],
                 batch, moments: str = "fp32") -> None:
        self.make_model, self.tier, self.swap_dir, self.moments = make_model, tier, swap_dir, moments
        self.engine = self._wrap()
        idx, tgt = batch
        self.engine(idx, tgt).backward()
        self.engine.step()
        self.engine.zero_grad()
        self.engine.synchronize()
        self.fresh = None

    def _wrap(self):
        options = dict(nvme_path=str(self.swap_dir)) if self.tier == "nvme" else {}
        return offload.wrap(self.make_model(), tier=self.tier, dtype=torch.float32, device="cpu",
                            grad_accumulation_steps=1, moments=self.moments, **options)

    def save(self, path: Path) -> Result:
        before = self.engine.stats()["bytes_disk_read"]
        self.engine.save(str(path), progress=False)
        swap_read = self.engine.stats()["bytes_disk_read"] - before
        transfer = json.loads((path / "manifest.json").read_text())["optimizer_state_transfer"]
        size = tree_bytes(path)
        return Result(swap_read, size - transfer["cloned_bytes"], transfer["cloned_bytes"], size)

    def prepare_load(self) -> None:
        self.fresh = self._wrap()  # for nvme: writes the initial swap record (not timed)

    def load(self, path: Path) -> Result:
        before = self.fresh.stats()["bytes_disk_written"]
        self.fresh.load(str(path), progress=False)
        written = self.fresh.stats()["bytes_disk_written"] - before
        state = sum(swap_state_bytes(p.numel(), self.moments) for p in self.fresh.module.parameters())
        size = tree_bytes(path)
        # nvme: every state byte lands in the swap file, written or cloned
        return Result(size, written, state - written if self.tier == "nvme" else 0, size)

    def after_load(self) -> None:
        self.fresh.close()
        self.fresh = None

    def close(self) -> None:
        self.engine.close()


class TorchRival:
    """torch.save of model and AdamW state dicts (+ fsync); torch.load(weights_only=True) + load_state_dict."""

    def __init__(self, make_model: Callable[[], torch.nn.Module], batch) -> None:
        self.make_model = make_model
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0)
        self.model(*batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.fresh: Optional[Tuple[torch.nn.Module, torch.optim.Optimizer]] = None

    def prepare_load(self) -> None:
        model = self.make_model()
        self.fresh = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))

    def after_load(self) -> None:
        self.fresh = None

    def close(self) -> None:
        pass


class TorchSave(TorchRival):
    def save(self, path: Path) -> Result:
        path.mkdir()
        with open(path / "checkpoint.pt", "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        size = tree_bytes(path)
        return Result(0, size, 0, size)

    def load(self, path: Path) -> Result:
        model, optimizer = self.fresh
        state = torch.load(path / "checkpoint.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        size = tree_bytes(path)
        return Result(size, 0, 0, size)


class SafetensorsSave(TorchRival):
    """The same tensors in one safetensors file (tied aliases once: save_file refuses shared storage)."""

    def save(self, path: Path) -> Result:
        import safetensors.torch

        path.mkdir()
        tensors, seen = {}, set()
        for name, value in self.model.state_dict().items():
            if value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                tensors[f"model/{name}"] = value
        for index, state in self.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                tensors[f"optimizer/{index}/{key}"] = value
        safetensors.torch.save_file(tensors, str(path / "checkpoint.safetensors"))
        sync_file(path / "checkpoint.safetensors")
        size = tree_bytes(path)
        return Result(0, size, 0, size)

    def load(self, path: Path) -> Result:
        import safetensors.torch

        model, optimizer = self.fresh
        tensors = safetensors.torch.load_file(str(path / "checkpoint.safetensors"))
        missing, unexpected = model.load_state_dict(
            {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # the tied alias
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer/"):
                _, index, name = key.split("/")
                state.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
        size = tree_bytes(path)
        return Result(size, 0, 0, size)


def crc_rate(nbytes: int) -> float:
    """Bytes/s of the checksum new checkpoints use, on one core (median of 3)."""
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    algorithm, times = preferred_algorithm(), []
    for _ in range(3):
        start = time.perf_counter()
        checksum(buffer, algorithm)
        times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[1]


def checkpoint_sizes(make_model: Callable[[], torch.nn.Module], batch, base: Path) -> None:
    """Bytes of a checkpoint of the model after one step, for each `moments=` and compute dtype (cpu tier):
    the optimizer files, the whole directory, and each against fp32 moments' of the same compute dtype
    ([Note: master weights stored once])."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        reference: Dict[str, int] = {}
        for moments in ("fp32", "bf16", "int8"):
            engine = offload.wrap(make_model(), tier="cpu", dtype=dtype, device="cpu", moments=moments)
            idx, tgt = batch
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
            path = base / f"sizes-{moments}-{dtype}"
            engine.save(str(path), progress=False)
            engine.close()
            optim = sum(f.stat().st_size for f in path.iterdir() if f.name.startswith("optimizer"))
            whole = tree_bytes(path)
            manifest = json.loads((path / "manifest.json").read_text())
            reference = reference or {"optim": optim, "whole": whole}
            rows.append({"compute": str(dtype).replace("torch.", ""), "moments": moments,
                         "version": manifest["version"], "masters_derived": len(manifest.get("masters", {})),
                         "optimizer_MB": round(optim / MB, 2), "checkpoint_MB": round(whole / MB, 2),
                         "optimizer_vs_fp32": f"{optim / reference['optim']:.3f}x",
                         "checkpoint_vs_fp32": f"{whole / reference['whole']:.3f}x"})
            shutil.rmtree(path)
    print_table(rows, list(rows[0]))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints and the swap file go (default: a temp dir)")
    parser.add_argument("--no-xfs", action="store_true", help="skip the loop-mounted XFS (clone) rows")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 1 round (a smoke run)")
    parser.add_argument("--sizes", action="store_true", help="only the checkpoint's bytes for each moments= and "
                        "compute dtype (no timing)")
    parser.add_argument("--no-csv", action="store_true", help="do not append to benchmarks/results/checkpoint.csv")
    parser.add_argument("--moments", choices=("fp32", "bf16", "int8"), default="fp32",
                        help="the offload rows' moments= (compressed moments: their values or codes are cloned too)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.rounds = 2, 64, 512, 32, 1
    start_all = time.perf_counter()
    torch.manual_seed(0)
    base_model = DemoGPT(args.vocab, args.dim, args.layers, args.context, heads=4)
    n_params = sum(p.numel() for p in base_model.parameters())
    gen = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, args.vocab, (2, args.context), generator=gen) for _ in range(2))

    def make_model() -> torch.nn.Module:
        model = copy.deepcopy(base_model)
        model.lm_head.weight = model.wte.weight
        return model

    if args.sizes:
        base = Path(tempfile.mkdtemp(prefix="offload-bench-ckpt-", dir=args.dir))
        try:
            print(f"DemoGPT layers={args.layers} dim={args.dim} vocab={args.vocab} | {n_params / 1e6:.2f}M params, "
                  "cpu tier, one step")
            checkpoint_sizes(make_model, batch, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    state_bytes = 16 * n_params  # fp32 weights + master + two moments
    probe_bytes = (8 if args.quick else 64) << 20
    base = Path(tempfile.mkdtemp(prefix="offload-bench-ckpt-", dir=args.dir))
    xfs: Optional[LoopXFS] = None
    rivals: Dict[str, object] = {}
    probes: Dict[str, DiskProbe] = {}
    try:
        (base / "swap").mkdir()
        rivals["offload cpu tier"] = OffloadRival(make_model, "cpu", None, batch, args.moments)
        rivals["offload nvme tier"] = OffloadRival(make_model, "nvme", base / "swap", batch, args.moments)
        probes["ext"] = DiskProbe(str(base), sample_bytes=probe_bytes, samples=args.rounds)
        skipped: Dict[str, str] = {}
        if args.no_xfs:
            skipped["offload nvme tier, XFS clones"] = "--no-xfs"
        else:
            # trained swap + checkpoint + a fresh engine's swap, uncloned, + probe regions, + slack
            xfs = LoopXFS(base, 3 * state_bytes + probe_bytes * args.rounds + (256 << 20))
            if xfs.ok:
                (xfs.mount / "swap").mkdir()
                rivals["offload nvme tier, XFS clones"] = OffloadRival(make_model, "nvme", xfs.mount / "swap", batch,
                                                                       args.moments)
                probes["xfs"] = DiskProbe(str(xfs.mount), sample_bytes=probe_bytes, samples=args.rounds)
            else:
                skipped["offload nvme tier, XFS clones"] = xfs.reason
        rivals["torch.save/load"] = TorchSave(make_model, batch)
        try:
            import safetensors.torch  # noqa: F401

            rivals["safetensors save_file/load_file"] = SafetensorsSave(make_model, batch)
        except ImportError:
            skipped["safetensors save_file/load_file"] = "safetensors not installed"

        times: Dict[Tuple[str, str], List[float]] = {}
        verify: Dict[str, List[float]] = {}
        traffic: Dict[Tuple[str, str], Result] = {}
        evict = "?"
        with VerifyTimer() as timer:
            for round_index in range(args.rounds):
                for probe in probes.values():
                    probe.sample()
                # rotated, so that no rival always runs right after the probe or after a given rival's rmtree
                names = list(rivals)
                order = names[round_index % len(names):] + names[:round_index % len(names)]
                for name in order:
                    rival, index = rivals[name], names.index(name)
                    where = xfs.mount if "XFS" in name else base
                    path = where / f"ckpt-{round_index}-{index}"
                    t0 = time.perf_counter()
                    traffic[(name, "save")] = rival.save(path)  # type: ignore[attr-defined]
                    times.setdefault((name, "save"), []).append(time.perf_counter() - t0)
                    rival.prepare_load()  # type: ignore[attr-defined]
                    evict = drop_cache(where)
                    timer.seconds = 0.0
                    t0 = time.perf_counter()
                    traffic[(name, "load")] = rival.load(path)  # type: ignore[attr-defined]
                    elapsed = time.perf_counter() - t0
                    times.setdefault((name, "load"), []).append(elapsed)
                    verify.setdefault(name, []).append(timer.seconds / elapsed)
                    rival.after_load()  # type: ignore[attr-defined]
                    shutil.rmtree(path)
        disks = {key: probe.result() for key, probe in probes.items()}
        crc = crc_rate(probe_bytes)
    finally:
        for rival in rivals.values():
            rival.close()  # type: ignore[attr-defined]
        for probe in probes.values():
            probe.close()
        if xfs is not None:
            xfs.close()
        shutil.rmtree(base, ignore_errors=True)

    rows: List[Dict[str, object]] = []
    for op in ("save", "load"):
        for name in list(rivals) + list(skipped):
            if name in skipped:
                rows.append({"rival": name, "op": op, "ms p50": f"skipped: {skipped[name]}"})
                continue
            median, p20, p80 = summarize(times[(name, op)])
            t = traffic[(name, op)]
            disk = disks["xfs" if "XFS" in name else "ext"]
            bound = t.read / disk.read + t.written / disk.write
            row = {"rival": name, "op": op, "MB": f"{t.data / MB:.0f}", "ms p50": f"{median * 1e3:.0f}",
                   "p20-p80": f"{p20 * 1e3:.0f}-{p80 * 1e3:.0f}", "GB/s": f"{t.data / median / 1e9:.2f}",
                   "disk MB r/w": f"{t.read / MB:.0f}/{t.written / MB:.0f}", "bound ms": f"{bound * 1e3:.0f}",
                   "of_bound": f"{bound / median:.2f}"}
            if name.startswith("offload"):
                row["cloned MB"] = f"{t.cloned / MB:.0f}"
            if op == "load" and name.startswith("offload"):
                row["verify"] = f"{summarize(verify[name])[0]:.0%}"
            rows.append(row)
    columns = ["rival", "op", "MB", "ms p50", "p20-p80", "GB/s", "disk MB r/w", "cloned MB", "bound ms",
               "of_bound", "verify"]
    print(machine_header())
    print(f"DemoGPT layers={args.layers} dim={args.dim} vocab={args.vocab} | {n_params / 1e6:.2f}M params fp32, "
          f"AdamW after 1 step, offload moments={args.moments} | {args.rounds} rounds, interleaved, order rotated | "
          f"native core: {offload.native_available()}")
    for key, disk in disks.items():
        where = (f"loop-mounted XFS (reflink=1, loop direct-io {'on' if xfs.direct else 'off'}) on an image "
                 "in that directory" if key == "xfs" else "the checkpoint directory")
        print(f"disk bound, {where}: write {disk.write / 1e9:.2f} GB/s, read {disk.read / 1e9:.2f} GB/s "
              f"(DiskProbe, {probe_bytes >> 20} MiB fresh regions, {disk.backend}, O_DIRECT {disk.direct})")
    print(f"{preferred_algorithm()} {crc / 1e9:.1f} GB/s on one core; page cache before each load: {evict}")
    print_table(rows, columns)
    print(f"torch.save and safetensors: neither atomic nor checksummed; offload: atomic directory swap, a "
          f"checksum per tensor, load verifies everything before changing the engine; "
          f"{time.perf_counter() - start_all:.0f} s")
    if not args.no_csv and not args.quick:
        append_csv("checkpoint", [dict(r, params=n_params, layers=args.layers, dim=args.dim, vocab=args.vocab,
                                       rounds=args.rounds, moments=args.moments) for r in rows])


if __name__ == "__main__":
    main()
