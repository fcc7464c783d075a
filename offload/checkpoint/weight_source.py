"""`WeightSource`: the tensors of a pretrained checkpoint, read one at a time by name.

`wrap(model, weights=PATH)` fills each block's buffers from here as the block is materialized, so a model
larger than RAM never exists whole in memory. PATH is a `.safetensors` file, a directory of Hugging Face
shards (`model.safetensors.index.json`, as `save_pretrained` writes them) or with one `model.safetensors`
(when a directory holds both, the single file, as transformers' `from_pretrained` chooses), or an offload
checkpoint directory (its `model.safetensors`, every tensor checked against the manifest's checksum as it
is read, as `engine.load` checks it). Opening reads only the headers; each `read` preads one tensor's bytes
into a tensor of its own (or straight into the caller's buffer): no file is mapped, because mapped shards
stay resident in the process (a checkpoint's worth of RSS while loading).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from offload.checkpoint.atomic import MANIFEST, resolve
from offload.checkpoint.manifest import MODEL_FILE, read_manifest
from offload.checkpoint.tensor_file import dtype_of_code
from offload.checksum import checksum
from offload.errors import OffloadConfigError, OffloadIntegrityError

HF_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checksums(NamedTuple):
    """What an offload checkpoint's manifest says each tensor of its weights file must hash to."""

    algorithm: str
    by_name: Dict[str, int]


class WeightSource:
    """Names, shapes and dtypes of every tensor at `path` (headers only), and `read(name)`."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._where: Dict[str, Tuple[str, int, int]] = {}  # name -> (file, first byte, end byte)
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, torch.dtype] = {}
        files, self._checksums = _files_of(self.path)
        for file in files:
            base, header = _read_header(file)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = dtype_of_code(info.get("dtype", ""))
                if dtype is None:
                    raise OffloadConfigError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, which "
                                             "offload cannot load")
                first, stop = info["data_offsets"]
                self._where[name] = (file, base + first, base + stop)
                self.shapes[name] = tuple(info["shape"])
                self.dtypes[name] = dtype

    def names(self) -> List[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> Tensor:
        """One tensor, as stored, in memory of its own (a CPU tensor)."""
        out = torch.empty(self.shapes[name], dtype=self.dtypes[name])
        self.read_into(name, out)
        return out

    @property
    def verifies(self) -> bool:
        """Whether reads are checked against checksums (an offload checkpoint's): only whole tensors can be."""
        return self._checksums is not None

    def read_into(self, name: str, out: Tensor) -> None:
        """Tensor `name`'s bytes into the contiguous CPU tensor `out` of its dtype and size (checked against
        the manifest's checksum when the weights are an offload checkpoint's)."""
        file, first, stop = self._where[name]
        view = _bytes_of(out)
        if len(view) != stop - first or out.dtype != self.dtypes[name]:
            raise OffloadConfigError(f"{file}: tensor {name!r} is {self.dtypes[name]} {list(self.shapes[name])}, "
                                     f"asked for {out.dtype} with {out.numel()} elements")
        _read_exactly(file, name, view, first)
        if self._checksums is not None:
            self._verify(name, file, view)

    def read_range_into(self, name: str, start: int, out: Tensor) -> None:
        """Elements [start, start + out.numel()) of tensor `name` (flattened) into the contiguous CPU tensor `out` of
        its dtype: a data-parallel rank's part (sharded weights). Unverified: use `read_into` where `verifies`."""
        file, first, stop = self._where[name]
        view = _bytes_of(out)
        offset = first + start * out.element_size()
        if out.dtype != self.dtypes[name] or start < 0 or offset + len(view) > stop:
            raise OffloadConfigError(f"{file}: tensor {name!r} is {self.dtypes[name]} {list(self.shapes[name])}, "
                                     f"asked for {out.dtype} elements [{start}, {start + out.numel()})")
        _read_exactly(file, name, view, offset)

    def _verify(self, name: str, file: str, view: memoryview) -> None:
        assert self._checksums is not None
        expected = self._checksums.by_name.get(name)
        if expected is None:
            raise OffloadIntegrityError(f"the manifest beside {file!r} has no checksum for tensor {name!r}: the "
                                        "checkpoint is incomplete or was edited", file)
        if checksum(view, self._checksums.algorithm) != expected:
            raise OffloadIntegrityError(f"checksum mismatch in {file!r}, tensor {name!r}: the file was damaged "
                                        "after it was written; load an intact copy (or an earlier checkpoint)", file)

    def __repr__(self) -> str:
        return f"WeightSource({self.path!r}, {len(self._where)} tensors)"


def _bytes_of(out: Tensor) -> memoryview:
    """`out`'s bytes, viewed by address: Tensor.numpy() would mark the storage unresizable, and a streamed block's
    buffer must shrink to zero bytes when it is released."""
    assert out.is_contiguous() and out.device.type == "cpu"
    return memoryview((ctypes.c_char * (out.numel() * out.element_size())).from_address(out.data_ptr())).cast("B")


def _read_exactly(file: str, name: str, view: memoryview, offset: int) -> None:
    with open(file, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise OffloadConfigError(f"{file}: short read of tensor {name!r} (truncated file?)")
            done += got


def _read_header(file: str) -> Tuple[int, dict]:
    """(offset of the data, the JSON header) of a safetensors file."""
    with open(file, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        try:
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError("header length out of range")
            return 8 + length, json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            raise OffloadConfigError(f"{file} is not a readable safetensors file ({exc})") from None


def _files_of(path: str) -> Tuple[List[str], Optional[Checksums]]:
    """The safetensors files PATH stands for, with the checksums an offload checkpoint records for them; an
    error that lists the accepted forms otherwise."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise OffloadConfigError(f"weights={path!r} is a file but not .safetensors; pass a .safetensors file, a "
                                     f"directory of Hugging Face shards ({HF_INDEX}) or an offload checkpoint")
        return [path], None
    if not os.path.isdir(path):
        raise OffloadConfigError(f"weights={path!r} does not exist")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return _checkpoint_weights(resolve(path))
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):  # before the index, as transformers' from_pretrained chooses
        return [single], None
    index = os.path.join(path, HF_INDEX)
    if os.path.isfile(index):
        return _shards_of(path, index), None
    raise OffloadConfigError(f"weights={path!r} holds neither {HF_INDEX} nor {SINGLE_FILE}; pass a .safetensors "
                             "file, a directory of Hugging Face shards or an offload checkpoint directory")


def _checkpoint_weights(directory: str) -> Tuple[List[str], Optional[Checksums]]:
    manifest = read_manifest(directory)
    info = manifest.get("files", {}).get(MODEL_FILE)
    if info is None:
        raise OffloadIntegrityError(f"the manifest of {directory!r} lists no {MODEL_FILE}: not a complete offload "
                                    "checkpoint", directory)
    return [os.path.join(directory, MODEL_FILE)], Checksums(manifest["checksum"], dict(info["checksums"]))


def _shards_of(path: str, index: str) -> List[str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise OffloadConfigError(f"{index} is damaged ({type(exc).__name__}: {exc}); it should be JSON with a "
                                 "\"weight_map\" of tensor name -> shard file, as save_pretrained writes it: "
                                 "save the model again, or copy the index from the model's source") from None
    missing = [f for f in files if not isinstance(f, str) or not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise OffloadConfigError(f"{index} names shards that are missing: {', '.join(map(str, missing[:5]))}")
    return [os.path.join(path, f) for f in files]
