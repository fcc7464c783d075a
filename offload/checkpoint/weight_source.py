"""`WeightSource`: the tensors of a pretrained checkpoint, read one at a time by name.

`wrap(model, weights=PATH)` fills each block's buffers from here as the block is materialized, so a model
larger than RAM never exists whole in memory. PATH is a `.safetensors` file, a directory of Hugging Face
shards (`model.safetensors.index.json`, as `save_pretrained` writes them) or with one `model.safetensors`,
or an offload checkpoint directory (its `model.safetensors`). Opening reads only the headers; each `read`
preads one tensor's bytes into a tensor of its own (or straight into the caller's buffer): no file is
mapped, because mapped shards stay resident in the process (a checkpoint's worth of RSS while loading).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from offload.checkpoint.atomic import MANIFEST, resolve
from offload.checkpoint.tensor_file import dtype_of_code
from offload.errors import OffloadConfigError

HF_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightSource:
    """Names, shapes and dtypes of every tensor at `path` (headers only), and `read(name)`."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._where: Dict[str, Tuple[str, int, int]] = {}  # name -> (file, first byte, end byte)
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, torch.dtype] = {}
        for file in _files_of(self.path):
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

    def read_into(self, name: str, out: Tensor) -> None:
        """Tensor `name`'s bytes into the contiguous CPU tensor `out` of its dtype and size."""
        file, first, stop = self._where[name]
        assert out.is_contiguous() and out.device.type == "cpu"
        # a view by address: Tensor.numpy() would mark the storage unresizable, and a streamed block's
        # buffer must shrink to zero bytes when it is released
        view = memoryview((ctypes.c_char * (out.numel() * out.element_size())).from_address(out.data_ptr())).cast("B")
        if len(view) != stop - first or out.dtype != self.dtypes[name]:
            raise OffloadConfigError(f"{file}: tensor {name!r} is {self.dtypes[name]} {list(self.shapes[name])}, "
                                     f"asked for {out.dtype} with {out.numel()} elements")
        with open(file, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                got = os.preadv(f.fileno(), [view[done:]], first + done)
                if got <= 0:
                    raise OffloadConfigError(f"{file}: short read of tensor {name!r} (truncated file?)")
                done += got

    def __repr__(self) -> str:
        return f"WeightSource({self.path!r}, {len(self._where)} tensors)"


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


def _files_of(path: str) -> List[str]:
    """The safetensors files PATH stands for; an error that lists the accepted forms otherwise."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise OffloadConfigError(f"weights={path!r} is a file but not .safetensors; pass a .safetensors file, a "
                                     f"directory of Hugging Face shards ({HF_INDEX}) or an offload checkpoint")
        return [path]
    if not os.path.isdir(path):
        raise OffloadConfigError(f"weights={path!r} does not exist")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        path = resolve(path)  # an offload checkpoint: its model.safetensors
    index = os.path.join(path, HF_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise OffloadConfigError(f"{index} names shards that are missing: {', '.join(missing[:5])}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise OffloadConfigError(f"weights={path!r} holds neither {HF_INDEX} nor {SINGLE_FILE}; pass a .safetensors "
                             "file, a directory of Hugging Face shards or an offload checkpoint directory")


