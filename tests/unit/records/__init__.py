"""The gradient homes on their own: accumulators, the gradient window, `.grad`'s stand-in, the backward
tracker and the non-finite skips (offload/scheduler/grads/)."""
