"""The modes an engine runs in, each an object chosen once at placement (setup/placement.py), so the
phases never ask which tier or mode is active: disk traffic (none, or the nvme ring), gradient reduction
(local, or across data-parallel ranks) and clipping (none, or by the global norm)."""
