"""`manifest.json`: what a checkpoint holds, written last, so its presence marks a complete checkpoint.

Keys: `format`/`version` (1: the optimizer file holds fp32 moments; 2: bf16 moments as bf16 values and int8 ones as
codes and per-parameter block scales; 3: `masters` names the parameters whose master weights the optimizer files
leave out, and where they come from: [Note: master weights stored once]; 4: data-parallel ranks' files hold their
parts of bf16 and int8 moments as they are kept, int8 blocks starting at each part's first element); `tier`, `compute_dtype` and `moments` (the Adam moments' format, "fp32" when
absent) of the engine that saved; `checksum` (the algorithm);
`step`, `skipped_steps`; `param_groups` (hyperparameters without the params); `blocks` (per block, per
flat group: dtype and each parameter's name, shape, element offset, trainable flag and Adam step count);
`tied` (alias name -> stored name); `files` (per file: size, and per tensor its checksum and block);
`scheduler`, `data`, `rng` (file names or null).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from offload.checkpoint.atomic import MANIFEST
from offload.errors import OffloadIntegrityError

FORMAT = "offload-checkpoint"
VERSION = 4  # the newest this offload reads (what each adds: the module docstring, version_for)
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
DATA_FILE = "data.pt"
# objects saved beside the engine through their state_dict(): the keyword (and manifest key) -> file
STATEFUL_FILES = {"scheduler": SCHEDULER_FILE, "data": DATA_FILE}


def version_for(moments: str, derived_masters: bool, parts: bool = False) -> int:
    """The format version a checkpoint of these moments needs: an older offload refuses a version-2 file (its
    uint8 or bf16 moment entries), a version-3 one (masters it would look for in vain in the optimizer files) or a
    version-4 one (ranks' parts it would read as fp32) with "upgrade offload" instead of misreading it."""
    if parts and moments != "fp32":
        return 4
    if derived_masters:
        return 3
    return 1 if moments == "fp32" else 2


def write_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    path = os.path.join(directory, MANIFEST)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise OffloadIntegrityError(f"{path!r} is missing: not a complete offload checkpoint", path) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OffloadIntegrityError(f"{path!r} is damaged ({exc})", path) from None
    if manifest.get("format") != FORMAT:
        raise OffloadIntegrityError(f"{path!r} is not an offload checkpoint manifest", path)
    if manifest.get("version", 0) > VERSION:
        raise OffloadIntegrityError(f"{path!r} has format version {manifest.get('version')}; this offload reads "
                                    f"up to {VERSION}: upgrade offload", path)
    return manifest


def jsonable_group(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's hyperparameters that survive JSON (numbers, strings, bools, lists of them)."""
    out: Dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            out[key] = list(value)
    return out
