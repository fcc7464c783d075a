"""Checkpoints: atomic, streamed, name-keyed save and load of an engine of any tier (docs/design.md, "Checkpoints")."""

from offload.checkpoint.reader import load_checkpoint
from offload.checkpoint.writer import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
