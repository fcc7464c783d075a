"""The state stores on their own: the `StateStore` protocol kept by each store, and the AdamW loop over them
(offload/scheduler/state/)."""
