"""The scheduler: blocks, hooks, streams and the step pipeline. Internal: the public API is offload.wrap."""
