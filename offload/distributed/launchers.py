"""Where a process stands, as each launcher tells it: its rank and world (for a warning when the process group was
never started) and its place on its machine (local rank and local world size).

The rank and the world size of a data-parallel engine are the process group's (`dist.get_rank()`,
`dist.get_world_size()`), whichever launcher started the processes. Its place on the machine is not: each launcher
says it its own way, and the engine needs it to share the machine's cores among its ranks, and to tell a rank
which GPU is its own.

| launcher | rank, world | local rank | local world size |
| --- | --- | --- | --- |
| `torchrun`, `accelerate launch` | RANK, WORLD_SIZE | LOCAL_RANK | LOCAL_WORLD_SIZE |
| `python -m torch.distributed.launch` | RANK, WORLD_SIZE | LOCAL_RANK (torch >= 2.0; older ones only with `--use-env`) and the argument `--local-rank=N` (`--local_rank=N` before torch 2.0) | LOCAL_WORLD_SIZE (torch >= 2.0) |
| `deepspeed` | RANK, WORLD_SIZE | LOCAL_RANK and the argument `--local_rank=N` | LOCAL_SIZE |
| `mpirun` (Open MPI, MPICH / Intel MPI, MVAPICH) | OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, MV2_COMM_WORLD_RANK/SIZE | ..._LOCAL_RANK, MPI_LOCALRANKID | ..._LOCAL_SIZE, MPI_LOCALNRANKS |

The environment comes first, then the `--local-rank` / `--local_rank` argument; a local world size no launcher
gave is taken to be the whole world (one machine).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

# (variable, launcher) in the order they are read
RANK_AND_WORLD = (("RANK", "WORLD_SIZE", "torchrun / accelerate launch / deepspeed / torch.distributed.launch"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
                  ("PMI_RANK", "PMI_SIZE", "MPICH / Intel MPI"),
                  ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MVAPICH"))
LOCAL_RANK = (("LOCAL_RANK", "torchrun / accelerate launch / deepspeed / torch.distributed.launch"),
              ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI's mpirun"), ("MPI_LOCALRANKID", "MPICH / Intel MPI"),
              ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH"))
LOCAL_WORLD = (("LOCAL_WORLD_SIZE", "torchrun / accelerate launch / torch.distributed.launch"),
               ("LOCAL_SIZE", "deepspeed"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI's mpirun"),
               ("MPI_LOCALNRANKS", "MPICH / Intel MPI"), ("MV2_COMM_WORLD_LOCAL_SIZE", "MVAPICH"))
LOCAL_RANK_ARGS = ("--local-rank", "--local_rank")  # the legacy launchers' argument (torch.distributed.launch, deepspeed)

Found = Tuple[Optional[int], str, str]  # (value or None, the variable or argument, the launcher that sets it)
_NONE: Found = (None, "", "")


@dataclass(frozen=True)
class LocalPlace:
    """This process's place on its machine; None where no launcher said it. `source` names where each came from."""

    local_rank: Optional[int]
    local_world: Optional[int]
    source: str


def local_place(environ: Optional[Mapping[str, str]] = None, argv: Optional[Sequence[str]] = None) -> LocalPlace:
    """The local rank and local world size the launcher gave this process (the module docstring's table)."""
    environ = os.environ if environ is None else environ
    local_rank = _first_int(environ, LOCAL_RANK)
    if local_rank[0] is None:
        local_rank = _local_rank_argument(sys.argv if argv is None else argv)
    local_world = _first_int(environ, LOCAL_WORLD)
    said = [f"{name}={value} ({launcher})" for value, name, launcher in (local_rank, local_world) if value is not None]
    return LocalPlace(local_rank[0], local_world[0], "; ".join(said) or "no launcher said it")


def launched_rank_and_world(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int, str]]:
    """(rank, world size, which variables said it) when a launcher started this process as one of several."""
    environ = os.environ if environ is None else environ
    for rank_key, world_key, launcher in RANK_AND_WORLD:
        rank, world = _int(environ.get(rank_key)), _int(environ.get(world_key))
        if rank is not None and world is not None and world > 1:
            return rank, world, f"{rank_key}={rank}, {world_key}={world}: {launcher}"
    return None


def _first_int(environ: Mapping[str, str], keys: Sequence[Tuple[str, str]]) -> Found:
    for key, launcher in keys:
        value = _int(environ.get(key))
        if value is not None:
            return value, key, launcher
    return _NONE


def _local_rank_argument(argv: Sequence[str]) -> Found:
    """`--local-rank=N`, `--local_rank=N`, or either followed by N, as argparse would read them."""
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in LOCAL_RANK_ARGS:
            number = _int(value if equals else (argv[i + 1] if i + 1 < len(argv) else None))
            if number is not None:
                return number, name, "the legacy launchers' argument"
    return _NONE


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
