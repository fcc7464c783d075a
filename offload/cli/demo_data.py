"""The demo's training data: text from a Markov chain, as a token file read through `offload.data`.

Each of the first 16 token ids is followed by one of four successors with fixed probabilities
(0.55, 0.25, 0.15, 0.05), so the best possible loss is the chain's entropy (about 1.11 nats) and a small GPT
falls smoothly from ln(vocab) past ln(16) toward it: a run visibly learning, unlike uniform random tokens (nothing to
learn) or a counting rule (learned in a few steps, after which every batch looks the same).
"""

from __future__ import annotations

import math
import os

import numpy as np

from offload.data import write_tokens

SUCCESSOR_PROBABILITIES = np.array([0.55, 0.25, 0.15, 0.05])
STATES = 16  # few enough that the demo's GPT learns the transitions within tens of steps, not hundreds
DEMO_TOKENS = 1 << 20  # the token file's length: `python -m offload demo --context` stays below it


def chain_entropy() -> float:
    """The loss of a model that knows the chain exactly (nats per token)."""
    p = SUCCESSOR_PROBABILITIES
    return float(-(p * np.log(p)).sum())


def markov_tokens(tokens: int, states: int, seed: int = 0, chains: int = 256) -> np.ndarray:
    """`tokens` ids from `chains` independent walks of one random chain over ids [0, states), concatenated."""
    rng = np.random.default_rng(seed)
    successors = np.stack([rng.choice(states, size=len(SUCCESSOR_PROBABILITIES), replace=False)
                           for _ in range(states)])
    length = math.ceil(tokens / chains)
    walks = np.empty((chains, length), dtype=np.int64)
    walks[:, 0] = rng.integers(0, states, size=chains)
    for t in range(1, length):
        pick = rng.choice(len(SUCCESSOR_PROBABILITIES), size=chains, p=SUCCESSOR_PROBABILITIES)
        walks[:, t] = successors[walks[:, t - 1], pick]
    return walks.reshape(-1)[:tokens]


def write_demo_tokens(directory: str, vocab: int, tokens: int = DEMO_TOKENS, seed: int = 0) -> str:
    """The demo's token file in `directory` (written once per vocabulary size); returns its path."""
    states = min(vocab, STATES)
    path = os.path.join(directory, f"markov-{states}-tokens.npy")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        write_tokens(path, markov_tokens(tokens, states, seed))
    return path
