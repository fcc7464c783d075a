"""`TokenWindows`: random windows of a token corpus on disk, as int64 batches, seeded and resumable."""

from __future__ import annotations

import enum
import os
from typing import Any, Dict, Optional, Protocol, Union

import torch

from offload.data.dali_reader import INSTALL, DaliWindowStream, check_dali_limits, dali_available
from offload.data.numpy_reader import NumpyWindowStream
from offload.data.token_files import open_token_files
from offload.data.windows import WindowSampler
from offload.errors import OffloadConfigError


class Backend(enum.Enum):
    AUTO = "auto"
    DALI = "dali"
    NUMPY = "numpy"


class WindowStream(Protocol):
    def next(self) -> torch.Tensor: ...

    def close(self) -> None: ...


class TokenWindows:
    """An endless iterator of `(batch_size, seq_len + 1)` int64 batches, each row `seq_len + 1` consecutive
    tokens from a random offset of `path` (a `.npy` of uint16/int32 ids, or a directory of such shards):
    inputs `batch[:, :-1]`, next-token targets `batch[:, 1:]`.

    The windows are a function of `seed`, the rank and the batch number only, so both backends read the same
    windows, and `state_dict()` (a counter) resumes the stream exactly; `engine.save(path, data=windows)`
    carries it. `backend="auto"`: on a CUDA `device` with NVIDIA DALI installed, DALI's GPU numpy reader
    (a region of interest per window; batches delivered on the device); otherwise the numpy reader (one
    pread per window, readahead off, a background thread), which on the CPU reads less and costs less CPU
    than DALI's CPU reader (benchmarks/bench_data.py; `backend="dali"` still runs it, `o_direct=True` for
    its O_DIRECT mode, which reads whole files). Under torch.distributed each rank draws its own windows
    (`rank` defaults to the process group's rank).

    The token files must not change while they are read: replace one by writing a new file and renaming it
    into place (`write_tokens` does), which an open reader never sees. The numpy reader raises
    `OffloadIntegrityError` naming a file rewritten in place ([Note: a token file changed while read]).
    """

    def __init__(self, path: "Union[str, os.PathLike[str]]", seq_len: int, batch_size: int, seed: int = 0,
                 backend: str = "auto", device: "Union[str, torch.device, None]" = None, *,
                 rank: Optional[int] = None, prefetch: int = 2, o_direct: bool = False) -> None:
        if seq_len < 1 or batch_size < 1:
            raise OffloadConfigError(f"TokenWindows needs seq_len >= 1 and batch_size >= 1; got seq_len={seq_len}, "
                                     f"batch_size={batch_size}")
        self.files = open_token_files(path, seq_len + 1)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, int(seed)
        self.device = torch.device(device) if device is not None else None
        self.backend = _choose_backend(_parse_backend(backend), self.files, self.device)
        if o_direct and self.backend is not Backend.DALI:
            raise OffloadConfigError("TokenWindows o_direct=True applies to DALI's reader (backend=\"dali\"); the "
                                     "numpy reader already reads only the windows' pages")
        self.sampler = WindowSampler(self.files, seq_len + 1, batch_size, self.seed, _default_rank(rank))
        self.batches = 0  # batches handed out: the stream's position
        self._prefetch, self._o_direct = prefetch, o_direct
        self._stream: Optional[WindowStream] = None

    def __iter__(self) -> "TokenWindows":
        return self

    def __next__(self) -> torch.Tensor:
        if self._stream is None:
            self._stream = self._open(self.batches)
        batch = self._stream.next()
        self.batches += 1
        return batch

    def _open(self, start: int) -> WindowStream:
        if self.backend is Backend.DALI:
            return DaliWindowStream(self.files, self.sampler, start, self.device, self._prefetch, self._o_direct)
        return NumpyWindowStream(self.files, self.sampler, start, self.device, self._prefetch)

    def state_dict(self) -> Dict[str, Any]:
        """The stream's position and what it is valid for (rank-independent: each rank resumes its own)."""
        return {"batches": self.batches, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "files": self.files.fingerprint()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position; the next batch is the one that followed it."""
        saved = {k: state.get(k) for k in ("seed", "seq_len", "batch_size")}
        mine = {"seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size}
        if saved != mine:
            raise OffloadConfigError(f"this TokenWindows state was saved with {saved}, but these windows have {mine}; "
                                     "build TokenWindows with the saved settings to resume the same stream")
        files = [tuple(f) for f in state.get("files", [])]
        if files != [tuple(f) for f in self.files.fingerprint()]:
            raise OffloadConfigError(f"this TokenWindows state was saved over token files {files}, not "
                                     f"{self.files.fingerprint()}; resume over the same files")
        self.close()
        self.batches = int(state["batches"])

    def close(self) -> None:
        """Stop the reader (its thread or pipeline); iterating again reopens it where the stream stands."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> "TokenWindows":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"TokenWindows({len(self.files.shards)} shard(s), {self.files.tokens} {self.files.dtype} tokens, "
                f"seq_len={self.seq_len}, batch_size={self.batch_size}, seed={self.seed}, "
                f"backend={self.backend.value}, at batch {self.batches})")


def _parse_backend(backend: str) -> Backend:
    try:
        return Backend(backend)
    except ValueError:
        raise OffloadConfigError(f"TokenWindows backend={backend!r}; choose one of "
                                 f"{[b.value for b in Backend]}") from None


def _choose_backend(wanted: Backend, files: Any, device: Optional[torch.device]) -> Backend:
    if wanted is Backend.NUMPY or (wanted is Backend.AUTO and (device is None or device.type != "cuda")):
        return Backend.NUMPY  # on the CPU numpy reads less than DALI's CPU reader ([Note: token windows])
    if not dali_available():
        if wanted is Backend.DALI:
            raise OffloadConfigError(f"TokenWindows backend=\"dali\" needs NVIDIA DALI: {INSTALL}")
        return Backend.NUMPY
    if wanted is Backend.DALI:
        check_dali_limits(files)
        return wanted
    try:
        check_dali_limits(files)
    except OffloadConfigError:
        return Backend.NUMPY  # a shard beyond DALI's int32 coordinates: numpy reads it
    return Backend.DALI


def _default_rank(rank: Optional[int]) -> int:
    if rank is not None:
        return int(rank)
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
