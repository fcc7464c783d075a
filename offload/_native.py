"""Import the native core `offload._C` once, keeping the reason when it is unavailable.

Everything in offload works without `_C` through pure-PyTorch fallbacks; `import offload` warns once when
that happens, and `python -m offload doctor` prints the reason (usually the build or import error).
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Optional

_C: Optional[ModuleType]
try:
    from offload import _C

    _IMPORT_ERROR: Optional[str] = None
except ImportError as exc:  # the extension was not built, or failed to load (e.g. a missing symbol)
    _C = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def native_available() -> bool:
    """Whether the compiled core `offload._C` was imported."""
    return _C is not None


def native_import_error() -> Optional[str]:
    """Why `offload._C` could not be imported, or None when it was."""
    return _IMPORT_ERROR


def warn_if_unavailable() -> None:
    """Say once, at import, that the pure-PyTorch fallbacks are in use and how to find out why."""
    if _C is None:
        warnings.warn(
            "offload: the native core offload._C is unavailable "
            f"({_IMPORT_ERROR}); using slower pure-PyTorch fallbacks. "
            "Run `python -m offload doctor` for details, or reinstall with `pip install -v .` to see the build.",
            RuntimeWarning,
            stacklevel=3,
        )
