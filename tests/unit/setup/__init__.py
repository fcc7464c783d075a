"""Placement: which store, weight home, gradient home and modes a policy gives each group
(offload/scheduler/setup/)."""
