"""One rank of the multi-node test (tests/test_multinode.py), started by one of two torchrun launchers.

`torchrun --nnodes 2 --nproc_per_node 1 ... tests/multinode_child.py <repo> <node dir> <shared dir> <case.json>`.
The node directory stands for the node's own disks: its `nvme_path` (`<node dir>/nvme`) and this rank's
results (`<node dir>/result.pt`); the shared directory stands for the file system every node sees and gets
only the checkpoint (`<shared dir>/ck`). TinyGPT trains data-parallel, each rank on its half of every
batch; the checkpoint is saved before step `save_at`. Rank 1 starts from other weights: the engine must
start every rank from rank 0's.
"""

from __future__ import annotations

import os
import sys


def exit_with_the_launcher() -> None:
    """torchrun starts each worker in a session of its own: a launcher killed outright (SIGKILL, or as the
    test process died) would leave it behind, blocked in a collective or in connecting to the launcher's
    store (holding the GIL there: a watching thread could not run). On Linux the kernel kills it when its
    parent goes; a worker whose launcher went before that (while this process started) exits at once."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            command = f.read()
        launcher = b"torch.distributed.run" in command or b"torchrun" in command
    except OSError:
        launcher = False
    if not launcher:
        os._exit(3)


exit_with_the_launcher()  # first, before the imports that take seconds

import datetime  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, sys.argv[1])

import offload  # noqa: E402
from offload.errors import OffloadIOError  # noqa: E402
from tests.dp_child import rank_part, weights_agree  # noqa: E402
from tests.models import TinyGPT, make_batches  # noqa: E402


def train(case: dict, node_dir: str, shared_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0 if rank == 0 else 1000 + rank)
    options = dict(case["options"], dtype=torch.float32, device="cpu", nvme_path=os.path.join(node_dir, "nvme"))
    os.makedirs(options["nvme_path"], exist_ok=True)
    engine = offload.wrap(TinyGPT(), **options)
    losses, agree, saved_weights, save_error = [], [], None, None
    for done, step in enumerate(make_batches(case["steps"], case["micro"], batch=case["batch"])):
        if done == case["save_at"]:
            try:
                engine.save(os.path.join(shared_dir, "ck"))
            except OffloadIOError as exc:  # the test's "shared" directory is not shared: every rank says so
                if not case.get("save_fails"):
                    raise
                save_error = str(exc)
            saved_weights = engine.state_dict()
        for idx, tgt in step:
            loss = engine(rank_part(idx, rank, world), rank_part(tgt, rank, world))
            (loss / len(step)).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        engine.step()
        engine.zero_grad()
        agree.append(weights_agree(engine))
    result = {"rank": rank, "world": world, "local_world": engine.data_parallel.local_world,
              "shard_world": engine.plan.shard_world,
              "losses": losses, "agree": agree, "saved_weights": saved_weights,
              "save_error": save_error, "weights": engine.state_dict(),
              "stats": engine.stats(), "nvme": sorted(os.listdir(options["nvme_path"])),
              # what this node sees of the other nodes' directories (the test hides them where it can)
              "peers": {name: sorted(os.listdir(os.path.join(os.path.dirname(node_dir), name)))
                        for name in os.listdir(os.path.dirname(node_dir))
                        if name.startswith("node") and name != os.path.basename(node_dir)}}
    engine.close()
    torch.save(result, os.path.join(node_dir, "result.pt"))


def main() -> None:
    node_dir, shared_dir = sys.argv[2], sys.argv[3]
    with open(os.path.join(node_dir, f"worker-{os.getpid()}.pid"), "w") as f:  # for the test's clean-up
        f.write(str(os.getpid()))
    case = json.loads(open(sys.argv[4]).read())
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    # a peer that died fails the collectives in a minute instead of gloo's default half hour
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        train(case, node_dir, shared_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
