"""The optional dependencies the Hugging Face integrations need, imported on first use: a missing one is a
`MissingDependencyError` naming the install command, raised where the integration is used, never at `import
offload`."""

from __future__ import annotations

from typing import Any, Tuple

from offload.errors import OffloadConfigError

INSTALL = 'pip install transformers accelerate  (or pip install "offload[hf]")'


class MissingDependencyError(OffloadConfigError, ImportError):
    """transformers or accelerate is not installed: an OffloadConfigError that is also an ImportError."""


def require_transformers() -> Tuple[Any, Any]:
    """(transformers, accelerate), imported; MissingDependencyError naming the install command otherwise."""
    try:
        import accelerate
        import transformers
    except ImportError as error:
        raise MissingDependencyError(f"offload.integrations.transformers needs transformers and accelerate "
                                     f"({error}): {INSTALL}") from error
    return transformers, accelerate
