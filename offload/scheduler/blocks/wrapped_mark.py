"""The attribute a wrapped model carries: a weak reference to its engine (`wrap()` refuses a model that has
one alive; `close()` and a deepcopy of the model remove it)."""

MARKER = "_offload_engine"
