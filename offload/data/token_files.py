"""Which token arrays a `TokenWindows` reads: one `.npy` file or a directory of `.npy` shards, checked once.

Only the headers are read here (`npy_header`, which the numpy reader maps the data behind), so a token
file larger than RAM costs nothing to open. Every problem a user can fix is raised here, before any
training step, with the file it concerns and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, List, Tuple

import numpy as np

from offload.errors import OffloadConfigError

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))
MAKE_ONE = ("make one with `python -m offload tokenize --tokenizer DIR input.txt out.npy` or "
            "`offload.data.write_tokens(path, tokens)`")


@dataclass(frozen=True)
class TokenShard:
    """One 1-D token array on disk."""

    path: str
    tokens: int


@dataclass(frozen=True)
class TokenFiles:
    """The shards of one token corpus, all of one dtype, each long enough for a window."""

    shards: Tuple[TokenShard, ...]
    dtype: np.dtype

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def fingerprint(self) -> List[Tuple[str, int]]:
        """What a saved stream position is only valid for: each shard's name and length."""
        return [(os.path.basename(s.path), s.tokens) for s in self.shards]


def open_token_files(path: "os.PathLike[str] | str", window: int) -> TokenFiles:
    """Check `path` (a `.npy` file, or a directory of them) for windows of `window` tokens."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise OffloadConfigError(f"token file {path!r} does not exist; {MAKE_ONE}")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".npy"))
        if not names:
            raise OffloadConfigError(f"token directory {path!r} holds no .npy files; put token shards "
                                     f"(1-D uint16 or int32 arrays) there, or {MAKE_ONE}")
        paths = [os.path.join(path, n) for n in names]
    else:
        paths = [path]
    shards, dtypes = [], set()
    for file in paths:
        tokens, dtype = _header(file)
        if tokens < window:
            raise OffloadConfigError(
                f"token file {file!r} holds {tokens} tokens, fewer than one window of seq_len + 1 = {window}; "
                "use a shorter seq_len, or join short files into longer shards")
        shards.append(TokenShard(file, tokens))
        dtypes.add(dtype)
    if len(dtypes) > 1:
        raise OffloadConfigError(f"the shards in {path!r} mix dtypes {sorted(str(d) for d in dtypes)}; write every "
                                 "shard with one dtype (uint16 when the vocabulary fits 65536 ids, int32 otherwise)")
    return TokenFiles(tuple(shards), dtypes.pop())


def npy_header(file: "str | BinaryIO") -> Tuple[Tuple[int, ...], np.dtype, int]:
    """(shape, dtype, byte offset of the data) of a .npy file (a path, or a binary file at its start), from
    its header alone."""
    if not isinstance(file, str):
        version = np.lib.format.read_magic(file)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read(file)
        return shape, dtype, file.tell()
    with open(file, "rb") as f:
        return npy_header(f)


def _header(file: str) -> Tuple[int, np.dtype]:
    if not file.endswith(".npy"):
        raise OffloadConfigError(f"token file {file!r} is not a .npy file; {MAKE_ONE}")
    try:
        shape, dtype, offset = npy_header(file)
    except (ValueError, OSError) as exc:
        raise OffloadConfigError(f"token file {file!r} is not a readable .npy array ({exc}); {MAKE_ONE}") from None
    if len(shape) != 1:
        raise OffloadConfigError(f"token file {file!r} has shape {shape}; token files are 1-D arrays "
                                 "(flatten it: np.save(path, tokens.reshape(-1)))")
    if dtype not in TOKEN_DTYPES:
        raise OffloadConfigError(f"token file {file!r} has dtype {dtype}; token files hold uint16 or int32 "
                                 "ids (np.save(path, tokens.astype(np.uint16)) when every id is below 65536, "
                                 "else int32)")
    if os.path.getsize(file) < offset + shape[0] * dtype.itemsize:
        raise OffloadConfigError(f"token file {file!r} is shorter than its header says (cut off while written?); "
                                 "write it again")
    return int(shape[0]), dtype


def write_tokens(path: "os.PathLike[str] | str", tokens: "np.ndarray") -> str:
    """Save `tokens` (integer ids: a numpy array, a torch tensor or a list) as a token file: uint16 when every
    id fits, int32 otherwise. Written to a temporary name and renamed, so a reader never sees half a file.
    Returns the path.

    The ids must be integers in [0, 2**31): a float array is refused even when every value is whole (ids
    that passed through floats are usually a bug upstream, and a cast would truncate 1.7 to 1 silently:
    round them yourself), and so are bools, negative ids (padding or ignore_index) and ids beyond int32."""
    path = os.fspath(path)
    flat = np.asarray(tokens).reshape(-1)
    if flat.size and (flat.dtype == np.bool_ or not np.issubdtype(flat.dtype, np.integer)):
        raise OffloadConfigError(
            f"write_tokens({path!r}): the ids have dtype {flat.dtype}, not integers; token ids are integer "
            "indices into the vocabulary (pass the tokenizer's ids; for floats that are whole ids, "
            "np.rint(tokens).astype(np.int64) after checking they are)")
    if flat.size:
        low, high = int(flat.min()), int(flat.max())
        if low < 0:
            at = int(np.argmax(flat < 0))
            raise OffloadConfigError(
                f"write_tokens({path!r}): negative id {int(flat[at])} at index {at}; token ids lie in [0, 2**31) "
                "(a negative id is usually padding or ignore_index such as -100: drop those positions "
                "before writing)")
        if high > np.iinfo(np.int32).max:
            at = int(np.argmax(flat > np.iinfo(np.int32).max))
            raise OffloadConfigError(
                f"write_tokens({path!r}): id {int(flat[at])} at index {at} does not fit a token file's int32 "
                f"(at most {np.iinfo(np.int32).max}); pass ids from the tokenizer's vocabulary")
    dtype = np.uint16 if not flat.size or int(flat.max()) < 65536 else np.int32
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, flat.astype(dtype, copy=False))
    os.replace(tmp, path)
    return path
