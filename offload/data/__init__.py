"""`offload.data`: token corpora on disk as training batches, leaving the host's cores and disk to the
optimizer. `TokenWindows` reads random windows through NVIDIA DALI when installed, else with pread;
`write_tokens` makes a token file; `python -m offload tokenize` makes one from text."""

from offload.data.token_files import open_token_files, write_tokens
from offload.data.token_windows import Backend, TokenWindows

__all__ = ["Backend", "TokenWindows", "open_token_files", "write_tokens"]
