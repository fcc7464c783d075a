"""Every way people launch several processes (issue 37, item 2): an offload script trains under `deepspeed` and
`python -m torch.distributed.launch` exactly as under torchrun, each rank finding its rank, world, local rank and
local world size, however its launcher says them (offload/distributed/launchers.py).

Two processes on one machine, gloo on the CPU (tests/launcher_child.py: `init_process_group("gloo")`, argparse of
`--local-rank`, 3 steps of 2 micro-batches with clipping). What each launcher gives a rank, read from its code:

- torchrun (the reference): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.
- `python -m torch.distributed.launch --nproc_per_node=2` (torch 2.13: torchrun's environment, plus the argument
  `--local-rank=N`); and as torch before 2.0 launched without `--use-env` (RANK, WORLD_SIZE, MASTER_ADDR/PORT, and
  `--local_rank=N` only: no LOCAL_RANK, no LOCAL_WORLD_SIZE), emulated.
- `deepspeed --num_gpus 2` (deepspeed/launcher/launch.py, 0.19.8: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
  CROSS_RANK, CROSS_SIZE, LOCAL_SIZE and no LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES, and `--local_rank=N` before the
  script's own arguments): the real launcher where DeepSpeed is installed (its CPU accelerator launches CPU
  processes), and that environment emulated everywhere.

Losses and weights must equal torchrun's bit for bit, the ranks' weights bit-identical. A process launched as one
of several that never starts the process group is warned at wrap(); ranks on one GPU are refused naming the
local rank to pass.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import offload
from offload.distributed.agreement import shared_gpus
from offload.distributed.launchers import launched_rank_and_world, local_place
from tests.models import TinyGPT

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "launcher_child.py"
LAUNCH_SECONDS = 300
# what a launcher may have left in this process's environment, and what the launchers under test set themselves
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(out: Path, command: List[str]) -> Dict[str, Any]:
    out.mkdir()
    done = subprocess.run(command + [str(CHILD), str(ROOT), str(out)], capture_output=True, text=True,
                          timeout=LAUNCH_SECONDS, cwd=out, env=_clean_env())
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    return torch.load(out / "result.pt", weights_only=False)


def _emulate(out: Path, env_of: Any, argument: str) -> Dict[str, Any]:
    """Two processes with the environment `env_of(rank, port)` and `argument=rank` before the script's arguments,
    as the launcher in question starts them."""
    out.mkdir()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-u", str(CHILD), f"{argument}={rank}", str(ROOT), str(out)],
                              env={**_clean_env(), **env_of(rank, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=out) for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_SECONDS)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs), [o[-4000:] for o in outputs]
    return torch.load(out / "result.pt", weights_only=False)


def _deepspeed_env(rank: int, port: int) -> Dict[str, str]:
    """deepspeed/launcher/launch.py's main(), one node of 2 local processes."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", CROSS_RANK="0", CROSS_SIZE="1",
                LOCAL_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="0,1")


def _legacy_env(rank: int, port: int) -> Dict[str, str]:
    """torch.distributed.launch before torch 2.0, without --use-env: no LOCAL_RANK (the argument says it)."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return _launch(tmp_path_factory.mktemp("launchers") / "torchrun",
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])


def _assert_as_under_torchrun(result: Dict[str, Any], torchrun: Dict[str, Any], said: List[str],
                              argument: Optional[List[Optional[int]]]) -> None:
    found = result["found"]
    assert [(f["rank"], f["world"], f["local_rank"], f["local_world"]) for f in found] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert [(f["rank"], f["world"], f["local_rank"], f["local_world"]) for f in torchrun["found"]] == \
        [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert all(f["agree"] for f in found)
    for f in found:
        assert all(name in f["place"] for name in said), f["place"]
    if argument is not None:
        assert [f["argument"] for f in found] == argument  # the script's own argparse read the launcher's argument
    assert result["losses"] == torchrun["losses"]  # bit for bit: the same arithmetic
    for key, value in torchrun["weights"].items():
        assert torch.equal(result["weights"][key], value), key


@pytest.mark.slow
@needs_gloo
def test_torch_distributed_launch_trains_as_torchrun(tmp_path: Path, torchrun: Dict[str, Any]) -> None:
    result = _launch(tmp_path / "launch", [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2",
                                           f"--master_port={_free_port()}"])
    _assert_as_under_torchrun(result, torchrun, ["LOCAL_RANK=", "LOCAL_WORLD_SIZE=2"], [0, 1])


@pytest.mark.slow
@needs_gloo
def test_the_legacy_launchers_argument_alone_gives_the_local_rank(tmp_path: Path, torchrun: Dict[str, Any]) -> None:
    """torch.distributed.launch before torch 2.0 without --use-env: `--local_rank=N` and no LOCAL_RANK."""
    result = _emulate(tmp_path / "legacy", _legacy_env, "--local_rank")
    _assert_as_under_torchrun(result, torchrun, ["--local_rank="], [0, 1])
    assert all("LOCAL_WORLD_SIZE" not in f["place"] for f in result["found"])  # the whole world: one machine


@pytest.mark.slow
@needs_gloo
def test_deepspeeds_launch_environment_trains_as_torchrun(tmp_path: Path, torchrun: Dict[str, Any]) -> None:
    """The environment deepspeed/launcher/launch.py gives each rank, emulated (DeepSpeed not needed)."""
    result = _emulate(tmp_path / "deepspeed-env", _deepspeed_env, "--local_rank")
    _assert_as_under_torchrun(result, torchrun, ["LOCAL_RANK=", "LOCAL_SIZE=2 (deepspeed)"], [0, 1])


@pytest.mark.slow
@needs_gloo
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="the deepspeed launcher needs DeepSpeed: pip install deepspeed (DS_BUILD_OPS=0 builds nothing)")
def test_the_deepspeed_launcher_trains_as_torchrun(tmp_path: Path, torchrun: Dict[str, Any]) -> None:
    """`deepspeed --num_gpus 2 script.py`: on a machine without GPUs its CPU accelerator launches 2 processes."""
    result = _launch(tmp_path / "deepspeed", [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                              "--master_port", str(_free_port())])
    _assert_as_under_torchrun(result, torchrun, ["LOCAL_RANK=", "LOCAL_SIZE=2 (deepspeed)"], [0, 1])


# ----- in this process: what each launcher's variables and arguments say ---------------------------------------
@pytest.mark.parametrize("environ, argv, want", [
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, ["train.py"], (1, 4)),  # torchrun, accelerate launch
    ({"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}, ["train.py", "--local_rank=1"], (1, 2)),  # deepspeed
    ({}, ["train.py", "--local-rank=3", "--lr", "1"], (3, None)),  # torch.distributed.launch, torch >= 2.0
    ({}, ["train.py", "--local_rank", "2"], (2, None)),  # the same, before 2.0, as argparse reads it
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, ["train.py"], (0, 8)),  # mpirun
    ({}, ["train.py"], (None, None)),  # no launcher: the local world is the whole world
])
def test_local_place_as_each_launcher_says_it(environ: Dict[str, str], argv: List[str], want: Any) -> None:
    place = local_place(environ, argv)
    assert (place.local_rank, place.local_world) == want


def test_a_process_launched_as_one_of_several_without_a_process_group_is_warned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It would train alone on its part of the data; before: silently."""
    assert not dist.is_initialized()
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    assert launched_rank_and_world() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match=r"launched as rank 1 of 2 \(RANK=1, WORLD_SIZE=2: torchrun.*"
                                            r"Call torch.distributed.init_process_group\(\) before offload.wrap\(\)"):
        offload.wrap(TinyGPT(), tier="cpu", device="cpu").close()


def test_ranks_on_one_gpu_are_refused_naming_the_local_rank() -> None:
    """The check runs in wrap()'s agreement of the ranks on CUDA; here on what the ranks would exchange."""
    every = [{" gpu": "GPU-1 (cuda:0 of h)", " local rank": "0 (LOCAL_RANK=0 (torchrun))"},
             {" gpu": "GPU-1 (cuda:0 of h)", " local rank": "1 (LOCAL_RANK=1 (torchrun))"}]
    message = shared_gpus(every)
    assert message is not None and message.startswith("ranks 0-1 compute on the same GPU (GPU-1 (cuda:0 of h))")
    assert "torch.cuda.set_device(local_rank)" in message and "rank 1: 1 (LOCAL_RANK=1" in message
    assert shared_gpus([{" gpu": "GPU-1", " local rank": "0"}, {" gpu": "GPU-2", " local rank": "1"}]) is None
    assert shared_gpus([{" gpu": "", " local rank": "0"}, {" gpu": "", " local rank": "1"}]) is None  # the CPU
