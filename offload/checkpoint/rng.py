"""RNG states (torch CPU and CUDA, Python's `random`, NumPy's global generator) as weights_only-loadable data."""

from __future__ import annotations

import random
from typing import Any, Dict, Tuple, cast

import numpy as np
import torch


def capture() -> Dict[str, Any]:
    np_state = cast(Tuple[Any, ...], np.random.get_state())  # legacy form: (name, keys, pos, gauss?, gauss)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
