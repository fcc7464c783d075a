"""`WeightSource`: the tensors of a pretrained checkpoint, read one at a time by name.

`wrap(model, weights=PATH)` fills each block's buffers from here as the block is materialized, so a model
larger than RAM never exists whole in memory. PATH is a `.safetensors` file, a directory of Hugging Face
shards (`model.safetensors.index.json`, as `save_pretrained` writes them) or with one `model.safetensors`,
or an offload checkpoint directory (its `model.safetensors`). Only headers are read when opening; each
`read` maps one tensor (safetensors' `safe_open`), never a whole file.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open
from torch import Tensor

from offload.checkpoint.atomic import MANIFEST, resolve
from offload.errors import OffloadConfigError

HF_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightSource:
    """Names, shapes and dtypes of every tensor at `path` (headers only), and `read(name)`."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._file_of: Dict[str, str] = {}
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, torch.dtype] = {}
        self._handles: Dict[str, object] = {}
        for file in _files_of(self.path):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    self._file_of[name] = file
                    self.shapes[name] = tuple(piece.get_shape())
                    self.dtypes[name] = _DTYPES.get(piece.get_dtype(), torch.float32)

    def names(self) -> List[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def read(self, name: str) -> Tensor:
        """One tensor, as stored (a CPU tensor backed by the mapped file until copied)."""
        file = self._file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, framework="pt")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._handles.clear()  # each handle unmaps its file when collected

    def __repr__(self) -> str:
        return f"WeightSource({self.path!r}, {len(self._file_of)} tensors)"


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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
