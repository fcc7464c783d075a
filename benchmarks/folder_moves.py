"""How often one training step's Python calls cross between the package's folders, per thread.

    python benchmarks/folder_moves.py                 # the review's case: 4 blocks, nvme, gradients on disk, clipping
    python benchmarks/folder_moves.py --json

Every call from a function in one folder of `offload/` to a function in another (`scheduler/records` ->
`scheduler/grads`, `tiers` -> `io`) is a move; calls from torch or the user into offload are not. The counts are
per thread: the training thread, and the engine's threads (the step worker, the I/O completion threads) summed.
One warm-up step first (the block order is recorded, buffers are taken), then one step traced. A reader who
follows one gradient pays for each move: issue 34 asks for half of the 2026-11-27 counts (training thread ~400,
engine threads ~11,300). The step is checked against torch.optim.AdamW with clip_grad_norm_.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

import offload

PACKAGE = Path(offload.__file__).resolve().parent


def folder_of(filename: str) -> Optional[str]:
    """The folder of `offload/` a source file is in ("." for the top level), or None outside the package."""
    try:
        relative = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    return str(relative.parent)


class MoveCounter:
    """A profile function counting, per thread, calls whose caller and callee are in different folders."""

    def __init__(self) -> None:
        self.moves: Dict[str, int] = collections.Counter()
        self.calls: Dict[str, int] = collections.Counter()
        self.pairs: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._folders: Dict[str, Optional[str]] = {}
        self.files: Dict[str, Dict[str, None]] = collections.defaultdict(dict)  # per thread, in first-call order
        self._lock = threading.Lock()
        self.active = False  # installed before the engine starts its threads, counting only while set

    def _folder(self, filename: str) -> Optional[str]:
        if filename not in self._folders:
            self._folders[filename] = folder_of(filename)
        return self._folders[filename]

    def __call__(self, frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call" or not self.active:
            return
        callee = self._folder(frame.f_code.co_filename)
        if callee is None or frame.f_back is None:
            return
        caller = self._folder(frame.f_back.f_code.co_filename)
        if caller is None:
            return
        thread = "training" if threading.current_thread() is threading.main_thread() else "engine"
        with self._lock:
            self.calls[thread] += 1
            self.files[thread].setdefault(str(Path(frame.f_code.co_filename).resolve().relative_to(PACKAGE)), None)
            if caller != callee:
                self.moves[thread] += 1
                self.pairs[thread][f"{caller} -> {callee}"] += 1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def step(forward, optimizer, x: torch.Tensor, clip: Optional[nn.Module] = None) -> float:
    loss = forward(x).square().mean()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--top", type=int, default=8, help="the most frequent folder pairs to print per thread")
    parser.add_argument("--files", action="store_true", help="also the files of offload/ each thread calls into, "
                                                             "in the order of their first call")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    xs = [torch.randn(8, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with tempfile.TemporaryDirectory() as swap:
        plain = model()
        reference = torch.optim.AdamW(plain.parameters())
        wrapped = model()
        counter = MoveCounter()
        threading.setprofile(counter)  # the engine's threads start in wrap(): they inherit it
        # host_memory below the gradients' total: the gradients wait for the clipping norm on disk
        engine = offload.wrap(wrapped, "nvme", nvme_path=swap, max_grad_norm=1.0, host_memory=900_000,
                              dtype=torch.float32, device="cpu")
        assert engine.plan.grads_on_disk, engine.plan
        sys.setprofile(counter)
        try:
            for i, x in enumerate(xs):
                expected = step(plain, reference, x, clip=plain)
                counter.active = i == len(xs) - 1
                got = step(engine, engine, x)
                engine.synchronize()  # the step's updates and writes, in the count
                counter.active = False
                assert abs(got - expected) <= 1e-5, (got, expected)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        weights = max((a - b).abs().max().item() for a, b in zip(wrapped.parameters(), plain.parameters()))
        assert weights <= 1e-5, weights
        engine.close()
    result = {"moves": dict(counter.moves), "calls": dict(counter.calls),
              "files": {t: list(files) for t, files in counter.files.items()},
              "top": {t: counter.pairs[t].most_common(args.top) for t in counter.pairs}}
    if args.json:
        print(json.dumps(result))
    else:
        for thread in ("training", "engine"):
            print(f"{thread} thread(s): {counter.moves[thread]} moves between folders in {counter.calls[thread]} "
                  "calls inside offload")
            for pair, count in counter.pairs[thread].most_common(args.top):
                print(f"  {count:6d}  {pair}")
            if args.files:
                files = list(counter.files[thread])
                folders = {str(Path(f).parent) for f in files}
                print(f"  {len(files)} files in {len(folders)} folders: " + ", ".join(files))
        print("the step matches torch.optim.AdamW + clip_grad_norm_ (1e-5)")
    return result


if __name__ == "__main__":
    main()
