"""Data parallelism that the engine cannot see is refused: before, under torchrun with DDP before or after
wrap(), every rank trained alone and the ranks drifted apart. A process group started before wrap() makes
the engine train data-parallel itself (tests/test_data_parallel.py); one started after it, and DDP or FSDP
around or under the engine, raise with the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import offload
from offload.errors import OffloadConfigError
from tests.models import TinyGPT

_RANK_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    import offload
    from offload.errors import OffloadError
    from tests.models import TinyGPT, make_batches

    order, out = sys.argv[2], sys.argv[3]  # "wrap-first": wrap, init, DDP

    def report(line):
        with open(f"{out}/rank{dist.get_rank()}.txt", "a") as f:
            f.write(line + "\\n")

    model = TinyGPT()
    if order == "wrap-first":
        engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu")
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(engine.module)
        (idx, tgt), = make_batches(1, 1)[0]
        try:
            ddp(idx, tgt).backward()
        except OffloadError as exc:
            report(f"rank {dist.get_rank()} refused at forward: {exc}")
        try:
            engine.step()  # a step without a forward under the process group: refused as well
        except OffloadError as exc:
            report(f"rank {dist.get_rank()} refused at step: {exc}")
        engine.close()
    dist.destroy_process_group()
''')


@pytest.mark.parametrize("order", ["wrap-first"])
def test_a_process_group_started_after_wrap_is_refused_with_the_fix(tmp_path, order):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this build")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(root), order, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for rank in (0, 1) if (tmp_path / f"rank{rank}.txt").exists()
             for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    where = ["forward", "step"]
    assert sorted(line.split()[1] for line in lines) == sorted(["0", "1"] * len(where)), done.stdout
    for line in lines:
        assert "2 processes" in line and "made by offload.wrap() for 1" in line and "then call offload.wrap()" in line
        assert line.split()[4].rstrip(":") in where


def test_a_model_inside_data_parallel_is_refused_at_wrap():
    with pytest.raises(OffloadConfigError, match="DataParallel.*wrap the plain model"):
        offload.wrap(torch.nn.DataParallel(TinyGPT()), tier="cpu", device="cpu")
