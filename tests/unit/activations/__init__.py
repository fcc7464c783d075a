"""The saved-tensor hooks on their own: what a forward saves, measured, and activations spilled to the swap
directory (offload/scheduler/activations/)."""
