"""Several nodes (issue 27): two torchrun launchers, `--nnodes 2`, one rank each, meeting on 127.0.0.1 as two
machines would (a c10d rendezvous, and the static one `--node_rank` / `accelerate launch --machine_rank` use).

Each "node" has a directory of its own for its `nvme_path` (the swap file of its optimizer part) and its
results; only the checkpoint directory is shared. Where the test may (root, `unshare`), each launcher runs in
a mount namespace of its own in which the other node's directory is an empty one, so nothing a node needs
can come from the other's disk; a checkpoint directory node 1 does not share is refused. The run must train exactly as one process on the whole
batch (losses and weights within 1e-5, as in tests/test_data_parallel.py: fp32 on the CPU, lr 1e-3, global
norm clipping on), keep the two ranks bit-identical, and save a checkpoint that one process loads with the
very weights and optimizer state the nodes held, and then continues as the nodes did.
The ranks run in tests/multinode_child.py. `ENGINES` holds the engine settings the run is checked under
(replicated weights, and `shard_weights=True`): a mode added later is one more entry.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from tests.models import TinyGPT, make_batches, one_intraop_thread
from tests.test_data_parallel import optimizer_tensors

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "multinode_child.py"
LAUNCH_SECONDS = 240
CASE = dict(steps=4, micro=1, batch=4, save_at=2)
ENGINES = {
    "replicated": dict(tier="nvme", lr=1e-3, max_grad_norm=1.0, shard_weights=False),
    "sharded": dict(tier="nvme", lr=1e-3, max_grad_norm=1.0, shard_weights=True),  # each rank 1/N of the weights
}

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)

# a launch that failed for these reasons (the port was taken between choosing and binding it) is retried once
PORT_TROUBLE = ("EADDRINUSE", "address already in use", "RendezvousConnectionError", "RendezvousTimeoutError",
                "DistNetworkError")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def can_isolate() -> bool:
    """Whether a launcher can run in a mount namespace of its own (root, util-linux `unshare`), where the
    other node's directory is hidden: then no node can read another's local disk, as on two machines."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


def isolated(command: List[str], mounts: List[Tuple[Path, Path]]) -> List[str]:
    """`command` in a mount namespace of its own in which each (source, target) is bind-mounted over target."""
    script = 'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 99; shift 2; done; shift; exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
            *[str(p) for pair in mounts for p in pair], "--", *command]


def node_command(rendezvous: str, node: int, port: int, node_dir: Path, shared: Path, spec: Path) -> List[str]:
    """One node's launcher. c10d: every node runs the same command (ranks in the order the nodes join; node 0
    hosts the rendezvous store, and the join gives up well within the test's own limit). static: `--node_rank`
    and the master address, as `accelerate launch --machine_rank --main_process_ip --main_process_port` run it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--max-restarts", "0"]
    if rendezvous == "c10d":
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                    f"offload-multinode-{port}", "--rdzv-conf", f"is_host={str(node == 0).lower()},join_timeout=120",
                    "--local-addr", "127.0.0.1"]
    else:
        command += ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    return command + [str(CHILD), str(ROOT), str(node_dir), str(shared), str(spec)]


def die_with_the_test() -> None:
    """In a launcher, before it runs (Linux): killed when the test process dies, even by SIGKILL, where no
    clean-up of ours runs; its workers then exit too (multinode_child.exit_with_the_launcher)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop(procs: List[subprocess.Popen], node_dirs: List[Path]) -> None:
    """Every launcher and every worker gone: SIGTERM to each launcher's process group (torchrun passes it on
    to its workers), SIGKILL to whatever is left, then to any worker still alive (torchrun starts them in
    sessions of their own; each wrote its pid)."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for node_dir in node_dirs:
        for pid_file in node_dir.glob("worker-*.pid"):
            pid = int(pid_file.read_text())
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    mine = str(CHILD).encode() in f.read()
            except OSError:
                continue  # already gone
            if mine:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def launch(tmp: Path, case: dict, rendezvous: str, shared_checkpoints: bool = True) -> Tuple[bool, str]:
    """Both launchers at once on a port chosen just before; (succeeded, their output). Where it can, each node
    sees an empty directory in place of the other's (and with `shared_checkpoints=False`, node 1 an empty one
    of its own in place of the shared directory)."""
    shared = tmp / "shared"
    node_dirs = [tmp / f"node{n}" for n in (0, 1)]
    blank, own_shared = tmp / "blank", tmp / "unshared"
    for d in (shared, *node_dirs, blank, own_shared):
        d.mkdir(parents=True)
    spec = tmp / "case.json"
    spec.write_text(json.dumps(case))
    port = free_port()
    procs, logs = [], []
    try:
        for node, node_dir in enumerate(node_dirs):
            command = node_command(rendezvous, node, port, node_dir, shared, spec)
            if can_isolate():
                mounts = [(blank, node_dirs[1 - node])]
                if node == 1 and not shared_checkpoints:
                    mounts.append((own_shared, shared))
                command = isolated(command, mounts)
            log = open(tmp / f"launcher{node}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(command, cwd=node_dir,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_the_test if sys.platform == "linux" else None))
        deadline = time.monotonic() + LAUNCH_SECONDS
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break  # done, or one failed: the other would only wait for it
            time.sleep(0.2)
        ok = all(p.poll() == 0 for p in procs)
    finally:
        stop(procs, node_dirs)
        for log in logs:
            log.close()
    output = "\n".join(f"--- node {n} (rc {p.returncode}) ---\n{(tmp / f'launcher{n}.log').read_text()[-5000:]}"
                       for n, p in enumerate(procs))
    return ok, output


def run_two_nodes(tmp_path: Path, options: dict, rendezvous: str, shared_checkpoints: bool = True
                  ) -> Tuple[Path, List[dict]]:
    """The 2-node run of `options` (retried once, in a fresh directory, if the rendezvous port was taken);
    the directory of attempt that ran and each rank's results, by rank."""
    case = dict(CASE, options=options, save_fails=not shared_checkpoints)
    for attempt in (0, 1):
        tmp = tmp_path / f"attempt{attempt}"
        ok, output = launch(tmp, case, rendezvous, shared_checkpoints)
        if ok or attempt == 1 or not any(word in output for word in PORT_TROUBLE):
            break
    assert ok, output
    results = [torch.load(tmp / f"node{n}" / "result.pt", weights_only=False) for n in (0, 1)]
    for node, result in enumerate(results):
        result["node"] = node
    return tmp, sorted(results, key=lambda r: r["rank"])


def one_process(options: dict, nvme: Path, steps: range, load: Optional[Path] = None,
                save: Optional[Path] = None) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """The same engine in one process on the whole batch, for `steps`: (losses, weights after loading or at the
    start, weights at the end)."""
    import offload

    torch.manual_seed(0)
    nvme.mkdir(parents=True, exist_ok=True)
    engine = offload.wrap(TinyGPT(), **dict(options, dtype=torch.float32, device="cpu", nvme_path=str(nvme)))
    if load is not None:
        engine.load(str(load))
    start = engine.state_dict()
    if save is not None:
        engine.save(str(save))
    losses = []
    batches = make_batches(CASE["steps"], CASE["micro"], batch=CASE["batch"])
    for i in steps:
        for idx, tgt in batches[i]:
            loss = engine(idx, tgt)
            (loss / len(batches[i])).backward()
            losses.append(float(loss.detach()))
        engine.step()
        engine.zero_grad()
    end = engine.state_dict()
    engine.close()
    return losses, start, end


def assert_close(name: str, ours: List[float], expected: List[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(ours, expected)]
    assert len(ours) == len(expected) and max(diffs) < 1e-5, (name, diffs)


def assert_weights_close(name: str, ours: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert ours.keys() == expected.keys(), name
    for key, value in expected.items():
        err = (ours[key].float() - value.float()).abs().max().item()
        assert err < 1e-5, (name, key, err)


@pytest.mark.parametrize("engine,rendezvous", [("replicated", "c10d"), ("replicated", "static"), ("sharded", "c10d")])
def test_two_nodes_train_as_one_process_and_their_checkpoint_loads_in_one(tmp_path, engine, rendezvous):
    options = ENGINES[engine]
    run, ranks = run_two_nodes(tmp_path, options, rendezvous)
    shared = run / "shared"
    steps, save_at = CASE["steps"], CASE["save_at"]

    # two nodes of one rank each: each its own part of the optimizer state under its own nvme_path
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["local_world"] == 1 for r in ranks)  # the CPU Adam's threads are split per machine
    assert all(r["save_error"] is None for r in ranks)
    assert all(r["shard_world"] == (2 if options["shard_weights"] else 1) for r in ranks)  # each rank 1/2 of them
    for r in ranks:
        assert r["nvme"] == [f"rank-{r['rank']}"], r["nvme"]
    if can_isolate():  # as on two machines: neither node could read the other's directory
        assert [r["peers"] for r in sorted(ranks, key=lambda r: r["node"])] == [{"node1": []}, {"node0": []}]
    if rendezvous == "static":
        assert [r["node"] for r in ranks] == [0, 1]  # --node_rank is the rank (c10d: the order of joining)
    # bit-identical ranks, after every step and at the save
    assert all(r["agree"] == [True] * steps for r in ranks), [r["agree"] for r in ranks]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for a, b in ((ranks[0]["weights"], ranks[1]["weights"]), (ranks[0]["saved_weights"], ranks[1]["saved_weights"])):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    nodes = ranks[0]

    # exactly as one process on the whole batch, same engine settings
    losses, _, weights = one_process(options, tmp_path / "one" / "nvme", range(steps))
    assert_close("two nodes against one process", nodes["losses"], losses)
    assert_weights_close("two nodes against one process", nodes["weights"], weights)

    # the shared file system got the checkpoint and nothing else: the manifest and model (rank 0), each
    # rank's optimizer part
    assert sorted(p.name for p in shared.iterdir()) == ["ck"]
    assert sorted(p.name for p in (shared / "ck").iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer-00000-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors"]
    assert json.loads((shared / "ck" / "manifest.json").read_text())["world_size"] == 2

    # one process loads it: the nodes' weights and optimizer state at the save, bit for bit ...
    resaved = tmp_path / "one" / "ck-resaved"
    rest, loaded, final = one_process(options, tmp_path / "one" / "nvme-resumed", range(save_at, steps),
                                      load=shared / "ck", save=resaved)
    assert loaded.keys() == nodes["saved_weights"].keys()
    for key, value in nodes["saved_weights"].items():
        assert torch.equal(loaded[key], value), key
    theirs, mine = optimizer_tensors(shared / "ck"), optimizer_tensors(resaved)
    assert theirs.keys() == mine.keys() and len(theirs) > 0
    for name in theirs:
        assert torch.equal(theirs[name], mine[name]), name
    # ... and goes on as the two nodes did
    assert_close("one process resumed from the nodes' checkpoint", rest, nodes["losses"][save_at:])
    assert_weights_close("one process resumed from the nodes' checkpoint", final, nodes["weights"])


@pytest.mark.skipif(not can_isolate(), reason="needs root and util-linux unshare: a mount namespace per node")
def test_a_checkpoint_directory_the_nodes_do_not_share_is_refused_on_every_rank(tmp_path):
    """Node 1 sees a directory of its own where node 0 sees the shared one: engine.save raises on both ranks
    naming the cause, leaves nothing behind in either, and training goes on."""
    run, ranks = run_two_nodes(tmp_path, ENGINES["replicated"], "static", shared_checkpoints=False)
    for r in ranks:
        message = r["save_error"] or ""
        assert "rank 1 could not write its part of checkpoint" in message, message
        assert "which this rank does not see" in message and "every node sees" in message, message
        assert "nothing was switched" in message, message
        assert r["agree"] == [True] * CASE["steps"]
    assert list((run / "shared").iterdir()) == [] and list((run / "unshared").iterdir()) == []
