"""The engine: `Engine` (engine.py) and its release (release.py)."""

from offload.engine.engine import Engine

__all__ = ["Engine"]
