"""Optimizers that run on the host: the fused CPU Adam and the flat-buffer step the engine calls."""

from offload.optim.cpu_adam import CPUAdam
from offload.optim.functional import adam_step_flat, sum_of_squares

__all__ = ["CPUAdam", "adam_step_flat", "sum_of_squares"]
